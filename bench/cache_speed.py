"""Spatial KV cache (issue 12): time per NFE, tokens/s and answer quality of ``none`` / ``prefix`` / ``dual``.

Commands (from the repository root, venv active)::

    python bench/cache_speed.py                  # speed + quality -> bench/results/cache_speed.json (~20 min)
    python bench/cache_speed.py --quick          # a short look: 64-token prompt and response, 100 problems
    python bench/cache_speed.py --skip-quality   # speed only (~10 min; no adapter training)

**Speed.** The real ``tdlm.models.llada.LLaDA`` class at the medium shape of the other benches (d_model 512,
8 layers, 8 heads, SwiGLU 1376, vocab 1024, fp32, seeded random weights), a 256-token prompt, 256 generated
tokens, block 32, batch 1 and 8, policies ``threshold`` (tau 0.9) and ``tdlm`` (the default temporal config,
4 dispersed layers of 4 x 64, full history; W_O = 0, so its tokens equal threshold's (Prop. 1) and its time
includes the temporal attention and cache). A random model's predictive distributions are flat, so every
step would commit one token (256 NFE, nothing like a trained model under tau 0.9); the LM head is therefore
multiplied by ``--head-scale`` (default 110): over the 8 requests the threshold rule then takes a few to a
dozen evaluations per block, about the paper's LLaDA GSM8K regime (TDLM ~40 NFE for 256 tokens). For each
policy and batch size the three caches decode the same requests side by side (their order rotates), after
one untimed warm-up decode per cache (the shared harness, ``bench/timing.py``; ``--rounds`` repeats the
interleaved rounds and keeps each cache's least contended one). Batch 1 decodes the first request, batch 8
the eight requests as one batch (equal lengths: no padding). Times are the process's CPU seconds (one torch
thread: the busy time of the one core used, robust to other processes on a shared machine;
wall seconds are recorded too).
Reported: NFE per request, ms per NFE = CPU seconds / the requests' summed NFE (the cost of one evaluation of
one request; batched rows share a forward), generated tokens/s = batch x 256 / CPU seconds, and both ratios
against ``none``. The per-NFE gain of a cache grows with the
evaluations per block (each block starts with a full-canvas refresh); tokens/s also moves with NFE, and a
cache changes the logits and so the NFE: on a random model by more than on a trained one.

**Quality.** The demo task: the shipped ``tiny-arith`` backbone with a trained TDLM adapter (``--adapter``;
default ``runs/demo/train/adapter`` from ``make demo``, else one trained here by the real DeepSpeed launcher
with the demo's recipe (200 steps, ~3 min) into ``--work-dir`` and reused by later runs), evaluated by
``eval/run.py --cache none prefix dual`` on the held-out split: ``threshold`` and ``tdlm`` at tau 0.9, 40
tokens, batch 1, fp32, once with the demo's one block of 40 on all 500 problems (both caches then hold the
prompt only, so prefix = dual) and once with blocks of 8 on the first 200 (five blocks: dual also caches the
blocks to the right). Target: each cached run within 1 point of the uncached run's accuracy.

Targets (issue 12): dual >= 4x faster per NFE than none and >= 3x the end-to-end tokens/s at the medium
shape; accuracy within 1 point. The table reports what this machine gives, met or not.
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

import torch  # noqa: E402
from benchlib import build_tdlm, machine, write_result  # noqa: E402  (bench/ is sys.path[0] as a script)
from timing import interleaved, rotated  # noqa: E402  (the shared harness, bench/timing.py)

import tdlm  # noqa: E402

RESULTS = REPO / "bench" / "results" / "cache_speed.json"
MEDIUM = dict(
    d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, mlp_hidden_size=1376, vocab_size=1024,
    embedding_size=1024, mask_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
)  # fmt: skip
MEDIUM_SEED = 0
CACHES = ("none", "prefix", "dual")
POLICIES = ("threshold", "tdlm")
TARGETS = {"dual_per_nfe_x": 4.0, "dual_tokens_per_s_x": 3.0, "accuracy_points": 1.0}


# -- speed ------------------------------------------------------------------------------------------------
def build(head_scale: float) -> tdlm.TDLM:
    model = build_tdlm("medium", MEDIUM, MEDIUM_SEED)
    with torch.no_grad():
        model.backbone.model.transformer.ff_out.weight.mul_(head_scale)
    return model


def decode_once(model: tdlm.TDLM, policy: str, prompts: list[list[int]], cfg: tdlm.DecodeConfig, cache: str):
    target = model if policy == "tdlm" else model.backbone
    return tdlm.decode(target, prompts, cfg, policy=policy, cache=cache)


def row(sample, prompts: int, gen_length: int) -> dict:
    """One timed decode (a :class:`timing.Sample` of :func:`decode_once`) as a result row."""
    res, cpu = sample.value, sample.cpu_s
    nfe = [r.nfe for r in res]
    return {"cpu_s": cpu, "wall_s": sample.wall_s, "nfe": nfe, "nfe_mean": sum(nfe) / len(nfe),
            "evaluations": max(nfe), "ms_per_nfe": 1000 * cpu / sum(nfe), "tokens_per_s": prompts * gen_length / cpu,
            "tokens": [r.tokens for r in res]}  # fmt: skip


def speed(args: argparse.Namespace) -> list[dict]:
    model = build(args.head_scale)
    g = torch.Generator().manual_seed(0)
    requests = torch.randint(8, MEDIUM["vocab_size"], (max(args.batch_sizes), args.prompt_len), generator=g).tolist()
    cfg = tdlm.DecodeConfig(gen_length=args.gen_length, block_size=args.block_size, threshold=0.9)
    warm = tdlm.DecodeConfig(gen_length=args.block_size, block_size=args.block_size, threshold=0.9)
    for policy in args.policies:
        for cache in CACHES:
            decode_once(model, policy, requests[:1], warm, cache)  # untimed: first-call paths, allocator
    rows, turn = [], 0
    for policy in args.policies:
        for batch in args.batch_sizes:
            order = rotated(list(CACHES), turn)  # rotate which cache runs first, setting to setting
            turn += 1
            cands = {c: (lambda c=c, p=policy, b=batch: decode_once(model, p, requests[:b], cfg, c)) for c in order}
            t = interleaved(cands, args.rounds)  # the shared harness: caches side by side, rotated per round
            got = {}
            for cache in order:
                best = min(t.samples[cache], key=lambda x: x.cpu_s)  # the least contended round
                got[cache] = r = row(best, batch, cfg.gen_length)
                print(f"  {policy:9s} batch {batch} {cache:6s}: {r['cpu_s']:7.1f} CPU s ({r['wall_s']:.1f} wall), "
                      f"NFE {r['nfe_mean']:6.1f}, "
                      f"{r['ms_per_nfe']:7.1f} ms/NFE, {r['tokens_per_s']:6.1f} tok/s", file=sys.stderr, flush=True)
            for cache in CACHES:
                r = dict(got[cache])
                tokens = r.pop("tokens")
                r["same_tokens_as_none"] = tokens == got["none"]["tokens"]
                r["per_nfe_x_none"] = got["none"]["ms_per_nfe"] / r["ms_per_nfe"]
                r["tokens_per_s_x_none"] = r["tokens_per_s"] / got["none"]["tokens_per_s"]
                rows.append({"policy": policy, "batch": batch, "cache": cache, **r})
    return rows


# -- quality ----------------------------------------------------------------------------------------------
def ensure_adapter(args: argparse.Namespace, env: dict) -> str:
    """The demo task's trained adapter: --adapter, make demo's, or one trained here with the demo recipe."""
    from tdlm.demo import BACKBONE, ensure_toy_trajectories, run_stage

    for cand in (args.adapter, str(REPO / "runs" / "demo" / "train" / "adapter"),
                 str(Path(args.work_dir) / "train" / "adapter")):  # fmt: skip
        if cand and (Path(cand) / "adapter.safetensors").exists():
            return cand
    if args.adapter:
        raise SystemExit(f"--adapter {args.adapter}: no adapter.safetensors there (a TDLM.save_adapter folder)")
    work = Path(args.work_dir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ensure_toy_trajectories(args.trajectories, BACKBONE)
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    run_stage([deepspeed, "--num_gpus", "2", "launcher/train.py", "--ds", "ds_configs/zero3.json", "--config",
          "configs/tiny.yaml", "--output-dir", str(work / "train"), "--max-steps", str(args.steps),
          f"data.trajectories={args.trajectories}", "train.save_every=0", f"wandb.group={work.name}"],
         work / "logs" / "train.log", env)  # fmt: skip
    return str(work / "train" / "adapter")


def quality(args: argparse.Namespace) -> tuple[list[dict], str]:
    from tdlm.demo import BACKBONE, DTYPE, GEN_LENGTH, run_stage

    env = os.environ.copy()
    for k, v in {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "RAY_USAGE_STATS_ENABLED": "0",
                 "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
        env.setdefault(k, v)
    adapter = ensure_adapter(args, env)
    work = Path(args.work_dir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    problems = args.problems * len(args.quality_block_sizes) if len(args.problems) == 1 else args.problems
    rows = []
    for block, n in zip(args.quality_block_sizes, problems, strict=True):
        ev = work / f"eval-b{block}-n{n}"
        run_stage([sys.executable, "eval/run.py", "--backbone", BACKBONE, "--adapter", f"demo={adapter}", "--tasks",
              "arith", "--limit", str(n), "--policies", "threshold", "tdlm", "--thresholds", "0.9",
              "--cache", *CACHES, "--dtype", DTYPE, "--gen-length", str(GEN_LENGTH), "--block-size", str(block),
              "--batch-size", "1", "--workers", "1", "--wandb-mode", "disabled", "--output-dir", str(ev),
              "--group", work.name], work / "logs" / f"eval-b{block}.log", env)  # fmt: skip
        runs = json.loads((ev / "summary.json").read_text())["runs"]
        base = {r["policy"]: r for r in runs if (r.get("cache") or "none") == "none"}
        for r in sorted(runs, key=lambda r: (POLICIES.index(r["policy"]), CACHES.index(r.get("cache") or "none"))):
            b = base[r["policy"]]
            rows.append({"block_size": block, "policy": r["policy"], "cache": r.get("cache") or "none", "n": r["n"],
                         "accuracy": 100 * r["accuracy"], "nfe": r["nfe_mean"], "seconds": r["seconds_mean"],
                         "accuracy_vs_none_points": 100 * (r["accuracy"] - b["accuracy"])})  # fmt: skip
    return rows, adapter


# -- report -----------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--head-scale", type=float, default=110.0, help="LM-head multiplier of the random model")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds per setting (the least CPU time kept)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--quality-block-sizes", nargs="+", type=int, default=[40, 8],
                    help="blocks of the 40-token response: 40 = the demo's setting, 8 = five blocks")
    ap.add_argument("--problems", nargs="+", type=int, default=[500, 200],
                    help="held-out arith problems per quality block size (one value: all)")
    ap.add_argument("--adapter", default=None, help="trained tiny-arith TDLM adapter (default: make demo's)")
    ap.add_argument("--steps", type=int, default=200, help="training steps when an adapter is trained here")
    ap.add_argument("--trajectories", default=str(REPO / "runs" / "demo" / "trajectories"))
    ap.add_argument("--work-dir", default=str(REPO / "runs" / "bench_cache"))
    ap.add_argument("--quick", action="store_true", help="64-token prompt and response, 100 problems; no JSON")
    ap.add_argument("--out", default=None, help=f"result JSON (default {RESULTS.relative_to(REPO)} unless --quick)")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.gen_length, args.problems = 64, 64, [100]
    if len(args.problems) not in (1, len(args.quality_block_sizes)):
        ap.error("--problems takes one value or one per --quality-block-sizes")
    out = args.out or (None if args.quick else RESULTS)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    load = [os.getloadavg()[0]]
    rows = [] if args.skip_speed else speed(args)
    load.append(os.getloadavg()[0])
    qrows, adapter = ([], None) if args.skip_quality else quality(args)
    load.append(os.getloadavg()[0])

    if rows:
        print_speed(rows, args, load[0])
    dual = [r for r in rows if r["cache"] == "dual"]
    speed_met = {f"{r['policy']}/b{r['batch']}": {"per_nfe": r["per_nfe_x_none"] >= TARGETS["dual_per_nfe_x"],
                                                  "tokens_per_s": r["tokens_per_s_x_none"]
                                                  >= TARGETS["dual_tokens_per_s_x"]} for r in dual}  # fmt: skip
    quality_met = None
    if qrows:
        quality_met = print_quality(qrows, args, adapter)
    wall = time.time() - t0
    print(f"\nwall time {wall / 60:.1f} min")
    if out is not None:
        write_result(out, {
            "bench": "cache_speed", **machine(), "loadavg_1m": load, "wall_seconds": round(wall, 1),
            "settings": {"prompt_len": args.prompt_len, "gen_length": args.gen_length, "block_size": args.block_size,
                         "threshold": 0.9, "head_scale": args.head_scale, "batch_sizes": args.batch_sizes,
                         "medium_config": MEDIUM, "medium_seed": MEDIUM_SEED, "threads": args.threads,
                         "rounds": args.rounds, "timing": "bench/timing.py interleaved (caches side by side, order "
                                                          "rotated); each row is the round with the least CPU time",
                         "quality": None if args.skip_quality else {
                             "backbone": "tiny-arith", "adapter": adapter, "problems": args.problems,
                             "gen_length": 40, "block_sizes": args.quality_block_sizes, "tau": 0.9}},
            "targets": TARGETS, "speed_targets_met": speed_met, "quality_target_met": quality_met,
            "speed": rows, "quality": qrows,
        })  # fmt: skip
    return 0


def print_speed(rows: list[dict], args: argparse.Namespace, load: float) -> None:
    print(f"\nSpeed: medium LLaDA (d 512, 8 layers), {args.prompt_len}-token prompt, {args.gen_length} tokens, block "
          f"{args.block_size}, head x{args.head_scale:g}, tau 0.9, {args.threads} thread(s); load {load:.1f}\n")
    print("| policy | batch | cache | NFE / request | ms / NFE | tokens/s | × none per NFE | × none tokens/s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['batch']} | {r['cache']} | {r['nfe_mean']:.1f} | {r['ms_per_nfe']:.0f} | "
              f"{r['tokens_per_s']:.1f} | {r['per_nfe_x_none']:.2f}× | {r['tokens_per_s_x_none']:.2f}× |")
    dual = [r for r in rows if r["cache"] == "dual"]
    print(f"\ndual vs none (targets >= {TARGETS['dual_per_nfe_x']:g}x per NFE, >= {TARGETS['dual_tokens_per_s_x']:g}x "
          "tokens/s): " + ", ".join(f"{r['policy']}/b{r['batch']} {r['per_nfe_x_none']:.2f}x / "
                                    f"{r['tokens_per_s_x_none']:.2f}x" for r in dual))  # fmt: skip


def print_quality(qrows: list[dict], args: argparse.Namespace, adapter: str) -> bool:
    print(f"\nQuality: tiny-arith + adapter {adapter}, held-out problems, 40 tokens, tau 0.9, batch 1\n")
    print("| block | problems | policy | cache | accuracy | NFE | seconds | Δ accuracy vs none |")
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    for q in qrows:
        print(f"| {q['block_size']} | {q['n']} | {q['policy']} | {q['cache']} | {q['accuracy']:.1f}% | {q['nfe']:.2f} "
              f"| {q['seconds']:.3f} | {q['accuracy_vs_none_points']:+.1f} pt |")
    met = all(abs(q["accuracy_vs_none_points"]) <= TARGETS["accuracy_points"] for q in qrows)
    print(f"\naccuracy within {TARGETS['accuracy_points']:g} point of the uncached run: {'met' if met else 'NOT met'}")
    return met


if __name__ == "__main__":
    sys.exit(main())
