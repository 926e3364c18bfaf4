"""The on-policy job end to end (real local Ray cluster, real DeepSpeed launches): a job killed in each phase of a
round (records, mix, train, sync) and rerun each time ends with exactly the records, mix and adapter of an
uninterrupted job, every shard written once, and the round and adapter version on every logged point."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import tdlm
from tdlm.data.store import write_manifest
from tdlm.data.trajectories import write_parquet
from tdlm.decoding.config import DecodeSettings
from tdlm.generation.worker import ShardTask, ShardWorker, WorkerSpec
from tdlm.onpolicy.job import KILL_ENV

REPO = Path(__file__).resolve().parents[1]
GEN = 24


@pytest.fixture(scope="module")
def round0(tmp_path_factory) -> dict:
    """Round 0 given: 8 teacher trajectories of tiny-multi (`original`, 24 tokens) and an adapter of the recipe's
    layout with a nonzero W_O, so the round-1 student differs from the teacher."""
    d = tmp_path_factory.mktemp("round0")
    texts = [json.loads(x)["question"] for x in (REPO / "data" / "multi_prompts.jsonl").read_text().splitlines()[:8]]
    spec = WorkerSpec("tiny-multi", DecodeSettings(policy="original", gen_length=GEN, block_size=8, batch_size=16,
                                                   dtype="float32"))  # fmt: skip
    recs = ShardWorker(spec).run_shard(ShardTask(0, [f"t{i}" for i in range(8)], texts)).records
    write_parquet(recs, d / "teacher" / "shard-00000.parquet")
    write_manifest(d / "teacher", recs[0].backbone_id, {"policy": "original"})
    model = tdlm.TDLM(tdlm.load_backbone("tiny-multi", dtype="float32"),
                      tdlm.TemporalConfig(layers="dispersed:3", heads=2, head_dim=32))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in model.temporal.values():
            mod.o_proj.weight.copy_(torch.randn(mod.o_proj.weight.shape, generator=g) * 0.3)
    model.save_adapter(d / "adapter")
    recipe = yaml.safe_load((REPO / "configs" / "tiny_multi.yaml").read_text())
    recipe["train"] |= {"micro_batch_size": 2, "max_steps": 3, "save_every": 1, "log_every": 1}
    recipe["optim"]["warmup_steps"] = 1
    (d / "train.yaml").write_text(yaml.safe_dump(recipe))
    return {"teacher": d / "teacher", "adapter": d / "adapter", "train": d / "train.yaml"}


def job_cmd(out: Path, round0: dict) -> list[str]:
    cfg = yaml.safe_load((REPO / "configs" / "onpolicy_tiny_multi.yaml").read_text())
    cfg |= {"train_config": str(round0["train"]), "output_dir": str(out), "round0_trajectories": str(round0["teacher"]),
            "round0_adapter": str(round0["adapter"]), "rounds": 1, "prompts_per_round": 8, "mix_size": 8,
            "mix_lambda": 0.5, "updates_per_round": 3, "shard_size": 4, "actors": 1, "gap_prompts": 2,
            "launcher": ["deepspeed", "--num_gpus", "1"],
            "round_overrides": ["optim.warmup_steps=1"], "wandb_mode": "disabled"}  # fmt: skip
    cfg["decode"] |= {"gen_length": GEN, "block_size": 8, "batch_size": 4}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return [sys.executable, str(REPO / "ray_jobs" / "onpolicy.py"), "--config", str(path)]


def job_env(kill: str | None = None) -> dict[str, str]:
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_CBWR": "AUTO,STRICT", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop(KILL_ENV, None)
    if kill:
        env[KILL_ENV] = kill
    return env


def run_job(out: Path, round0: dict, kill: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(job_cmd(out, round0), cwd=REPO, env=job_env(kill), capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@contextlib.contextmanager
def job_beside(out: Path, round0: dict):
    """The uninterrupted job started in the background, beside the test's other jobs (it shares nothing with them
    but round 0's files, which no job writes: its own output folder, its own local Ray cluster, its own free
    DeepSpeed port), so its minute of mostly start-up and waiting overlaps theirs. Yields ``finish()``: wait for it
    (300 s, as run_job) and return it as run_job would; it is killed, its whole session, if the test ends first."""
    log = out.with_suffix(".log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(job_cmd(out, round0), cwd=REPO, env=job_env(), stdout=fh, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip

    def finish() -> subprocess.CompletedProcess:
        rc = proc.wait(timeout=300)
        return subprocess.CompletedProcess(proc.args, rc, log.read_text(), "")

    try:
        yield finish
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def fingerprint(out: Path) -> dict:
    r1 = out / "rounds" / "01"
    records = json.loads((r1 / "records" / "manifest.json").read_text())
    mix = json.loads((r1 / "mix" / "manifest.json").read_text())
    return {"records": {k: v["sha256"] for k, v in records["shards"].items()},
            "mix": {k: v["sha256"] for k, v in mix["shards"].items()},
            "adapter": json.loads((r1 / "adapter" / "version.json").read_text())["adapter_sha256"]}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_killed_in_every_phase_resumes_to_the_uninterrupted_job(tmp_path, round0):
    ref = tmp_path / "reference"
    out = tmp_path / "killed"
    with job_beside(ref, round0) as reference:
        for phase in ("records", "mix", "train", "sync"):
            got = run_job(out, round0, kill=f"1:{phase}")
            assert got.returncode in (137, -9), (phase, got.returncode, got.stdout[-2000:], got.stderr[-2000:])
            phases = json.loads((out / "onpolicy.json").read_text())["rounds"].get("1", {}).get("phases", [])
            assert phase not in phases, (phase, phases)  # killed inside the phase: not marked done
        done = reference()
    assert done.returncode == 0, done.stdout[-6000:]
    want = fingerprint(ref)
    state = json.loads((ref / "onpolicy.json").read_text())["rounds"]["1"]
    assert state["phases"] == ["prompts", "records", "mix", "train", "sync"]
    assert state["mix"]["current"] == 4 and state["mix"]["replay"] == 4
    assert "exposure_gap" in state and state["gap_prompts"] == 4  # 2 per shard, 2 shards

    final = run_job(out, round0)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    assert fingerprint(out) == want

    # exactly once: the records' shards were each written by one attempt (the one written before the kill is adopted)
    manifest = json.loads((out / "rounds" / "01" / "records" / "manifest.json").read_text())
    computed = [i for run in manifest["runs"] for i in run["computed_shards"]]
    adopted = sum(run.get("adopted_shards", 0) for run in manifest["runs"])
    assert len(computed) == len(set(computed)) and len(computed) + adopted == 2, manifest["runs"]
    # the training run continued its checkpoint rather than starting over
    summary = json.loads((out / "rounds" / "01" / "train" / "summary.json").read_text())
    assert summary["resumed_from"] >= 1 and summary["steps"] == 3
    # the round and the adapter version on every logged point: the job's and the training's
    job_points = [json.loads(x) for x in (out / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [(p["onpolicy/round"], p["onpolicy/adapter_version"]) for p in job_points] == [(0, 0), (1, 1)]
    assert "onpolicy/exposure_gap" in job_points[1]
    # round 1 continued round 0's adapter (model.init_adapter): its W_O is round 0's, moved by 3 small updates, not 0
    from safetensors.torch import load_file

    w0 = load_file(str(round0["adapter"] / "adapter.safetensors"))
    w1 = load_file(str(out / "rounds" / "01" / "adapter" / "adapter.safetensors"))
    o_proj = [k for k in w0 if "o_proj" in k]
    assert o_proj and all(w0[k].abs().max() > 0.5 for k in o_proj)
    assert all((w1[k] - w0[k]).abs().max() < 0.1 for k in o_proj)
    train_points = [json.loads(x) for x in (out / "rounds" / "01" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert train_points and all(p["onpolicy/round"] == 1 and p["onpolicy/adapter_version"] == 1 for p in train_points)
