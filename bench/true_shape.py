"""The 8B claims checked at the true shape without a GPU (issue 27): traced memory, FLOPs and bytes per NFE,
and a predicted H200 / GH200 / H100 time to hold the first GPU run to.

A thin driver over :mod:`tdlm.profiling` (the counter, tracers, cost model and static-plan tables live there).
Everything runs on this CPU under ``FakeTensorMode``: LLaDA-8B-Instruct and Dream-v0-Instruct-7B are built as the
release configs (``tdlm.training.planner.resolve_backbone``) on the meta device with the adapter of
``configs/llada_8b.yaml`` / ``configs/dream_7b.yaml``, and their parameters are swapped for fake bf16 tensors
(shape, dtype; no storage). The library code then runs unchanged; torch's own tools watch its dispatch:

* ``torch.distributed._tools.mem_tracker.MemTracker``: live tensor bytes by category (parameters, gradients,
  optimizer state, activations, temporaries) and their peak (``mem_tracker``: it would hook the gradient of
  every parameter, which raises on the frozen backbone's, so those are skipped);
* ``torch.utils.flop_counter.FlopCounterMode``: FLOPs (never in the same pass as MemTracker under autograd: its
  module hooks keep each module's output alive until backward, which undoes activation checkpointing);
* ``tdlm.profiling.ledger.Ledger`` (a ``TorchDispatchMode``): bytes each op reads and writes, kernel counts, the
  temporal history's own traffic, and the true-shape checks (vocabulary-wide tensors beyond the LM head's rows, float64,
  int32 offsets); composite-only ops are split into the kernels they run.

What is modelled rather than traced, and why:

* **The GPU's attention kernel.** This torch is a CPU build: fake tensors live on the CPU device (a fake CUDA
  tensor cannot even be indexed without CUDA), where SDPA would pick the CPU kernel. ``F.scaled_dot_product_attention``
  is swapped (``gpu_sdpa``) for the kernel an H100/H200 uses for bf16: flash attention without a mask,
  memory-efficient attention with one (a boolean mask becomes its additive bias). The aten ops, their meta shapes
  and backward formulas are torch's own.
* **Values the host reads.** Fake tensors hold no values: ``nonzero``, a boolean index and ``int(mask.sum())``
  get the count of the batch's real supervised mask (built with real tensors, as the launcher's stream does);
  decoding's host reads are answered by ``trace_decode_loop`` (tests) or not reached (the bench calls
  ``TDLM.forward_groups`` / the backbone step at a chosen step of a chosen block, history storage grown as
  ``TemporalCache.reserve`` grows it by then).
* **ZeRO-3 (8 ranks).** DeepSpeed needs a process group and real storages, so the rank's partition of the frozen
  backbone, the gathered-layer working set, the partitioned gradients, AdamW state and the IPG bucket are the
  planner's counts of the same meta-built parameters with the DS JSON's knobs (``ds_configs/zero3.json``). What
  is traced is everything the micro-step itself allocates (activations, recomputation, logits, loss, backward
  temporaries), the same on every rank: one process runs the launcher's step
  (``tdlm.training.loop.supervised_ce``, then ``backward``) on one rank's micro-batch.
* **Roofline.** Per op: max(FLOPs / peak, bytes / bandwidth). "eager" counts every op's bytes and every op as a
  launch; "fused" drops the bytes of pointwise ops (a compiler folds them into a neighbour), a lower bound for the
  compiled graph. The launch term is kernels per NFE of the compiled graph (``bench/results/dispatch_count.json``:
  inductor's generated ``call()`` of the decode loop's own graphs at width 64 and true depth, per step kind; a kind
  not counted there is scaled from the uncached count by a fusion-aware count of its ops) times ``--launch-us``
  (5 µs, stated); about 0 with CUDA graphs (``compile="reduce-overhead"``). It is
  applied two ways: *added* to the roofline (the host serialised with the GPU: an upper bound), and *overlapped*
  (``overlapped_ms``): CUDA launches are asynchronous, so the host issues the kernels one launch cost apart
  while the GPU runs them for their roofline times, and a launch costs time only where the host falls behind (the
  first kernels of an NFE, runs of kernels shorter than a launch). The loop's one host read per NFE empties the
  queue, so each NFE starts its timeline at zero. The per-launch cost at which each target would fail is printed
  (``launch_us_at_target``), a number the first GPU run checks (``bench/gpu_check.py`` profiles kernels per NFE
  and the GPU's busy time against the wall).

**The static storage plan** (``storage="static"``; ``static_history``, section ``static_history``): its memory per
row at the decode predictions' shape (prompt 256, already a prompt bucket, + 256): the temporal history at its final
size (``full``: 256 slots; ``last:32``), the spatial KV cache of every layer (bf16) and the canvas (ids, attention
mask, reveal steps, NFE; int64), and per batch bucket 1, 2, 4, ... on an H200 (141 GB): the weights, every bucket
decoded so far (the plan keeps one set per bucket: 2B - 1 rows), the transient activations of ``decode_memory``
and a 2 GiB reserve; the largest bucket that fits and whether batch 8 with the dual cache does
(``memory.batch8_dual_fits``). ``static_plan_check``: the per-row formula against what real decodes with
``storage="static", cache="dual"`` hold on tiny models (``static_bytes(backbone)`` + the histories, exact).

**Reduce-overhead rows** (section ``reduce_overhead``, from ``gpu_check``'s rows; ``--merge`` derives it too):
``compile="reduce-overhead"`` (CUDA graphs: launches about 0) against ``compile=True`` (launches at ``--launch-us``)
for each setting bench/gpu_check.py times, named as it names them, written before any GPU run.

Usage:  python bench/true_shape.py [--out bench/results/true_shape.json] [--quick] [--skip train,memory,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the checkout's tdlm, not an installed one

from tdlm.profiling.predictions import (  # noqa: E402
    GPU_CHECK,
    decode_memory,
    decode_table,
    gpu_check_predictions,
    reduce_overhead_predictions,
)
from tdlm.profiling.roofline import (  # noqa: E402
    GPUS,
    LAUNCH_US,
    break_even_launch_us,
    compiled_kernels,
    per_nfe,
    strip_timelines,
)
from tdlm.profiling.static_memory import (  # noqa: E402
    BUCKETS,
    static_history,
    static_memory_table,
    static_plan_check,
    transient_per_row,
)
from tdlm.profiling.true_shape import ALLOCATIONS, DECODE, TRAIN_SHAPE, planner_beside, trace_training  # noqa: E402
from tdlm.training.planner import GiB  # noqa: E402

PAPER = {"ms_per_nfe": 585.0 / 40.08, "gsm8k_s": 0.585, "nfe": 40.08, "device": "GH200, compiled, batch 1",
         "source": "paper Table 4, '16, dispersed (main)': 0.585 s for 40.08 NFE"}  # fmt: skip
KERNELS_JSON = ROOT / "bench" / "results" / "dispatch_count.json"


def _earlier(path: str | Path, key: str) -> dict:
    """Section ``key`` of the JSON at ``path`` (an earlier run of this bench), {} if there is none."""
    try:
        return json.loads(Path(path).read_text()).get(key) or {}
    except (OSError, ValueError):
        return {}


def print_static(name: str, st: dict) -> None:
    """The static plan's memory per row and its bucket table (``static_history`` + ``static_memory_table``)."""
    print(f"\nstatic storage plan, {name}: per row, {DECODE['gen']}-token response, canvas {st['canvas_len']} "
          f"(prompt {st['prompt']} bucketed to {st['prompt_bucketed']}) (MiB):")  # fmt: skip
    for r in st["rows"]:
        for cache, p in st["plan"][r["history"]].items():
            print(f"  {r['history']:8s} {r['temporal_layers']} of {st['layers']} layers, cache {cache:4s}: history "
                  f"{p['history'] / 2**20:8.1f} + KV cache {p['kv_cache'] / 2**20:6.1f} + canvas "
                  f"{p['canvas'] / 2**20:6.3f} = {p['total'] / 2**20:8.1f} (history formula matches allocation: "
                  f"{r['formula_matches']})")  # fmt: skip
    m = st.get("memory")
    if not m:
        return
    tr = m["transient"] or {"per_row_bytes": 0, "fixed_bytes": 0}
    print(f"  H200 {m['budget_bytes'] / 1e9:.0f} GB: weights {m['weight_bytes'] / GiB:.2f} GiB + reserve "
          f"{m['reserve_bytes'] / GiB:.0f} GiB + transient {tr['fixed_bytes'] / 2**20:.0f} MiB + "
          f"{tr['per_row_bytes'] / 2**20:.1f} MiB/row ({m['transient_source']}); cache {m['cache']}; held = every "
          f"bucket up to B decoded (2B - 1 rows) (GiB)")  # fmt: skip
    print(f"  {'bucket':>6s} " + " ".join(f"{h + ' held':>14s} {'total':>7s} {'fits':>4s}" for h in st["plan"]))
    hists = list(st["plan"])
    for b in BUCKETS:
        cells = []
        for h in hists:
            r = next(x for x in m["rows"] if x["history"] == h and x["bucket"] == b)
            cells.append(f"{r['held_cumulative_bytes'] / GiB:14.2f} {r['total_bytes'] / GiB:7.1f} "
                         f"{'yes' if r['fits'] else 'no':>4s}")  # fmt: skip
        print(f"  {b:6d} " + " ".join(cells))
        if not any(x["fits"] for x in m["rows"] if x["bucket"] == b):
            break
    print(f"  largest bucket that fits: {m['largest_bucket']} (a process decoding that bucket only: "
          f"{m['largest_bucket_alone']}); batch 8 + dual fits: {m['batch8_dual_fits']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "true_shape.json"))
    ap.add_argument("--quick", action="store_true", help="4 blocks deep (shapes per block unchanged): a smoke run")
    ap.add_argument("--models", default="llada-8b,dream-7b")
    ap.add_argument("--launch-us", type=float, default=LAUNCH_US, help="µs per kernel launch without CUDA graphs")
    ap.add_argument("--kernels", default=str(KERNELS_JSON),
                    help="bench/dispatch_count.py JSON whose compiled kernel counts set the launch term")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: train, memory, static, nfe, gpu_check")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine the sections of earlier runs' JSON files (later files win) into --out and reprint "
                         "the table; nothing is traced")  # fmt: skip
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    from benchlib import machine, write_result  # bench/ is sys.path[0] when run as a script

    depth = 4 if args.quick else None
    skip = set(filter(None, args.skip.split(",")))
    models = args.models.split(",")
    result: dict = {"machine": machine(), "load_before": os.getloadavg(), "quick": args.quick, "gpus": GPUS,
                    "paper": PAPER,
                    "launch_us": args.launch_us, "decode_shape": DECODE, "train_shape": TRAIN_SHAPE,
                    "method": "FakeTensorMode at true shape; MemTracker, FlopCounterMode, Ledger (bench/true_shape.py "
                              "docstring: what is traced and what is modelled)"}  # fmt: skip
    t0 = time.perf_counter()
    if "train" not in skip:
        result["train"] = []
        print("training micro-step (launcher path), traced peak vs planner (ZeRO-3, 8 GPUs, ds_configs/zero3.json):")
        print(f"{'model':9s} {'layers':13s} {'traced act+tmp':>14s} {'planner act':>11s} {'traced/GPU':>10s} "
              f"{'planner/GPU':>11s} {'ratio':>6s}  planner peak at")  # fmt: skip
        for name in models:
            for alloc in ALLOCATIONS[name]:
                if depth is not None:
                    alloc = "dispersed:2"
                # FLOPs in another pass: FlopCounterMode's module hooks keep every module output alive until
                # backward, which would undo activation checkpointing in the memory trace.
                row = trace_training(name, alloc, depth=depth, flops=False)
                row |= planner_beside(row)
                result["train"].append(row)
                print(f"{name:9s} {alloc:13s} {row['traced_activation_side'] / GiB:14.2f} "
                      f"{row['planner_activation_side'] / GiB:11.2f} {row['traced_total_per_gpu'] / GiB:10.2f} "
                      f"{row['planner_total'] / GiB:11.2f} {row['total_ratio']:6.3f}  {row['planner_peak_phase']}"
                      f"  [{row['trace_s']:.0f} s]", flush=True)  # fmt: skip
                if depth is not None:
                    break
    if "memory" not in skip:
        result["decode_memory"] = {}
        h200 = GPUS["h200"]["mem"]
        for name in models:
            mem = decode_memory(name, depth, h200, 2 * GiB)
            result["decode_memory"][name] = mem
            print(f"\ndecode memory, {name}, last step of a 256-token response (MemTracker peak, GiB):")
            for r in mem["rows"]:
                print(f"  {r['policy']:8s} {r['history'] or '-':8s} cache {r['cache']:5s} batch {r['batch']}: "
                      f"{r['peak']['Total'] / GiB:7.2f} (history {r['history_bytes'] / GiB:.2f}, "
                      f"spatial KV {r['kv_cache_bytes'] / GiB:.2f})")  # fmt: skip
            g = mem["generation"]
            print(f"  generation (backbone, no cache): {g['per_row_bytes'] / 2**20:.1f} MiB per row -> largest batch "
                  f"in 141 GB with 2 GiB reserve: {g['max_batch']} (traced there: {g['peak_at_max_batch'] / GiB:.1f} "
                  f"GiB, fits {g['fits']})")  # fmt: skip
    if "static" not in skip:
        result["static_history"] = {}
        # the transient activations: this run's decode_memory, else an earlier run's (--out, then the checked-in file)
        known = (result.get("decode_memory") or _earlier(args.out, "decode_memory")
                 or _earlier(ROOT / "bench" / "results" / "true_shape.json", "decode_memory"))  # fmt: skip
        for name in models:
            st = static_history(name, depth)
            st["memory"] = static_memory_table(st, GPUS["h200"]["mem"], transient_per_row(known.get(name)))
            result["static_history"][name] = st
            print_static(name, st)
        checks = [static_plan_check(h) for h in ("full", "last:4")]
        result["static_plan_check"] = {"rows": [r for c in checks for r in c["rows"]],
                                       "matches": all(c["matches"] for c in checks)}  # fmt: skip
        print(f"  static plan formula vs a real decode (tiny LLaDA / Dream, storage='static', cache='dual', buckets "
              f"4 + 1): exact {result['static_plan_check']['matches']}")  # fmt: skip
    if "nfe" not in skip:
        kernels = compiled_kernels(args.kernels)
        evals_per_block = PAPER["nfe"] / (DECODE["gen"] / DECODE["block"])
        blocks = (0, DECODE["gen"] // DECODE["block"] - 1)
        result["nfe"] = {}
        for name in models:
            rows, secs = decode_table(name, depth, blocks, PAPER["nfe"])
            avg = per_nfe(rows, kernels[name], args.launch_us, evals_per_block)
            even_by_gpu = {gpu: {f"{cache}|{key}": break_even_launch_us(rows, kernels[name], evals_per_block, cache,
                                                                        lim, key, gpu=gpu)
                                 for cache, lim in TARGETS.items() for key in ("launch", "overlap")}
                           for gpu in GPUS}  # fmt: skip
            even = even_by_gpu["h200"]  # the targets are stated on an H200
            result["nfe"][name] = {"rows": rows, "trace_s": secs, "evals_per_block": evals_per_block,
                                   "per_nfe_ms": {f"{k[0]}|{k[1]}": v for k, v in avg.items()},
                                   "launch_us_at_target": even, "launch_us_at_target_by_gpu": even_by_gpu,
                                   "compiled_kernels": kernels[name],
                                   "compiled_kernels_source": str(args.kernels)}  # fmt: skip
        result["table"] = summary_table(result, models)
        result["targets"] = targets(result)
        print_targets(result["targets"], args.launch_us)
    if "gpu_check" not in skip:
        kernels = compiled_kernels(args.kernels)
        result["gpu_check"] = {"shape": GPU_CHECK, "gpus": list(GPUS), "rows": [  # each row names its gpu
            r for name in models for r in gpu_check_predictions(name, depth, kernels[name], args.launch_us)]}
        result["reduce_overhead"] = reduce_overhead_predictions(result["gpu_check"], args.launch_us)
    result["seconds"] = time.perf_counter() - t0
    result["load_after"] = os.getloadavg()
    write_result(args.out, strip_timelines(result))
    return 0


def merge(paths: list[str], out: str) -> int:
    """One result from the sections of several runs (each run's machine record kept under ``parts``)."""
    from benchlib import write_result

    result: dict = {"parts": []}
    for p in paths:
        part = json.loads(Path(p).read_text())
        sections = [k for k in ("train", "decode_memory", "static_history", "static_plan_check", "nfe", "gpu_check")
                    if k in part]  # fmt: skip
        mine = {"file": str(p), "machine": part["machine"], "quick": part["quick"], "sections": sections}
        # a merged file brings its own parts (the runs its sections came from), less the sections merged over
        result["parts"] = [dict(q, sections=[k for k in q["sections"] if k not in sections])
                           for q in result["parts"]]  # fmt: skip
        result["parts"] = [q for q in result["parts"] if q["sections"]] + part.get("parts", [mine])
        for key in ("gpus", "paper", "launch_us", "decode_shape", "train_shape", "method", "machine", "quick"):
            result[key] = part[key]
        if "train" in part:
            keep = {(r["model"], r["layers"]) for r in part["train"]}
            result["train"] = [r for r in result.get("train", []) if (r["model"], r["layers"]) not in keep]
            result["train"] += part["train"]
        for key in ("decode_memory", "static_history", "nfe"):
            if key in part:
                result.setdefault(key, {}).update(part[key])
        if "static_plan_check" in part:
            result["static_plan_check"] = part["static_plan_check"]
        if "gpu_check" in part:
            models = {r["model"] for r in part["gpu_check"]["rows"]}
            rows = [r for r in result.get("gpu_check", {}).get("rows", []) if r["model"] not in models]
            result["gpu_check"] = part["gpu_check"] | {"rows": rows + part["gpu_check"]["rows"]}
    if "gpu_check" in result:  # predictions derived from the gpu_check rows (no tracing)
        result["reduce_overhead"] = reduce_overhead_predictions(result["gpu_check"], result["launch_us"])
    for name, st in result.get("static_history", {}).items():
        if "memory" in st:
            print_static(name, st)
    if "nfe" in result:
        result["table"] = summary_table(result, list(result["nfe"]))
        result["targets"] = targets(result)
        print_targets(result["targets"], result["launch_us"])
    write_result(out, result)
    return 0


def summary_table(result: dict, models: list[str]) -> list[dict]:
    """One row per (model, cache): predicted ms/NFE for backbone and TDLM (full / last:32) on H200 and GH200,
    TDLM's overhead, the history's traffic per NFE against its size, predicted GSM8K seconds (paper NFE x ms)."""
    out = []
    hdr = (f"{'model':9s} {'cache':6s} {'history':8s} {'GPU':6s} {'bb ms':>7s} {'tdlm ms':>8s} {'ovh %':>6s} "
           f"{'bb ovl':>7s} {'tdlm ovl':>8s} {'ovh % ovl':>9s} {'ovh % CG':>8s} {'hist read/size':>14s} "
           f"{'copies/size':>11s} {'GSM8K s':>8s}")  # fmt: skip
    print("\npredicted per NFE, batch 1, prompt 256 + 256: fused roofline + the compiled graph's launches added (ms, "
          "ovh %), issued asynchronously (ovl), and with CUDA graphs (CG)")
    print(hdr)
    for name in models:
        nfe = result["nfe"][name]
        avg = nfe["per_nfe_ms"]
        for cache in ("none", "prefix", "dual"):
            for hist in ("full", "last:32"):
                tdlm_rows = [r for r in nfe["rows"] if r["label"] == f"tdlm {hist}" and r["cache"] == cache]
                size = max(r["history_bytes"] for r in tdlm_rows)
                steps = [r[k] for r in tdlm_rows for k in ("eval", "window") if k in r]
                h_read = max(s["hist_read"] for s in steps)
                copies = max(s["copy_read"] + s["copy_written"] for s in steps)
                for gpu in GPUS:
                    bb, td = avg[f"backbone|{cache}"][gpu], avg[f"tdlm {hist}|{cache}"][gpu]
                    row = {"model": name, "cache": cache, "history": hist, "gpu": gpu,
                           "backbone_ms": bb["launch"], "tdlm_ms": td["launch"],
                           "backbone_ms_cuda_graphs": bb["graphs"], "tdlm_ms_cuda_graphs": td["graphs"],
                           "backbone_ms_eager_bound": bb["eager"], "tdlm_ms_eager_bound": td["eager"],
                           "backbone_ms_overlapped": bb["overlap"], "tdlm_ms_overlapped": td["overlap"],
                           "overhead": td["launch"] / bb["launch"] - 1,
                           "overhead_overlapped": td["overlap"] / bb["overlap"] - 1,
                           "overhead_cuda_graphs": td["graphs"] / bb["graphs"] - 1,
                           "history_bytes": size, "history_read_max": h_read, "history_copies_max": copies,
                           "history_reads_per_size": h_read / size if size else 0.0,
                           "gsm8k_s": PAPER["nfe"] * td["launch"] * 1e-3}  # fmt: skip
                    out.append(row)
                    print(f"{name:9s} {cache:6s} {hist:8s} {gpu:6s} {bb['launch']:7.2f} {td['launch']:8.2f} "
                          f"{100 * row['overhead']:6.2f} {bb['overlap']:7.2f} {td['overlap']:8.2f} "
                          f"{100 * row['overhead_overlapped']:9.2f} {100 * row['overhead_cuda_graphs']:8.2f} "
                          f"{row['history_reads_per_size']:14.2f} {copies / size if size else 0:11.3f} "
                          f"{row['gsm8k_s']:8.3f}")  # fmt: skip
    print(f"paper ({PAPER['device']}): {PAPER['ms_per_nfe']:.1f} ms/NFE, GSM8K {PAPER['gsm8k_s']} s at "
          f"{PAPER['nfe']} NFE")  # fmt: skip
    return out


def print_targets(t: dict, launch_us: float) -> None:
    """The issue's targets, one line per cache: each launch model's overhead and the launch cost it holds up to."""
    def upto(us):
        return "beyond 100 µs" if us is None else f"up to {us:.1f} µs"

    print(f"\ntargets, LLaDA-8B 16 of 32 layers, H200, history full ({launch_us:g} µs per launch):")
    for key, r in t.items():
        if r["limit"] is None or not key.endswith("|full"):
            continue
        verdict = (lambda ok: "met" if ok else "NOT MET")  # noqa: E731
        print(f"  {key.split('|')[0]:5s} <= {100 * r['limit']:.0f}%: launches added "
              f"{100 * r['overhead_launches']:+.2f}% "
              f"({verdict(r['met_launches'])}; holds {upto(r.get('launch_us_at_limit_added'))}), overlapped "
              f"{100 * r['overhead_overlapped']:+.2f}% ({verdict(r['met_overlapped'])}; holds "
              f"{upto(r.get('launch_us_at_limit_overlapped'))}), CUDA graphs {100 * r['overhead_cuda_graphs']:+.2f}% "
              f"({verdict(r['met_cuda_graphs'])})")  # fmt: skip


TARGETS = {"none": 0.03, "dual": 0.06}  # issue 27: TDLM's overhead per NFE at 16 of 32 layers


def targets(result: dict) -> dict:
    """The issue's targets on the LLaDA recipe (16 of 32 layers), H200: overhead per NFE <= 3% uncached, <= 6% with
    the dual cache (with CUDA graphs; with the stated launch cost issued asynchronously; and added, the host-serialised
    bound), and the history read at most once per NFE."""
    out = {}
    for r in result.get("table", []):
        if r["model"] != "llada-8b" or r["gpu"] != "h200":
            continue
        key = f"{r['cache']}|{r['history']}"
        lim = TARGETS.get(r["cache"])
        out[key] = {"overhead_launches": r["overhead"], "overhead_overlapped": r.get("overhead_overlapped"),
                    "overhead_cuda_graphs": r["overhead_cuda_graphs"],
                    "limit": lim, "met_launches": None if lim is None else r["overhead"] <= lim,
                    "met_overlapped": None if lim is None or "overhead_overlapped" not in r
                    else r["overhead_overlapped"] <= lim,
                    "met_cuda_graphs": None if lim is None else r["overhead_cuda_graphs"] <= lim,
                    "history_reads_per_size": r["history_reads_per_size"],
                    "history_one_read": r["history_reads_per_size"] <= 1.0 + 1e-3}  # fmt: skip
        if lim is not None and r["history"] == "full":
            even = result["nfe"]["llada-8b"].get("launch_us_at_target", {})
            # the per-launch cost up to which the target holds (None: beyond 100 µs), a number the GPU run can check
            out[key] |= {"launch_us_at_limit_added": even.get(f"{r['cache']}|launch"),
                         "launch_us_at_limit_overlapped": even.get(f"{r['cache']}|overlap")}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
