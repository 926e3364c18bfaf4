"""What the demo runs and where (:mod:`tdlm.demo`): its settings (:class:`DemoPlan`), its prompts, the stage runner
and the stamps that let a rerun reuse what an earlier run finished."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tdlm.errors import TDLMError
from tdlm.tasks.toydata import MULTI_GEN_LENGTH, MULTI_TEST_SIZE

REPO = Path(__file__).resolve().parents[2]
DEMO_BACKBONE = "tiny-multi"
DEMO_TASK = "multi"
DEMO_GEN_CONFIG = "configs/gen_tiny_multi.yaml"
DEMO_TRAIN_CONFIG = "configs/tiny_multi.yaml"
# DEMO_COMPILE=1 evaluates with torch.compile (compilation excluded from the seconds; bench/results/decode_speed.json
# has compiled vs eager per evaluation). Off by default: on a busy 2-core machine inductor's compilation of the
# step graphs in each evaluation worker costs more wall time than it saves over 110 batches; the fast mode (the test
# suite) always stays eager.
DEMO_COMPILE = os.environ.get("DEMO_COMPILE") == "1"


@dataclass(frozen=True)
class DemoPlan:
    out: Path
    prompts: int
    train_steps: int | None  # None: the training config's max_steps
    test_problems: int
    thresholds: tuple[float, ...]  # threshold's tau sweep (includes BASELINE_TAU)
    tdlm_thresholds: tuple[float, ...]
    diagnostic_problems: int  # first N test problems replayed for the prediction-change diagnostic
    block_size: int = MULTI_GEN_LENGTH
    eval_batch_size: int = 50
    compile: bool = False  # torch.compile the evaluator's decode steps (compilation excluded from seconds)

    @classmethod
    def from_env(cls, out: Path) -> DemoPlan:
        if os.environ.get("DEMO_FAST") == "1":
            return cls(out, prompts=64, train_steps=8, test_problems=12, thresholds=(0.7, 0.9),
                       tdlm_thresholds=(0.9,), diagnostic_problems=6)
        # Every held-out problem: at 500 the standard error of an accuracy near 60% is 2.2 points.
        return cls(out, prompts=1024, train_steps=None, test_problems=MULTI_TEST_SIZE,
                   thresholds=(0.5, 0.7, 0.8, 0.9, 0.95), tdlm_thresholds=(0.7, 0.8, 0.9, 0.95, 0.99),
                   diagnostic_problems=200, compile=DEMO_COMPILE)


def run_stage(cmd: list[str], log: Path, env: dict | None = None) -> None:
    """Run a stage, teeing its output to ``log`` and the terminal; a failure stops the demo."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or os.environ.copy(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            sys.stdout.write(line)
        rc = proc.wait()
    if rc != 0:
        raise TDLMError(f"demo stage failed (exit {rc}): {' '.join(cmd[:3])} ...; see {log}")
    print(f"[{time.time() - t0:.0f} s] done: {log}", flush=True)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stage_reusable(stamp: Path, key: dict, outputs: list[Path]) -> bool:
    """True when a stage finished earlier with this ``key`` (its command without the launch's port and resume
    flags, and the digest of what it read from the stage before) and its outputs are still there.

    A rerun of a finished stage would only find its work done (generation's shards, a finished training run,
    evaluation's shards), after starting a Ray cluster or a DeepSpeed launch to find it (7-8 s each on 2 cores).
    A stage that did not finish has no stamp and runs again, resuming as before."""
    try:
        saved = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return saved == key and all(p.exists() for p in outputs)


def mark_finished(stamp: Path, key: dict) -> None:
    """Whole or absent: a stamp is written after its stage returned 0, never half."""
    tmp = stamp.with_name(f"{stamp.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(key, indent=2) + "\n")
    os.replace(tmp, stamp)


def write_prompts(path: Path, n: int, task: str = "arith") -> None:
    """The first ``n`` problems of ``task``'s teacher-prompt split ('arith' or 'multi'), one JSON line each."""
    from tdlm.tasks.toydata import multi_split, split

    problems = multi_split("prompts", n) if task == "multi" else split("prompts", n)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for p in problems:
            fh.write(json.dumps({"id": p.id, "question": p.question}) + "\n")


def demo_stamp(mode: str) -> dict:
    """What the demo's stage folders depend on: a rerun with the same stamp resumes them."""
    digest = {name: hashlib.sha256((REPO / name).read_bytes()).hexdigest()
              for name in (DEMO_GEN_CONFIG, DEMO_TRAIN_CONFIG, "ds_configs/zero3.json")}
    return {"task": DEMO_TASK, "backbone": DEMO_BACKBONE, "mode": mode, "configs": digest}


def set_aside_other_demo(out: Path, mode: str) -> None:
    """Rename ``out`` to ``<out>.previous-<time>`` when it holds stages of another demo (task, mode or recipe).

    The stages resume (generation skips finished shards, training a finished run, evaluation finished shards) and
    refuse changed settings; a folder from another recipe, such as the former tiny-arith demo, is moved aside
    whole instead of being mixed with the new run or ending the demo with a refusal.
    """
    stamp = demo_stamp(mode)
    path = out / "demo.json"
    stages = [d for d in ("trajectories", "train", "eval") if (out / d).exists()]
    if stages:
        try:
            previous = json.loads(path.read_text())
        except (OSError, ValueError):
            previous = None
        if previous != stamp:
            dest = out.with_name(f"{out.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
            n = 1
            while dest.exists():
                dest, n = out.with_name(f"{out.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
            os.replace(out, dest)
            print(f"{out} holds another demo's stages ({', '.join(stages)}): moved to {dest}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp, indent=2) + "\n")
