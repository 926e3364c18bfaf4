"""The GPU check's decode stage (``nfe``) and its launch profile, run by the stage child (bench/gpu_check_stages.py).

* ``nfe``: ``tdlm.decode`` as users run it, LLaDA-8B and Dream-7B shape (random bf16 weights), prompt 256 + 64 in
  blocks of 32, batch 1 and a left-padded batch of 8, cache none / dual, compiled (``compile=True``) and eager,
  threshold vs tdlm (half the layers, dispersed, live adapter; a setting whose name ends in a policy runs that one
  only, ``gpu_check_plan._setting``): ms per NFE and TDLM / backbone; and ``compile="reduce-overhead"`` with
  ``storage="static"`` (CUDA graphs; ``gpu_check_plan.compile_kw``) at batch 1 and 8, none / dual, beside compile=True
  on the same static plan (``compiled-static``; ``reduce_overhead_over_compiled_static``), which is beside
  compile=True dynamic (``compiled_static_over_compiled``). Each setting decodes once untimed (compiles;
  reduce-overhead also records its CUDA graphs at the static plan's addresses) and once timed (replays). Batch-1
  ``compile=True`` settings and every reduce-overhead one decode once more under ``torch.profiler``
  (:func:`launch_profile`): kernels per NFE launched inside the compiled region only, the host time per launch and the
  ``cudaGraphLaunch`` calls (:func:`region_counts`). Every setting records inductor's ``cudagraph_skips`` counter over
  its decodes (``<policy>_cudagraph_skips``): a reduce-overhead setting with a skip, or without a graph launch, is not
  a CUDA-graph number (the comparison marks it). ``/gen256`` settings decode a 256-token response once per policy for
  the decode memory at true_shape.json's ``decode_memory`` shape (max allocated after a peak reset).
* **Scope and depth** (``gpu_check_plan.compile_scope``, ``gpu_check_plan.RO_LAYERS``): ``compiled`` settings decode
  with ``compile_scope="block"``; ``reduce-overhead`` and ``compiled-static`` at the model scope, on a LLaDA of the
  true width and fewer layers (:func:`_models`), whose ms/NFE is also given extrapolated per layer to the full depth
  (``<policy>_ms_per_nfe_full_depth``). :func:`nfe_summary` takes a ratio within one scope and depth only.
* **Rows that diverge** (``.../diverge``, :func:`plant_divergence`): under random weights every row reveals one
  token per evaluation, so the rows of a batch move in lockstep and a decode never splits its refresh / window
  groups, finishes a row early or rides a finished row. This setting decodes 3 requests (the static plan's bucket 4:
  one padding row) with the dual cache under reduce-overhead, after planting a peaked LM-head row for the first
  request only: the head row of one token is set along that request's hidden state, orthogonal to the others', so
  the first request reveals a whole block per evaluation and finishes ``gen_length / block_size`` evaluations in,
  the others one token per evaluation. The planted row is put back after the setting.
"""

from __future__ import annotations

import bisect
import contextlib
import statistics
import time

from gpu_check import hook
from gpu_check_common import HOST_US_PER_LAUNCH_IS, RATIOS
from gpu_check_plan import compile_kw, find_setting, nfe_settings

ANCHOR_MS_PER_NFE = 585.0 / 40.08  # paper, Table 4 "16, dispersed (main)": 0.585 s for 40.08 NFE (GH200)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            "settings": {s["name"]: s for s in nfe_settings(ctx.dry_run, every=True)}}  # fmt: skip


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


def _models(ctx, name: str, layers: int | None = None):
    """(backbone, TDLM) of ``name``, built on first use: a stage that never reaches Dream never builds it.
    ``layers``: the depth option, LLaDA at its true width with this many layers (its own seeded random weights)."""
    import dataclasses

    import torch

    key = (name, layers)
    if key not in ctx.models:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[ctx.dtype_name]
        if layers:
            from gpu_train_probe import build_backbone

            assert name == "llada-8b", f"the depth option builds LLaDA only, not {name}"
            bb = build_backbone(dataclasses.replace(ctx.cfg, n_layers=layers), ctx.device, dtype, 0)
        else:
            bb = ctx.backbone if name == "llada-8b" else _dream(ctx.dry_run, ctx.device, dtype)
        ctx.models[key] = (bb, _live(bb, ctx.dry_run))
    return ctx.models[key]


def bb_layers(ctx, model: str) -> int:
    """The full depth of ``model`` in this run (the toy backbones' in a dry run)."""
    return _models(ctx, model)[0].num_layers


def nfe_item(ctx, name: str, partial) -> dict:
    """One decode setting (``nfe_settings``), its policies (threshold then tdlm, or the one it names); ``partial``
    after each policy."""
    import torch

    import tdlm
    from tdlm.training.planner import PeakMeter, tensor_bytes

    s = find_setting(name, ctx.dry_run)
    P, G, bs = _shape(ctx, s)
    bb, live = _models(ctx, s["model"], s.get("layers"))
    g = torch.Generator(device="cpu").manual_seed(1000 * s["batch"] + P)  # the same prompts after a restart
    rows = torch.randint(3, min(bb.vocab_size, 1000), (s["batch"], P), generator=g).tolist()
    req = [r[: P - (i * P) // (2 * s["batch"])] for i, r in enumerate(rows)]  # left-padded when batch > 1
    # profiled after the timed decode: compile=True at batch 1 (kernels per NFE, host time per launch) and every
    # reduce-overhead setting (its cudaGraphLaunch events: the proof that CUDA graphs were replayed at all)
    profiled = (s["mode"] == "compiled" and s["batch"] == 1) or s["mode"] == "reduce-overhead"
    how = compile_kw(s["mode"], ctx.dry_run)  # reduce-overhead: CUDA graphs + the static plan (compile_kw)
    row: dict = {k: s[k] for k in ("model", "batch", "cache", "mode", "purpose", "scope", "policies")}
    row |= {"gen_length": G} | how
    if s.get("layers"):  # the depth option: measured at these layers, extrapolated per layer to the full depth
        row.update(layers=s["layers"], full_layers=bb_layers(ctx, s["model"]))
    # .../diverge: a peaked LM-head row for the first request only, put back when the setting ends
    planted = plant_divergence(bb, req, G, ctx.device) if s["purpose"] == "diverge" else contextlib.nullcontext()
    with planted as plant:
        if plant:
            row["planted"] = plant
        for policy in s["policies"]:
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
                    # untimed: compiles / warms up every graph of this setting (reduce-overhead: records its CUDA
                    # graphs, at the static plan's addresses, which the timed decode of the same bucket replays)
                    tdlm.decode(target, req, **kw)
                    sync(ctx.device)
                    row[f"{policy}_warmup_s"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    res = tdlm.decode(target, req, **kw)
                    sync(ctx.device)
                    sec = time.perf_counter() - t0
                evals = max(r.nfe for r in res)
                row[f"{policy}_ms_per_nfe"] = 1000 * sec / evals
                if s.get("layers"):  # per layer: the LM head and the loop's own work counted full/layers times
                    full = row[f"{policy}_ms_per_nfe"] * row["full_layers"] / s["layers"]
                    row[f"{policy}_ms_per_nfe_full_depth"] = full
                row[f"{policy}_nfe"] = [r.nfe for r in res]
                # after the timed decode: the profiler slows what it watches. Under CUDA graphs the kernels are
                # replayed, not launched: a reduce-overhead profile counts graph launches, held to their ms/NFE.
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


@contextlib.contextmanager
def plant_divergence(backbone, req: list[list[int]], gen_length: int, device, margin: float = 12.0):
    """Make the first request's rows reveal a whole block per evaluation and the others one token each (the module
    docstring's rows that diverge), for the ``with`` block; yields what it planted and puts the head row back.

    One eager forward of the canvas (each prompt left-padded, then ``gen_length`` mask tokens) gives the LM head's
    input (after the final norm) at each request's masked positions; their means per request are ``H_0, H_1, ...``.
    The head row of a token ``T`` (not mask, EOS or pad) is set to ``alpha * w``: ``w`` is ``H_0`` less its part in
    the span of the other requests' means (so ``T``'s logit is about 0 at their positions), and ``alpha`` puts
    ``T``'s logit ``margin`` above the log-sum-exp of every other token at the least favourable masked position of
    request 0 (its probability above 1 - e^-margin, over any threshold). A bench planting, not a library hook: the
    weights are random anyway; compute per NFE does not depend on their values."""
    import torch

    head = backbone.model.transformer.ff_out  # LLaDA's LM head (untied): logits = ff_out(ln_f(h))
    n = len(req)
    P = max(len(r) for r in req)
    pad, mask = backbone.pad_token_id, backbone.mask_token_id
    ids = torch.tensor([[pad] * (P - len(r)) + list(r) + [mask] * gen_length for r in req], device=device)
    att = torch.tensor([[0] * (P - len(r)) + [1] * (len(r) + gen_length) for r in req], device=device)
    seen = {}
    handle = head.register_forward_pre_hook(lambda mod, args: seen.setdefault("h", args[0].detach()))
    try:
        with torch.no_grad():
            logits = backbone(ids, attention_mask=att)[:, P:].double()  # (n, G, V)
    finally:
        handle.remove()
    h = seen["h"][:, P:].double()  # (n, G, d): the head's input at the masked positions
    means = h.mean(1)  # (n, d)
    others = means[1:].T  # (d, n - 1)
    q, _ = torch.linalg.qr(others)
    w = means[0] - q @ (q.T @ means[0])  # H_0 orthogonal to the span of the others' means
    token = next(t for t in range(3, backbone.vocab_size) if t not in (pad, mask, backbone.eos_token_id))
    rest = torch.cat([logits[0, :, :token], logits[0, :, token + 1 :]], -1)  # request 0, every other token
    reach = (h[0] @ w).min()  # the projection at request 0's least favourable masked position
    assert reach > 0, f"request 0's hidden states do not lie along their mean ({float(reach)})"
    alpha = float((torch.logsumexp(rest, -1).max() + margin) / reach)
    saved = head.weight[token].detach().clone()
    with torch.no_grad():
        head.weight[token].copy_((alpha * w).to(head.weight.dtype))
    try:
        yield {"requests": n, "peaked_request": 0, "token": token, "alpha": alpha, "margin": margin,
               "other_requests_logit_at_mean": [float(alpha * (means[i] @ w)) for i in range(1, n)]}  # fmt: skip
    finally:
        with torch.no_grad():
            head.weight[token].copy_(saved)


def cudagraph_skips() -> int:
    """Inductor's running count of graphs it compiled for CUDA graphs but ran without them (``cudagraph_skips``;
    each skip also logs its reason): a process-wide counter, so a setting records its own increase."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def nfe_summary(doc: dict) -> None:
    """Compiled / eager, and each ratio of ``gpu_check_common.RATIOS`` (reduce-overhead / compiled-static,
    compiled-static / compiled), of the same model, batch and cache, wherever both have run."""
    rows = [r for r in doc["rows"] if r.get("purpose") == "speed"]

    # the row of ``mode`` with the same model, batch, cache and depth (and scope, for RATIOS) that ran ``policy``
    def same(r: dict, mode: str, policy: str) -> dict | None:
        key = ("model", "batch", "cache", "layers") + (("scope",) if mode != "eager" else ())
        return next((e for e in rows if e.get("mode") == mode and f"{policy}_ms_per_nfe" in e
                     and [e.get(k) for k in key] == [r.get(k) for k in key]), None)  # fmt: skip

    for r in rows:
        for mode, over in (("compiled", "eager"), *RATIOS):
            key = f"{mode}_over_{over}".replace("-", "_")  # e.g. reduce_overhead_over_compiled_static
            for policy in ("threshold", "tdlm"):
                base = same(r, over, policy) if r.get("mode") == mode else None
                if base and f"{policy}_ms_per_nfe" in r:
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
