"""DeepSpeed training: real launches with 2 CPU ranks (slow), plus preflight checks in-process."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tdlm
from tdlm.config import apply_overrides, from_dict, load_yaml
from tdlm.data.store import write_manifest
from tdlm.data.trajectories import TrajectoryRecord, write_parquet
from tdlm.decoding import decode
from tdlm.tasks.base import default_data_dir
from tdlm.training import lr_lambda, preflight
from tdlm.training.config import RunConfig
from tdlm.training.ds_config import load_ds_json, resolve_ds_config
from tests.log_checks import OUR_TRACEBACK

REPO = Path(__file__).resolve().parents[1]
STEPS = 24
# configs/tiny.yaml is the shipped tiny-arith default; these tests train on the random tiny-llada preset.
TINY_LLADA = ("model.backbone=tiny-llada", "model.layers=dispersed:2", "model.heads=2", "model.head_dim=16",
              "optim.warmup_steps=5")


def make_trajectories(folder: Path, backbone: str = "tiny-llada", n: int = 48, shards: int = 2) -> Path:
    bb = tdlm.load_backbone(backbone)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, 100, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    res = decode(bb, prompts, policy="original", gen_length=16, block_size=8)
    recs = [TrajectoryRecord.from_decode(r, f"toy:{i}", f"toy prompt {i}", backbone, {"policy": "original"})
            for i, r in enumerate(res)]
    per = n // shards
    for s in range(shards):
        write_parquet(recs[s * per:(s + 1) * per], folder / f"shard-{s:05d}.parquet")
    write_manifest(folder, backbone, {"decode": {"policy": "original"}})
    return folder


@pytest.fixture(scope="module")
def traj_dir(tmp_path_factory) -> Path:
    return make_trajectories(tmp_path_factory.mktemp("traj"))


def _ds_json(tmp: Path, name: str, stage: int) -> Path:
    raw = load_ds_json(REPO / "ds_configs" / name)
    # Toy parameters sit under the persistence threshold: force real partitioning at stage 3.
    if stage == 3:
        raw["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = tmp / f"test_{name}"
    path.write_text(json.dumps(raw))
    return path


def _launch(ds: Path, traj: Path, out: Path, *extra: str, background: bool = False, steps: int = STEPS):
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
                        "DS_ACCELERATOR": "cpu"}
    port = str(29500 + os.getpid() % 1000)
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", port,
           str(REPO / "launcher" / "train.py"), "--ds", str(ds), "--config", str(REPO / "configs" / "tiny.yaml"),
           "--output-dir", str(out), "--max-steps", str(steps), f"data.trajectories={traj}", "train.save_every=8",
           *TINY_LLADA, "data.states=4", "train.micro_batch_size=4",
           "train.verify_frozen=true", "train.verify_export=true", *extra]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if background:
        return proc
    rc = proc.wait(timeout=900)
    assert rc == 0, out.with_suffix(".log").read_text()[-4000:]
    return proc


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, traj_dir) -> Path:
    tmp = tmp_path_factory.mktemp("z3")
    out = tmp / "run"
    _launch(_ds_json(tmp, "zero3.json", 3), traj_dir, out)
    return out


@pytest.mark.slow
def test_zero3_trains_and_exports(zero3_run):
    losses = _losses(zero3_run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = sum(losses[s] for s in range(1, 5)) / 4, sum(losses[s] for s in range(STEPS - 3, STEPS + 1)) / 4
    assert last < first - 0.05, losses
    summary = json.loads((zero3_run / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and summary["world_size"] == 2
    assert summary["checks"]["frozen_backbone_unchanged"] is True
    assert summary["checks"]["export_max_abs_diff"] < 1e-4
    ds = json.loads((zero3_run / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 8 and ds["activation_checkpointing"] is not None
    adapter = tdlm.TDLM.from_adapter(tdlm.load_backbone("tiny-llada"), zero3_run / "adapter")
    assert adapter.layer_ids == [1, 3]
    assert any(torch.count_nonzero(m.o_proj.weight) > 0 for m in adapter.temporal.values())
    assert list((zero3_run / "wandb").glob("offline-run-*"))
    # the W&B config records the adapter's size (it said 0 once: ZeRO-3 had partitioned the parameters)
    count = adapter.num_temporal_parameters()
    assert summary["temporal_parameters"] == count > 0
    (wb,) = (zero3_run / "wandb").glob("offline-run-*/run-*.wandb")
    assert f'"temporal_parameters":{count}'.encode() in wb.read_bytes()  # the config record's compact JSON


@pytest.mark.slow
def test_zero2_matches_zero3(tmp_path, traj_dir, zero3_run):
    out = tmp_path / "run"
    _launch(_ds_json(tmp_path, "zero2.json", 2), traj_dir, out)
    a, b = _losses(zero3_run), _losses(out)
    assert a[1] == pytest.approx(b[1], rel=1e-6)  # same data, same initial weights
    # Later steps: the stages reduce gradients in different orders, and Adam's g / (sqrt(v) + eps)
    # amplifies that rounding for near-zero gradient entries (measured: <= 1.1e-3 relative by step 6).
    for s in a:
        assert abs(a[s] - b[s]) <= 5e-3 * abs(a[s]), (s, a[s], b[s])


def _wait_for_step(out: Path, proc, step: int, timeout: float = 600) -> None:
    """Until ``step`` updates are in metrics.jsonl (complete lines only: rank 0 may be mid-write)."""
    deadline = time.time() + timeout
    path = out / "metrics.jsonl"
    while not path.exists() or path.read_text().count("\n") < step:
        assert proc.poll() is None and time.time() < deadline, out.with_suffix(".log").read_text()[-3000:]
        time.sleep(0.2)


def _wait_ranks_gone(out: Path, proc, timeout: float = 120) -> int:
    """The runner's exit status, once every rank of ``out`` has exited too (Ctrl-C ends the runner first)."""
    rc = proc.wait(timeout=timeout)
    deadline = time.time() + timeout
    while _rank_pids(out):
        assert time.time() < deadline, "ranks still running"
        time.sleep(0.2)
    return rc


def _stop_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "resume with --resume" in line]


@pytest.mark.slow
def test_ctrl_c_and_preemption_then_resume_match_uninterrupted(tmp_path, traj_dir, zero3_run):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it), then SIGUSR1 to rank 1 alone (Slurm's
    --signal): each time every rank stops after the same update, checkpoints and exits with one line; two resumes
    then give the uninterrupted run's metrics and adapter bit for bit, in one W&B run. A checkpoint folder left
    half-written (as a SIGKILL mid-save leaves it) is skipped by the last resume."""
    from safetensors.torch import load_file

    from tdlm.training.run_dir import EXIT_PREEMPTED, verify_checksums

    ds = _ds_json(tmp_path, "zero3.json", 3)
    out = tmp_path / "run"
    log_path = out.with_suffix(".log")
    proc = _launch(ds, traj_dir, out, background=True)
    _wait_for_step(out, proc, 3)
    os.killpg(proc.pid, signal.SIGINT)
    _wait_ranks_gone(out, proc)
    log = log_path.read_text()
    (line,) = _stop_lines(log)
    m = re.fullmatch(r"interrupted at step (\d+) \(SIGINT; checkpoint (.*)\); resume with --resume", line.strip())
    assert m, line
    first = int(m.group(1))
    assert 3 <= first < 8 and Path(m.group(2)) == out / "checkpoints" / f"step-{first}"
    verify_checksums(Path(m.group(2)))
    assert not OUR_TRACEBACK.search(log) and "gloo" not in log, log[-3000:]
    assert not (out / "summary.json").exists()

    # SIGUSR1 to one rank only: both agree at the next boundary; the exit status reaches the `deepspeed` command
    proc = _launch(ds, traj_dir, out, "--resume", background=True)
    _wait_for_step(out, proc, first + 3)
    ranks = sorted(_rank_pids(out))
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGUSR1)
    assert _wait_ranks_gone(out, proc) == EXIT_PREEMPTED
    log = log_path.read_text()
    assert [line for line in log.splitlines() if line.startswith("resuming from step")] == [
        f"resuming from step {first} ({out / 'checkpoints' / f'step-{first}'}; W&B run "
        f"{json.loads((out / 'wandb_run.json').read_text())['id']})"]
    (line,) = _stop_lines(log)
    m = re.fullmatch(r"preempted at step (\d+) \(SIGUSR1; checkpoint .*\); resume with --resume", line.strip())
    assert m, line
    second = int(m.group(1))
    assert second >= first + 3
    assert not OUR_TRACEBACK.search(log) and "gloo" not in log, log[-3000:]
    torn = out / "checkpoints" / f"step-{second + 1}"  # a save that never finished: no SHA256SUMS.json
    torn.mkdir()
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"partial")

    _launch(ds, traj_dir, out, "--resume")
    assert f"resuming from step {second} " in log_path.read_text()
    ref, got = _losses(zero3_run), _losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == second
    for s in range(1, STEPS + 1):
        assert got[s] == ref[s], (s, got[s], ref[s])  # bit-identical (MKL_CBWR, same data order, same state)
    a, b = load_file(zero3_run / "adapter" / "adapter.safetensors"), load_file(out / "adapter" / "adapter.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # one W&B run across the three launches, and how each launch ended
    record = json.loads((out / "wandb_run.json").read_text())
    assert [(e["state"], e["step"], e.get("signal"), e["exit_code"]) for e in record["exits"]] == [
        ("interrupted", first, "SIGINT", EXIT_PREEMPTED), ("preempted", second, "SIGUSR1", EXIT_PREEMPTED),
        ("finished", STEPS, None, 0)]
    runs = sorted((out / "wandb").glob(f"offline-run-*-{record['id']}"))
    assert len(runs) == 3 and len(list((out / "wandb").glob("offline-run-*"))) == 3
    first_launch = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"stopped_at_step" in first_launch and b"interrupted" in first_launch  # written although Ctrl-C


@pytest.mark.slow
def test_zero3_trains_latent_history(tmp_path, traj_dir):
    """``model.history=latent:M`` trains through the same launcher (states evaluated in order)."""
    out = tmp_path / "run"
    _launch(_ds_json(tmp_path, "zero3.json", 3), traj_dir, out, "model.history=latent:2", "model.perceiver_heads=1",
            steps=6)  # fmt: skip
    assert sorted(_losses(out)) == list(range(1, 7))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checks"]["frozen_backbone_unchanged"] is True
    assert summary["checks"]["export_max_abs_diff"] < 1e-4
    adapter = tdlm.TDLM.from_adapter(tdlm.load_backbone("tiny-llada"), out / "adapter")
    assert str(adapter.policy) == "latent:2" and adapter.num_latents == 2
    mods = list(adapter.temporal.values())
    assert all(m.memory.perceiver.heads == 1 for m in mods)
    assert any(torch.count_nonzero(m.o_proj.weight) > 0 for m in mods)  # W_O starts at zero: it trained


# -- preflight: bad input, one clear error each -------------------------------------------------------
def _run(traj: Path, *overrides: str) -> RunConfig:
    raw = apply_overrides(load_yaml(REPO / "configs" / "tiny.yaml"),
                          [f"data.trajectories={traj}", *TINY_LLADA, "data.states=4", "train.micro_batch_size=4",
                           *overrides])
    return from_dict(RunConfig, raw, "configs/tiny.yaml")


def test_preflight_accepts_the_tiny_config(traj_dir):
    ds = preflight(_run(traj_dir), load_ds_json(REPO / "ds_configs" / "zero3.json"), 2, on_gpu=False)
    assert ds["train_batch_size"] == 8 and ds["bf16"]["enabled"] is False
    assert ds["optimizer"]["params"]["torch_adam"] is True


def test_preflight_refuses_evaluation_problems_as_teacher_prompts(tmp_path):
    gsm8k = [json.loads(line)["question"] for line in
             (default_data_dir() / "gsm8k_test.jsonl").read_text().splitlines()[:3]]
    traj = make_trajectories(tmp_path / "traj", n=8, shards=1)
    from tdlm.data.trajectories import read_parquet

    recs = read_parquet(traj / "shard-00000.parquet")
    for r, q in zip(recs, gsm8k, strict=False):
        r.prompt_text = q  # three teacher prompts are GSM8K test problems
    write_parquet(recs, traj / "shard-00000.parquet")
    write_manifest(traj, "tiny-llada", {})
    z3 = load_ds_json(REPO / "ds_configs" / "zero3.json")
    with pytest.raises(tdlm.TDLMError, match=r"3 of 8 teacher prompts are gsm8k test problems.*allow_eval_prompts"):
        preflight(_run(traj), z3, 2, False)
    preflight(_run(traj, "data.allow_eval_prompts=true"), z3, 2, False)


def test_preflight_errors(tmp_path, traj_dir):
    z3 = load_ds_json(REPO / "ds_configs" / "zero3.json")
    with pytest.raises(tdlm.TDLMError, match="does not exist"):
        preflight(_run(tmp_path / "missing"), z3, 2, False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(tdlm.TDLMError, match="no shard-"):
        preflight(_run(tmp_path / "empty"), z3, 2, False)
    with pytest.raises(tdlm.TDLMError, match=r"out of range .* \(valid: 0..3\)"):
        preflight(_run(traj_dir, "model.layers=[1, 9]"), z3, 2, False)
    with pytest.raises(tdlm.TDLMError, match="backbone_id='tiny-llada' but training backbone is 'tiny-dream'"):
        preflight(_run(traj_dir, "model.backbone=tiny-dream", "model.layers=middle:2"), z3, 2, False)
    bad = copy.deepcopy(z3)
    bad["zero_optimization"]["stage"] = 2
    with pytest.raises(tdlm.TDLMError, match="stage=2 contradicts train.zero_stage=3"):
        preflight(_run(traj_dir, "train.zero_stage=3"), bad, 2, False)
    bad = copy.deepcopy(z3)
    bad["train_batch_size"] = 16
    with pytest.raises(tdlm.TDLMError, match="train_batch_size=16 contradicts"):
        preflight(_run(traj_dir), bad, 2, False)
    bad = copy.deepcopy(z3)
    bad["train_micro_batch_size_per_gpu"] = 2
    with pytest.raises(tdlm.TDLMError, match="train_micro_batch_size_per_gpu=2 contradicts"):
        preflight(_run(traj_dir), bad, 2, False)
    with pytest.raises(tdlm.TDLMError, match="unknown key"):
        _run(traj_dir, "train.max_stpes=3")
    with pytest.raises(tdlm.TDLMError, match="expected an integer"):
        _run(traj_dir, "train.max_steps=many")


def test_training_requires_a_complete_verified_manifest(tmp_path):
    z3 = load_ds_json(REPO / "ds_configs" / "zero3.json")
    traj = make_trajectories(tmp_path / "traj", n=16, shards=2)
    preflight(_run(traj), z3, 2, False)
    manifest = json.loads((traj / "manifest.json").read_text())
    # generation still running: 8 of 16 prompts finished
    running = manifest | {"status": "running", "num_prompts": 16,
                          "shards": {"shard-00000.parquet": manifest["shards"]["shard-00000.parquet"]}}
    (traj / "manifest.json").write_text(json.dumps(running))
    with pytest.raises(tdlm.TDLMError, match=r"generation is not finished \(status 'running': 8 of 16 prompts"):
        preflight(_run(traj), z3, 2, False)
    # a shard changed after generation, same size: one byte flipped
    (traj / "manifest.json").write_text(json.dumps(manifest))
    shard = traj / "shard-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(tdlm.TDLMError, match="shard-00001.parquet: sha256 differs from manifest.json"):
        preflight(_run(traj), z3, 2, False)
    (traj / "manifest.json").unlink()
    with pytest.raises(tdlm.TDLMError, match="has no manifest.json"):
        preflight(_run(traj), z3, 2, False)


def test_foreign_vocab_is_rejected(tmp_path):
    rec = TrajectoryRecord("x", [3, 4], [500, 11], [1, 2], 2, backbone_id="tiny-llada")
    write_parquet([rec] * 8, tmp_path / "shard-00000.parquet")
    write_manifest(tmp_path, "tiny-llada", {})
    with pytest.raises(tdlm.TDLMError, match="token id 500 outside the backbone's vocabulary of 128"):
        preflight(_run(tmp_path), load_ds_json(REPO / "ds_configs" / "zero3.json"), 2, False)
    rec = TrajectoryRecord("x", [3, 4], [2, 11], [1, 2], 2, backbone_id="tiny-llada")
    write_parquet([rec] * 8, tmp_path / "shard-00000.parquet")
    write_manifest(tmp_path, "tiny-llada", {})
    with pytest.raises(tdlm.TDLMError, match="mask id 2"):
        preflight(_run(tmp_path), load_ds_json(REPO / "ds_configs" / "zero3.json"), 2, False)


def test_launcher_prints_one_line_error(tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, str(REPO / "launcher" / "train.py"), "--ds",
                           str(REPO / "ds_configs" / "zero3.json"), "--config", str(REPO / "configs" / "tiny.yaml"),
                           f"data.trajectories={tmp_path / 'nope'}", f"output_dir={tmp_path / 'run'}", *TINY_LLADA],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: data.trajectories:") and "Traceback" not in proc.stderr


def test_lr_schedule():
    assert lr_lambda(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(55, 10, 100, 0.1) == pytest.approx(0.55)


def test_resolved_ds_config_zero3_offload():
    run = from_dict(RunConfig, {}, "x")
    cfg = resolve_ds_config(load_ds_json(REPO / "ds_configs" / "zero3_offload.json"), run, 8, on_gpu=True)
    assert cfg["bf16"]["enabled"] is True and "torch_adam" not in cfg["optimizer"]["params"]
    assert cfg["train_batch_size"] == 4 * 8


@pytest.mark.slow
def test_checkpoints_carry_checksums_and_the_logged_lr_is_the_one_used(zero3_run):
    from tdlm.training import lr_lambda
    from tdlm.training.run_dir import SUMS, verify_checksums

    tags = sorted((zero3_run / "checkpoints").glob("step-*"))
    assert [t.name for t in tags] == ["step-16", "step-24"]  # train.keep_last=2: step-8 went once step-24 verified
    assert (zero3_run / "checkpoints" / "latest").read_text() == "step-24"
    for tag in tags:
        assert (tag / SUMS).exists()
        verify_checksums(tag)
    recs = {r["step"]: r for r in map(json.loads, (zero3_run / "metrics.jsonl").read_text().splitlines())}
    o = json.loads((zero3_run / "run_config.json").read_text())["optim"]
    # update u (1-based) uses lr * lr_lambda(u - 1): linear warm-up, then cosine to min_lr_ratio
    for step in (1, 2, o["warmup_steps"] + 1, STEPS):
        want = o["lr"] * lr_lambda(step - 1, o["warmup_steps"], STEPS, o["min_lr_ratio"])
        assert recs[step]["lr"] == pytest.approx(want, rel=1e-9), step


def _rank_pids(out: Path) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "launcher/train.py" in cmd and "--local_rank" in cmd and str(out) in cmd:
            pids.append(int(p.name))
    return pids


@pytest.mark.slow
def test_ranks_stop_when_the_launcher_is_killed(tmp_path, traj_dir):
    import signal
    import time

    out = tmp_path / "run"
    # ds_configs/zero3.json as shipped: its persistence threshold is where the W&B config once recorded 0 parameters
    proc = _launch(REPO / "ds_configs" / "zero3.json", traj_dir, out, background=True, steps=100000)
    try:
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, out.with_suffix(".log").read_text()[-3000:]
            time.sleep(1)
        ranks = _rank_pids(out)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)  # only the `deepspeed` runner
        deadline = time.time() + 60
        while _rank_pids(out) and time.time() < deadline:
            time.sleep(1)
        assert not _rank_pids(out), "ranks kept running after the launcher died"
        log = out.with_suffix(".log").read_text()
        # the W&B config records the adapter's size: 2 layers x (4 x 64 x 32 + 1); ZeRO-3 once made it 0
        (wb,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
        assert b'"temporal_parameters":16386}' in wb.read_bytes()
        assert "is gone; stopping rank" in log
        # ... and they stopped as if preempted (the watcher's SIGTERM): together, with a verified checkpoint
        from tdlm.training.run_dir import verify_checksums

        (line,) = _stop_lines(log)
        m = re.fullmatch(r"preempted at step (\d+) \(SIGTERM; checkpoint (.*)\); resume with --resume", line.strip())
        assert m, line
        verify_checksums(Path(m.group(2)))
        assert not OUR_TRACEBACK.search(log) and "gloo" not in log, log[-3000:]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
