"""Answer quality of ``latent:M`` against ``full`` history on the demo task (issue: within 1 point).

Command (from the repository root, venv active; ~15 minutes on a quiet 2-core CPU)::

    python bench/latent_quality.py                       # -> bench/results/latent_quality.json
    python bench/latent_quality.py --steps 40 --problems 50 --out /tmp/lq.json   # a quick look

What is compared. Two adapters on the shipped ``tiny-arith`` backbone, trained side by side by the real
entry point (``deepspeed --num_gpus 2 launcher/train.py --ds ds_configs/zero3.json --config
configs/tiny.yaml``, 2 CPU ranks) on the same teacher trajectories, the same seed, steps and recipe;
only ``model.history`` differs (``full`` vs ``latent:M``). Both are then evaluated by ``eval/run.py``
with the ``tdlm`` policy over the same tau sweep on the first ``--problems`` held-out problems (batch 1,
block 40, 40 tokens, fp32 as in ``make demo``), in one run. The table gives accuracy, NFE and seconds
per tau and the accuracy gap latent - full in points; the target is |gap| <= 1 point at every tau
(reported, never tuned: nothing here feeds back into either recipe).

Trajectories: ``--trajectories`` (default ``runs/demo/trajectories``, written by ``make demo``); when
that folder does not exist, the embedded default's 512 teacher trajectories are generated first
(``tdlm.demo.ensure_toy_trajectories``, ``original`` decoding, in-process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchlib import machine, write_result  # noqa: E402  (bench/ is sys.path[0] when run as a script)

from tdlm.demo import BACKBONE, DTYPE, GEN_LENGTH, ensure_toy_trajectories, run_stage  # noqa: E402

RESULTS = REPO / "bench" / "results" / "latent_quality.json"
TARGET_POINTS = 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latents", type=int, default=4, help="M of latent:M (default 4)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per adapter (default 200, as make demo)")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems evaluated (default 200)")
    ap.add_argument("--taus", type=float, nargs="+", default=[0.5, 0.7, 0.9], help="tdlm thresholds")
    ap.add_argument("--trajectories", default=str(REPO / "runs" / "demo" / "trajectories"))
    ap.add_argument("--work-dir", default=str(REPO / "runs" / "bench_latent"), help="adapters, eval output, logs")
    ap.add_argument("--out", default=str(RESULTS), help="result JSON (default bench/results/latent_quality.json)")
    args = ap.parse_args()

    t0 = time.time()
    py = sys.executable
    env = os.environ.copy()
    for k, v in {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "RAY_USAGE_STATS_ENABLED": "0",
                 "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
        env.setdefault(k, v)
    work = Path(args.work_dir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ensure_toy_trajectories(args.trajectories, BACKBONE)
    load = [os.getloadavg()[0]]

    histories = {"full": "full", "latent": f"latent:{args.latents}"}
    train_s = {}
    for label, history in histories.items():
        t = time.time()
        deepspeed = str(Path(py).parent / "deepspeed")
        run_stage([deepspeed, "--num_gpus", "2", "launcher/train.py", "--ds", "ds_configs/zero3.json", "--config",
              "configs/tiny.yaml", "--output-dir", str(work / label), "--max-steps", str(args.steps),
              f"data.trajectories={args.trajectories}", f"model.history={history}", "train.save_every=0",
              f"wandb.group={work.name}"], work / "logs" / f"train_{label}.log", env)  # fmt: skip
        train_s[label] = time.time() - t
    load.append(os.getloadavg()[0])

    ev = work / "eval"
    taus = [str(t) for t in args.taus]
    adapters = [f"{k}={work / k / 'adapter'}" for k in histories]
    run_stage([py, "eval/run.py", "--backbone", BACKBONE, "--adapter", *adapters,
          "--tasks", "arith", "--limit", str(args.problems), "--policies", "tdlm", "--tdlm-thresholds", *taus,
          "--dtype", DTYPE, "--gen-length", str(GEN_LENGTH), "--block-size", str(GEN_LENGTH), "--batch-size", "1",
          "--workers", "1",
          "--output-dir", str(ev), "--group", work.name], work / "logs" / "eval.log", env)  # fmt: skip
    load.append(os.getloadavg()[0])

    runs = json.loads((ev / "summary.json").read_text())["runs"]
    by = {(r["adapter_label"], r["threshold"]): r for r in runs if r["policy"] == "tdlm"}
    rows = []
    for tau in args.taus:
        f, lat = by[("full", tau)], by[("latent", tau)]
        rows.append({"tau": tau, "full": _cell(f), "latent": _cell(lat),
                     "gap_points": round(100 * (lat["accuracy"] - f["accuracy"]), 2)})  # fmt: skip
    met = all(abs(r["gap_points"]) <= TARGET_POINTS for r in rows)

    print(f"\nlatent:{args.latents} vs full history, tiny-arith, {args.steps} training steps each, "
          f"{args.problems} held-out problems, batch 1\n")
    print("| tau | full acc | full NFE | full s | latent acc | latent NFE | latent s | gap (pts) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, lat = r["full"], r["latent"]
        print(f"| {r['tau']:g} | {f['accuracy']:.1f}% | {f['nfe']:.2f} | {f['seconds']:.3f} | {lat['accuracy']:.1f}% | "
              f"{lat['nfe']:.2f} | {lat['seconds']:.3f} | {r['gap_points']:+.1f} |")
    print(f"\ntraining wall time: full {train_s['full']:.0f} s, latent {train_s['latent']:.0f} s; "
          f"target |gap| <= {TARGET_POINTS:g} pt at every tau: {'met' if met else 'NOT met'}")

    result = {
        "bench": "latent_quality",
        **machine(),
        "loadavg_1m": load,
        "settings": {"backbone": BACKBONE, "latents": args.latents, "steps": args.steps, "problems": args.problems,
                     "taus": args.taus, "gen_length": GEN_LENGTH, "block_size": GEN_LENGTH,
                     "config": "configs/tiny.yaml", "trajectories": args.trajectories},  # fmt: skip
        "rows": rows,
        "train_seconds": train_s,
        "target_points": TARGET_POINTS,
        "target_met": met,
        "wall_seconds": round(time.time() - t0, 1),
    }
    write_result(args.out, result)
    return 0


def _cell(r: dict) -> dict:
    return {"accuracy": round(100 * r["accuracy"], 2), "nfe": r["nfe_mean"], "seconds": r["seconds_mean"]}


if __name__ == "__main__":
    sys.exit(main())
