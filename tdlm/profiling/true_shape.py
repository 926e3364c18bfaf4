"""The release models at their true shape without their weights: LLaDA-8B-Instruct and Dream-v0-Instruct-7B built as
the release configs (``tdlm.training.planner.resolve_backbone``) on the meta device with the recipe's adapter
(``configs/llada_8b.yaml`` / ``configs/dream_7b.yaml``), parameters swapped for fake bf16 tensors (shape, dtype; no
storage), and the library's own training micro-step and decode evaluations traced on them
(:func:`~tdlm.profiling.tracing.tracing`).

What is modelled rather than traced:

* **Values the host reads.** Fake tensors hold no values: ``nonzero``, a boolean index and ``int(mask.sum())``
  get the count of the batch's real supervised mask (built with real tensors, as the launcher's stream does);
  decoding's host reads are answered by :func:`trace_decode_loop` (tests) or not reached (:func:`trace_decode`
  calls ``TDLM.forward_groups`` / the backbone step at a chosen step of a chosen block, history storage grown as
  ``TemporalCache.reserve`` grows it by then).
* **ZeRO-3 (8 ranks).** DeepSpeed needs a process group and real storages, so the rank's partition of the frozen
  backbone, the gathered-layer working set, the partitioned gradients, AdamW state and the IPG bucket are the
  planner's counts of the same meta-built parameters with the DS JSON's knobs (:func:`planner_beside`). What is
  traced is everything the micro-step itself allocates (activations, recomputation, logits, loss, backward
  temporaries), the same on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tdlm.config import load_config
from tdlm.models.loading import build_backbone
from tdlm.profiling.ledger import Limits
from tdlm.profiling.roofline import GPUS
from tdlm.profiling.tracing import HostRead, cache_tensors, peak_by_category, tracing
from tdlm.temporal.model import TDLM, StepGroup
from tdlm.training.config import RunConfig
from tdlm.training.ds_config import load_ds_json, uses_activation_checkpointing
from tdlm.training.loop import temporal_config
from tdlm.training.planner import DSKnobs, inventory, plan, random_batch, resolve_backbone
from tdlm.training.planner.model import BackboneSpec

CHECKOUT = Path(__file__).resolve().parents[2]  # the recipes are files of the checkout, as tdlm.tasks' data
RECIPES = {"llada-8b": CHECKOUT / "configs" / "llada_8b.yaml", "dream-7b": CHECKOUT / "configs" / "dream_7b.yaml"}
DS_JSON = CHECKOUT / "ds_configs" / "zero3.json"


def recipe(name: str) -> tuple[RunConfig, dict]:
    """The paper recipe's run config and the DS JSON it launches with."""
    return load_config(RunConfig, RECIPES[name]), load_ds_json(DS_JSON)


def fake_model(name: str, mode: FakeTensorMode, layers: str | None = None, history: str | None = None,
               device: str = "cpu", dtype: torch.dtype = torch.bfloat16, depth: int | None = None) -> TDLM:
    """TDLM on the release architecture ``name`` with the recipe's adapter (``layers`` / ``history`` override it),
    parameters fake ``dtype`` tensors on ``device``; activation checkpointing as the launcher sets it.

    ``depth`` cuts the backbone to its first ``depth`` blocks (every block has the same shapes; tests only)."""
    run, ds = recipe(name)
    spec = resolve_backbone(name)
    cfg = spec.config
    if depth is not None:
        cfg[{"llada": "n_layers", "dream": "num_hidden_layers"}[spec.family]] = depth
    tc = temporal_config(run)
    if depth is not None and layers is None:
        layers = f"dispersed:{max(1, depth // 2)}"
    tc = dataclasses.replace(tc, **{k: v for k, v in (("layers", layers), ("history", history)) if v is not None})
    with torch.device("meta"):
        backbone = build_backbone(spec.family, cfg, spec.name).to(dtype)
        backbone.backbone_id = name
        model = TDLM(backbone, tc)
    # Module.to() cannot swap meta parameters for fake ones (weak references); set them directly.
    with mode:
        for mod in model.modules():
            for key, p in list(mod._parameters.items()):
                if p is not None:
                    fake = torch.empty_like(p, device=device)
                    mod._parameters[key] = nn.Parameter(fake, requires_grad=p.requires_grad)
    model.activation_checkpointing = uses_activation_checkpointing(ds, run)
    return model




# -- training: one launcher micro-step -------------------------------------------------------------------
TRAIN_SHAPE = {"micro_batch": 4, "states": 8, "seq_len": 768, "response_len": 256}
ALLOCATIONS = {"llada-8b": ("dispersed:8", "dispersed:16", "all"), "dream-7b": ("dispersed:8", "middle:14", "all")}


def trace_training(name: str, layers: str | None, memory: bool = True, depth: int | None = None,
                   shape: dict | None = None, flops: bool = True, live: bool = False) -> dict:  # fmt: skip
    """One micro-step of the launcher (``supervised_ce`` -> ``backward``) at true shape under FakeTensorMode.

    Returns MemTracker's peak by category, the checks' violations and the planner's prediction beside it."""
    from tdlm.training.loop import supervised_ce

    s = dict(TRAIN_SHAPE, **(shape or {}))
    B, K, L, N = s["micro_batch"], s["states"], s["seq_len"], s["response_len"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(name, mode, layers, depth=depth)
    model.train()
    real = random_batch(model.backbone, B, K, L, N, seed=0)  # real token ids: the mask and its count are real
    S = real.num_targets
    V = model.backbone.vocab_size
    batch = dataclasses.replace(real, **{k: mode.from_tensor(getattr(real, k))
                                         for k in ("input_ids", "labels", "attention_mask")})
    mode.allow_non_fake_inputs = False
    t0 = time.perf_counter()
    with mode, tracing(Limits(V, S), {B * K * L: S, S: S}, memory=memory, track=(model,),
                       flops=flops) as (ledger, fl, mt):  # fmt: skip
        ledger.live_on = live
        ce = supervised_ce(model, batch)  # the launcher's step (tdlm/training/loop.py: train_step)
        (ce / S).backward()
    out = {"model": name, "layers": layers or "recipe", "layer_ids": model.layer_ids,
           "temporal_params": model.num_temporal_parameters(), "supervised": S, "shape": s,
           "checkpointing": model.activation_checkpointing, "violations": ledger.violations[:20],
           "vocab_shapes": sorted(ledger.vocab_shapes),
           "trace_s": round(time.perf_counter() - t0, 1), "flops": fl.get_total_flops() if fl else None}  # fmt: skip
    if mt is not None:
        out["traced_peak"] = peak_by_category(mt)
    if live:
        out["live_peak"], out["live_at_peak"] = ledger.live_peak, ledger.at_peak
    out["depth"] = depth
    del ce, batch
    return out


def planner_beside(row: dict, world: int = 8) -> dict:
    """The planner at the same shape (ZeRO-3 on ``world`` GPUs, the DS JSON's knobs), and the traced peak per GPU:
    the planner's partitioned static terms (counted) + the traced activations and temporaries."""
    name, s = row["model"], row["shape"]
    spec = resolve_backbone(name)
    if row.get("depth"):  # the cut model of --quick
        cfg = spec.config | {{"llada": "n_layers", "dream": "num_hidden_layers"}[spec.family]: row["depth"]}
        spec = BackboneSpec(spec.name, spec.family, json.dumps(cfg, sort_keys=True))
    ds = load_ds_json(DS_JSON)
    knobs = DSKnobs.from_ds_config(ds, str(DS_JSON), inventory(spec).backbone.hidden)
    p = plan(spec, row["layer_ids"], None, None, states=s["states"], seq_len=s["seq_len"],
             response_len=s["response_len"], supervised=row["supervised"], micro_batch=s["micro_batch"], dtype="bf16",
             checkpointing=row["checkpointing"], zero=3, world_size=world, knobs=knobs, gpu_mem_gb=96.0)  # fmt: skip
    pk = row["traced_peak"]
    act_pred = p.backbone_activations + p.temporal_activations + p.temporal_history + p.logits + p.working
    act_traced = pk.get("Activation", 0) + pk.get("Temp", 0)
    traced_total = p.static + act_traced
    return {
        "planner_total": p.total, "planner_static": p.static, "planner_activation_side": act_pred,
        "planner_peak_phase": p.peak_phase, "traced_activation_side": act_traced, "traced_total_per_gpu": traced_total,
        "activation_ratio": act_traced / act_pred, "total_ratio": traced_total / p.total,
        "within_10pct": abs(traced_total / p.total - 1) <= 0.10,
        "planner_components": {k: v for k, v in p.to_dict().items() if isinstance(v, int) and not isinstance(v, bool)},
    }  # fmt: skip


# -- decoding: one evaluation at a chosen step ------------------------------------------------------------
DECODE = {"prompt": 256, "gen": 256, "block": 32}


def trace_decode(model: TDLM, mode: FakeTensorMode, policy: str, cache_mode: str, block: int, batch: int = 1,
                 steps_done: int = 0, memory: bool = False, limits: bool = True,
                 shape: dict | None = None) -> dict:  # fmt: skip
    """One denoiser evaluation of the decode loop's step kinds at block ``block`` of the response, as
    ``tdlm.decoding.loop`` issues it: the backbone step (``policy='backbone'``) or ``TDLM.forward_groups``
    (``'tdlm'``, a history preallocated by ``new_cache(B, length=G)`` after ``steps_done`` evaluations), then
    the loop's float64 confidence of the block. With a spatial cache the block's refresh runs first and the
    window step is traced separately (``window`` key); ``eval`` is the refresh / the uncached evaluation."""
    from tdlm.decoding.compiled import backbone_eval
    from tdlm.decoding.step_groups import window_front
    from tdlm.models.kv_cache import KVStep, SpatialKVCache

    shape = shape or DECODE
    P, G, bs = shape["prompt"], shape["gen"], shape["block"]
    dev = next(model.parameters()).device
    L, b = P + G, batch
    bb = model.backbone
    V = bb.vocab_size
    out: dict = {"policy": policy, "cache": cache_mode, "block": block, "batch": b, "steps_done": steps_done,
                 "history": str(model.policy) if policy == "tdlm" else None}  # fmt: skip
    with mode, torch.inference_mode(), tracing(Limits(V, b * bs) if limits else None, memory=memory,
                                               track=(model,), flops=not memory) as (ledger, fl, mt):  # fmt: skip
        ids = torch.zeros((b, L), dtype=torch.long, device=dev)
        start = P + block * bs
        positions = (start + torch.arange(bs, device=dev)).expand(b, bs)
        cache = None
        if policy == "tdlm":
            cache = model.new_cache(b, length=G)
            cache.steps = steps_done  # the host counter after `steps_done` evaluations
            if hasattr(cache, "reserve"):  # storage as it stands then (its growth is not this evaluation's work)
                cache.reserve(steps_done + 1)
            if block > 0:  # the loop's storage columns at the block's start: the earlier blocks are revealed
                still = torch.zeros((b, G), dtype=torch.bool, device=dev)
                still[:, block * bs :] = True
                cache.compact(still, G - block * bs)
            # the loop's promise for one row under the dual cache: its columns are its rows in order (claim_rows)
            in_order = cache_mode == "dual" and b == 1
            cache.claim_rows(in_order and cache.width == G - block * bs)
            out["history_bytes"] = ledger.watch_tensors(cache_tensors(cache))
            out["history_columns"] = cache.width
        kv_cache = SpatialKVCache(cache_mode, b) if cache_mode != "none" else None
        kinds = [("eval", KVStep(kv_cache, True) if kv_cache is not None else None)]
        if kv_cache is not None:
            kinds.append(("window", None))
        for kind, step in kinds:
            if kind == "window":
                step = KVStep.window(kv_cache, torch.full((b,), start, device=dev), bs, L, bb.logit_shift,
                                     host_starts=[start] * b)  # fmt: skip
                if cache is not None:  # the loop's front: the block's columns come first (window_front)
                    front = window_front([block], [block], [bs], bs, model.offset, G)
                    if in_order:  # as the loop: the window's rows from (logit shift - offset), in order
                        cache.set_front(min(front, bs + model.offset), aligned=True)
                    else:
                        cache.set_front(front if cache_mode == "dual" else cache.width)
            ledger.reset()
            if mt is not None:
                mt.reset_mod_stats()  # one MemTracker over both forwards (it counts one call per module)
            f0 = fl.get_total_flops() if fl is not None else 0
            if policy == "tdlm":
                logits = model.forward_groups(P, cache, [StepGroup(ids, None, positions, step, None)])[0]
            else:
                logits = backbone_eval(bb, ids, None, positions, step)
            conf, x0 = torch.log_softmax(logits.double(), dim=-1).max(-1)  # the loop's confidence (float64)
            del conf, x0, logits
            tot = ledger.totals()
            out[kind] = {**tot, "flop_counter": fl.get_total_flops() - f0 if fl is not None else None,
                         "violations": ledger.violations[:20],
                         "roofline_ms": {g: {"eager": ledger.roofline_ms(spec, False), "fused":
                                             ledger.roofline_ms(spec, True)} for g, spec in GPUS.items()},
                         # the fused kernels' µs in order (for overlapped_ms); dropped from the JSON (strip_timelines)
                         "_kernel_us": {g: ledger.kernel_us(spec) for g, spec in GPUS.items()}}  # fmt: skip
        if mt is not None:
            out["peak"] = peak_by_category(mt)
            out["kv_cache_bytes"] = kv_cache.nbytes() if kv_cache is not None else 0
    return out


def trace_decode_loop(model: TDLM, mode: FakeTensorMode, cache_mode: str, batch: int = 2,
                      evaluations: int | None = None) -> dict:  # fmt: skip
    """``tdlm.decode`` itself (policy tdlm, 256 tokens in blocks of 32 after prompts of up to 256 tokens, the last
    row shorter: left-padded) traced through its first ``evaluations`` evaluations (default: 1 uncached; 2 with a
    spatial cache, a refresh then a window step). Host reads are answered with zeros (no row done, block 0) until
    the LM head has produced that many block logits; the next host read ends the trace."""
    from tdlm.decoding import decode

    G, bs, P = DECODE["gen"], DECODE["block"], DECODE["prompt"]
    want = evaluations or (1 if cache_mode == "none" else 2)
    V = model.backbone.vocab_size
    limits = Limits(V, batch * bs)
    state = {"answered": 0}

    def heads() -> int:
        return sum(1 for o in ledger.ops if o["op"] in ("aten.mm", "aten.addmm") and o.get("out_vocab"))

    def on_read(func, t):
        if heads() >= want or state["answered"] > 64:
            raise HostRead(f"{func.__name__} after {heads()} head outputs")
        state["answered"] += 1
        zero = False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        return torch.full(t.shape, zero).tolist() if func is torch.Tensor.tolist else zero

    prompts = [[3 + (i % 97) for i in range(P - (r == batch - 1) * 17)] for r in range(batch)]
    ended = None
    with mode, tracing(limits, memory=False, on_read=on_read, flops=False) as (ledger, _, _):
        try:
            decode(model, prompts, policy="tdlm", cache=cache_mode, gen_length=G, block_size=bs)
        except HostRead as e:
            ended = str(e)
    return {"cache": cache_mode, "batch": batch, "head_outputs": heads(), "ended_at": ended,
            "violations": ledger.violations[:20], "vocab_shapes": sorted(ledger.vocab_shapes),
            "kernels": len(ledger.ops)}  # fmt: skip


def eval_model(name: str, mode: FakeTensorMode, history: str, depth: int | None) -> TDLM:
    """:func:`fake_model` with history ``history``, in eval mode (the decode traces' model)."""
    model = fake_model(name, mode, history=history, depth=depth)
    return model.eval()

