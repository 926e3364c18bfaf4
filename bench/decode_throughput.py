"""Decoding throughput of ``tdlm.decode``: samples/s per policy and batch size, on CPU.

Commands (from the repository root, venv active)::

    python bench/decode_throughput.py            # full run (~8 CPU-min at 1 thread) -> bench/results/...json
    python bench/decode_throughput.py --quick    # tiny model, few samples; prints only unless --out is given
    python bench/decode_throughput.py --threads 2 --sizes medium --batch-sizes 1 16

What is measured. Wall time of :func:`tdlm.decode` over ``--samples`` requests, decoded ``batch``
at a time (after one untimed warm-up call of the same batch size); samples/s = requests / seconds.
Timing is the shared harness (:mod:`timing`): per model, every policy x batch size runs once per round
(``--rounds``, default 3) in an order rotated every round, so a change of machine load lands on all of them
alike; ``seconds`` is the minimum over rounds (``seconds_median`` and the CPU seconds are kept too).
NFE per sample is the mean number of denoiser evaluations. Requests are random non-special token ids
(fixed seed) of ``--prompt-len`` tokens, ``--gen-length`` response tokens in blocks of
``--block-size``; all requests in a batch have the same length (no padding).

Policies: ``original`` (one token per evaluation), ``threshold`` (tau 0.9) and ``tdlm`` (threshold
rule on a TDLM with the default temporal config; W_O is zero at init, Prop. 1, so its tokens equal
``threshold`` and the difference is the cost of the temporal cache and attention). The models have
random weights, so their predictive distributions are flat: no confidence passes tau and
``threshold`` / ``tdlm`` degenerate to one token per evaluation (NFE = gen_length), exactly like
``original``. That is fine for throughput per evaluation but says nothing about NFE savings.

Sizes: ``tiny`` = ``tdlm.load_backbone("tiny-llada")`` (d 64, 4 layers); ``medium`` = the real
``tdlm.models.llada.LLaDA`` class at d_model 256, 6 layers, 4 heads, SwiGLU 688, vocab 128, float32,
seeded random init (``tdlm.models.loading.init_weights``).

Target (issue): batch 16 >= 4x the samples/s of batch 1. On a CPU this holds only while per-call
overhead dominates; once the matmuls dominate (already at ~100 tokens here) batching adds little,
because one core is busy either way. The table reports what this machine gives. The machine is
shared: the load average before/after is recorded, and numbers move by 10-30 % between runs (the
saved run: load average 10-19 on 2 cores, 19 min wall for ~8 min of CPU time).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from benchlib import build_tdlm, machine, write_result  # bench/ is sys.path[0] when run as a script
from timing import interleaved, summary

import tdlm

RESULTS = Path(__file__).resolve().parent / "results" / "decode_throughput.json"
MEDIUM = dict(
    d_model=256, n_layers=6, n_heads=4, n_kv_heads=4, mlp_hidden_size=688, vocab_size=128,
    embedding_size=128, mask_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
)  # fmt: skip
MEDIUM_SEED = 0
POLICIES = ("original", "threshold", "tdlm")
TARGET_RATIO = 4.0


def build(size: str) -> tdlm.TDLM:
    """TDLM (zero W_O) around a frozen backbone; ``.backbone`` serves the non-tdlm policies."""
    return build_tdlm(size, MEDIUM, MEDIUM_SEED)


def requests(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, vocab, (n, length), generator=g).tolist()  # ids < 8 are specials


def runner(model: tdlm.TDLM, policy: str, batch: int, prompts: list[list[int]], cfg: tdlm.DecodeConfig):
    """One measurement: every request decoded ``batch`` at a time; returns the NFE per request."""
    target = model if policy == "tdlm" else model.backbone
    tdlm.decode(target, prompts[:batch], cfg, policy=policy)  # warm-up (allocator, first-call paths)

    def run() -> list[int]:
        nfe = []
        for start in range(0, len(prompts), batch):
            nfe.extend(r.nfe for r in tdlm.decode(target, prompts[start : start + batch], cfg, policy=policy))
        return nfe

    return run


def measure(model: tdlm.TDLM, policies, batch_sizes, prompts: list[list[int]], cfg: tdlm.DecodeConfig,
            rounds: int) -> dict[tuple[str, int], dict]:  # fmt: skip
    """Every (policy, batch) of one model side by side (:func:`timing.interleaved`), min / median of rounds."""
    cands = {f"{p}/{b}": runner(model, p, b, prompts, cfg) for p in policies for b in batch_sizes}
    t = interleaved(cands, rounds)
    out = {}
    for name in cands:
        p, b = name.split("/")
        wall, cpu = summary(t.seconds(name, "wall")), summary(t.seconds(name, "cpu"))
        nfe = t.samples[name][0].value
        out[(p, int(b))] = {"samples": len(prompts), "seconds": wall["min"], "seconds_median": wall["median"],
                            "cpu_seconds": cpu["min"], "rounds": rounds,
                            "samples_per_s": len(prompts) / wall["min"], "nfe_per_sample": sum(nfe) / len(nfe)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "medium"], choices=["tiny", "medium"], help="models")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES, help="decoding policies")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16], help="requests per decode call")
    ap.add_argument("--samples", type=int, default=32, help="requests per measurement (tiny)")
    ap.add_argument("--medium-samples", type=int, default=16, help="requests per measurement (medium)")
    ap.add_argument("--prompt-len", type=int, default=48, help="prompt tokens per request")
    ap.add_argument("--gen-length", type=int, default=64, help="response tokens")
    ap.add_argument("--block-size", type=int, default=32, help="block size")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = one Ray CPU actor)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measurement (min is reported)")
    ap.add_argument("--quick", action="store_true", help="tiny only, 16 samples; no JSON unless --out")
    ap.add_argument("--out", type=Path, default=None, help=f"result JSON (default: {RESULTS} unless --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.samples = ["tiny"], 16
    out = args.out or (None if args.quick else RESULTS)
    torch.set_num_threads(args.threads)
    cfg = tdlm.DecodeConfig(gen_length=args.gen_length, block_size=args.block_size, threshold=0.9)
    load_before = os.getloadavg()
    rows = []
    for size in args.sizes:
        model = build(size)
        n = args.medium_samples if size == "medium" else args.samples
        n = max(n, max(args.batch_sizes))
        prompts = requests(n, args.prompt_len, model.backbone.vocab_size)
        got = measure(model, args.policies, args.batch_sizes, prompts, cfg, args.rounds)
        for policy in args.policies:
            for bs in args.batch_sizes:
                r = got[(policy, bs)]
                rows.append({"size": size, "policy": policy, "batch": bs, **r})
                print(f"  {size:6s} {policy:9s} batch {bs:2d}: {r['samples_per_s']:7.2f} samples/s "
                      f"NFE {r['nfe_per_sample']:.1f}", file=sys.stderr)  # fmt: skip
    load_after = os.getloadavg()
    base = {(r["size"], r["policy"]): r["samples_per_s"] for r in rows if r["batch"] == min(args.batch_sizes)}
    for r in rows:
        r["speedup_vs_batch1"] = r["samples_per_s"] / base[(r["size"], r["policy"])]
    print(f"\n{args.prompt_len}-token prompts, {args.gen_length} response tokens, block {args.block_size}, "
          f"{args.threads} thread(s), torch {torch.__version__}; "
          f"load avg {load_before[0]:.1f} -> {load_after[0]:.1f}\n")
    print("| model | policy | batch | samples/s | NFE/sample | x batch 1 |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['policy']} | {r['batch']} | {r['samples_per_s']:.2f} | {r['nfe_per_sample']:.1f} "
              f"| {r['speedup_vs_batch1']:.2f} |")
    top = max(args.batch_sizes)
    verdicts = {f"{r['size']}/{r['policy']}": r["speedup_vs_batch1"] for r in rows if r["batch"] == top}
    print(f"\nbatch {top} vs batch {min(args.batch_sizes)} (target >= {TARGET_RATIO}x): "
          + ", ".join(f"{k} {v:.2f}x{'' if v >= TARGET_RATIO else ' (below)'}" for k, v in verdicts.items()))
    if out is not None:
        result = {
            "bench": "decode_throughput",
            **machine(),
            "threads": args.threads,
            "rounds": args.rounds,
            "timing": "bench/timing.py interleaved, order rotated per round; seconds = min of rounds (wall)",
            "load_avg_before": load_before,
            "load_avg_after": load_after,
            "settings": {"prompt_len": args.prompt_len, "gen_length": args.gen_length, "block_size": args.block_size,
                         "threshold": 0.9, "medium_config": MEDIUM, "medium_seed": MEDIUM_SEED},
            "target": {"batch16_over_batch1": TARGET_RATIO},
            "speedup_largest_batch": verdicts,
            "rows": rows,
        }  # fmt: skip
        write_result(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
