"""Training-seed variance of the demo recipe: how far apart are the TDLM points of adapters trained with different
seeds on the same teacher trajectories? (issue 23, item 9: which differences between recipes are signal.)

For each seed S: ``deepspeed --num_gpus 2 launcher/train.py --ds ds_configs/zero3.json --config configs/tiny_multi.yaml
train.seed=S data.seed=S`` on the demo's trajectories (``runs/demo/trajectories``, written by ``make demo``), then
``eval/run.py`` with ``--policies tdlm`` over the demo's tau grid on the held-out multi-v1 test split. The result
gives, per tau, each seed's accuracy and mean NFE, their mean, standard deviation and range, beside the evaluation's
own binomial standard error (what the demo report quotes): a seed spread above it is recipe noise that a single
demo run cannot see.

    python bench/seed_variance.py                       # seeds 0 1 2, the whole test split (~3.5 min per seed)
    python bench/seed_variance.py --seeds 0 1 2 3 --limit 200

Every stage resumes (a seed's finished training or evaluation is reused), so an interrupted bench continues.
Training runs with MKL_CBWR=AUTO,STRICT (set by launcher/train.py), so the same seed gives the same adapter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import exit_with, machine, run_logged, write_result  # noqa: E402

from tdlm.demo import DEMO_BACKBONE, DEMO_TASK, DEMO_TRAIN_CONFIG, DTYPE, MULTI_GEN_LENGTH, free_port  # noqa: E402

TAUS = (0.7, 0.8, 0.9, 0.95, 0.99)  # the demo's tdlm_thresholds (tdlm.demo.DemoPlan, full mode)


def run(cmd: list[str], log: Path, env: dict) -> None:
    run_logged(cmd, log, env, REPO)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--trajectories", default=str(REPO / "runs" / "demo" / "trajectories"))
    ap.add_argument("--limit", type=int, default=None, help="test problems (default: the whole split)")
    ap.add_argument("--max-steps", type=int, default=None, help="override the recipe's updates (quick checks)")
    ap.add_argument("--out", default=str(REPO / "runs" / "seed_variance"))
    ap.add_argument("--result", default=str(REPO / "bench" / "results" / "seed_variance.json"))
    args = ap.parse_args(argv)
    if len(args.seeds) < 2:
        raise SystemExit("error: --seeds: give at least two seeds (a spread needs them)")
    traj = Path(args.trajectories)
    if not (traj / "manifest.json").exists():
        raise SystemExit(f"error: {traj}: no teacher trajectories (run `make demo` first, or pass --trajectories)")
    out = Path(args.out)
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MKL_CBWR": "AUTO,STRICT",
                        "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"), "RAY_USAGE_STATS_ENABLED": "0"}
    py, deepspeed = sys.executable, str(Path(sys.executable).parent / "deepspeed")
    per_seed: dict[int, dict] = {}
    t0 = time.time()
    for seed in args.seeds:
        train_dir = out / f"train-seed{seed}"
        steps = [] if args.max_steps is None else ["--max-steps", str(args.max_steps)]
        resume = ["--resume"] if (train_dir / "run_config.json").exists() else []
        t = time.time()
        run([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), "launcher/train.py", "--ds",
             "ds_configs/zero3.json", "--config", DEMO_TRAIN_CONFIG, "--output-dir", str(train_dir), *steps, *resume,
             f"data.trajectories={traj}", f"train.seed={seed}", f"data.seed={seed}"],
            out / "logs" / f"train-seed{seed}.log", env)
        train_s = time.time() - t
        ev = out / f"eval-seed{seed}"
        limit = [] if args.limit is None else ["--limit", str(args.limit)]
        t = time.time()
        run([py, "eval/run.py", "--backbone", DEMO_BACKBONE, "--adapter", f"seed{seed}={train_dir / 'adapter'}",
             "--tasks", DEMO_TASK, *limit, "--policies", "tdlm", "--tdlm-thresholds", *map(str, TAUS), "--dtype",
             DTYPE, "--gen-length", str(MULTI_GEN_LENGTH), "--block-size", str(MULTI_GEN_LENGTH), "--batch-size",
             "50", "--warmup", "0", "--workers", "2", "--output-dir", str(ev), "--group", "seed-variance",
             "--wandb-mode", "disabled"], out / "logs" / f"eval-seed{seed}.log", env)
        summary = json.loads((ev / "summary.json").read_text())
        final = json.loads((train_dir / "summary.json").read_text())
        per_seed[seed] = {"train_seconds": train_s, "eval_seconds": time.time() - t,
                          "final_loss": final.get("final_loss", final.get("loss")),
                          "points": {f"{r['threshold']:g}": {"accuracy": r["accuracy"], "nfe_mean": r["nfe_mean"],
                                                             "n": r["n"]}
                                     for r in summary["runs"] if r["policy"] == "tdlm"}}
    spread = {}
    for tau in (f"{t:g}" for t in TAUS):
        acc = [per_seed[s]["points"][tau]["accuracy"] for s in args.seeds]
        nfe = [per_seed[s]["points"][tau]["nfe_mean"] for s in args.seeds]
        n = per_seed[args.seeds[0]]["points"][tau]["n"]
        m = statistics.fmean(acc)
        spread[tau] = {"accuracy_mean": m, "accuracy_sd_over_seeds": statistics.stdev(acc),
                       "accuracy_range": [min(acc), max(acc)], "eval_standard_error": math.sqrt(m * (1 - m) / n),
                       "nfe_mean": statistics.fmean(nfe), "nfe_sd_over_seeds": statistics.stdev(nfe),
                       "nfe_range": [min(nfe), max(nfe)], "n": n}
    print("\n| tau | accuracy mean | sd over seeds | range | eval SE | NFE mean | NFE sd |")
    print("|---|---|---|---|---|---|---|")
    for tau, r in spread.items():
        print(f"| {tau} | {100 * r['accuracy_mean']:.1f}% | {100 * r['accuracy_sd_over_seeds']:.1f} | "
              f"{100 * r['accuracy_range'][0]:.1f}-{100 * r['accuracy_range'][1]:.1f} | "
              f"{100 * r['eval_standard_error']:.1f} | {r['nfe_mean']:.2f} | {r['nfe_sd_over_seeds']:.2f} |")
    write_result(args.result, {"machine": machine(), "seeds": args.seeds, "limit": args.limit,
                               "max_steps": args.max_steps, "trajectories": str(traj), "per_seed": per_seed,
                               "spread": spread, "minutes": (time.time() - t0) / 60})
    return 0


if __name__ == "__main__":
    exit_with(main)
