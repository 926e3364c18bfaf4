"""The GPU cost model: a traced step's roofline per GPU (:class:`~tdlm.profiling.ledger.Ledger` gives each op's
FLOPs and bytes), the compiled graph's kernel launches, and the launch timeline that puts them together.

Roofline per op: max(FLOPs / peak, bytes / bandwidth). "eager" counts every op's bytes and every op as a launch;
"fused" drops the bytes of pointwise ops (a compiler folds them into a neighbour), a lower bound for the compiled
graph. The launch term is kernels per NFE of the compiled graph (``bench/results/dispatch_count.json``) times a
per-launch host cost, applied two ways: *added* to the roofline (the host serialised with the GPU: an upper bound)
and *overlapped* (:func:`overlapped_ms`: asynchronous launches cost time only where the host falls behind).
"""

from __future__ import annotations

import json
from pathlib import Path

# Dense bf16 peak and HBM bandwidth (vendor figures): H200 SXM; GH200's H100 96 GB (the paper's device); H100 SXM
# 80 GB (the GPU most often lent for bench/gpu_check.sh). Every time prediction is computed for each of them; the
# GPU check picks the rows of the GPU it runs on (bench/gpu_check_common.gpu_kind, whose GPU_KINDS must name these).
GPUS = {"h200": {"flops": 989e12, "bw": 4.8e12, "mem": 141e9}, "gh200": {"flops": 989e12, "bw": 4.0e12, "mem": 96e9},
        "h100": {"flops": 989e12, "bw": 3.35e12, "mem": 80e9}}
LAUNCH_US = 5.0  # per kernel launch of a compiled graph without CUDA graphs (stated assumption)


def overlapped_ms(kernel_us: list[float], host_us: float) -> float:
    """ms of one step whose kernels the host launches asynchronously, as CUDA launches are: the host issues kernel k
    at (k + 1) dt (dt = ``host_us`` / kernels: the compiled graph's launch cost spread over the traced kernels), the
    GPU starts it at max(its issue, the end of kernel k - 1) and runs it for its roofline time. The step ends with
    its last kernel (the loop's one host read per NFE waits for it, so the next step starts on an empty queue).
    Launches cost time only where the host falls behind the GPU: kernels shorter than dt in a row, and the first
    kernels of a step. ``host_us`` = 0 gives the roofline itself (CUDA graphs); a host slower than the GPU
    throughout gives the launches' sum plus the last kernel (the additive term's regime)."""
    if not kernel_us:
        return 0.0
    dt, end = host_us / len(kernel_us), 0.0
    for k, d in enumerate(kernel_us):
        end = max(end, (k + 1) * dt) + d
    return 1e-3 * end



def compiled_kernels(path: str | Path) -> dict:
    """Kernels per NFE of compiled graphs, measured by bench/dispatch_count.py: ``backbone`` / ``tdlm`` of an
    uncached ``forward_step`` (``compiled``), and ``loop``: the decode loop's own graphs (``compiled_loop``, from
    ``--loop``), per cache setting the first graph (an uncached evaluation or a refresh) and the window step."""
    raw = json.loads(Path(path).read_text())
    out = {m: {"backbone": v["backbone_kernels_per_nfe"], "tdlm": v["tdlm_kernels_per_nfe"]}
           for m, v in raw["compiled"].items()}  # fmt: skip
    for m, settings in raw.get("compiled_loop", {}).items():
        out.setdefault(m, {})["loop"] = {key: {who: {"eval": r[who]["refresh"], "window": r[who]["window"]}
                                               for who in ("backbone", "tdlm")} for key, r in settings.items()}
    return out


def launches(ref: dict, who: str, cache: str, kind: str, batch: int = 1) -> int | None:
    """Kernels of the decode loop's own compiled graph of this step (``who`` backbone / tdlm, ``kind`` eval /
    window), None where bench/dispatch_count.py did not count it. A dual window of one row reads its history's rows
    in order (the loop's promise); several rows gather them."""
    key = cache if cache != "dual" else ("dual rows in order" if batch == 1 else "dual gathered")
    return ref.get("loop", {}).get(key, {}).get(who, {}).get(kind)


def step_ms(step: dict, gpu: str, kernels: float, launch_us: float) -> dict:
    """Predicted ms of one step on ``gpu``: ``graphs`` the fused roofline (CUDA graphs: launches about 0);
    ``launch`` + the compiled graph's launches added, each ``launch_us`` (the host serialised with the GPU: an upper
    bound); ``overlap`` the same launches issued asynchronously (:func:`overlapped_ms`); ``eager`` every op's
    bytes, every op a launch (added)."""
    r = step["roofline_ms"][gpu]
    host_us = kernels * launch_us
    return {"graphs": r["fused"], "launch": r["fused"] + host_us * 1e-3,
            "overlap": overlapped_ms(step["_kernel_us"][gpu], host_us),
            "eager": r["eager"] + step["kernels"] * launch_us * 1e-3, "kernels_compiled": kernels}  # fmt: skip


def strip_timelines(obj):
    """``obj`` without the per-kernel timelines (``_kernel_us``: thousands of numbers per traced step)."""
    if isinstance(obj, dict):
        return {k: strip_timelines(v) for k, v in obj.items() if k != "_kernel_us"}
    if isinstance(obj, list):
        return [strip_timelines(v) for v in obj]
    return obj


def per_nfe(rows: list[dict], ref_kernels: dict, launch_us: float, evals_per_block: float) -> dict:
    """ms per NFE of each (policy/history, cache) on each GPU, averaged over the traced first and last blocks: an
    uncached evaluation, or a block's refresh plus ``evals_per_block - 1`` window steps.

    Launches: the kernels inductor generated for this step in the decode loop's own graph (``ref_kernels["loop"]``,
    bench/dispatch_count.py --loop: :func:`launches`); where a step kind was not counted, the uncached NFE's count
    (``ref_kernels``) scaled by the step's fusion-aware estimate (``kernels_fused_est``) over the uncached one."""
    out: dict = {}
    base = {r["label"]: r["eval"]["kernels_fused_est"] for r in rows if r["cache"] == "none"}
    for r in rows:
        key = (r["label"], r["cache"])
        who = "tdlm" if r["policy"] == "tdlm" else "backbone"
        scale = ref_kernels[who] / base[r["label"]]
        n_e = launches(ref_kernels, who, r["cache"], "eval", r["batch"]) or r["eval"]["kernels_fused_est"] * scale
        n_w = "window" in r and (launches(ref_kernels, who, r["cache"], "window", r["batch"])
                                 or r["window"]["kernels_fused_est"] * scale)  # fmt: skip
        for gpu in GPUS:
            e = step_ms(r["eval"], gpu, n_e, launch_us)
            if "window" in r:
                w = step_ms(r["window"], gpu, n_w, launch_us)
                avg = {k: (e[k] + (evals_per_block - 1) * w[k]) / evals_per_block for k in e}
            else:
                avg = dict(e)
            out.setdefault(key, {}).setdefault(gpu, []).append(avg)
    keys = ("graphs", "launch", "overlap", "eager", "kernels_compiled")
    return {k: {g: {m: sum(a[m] for a in v) / len(v) for m in keys} for g, v in gv.items()} for k, gv in out.items()}


def break_even_launch_us(rows: list[dict], ref_kernels: dict, evals_per_block: float, cache: str, limit: float,
                         key: str, gpu: str = "h200", history: str = "full", most: float = 100.0) -> float | None:
    """The per-launch host cost (µs) at which TDLM's predicted overhead per NFE with ``cache`` reaches ``limit``,
    launches ``key`` ("overlap": issued asynchronously; "launch": added); None if it stays below at ``most`` µs.
    Bisection: the overhead grows with the launch cost (more of TDLM's extra launches are exposed)."""
    def overhead(us: float) -> float:
        avg = per_nfe(rows, ref_kernels, us, evals_per_block)
        return avg[(f"tdlm {history}", cache)][gpu][key] / avg[("backbone", cache)][gpu][key] - 1

    if overhead(most) <= limit:
        return None
    lo, hi = 0.0, most
    if overhead(lo) > limit:
        return 0.0
    for _ in range(24):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if overhead(mid) <= limit else (lo, mid)
    return lo

