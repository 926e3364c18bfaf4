"""The GPU check's last step: each measured number beside its prediction for this GPU (bench/gpu_check.py).

The parent calls :func:`beside_predicted` after the stages, whatever they left: it reads ``<out>/gpu_<stage>.json``,
picks the prediction rows of ``bench/results/true_shape.json`` that hold for the GPU the stages ran on
(``gpu_check_common.gpu_kind``, ``gpu_check_common.select_predictions``), prints the table and writes
``<out>/predicted_vs_measured.json``. Standard library only: the parent never imports torch.

A ``reduce-overhead`` setting (``compile="reduce-overhead"``, ``storage="static"``) is held to the ``reduce-overhead``
prediction of its (model, batch, cache) row (true_shape.json's ``reduce_overhead`` section: the fused roofline,
launches about 0), and its ms/NFE over the same setting's compile=True one on the same static plan
(``.../compiled-static``) to the predicted ratio (``reduce-overhead/compiled-static`` rows: with the launches added,
and issued asynchronously as ``overlapped``): one factor apart, CUDA graphs alone. The storage plan's own cost is its
own ratio, ``compiled-static/compiled`` (compile=True, static over dynamic). Both pairings:
``gpu_check_common.RATIOS``.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_check_common import (
    GPU_KINDS,
    HOST_US_PER_LAUNCH_IS,
    PREDICTION,
    RATIOS,
    STAGE_ORDER,
    gpu_kind,
    read_json,
    select_predictions,
    write_json,
)


def _loop_kernels(kernels: dict, policy: str, cache: str, batch: int, block: int) -> float | None:
    """Kernels per NFE of the decode loop's own compiled graphs (bench/dispatch_count.py --loop): uncached, one
    evaluation; dual, a block's refresh and ``block - 1`` window steps (one token per evaluation here)."""
    who = "tdlm" if policy == "tdlm" else "backbone"
    loop = kernels.get("loop", {})
    if cache == "none":
        return (loop.get("none", {}).get(who, {}).get("eval")) or kernels.get(who)
    counts = loop.get("dual rows in order" if batch == 1 else "dual gathered", {}).get(who, {})
    if counts.get("eval") is None or counts.get("window") is None:
        return None
    return (counts["eval"] + (block - 1) * counts["window"]) / block


def _policies(row: dict) -> tuple[str, ...]:
    """The policies a setting ran (``gpu_check_plan._setting``: both unless its name ends in one)."""
    return tuple(row.get("policies") or ("threshold", "tdlm"))


def cuda_graph_proof(row: dict, policy: str) -> str | None:
    """Why a reduce-overhead setting's ``policy`` number is not a CUDA-graph number, or None when it is: inductor
    skipped none of its graphs (``<policy>_cudagraph_skips`` 0: a skipped graph runs without CUDA graphs, silently
    but for a log line) and its profile saw CUDA graphs replayed (``cudaGraphLaunch`` calls). Neither recorded is
    not a proof either."""
    skips = row.get(f"{policy}_cudagraph_skips")
    graphs = (row.get(f"{policy}_launches") or {}).get("graph_launches")
    why = []
    if skips is None:
        why.append("cudagraph_skips not recorded")
    elif skips > 0:
        why.append(f"inductor skipped CUDA graphs {skips} times (cudagraph_skips)")
    if graphs is None:
        why.append("no profile of its graph launches")
    elif graphs == 0:
        why.append("no cudaGraphLaunch in its profile")
    return "; ".join(why) or None


def _diverge_rows(m: dict, policy: str, gpu_check: dict) -> list[dict]:
    """The rows that diverge (``.../diverge``, bench/gpu_check_nfe.py): how many distinct evaluations its requests
    finished at (predicted 2: the planted request a block per evaluation, the others a token per evaluation), and
    its ms/NFE beside the reduce-overhead prediction interpolated between the batch-1 and batch-8 rows at the
    static plan's bucket (its padding row is computed too)."""
    from math import ceil, log2

    bucket = 2 ** ceil(log2(m["batch"]))
    nfe = m.get(f"{policy}_nfe") or []
    lo, hi = (gpu_check.get((m["model"], b, m["cache"]), {}).get(f"{policy}_ms_per_nfe", {}).get(m["mode"])
              for b in (1, 8))  # fmt: skip
    want = lo + (hi - lo) * (bucket - 1) / 7 if lo and hi else None
    mark = {"not_cuda_graphs": cuda_graph_proof(m, policy)} if m["mode"] == "reduce-overhead" else {}
    return [{"what": f"rows finish apart {m['model']} b{m['batch']} (bucket {bucket}) {m['cache']} {policy}",
             "unit": "", "measured": len(set(nfe)) if nfe else None, "predicted": 2, "nfe": nfe,
             "source": "a peaked head row planted for request 0 (bench/gpu_check_nfe.py plant_divergence)"},
            {"what": f"ms/NFE {m['model']} b{m['batch']} {m['cache']} {m['mode']} diverge {policy}", "unit": "ms",
             "measured": m.get(f"{policy}_ms_per_nfe_full_depth", m.get(f"{policy}_ms_per_nfe")), "predicted": want,
             "source": f"true_shape.json gpu_check {m['mode']}, b1..b8 interpolated at {bucket} rows", **mark}]


def beside_predicted(out: Path, dry_run: bool, prediction: Path = PREDICTION) -> dict:
    """Each measured number (this run's stage JSONs in ``out``) beside its prediction for this GPU; printed,
    written to ``<out>/predicted_vs_measured.json`` and returned."""
    suffix = "_dryrun" if dry_run else ""
    docs = {s: read_json(out / f"gpu_{s}{suffix}.json") for s in STAGE_ORDER}
    if not prediction.exists():
        print(f"[gpu_check] no prediction at {prediction}: run python bench/true_shape.py", flush=True)
        return {"status": "skipped", "reason": f"{prediction} missing"}
    pred = json.loads(prediction.read_text())
    name = next((d["machine"].get("name") for d in docs.values() if d.get("machine", {}).get("name")), None)
    kind = "h200" if dry_run else gpu_kind(name)  # a dry run holds its toy numbers to the H200 rows: code path only
    # memory, planner and kernel counts hold on any GPU; only the time rows need a GPU true_shape models
    sel = select_predictions(pred, kind)
    gpu_says = (f"{name or 'no GPU'}: " + (f"the {kind.upper()} rows" if kind else
                f"not a GPU the time predictions model ({', '.join(k.upper() for k in GPU_KINDS)}): only the "
                "GPU-independent rows (memory, planner, kernel counts)") + (" (dry run)" if dry_run else ""))
    rows: list[dict] = []
    traced = {r["layers"]: r for r in pred.get("train", []) if r["model"] == "llada-8b" and "traced_peak" in r}
    for m in docs["train"].get("rows", []):
        t = traced.get(m.get("layers"))
        want = t["traced_peak"]["Total"] + 4 * t["temporal_params"] if t else None  # + bf16 AdamW m, v
        rows.append({"what": f"train peak, llada-8b {m.get('layers', m['item'])}, one process", "unit": "GiB",
                     "measured": m["measured"] / 2**30 if m.get("measured") else None,
                     "predicted": want / 2**30 if want else None,
                     "planner": m["predicted"] / 2**30 if m.get("predicted") else None})  # fmt: skip
    for m in docs["deepspeed"].get("rows", []):
        planner = (m.get("planner") or {}).get("total")
        rows.append({"what": f"DeepSpeed peak, {m.get('layers')}, ZeRO-3 one rank", "unit": "GiB",
                     "measured": m["max_allocated"] / 2**30 if m.get("max_allocated") else None,
                     "predicted": planner / 2**30 if planner else None,
                     "source": "plan(zero=3, world_size=1), ds_configs/zero3.json knobs"})  # fmt: skip
    block = docs["nfe"].get("block_size", 32)
    # the setting each mode of RATIOS is held against: same model, batch, cache and policy, the paired mode
    # (a ratio is taken within one depth and one compile scope only: gpu_check_plan.compile_scope); a setting may run
    # one policy, and another setting of the same mode the other
    by_mode = {(m["mode"], m["model"], m["batch"], m["cache"], m.get("layers"), m.get("scope"), policy): m
               for m in docs["nfe"].get("rows", []) if m.get("purpose") == "speed" and "mode" in m
               for policy in _policies(m)}  # fmt: skip
    pair_of = dict(RATIOS)
    for m in docs["nfe"].get("rows", []):
        if "mode" not in m:
            continue
        key, model = (m["model"], m["batch"], m["cache"]), m["model"]
        p = sel["gpu_check"].get(key)
        for policy in _policies(m):
            if m["purpose"] == "memory":
                label = "backbone" if policy == "threshold" else "tdlm full"
                want = sel["decode_memory"].get((model, "backbone" if policy == "threshold" else "tdlm",
                                                 None if policy == "threshold" else "full", m["cache"], m["batch"]))
                mem = m.get(f"{policy}_memory") or {}
                rows.append({"what": f"decode peak {model} b{m['batch']} {m['cache']} gen{m['gen_length']} {policy}",
                             "unit": "GiB", "measured": mem["decode_peak"] / 2**30 if mem else None,
                             "predicted": want["peak"]["Total"] / 2**30 if want else None,
                             "source": "true_shape.json decode_memory (last step, MemTracker)"})  # fmt: skip
                per = sel["per_nfe"].get((model, label, m["cache"])) if m["batch"] == 1 else None
                if per:
                    rows.append({"what": f"ms/NFE {model} b1 {m['cache']} eager gen{m['gen_length']} {policy}",
                                 "unit": "ms", "measured": m.get(f"{policy}_ms_per_nfe"), "predicted": per["eager"],
                                 "source": "true_shape.json nfe per_nfe_ms (eager bound)"})  # fmt: skip
                continue
            if m["purpose"] == "diverge":
                rows += _diverge_rows(m, policy, sel["gpu_check"])
                continue
            pm = p[f"{policy}_ms_per_nfe"] if p else {}
            compiled = m["mode"] in ("compiled", "compiled-static")  # compile=True, either storage plan
            # a reduce-overhead number is a CUDA-graph number only when proven (no skip, graphs replayed)
            mark = ({"not_cuda_graphs": cuda_graph_proof(m, policy)} if m["mode"] == "reduce-overhead" else {})
            # the depth option: measured at m["layers"] layers, extrapolated per layer to the full depth
            depth = (f" (at {m['layers']} of {m['full_layers']} layers, x{m['full_layers'] / m['layers']:g})"
                     if m.get("layers") else "")  # fmt: skip
            rows.append({"what": f"ms/NFE {model} b{m['batch']} {m['cache']} {m['mode']} {policy}{depth}",
                         "unit": "ms", "predicted": pm.get(m["mode"]), "scope": m.get("scope"),
                         "measured": m.get(f"{policy}_ms_per_nfe_full_depth", m.get(f"{policy}_ms_per_nfe")),
                         # compiled: the launches added (above) or issued asynchronously (here), and none
                         "predicted_overlapped": pm.get("compiled_overlapped") if compiled else None,
                         "predicted_cuda_graphs": pm.get("cuda_graphs") if compiled else None, **mark})  # fmt: skip
            if m["mode"] in pair_of:  # one factor apart (RATIOS): CUDA graphs alone, or the storage plan alone
                over = pair_of[m["mode"]]
                base_row = by_mode.get((over, *key, m.get("layers"), m.get("scope"), policy), {})
                base, mine = base_row.get(f"{policy}_ms_per_nfe"), m.get(f"{policy}_ms_per_nfe")
                mine_p, base_p = pm.get(m["mode"]), pm.get(over)
                ro = m["mode"] == "reduce-overhead"
                ovl = mine_p / pm["compiled_overlapped"] if ro and mine_p and pm.get("compiled_overlapped") else None
                rows.append({"what": f"{m['mode']}/{over} {model} b{m['batch']} {m['cache']} {policy}", "unit": "",
                             "measured": mine / base if mine and base else None,
                             "predicted": mine_p / base_p if mine_p and base_p else None,
                             "predicted_overlapped": ovl, "pairs": [m["item"], base_row.get("item")],
                             **({} if base_row else {"unpaired": f"no {over} setting at {m.get('layers') or 'full'} "
                                                      f"layers, {m.get('scope')} scope"}),
                             "source": "true_shape.json reduce_overhead (roofline / + launches)" if ro else
                             "true_shape.json gpu_check (the static plan modelled by the dynamic trace)",
                             **mark})  # fmt: skip
            # the compile=True launch profile's rows; a reduce-overhead profile only proves its graph launches
            prof = (m.get(f"{policy}_launches") or {}) if m["mode"] == "compiled" else {}
            if prof.get("kernels_per_nfe_compiled") is not None:
                rows.append({"what": f"kernels/NFE in compiled region {model} b1 {m['cache']} {policy}", "unit": "",
                             "measured": prof["kernels_per_nfe_compiled"],
                             "predicted": _loop_kernels(sel["kernels"].get(model, {}), policy, m["cache"], 1, block),
                             "source": "dispatch_count.json loop graphs (inductor's call())"})  # fmt: skip
            if prof.get("host_us_per_launch") is not None:
                even = sel["launch_us_at_target"].get(model, {})
                rows.append({"what": f"host µs/launch {model} b1 {m['cache']} {policy}", "unit": "µs",
                             "measured": prof["host_us_per_launch"], "predicted": sel["launch_us"],
                             "holds_up_to_added": even.get(f"{m['cache']}|launch"),
                             "holds_up_to_overlapped": even.get(f"{m['cache']}|overlap"),
                             "source": HOST_US_PER_LAUNCH_IS})  # fmt: skip
            if prof.get("busy_over_wall") is not None:
                busy = pm["cuda_graphs"] / pm["compiled_overlapped"] if pm.get("compiled_overlapped") else None
                rows.append({"what": f"GPU busy/wall {model} b1 {m['cache']} compiled {policy}", "unit": "",
                             "measured": prof["busy_over_wall"], "predicted": busy,
                             "source": "roofline / overlapped prediction"})  # fmt: skip
    checks = {s: {"status": d.get("status", "not run"), "items": d.get("items", {}),
                  **({"loss_finite": d["loss_finite"]} if "loss_finite" in d else {})}
              for s, d in docs.items() if d}  # fmt: skip
    print(f"[gpu_check] measured beside predicted ({prediction.name}; {gpu_says}):")
    fmt = (lambda v: "   n/a" if v is None else f"{v:8.2f}")  # noqa: E731
    for r in rows:
        r["ratio"] = r["measured"] / r["predicted"] if r["measured"] and r["predicted"] else None
        more = "".join(f"  {label} {fmt(r[k])}" for k, label in (
            ("predicted_overlapped", "overlapped"), ("predicted_cuda_graphs", "CUDA graphs"), ("planner", "planner"),
            ("holds_up_to_overlapped", "target holds to")) if r.get(k) is not None)  # fmt: skip
        print(f"  {r['what']:52s} measured {fmt(r['measured'])} {r['unit']:3s} predicted {fmt(r['predicted'])}"
              + ("" if r["ratio"] is None else f"  ratio {r['ratio']:.2f}") + more
              + (f"  NOT a CUDA-graph number ({r['not_cuda_graphs']})" if r.get("not_cuda_graphs") else "")
              + (f"  not paired: {r['unpaired']}" if r.get("unpaired") else ""),
              flush=True)  # fmt: skip
    for s, c in checks.items():
        cut = ", ".join(f"{k} ({v})" for k, v in c["items"].items() if v != "ok")
        print(f"  stage {s:10s} {c['status']:8s}" + (f" loss finite: {c['loss_finite']}" if "loss_finite" in c else "")
              + (f"  not ok: {cut}" if cut else ""), flush=True)  # fmt: skip
    result = {"status": "ok", "prediction": str(prediction), "dry_run": dry_run, "gpu": name, "gpu_kind": kind,
              "gpu_rows": gpu_says, "rows": rows, "stages": checks}  # fmt: skip
    write_json(out / f"predicted_vs_measured{suffix}.json", result)
    return result

