"""Compiled vs eager decoding on CPU (issue 21, item 7 second bullet): ms per NFE of the backbone and of TDLM.

Commands (from the repository root, venv active)::

    python bench/decode_speed.py            # -> bench/results/decode_speed.json (~20 min on 2 busy cores)
    python bench/decode_speed.py --quick    # 64 + 64 tokens, one repeat; prints only unless --out is given

**Setup.** The real ``tdlm.models.llada.LLaDA`` class at the medium shape of the other benches (d_model 512,
8 layers, 8 heads, SwiGLU 1376, vocab 1024, fp32, seeded random weights), a 256-token prompt + 256 generated
tokens, block 32, batch 1, threshold tau 0.9; the LM head is multiplied by ``--head-scale`` (110, as in
``bench/cache_speed.py``) so that blocks take a few evaluations each instead of one token per evaluation.
TDLM is the default temporal config (4 dispersed layers of 4 x 64) with history ``last:32``: H = 32 history
slots per position, the H of ``bench/temporal_overhead.py``, preallocated as the static step needs (``full``
would attend over C = gen_length = 256 slots whatever the evaluation); W_O = 0, so its tokens and NFE equal
threshold's (Prop. 1) and its time is the backbone's plus the temporal attention and history writes.

**Timing.** One torch thread; process CPU seconds (robust to other processes on a shared machine; wall
seconds are recorded too). For each cache (none, dual) and method (backbone, TDLM), eager and compiled
(``compile=True``: inductor, fullgraph) decode the same request side by side, alternating which runs first,
``--repeats`` times each (default 1: a medium decode takes a minute on a loaded core), after an untimed
warm-up per setting: for the compiled rows a whole decode of the same shapes, which compiles every graph, so
the timed decodes exclude compilation and warm-up (its wall seconds are recorded); for eager one block. ms per NFE =
CPU seconds / NFE. Reported: compiled / eager per NFE, and the temporal overhead per NFE = TDLM / backbone - 1.

Targets (issue 21): compiled not slower than eager; TDLM's temporal overhead per NFE <= 8% of the backbone's,
uncached and with the dual cache. The table says met or not with the measured numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from benchlib import machine, write_result  # noqa: E402  (bench/ is sys.path[0] as a script)

import tdlm  # noqa: E402
from tdlm.models.loading import random_backbone  # noqa: E402

RESULTS = REPO / "bench" / "results" / "decode_speed.json"
MEDIUM = dict(
    d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, mlp_hidden_size=1376, vocab_size=1024,
    embedding_size=1024, mask_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
)  # fmt: skip
CACHES = ("none", "dual")
TARGETS = {"compiled_over_eager_max": 1.0, "temporal_overhead_max": 0.08}


def build(head_scale: float, history: str) -> tdlm.TDLM:
    backbone = random_backbone("llada", MEDIUM, 0, "medium-llada")
    with torch.no_grad():
        backbone.model.transformer.ff_out.weight.mul_(head_scale)
    return tdlm.TDLM(backbone, tdlm.TemporalConfig(history=history)).eval()


def decode_once(model, policy: str, prompt: list[int], cfg: tdlm.DecodeConfig, compile_) -> dict:
    c0, t0 = time.process_time(), time.perf_counter()
    res = tdlm.decode(model, [prompt], cfg, policy=policy, compile=compile_)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return {"cpu_s": cpu, "wall_s": wall, "nfe": res[0].nfe, "tokens": res[0].tokens}


def _attention_code() -> str:
    """Which temporal attention ran: the git blob of tdlm/temporal/attention.py (and whether it is modified)."""
    import subprocess

    try:
        blob = subprocess.run(["git", "hash-object", "tdlm/temporal/attention.py"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "tdlm/temporal/attention.py"], cwd=REPO)
        return f"attention.py blob {blob}" + (" (uncommitted changes)" if dirty.returncode else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 + 64 tokens, one repeat")
    ap.add_argument("--repeats", type=int, default=1, help="timed decodes per setting (alternating order)")
    ap.add_argument("--head-scale", type=float, default=110.0)
    ap.add_argument("--history", default="last:32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", default="true", help="DecodeConfig.compile of the compiled rows (default inductor)")
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS.relative_to(REPO)}; none with --quick)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompt_len, gen = (64, 64) if args.quick else (256, 256)
    repeats = 1 if args.quick else args.repeats
    model = build(args.head_scale, args.history)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(8, MEDIUM["vocab_size"], (prompt_len,), generator=g).tolist()
    load0 = os.getloadavg()[0]
    rows = []
    with torch.inference_mode():
        for cache in CACHES:
            cfg = tdlm.DecodeConfig(gen_length=gen, block_size=32, threshold=0.9, cache=cache)
            short = dataclasses.replace(cfg, gen_length=32)
            got: dict = {}
            for method, target, policy in (("backbone", model.backbone, "threshold"), ("tdlm", model, "tdlm")):
                for mode, comp in (("eager", False), ("compiled", args.compile)):
                    t0 = time.perf_counter()
                    # Compiled: a whole decode of the same shapes compiles every graph of this setting; eager: one
                    # block warms the allocator (a whole eager decode would only double the bench's time).
                    warm = decode_once(target, policy, prompt, cfg if comp else short, comp)
                    got[(method, mode)] = {"warmup_wall_s": time.perf_counter() - t0, "runs": []}
                    print(f"  {cache:4s} {method:8s} {mode:8s} warm-up {got[(method, mode)]['warmup_wall_s']:.1f} s, "
                          f"(NFE {warm['nfe']})", file=sys.stderr, flush=True)  # fmt: skip
            for r in range(repeats):
                for method, target, policy in (("backbone", model.backbone, "threshold"), ("tdlm", model, "tdlm")):
                    modes = (("eager", False), ("compiled", args.compile))
                    for mode, comp in modes if r % 2 == 0 else modes[::-1]:
                        got[(method, mode)]["runs"].append(decode_once(target, policy, prompt, cfg, comp))
            per = {}
            for d in got.values():
                d["tokens"], d["nfe"] = d["runs"][0]["tokens"], d["runs"][0]["nfe"]
            for (method, mode), d in got.items():
                ms = [1000 * x["cpu_s"] / x["nfe"] for x in d["runs"]]
                per[(method, mode)] = statistics.median(ms)
                rows.append({
                    "cache": cache, "method": method, "mode": mode, "nfe": d["nfe"],
                    "ms_per_nfe": per[(method, mode)], "ms_per_nfe_runs": ms,
                    "wall_ms_per_nfe": statistics.median(1000 * x["wall_s"] / x["nfe"] for x in d["runs"]),
                    "warmup_wall_s": d["warmup_wall_s"],
                    "same_tokens_as_eager_backbone": d["tokens"] == got[("backbone", "eager")]["tokens"]
                    and all(x["tokens"] == d["tokens"] for x in d["runs"]),
                })  # fmt: skip
            for row in rows[-4:]:
                row["compiled_over_eager"] = per[(row["method"], "compiled")] / per[(row["method"], "eager")]
                row["temporal_overhead"] = per[("tdlm", row["mode"])] / per[("backbone", row["mode"])] - 1
    lines = ["| cache | method | mode | NFE | ms/NFE (CPU) | compiled / eager | TDLM overhead / NFE | same tokens |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['cache']} | {r['method']} | {r['mode']} | {r['nfe']} | {r['ms_per_nfe']:.1f} | "
                     f"{r['compiled_over_eager']:.3f} | {100 * r['temporal_overhead']:+.1f}% | "
                     f"{r['same_tokens_as_eager_backbone']} |")  # fmt: skip
    verdict = {
        "compiled_not_slower": all(r["compiled_over_eager"] <= TARGETS["compiled_over_eager_max"] for r in rows),
        "temporal_overhead_le_8pct": {f"{r['cache']}/{r['mode']}": r["temporal_overhead"] <= 0.08
                                      for r in rows if r["method"] == "tdlm"},  # fmt: skip
    }
    print("\n".join(lines))
    print(f"targets: {verdict}")
    result = {"machine": machine(), "load_before": load0, "load_after": os.getloadavg()[0],
              "settings": {"prompt_len": prompt_len, "gen_length": gen, "block_size": 32, "batch": 1,
                           "threshold": 0.9, "head_scale": args.head_scale, "history": args.history,
                           "repeats": repeats, "threads": args.threads, "compile": args.compile,
                           "attention": _attention_code(), "medium": MEDIUM},
              "targets": TARGETS, "verdict": verdict, "rows": rows, "table": lines}  # fmt: skip
    out = args.out or (None if args.quick else RESULTS)
    if out:
        write_result(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
