"""The GPU check's child: one stage's settings in one process, its JSON after every one (bench/gpu_check.py).

Started by the parent (``gpu_check.run_stage``) in its own process group, which the parent kills at the stage's
deadline; never run by hand except to debug a stage::

    python bench/gpu_check_stages.py nfe --items '["llada-8b/b1/none/compiled"]' --json /tmp/gpu_nfe.json --dry-run

It writes ``--json`` after its setup, when a setting starts (``running``), inside a setting when a part of it
finished (``partial``) and after every setting; the parent reads that file and writes the stage's final status.
Exit status 3 after a CUDA error: it poisons this process, so the parent goes on with the next setting in a new one.

* ``train``: real training steps on random LLaDA-8B-shaped weights (bf16) at the target shape (4 x 64 heads, K 8,
  L 768 with 256 response tokens, micro-batch 4, activation checkpointing), all 32 layers and 16 dispersed, one
  process without ZeRO: ``torch.cuda.max_memory_allocated`` after the warm-up step and a peak reset, next to
  ``tdlm.training.planner.plan(zero=0)``; every loss must be finite (``loss_finite``).
* ``deepspeed``: ``deepspeed.initialize`` with ``ds_configs/zero3.json`` on one rank (NCCL), TDLM at dispersed:16,
  3 steps at the train stage's shape. Peak memory after ``torch.cuda.reset_peak_memory_stats`` (at the stage's
  start and again after the warm-up step), next to ``plan(zero=3, world_size=1)`` with the DS JSON's knobs; every
  loss finite. DeepSpeed is imported first, before any backbone is built (:func:`deepspeed_preflight`); the stage
  is skipped when that import fails in any way (its wheels travel in ``.whl/``, see gpu_check.sh).
* ``nfe``: ``tdlm.decode`` as users run it, LLaDA-8B and Dream-7B shape (random bf16 weights), prompt 256 + 64 in
  blocks of 32, batch 1 and a left-padded batch of 8, cache none / dual, compiled (``compile=True``) and eager,
  threshold vs tdlm (half the layers, dispersed, live adapter): ms per NFE and TDLM / backbone; and
  ``compile="reduce-overhead"`` with ``storage="static"`` (CUDA graphs; ``gpu_check.compile_kw``) at batch 1 and 8,
  none / dual, beside compile=True on the same static plan (``compiled-static``;
  ``reduce_overhead_over_compiled_static``), which is beside compile=True dynamic
  (``compiled_static_over_compiled``). Each setting decodes once untimed (compiles;
  reduce-overhead also records its CUDA graphs at the static plan's addresses) and once timed (replays). Batch-1
  ``compile=True`` settings and every reduce-overhead one decode once more under ``torch.profiler``
  (:func:`launch_profile`): kernels per NFE launched inside the compiled region only, the host time per launch and
  the ``cudaGraphLaunch`` calls (:func:`region_counts`). Every setting records inductor's ``cudagraph_skips``
  counter over its decodes (``<policy>_cudagraph_skips``): a reduce-overhead setting with a skip, or without a graph
  launch, is not a CUDA-graph number (the comparison marks it). ``/gen256``
  settings decode a 256-token response once per policy for the decode memory at true_shape.json's
  ``decode_memory`` shape (max allocated after a peak reset).
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

from gpu_check import HOOKS_ENV, compile_kw, hook, nfe_settings
from gpu_check_common import HOST_US_PER_LAUNCH_IS, RATIOS, ROOT, gpu_kind, read_json, write_json

ANCHOR_MS_PER_NFE = 585.0 / 40.08  # paper, Table 4 "16, dispersed (main)": 0.585 s for 40.08 NFE (GH200)


# -- the child: one stage's settings, its JSON after every one ----------------------------------------------------
def child_main(stage: str, items: list[str], path: Path, dry_run: bool) -> int:
    """Build what the stage needs, then run ``items`` in order, writing ``path`` after each (module docstring)."""
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
    doc = read_json(path) or {"stage": stage, "rows": []}  # a restarted child keeps the rows before it
    doc.update(status="running", running=None)

    def write():
        doc["updated"] = time.time()
        write_json(path, doc)

    try:
        # what a stage needs imported before anything is built: a stage that cannot import it is skipped at once,
        # before the backbone's build (seconds, and GB of GPU memory) and not after
        skip = PREFLIGHT[stage]() if stage in PREFLIGHT else None
        if skip:
            doc.update(status="skipped", reason=skip)
            write()
            return 0
        ctx = build_context(stage, dry_run)
        doc["machine"] = ctx.info
        setup = STAGES[stage][0](ctx)
        if setup.get("status") == "skipped":
            doc.update(status="skipped", reason=setup["reason"])
            write()
            return 0
        doc.update(setup)
        write()
    except Exception as e:
        doc.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
        write()
        return 1
    for item in items:
        doc["running"] = {"item": item, "since": time.time()}
        write()

        def partial(row: dict, item=item) -> None:  # inside a setting: what finished so far survives a kill
            doc["running"]["partial"] = row
            write()

        t = time.perf_counter()
        try:
            h = hook("sleep", stage, item)
            if h:
                time.sleep(h[3])
            if hook("raise", stage, item):
                raise RuntimeError(f"planted by {HOOKS_ENV}")
            if hook("cudaerror", stage, item):
                raise RuntimeError(f"CUDA error: an illegal memory access was encountered (planted by {HOOKS_ENV})")
            row = STAGES[stage][1](ctx, item, partial)
        except Exception as e:  # a failing setting is a result, not the end of the stage
            row = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:1000]}",
                   "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        row = {"item": item, **row, "seconds": time.perf_counter() - t}
        row.setdefault("status", "ok")
        doc["rows"].append(row)
        doc["running"] = None
        STAGES[stage][2](doc)
        write()
        print(f"[gpu_check] {stage} {item}: {row['status']} in {row['seconds']:.1f} s"
              + (f" ({row['error'][:200]})" if "error" in row else ""), flush=True)  # fmt: skip
        if "CUDA error" in row.get("error", ""):  # a sticky CUDA error poisons this process: go on in a new one
            doc["restart"] = True
            write()
            return 3
        ctx.cleanup()
    doc["status"] = "done"  # the parent writes the stage's final status
    write()
    return 0


def build_context(stage: str, dry_run: bool) -> SimpleNamespace:
    import torch
    from gpu_train_probe import TINY, build_backbone

    from tdlm.models.llada import LLaDAConfig

    cuda = torch.cuda.is_available() and not dry_run
    if not cuda and not dry_run:
        raise RuntimeError("no CUDA device; use --dry-run on a CPU")
    device = torch.device("cuda:0" if cuda else "cpu")
    dtype_name = "bf16" if cuda else "fp32"
    cfg = TINY if dry_run else LLaDAConfig()
    t0 = time.perf_counter()
    backbone = build_backbone(cfg, device, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name], 0)
    if hook("nan", stage):  # every loss becomes NaN: the finiteness check must catch it
        with torch.no_grad():
            for n, p in backbone.named_parameters():
                if "wte" in n or "embed_tokens" in n:
                    p.fill_(float("nan"))
    info = device_info(device) | {"dry_run": dry_run, "backbone_build_s": time.perf_counter() - t0}

    def cleanup():
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    return SimpleNamespace(cfg=cfg, device=device, cuda=cuda, dry_run=dry_run, dtype_name=dtype_name,
                           backbone=backbone, info=info, cleanup=cleanup, models={})  # fmt: skip


def device_info(device) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "host": socket.gethostname(), "device": str(device)}  # fmt: skip
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, total_memory=p.total_memory, capability=list(torch.cuda.get_device_capability()),
                    cuda=torch.version.cuda, gpu_kind=gpu_kind(p.name))  # fmt: skip
    return info


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def losses_finite(losses: list[float]) -> bool:
    return bool(losses) and all(math.isfinite(x) for x in losses)


def _check_losses(row: dict) -> dict:
    row["loss_finite"] = losses_finite(row.get("losses", []))
    if row.get("status", "ok") == "ok" and not row["loss_finite"]:
        row.update(status="failed", error=f"non-finite loss: {row.get('losses')}")
    return row


def _summary_losses(doc: dict) -> None:
    rows = [r for r in doc["rows"] if "loss_finite" in r]
    doc["loss_finite"] = all(r["loss_finite"] for r in rows) if rows else None


# -- train --------------------------------------------------------------------------------------------------
def _train_shape(ctx) -> dict:
    if ctx.dry_run:
        return dict(micro_batch=2, states=4, seq_len=48, response_len=16, heads=2, head_dim=16)
    return dict(micro_batch=4, states=8, seq_len=768, response_len=256, heads=4, head_dim=64)


def train_setup(ctx) -> dict:
    return {"shape": _train_shape(ctx), "checkpointing": True,
            "note": "one process, no ZeRO: torch.cuda.max_memory_allocated after the warm-up step and a peak reset "
                    "(PeakMeter) vs plan(zero=0, world_size=1)"}  # fmt: skip


def train_item(ctx, spec: str, partial) -> dict:
    import torch
    from gpu_train_probe import run_config

    args = SimpleNamespace(**_train_shape(ctx), dtype=ctx.dtype_name, steps=3, seed=0, reserve_gb=2.0)
    mem_gb = (torch.cuda.get_device_properties(ctx.device).total_memory / 2**30) if ctx.cuda else 24.0
    row = run_config(ctx.backbone, ctx.cfg, spec, True, args, ctx.device, mem_gb)
    row.pop("plan", None)
    row.pop("layers", None)
    row = {"layers": spec, **row, "peak_reset": "PeakMeter: reset after the warm-up step"}
    if row["status"] == "OOM":
        row["status"] = "failed"
    return _check_losses(row)


# -- deepspeed ----------------------------------------------------------------------------------------------
def deepspeed_preflight() -> str | None:
    """Import DeepSpeed before the stage builds anything; why the stage is skipped, or None. Any failure skips it:
    not only an ImportError (no wheels carried) but whatever its import chain raises on this image, e.g. a SystemError
    from a pydantic / pydantic-core version mismatch, an AttributeError from a torch it does not know. DeepSpeed's
    import is the environment's, not the code's under test: "failed" stays for the step itself."""
    try:
        import deepspeed  # noqa: F401  (imported for the stage: deepspeed_setup and deepspeed_item use it)
    except Exception as e:
        return (f"DeepSpeed not importable ({type(e).__name__}: {str(e)[:300]}); carry .whl "
                "(gpu_check.sh --fetch)")  # fmt: skip
    return None


def deepspeed_setup(ctx) -> dict:
    import deepspeed  # imported already by deepspeed_preflight, before the backbone was built

    return {"deepspeed": deepspeed.__version__, "zero_stage": 3, "world_size": 1}


def deepspeed_item(ctx, item: str, partial) -> dict:
    import deepspeed
    import torch

    from tdlm.training.loop import supervised_ce
    from tdlm.training.planner import DSKnobs, PeakMeter, plan, random_batch

    if ctx.cuda:  # a stage's peak is its own: nothing before it may show in max_memory_allocated
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if ctx.cuda else "gloo", verbose=False)
    shape = _train_shape(ctx)
    B, K, L, N = shape["micro_batch"], shape["states"], shape["seq_len"], shape["response_len"]
    model = _live(ctx.backbone, ctx.dry_run)
    model.activation_checkpointing = True
    model.train()
    ds_cfg = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    ds_cfg.update(train_batch_size=B, train_micro_batch_size_per_gpu=B, gradient_accumulation_steps=1,
                  gradient_clipping=1.0, steps_per_print=10**9)  # fmt: skip
    ds_cfg["optimizer"]["params"] = {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0,
                                     "torch_adam": True}  # fmt: skip
    ds_cfg["bf16"] = {"enabled": ctx.dtype_name == "bf16"}
    batch = random_batch(ctx.backbone, B, K, L, N, 0).to(ctx.device)
    mem_gb = (torch.cuda.get_device_properties(ctx.device).total_memory / 2**30) if ctx.cuda else 24.0
    p = plan(ctx.cfg, model.layer_ids, model.config.heads, model.config.head_dim, states=K, seq_len=L,
             response_len=N, supervised=batch.num_targets, micro_batch=B, dtype=ctx.dtype_name, checkpointing=True,
             zero=3, world_size=1, knobs=DSKnobs.from_ds_config(ds_cfg, "zero3.json", ctx.cfg.d_model),
             gpu_mem_gb=mem_gb, reserve_gb=0.0 if ctx.dry_run else 2.0)  # fmt: skip
    row: dict = {"layers": f"dispersed:{len(model.layer_ids)}", "shape": dict(B=B, K=K, L=L, N=N),
                 "planner": {"total": p.total, "peak_phase": p.peak_phase, "zero": 3, "world_size": 1,
                             "components": {k: v for k, v in p.to_dict().items()
                                            if isinstance(v, int) and not isinstance(v, bool)}}}  # fmt: skip
    partial(row)  # the planner's figure survives a kill during initialize or the steps
    params = [q for q in model.parameters() if q.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_cfg)
    for q in model.temporal.parameters():
        deepspeed.zero.register_external_parameter(model, q)
    losses, times = [], []

    def step():
        sync(ctx.device)
        t = time.perf_counter()
        loss = supervised_ce(engine, batch) / batch.num_targets
        engine.backward(loss)
        engine.step()
        sync(ctx.device)
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
        partial(row | {"losses": losses, "step_s": times})

    step()  # warm-up: DeepSpeed's optimizer states and buffers; the planner counts them as static
    row["peak_reset"] = {"when": "after deepspeed.initialize and the warm-up step, before the measured steps",
                         "allocated_at_reset": torch.cuda.memory_allocated(ctx.device) if ctx.cuda else None}
    with PeakMeter(ctx.device) as meter:  # CUDA: reset_peak_memory_stats; CPU: the profiler's allocation events
        for _ in range(2):
            step()
    row.update(losses=losses, step_s=times, peak_delta=meter.peak_delta, max_allocated=meter.peak,
               ratio=meter.peak / p.total if meter.peak else None)  # fmt: skip
    if ctx.cuda:
        row["max_reserved"] = torch.cuda.max_memory_reserved(ctx.device)
    return _check_losses(row)


# -- nfe --------------------------------------------------------------------------------------------------
def _shape(ctx, setting: dict) -> tuple[int, int, int]:
    P, G, bs = (8, 16, 8) if ctx.dry_run else (256, 64, 32)
    return P, setting.get("gen") or G, bs


def nfe_setup(ctx) -> dict:
    P, G, bs = _shape(ctx, {})
    return {"prompt_len": P, "gen_length": G, "block_size": bs, "threshold": 0.9, "dtype": ctx.dtype_name,
            "compile": "eager" if ctx.dry_run else True,
            "compile_by_mode": {m: compile_kw(m, ctx.dry_run) for m in
                                ("compiled", "compiled-static", "reduce-overhead", "eager")},
            "anchor_ms_per_nfe_gh200": ANCHOR_MS_PER_NFE,
            "settings": {s["name"]: s for s in nfe_settings(ctx.dry_run)}}  # fmt: skip


def _dream(dry_run: bool, device, dtype):
    """Random-init Dream-7B (or a toy Dream): meta build -> cast -> to_empty -> seeded init, as for LLaDA."""
    import torch

    from tdlm.models.dream import Dream, DreamConfig
    from tdlm.training.planner.measure import init_random_

    tiny = DreamConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=176, vocab_size=512, mask_token_id=2, eos_token_id=1, pad_token_id=0,
                       torch_dtype="float32")  # fmt: skip
    with torch.device("meta"):
        model = Dream(tiny if dry_run else DreamConfig())
    model = model.to(dtype).to_empty(device=device)
    init_random_(model, 1)
    model.backbone_id = "dream-tiny-random" if dry_run else "dream-7b-random"
    return model.freeze()


def _live(backbone, dry_run: bool):
    """TDLM at the paper's allocation (half the layers, dispersed) with a live adapter (nonzero W_O)."""
    import torch

    from tdlm.temporal.model import TDLM, TemporalConfig

    heads, head_dim = (2, 16) if dry_run else (4, 64)
    model = TDLM(backbone, TemporalConfig(layers=f"dispersed:{backbone.num_layers // 2}", heads=heads,
                                          head_dim=head_dim))  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for mod in model.temporal.values():
            w = torch.randn(mod.o_proj.weight.shape, generator=g) * 0.02
            mod.o_proj.weight.copy_(w.to(mod.o_proj.weight.dtype))
    return model.eval()


def _models(ctx, name: str):
    """(backbone, TDLM) of ``name``, built on first use: a stage that never reaches Dream never builds it."""
    import torch

    if name not in ctx.models:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[ctx.dtype_name]
        bb = ctx.backbone if name == "llada-8b" else _dream(ctx.dry_run, ctx.device, dtype)
        ctx.models[name] = (bb, _live(bb, ctx.dry_run))
    return ctx.models[name]


def nfe_item(ctx, name: str, partial) -> dict:
    """One decode setting (``nfe_settings``), threshold then tdlm; ``partial`` after each policy."""
    import torch

    import tdlm
    from tdlm.training.planner import PeakMeter, tensor_bytes

    s = next(x for x in nfe_settings(ctx.dry_run) if x["name"] == name)
    P, G, bs = _shape(ctx, s)
    bb, live = _models(ctx, s["model"])
    g = torch.Generator(device="cpu").manual_seed(1000 * s["batch"] + P)  # the same prompts after a restart
    rows = torch.randint(3, min(bb.vocab_size, 1000), (s["batch"], P), generator=g).tolist()
    req = [r[: P - (i * P) // (2 * s["batch"])] for i, r in enumerate(rows)]  # left-padded when batch > 1
    # profiled after the timed decode: compile=True at batch 1 (kernels per NFE, host time per launch) and every
    # reduce-overhead setting (its cudaGraphLaunch events: the proof that CUDA graphs were replayed at all)
    profiled = (s["mode"] == "compiled" and s["batch"] == 1) or s["mode"] == "reduce-overhead"
    how = compile_kw(s["mode"], ctx.dry_run)  # reduce-overhead: CUDA graphs + the static plan (gpu_check.compile_kw)
    row: dict = {k: s[k] for k in ("model", "batch", "cache", "mode", "purpose")} | {"gen_length": G} | how
    for policy in ("threshold", "tdlm"):
        target = live if policy == "tdlm" else bb
        kw = dict(policy=policy, cache=s["cache"], gen_length=G, block_size=bs, threshold=0.9, **how)
        h = hook("sleep", "nfe", f"{name}@{policy}")  # test hook: a policy that hangs after the other finished
        if h:
            time.sleep(h[3])
        skips_before = cudagraph_skips()
        try:
            if s["purpose"] == "memory":  # one decode: its peak after a reset, the model's own bytes counted once
                sync(ctx.device)
                t0 = time.perf_counter()
                with PeakMeter(ctx.device) as meter:
                    res = tdlm.decode(target, req, **kw)
                sec = time.perf_counter() - t0
                model_bytes = tensor_bytes(target)
                row[f"{policy}_memory"] = {
                    "decode_peak": model_bytes + meter.peak_delta, "model_bytes": model_bytes,
                    "peak_above_reset": meter.peak_delta, "max_allocated": meter.peak,
                    "how": "max allocated after a peak reset, less what was allocated at the reset, plus the "
                           "model's own parameters and buffers (another model held by this process is not counted)"}
            else:
                sync(ctx.device)
                t0 = time.perf_counter()
                # untimed: compiles / warms up every graph of this setting (reduce-overhead: records its CUDA graphs,
                # at the static plan's addresses, which the timed decode of the same bucket replays)
                tdlm.decode(target, req, **kw)
                sync(ctx.device)
                row[f"{policy}_warmup_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                res = tdlm.decode(target, req, **kw)
                sync(ctx.device)
                sec = time.perf_counter() - t0
            evals = max(r.nfe for r in res)
            row[f"{policy}_ms_per_nfe"] = 1000 * sec / evals
            row[f"{policy}_nfe"] = [r.nfe for r in res]
            # after the timed decode: the profiler slows what it watches. Under CUDA graphs the kernels are replayed,
            # not launched: a reduce-overhead profile counts graph launches, and its rows are held to their ms/NFE.
            if profiled:
                row[f"{policy}_launches"] = launch_profile(target, req, kw, ctx.device)
        except Exception as e:  # the other policy still runs
            row[f"{policy}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        # inductor counts each graph it would not put under CUDA graphs (a mutated input, a CPU tensor, dynamic
        # shapes...) and runs it without them: a reduce-overhead number with skips is not a CUDA-graph number
        row[f"{policy}_cudagraph_skips"] = cudagraph_skips() - skips_before
        partial(row)
    if "threshold_ms_per_nfe" in row and "tdlm_ms_per_nfe" in row:
        row["tdlm_over_backbone"] = row["tdlm_ms_per_nfe"] / row["threshold_ms_per_nfe"]
    errors = [k for k in row if k.endswith("_error")]
    if errors:
        row.update(status="failed", error="; ".join(row[k] for k in errors))
    print(f"[gpu_check] nfe {name}: {row.get('threshold_ms_per_nfe', float('nan')):.2f} / "
          f"{row.get('tdlm_ms_per_nfe', float('nan')):.2f} ms per NFE (threshold / tdlm)", flush=True)  # fmt: skip
    return row


def cudagraph_skips() -> int:
    """Inductor's running count of graphs it compiled for CUDA graphs but ran without them (``cudagraph_skips``;
    each skip also logs its reason): a process-wide counter, so a setting records its own increase."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def nfe_summary(doc: dict) -> None:
    """Compiled / eager, and each ratio of ``gpu_check_common.RATIOS`` (reduce-overhead / compiled-static,
    compiled-static / compiled), of the same model, batch and cache, wherever both have run."""
    rows = [r for r in doc["rows"] if r.get("purpose") == "speed"]

    def same(r: dict, mode: str) -> dict | None:
        return next((e for e in rows if e.get("mode") == mode and (e["model"], e["batch"], e["cache"]) ==
                     (r["model"], r["batch"], r["cache"])), None)  # fmt: skip

    for r in rows:
        for mode, over in (("compiled", "eager"), *RATIOS):
            key = f"{mode}_over_{over}".replace("-", "_")  # e.g. reduce_overhead_over_compiled_static
            base = same(r, over) if r.get("mode") == mode else None
            for policy in ("threshold", "tdlm"):
                if base and f"{policy}_ms_per_nfe" in r and f"{policy}_ms_per_nfe" in base:
                    r[f"{policy}_{key}"] = r[f"{policy}_ms_per_nfe"] / base[f"{policy}_ms_per_nfe"]


# -- the launch profile: kernels of the compiled region, host time per launch ----------------------------------
REGION_PREFIX = "Torch-Compiled Region"  # torch._dynamo's record_function around every call of a compiled frame
LAUNCH_PREFIXES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")  # runtime + driver API
GRAPH_LAUNCH_PREFIXES = ("cudaGraphLaunch", "cuGraphLaunch")  # a CUDA graph replayed (runtime + driver API)
COPY_PREFIXES = ("cudaMemcpy", "cudaMemset", "cuMemcpy", "cuMemset")

def region_counts(events: list[tuple], evals: int) -> dict:
    """Per NFE, from profiler events ``(name, start_ns, duration_ns, on_device, correlation_id)``: the kernels
    launched inside the compiled regions only (host launch calls that start within a ``Torch-Compiled Region``;
    cross-checked by device kernels whose CUPTI correlation id matches one of them), the launches outside them (the
    decode loop's own eager kernels), the host time per launch (``HOST_US_PER_LAUNCH_IS``), and the CUDA graphs
    replayed (``cudaGraphLaunch`` calls, anywhere: a reduce-overhead setting without one recorded no graph).
    Without device events (a CPU) the aten operators inside the regions stand in for launches."""
    host = [e for e in events if not e[3]]
    merged: list[list[int]] = []
    for s, end in sorted((e[1], e[1] + e[2]) for e in host if e[0].startswith(REGION_PREFIX)):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([s, end])
    starts = [m[0] for m in merged]

    def inside(t: int) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t < merged[i][1]

    region_ns = sum(end - s for s, end in merged)
    graphs = sum(e[0].startswith(GRAPH_LAUNCH_PREFIXES) for e in host)  # anywhere: a replay is one host call
    out: dict = {"nfe": evals, "regions_per_nfe": len(merged) / evals,
                 "region_host_ms_per_nfe": region_ns / 1e6 / evals,
                 "graph_launches": graphs, "graph_launches_per_nfe": graphs / evals}  # fmt: skip
    launches = [e for e in host if e[0].startswith(LAUNCH_PREFIXES)]
    if not any(e[3] for e in events) and not launches:  # CPU: no kernels; operators stand in (code path only)
        ops = [e for e in host if e[0].startswith("aten::")]
        n_in = sum(inside(e[1]) for e in ops)
        return out | {"cpu_ops_in_region_per_nfe": n_in / evals, "cpu_ops_outside_per_nfe": (len(ops) - n_in) / evals,
                      "host_us_per_op_in_region": region_ns / 1e3 / n_in if n_in else None}  # fmt: skip
    in_region = [e for e in launches if inside(e[1])]
    corr = {e[4] for e in in_region}
    kernels = [e for e in events if e[3] and not e[0].lower().startswith(("memcpy", "memset"))]
    matched = sum(e[4] in corr for e in kernels)
    return out | {
        "kernels_per_nfe_compiled": len(in_region) / evals,
        "kernels_per_nfe_compiled_device": matched / evals if matched else None,
        "launches_outside_per_nfe": (len(launches) - len(in_region)) / evals,
        "copies_in_region_per_nfe": sum(e[0].startswith(COPY_PREFIXES) and inside(e[1]) for e in host) / evals,
        "kernels_per_nfe_all": len(kernels) / evals,
        "host_us_per_launch": region_ns / 1e3 / len(in_region) if in_region else None,
        "launch_api_us_mean": statistics.fmean(e[2] / 1e3 for e in in_region) if in_region else None,
        "host_us_per_launch_is": HOST_US_PER_LAUNCH_IS,
    }


def launch_profile(target, req: list[list[int]], kw: dict, device) -> dict:
    """One more decode of a compiled setting under ``torch.profiler``: :func:`region_counts`, plus the GPU's busy
    time (its kernels' summed durations: one stream, they do not overlap) against the profiled wall: near 1, the
    launches hide behind the GPU's work (true_shape's "overlapped" prediction); well below, the host is too slow."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import tdlm

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        res = tdlm.decode(target, req, **kw)
        sync(device)
    wall = time.perf_counter() - t0
    evals = max(r.nfe for r in res)
    dev = torch.autograd.DeviceType.CUDA
    events = [(e.name(), e.start_ns(), e.duration_ns(), e.device_type() == dev, e.correlation_id())
              for e in prof.profiler.kineto_results.events()]  # fmt: skip
    out = region_counts(events, evals) | {"profiled_wall_ms_per_nfe": 1000 * wall / evals}
    if cuda:
        busy_ns = sum(e[2] for e in events if e[3])
        out |= {"gpu_busy_ms_per_nfe": busy_ns / 1e6 / evals, "busy_over_wall": busy_ns / 1e9 / wall if wall else None}
    else:
        out["cpu_events_per_nfe"] = len(events) / evals
    return out


PREFLIGHT = {"deepspeed": deepspeed_preflight}  # stage -> before its context is built: why it is skipped, or None
STAGES = {  # stage -> (setup, one setting, summary after each setting)
    "train": (train_setup, train_item, _summary_losses),
    "deepspeed": (deepspeed_setup, deepspeed_item, _summary_losses),
    "nfe": (nfe_setup, nfe_item, nfe_summary),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=list(STAGES))
    ap.add_argument("--items", required=True, help="JSON list of the settings to run, in this order")
    ap.add_argument("--json", required=True, help="the stage's JSON, rewritten after every setting")
    ap.add_argument("--dry-run", action="store_true", help="toy size on the CPU")
    args = ap.parse_args(argv)
    return child_main(args.stage, json.loads(args.items), Path(args.json), args.dry_run)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a gloo/NCCL thread can abort interpreter shutdown (shared notes)
