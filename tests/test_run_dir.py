"""The training run folder (tdlm/training/run_dir.py) and run-config validation: what a launch refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tdlm.config import from_dict, load_config, to_dict
from tdlm.errors import TDLMError
from tdlm.tracking import Tracker, read_metrics
from tdlm.training import RunConfig
from tdlm.training.ds_config import load_ds_json
from tdlm.training.loop import preflight_config
from tdlm.training.run_dir import (
    RunLock,
    check_run_dir,
    newest_verified_tag,
    verify_checksums,
    write_checksums,
)

REPO = Path(__file__).resolve().parents[1]
Z3 = REPO / "ds_configs" / "zero3.json"
TINY = ["model.backbone=tiny-llada", "model.layers=dispersed:2", "model.heads=2", "model.head_dim=16"]


def _run(out: Path, **sections) -> RunConfig:
    raw = {"output_dir": str(out), "model": {"backbone": "tiny-llada", "layers": "dispersed:2", "heads": 2,
                                             "head_dim": 16}}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return from_dict(RunConfig, raw)


def _existing_run(out: Path, run: RunConfig, world: int = 2) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(json.dumps(to_dict(run)))
    (out / "ds_config.json").write_text(json.dumps({"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4,
                                                    "gradient_accumulation_steps": 1}))


# -- item 3: resume compares the recipe; finished runs; torn metrics; non-empty folders ---------------
def test_resume_refuses_a_changed_recipe_naming_each_field(tmp_path):
    out = tmp_path / "run"
    old = _run(out, optim={"lr": 1e-3}, train={"micro_batch_size": 4, "seed": 0})
    _existing_run(out, old)
    assert check_run_dir(old, resume=True, allow_recipe_change=False, world_size=2) == "resume"
    new = _run(out, optim={"lr": 2e-3}, train={"micro_batch_size": 2, "seed": 1})
    with pytest.raises(TDLMError) as info:
        check_run_dir(new, resume=True, allow_recipe_change=False, world_size=4)
    msg = str(info.value)
    for part in ("optim.lr: 0.001 -> 0.002", "train.micro_batch_size: 4 -> 2", "train.seed: 0 -> 1",
                 "world size: 2 -> 4", "--allow-recipe-change"):
        assert part in msg, msg
    assert check_run_dir(new, resume=True, allow_recipe_change=True, world_size=4) == "resume"
    # what does not change the recipe may change
    logged = _run(out, optim={"lr": 1e-3}, train={"micro_batch_size": 4, "seed": 0, "log_every": 5, "save_every": 3})
    assert check_run_dir(logged, resume=True, allow_recipe_change=False, world_size=2) == "resume"


def test_a_finished_run_resumed_is_a_no_op(tmp_path):
    out, traj = tmp_path / "run", tmp_path / "traj"
    run = _run(out, train={"max_steps": 10}, data={"trajectories": str(traj)})
    _existing_run(out, run)
    (out / "summary.json").write_text(json.dumps({"steps": 10, "final_loss": 1.5}))
    assert check_run_dir(run, resume=True, allow_recipe_change=False, world_size=2) == "finished"
    before = (out / "summary.json").read_bytes()
    env = os.environ | {"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "launcher" / "train.py"), "--ds", str(Z3), "--resume",
                           "--output-dir", str(out), "train.max_steps=10", f"data.trajectories={traj}", *TINY],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "finished at step 10" in proc.stdout and "nothing to resume" in proc.stdout
    assert (out / "summary.json").read_bytes() == before
    assert not traj.exists()


def test_a_non_empty_folder_without_resume_is_refused(tmp_path):
    out = tmp_path / "run"
    run = _run(out)
    assert check_run_dir(run, resume=False, allow_recipe_change=False, world_size=2) == "fresh"
    _existing_run(out, run)
    with pytest.raises(TDLMError, match=rf"{out} already holds a training run \(run_config.json\): continue it "
                                        r"with --resume, or train into another --output-dir"):
        check_run_dir(run, resume=False, allow_recipe_change=False, world_size=2)
    with pytest.raises(TDLMError, match="holds no run"):
        check_run_dir(_run(tmp_path / "empty"), resume=True, allow_recipe_change=False, world_size=2)


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert "dropping a torn last line" in capsys.readouterr().err
    tracker = Tracker(tmp_path, "p", None, None, {}, mode="disabled")
    tracker.truncate(1)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n'
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(TDLMError, match="metrics.jsonl line 2: not JSON"):
        read_metrics(path)


# -- item 4: one writer per run folder; ranks agree on the tag --------------------------------------
def test_a_second_run_on_a_locked_folder_fails_at_once_with_the_holder(tmp_path):
    lock = RunLock(tmp_path / "run")
    code = ("import sys; from tdlm.training.run_dir import RunLock\n"
            f"try:\n    RunLock({str(tmp_path / 'run')!r})\nexcept Exception as e:\n    print(e); sys.exit(3)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 3 and f"pid {os.getpid()}" in proc.stdout, proc.stdout + proc.stderr
    lock.release()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stdout  # released: the next run may take it


def test_the_launcher_refuses_a_folder_another_run_holds(tmp_path):
    out = tmp_path / "run"
    run = _run(out, data={"trajectories": str(tmp_path / "traj")})
    _existing_run(out, run)
    lock = RunLock(out)
    env = os.environ | {"OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, str(REPO / "launcher" / "train.py"), "--ds", str(Z3), "--resume",
                           "--output-dir", str(out), f"data.trajectories={tmp_path / 'traj'}", *TINY],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    lock.release()
    assert proc.returncode == 2 and f"another training run is writing this folder (pid {os.getpid()}" in proc.stderr


class _Engine:
    def __init__(self) -> None:
        self.tag = None

    def load_checkpoint(self, path, tag=None, load_module_strict=True):
        self.tag = tag
        return path, {"step": int(tag.split("-")[1]), "config": {}}


def _rank(rank: int, world: int, port: int, dirs: list[str], out: list) -> None:
    import torch.distributed as dist

    from tdlm.training.checkpoint import load_checkpoint
    from tdlm.training.session import Session

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    run = _run(Path(dirs[rank]))
    sess = Session(run, {}, _Engine(), None, None, torch.device("cpu"), rank, world, None, allow_recipe_change=True)
    try:
        step = load_checkpoint(sess)
        out.append((rank, sess.engine.tag, step))
    except TDLMError as e:
        out.append((rank, "error", str(e)))
    dist.destroy_process_group()


def _fake_checkpoint(run_dir: Path, steps: list[int], sums: bool = True) -> None:
    for s in steps:
        tag = run_dir / "checkpoints" / f"step-{s}"
        tag.mkdir(parents=True)
        (tag / "mp_rank_00_model_states.pt").write_bytes(os.urandom(64))
        if sums:
            write_checksums(tag)


def test_ranks_load_the_tag_rank_0_chose(tmp_path):
    # Rank 1 sees a folder whose newest checkpoint is older (e.g. a lagging shared file system view):
    # every rank must still load rank 0's choice.
    a, b = tmp_path / "a", tmp_path / "b"
    _fake_checkpoint(a, [8, 16])
    _fake_checkpoint(b, [8])
    with mp.Manager() as m:
        out = m.list()
        port = 29000 + os.getpid() % 1000
        mp.spawn(_rank, args=(2, port, [str(a), str(b)], out), nprocs=2, join=True)
        got = sorted(out)
    assert got == [(0, "step-16", 16), (1, "step-16", 16)], got


# -- item 7: checkpoint checksums -------------------------------------------------------------------
def test_checkpoint_files_are_verified_before_loading(tmp_path):
    run = tmp_path / "run"
    _fake_checkpoint(run, [8, 16])
    ckpt = run / "checkpoints"
    assert newest_verified_tag(ckpt) == "step-16"
    f = ckpt / "step-16" / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    data[10] ^= 0xFF  # same size, one byte
    f.write_bytes(bytes(data))
    with pytest.raises(TDLMError, match="mp_rank_00_model_states.pt: sha256 differs from SHA256SUMS.json"):
        newest_verified_tag(ckpt)
    (ckpt / "step-8" / "evil.pt").write_bytes(b"x")
    with pytest.raises(TDLMError, match="evil.pt: not listed in SHA256SUMS.json"):
        verify_checksums(ckpt / "step-8")
    # a save that never finished (no checksums yet) is skipped for the previous complete one
    (ckpt / "step-8" / "evil.pt").unlink()
    _fake_checkpoint(run, [24], sums=False)
    (ckpt / "step-16" / "SHA256SUMS.json").unlink()
    assert newest_verified_tag(ckpt) == "step-8"


# -- item 6: every field before any work; numeric strings; DS JSON errors name file and field -------
def test_numeric_strings_are_accepted_for_float_fields(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optim:\n  lr: 3e-3\n  eps: 1e-8\n")  # YAML 1.1 reads these as strings
    run = load_config(RunConfig, cfg)
    assert run.optim.lr == 0.003 and run.optim.eps == 1e-8
    with pytest.raises(TDLMError, match="optim.lr: expected a number; got 'fast'"):
        from_dict(RunConfig, {"optim": {"lr": "fast"}})


@pytest.mark.parametrize("override,pattern", [
    ("train.log_every=0", r"train.log_every must be >= 1; got 0"),
    ("optim.lr=-1", r"optim.lr must be > 0"),
    ("optim.min_lr_ratio=2", r"optim.min_lr_ratio must be in \[0, 1\]"),
    ("train.save_every=-1", r"train.save_every must be >= 0"),
    ("data.states=0", r"data.states must be >= 1"),
    ("model.alignment=left", r"model.alignment must be prediction or input"),
])
def test_every_field_is_checked_before_work(tmp_path, override, pattern):
    run = _run(tmp_path / "run")
    from tdlm.config import apply_overrides

    run = from_dict(RunConfig, apply_overrides(to_dict(run), [override]), "my.yaml")
    with pytest.raises(TDLMError, match="my.yaml: " + pattern):
        preflight_config(run, load_ds_json(Z3), 2, False, "my.yaml", str(Z3))


@pytest.mark.parametrize("mutate,pattern", [
    (lambda d: d["zero_optimization"].update(stage="three"),
     r"zero_optimization.stage must be 0, 1, 2 or 3; got 'three'"),
    (lambda d: d.update(bf16={"enabled": "yes"}), r"bf16.enabled must be true, false or \"auto\"; got 'yes'"),
    (lambda d: d["zero_optimization"].update(reduce_bucket_size="big"), r"zero_optimization.reduce_bucket_size must"),
    (lambda d: d.update(optimizer="AdamW"), r"optimizer must be an object"),
])
def test_ds_json_errors_name_file_and_field(tmp_path, mutate, pattern):
    raw = load_ds_json(Z3)
    mutate(raw)
    path = tmp_path / "bad_ds.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(TDLMError, match=rf"{path}: " + pattern):
        preflight_config(_run(tmp_path / "run"), load_ds_json(path), 2, False, "my.yaml", str(path))


def test_bad_fields_fail_before_the_default_trajectories_are_generated(tmp_path):
    # The embedded default generates runs/tiny/trajectories on first use: a bad field must fail first.
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(REPO / "launcher" / "train.py"), "--ds", str(Z3),
                           "train.log_every=0"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and "train.log_every must be >= 1" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()
    # a typo in data.trajectories is an error, not a new teacher set at the typo's path
    typo = tmp_path / "runs" / "tiny" / "trajectoires"
    proc = subprocess.run([sys.executable, str(REPO / "launcher" / "train.py"), "--ds", str(Z3),
                           f"data.trajectories={typo}"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 2 and f"data.trajectories: {typo} does not exist" in proc.stderr, proc.stderr[-2000:]
    assert not typo.exists()
