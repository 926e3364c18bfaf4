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
* ``nfe``: the decode settings (``gpu_check_plan.nfe_settings``) and their launch profile: bench/gpu_check_nfe.py, whose
  functions this module's ``STAGES`` table runs (and re-exports, as the tests call them from here).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import socket
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

from gpu_check import HOOKS_ENV, hook
from gpu_check_common import ROOT, gpu_kind, read_json, write_json
from gpu_check_nfe import (  # noqa: F401  (re-exported: the tests call the nfe stage's functions from here)
    _live,
    cudagraph_skips,
    launch_profile,
    nfe_item,
    nfe_setup,
    nfe_summary,
    region_counts,
    sync,
)


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
