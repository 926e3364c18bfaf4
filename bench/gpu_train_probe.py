"""GPU training-memory probe: measured peak of real TDLM training steps on a LLaDA-8B-shaped backbone vs the planner.

Commands (repository root, venv active)::

    python bench/gpu_train_probe.py                       # one GPU (H100/H200), 1-2 min -> results/gpu_train_probe.json
    python bench/gpu_train_probe.py --cap-gb 96 --seq-len 384 --micro-batch 5   # 96 GB GH200, 32-layer OOM band
    python bench/gpu_train_probe.py --tiny                # CPU code-path check at toy size (~1 min on 2 cores)
                                                          #   -> bench/results/gpu_train_probe_cpu_tiny.json

What runs. ``tdlm.models.llada.LLaDA(LLaDAConfig())`` (the release shapes: 32 layers, d 4096, SwiGLU 12288,
V 126464) is built on the meta device, cast to bf16 and materialised on the GPU with seeded random weights
(``to_empty`` + ``tdlm.training.planner.init_random_``; nothing is downloaded). For each temporal allocation
(dispersed:8, dispersed:16, all = 32 layers; 4 heads x 64) and activation checkpointing off / on, a fresh TDLM
adapter and ``torch.optim.AdamW`` over its parameters run ``--steps`` training steps of
:func:`tdlm.training.planner.train_step` (forward_states over K random trajectory states of L tokens, LM head at
the supervised positions -> trajectory_loss ->
backward -> AdamW), the first one as warm-up (it creates the AdamW states). The table reports
``torch.cuda.max_memory_allocated`` over the measured steps (absolute: backbone included), the median step time,
and ``tdlm.training.planner.plan(..., zero=0)`` for the same shapes: one process, no DeepSpeed, AdamW states in bf16. A
config that runs out of memory is reported as OOM and the probe moves on. With ``--boundary`` (default on a GPU)
it also runs ``all`` without checkpointing at the largest micro-batch the planner says fits the device (or
``--cap-gb``) and at one more, to check the fit boundary on hardware.

``--cap-gb G`` limits this process's CUDA allocator to G GiB (``torch.cuda.set_per_process_memory_fraction``) to
emulate a smaller card. ``--tiny`` runs the same code on the CPU at toy size (8 layers, d 64; allocations
dispersed:2 / dispersed:4 / all) and measures with the profiler-based ``tdlm.training.planner.PeakMeter``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from benchlib import write_result  # bench/ is sys.path[0] when run as a script

from tdlm.models.llada import LLaDA, LLaDAConfig
from tdlm.temporal.model import TDLM, TemporalConfig
from tdlm.training.planner import (
    GiB,
    PeakMeter,
    init_random_,
    max_micro_batch,
    plan,
    random_batch,
    tensor_bytes,
    train_step,
)

RESULTS = Path(__file__).resolve().parent / "results"
TINY = LLaDAConfig(
    d_model=64,
    n_layers=8,
    n_heads=4,
    n_kv_heads=4,
    mlp_hidden_size=176,
    vocab_size=512,
    embedding_size=512,
    mask_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    torch_dtype="float32",
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def allocations(n_layers: int) -> list[tuple[str, str]]:
    """(spec, label): a quarter, half (dispersed) and all of the layers: 8 / 16 / 32 of LLaDA-8B's 32."""
    return [
        (f"dispersed:{n_layers // 4}", f"{n_layers // 4}, dispersed"),
        (f"dispersed:{n_layers // 2}", f"{n_layers // 2}, dispersed"),
        ("all", f"{n_layers}, all"),
    ]


def build_backbone(cfg: LLaDAConfig, device: torch.device, dtype: torch.dtype, seed: int) -> LLaDA:
    """Random-init LLaDA directly in ``dtype`` on ``device``: meta build -> cast -> to_empty -> init."""
    with torch.device("meta"):
        backbone = LLaDA(cfg)
    backbone = backbone.to(dtype).to_empty(device=device)
    init_random_(backbone, seed)
    backbone.backbone_id = "llada-8b-random" if cfg == LLaDAConfig() else "llada-tiny-random"
    return backbone.freeze()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(backbone, cfg, spec: str, ckpt: bool, args, device: torch.device, mem_gb: float) -> dict:
    """Train ``args.steps`` steps of one allocation; returns a result row (status 'ok' or 'OOM')."""
    B, K, L, N = args.micro_batch, args.states, args.seq_len, args.response_len
    row: dict = dict(layers=spec, checkpointing=ckpt, micro_batch=B, states=K, seq_len=L, response_len=N)
    model = opt = batch = None
    try:
        model = TDLM(backbone, TemporalConfig(layers=spec, heads=args.heads, head_dim=args.head_dim))
        model.activation_checkpointing = ckpt
        model.train()
        batch = random_batch(backbone, B, K, L, N, args.seed).to(device)
        p = plan(
            cfg,
            model.layer_ids,
            model.config.heads,
            model.config.head_dim,
            states=K,
            seq_len=L,
            response_len=N,
            supervised=batch.num_targets,
            micro_batch=B,
            dtype=args.dtype,
            checkpointing=ckpt,
            zero=0,
            world_size=1,
            gpu_mem_gb=mem_gb,
            reserve_gb=args.reserve_gb,
        )
        row.update(
            predicted=p.total,
            predicted_fits=p.fits,
            predicted_phase=p.peak_phase,
            plan=p.to_dict(),
            temporal_params=model.num_temporal_parameters(),
        )
        opt = torch.optim.AdamW(model.temporal.parameters(), lr=1e-5)
        losses = [train_step(model, batch, opt)]  # warm-up: AdamW states, kernels, allocator pools
        sync(device)
        baseline = tensor_bytes(backbone, model, opt, batch)
        times = []
        with PeakMeter(device) as meter:
            for _ in range(args.steps - 1):
                sync(device)
                t0 = time.perf_counter()
                losses.append(train_step(model, batch, opt))
                sync(device)
                times.append(time.perf_counter() - t0)
        peak = meter.peak if meter.peak is not None else baseline + meter.peak_delta
        row.update(status="ok", measured=peak, ratio=peak / p.total, step_s=statistics.median(times), losses=losses)
        if device.type == "cuda":  # allocator overhead on top of tensors: what the planner's reserve must cover
            row["max_reserved"] = torch.cuda.max_memory_reserved(device)
    except (OOM, RuntimeError) as e:  # cuBLAS/cuDNN allocation failures are RuntimeErrors
        if not isinstance(e, OOM) and "out of memory" not in str(e).lower():
            raise
        row.update(status="OOM", error=str(e).splitlines()[0][:200])
    finally:
        del model, opt, batch
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], mem_gb: float) -> str:
    big = max((r.get("predicted", 0) for r in rows), default=0) >= GiB
    unit, scale = ("GiB", GiB) if big else ("MiB", 2**20)
    head = (
        f"| temporal layers | ckpt | B | predicted {unit} | measured {unit} | measured/predicted | step s | status "
        f"| plan @ {mem_gb:g} GiB |"
    )
    out = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = f"{r['predicted'] / scale:.2f}" if "predicted" in r else "-"
        meas = f"{r['measured'] / scale:.2f}" if "measured" in r else "-"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        step = f"{r['step_s']:.3f}" if "step_s" in r else "-"
        verdict = ("fits" if r["predicted_fits"] else "OOM") if "predicted_fits" in r else "-"
        out.append(
            f"| {r['label']} | {'on' if r['checkpointing'] else 'off'} | {r['micro_batch']} | {pred} | {meas} "
            f"| {ratio} | {step} | {r['status']} | {verdict} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, toy LLaDA (8 layers, d 64): checks the code path")
    ap.add_argument("--states", type=int, default=None, help="K sampled states (default 8; tiny 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="L = prompt + response tokens (default 512; tiny 64)")
    ap.add_argument("--response-len", type=int, default=None, help="N response tokens (default L // 2)")
    ap.add_argument("--micro-batch", type=int, default=1, help="B trajectories per step")
    ap.add_argument("--heads", type=int, default=4, help="temporal heads M")
    ap.add_argument("--head-dim", type=int, default=None, help="temporal head width (default 64; tiny 16)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--steps", type=int, default=3, help="training steps per config, the first is warm-up")
    ap.add_argument("--layers", default=None, help="comma list of allocations (default: quarter,half dispersed, all)")
    ap.add_argument("--checkpointing", default="off,on", help="'off,on', 'off' or 'on'")
    ap.add_argument("--cap-gb", type=float, default=None, help="limit the CUDA allocator to this many GiB")
    ap.add_argument(
        "--boundary",
        choices=("auto", "on", "off"),
        default="auto",
        help="also run 'all' without checkpointing at the planner's largest fitting micro-batch and one "
        "more (auto: on a GPU only; on the CPU --cap-gb only sets the planner's memory)",
    )
    ap.add_argument(
        "--reserve-gb",
        type=float,
        default=None,
        help="planner reserve for CUDA context / fragmentation (default 2; 0 with --tiny)",
    )
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip configs once this much time has passed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (--tiny)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/gpu_train_probe*.json)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step is a warm-up)")
    t_start = time.perf_counter()

    if args.tiny:
        device, cfg = torch.device("cpu"), TINY
        torch.set_num_threads(args.threads)
    elif torch.cuda.is_available():
        device, cfg = torch.device("cuda", torch.cuda.current_device()), LLaDAConfig()
    else:
        print("error: no CUDA device; run with --tiny for the CPU code path", file=sys.stderr)
        return 2
    args.states = args.states or (4 if args.tiny else 8)
    args.seq_len = args.seq_len or (64 if args.tiny else 512)
    args.response_len = args.response_len or args.seq_len // 2
    args.head_dim = args.head_dim or (16 if args.tiny else 64)
    out_path = args.out or RESULTS / ("gpu_train_probe_cpu_tiny.json" if args.tiny else "gpu_train_probe.json")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if args.cap_gb:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * GiB / total), device)
        mem_gb = args.cap_gb or total / GiB
        device_name = torch.cuda.get_device_name(device)
    else:
        mem_gb, device_name = args.cap_gb or 96.0, f"cpu ({platform.processor() or platform.machine()})"
    args.reserve_gb = args.reserve_gb if args.reserve_gb is not None else (0.0 if args.tiny else 2.0)

    t0 = time.perf_counter()
    backbone = build_backbone(cfg, device, DTYPES[args.dtype], args.seed)
    sync(device)
    build_s = time.perf_counter() - t0
    print(
        f"backbone: {backbone.num_parameters():,} params in {args.dtype} on {device_name} ({build_s:.1f} s); "
        f"K={args.states} L={args.seq_len} N={args.response_len} B={args.micro_batch}; memory {mem_gb:.0f} GiB",
        flush=True,
    )

    allocs = allocations(cfg.n_layers)
    if args.layers:
        allocs = [(s, s) for s in args.layers.split(",")]
    ckpts = [c == "on" for c in args.checkpointing.split(",")]
    jobs = [(spec, label, ck, args.micro_batch) for spec, label in allocs for ck in ckpts]
    if args.boundary == "on" or (args.boundary == "auto" and device.type == "cuda"):
        b = max_micro_batch(
            backbone=cfg,
            layers="all",
            heads=args.heads,
            head_dim=args.head_dim,
            states=args.states,
            seq_len=args.seq_len,
            response_len=args.response_len,
            dtype=args.dtype,
            checkpointing=False,
            zero=0,
            gpu_mem_gb=mem_gb,
            reserve_gb=args.reserve_gb,
        )
        jobs += [("all", f"{cfg.n_layers}, all (boundary)", False, bb) for bb in (b, b + 1) if bb >= 1]

    rows = []
    for spec, label, ck, mb in jobs:
        if time.perf_counter() - t_start > args.budget_s:
            rows.append(dict(layers=spec, label=label, checkpointing=ck, micro_batch=mb, status="skipped (time)"))
            continue
        args_b = argparse.Namespace(**{**vars(args), "micro_batch": mb})
        row = run_config(backbone, cfg, spec, ck, args_b, device, mem_gb)
        row["label"] = label
        rows.append(row)
        meas = f"{row['measured'] / GiB:.3f} GiB" if "measured" in row else row["status"]
        pred = f"{row['predicted'] / GiB:.3f}" if "predicted" in row else "-"
        print(f"  {label:24s} ckpt={'on ' if ck else 'off'} B={mb}: measured {meas}, predicted {pred} GiB", flush=True)

    table = markdown(rows, mem_gb)
    print()
    print(table)
    result = dict(
        bench="gpu_train_probe",
        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        device=device_name,
        memory_gib=mem_gb,
        cap_gb=args.cap_gb,
        torch=torch.__version__,
        backbone=dict(params=backbone.num_parameters(), config=cfg.to_dict(), dtype=args.dtype, build_s=build_s),
        shapes=dict(
            states=args.states,
            seq_len=args.seq_len,
            response_len=args.response_len,
            micro_batch=args.micro_batch,
            heads=args.heads,
            head_dim=args.head_dim,
        ),
        planner="tdlm.training.planner.plan(zero=0, world_size=1): one process, plain AdamW, states in the "
        "parameter dtype",
        rows=rows,
        table=table,
        wall_s=time.perf_counter() - t_start,
    )
    write_result(out_path, result)
    print(f"({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
