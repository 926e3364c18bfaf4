"""The GPU check: run once whenever a GPU is lent (``bash bench/gpu_check.sh``; the stages are here).

Each stage writes ``<out>/gpu_<stage>.json`` as soon as it ends, ``status`` "ok", "failed" (with the
error) or "skipped" (with the reason); a failing stage never stops the next one.

* ``train``: real training steps on random LLaDA-8B-shaped weights (bf16) at the target shape (all 32
  layers, 4 x 64, K 8, L 768 with 256 response tokens, micro-batch 4, activation checkpointing) and at
  16 dispersed layers, one process without ZeRO: ``torch.cuda.max_memory_allocated`` next to
  ``tdlm.training.planner.plan(zero=0)`` (the per-GPU plan of ZeRO-3 on 8 GPUs differs only in the
  partitioned static terms, which are counted, not measured).
* ``nfe``: one denoiser evaluation at LLaDA-8B shape, batch 1, L 768: the backbone against TDLM (16
  dispersed layers) with H = 8 and 32 history entries; eager and ``torch.compile`` (per block); the SDPA
  kernels (flash, memory-efficient, cuDNN, math) and ``flash-attn`` if it is importable. The paper's
  anchor: 0.585 s for 40.08 NFE on GH200, about 14.6 ms per NFE.
* ``deepspeed``: one ZeRO-3 training step through ``deepspeed.initialize`` on a single rank (NCCL), if
  DeepSpeed is importable (its wheels travel in ``.whl/``, see gpu_check.sh).

``--dry-run`` runs every stage at toy size on the CPU (compile with the eager backend); the test suite runs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_train_probe import TINY, build_backbone, run_config  # noqa: E402

from tdlm.models.llada import LLaDAConfig  # noqa: E402
from tdlm.temporal.model import TDLM, TemporalConfig  # noqa: E402
from tdlm.training.planner import random_batch  # noqa: E402

ANCHOR_MS_PER_NFE = 585.0 / 40.08  # paper, Table 4 "16, dispersed (main)": 0.585 s for 40.08 NFE (GH200)


def device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "host": socket.gethostname(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, total_memory=p.total_memory, capability=list(torch.cuda.get_device_capability()),
                    cuda=torch.version.cuda)
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- stages ---------------------------------------------------------------------------------------
def stage_train(ctx: SimpleNamespace) -> dict:
    shape = dict(micro_batch=4, states=8, seq_len=768, response_len=256, heads=4, head_dim=64)
    specs = ["all", "dispersed:16"]
    if ctx.dry_run:
        shape = dict(micro_batch=2, states=4, seq_len=48, response_len=16, heads=2, head_dim=16)
        specs = ["all", "dispersed:4"]
    args = SimpleNamespace(**shape, dtype=ctx.dtype_name, steps=3, seed=0, reserve_gb=2.0)
    mem_gb = (torch.cuda.get_device_properties(ctx.device).total_memory / 2**30) if ctx.cuda else 24.0
    rows = []
    for spec in specs:
        row = run_config(ctx.backbone, ctx.cfg, spec, True, args, ctx.device, mem_gb)
        row.pop("plan", None)
        rows.append(row)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
    return {"shape": shape, "checkpointing": True, "rows": rows,
            "note": "one process, no ZeRO: measured torch.cuda.max_memory_allocated vs plan(zero=0, world_size=1)"}


def _tdlm(ctx: SimpleNamespace) -> TDLM:
    heads, head_dim = (2, 16) if ctx.dry_run else (4, 64)
    model = TDLM(ctx.backbone, TemporalConfig(layers=f"dispersed:{ctx.cfg.n_layers // 2}", heads=heads,
                                               head_dim=head_dim))
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for mod in model.temporal.values():  # a live adapter: nonzero W_O
            w = torch.randn(mod.o_proj.weight.shape, generator=g) * 0.02
            mod.o_proj.weight.copy_(w.to(mod.o_proj.weight.dtype))
    return model.eval()


def stage_nfe(ctx: SimpleNamespace) -> dict:
    L, N = (48, 16) if ctx.dry_run else (768, 256)
    reps, warmup = (2, 1) if ctx.dry_run else (10, 3)
    bb, device = ctx.backbone, ctx.device
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(3, min(bb.vocab_size, 1000), (1, L), generator=g)
    x[:, L - N:] = bb.mask_token_id
    x = x.to(device)
    P = L - N
    model = _tdlm(ctx)
    rows: dict = {}

    def backbone_forward():
        with torch.inference_mode():
            bb(x)

    def tdlm_at(history: int):
        def fill():
            cache = model.new_cache(1)
            with torch.inference_mode():
                for _ in range(history):
                    model.forward_step(x, P, cache)
            return cache

        caches = [fill() for _ in range(reps + warmup)]

        def step():
            with torch.inference_mode():
                model.forward_step(x, P, caches.pop())
        return step

    def measure(tag: str) -> None:
        rows[f"{tag}/backbone"] = timed(backbone_forward, device, reps, warmup)
        for h in (8, 32):
            rows[f"{tag}/tdlm_H{h}"] = timed(tdlm_at(h), device, reps, warmup)

    measure("eager/sdpa-auto")
    if ctx.cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, kernel in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                             ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
            try:
                with sdpa_kernel([kernel]):
                    rows[f"eager/sdpa-{name}/backbone"] = timed(backbone_forward, device, reps, warmup)
            except RuntimeError as e:
                rows[f"eager/sdpa-{name}/backbone"] = f"unavailable: {str(e).splitlines()[0][:160]}"
    try:
        import flash_attn  # noqa: F401

        rows["flash_attn_package"] = f"present ({flash_attn.__version__}); tdlm does not call it (README)"
    except ImportError:
        rows["flash_attn_package"] = "absent"
    # torch.compile per block (attend + feed_forward): both the backbone and the TDLM path use it.
    backend = "eager" if ctx.dry_run else "inductor"
    saved = [(blk.attend, blk.feed_forward) for blk in bb.blocks]
    try:
        for blk in bb.blocks:
            blk.attend = torch.compile(blk.attend, backend=backend, dynamic=False)
            blk.feed_forward = torch.compile(blk.feed_forward, backend=backend, dynamic=False)
        t0 = time.perf_counter()
        backbone_forward()
        sync(device)
        rows["compile_seconds"] = time.perf_counter() - t0
        measure(f"compiled-{backend}/sdpa-auto")
    except Exception as e:  # a compile failure is a result, not the end of the check
        rows["compiled"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        for blk, (a, f) in zip(bb.blocks, saved, strict=True):
            blk.attend, blk.feed_forward = a, f
    ms = {k: v * 1000 for k, v in rows.items() if isinstance(v, float) and k != "compile_seconds"}
    return {"L": L, "response": N, "batch": 1, "ms_per_nfe": ms, "notes": {k: v for k, v in rows.items()
                                                                         if not isinstance(v, float)},
            "compile_seconds": rows.get("compile_seconds"), "anchor_ms_per_nfe_gh200": ANCHOR_MS_PER_NFE,
            "tdlm_layers": model.layer_ids}


def stage_deepspeed(ctx: SimpleNamespace) -> dict:
    try:
        import deepspeed
    except ImportError as e:
        return {"status": "skipped", "reason": f"DeepSpeed not importable ({e}); carry .whl (gpu_check.sh --fetch)"}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if ctx.cuda else "gloo", verbose=False)
    from tdlm.training.loop import supervised_ce

    B, K, L, N = (1, 4, 48, 16) if ctx.dry_run else (4, 8, 768, 256)
    model = _tdlm(ctx)
    model.activation_checkpointing = True
    model.train()
    ds_cfg = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "zero3.json").read_text())
    ds_cfg.update(train_batch_size=B, train_micro_batch_size_per_gpu=B, gradient_accumulation_steps=1,
                  gradient_clipping=1.0, steps_per_print=10**9)
    ds_cfg["optimizer"]["params"] = {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0,
                                     "torch_adam": True}
    ds_cfg["bf16"] = {"enabled": ctx.dtype_name == "bf16"}
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_cfg)
    for p in model.temporal.parameters():
        deepspeed.zero.register_external_parameter(model, p)
    batch = random_batch(ctx.backbone, B, K, L, N, 0).to(ctx.device)
    losses, times = [], []
    for _ in range(3):
        sync(ctx.device)
        t0 = time.perf_counter()
        loss = supervised_ce(engine, batch) / batch.num_targets
        engine.backward(loss)
        engine.step()
        sync(ctx.device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    out = {"deepspeed": deepspeed.__version__, "zero_stage": 3, "shape": dict(B=B, K=K, L=L, N=N),
           "losses": losses, "step_s": times}
    if ctx.cuda:
        out.update(max_allocated=torch.cuda.max_memory_allocated(ctx.device),
                   max_reserved=torch.cuda.max_memory_reserved(ctx.device))
    return out


STAGES = {"train": stage_train, "nfe": stage_nfe, "deepspeed": stage_deepspeed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results",
                    help="folder for gpu_<stage>.json (default: $OUT, else bench/results)")
    ap.add_argument("--dry-run", action="store_true", help="toy size on the CPU: checks every stage's code path")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma list of " + ", ".join(STAGES))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda:0" if cuda else "cpu")
    if not cuda and not args.dry_run:
        print("error: no CUDA device; use --dry-run on a CPU", file=sys.stderr)
        return 2
    dtype_name = "bf16" if cuda else "fp32"
    cfg = TINY if args.dry_run else LLaDAConfig()
    t0 = time.perf_counter()
    backbone = build_backbone(cfg, device, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name], 0)
    ctx = SimpleNamespace(cfg=cfg, device=device, cuda=cuda, dry_run=args.dry_run, dtype_name=dtype_name,
                          backbone=backbone)
    info = device_info(device) | {"dry_run": args.dry_run, "backbone_build_s": time.perf_counter() - t0}
    failed = 0
    for name in args.stages.split(","):
        if name not in STAGES:
            print(f"error: unknown stage {name!r}; expected {', '.join(STAGES)}", file=sys.stderr)
            return 2
        t1 = time.perf_counter()
        try:
            result = STAGES[name](ctx)
            result.setdefault("status", "ok")
        except Exception as e:
            failed += 1
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
        result.update(stage=name, seconds=time.perf_counter() - t1, machine=info)
        path = out / f"gpu_{name}{'_dryrun' if args.dry_run else ''}.json"
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"[gpu_check] {name}: {result['status']} in {result['seconds']:.1f} s -> {path}", flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a gloo/NCCL thread can abort interpreter shutdown (shared notes)
