"""Trajectory generation throughput on Ray (CPU): 1 vs 2 replicas, batch 1 vs 16.

Commands (from the repository root, venv active)::

    python bench/trajectory_throughput.py           # full run (~5 min on 2 shared cores) -> bench/results/...json
    python bench/trajectory_throughput.py --quick   # 16 prompts; prints only unless --out is given
    python bench/trajectory_throughput.py --num-prompts 128 --shard-size 64 --actors 1 2 --batch-sizes 1 8 16

What is measured. The real job: :func:`tdlm.generation.generate` on a local 2-CPU Ray cluster
(started once by the bench, ``ray.init(address="local")``) with CPU replicas of ``num_cpus=1`` (one
torch thread each), writing shards + manifest to a temporary dir that is deleted afterwards. For
every (replicas, batch) pair a fresh output dir is generated from scratch. Two rates:

* ``traj/s`` (end to end): trajectories / seconds from the first shard handed out to the last shard
  written (what the driver prints; includes Ray dispatch, the later start of the second replica,
  Parquet writes and manifest updates, excludes cluster start and the first replica's model load);
* ``traj/s (compute)``: trajectories / (sum of per-shard decode seconds / replicas), i.e. the rate if
  the replicas had never waited; the gap to the end-to-end rate is the orchestration overhead.

Workload. ``tiny-llada`` (preset: d 64, 4 layers, random weights; its tokenizer is per character,
so a GSM8K question is 100-500 tokens and compute dominates the per-shard overhead of Ray, which is a
few ms per shard); the first ``--num-prompts`` GSM8K test questions through the chat template;
policy ``threshold`` (tau 0.9), 32 response tokens in blocks of 8. With random weights no confidence
passes tau, so every request takes 32 evaluations (one token per step). Prompts of a shard are
decoded in length-sorted batches, so batch 16 pays for padding only within similar lengths.

Targets (issue): 2 replicas >= 1.7x one replica on 2 cores; batch 16 >= 4x batch 1. The machine is
shared with other jobs (load average recorded): the second replica competes with them for the
second core, and on a CPU a batch only helps while per-call overhead, not the matmuls, dominates.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Ray settings for this shared machine (shared/notes/ray-wandb-datasets-on-cpu.md): loopback only,
# no token auth, no usage stats.
for _k, _v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
               "RAY_USAGE_STATS_ENABLED": "0"}.items():  # fmt: skip
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
from benchlib import machine, write_result  # noqa: E402  (bench/ is sys.path[0] when run as a script)

from tdlm.decoding.config import DecodeSettings  # noqa: E402
from tdlm.generation import MANIFEST, GenerationConfig, generate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "trajectory_throughput.json"
GSM8K = REPO.parent / "shared" / "benchmarks" / "gsm8k_test.jsonl"
TARGETS = {"two_replicas_over_one": 1.7, "batch16_over_batch1": 4.0}


def run_one(args: argparse.Namespace, actors: int, batch: int, work: Path) -> dict:
    out = work / f"a{actors}-b{batch}"
    cfg = GenerationConfig(
        backbone=args.backbone, prompts=str(args.prompts), prompt_field="question", output_dir=str(out),
        num_prompts=args.num_prompts, shard_size=args.shard_size, actors=actors, cpus_per_actor=1, log_interval=60.0,
        decode=DecodeSettings(policy="threshold", gen_length=args.gen_length, block_size=args.block_size,
                              batch_size=batch),
        allow_eval_prompts=True,  # a throughput measurement: these trajectories never train anything
    )  # fmt: skip
    t0 = time.perf_counter()
    summary = generate(cfg)
    wall = time.perf_counter() - t0
    manifest = json.loads((out / MANIFEST).read_text())
    shard_seconds = sum(e["seconds"] for e in manifest["shards"].values())
    row = {
        "replicas": actors,
        "batch": batch,
        "trajectories": summary.num_prompts,
        "traj_per_s": summary.trajectories_per_s,
        "traj_per_s_compute": summary.num_prompts / (shard_seconds / actors),
        "wall_seconds_incl_startup": wall,
        "nfe_mean": manifest["nfe"]["mean"],
    }
    shutil.rmtree(out)
    print(f"  replicas {actors} batch {batch:2d}: {row['traj_per_s']:.2f} traj/s end to end, "
          f"{row['traj_per_s_compute']:.2f} compute, {wall:.0f} s wall", file=sys.stderr)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="tiny-llada", help="preset or checkpoint folder")
    ap.add_argument("--prompts", type=Path, default=GSM8K, help="JSONL with a 'question' field")
    ap.add_argument("--num-prompts", type=int, default=64, help="prompts per configuration")
    ap.add_argument("--shard-size", type=int, default=32, help="prompts per shard (>= 2 shards for 2 replicas)")
    ap.add_argument("--gen-length", type=int, default=32, help="response tokens")
    ap.add_argument("--block-size", type=int, default=8, help="block size")
    ap.add_argument("--actors", nargs="+", type=int, default=[1, 2], help="replica counts to compare")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16], help="decode batch sizes to compare")
    ap.add_argument("--quick", action="store_true", help="16 prompts, shards of 8; no JSON unless --out")
    ap.add_argument("--out", type=Path, default=None, help=f"result JSON (default: {RESULTS} unless --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.shard_size = 16, 8
    out = args.out or (None if args.quick else RESULTS)
    import datasets
    import ray

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cpus = max(args.actors)
    temp = f"/tmp/ray_tdlm_bench_{os.getpid()}"  # short: AF_UNIX socket paths are limited to 107 bytes
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=200 * 1024**2,
             _temp_dir=temp, logging_level=logging.WARNING)  # fmt: skip
    load_before = os.getloadavg()
    rows = []
    work = Path(tempfile.mkdtemp(prefix="tdlm_traj_bench_"))
    try:
        for actors in args.actors:
            for batch in args.batch_sizes:
                rows.append(run_one(args, actors, batch, work))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
    load_after = os.getloadavg()
    rate = {(r["replicas"], r["batch"]): r["traj_per_s"] for r in rows}
    lo_a, hi_a, lo_b, hi_b = min(args.actors), max(args.actors), min(args.batch_sizes), max(args.batch_sizes)
    scaling = {f"batch {b}": rate[(hi_a, b)] / rate[(lo_a, b)] for b in args.batch_sizes}
    batching = {f"{a} replica(s)": rate[(a, hi_b)] / rate[(a, lo_b)] for a in args.actors}
    print(f"\n{args.backbone}, {args.num_prompts} GSM8K prompts, shards of {args.shard_size}, {args.gen_length} "
          f"tokens / block {args.block_size}, threshold 0.9; CPU replicas with 1 thread; torch {torch.__version__}; "
          f"load avg {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} CPUs\n")  # fmt: skip
    print("| replicas | batch | traj/s (end to end) | traj/s (compute) | NFE/traj | wall s (incl. start) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['replicas']} | {r['batch']} | {r['traj_per_s']:.2f} | {r['traj_per_s_compute']:.2f} | "
              f"{r['nfe_mean']:.1f} | {r['wall_seconds_incl_startup']:.0f} |")  # fmt: skip
    print(f"\n{hi_a} vs {lo_a} replicas (target >= {TARGETS['two_replicas_over_one']}x): "
          + ", ".join(f"{k} {v:.2f}x (efficiency {100 * v / (hi_a / lo_a):.0f}%)" for k, v in scaling.items()))
    print(f"batch {hi_b} vs {lo_b} (target >= {TARGETS['batch16_over_batch1']}x): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in batching.items()))
    if out is not None:
        result = {
            "bench": "trajectory_throughput",
            **machine(),
            "ray": ray.__version__,
            "threads_per_replica": 1,
            "load_avg_before": load_before,
            "load_avg_after": load_after,
            "settings": {"backbone": args.backbone, "prompts": args.prompts.name, "num_prompts": args.num_prompts,
                         "shard_size": args.shard_size, "gen_length": args.gen_length,
                         "block_size": args.block_size, "policy": "threshold", "threshold": 0.9},
            "targets": TARGETS,
            "scaling_replicas": scaling,
            "batching_gain": batching,
            "rows": rows,
        }  # fmt: skip
        write_result(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
