"""The static storage plan's memory (``storage="static"``, tdlm/decoding/static_plan.py) at the true shape: its bytes
per row (:func:`static_plan_row`: the temporal history at its final size, the spatial KV cache of every layer, the
canvas), the history the model allocates beside the formula (:func:`static_history`), and per batch bucket 1, 2, 4,
... whether the weights, every bucket decoded so far, the transient activations and a reserve fit a GPU
(:func:`static_memory_table`). :func:`static_plan_check` holds the formula to what real decodes hold on tiny models.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tdlm.decoding import decode
from tdlm.decoding.static_plan import batch_bucket, kv_cache_bytes, prompt_bucket, static_bytes
from tdlm.models.loading import load_backbone
from tdlm.profiling.true_shape import DECODE, eval_model
from tdlm.temporal.model import TDLM, TemporalConfig
from tdlm.training.planner import GiB


def static_history(name: str, depth: int | None) -> dict:
    """The static storage plan's temporal history (``DecodeConfig.storage="static"``, tdlm/temporal/storage.py) for a
    256-token response, ``full`` and ``last:32``: its bytes per row by the formula the code states
    (``TDLM.temporal_cache_bytes(1, G, G)``, :func:`tdlm.temporal.storage.history_bytes`) beside the bytes of the
    history ``TDLM.static_histories`` allocates (fake tensors: shapes and dtypes, no storage) at batch 1 and 8. Held
    from the first evaluation for as long as the model lives (one per batch size), where the dynamic plan grows its
    buckets as the decode goes (``decode_memory``: its size at the last step).

    ``plan``: the static plan's whole memory per row (:func:`static_plan_row`): this history, the spatial KV cache
    of every layer at the canvas length the decode predictions use (prompt 256, a prompt bucket already, + 256) and
    the canvas; ``weight_bytes``: the model's parameters (backbone + adapter, bf16)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = eval_model(name, mode, "full", depth)
    G = DECODE["gen"]
    rows = []
    for history in ("full", "last:32"):
        model.set_history(history)
        with mode:
            allocated = {b: model.static_histories.history(model, b, G).nbytes() for b in (1, 8)}
        per_row = model.temporal_cache_bytes(1, G, G)
        rows.append({"history": history, "gen": G, "temporal_layers": len(model.layer_ids),
                     "d_t": model.config.heads * model.config.head_dim,
                     "dtype": str(next(model.temporal.parameters()).dtype), "per_row_bytes": per_row,
                     "allocated_bytes": {str(b): n for b, n in allocated.items()},
                     "formula_matches": all(n == b * per_row for b, n in allocated.items())})  # fmt: skip
    bb = model.backbone
    canvas_len = prompt_bucket(DECODE["prompt"]) + G
    elem = next(bb.parameters()).element_size()
    plan = {r["history"]: {c: static_plan_row(r["per_row_bytes"], bb.num_layers, bb.kv_heads, bb.head_dim,
                                              canvas_len, G, elem, c) for c in ("none", "dual")}
            for r in rows}  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"rows": rows, "canvas_len": canvas_len, "prompt": DECODE["prompt"], "prompt_bucketed": canvas_len - G,
            "layers": bb.num_layers, "kv_heads": bb.kv_heads, "head_dim": bb.head_dim, "element_size": elem,
            "weight_bytes": weights, "plan": plan,
            "capacity_slots": {"full": G, "last:32": 32}}  # fmt: skip


def static_plan_row(history_per_row: int, num_layers: int, kv_heads: int, head_dim: int, canvas_len: int, gen: int,
                    element_size: int, cache: str) -> dict:  # fmt: skip
    """Bytes per row the static plan holds for one bucket (tdlm/decoding/static_plan.py, StaticHistories): the
    temporal history at its final size, the spatial KV cache of every layer (keys and values, (kv_heads, L,
    head_dim) each, the backbone's dtype; none uncached), the canvas ids and attention mask (L int64 each), the
    reveal steps (G int64) and the NFE (one int64)."""
    kv = kv_cache_bytes(num_layers, kv_heads, head_dim, canvas_len, element_size) if cache != "none" else 0
    canvas = 2 * canvas_len * 8 + gen * 8 + 8
    return {"history": history_per_row, "kv_cache": kv, "canvas": canvas, "total": history_per_row + kv + canvas}


MEM_RESERVE = 2 * GiB  # the CUDA context, the allocator's fragmentation (decode_memory's reserve)
BUCKETS = tuple(1 << i for i in range(12))  # 1, 2, 4, ..., 2048


def transient_per_row(mem: dict | None) -> dict | None:
    """The decode's transient activations (a + b B) at TDLM full + dual, from ``decode_memory``'s MemTracker peaks
    at batch 1 and 8 less the history and spatial KV cache they hold (the static plan holds those instead)."""
    if not mem:
        return None
    act = {r["batch"]: r["peak"]["Activation"] - r["kv_cache_bytes"] - r["history_bytes"] for r in mem["rows"]
           if r["policy"] == "tdlm" and r["history"] == "full" and r["cache"] == "dual"}  # fmt: skip
    if set(act) != {1, 8}:
        return None
    slope = (act[8] - act[1]) / 7
    return {"per_row_bytes": slope, "fixed_bytes": act[1] - slope}


def static_memory_table(st: dict, budget: float, transient: dict | None, reserve: float = MEM_RESERVE,
                        cache: str = "dual") -> dict:  # fmt: skip
    """Per batch bucket (1, 2, 4, ...): what the static plan holds with ``cache`` for history full / last:32, and
    whether the model's weights + that + the transient activations of the bucket + ``reserve`` fit ``budget``.

    The plan keeps one set of buffers per bucket decoded (static_plan.py: the pool grows by one per bucket), so a
    server that has decoded every bucket up to B holds the sum of them: ``held_cumulative`` (2B - 1 rows), which is
    what ``fits`` judges; ``fits_alone`` is a process that only ever decodes bucket B. One prompt bucket (the canvas
    length of ``st``); each other prompt bucket or response length decoded adds its own set. The CUDA-graph pool's
    activations are the transient term of the largest bucket (one pool per device, replays in turn)."""
    tr = transient or {"per_row_bytes": 0.0, "fixed_bytes": 0.0}
    out: dict = {"cache": cache, "budget_bytes": budget, "reserve_bytes": reserve, "weight_bytes": st["weight_bytes"],
                 "transient": transient, "transient_source": "decode_memory (TDLM full + dual, batch 1 and 8, "
                 "MemTracker peak less history and KV cache)" if transient else "none known: reserve only",
                 "rows": [], "largest_bucket": {}, "largest_bucket_alone": {}}  # fmt: skip
    for hist, by_cache in st["plan"].items():
        per = by_cache[cache]["total"]
        for b in BUCKETS:
            act = tr["fixed_bytes"] + tr["per_row_bytes"] * b
            cum = (2 * b - 1) * per
            total = st["weight_bytes"] + cum + act + reserve
            alone = st["weight_bytes"] + b * per + act + reserve
            out["rows"].append({"history": hist, "bucket": b, "per_row_bytes": per, "held_bytes": b * per,
                                "held_cumulative_bytes": cum, "transient_bytes": act, "total_bytes": total,
                                "fits": total <= budget, "fits_alone": alone <= budget})  # fmt: skip
        fit = [r["bucket"] for r in out["rows"] if r["history"] == hist and r["fits"]]
        fit_alone = [r["bucket"] for r in out["rows"] if r["history"] == hist and r["fits_alone"]]
        out["largest_bucket"][hist] = max(fit) if fit else None
        out["largest_bucket_alone"][hist] = max(fit_alone) if fit_alone else None
    out["batch8_fits"] = {h: next(r["fits"] for r in out["rows"] if r["history"] == h and r["bucket"] == 8)
                          for h in st["plan"]}  # fmt: skip
    out["batch8_dual_fits"] = all(out["batch8_fits"].values())
    return out



def static_plan_check(history: str = "full") -> dict:
    """The per-row formula (:func:`static_plan_row`) against what a real decode holds, on tiny LLaDA and Dream
    models on this CPU: ``tdlm.decode(storage="static", cache="dual")`` of 3 prompts (bucket 4), then of 1 prompt
    (bucket 1, the same prompt bucket); ``static_bytes(backbone)`` + the model's static histories must equal
    (4 + 1) x the formula's row, exactly."""
    G, bs = 16, 8
    out = []
    for name in ("tiny-llada", "tiny-dream"):
        torch.manual_seed(0)
        bb = load_backbone(name)
        model = TDLM(bb, TemporalConfig(layers=f"dispersed:{max(1, bb.num_layers // 2)}", history=history)).eval()
        batches = [[[3, 5, 50, 51], [3, 4, 70, 71, 72, 73, 74, 75, 76], [3, 9, 60]], [[3, 4, 40, 41, 42]]]
        rows_held = 0
        for prompts in batches:
            decode(model, prompts, policy="tdlm", cache="dual", gen_length=G, block_size=bs, storage="static")
            rows_held += batch_bucket(len(prompts))
        canvas_len = prompt_bucket(max(len(p) for b in batches for p in b)) + G
        elem = next(bb.parameters()).element_size()
        row = static_plan_row(model.temporal_cache_bytes(1, G, G), bb.num_layers, bb.kv_heads, bb.head_dim,
                              canvas_len, G, elem, "dual")  # fmt: skip
        held = static_bytes(bb) + model.static_histories.nbytes()
        out.append({"model": name, "history": history, "gen": G, "canvas_len": canvas_len, "rows_held": rows_held,
                    "per_row": row, "held_bytes": held, "formula_bytes": rows_held * row["total"],
                    "matches": held == rows_held * row["total"]})  # fmt: skip
    return {"rows": out, "matches": all(r["matches"] for r in out)}
