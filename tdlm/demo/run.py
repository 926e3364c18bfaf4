"""The demo's stages in order and its command line (``python -m tdlm.demo``; the package docstring of
:mod:`tdlm.demo` describes them)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tdlm.data.toy_trajectories import DTYPE
from tdlm.demo.diagnostic import cached_diagnostic, diagnostic_summary, diagnostic_table, run_diagnostic
from tdlm.demo.findings import (
    BASELINE_TAU,
    REUSE_BASELINES,
    TDLM_PAIRED_TAU,
    _card_accuracy,
    _reproduction,
    baseline_pairs,
    evidence,
    frontier_table,
    judge,
    standard_error,
)
from tdlm.demo.plan import (
    DEMO_BACKBONE,
    DEMO_GEN_CONFIG,
    DEMO_TASK,
    DEMO_TRAIN_CONFIG,
    REPO,
    DemoPlan,
    mark_finished,
    run_stage,
    set_aside_other_demo,
    sha256_of,
    stage_reusable,
    write_prompts,
)
from tdlm.errors import TDLMError
from tdlm.tasks.toydata import MULTI_GEN_LENGTH
from tdlm.training.run_dir import free_port, training_resume_args

STAGES = ("generation", "training", "evaluation", "diagnostic", "report")


def interrupt_after(stage: str) -> None:
    """The test hook: ``TDLM_DEMO_INTERRUPT=<stage>`` ends the demo after ``stage`` as Ctrl-C would."""
    want = os.environ.get("TDLM_DEMO_INTERRUPT")
    if want and want not in STAGES:
        raise TDLMError(f"TDLM_DEMO_INTERRUPT={want!r}: expected one of {', '.join(STAGES)}")
    if want == stage:
        print(f"TDLM_DEMO_INTERRUPT={stage}: stopping after the {stage} stage", flush=True)
        sys.exit(130)


def build_parser():
    """The demo takes no flags (its settings are environment variables, so ``make demo`` needs none); ``--help``
    says so and what each variable does, and anything else is refused before a stage starts."""
    import argparse

    return argparse.ArgumentParser(
        prog="python -m tdlm.demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The whole pipeline on the shipped tiny-multi backbone, each stage through the entry point a "
                    "cluster user runs: teacher trajectories (Ray, 2 actors), training (deepspeed, 2 CPU ranks, "
                    "ZeRO-3), evaluation of original / threshold / tdlm and dInfer's training-free credit / soft on "
                    "the held-out test split, the "
                    "prediction-history diagnostic, and runs/demo/report.md. Rerunning resumes from what is on disk.",
        epilog="environment variables (the demo has no flags):\n"
               "  DEMO_DIR=PATH             output folder (default: runs/demo in the repository)\n"
               "  DEMO_FAST=1               fewer prompts, steps and test problems (minutes; the test suite uses it)\n"
               "  DEMO_COMPILE=1            evaluate with torch.compile (compilation excluded from the seconds)\n"
               "  TDLM_DEMO_INTERRUPT=STAGE stop right after generation|training|evaluation|diagnostic|report "
               "(exit 130)\n"
               "docs/demo.md describes the stages, the recipe and the measured results.")


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    out = Path(os.environ.get("DEMO_DIR", REPO / "runs" / "demo"))
    plan = DemoPlan.from_env(out)
    t_start = time.time()
    py = sys.executable
    env = os.environ.copy()
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores: more threads per process only contend
    env.setdefault("MKL_CBWR", "AUTO,STRICT")  # run-to-run bit-identical MKL kernels (launcher/train.py says why)
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"]
    from tdlm.models.loading import _resolve_folder

    backbone_dir = _resolve_folder(DEMO_BACKBONE)
    mode = "fast" if os.environ.get("DEMO_FAST") == "1" else "full"
    interrupt_after("")  # a misspelt TDLM_DEMO_INTERRUPT fails now, not after the stages ran to the end
    set_aside_other_demo(out, mode)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    print(f"tdlm demo -> {out} ({mode}; backbone {backbone_dir}, task {DEMO_TASK})")
    stage_s: dict[str, float] = {}

    def stage(name: str, log: str, cmd: list[str], key_cmd: list[str], inputs: list[Path],
              outputs: list[Path]) -> None:
        """Run a stage, or reuse it when it finished earlier with the same command and inputs (stage_reusable)."""
        stamp = logs / f"{log}.done.json"
        key = {"command": key_cmd, "inputs": {str(p): sha256_of(p) for p in inputs}}
        t0 = time.time()
        if stage_reusable(stamp, key, outputs):
            print(f"{name}: reusing {outputs[0]} (finished earlier with the same command and inputs)", flush=True)
        else:
            run_stage(cmd, logs / f"{log}.log", env)
            mark_finished(stamp, key)
        stage_s[name] = time.time() - t0
        interrupt_after(name)

    prompts = out / "prompts.jsonl"
    write_prompts(prompts, plan.prompts, DEMO_TASK)
    traj = out / "trajectories"
    cmd = [py, "ray_jobs/generate_trajectories.py", "--config", DEMO_GEN_CONFIG, "--prompts", str(prompts),
           "--num-prompts", str(plan.prompts), "--shard-size", str(max(16, plan.prompts // 8)),
           "--output-dir", str(traj)]  # fmt: skip
    stage("generation", "1_generate", cmd, cmd, [prompts], [traj / "manifest.json"])

    train_dir = out / "train"
    deepspeed = str(Path(py).parent / "deepspeed")
    steps = [] if plan.train_steps is None else [
        "--max-steps", str(plan.train_steps), f"train.save_every={max(1, plan.train_steps // 2)}"]
    args = ["launcher/train.py", "--ds", "ds_configs/zero3.json", "--config", DEMO_TRAIN_CONFIG, "--output-dir",
            str(train_dir), *steps, f"data.trajectories={traj}"]  # fmt: skip
    cmd = [deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), *args, *training_resume_args(train_dir)]
    adapter = train_dir / "adapter" / "adapter.safetensors"
    stage("training", "2_train", cmd, args, [traj / "manifest.json"], [adapter, train_dir / "summary.json"])

    ev = out / "eval"
    cmd = [py, "eval/run.py", "--backbone", DEMO_BACKBONE, "--adapter", f"demo={train_dir / 'adapter'}",
           "--tasks", DEMO_TASK, "--limit", str(plan.test_problems), "--policies", "original", "threshold", "tdlm",
           *REUSE_BASELINES, "--thresholds", *map(str, plan.thresholds), "--tdlm-thresholds",
           *map(str, plan.tdlm_thresholds), "--credit-thresholds", str(BASELINE_TAU), "--soft-thresholds",
           str(BASELINE_TAU),
           "--dtype", DTYPE, "--gen-length", str(MULTI_GEN_LENGTH), "--block-size", str(plan.block_size),
           "--batch-size", str(plan.eval_batch_size), "--warmup", "0", "--workers", "2", "--output-dir", str(ev),
           "--group", "demo", *(["--compile", "true"] if plan.compile else [])]  # fmt: skip
    stage("evaluation", "3_eval", cmd, cmd, [adapter], [ev / "summary.json"])

    t0 = time.time()
    diag_path = out / "diagnostic.json"
    diag_key, diagnostic = cached_diagnostic(diag_path, train_dir / "adapter", plan)
    if diagnostic is None:
        diagnostic = run_diagnostic(train_dir / "adapter", plan)
        tmp = diag_path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": diag_key, "rows": diagnostic}, indent=2) + "\n")
        os.replace(tmp, diag_path)  # whole or absent: an interruption never leaves half a diagnostic
    else:
        print(f"diagnostic: reusing {diag_path} (same adapter and plan)", flush=True)
    stage_s["diagnostic"] = time.time() - t0
    interrupt_after("diagnostic")

    from tdlm.evaluation.report import paired_table

    summary = json.loads((ev / "summary.json").read_text())
    runs = [r for r in summary["runs"] if r["task"] == DEMO_TASK]
    for r in runs:
        r["accuracy_se"] = standard_error(r["accuracy"], r["n"])
    verdict, facts = judge(runs)
    said, facts["evidence"] = evidence(runs)
    verdict = f"{verdict}\n\n{said}" if said else verdict
    plots = [ev / p for p in summary.get("plots", [])]
    card = json.loads((backbone_dir / "training.json").read_text()) if (backbone_dir / "training.json").exists() else {}
    train_summary = json.loads((train_dir / "summary.json").read_text())
    minutes = (time.time() - t_start) / 60
    repro = _reproduction(runs, card, plan.block_size)
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in stage_s.items())
    report = f"""# tdlm demo report

Task `multi-v1` (arithmetic chains, each answer writable in 144-1,152 valid forms; scored by the boxed result).
Backbone `{DEMO_BACKBONE}` ({card.get('parameters', 0):,} parameters; `original` accuracy in its model card:
{_card_accuracy(card)}). Teacher trajectories: {plan.prompts} prompts (`{DEMO_GEN_CONFIG}`), {MULTI_GEN_LENGTH}
tokens, one block. Adapter: {train_summary.get('steps')} DeepSpeed ZeRO-3 steps on 2 CPU ranks
(`{DEMO_TRAIN_CONFIG}`). Evaluation: the first {plan.test_problems} problems of the held-out test split, greedy,
block {plan.block_size}, batches of {plan.eval_batch_size} (tokens and NFE per request equal batch-1 decoding),
{'compiled (torch.compile, compilation excluded)' if plan.compile else 'eager'}; seconds per sample are the wall time
of its batch until it finished, the methods' batches timed interleaved in a rotated order.
The recipe was chosen on the validation split; this run is the only one that reads the test split.
Total wall time {minutes:.1f} min ({stages}).

## Finding
{verdict}
{repro}

## Frontiers (accuracy ± standard error vs mean NFE)
{frontier_table(runs)}

## Paired on the same problems
{paired_table(runs, f"threshold-tau{BASELINE_TAU:g}")}

### TDLM against the training-free baselines
TDLM at tau {TDLM_PAIRED_TAU:g} (without one, its largest tau) against dInfer's credit decoding and soft iteration,
which reuse earlier evaluations without training (`tdlm/decoding/reuse.py`, dInfer's default weights), both at tau
{BASELINE_TAU:g}, paired on the same problems with each baseline as the reference.

{baseline_pairs(runs)}

## Diagnostic: does a still-masked position keep its earlier predictions?
Positions that stay masked for three or more evaluations (content tokens only), first {plan.diagnostic_problems}
test problems, both decoders at tau {BASELINE_TAU:g}: how often the token finally committed equals the argmax
the same position had at each earlier evaluation (all of them, the first one, and 1/2/4/8 evaluations before
its commit).

{diagnostic_table(diagnostic)}

{diagnostic_summary(diagnostic)}

Plots: {', '.join(p.name for p in plots) or 'none'}
"""
    (out / "report.md").write_text(report)
    interrupt_after("report")  # report.md written, report.json and the plot copies not yet
    (out / "report.json").write_text(json.dumps(
        {"verdict": verdict, **facts, "runs": [{k: r.get(k) for k in ("policy", "threshold", "n", "accuracy",
                                                                        "accuracy_se", "nfe_mean", "seconds_mean",
                                                                        "seconds_se", "seconds_sd", "seconds_p10",
                                                                        "seconds_p90", "paired")} for r in runs],
         "diagnostic": diagnostic, "minutes": minutes, "stage_seconds": stage_s}, indent=2) + "\n")
    for p in plots:
        if p.exists():
            (out / p.name).write_bytes(p.read_bytes())
    print("\n" + report)
    print(f"report: {out / 'report.md'}")
    return 0
