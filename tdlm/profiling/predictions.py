"""The 8B time predictions per NFE, written before any GPU run: the roofline table of the decode loop's step kinds
(:func:`decode_table`), its memory at the last step (:func:`decode_memory`), and the settings ``bench/gpu_check.py``
measures (:func:`gpu_check_predictions`, :func:`reduce_overhead_predictions`), each a traced
:func:`~tdlm.profiling.true_shape.trace_decode` priced by :mod:`tdlm.profiling.roofline`.
"""

from __future__ import annotations

import time

from torch._subclasses.fake_tensor import FakeTensorMode

from tdlm.profiling.roofline import GPUS, launches, step_ms
from tdlm.profiling.true_shape import DECODE, eval_model, trace_decode


def decode_table(name: str, depth: int | None, blocks: tuple[int, ...], nfe: float) -> tuple[list[dict], float]:
    """Every decode row of the roofline table for ``name``: backbone / TDLM full / TDLM last:32 x none / prefix /
    dual x first / last block, batch 1; the last block after ``nfe - 1`` evaluations (the paper's run)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = eval_model(name, mode, "full", depth)
    rows = []
    t0 = time.perf_counter()
    for label, policy, history in (("backbone", "backbone", None), ("tdlm full", "tdlm", "full"),
                                   ("tdlm last:32", "tdlm", "last:32")):  # fmt: skip
        if history is not None:
            model.set_history(history)
        for cache in ("none", "prefix", "dual"):
            for blk in blocks:
                steps = 0 if blk == 0 else int(round(nfe)) - 1
                r = trace_decode(model, mode, policy, cache, blk, 1, steps)
                r["label"] = label
                rows.append(r)
                print(f"  [{time.perf_counter() - t0:6.0f} s] {name} {label:13s} {cache:6s} block {blk}: "
                      f"{r['eval']['roofline_ms']['h200']['fused']:.2f} ms fused (H200)"
                      + (f", window {r['window']['roofline_ms']['h200']['fused']:.2f}" if "window" in r else ""),
                      flush=True)  # fmt: skip
    return rows, time.perf_counter() - t0


def decode_memory(name: str, depth: int | None, budget: float, reserve: float) -> dict:
    """MemTracker's peak of one evaluation at the last step of a 256-token response (255 evaluations before it,
    one token each: the fullest history): batch 1 and 8, cache none / dual, history full / last:32, backbone
    (generation's teacher decoding) and TDLM; and the largest generation batch that fits ``budget`` bytes."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = eval_model(name, mode, "full", depth)
    G = DECODE["gen"]
    rows = []
    for policy, history in (("backbone", None), ("tdlm", "full"), ("tdlm", "last:32")):
        if history is not None:
            model.set_history(history)
        for cache in ("none", "dual"):
            for b in (1, 8):
                r = trace_decode(model, mode, policy, cache, G // DECODE["block"] - 1, b, G - 1, memory=True,
                                 limits=False)  # fmt: skip
                rows.append({k: r[k] for k in ("policy", "cache", "batch", "history", "peak", "kv_cache_bytes")}
                            | {"history_bytes": r.get("history_bytes", 0)})  # fmt: skip
    # Generation (configs/gen_*.yaml): backbone, cache none. Peak = parameters + a + b B (linear in B).
    gen = {r["batch"]: r["peak"]["Total"] for r in rows if r["policy"] == "backbone" and r["cache"] == "none"}
    slope = (gen[8] - gen[1]) / 7
    fixed = gen[1] - slope
    b_max = int((budget - reserve - fixed) // slope)
    check = trace_decode(model, mode, "backbone", "none", G // DECODE["block"] - 1, b_max, G - 1, memory=True,
                         limits=False)["peak"]["Total"]  # fmt: skip
    return {"rows": rows, "generation": {"budget_bytes": budget, "reserve_bytes": reserve, "per_row_bytes": slope,
                                         "fixed_bytes": fixed, "max_batch": b_max, "peak_at_max_batch": check,
                                         "fits": check + reserve <= budget}}  # fmt: skip



GPU_CHECK = {"prompt": 256, "gen": 64, "block": 32}  # bench/gpu_check.py's nfe stage


def gpu_check_predictions(name: str, depth: int | None, ref_kernels: dict, launch_us: float) -> list[dict]:
    """Predicted ms per NFE for the settings bench/gpu_check.py measures (prompt 256 + 64 in blocks of 32, random
    weights: one token per evaluation, so 32 evaluations per block): backbone (threshold) and TDLM (the recipe's
    allocation), batch 1 and 8, cache none / dual; eager = the unfused bound, compiled = fused + launches added,
    compiled_overlapped = fused with the launches issued asynchronously (:func:`overlapped_ms`), cuda_graphs = fused.
    One row per (setting, GPU of :data:`GPUS`), its ``gpu`` field naming the GPU: the trace is the same, only the
    roofline's peak and bandwidth differ. ``compiled-static`` (compile=True with ``storage="static"``) is the
    compiled prediction: the static plan's storage is modelled by the dynamic plan's trace (see
    :func:`reduce_overhead_predictions`), so static / dynamic is predicted to be 1."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = eval_model(name, mode, "full", depth)
    bs = GPU_CHECK["block"]
    rows = []
    for batch in (1, 8):
        base = {p: trace_decode(model, mode, p, "none", 0, batch, 0, limits=False,
                                shape=GPU_CHECK)["eval"]["kernels_fused_est"] for p in ("backbone", "tdlm")}
        for cache in ("none", "dual"):
            steps = {}  # policy -> the traced steps (GPU-independent; each GPU's roofline is in them)
            for policy in ("threshold", "tdlm"):
                steps[policy] = [trace_decode(model, mode, "tdlm" if policy == "tdlm" else "backbone", cache, blk,
                                              batch, blk * bs + bs // 2, limits=False, shape=GPU_CHECK)
                                 for blk in range(GPU_CHECK["gen"] // bs)]  # fmt: skip
            for gpu in GPUS:
                row = {"model": name, "gpu": gpu, "batch": batch, "cache": cache}
                for policy in ("threshold", "tdlm"):
                    kind = "tdlm" if policy == "tdlm" else "backbone"
                    scale = ref_kernels[kind] / base[kind]  # as in per_nfe, where the loop's graph was not counted
                    pred = {}
                    for mode_name, key in (("eager", "eager"), ("compiled", "launch"),
                                           ("compiled_overlapped", "overlap"), ("cuda_graphs", "graphs")):
                        per = []
                        for r in steps[policy]:
                            n_e = (launches(ref_kernels, kind, cache, "eval", batch)
                                   or r["eval"]["kernels_fused_est"] * scale)  # fmt: skip
                            e = step_ms(r["eval"], gpu, n_e, launch_us)[key]
                            if "window" in r:
                                n_w = (launches(ref_kernels, kind, cache, "window", batch)
                                       or r["window"]["kernels_fused_est"] * scale)  # fmt: skip
                                w = step_ms(r["window"], gpu, n_w, launch_us)[key]
                                e = (e + (bs - 1) * w) / bs
                            per.append(e)
                        pred[mode_name] = sum(per) / len(per)
                    pred["compiled-static"] = pred["compiled"]  # the static plan modelled by the dynamic trace
                    pred["reduce-overhead"] = pred["cuda_graphs"]  # compile="reduce-overhead": CUDA graphs, launches ~0
                    row[f"{policy}_ms_per_nfe"] = pred
                rows.append(row)
                th, td = row["threshold_ms_per_nfe"], row["tdlm_ms_per_nfe"]
                print(f"  gpu_check setting {name} b{batch} {cache} {gpu.upper()}: threshold {th['eager']:.2f} eager / "
                      f"{th['compiled']:.2f} compiled, launches added / {th['compiled_overlapped']:.2f} overlapped; "
                      f"tdlm {td['eager']:.2f} / {td['compiled']:.2f} / {td['compiled_overlapped']:.2f} ms",
                      flush=True)  # fmt: skip
    return rows


def reduce_overhead_predictions(section: dict, launch_us: float) -> dict:
    """bench/gpu_check.py's reduce-overhead settings predicted, written before any GPU run: per gpu_check row (model,
    batch, cache) and policy, ``compile="reduce-overhead"`` (CUDA graphs: the launch term about 0, the fused
    roofline, the row's ``cuda_graphs``) beside ``compile=True`` on the same static plan (the compiled graph's
    launches at ``launch_us`` each: added, the row's ``compiled-static``, and issued asynchronously,
    ``compiled_overlapped``). Each row names the measured setting it is held to (``setting``:
    ``<model>/b<batch>/<cache>/reduce-overhead``) and the compile=True setting it is compared with (``versus``: the
    ``compiled-static`` one, so the ratio measures CUDA graphs alone, not the storage plan as well), as
    bench/gpu_check_compare.py pairs them; ``static_over_dynamic`` is compiled-static / compiled (``static_versus``).
    One row per GPU of the section's rows (``gpu``).

    Modelled, not traced: the static plan's own storage (a history that never compacts, a dual window of one row
    that gathers its columns, bench/gpu_check.py runs reduce-overhead with ``storage="static"``) is the dynamic
    plan's trace here; at the check's 64-token response the history is at most 64 columns either way."""
    rows = []
    for r in section.get("rows", []):
        for policy in ("threshold", "tdlm"):
            pm = r[f"{policy}_ms_per_nfe"]
            pm.setdefault("reduce-overhead", pm["cuda_graphs"])  # the key gpu_check_compare reads for the mode
            pm.setdefault("compiled-static", pm["compiled"])  # a section written before the compiled-static setting
            ro, added, ovl = pm["reduce-overhead"], pm["compiled-static"], pm["compiled_overlapped"]
            stem = f"{r['model']}/b{r['batch']}/{r['cache']}"
            rows.append({"model": r["model"], "gpu": r.get("gpu", section.get("gpu")), "batch": r["batch"],
                         "cache": r["cache"], "policy": policy, "setting": f"{stem}/reduce-overhead",
                         "versus": f"{stem}/compiled-static", "static_versus": f"{stem}/compiled",
                         "reduce_overhead_ms_per_nfe": ro, "compile_true_ms_per_nfe": added,
                         "compile_true_overlapped_ms_per_nfe": ovl, "ratio_added": ro / added,
                         "ratio_overlapped": ro / ovl,
                         "static_over_dynamic": pm["compiled-static"] / pm["compiled"]})  # fmt: skip
    out = {"gpus": sorted({x["gpu"] for x in rows}, key=str), "shape": section.get("shape"), "launch_us": launch_us,
           "rows": rows,
           "what": "ms per NFE: reduce-overhead = fused roofline (launches ~0); compile=True (static plan) = fused + "
                   "launches added (upper bound) / issued asynchronously; ratio = reduce-overhead / compiled-static; "
                   "static_over_dynamic = compiled-static / compiled (modelled: 1)"}  # fmt: skip
    print(f"\npredicted reduce-overhead vs compile=True on the static plan, ms/NFE (prompt 256 + 64, {launch_us:g} µs "
          f"per launch without CUDA graphs):")  # fmt: skip
    print(f"  {'setting':34s} {'GPU':6s} {'policy':9s} {'reduce-ovh':>10s} {'True added':>10s} {'True ovl':>9s} "
          f"{'ratio':>6s}")  # fmt: skip
    for x in rows:
        print(f"  {x['setting']:34s} {x['gpu']:6s} {x['policy']:9s} {x['reduce_overhead_ms_per_nfe']:10.2f} "
              f"{x['compile_true_ms_per_nfe']:10.2f} {x['compile_true_overlapped_ms_per_nfe']:9.2f} "
              f"{x['ratio_added']:6.3f}")  # fmt: skip
    return out

