"""The GPU check: run once whenever a GPU is lent (``bash bench/gpu_check.sh``; the stages are here).

Each stage writes ``<out>/gpu_<stage>.json`` as soon as it ends, ``status`` "ok", "failed" (with the
error) or "skipped" (with the reason); a failing stage never stops the next one.

* ``train``: real training steps on random LLaDA-8B-shaped weights (bf16) at the target shape (all 32
  layers, 4 x 64, K 8, L 768 with 256 response tokens, micro-batch 4, activation checkpointing) and at
  16 dispersed layers, one process without ZeRO: ``torch.cuda.max_memory_allocated`` next to
  ``tdlm.training.planner.plan(zero=0)`` (the per-GPU plan of ZeRO-3 on 8 GPUs differs only in the
  partitioned static terms, which are counted, not measured).
* ``nfe``: ``tdlm.decode`` as users run it (:func:`stage_nfe`): LLaDA-8B and Dream-7B shape (random bf16
  weights built on meta, materialised on the GPU), prompt 256 + 64 generated in blocks of 32, batch 1 and a
  left-padded batch of 8, cache none / dual, eager and compiled (``compile=True``), threshold vs tdlm (the
  paper's allocation, a live adapter): ms per NFE and the TDLM/backbone ratio. The paper's anchor: 0.585 s
  for 40.08 NFE on GH200, about 14.6 ms per NFE. Settings beyond ``--nfe-budget`` seconds are skipped. Each
  compiled batch-1 setting is decoded once more under ``torch.profiler`` (:func:`launch_profile`): kernels per
  NFE and the GPU's busy time against the wall, what the launch term of the prediction assumes.
* ``deepspeed``: one ZeRO-3 training step through ``deepspeed.initialize`` on a single rank (NCCL), if
  DeepSpeed is importable (its wheels travel in ``.whl/``, see gpu_check.sh).

``--dry-run`` runs every stage at toy size on the CPU (compile with the eager backend); the test suite runs it.

After the stages, :func:`beside_predicted` prints each measured number next to the prediction made without a GPU
(``bench/results/true_shape.json``, ``bench/true_shape.py``): the train stage's peak next to the traced peak of the
same single-process step (MemTracker under FakeTensorMode, plus the AdamW moments), the nfe stage's ms per NFE next
to the roofline prediction for H200 (eager: the unfused bound; compiled: fused + kernel launches added, and beside
it the same launches issued asynchronously and with CUDA graphs), and the profiled kernels per NFE next to the
count inductor's CPU graph gave (``bench/results/dispatch_count.json``). It writes
``<out>/predicted_vs_measured.json``. A dry run does the same with its toy numbers (the ratios mean nothing there;
the code path is what it checks).
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

import tdlm  # noqa: E402
from tdlm.models.dream import Dream, DreamConfig  # noqa: E402
from tdlm.models.llada import LLaDAConfig  # noqa: E402
from tdlm.temporal.model import TDLM, TemporalConfig  # noqa: E402
from tdlm.training.planner import random_batch  # noqa: E402
from tdlm.training.planner.measure import init_random_  # noqa: E402

DREAM_TINY = DreamConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=176, vocab_size=512, mask_token_id=2, eos_token_id=1, pad_token_id=0,
                         torch_dtype="float32")  # fmt: skip
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


def _dream(dry_run: bool, device: torch.device, dtype: torch.dtype) -> Dream:
    """Random-init Dream-7B (or a toy Dream): meta build -> cast -> to_empty -> seeded init, as for LLaDA."""
    cfg = DREAM_TINY if dry_run else DreamConfig()
    with torch.device("meta"):
        model = Dream(cfg)
    model = model.to(dtype).to_empty(device=device)
    init_random_(model, 1)
    model.backbone_id = "dream-7b-random" if not dry_run else "dream-tiny-random"
    return model.freeze()


def _live(backbone, dry_run: bool) -> TDLM:
    """TDLM at the paper's allocation (half the layers, dispersed) with a live adapter (nonzero W_O)."""
    heads, head_dim = (2, 16) if dry_run else (4, 64)
    model = TDLM(backbone, TemporalConfig(layers=f"dispersed:{backbone.num_layers // 2}", heads=heads,
                                          head_dim=head_dim))  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for mod in model.temporal.values():
            w = torch.randn(mod.o_proj.weight.shape, generator=g) * 0.02
            mod.o_proj.weight.copy_(w.to(mod.o_proj.weight.dtype))
    return model.eval()


def launch_profile(target, req: list[list[int]], kw: dict, device: torch.device) -> dict:
    """One more decode of a compiled setting under ``torch.profiler``, per NFE: the kernels the GPU ran (its own
    kernel events) and their summed time (the GPU's busy time: one stream, so the kernels do not overlap), beside
    the profiled wall time. The launch term of ``bench/true_shape.py`` rests on two numbers this measures: kernels
    per NFE (predicted from inductor's CPU graph) and whether launches hide behind the GPU's work (busy / wall near
    1: the "overlapped" prediction; well below 1: the host launches too slowly, the "added" bound). On a CPU (dry
    run) there are no device events: the profiled operator events per NFE are recorded instead."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        res = tdlm.decode(target, req, **kw)
        sync(device)
    wall = time.perf_counter() - t0
    evals = max(r.nfe for r in res)
    events = prof.events()
    out: dict = {"nfe": evals, "profiled_wall_ms_per_nfe": 1000 * wall / evals}
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.time_range.elapsed_us() for e in kernels)
        launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                     "cuLaunchKernelEx")]  # fmt: skip
        out |= {"kernels_per_nfe": len(kernels) / evals, "gpu_busy_ms_per_nfe": busy_us / 1000 / evals,
                "busy_over_wall": busy_us / 1e6 / wall if wall else None,
                "launch_api_us_mean": (sum(e.time_range.elapsed_us() for e in launches) / len(launches)
                                       if launches else None)}  # fmt: skip
    else:
        out["cpu_events_per_nfe"] = len(events) / evals
    return out


def stage_nfe(ctx: SimpleNamespace) -> dict:
    """``tdlm.decode`` as users run it: LLaDA-8B and Dream-7B shape (random weights), batch 1 and a left-padded
    batch of 8, cache none / dual, eager and compiled (``compile=True``; the eager backend in a dry run),
    threshold vs tdlm (16 / 14 dispersed layers, live adapter). Each setting decodes once untimed (compiles every
    graph of it: the timed decode excludes compilation) and once timed (wall, CUDA-synchronised). ms per NFE =
    seconds / the batch's evaluations (a batched evaluation is one forward for all rows), and the TDLM/backbone
    ratio per setting. Random weights give flat predictions, so threshold commits one token per evaluation and
    NFE = gen_length: the cost per evaluation is what is measured. Settings run most important first; whatever
    does not fit the stage's budget (``--nfe-budget``) is recorded as skipped."""
    P, G, bs = (8, 16, 8) if ctx.dry_run else (256, 64, 32)
    compile_value = "eager" if ctx.dry_run else True
    budget = ctx.nfe_budget
    t_start = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[ctx.dtype_name]
    models = {"llada-8b": ctx.backbone, "dream-7b": _dream(ctx.dry_run, ctx.device, dtype)}
    tdlms = {name: _live(bb, ctx.dry_run) for name, bb in models.items()}
    g = torch.Generator(device="cpu").manual_seed(1)

    def prompts(bb, batch: int) -> list[list[int]]:
        rows = torch.randint(3, min(bb.vocab_size, 1000), (batch, P), generator=g).tolist()
        return [r[: P - (i * P) // (2 * batch)] for i, r in enumerate(rows)]  # left-padded when batch > 1

    settings = []  # most important first: eager batch 1, compiled batch 1, eager batch 8, compiled batch 8
    for batch, mode in ((1, "eager"), (1, "compiled"), (8, "eager"), (8, "compiled")):
        for name in models:
            if ctx.dry_run and mode == "compiled" and (batch > 1 or name != "llada-8b"):
                continue  # a dry run traces one compiled setting (tests/test_compile.py traces every kind)
            for cache in ("none",) if ctx.dry_run and mode == "compiled" else ("none", "dual"):
                settings.append((name, batch, cache, mode))
    rows, skipped = [], []
    for name, batch, cache, mode in settings:
        if budget and time.perf_counter() - t_start > budget:
            skipped.append(f"{name}/b{batch}/{cache}/{mode}")
            continue
        bb, req = models[name], prompts(models[name], batch)
        row = {"model": name, "batch": batch, "cache": cache, "mode": mode}
        for policy in ("threshold", "tdlm"):
            target = tdlms[name] if policy == "tdlm" else bb
            kw = dict(policy=policy, cache=cache, gen_length=G, block_size=bs, threshold=0.9,
                      compile=compile_value if mode == "compiled" else False)  # fmt: skip
            try:
                sync(ctx.device)
                t0 = time.perf_counter()
                tdlm.decode(target, req, **kw)  # untimed: compiles / warms up every graph of this setting
                sync(ctx.device)
                row[f"{policy}_warmup_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                res = tdlm.decode(target, req, **kw)
                sync(ctx.device)
                sec = time.perf_counter() - t0
                evals = max(r.nfe for r in res)
                row[f"{policy}_ms_per_nfe"] = 1000 * sec / evals
                row[f"{policy}_nfe"] = [r.nfe for r in res]
                if mode == "compiled" and batch == 1:  # after the timed decode: the profiler slows what it watches
                    row[f"{policy}_launches"] = launch_profile(target, req, kw, ctx.device)
            except Exception as e:  # a failing setting is a result, not the end of the stage
                row[f"{policy}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if "threshold_ms_per_nfe" in row and "tdlm_ms_per_nfe" in row:
            row["tdlm_over_backbone"] = row["tdlm_ms_per_nfe"] / row["threshold_ms_per_nfe"]
        rows.append(row)
        print(f"[gpu_check] nfe {name} b{batch} {cache} {mode}: "
              f"{row.get('threshold_ms_per_nfe', float('nan')):.2f} / {row.get('tdlm_ms_per_nfe', float('nan')):.2f}"
              f" ms per NFE (threshold / tdlm)", flush=True)  # fmt: skip
    for r in rows:  # compiled / eager of the same model, batch and cache
        eager = next((e for e in rows if e["mode"] == "eager" and (e["model"], e["batch"], e["cache"]) ==
                      (r["model"], r["batch"], r["cache"])), None)  # fmt: skip
        for policy in ("threshold", "tdlm"):
            if r["mode"] == "compiled" and eager and f"{policy}_ms_per_nfe" in r and f"{policy}_ms_per_nfe" in eager:
                r[f"{policy}_compiled_over_eager"] = r[f"{policy}_ms_per_nfe"] / eager[f"{policy}_ms_per_nfe"]
    errors = [k for r in rows for k in r if k.endswith("_error")]
    return {"prompt_len": P, "gen_length": G, "block_size": bs, "threshold": 0.9, "dtype": ctx.dtype_name,
            "compile": compile_value, "rows": rows, "skipped_for_budget": skipped, "budget_s": budget,
            "tdlm_layers": {n: m.layer_ids for n, m in tdlms.items()}, "anchor_ms_per_nfe_gh200": ANCHOR_MS_PER_NFE,
            **({"status": "failed", "error": f"{len(errors)} settings failed: {errors}"} if errors else {})}


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
PREDICTION = Path(__file__).resolve().parent / "results" / "true_shape.json"


def beside_predicted(out: Path, dry_run: bool, prediction: Path = PREDICTION) -> dict:
    """Measured (this run's stage JSONs in ``out``) beside the true-shape prediction; printed and returned."""
    if not prediction.exists():
        print(f"[gpu_check] no prediction at {prediction}: run python bench/true_shape.py", flush=True)
        return {"status": "skipped", "reason": f"{prediction} missing"}
    pred = json.loads(prediction.read_text())
    suffix = "_dryrun" if dry_run else ""
    rows: list[dict] = []
    train_path, nfe_path = out / f"gpu_train{suffix}.json", out / f"gpu_nfe{suffix}.json"
    traced = {r["layers"]: r for r in pred.get("train", []) if r["model"] == "llada-8b" and "traced_peak" in r}
    if train_path.exists():
        for m in json.loads(train_path.read_text()).get("rows", []):
            t = traced.get(m.get("layers"))
            want = t["traced_peak"]["Total"] + 4 * t["temporal_params"] if t else None  # + bf16 AdamW m, v
            rows.append({"what": f"train peak, llada-8b {m.get('layers')}, one process", "unit": "GiB",
                         "measured": m.get("measured", 0) / 2**30 if m.get("status") == "ok" else None,
                         "predicted": want / 2**30 if want else None,
                         "planner": m.get("predicted", 0) / 2**30 or None})  # fmt: skip
    nfe_pred = {(r["model"], r["batch"], r["cache"]): r for r in pred.get("gpu_check", {}).get("rows", [])}
    if nfe_path.exists():
        for m in json.loads(nfe_path.read_text()).get("rows", []):
            p = nfe_pred.get((m["model"], m["batch"], m["cache"]))
            for policy in ("threshold", "tdlm"):
                pm = p[f"{policy}_ms_per_nfe"] if p else {}
                rows.append({"what": f"ms/NFE {m['model']} b{m['batch']} {m['cache']} {m['mode']} {policy}",
                             "unit": "ms", "measured": m.get(f"{policy}_ms_per_nfe"), "predicted": pm.get(m["mode"]),
                             # compiled: the launches added (above) or issued asynchronously (here), and none
                             "predicted_overlapped": pm.get("compiled_overlapped") if m["mode"] == "compiled" else None,
                             "predicted_cuda_graphs": pm.get("cuda_graphs") if m["mode"] == "compiled" else None})
                prof = m.get(f"{policy}_launches") or {}
                count = pred.get("nfe", {}).get(m["model"], {}).get("compiled_kernels", {})
                if prof.get("kernels_per_nfe") is not None and m["cache"] == "none":
                    rows.append({"what": f"kernels/NFE {m['model']} b1 none compiled {policy}", "unit": "",
                                 "measured": prof["kernels_per_nfe"],
                                 "predicted": count.get("tdlm" if policy == "tdlm" else "backbone")})
                if prof.get("busy_over_wall") is not None:
                    rows.append({"what": f"GPU busy/wall {m['model']} b1 {m['cache']} compiled {policy}", "unit": "",
                                 "measured": prof["busy_over_wall"], "predicted": None})
    print(f"[gpu_check] measured beside predicted ({prediction.name}; H200 roofline{', dry run' if dry_run else ''}):")
    for r in rows:
        ratio = r["measured"] / r["predicted"] if r["measured"] and r["predicted"] else None
        r["ratio"] = ratio
        fmt = (lambda v: "   n/a" if v is None else f"{v:8.2f}")  # noqa: E731
        more = "".join(f"  {label} {fmt(r[k])}" for k, label in (("predicted_overlapped", "overlapped"),
                                                                  ("predicted_cuda_graphs", "CUDA graphs"))
                       if r.get(k) is not None)  # fmt: skip
        print(f"  {r['what']:48s} measured {fmt(r['measured'])} {r['unit']:3s} predicted {fmt(r['predicted'])}"
              + ("" if ratio is None else f"  ratio {ratio:.2f}") + more, flush=True)  # fmt: skip
    result = {"status": "ok", "prediction": str(prediction), "dry_run": dry_run, "rows": rows}
    (out / f"predicted_vs_measured{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results",
                    help="folder for gpu_<stage>.json (default: $OUT, else bench/results)")
    ap.add_argument("--dry-run", action="store_true", help="toy size on the CPU: checks every stage's code path")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma list of " + ", ".join(STAGES))
    ap.add_argument("--nfe-budget", type=float, default=300.0,
                    help="seconds for the nfe stage's settings; later ones are recorded as skipped (0 = no limit)")
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
                          backbone=backbone, nfe_budget=0.0 if args.dry_run else args.nfe_budget)
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
    try:
        beside_predicted(out, args.dry_run)
    except Exception as e:  # a comparison that cannot be made must not hide the stages' results
        failed += 1
        print(f"[gpu_check] measured-beside-predicted failed: {type(e).__name__}: {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a gloo/NCCL thread can abort interpreter shutdown (shared notes)
