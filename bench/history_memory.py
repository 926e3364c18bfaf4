"""Temporal-cache memory and temporal-attention time vs decoding steps: ``full`` vs ``latent:M``.

Launch (from the repository root, CPU, ~2 minutes on 2 cores)::

    . .venv/bin/activate && python bench/history_memory.py
    python bench/history_memory.py --quick          # steps up to 64, ~30 s
    python bench/history_memory.py --help

Backbone: the real :class:`tdlm.models.llada.LLaDA` class at a medium CPU size (d=256, 8 layers,
8 heads, SwiGLU 688, vocab 512), random init, fp32; temporal modules with the LLaDA default rule
(``dispersed:4`` of 8 layers, 4 heads of 64; the latent Perceiver at the same 4 x 64 width).
One request (batch 1) with a 64-token prompt and 256 response positions is decoded one token per
step along a fixed random order. After n steps (n in 16, 32, 64, 128, 256) we report

* ``cache.nbytes()`` of the temporal cache (``full`` grows with n, ``latent:M`` should be flat);
* temporal time per step: the temporal inserts plus the history writes and the cache commit, timed directly (CPU ops are
  synchronous), the minimum over the ``--window`` evaluations ending at step n (the minimum, not
  the median, because other processes on a shared CPU only ever add time);
* the whole ``forward_step`` and a plain backbone forward on the same input, for scale.

Times are process CPU time on one torch thread by default (``--clock cpu``): on a shared machine
wall time mostly measures the neighbours (a 55 ms backbone forward read 0.1-2.4 s under load 10 on
2 cores). ``--clock wall --threads N`` gives wall time on a quiet machine.

Answer quality on the demo task is *not* measured here. Results go to
``bench/results/history_memory.json`` with machine info, torch version and date.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
from benchlib import machine, write_result  # bench/ is sys.path[0] when run as a script

import tdlm
from tdlm.models.llada import LLaDA, LLaDAConfig

STEPS = (16, 32, 64, 128, 256)
QUICK_STEPS = (16, 32, 64)


def build_backbone(seed: int) -> LLaDA:
    torch.manual_seed(seed)
    cfg = LLaDAConfig(
        d_model=256, n_layers=8, n_heads=8, n_kv_heads=8, mlp_hidden_size=688, vocab_size=512,
        embedding_size=512, mask_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
    )
    bb = LLaDA(cfg).to(torch.float32)
    with torch.no_grad():  # nn defaults are fine for timing; keep embeddings at a transformer-like scale
        bb.model.transformer.wte.weight.normal_(0.0, 0.02)
    return bb.freeze()


def trajectory(bb: LLaDA, prompt_len: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All-masked start (1, P + N) and a random reveal order with random tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, bb.vocab_size, (1, prompt_len + length), generator=g)
    tokens = x[:, prompt_len:].clone()
    x[:, prompt_len:] = bb.mask_token_id
    order = torch.randperm(length, generator=g)
    return x, torch.stack([order, tokens[0, order]], dim=1)  # (N, 2): position, token


NOW = time.process_time  # set from --clock in main()


def timed(model: tdlm.TDLM, clock: list[float]) -> None:
    """Accumulate the temporal inserts' time into clock[0] (wraps this instance's layer loop)."""
    run = model._run

    def run_timed(input_ids, attention_mask, insert, *rest):
        def insert_timed(layer: int, h: torch.Tensor) -> torch.Tensor:
            t0 = NOW()
            out = insert(layer, h)
            clock[0] += NOW() - t0
            return out

        return run(input_ids, attention_mask, insert_timed, *rest)

    model._run = run_timed  # type: ignore[method-assign]


def timed_call(fn, clock: list[float]):
    """``fn`` with its time added to clock[0]."""

    def call(*args, **kwargs):
        t0 = NOW()
        out = fn(*args, **kwargs)
        clock[0] += NOW() - t0
        return out

    return call


def measure(bb: LLaDA, history: str, steps: tuple[int, ...], window: int, args) -> list[dict]:
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(history=history))
    with torch.no_grad():  # a live adapter (values do not change the cost, but avoid all-zero paths)
        for mod in model.temporal.values():
            mod.o_proj.weight.normal_(0.0, 0.02)
    clock = [0.0]
    timed(model, clock)
    x, reveal = trajectory(bb, args.prompt_len, args.length, args.seed)
    cache = model.new_cache(1)
    for name in ("commit", "append"):  # the history writes (after the forward) and the commit count as temporal
        setattr(cache, name, timed_call(getattr(cache, name), clock))
    rows, temporal, step_ms, backbone = [], [], [], []
    with torch.no_grad():
        for n in range(1, max(steps) + 1):
            in_window = any(0 <= s - n < window for s in steps)
            clock[0] = 0.0
            t0 = NOW()
            model.forward_step(x, args.prompt_len, cache)
            step_ms.append(1e3 * (NOW() - t0))
            temporal.append(1e3 * clock[0])
            if in_window:  # the plain backbone on the same input, for scale
                t0 = NOW()
                bb(x)
                backbone.append((n, 1e3 * (NOW() - t0)))
            pos, tok = reveal[n - 1].tolist()
            x[0, args.prompt_len + pos] = tok
            if n in steps:
                lo = n - window
                rows.append(
                    {
                        "history": history,
                        "steps": n,
                        "cache_bytes": cache.nbytes(),
                        "cache_bytes_model": model.temporal_cache_bytes(1, args.length, n),
                        "temporal_ms": min(temporal[lo:n]),
                        "forward_step_ms": min(step_ms[lo:n]),
                        "backbone_ms": min(t for s, t in backbone if lo < s <= n),
                    }
                )
                print(f"  {history:>9} step {n:>3}: cache {rows[-1]['cache_bytes'] / 1024:,.0f} KiB, "
                      f"temporal {rows[-1]['temporal_ms']:.1f} ms", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--histories", default="full,latent:4,latent:8", help="comma-separated history policies")
    ap.add_argument("--quick", action="store_true", help=f"steps {QUICK_STEPS} instead of {STEPS}")
    ap.add_argument("--window", type=int, default=8, help="evaluations ending at step n whose minimum is reported")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--length", type=int, default=256, help="response positions N (>= the largest step)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="process CPU time or wall time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "history_memory.json"))
    args = ap.parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    if args.length < max(steps):
        raise tdlm.TDLMError(f"--length {args.length} must be >= the largest step count {max(steps)}")
    torch.set_num_threads(args.threads)
    global NOW
    NOW = time.process_time if args.clock == "cpu" else time.perf_counter
    bb = build_backbone(args.seed)
    with torch.no_grad():  # warm up the kernels once
        bb(torch.randint(3, 512, (1, args.prompt_len + args.length)))
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    rows = [r for h in args.histories.split(",") for r in measure(bb, h.strip(), steps, args.window, args)]
    elapsed = time.perf_counter() - t_start

    print("| history | steps | temporal cache (KiB) | temporal ms/step | forward_step ms | backbone ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['history']} | {r['steps']} | {r['cache_bytes'] / 1024:,.0f} | {r['temporal_ms']:.2f} | "
            f"{r['forward_step_ms']:.2f} | {r['backbone_ms']:.2f} |"
        )
    result = {
        "bench": "history_memory",
        **machine(),
        "processor": platform.processor() or platform.machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "setup": {
            "backbone": "LLaDA d_model=256 n_layers=8 n_heads=8 mlp=688 vocab=512, random init, fp32",
            "temporal": "dispersed:4 (layers 1,3,5,7), 4 heads x 64; perceiver 4 x 64",
            "batch": 1,
            "prompt_len": args.prompt_len,
            "response_len": args.length,
            "reveal": "one token per step, fixed random order",
            "window": args.window,
            "statistic": "min over the window (ms)",
            "clock": "process CPU time" if args.clock == "cpu" else "wall time",
            "elapsed_s": round(elapsed, 1),
        },
        "rows": rows,
    }
    write_result(args.out, result)
    print(f"({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
