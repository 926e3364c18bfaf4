"""The whole pipeline end to end on a CPU: ``make demo`` (``python -m tdlm.demo``).

The demo runs on the ``multi-v1`` task (:mod:`tdlm.tasks.toydata`: arithmetic chains whose responses have hundreds of
equally valid surface forms) with the shipped ``tiny-multi`` backbone, where parallel decoding has something to
win: ``threshold`` needs tens of evaluations per request at tau 0.9 and loses accuracy as tau falls. Stages, each
through the real entry point a cluster user runs:

1. prompts: ``runs/demo/prompts.jsonl`` from the multi-v1 *prompts* split (disjoint from validation and test);
2. teacher trajectories: ``ray_jobs/generate_trajectories.py --config configs/gen_tiny_multi.yaml`` on a local
   Ray cluster with 2 actors;
3. training: ``deepspeed --num_gpus 2 launcher/train.py --ds ds_configs/zero3.json --config
   configs/tiny_multi.yaml`` (2 CPU ranks, ZeRO-3, activation checkpointing);
4. evaluation: ``eval/run.py`` on the held-out *test* split for ``original``, ``threshold`` and ``tdlm``, each
   policy over a tau sweep (greedy; batched, which leaves tokens and per-request NFE as at batch 1), and dInfer's
   training-free ``credit`` and ``soft`` (:mod:`tdlm.decoding.reuse`, dInfer's default weights) at tau 0.9;
5. diagnostic: for positions that stay masked three or more evaluations, how often the finally committed token
   equals each earlier evaluation's argmax (:mod:`tdlm.decoding.prediction_history`), backbone and TDLM at tau 0.9;
6. report: ``runs/demo/report.md`` with both frontiers (accuracy +- standard error vs mean NFE, and seconds per
   sample), every run paired with threshold tau 0.9 and TDLM tau 0.95 with each training-free baseline on the same
   problems, the Pareto plot, the diagnostic, and the target's outcome (TDLM within 1 point of the threshold
   baseline's accuracy at <= 0.8x its NFE and <= 0.85x its seconds at some tau, with the training-seed spread
   of ``bench/results/seed_variance.json``).

The recipe (teacher policy, K, updates, lr, layers, history, tau grid) was chosen on the *validation* split
(``scripts/validate_multi_backbone.py``); the test split is read only here. ``DEMO_FAST=1`` runs the same
stages with fewer prompts, steps and test problems (the test suite).

Rerunning resumes: generation skips finished shards, training continues its run folder with ``--resume`` (a finished
run has nothing to do; a run killed before its first checkpoint is moved aside and restarted), evaluation skips
finished shards, the diagnostic is reused when ``diagnostic.json`` was computed for the same adapter and plan, and
the report is rewritten from the stage outputs. ``TDLM_DEMO_INTERRUPT=<stage>`` (generation, training, evaluation,
diagnostic, report) stops the demo right after that stage, as an interruption would (exit 130); the test suite uses
it to interrupt every stage and resume.

The *embedded default* of a training launch without flags (tiny-arith, generated trajectories) lives in
:mod:`tdlm.data.toy_trajectories`; sweeps and benchmarks build on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tdlm.data.toy_trajectories import BACKBONE, DTYPE, GEN_LENGTH, ensure_toy_trajectories  # noqa: F401
from tdlm.demo.findings import (  # noqa: F401  (the report's findings; their names stay importable from here)
    ACCURACY_SLACK,
    BASELINE_TAU,
    NFE_TARGET,
    REUSE_BASELINES,
    SECONDS_TARGET,
    SEED_VARIANCE,
    TDLM_PAIRED_TAU,
    _card_accuracy,
    _reproduction,
    baseline_pairs,
    evidence,
    frontier_table,
    judge,
    seed_spread,
    standard_error,
)
from tdlm.errors import TDLMError
from tdlm.tasks.toydata import MULTI_GEN_LENGTH, MULTI_TEST_SIZE
from tdlm.training.run_dir import free_port, training_resume_args  # noqa: F401  (the demo's stages use them)

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


def _run(cmd: list[str], log: Path, env: dict | None = None) -> None:
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


def write_prompts(path: Path, n: int, task: str = "arith") -> None:
    """The first ``n`` problems of ``task``'s teacher-prompt split ('arith' or 'multi'), one JSON line each."""
    from tdlm.tasks.toydata import multi_split, split

    problems = multi_split("prompts", n) if task == "multi" else split("prompts", n)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for p in problems:
            fh.write(json.dumps({"id": p.id, "question": p.question}) + "\n")


def run_diagnostic(adapter: Path, plan: DemoPlan, min_masked: int = 3) -> list[dict]:
    """Prediction-change statistics (tdlm.decoding.prediction_history) on the first test problems, backbone and TDLM.

    Both decode with the threshold rule at tau 0.9 (threshold with the plain backbone, tdlm with the adapter), so
    the only difference is the temporal path; content positions only (the final token is not end-of-text / EOS).
    """
    import torch

    from tdlm.data.tokenizer import encode_prompts, load_tokenizer, stop_token_ids
    from tdlm.decoding.prediction_history import change_statistics, decode_histories
    from tdlm.models.loading import load_backbone
    from tdlm.tasks.multi import load_split
    from tdlm.temporal.model import TDLM

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    task = load_split("test", plan.diagnostic_problems)
    bb = load_backbone(DEMO_BACKBONE, dtype=DTYPE)
    tok = load_tokenizer(DEMO_BACKBONE)
    stop = stop_token_ids(tok, bb.eos_token_id)
    excluded = sorted(stop | {bb.pad_token_id})
    prompts = encode_prompts(tok, [p.prompt for p in task])
    rows = []
    for label, model, policy in (("backbone (threshold)", bb, "threshold"),
                                 ("TDLM", TDLM.from_adapter(bb, adapter), "tdlm")):
        t0 = time.time()
        _, histories = decode_histories(model, prompts, policy, BASELINE_TAU, plan.block_size, plan.block_size,
                                        tokenizer=tok, stop_ids=stop, batch_size=plan.eval_batch_size)
        stats = change_statistics(histories, min_masked, exclude_tokens=excluded)
        rows.append({"method": label, "policy": policy, "tau": BASELINE_TAU, "problems": len(task), **stats})
        print(f"diagnostic {label}: {stats['positions']} positions masked >= {min_masked} evaluations "
              f"({time.time() - t0:.0f} s)", flush=True)
    return rows


def _lags(row: dict) -> dict[int, float]:
    """``final_equals_lag`` with int keys (int in process, str after a JSON round trip)."""
    return {int(k): v for k, v in row["final_equals_lag"].items()}


def diagnostic_summary(rows: list[dict]) -> str:
    """One sentence per decoder from the diagnostic rows (numbers of this run only)."""
    parts = []
    for r in rows:
        if not r.get("positions"):
            parts.append(f"{r['method']}: no position stayed masked three or more evaluations.")
            continue
        lags = _lags(r)
        text = (f"{r['method']}: {r['positions']} positions waited {r['mean_masked_evaluations']:.1f} evaluations on "
                f"average and {100 * r['changed']:.0f}% of them changed their argmax while masked; the committed token "
                f"was the first evaluation's argmax {100 * r['final_equals_first']:.0f}% of the time")
        if 1 in lags:
            text += f", the previous evaluation's {100 * lags[1]:.0f}%"
        parts.append(text + ".")
    return " ".join(parts)


def diagnostic_table(rows: list[dict]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = ["| decoder (tau 0.9) | positions | mean evaluations masked | argmax changed | final = argmax of "
             "each earlier evaluation | final = first argmax | final = argmax at a-1 / a-2 / a-4 / a-8 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["positions"]:
            lines.append(f"| {r['method']} | 0 | | | | | |")
            continue
        lags = " / ".join(pct(_lags(r).get(k)) for k in (1, 2, 4, 8))
        lines.append(f"| {r['method']} | {r['positions']} | {r['mean_masked_evaluations']:.1f} | "
                     f"{pct(r['changed'])} | {pct(r['final_equals_earlier'])} | {pct(r['final_equals_first'])} | "
                     f"{lags} |")
    return "\n".join(lines)


STAGES = ("generation", "training", "evaluation", "diagnostic", "report")


def interrupt_after(stage: str) -> None:
    """The test hook: ``TDLM_DEMO_INTERRUPT=<stage>`` ends the demo after ``stage`` as Ctrl-C would."""
    want = os.environ.get("TDLM_DEMO_INTERRUPT")
    if want and want not in STAGES:
        raise TDLMError(f"TDLM_DEMO_INTERRUPT={want!r}: expected one of {', '.join(STAGES)}")
    if want == stage:
        print(f"TDLM_DEMO_INTERRUPT={stage}: stopping after the {stage} stage", flush=True)
        sys.exit(130)


def cached_diagnostic(path: Path, adapter: Path, plan: DemoPlan) -> tuple[dict, list[dict] | None]:
    """(key, rows) where rows come from ``path`` when it was computed for this adapter file and plan."""
    key = {"adapter_sha256": hashlib.sha256((adapter / "adapter.safetensors").read_bytes()).hexdigest(),
           "problems": plan.diagnostic_problems, "tau": BASELINE_TAU, "block_size": plan.block_size}
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return key, None
    return key, (saved.get("rows") if saved.get("key") == key else None)


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

    prompts = out / "prompts.jsonl"
    write_prompts(prompts, plan.prompts, DEMO_TASK)
    traj = out / "trajectories"
    t0 = time.time()
    _run([py, "ray_jobs/generate_trajectories.py", "--config", DEMO_GEN_CONFIG, "--prompts", str(prompts),
          "--num-prompts", str(plan.prompts), "--shard-size", str(max(16, plan.prompts // 8)),
          "--output-dir", str(traj)],
         logs / "1_generate.log", env)
    stage_s["generation"] = time.time() - t0
    interrupt_after("generation")

    train_dir = out / "train"
    deepspeed = str(Path(py).parent / "deepspeed")
    t0 = time.time()
    steps = [] if plan.train_steps is None else [
        "--max-steps", str(plan.train_steps), f"train.save_every={max(1, plan.train_steps // 2)}"]
    _run([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), "launcher/train.py", "--ds",
          "ds_configs/zero3.json",
          "--config", DEMO_TRAIN_CONFIG, "--output-dir", str(train_dir), *steps, f"data.trajectories={traj}",
          *training_resume_args(train_dir)],
         logs / "2_train.log", env)
    stage_s["training"] = time.time() - t0
    interrupt_after("training")

    ev = out / "eval"
    t0 = time.time()
    _run([py, "eval/run.py", "--backbone", DEMO_BACKBONE, "--adapter", f"demo={train_dir / 'adapter'}",
          "--tasks", DEMO_TASK, "--limit", str(plan.test_problems), "--policies", "original", "threshold", "tdlm",
          *REUSE_BASELINES, "--thresholds", *map(str, plan.thresholds), "--tdlm-thresholds",
          *map(str, plan.tdlm_thresholds), "--credit-thresholds", str(BASELINE_TAU), "--soft-thresholds",
          str(BASELINE_TAU),
          "--dtype", DTYPE, "--gen-length", str(MULTI_GEN_LENGTH), "--block-size", str(plan.block_size),
          "--batch-size", str(plan.eval_batch_size), "--warmup", "0", "--workers", "2", "--output-dir", str(ev),
          "--group", "demo", *(["--compile", "true"] if plan.compile else [])],
         logs / "3_eval.log", env)
    stage_s["evaluation"] = time.time() - t0
    interrupt_after("evaluation")

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
