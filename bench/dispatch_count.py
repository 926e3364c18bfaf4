"""Aten ops dispatched and kernels launched per denoiser evaluation (NFE): backbone vs TDLM (issue 21, item 7a).

At batch 1 on a GPU an 8B evaluation is bound by launches, not FLOPs, so what a temporal layer costs is the
number of operations it adds. Two counts:

* **eager, true shapes**: LLaDA-8B-Instruct and Dream-v0-Instruct-7B built on ``torch.device("meta")`` (no
  memory; bf16 as released), prompt 256 + 256 generated, batch 1. A ``TorchDispatchMode`` counts every aten op
  that reaches the dispatcher below autograd (what eager launches; views included, since each is a dispatch).
  One NFE = ``forward_step`` (TDLM, history of ``--warm`` earlier evaluations, the paper's allocation from
  configs/llada_8b.yaml / configs/dream_7b.yaml) or the backbone's ``forward``, full logits in both. Also
  counted in isolation: one backbone block (``Backbone.layer`` without insertion) and one temporal layer's
  insertion (everything the ``insert`` hook dispatches, history reads and writes included).
* **compiled, small width**: inductor (``torch.compile``, CPU C++ backend here) on the same layer count and
  allocation at width 64; counted are the calls in the generated ``call()`` of every compiled graph:
  generated fused kernels (``cpp_fused_*`` / ``triton_*``), ``extern_kernels.*`` (mm, bmm, addmm, SDPA...) and
  aten fallbacks (``torch.ops.aten.*``), i.e. the launches one evaluation makes. Op/kernel counts do not grow
  with width, so small width gives the count of the true model (fusion decisions can differ slightly).

Per temporal layer the compiled TDLM graph launches (``kernels_per_temporal_layer``, read off the generated
``call()``): the residual sum h = x + W_ao o materialised (inductor folds it into the next RMSNorm in the
backbone's graph, but the temporal projection is an extern GEMM and needs h in memory), the fused W_QKV GEMM, one
fused kernel (RoPE of q and, before this change, the layer's sink bias), the temporal SDPA and W_O as one
in-place ``baddbmm`` into h; the history writes of all layers are one kernel per NFE. ``--backbone-addmm``
adds a what-if count (``compiled_backbone_addmm``, LLaDA only): the backbone's attention output computed as
``torch.addmm(x, o, W_ao^T)``, so the extern GEMM writes h itself (a change to ``tdlm/models/llada.py``, proposed,
not made here).

Usage:  python bench/dispatch_count.py [--out bench/results/dispatch_count.json] [--no-compiled] [--backbone-addmm]
        [--against REF: older code's eager counts beside today's] [--carry OLD.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import add_against, machine, older_tree, write_result  # noqa: E402

import tdlm  # noqa: E402
from tdlm.models.loading import build_backbone  # noqa: E402
from tdlm.profiling.ledger import OpCounter, kernels_in  # noqa: E402  (the library's counters)

ROOT = Path(__file__).resolve().parents[1]
LLADA_8B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "mlp_hidden_size": 12288,
            "vocab_size": 126464, "embedding_size": 126464, "rope_theta": 500000.0}  # fmt: skip
DREAM_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "intermediate_size": 18944, "vocab_size": 152064, "rope_theta": 1000000.0}  # fmt: skip
MODELS = {"llada-8b": ("llada", LLADA_8B, "configs/llada_8b.yaml"), "dream-7b": ("dream", DREAM_7B,
                                                                                  "configs/dream_7b.yaml")}
def paper_temporal(path: str) -> tdlm.TemporalConfig:
    m = yaml.safe_load((ROOT / path).read_text())["model"]
    return tdlm.TemporalConfig(layers=m["layers"], heads=m["heads"], head_dim=m["head_dim"],
                               history=m.get("history", "full"))  # fmt: skip


def build(family: str, config: dict, temporal: tdlm.TemporalConfig, device: str, dtype: torch.dtype):
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the dtype (fake tensors cannot be swapped by .to afterwards)
    try:
        with torch.device(device):
            bb = build_backbone(family, config, f"{family}-shape").freeze()
            bb.backbone_id = f"{family}-shape"
            model = tdlm.TDLM(bb, temporal).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def canvas(model, prompt: int, gen: int, revealed: int, device: str) -> torch.Tensor:
    """(1, prompt + gen) ids: a prompt, ``revealed`` response tokens, the rest masked."""
    bb = model.backbone
    ids = torch.full((1, prompt + gen), bb.mask_token_id, dtype=torch.long, device=device)
    ids[:, :prompt] = 7
    ids[:, prompt : prompt + revealed] = 9
    return ids


def to_fake(module: torch.nn.Module, mode: FakeTensorMode) -> None:
    """Replace every parameter and buffer of a meta-built module by an uninitialised fake CPU tensor: kernels
    then dispatch as on a real CPU (e.g. SDPA picks its fused kernel, which a meta tensor would not)."""
    with mode:
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                               requires_grad=p.requires_grad)  # fmt: skip
            for name, t in list(mod._buffers.items()):
                if t is not None:
                    mod._buffers[name] = torch.empty(t.shape, dtype=t.dtype)


def eager_counts(name: str, prompt: int, gen: int, warm: int) -> dict:
    family, config, cfg_path = MODELS[name]
    model = build(family, config, paper_temporal(cfg_path), "meta", torch.bfloat16)
    mode = FakeTensorMode()
    to_fake(model, mode)
    with mode, torch.no_grad():
        return _eager_counts(model, prompt, gen, warm)


def _eager_counts(model, prompt: int, gen: int, warm: int) -> dict:
    bb = model.backbone
    ids = canvas(model, prompt, gen, warm, "cpu")
    with OpCounter() as c_bb:
        bb(ids)
    cache = model.new_cache(1)
    for s in range(warm):  # history of `warm` earlier evaluations
        model.forward_step(canvas(model, prompt, gen, s, "cpu"), prompt, cache)
    with OpCounter() as c_t:
        model.forward_step(ids, prompt, cache)
    x, ctx = bb.prepare(ids)
    with OpCounter() as c_block:
        bb.layer(model.layer_ids[0], x, ctx, None)
    # each temporal layer's insertion: everything its hook dispatches (history reads included; the entry it
    # hands to the cache is appended after the forward and counted only in the whole NFE)
    per_layer: dict[int, Counter[str]] = {}
    orig = type(model.backbone).layer

    def spy(self, index, x, ctx, insert=None):
        if insert is None or index not in model.layer_ids:
            return orig(self, index, x, ctx, insert)
        h = self.blocks[index].attend(x, ctx)
        with OpCounter() as c:
            h = insert(index, h)
        per_layer[index] = c.ops
        return self.blocks[index].feed_forward(h)

    type(model.backbone).layer = spy
    try:
        model.forward_step(canvas(model, prompt, gen, warm + 1, "cpu"), prompt, cache)
    finally:
        type(model.backbone).layer = orig
    n_t = len(model.layer_ids)
    block = c_block.total
    counts = [sum(per_layer[i].values()) for i in model.layer_ids]
    steady = max(counts[1:]) if n_t > 1 else counts[0]  # later layers reuse the evaluation's RoPE tables
    later = per_layer[model.layer_ids[-1]]
    return {
        "layers": bb.num_layers,
        "temporal_layers": n_t,
        "temporal_layer_ids": model.layer_ids,
        "heads_x_head_dim": [model.config.heads, model.config.head_dim],
        "backbone_ops_per_nfe": c_bb.total,
        "tdlm_ops_per_nfe": c_t.total,
        "tdlm_over_backbone": round(c_t.total / c_bb.total, 3),
        "block_ops": block,
        "temporal_layer_ops": steady,
        "first_temporal_layer_ops": counts[0],
        "temporal_layer_over_block": round(steady / block, 3),
        "nfe_delta_per_temporal_layer": round((c_t.total - c_bb.total) / n_t, 1),
        "nfe_delta_per_temporal_layer_over_block": round((c_t.total - c_bb.total) / n_t / block, 3),
        "temporal_layer_ops_by_name": dict(later.most_common()),
        "block_ops_by_name": dict(c_block.ops.most_common()),
    }


def compiled_counts(name: str, prompt: int, gen: int, warm: int, width: int, save_code: str | None = None) -> dict:
    from torch._inductor.utils import run_and_get_code

    family, config, cfg_path = MODELS[name]
    model = build(family, _small(family, config, width), _small_temporal(cfg_path), "cpu", torch.float32)
    bb = model.backbone
    ids = canvas(model, prompt, gen, warm, "cpu")
    torch._dynamo.reset()
    # Scalar C++ kernels: the same fused kernels (fusion is decided before code generation) without the vector
    # code path, which miscompiles some masked kernels of the unfused operator on this gcc (VecMask types).
    torch._inductor.config.cpp.vec_isa_ok = False
    with torch.no_grad():
        t0 = time.perf_counter()
        _, code_bb = run_and_get_code(torch.compile(bb), ids)
        t_bb = time.perf_counter() - t0
        cache = model.new_cache(1)
        for s in range(warm):
            model.forward_step(canvas(model, prompt, gen, s, "cpu"), prompt, cache)
        step = torch.compile(model.forward_step)
        t0 = time.perf_counter()
        _, code_t = run_and_get_code(step, ids, prompt, cache)
        t_t = time.perf_counter() - t0
    if save_code:
        Path(save_code).mkdir(parents=True, exist_ok=True)
        Path(save_code, f"{name}_backbone.py").write_text("\n".join(code_bb))
        Path(save_code, f"{name}_tdlm.py").write_text("\n".join(code_t))
    k_bb, k_t = kernels_in("\n".join(code_bb)), kernels_in("\n".join(code_t))
    n_bb, n_t = sum(k_bb.values()), sum(k_t.values())
    n_l = len(model.layer_ids)
    return {
        "width": width,
        "temporal_layers": n_l,
        "kernels_per_temporal_layer": round((n_t - n_bb) / n_l, 2),
        "graphs": {"backbone": len(code_bb), "tdlm": len(code_t)},
        "backbone_kernels_per_nfe": n_bb,
        "tdlm_kernels_per_nfe": n_t,
        "tdlm_over_backbone": round(n_t / n_bb, 3),
        "backbone_kernels_by_kind": dict(k_bb.most_common()),
        "tdlm_kernels_by_kind": dict(k_t.most_common()),
        "compile_s": {"backbone": round(t_bb, 1), "tdlm": round(t_t, 1)},
    }


def compiled_loop_counts(name: str, prompt: int, gen: int, block: int, width: int, cache: str = "dual",
                         in_order: bool = True) -> dict:  # fmt: skip
    """Kernels of the decode loop's own compiled graphs (``tdlm.decode(..., cache=cache, compile=True)``: inductor's
    step as the loop runs it, the written-out temporal attention included), batch 1, true depth and allocation at
    ``width``, backbone (threshold) and TDLM, in compile order: the first graph is an uncached evaluation or a
    block's refresh, the second (cached) its window step. ``in_order=False`` withdraws the loop's promise that the
    history's columns are the rows in order (TemporalCache.claim_rows / set_front(aligned=True)), so the temporal
    layers gather their rows and scatter-add the correction as with several rows."""
    from torch._inductor.utils import run_and_get_code

    from tdlm.temporal.history import TemporalCache

    family, config, cfg_path = MODELS[name]
    model = build(family, _small(family, config, width), _small_temporal(cfg_path), "cpu", torch.float32)
    bb = model.backbone
    ids = [7 + i % 50 for i in range(prompt)]
    kw = dict(cache=cache, gen_length=gen, block_size=block, threshold=0.9, compile=True)
    out: dict = {"width": width, "cache": cache, "in_order": in_order, "temporal_layers": len(model.layer_ids)}
    claim, set_front = TemporalCache.claim_rows, TemporalCache.set_front
    try:
        if not in_order:
            TemporalCache.claim_rows = lambda self, suffix: None
            TemporalCache.set_front = lambda self, columns, aligned=False: set_front(self, columns)
        for policy, target in (("backbone", bb), ("tdlm", model)):
            torch._dynamo.reset()
            with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
                res, code = run_and_get_code(lambda t=target, p=policy: tdlm.decode(
                    t, [ids], policy="threshold" if p == "backbone" else "tdlm", **kw))
            counts = [sum(kernels_in(c).values()) for c in code]
            out[policy] = {"graphs": counts, "refresh": counts[0], "window": counts[1] if len(counts) > 1 else None,
                           "nfe": res[0].nfe}  # fmt: skip
    finally:
        TemporalCache.claim_rows, TemporalCache.set_front = claim, set_front
    n_l = out["temporal_layers"]
    for kind in ("refresh", "window"):
        if out["tdlm"][kind] is not None and out["backbone"][kind] is not None:
            out[f"{kind}_kernels_per_temporal_layer"] = round((out["tdlm"][kind] - out["backbone"][kind]) / n_l, 2)
    return out


def _small(family: str, config: dict, width: int) -> dict:
    small, heads = dict(config), 4
    if family == "llada":
        small.update(d_model=width, n_heads=heads, n_kv_heads=heads, mlp_hidden_size=2 * width, vocab_size=256,
                     embedding_size=256, mask_token_id=255, eos_token_id=1, pad_token_id=1)  # fmt: skip
    else:
        small.update(hidden_size=width, num_attention_heads=heads, num_key_value_heads=2,
                     intermediate_size=2 * width, vocab_size=256, mask_token_id=255, eos_token_id=1,
                     pad_token_id=1)  # fmt: skip
    return small


def _small_temporal(cfg_path: str) -> tdlm.TemporalConfig:
    temporal = paper_temporal(cfg_path)
    temporal.heads, temporal.head_dim = 2, 16
    return temporal


@contextlib.contextmanager
def backbone_addmm():
    """What-if: LLaDA's attention sublayer returns ``addmm(x, o, W_ao^T)`` (the GEMM writes the residual sum)
    instead of ``x + attn_out(o)``; the same math. Restored on exit."""
    from tdlm.models import llada

    orig = llada.LLaDABlock.attend

    def attend(self, x, ctx, layer=None):
        B, L, _ = x.shape
        a = self.attn_norm(x)
        q = self.q_proj(a).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(a).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(a).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = llada.apply_rope(q, ctx.cos, ctx.sin), llada.apply_rope(k, ctx.cos, ctx.sin)
        o = llada.spatial_attention(q, k, v, ctx, layer).transpose(1, 2).reshape(B * L, -1)
        return torch.addmm(x.reshape(B * L, -1), o, self.attn_out.weight.t()).view(B, L, -1)

    llada.LLaDABlock.attend = attend
    try:
        yield
    finally:
        llada.LLaDABlock.attend = orig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/dispatch_count.json")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--warm", type=int, default=4, help="earlier evaluations in the temporal history")
    ap.add_argument("--width", type=int, default=64, help="hidden size of the compiled count")
    ap.add_argument("--compiled-prompt", type=int, default=16)
    ap.add_argument("--compiled-gen", type=int, default=16)
    ap.add_argument("--no-compiled", action="store_true", help="eager counts only (no inductor compile)")
    ap.add_argument("--save-code", default=None, help="folder to write the inductor output code to")
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. which attention code ran)")
    add_against(ap, "its eager counts at this run's shape (that tree's own dispatch_count.py, --no-compiled), "
                    "embedded as 'before' and printed beside today's")
    ap.add_argument("--carry", default=None, metavar="JSON",
                    help="an earlier result whose compiled counts are carried over for the models not compiled now")
    ap.add_argument("--compiled-models", default=",".join(MODELS),
                    help="comma list of models whose compiled graph is counted (the others are carried over from "
                         "--carry when given)")
    ap.add_argument("--loop", action="store_true",
                    help="also count the decode loop's own compiled graphs (compiled_loop): uncached, and the dual "
                         "cache's refresh and window with and without the loop's rows-in-order promise")
    ap.add_argument("--backbone-addmm", action="store_true",
                    help="also count LLaDA compiled with the backbone's attention output as one addmm (what-if)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = {"prompt": args.prompt, "gen": args.gen, "batch": 1, "dtype": "bfloat16", "warm_history": args.warm}
    result: dict = {"machine": machine(), "load_before": os.getloadavg(), "label": args.label, "shape": shape,
                    "eager": {}, "compiled": {}}
    print(f"eager aten ops per NFE (meta tensors, true shapes, prompt {args.prompt} + {args.gen}, batch 1)")
    print(f"{'model':10} {'backbone':>9} {'tdlm':>7} {'ratio':>6} {'block':>6} {'t-layer':>8} {'t/block':>8} "
          f"{'NFE delta/L_t':>14}")
    for name in MODELS:
        r = eager_counts(name, args.prompt, args.gen, args.warm)
        result["eager"][name] = r
        print(f"{name:10} {r['backbone_ops_per_nfe']:9d} {r['tdlm_ops_per_nfe']:7d} {r['tdlm_over_backbone']:6.3f} "
              f"{r['block_ops']:6d} {r['temporal_layer_ops']:8d} {r['temporal_layer_over_block']:8.3f} "
              f"{r['nfe_delta_per_temporal_layer']:14.1f}")
    if not args.no_compiled:
        print(f"\ncompiled kernels per NFE (inductor, {'cpu'}, width {args.width}, true depth and allocation)")
        print(f"{'model':10} {'backbone':>9} {'tdlm':>7} {'ratio':>6} {'graphs':>7}")
        carried = json.loads(Path(args.carry).read_text()) if args.carry else {}
        for name in MODELS:
            if name not in args.compiled_models.split(","):
                if name in carried.get("compiled", {}):
                    old = dict(carried["compiled"][name], carried_over_from=args.carry)
                    n_l = carried["eager"][name]["temporal_layers"]
                    old.setdefault("temporal_layers", n_l)
                    old.setdefault("kernels_per_temporal_layer",
                                   round((old["tdlm_kernels_per_nfe"] - old["backbone_kernels_per_nfe"]) / n_l, 2))
                    result["compiled"][name] = old
                    print(f"{name:10} carried over from {args.carry}")
                continue
            with contextlib.suppress(KeyboardInterrupt):
                r = compiled_counts(name, args.compiled_prompt, args.compiled_gen, args.warm, args.width,
                                    args.save_code)  # fmt: skip
                result["compiled"][name] = r
                print(f"{name:10} {r['backbone_kernels_per_nfe']:9d} {r['tdlm_kernels_per_nfe']:7d} "
                      f"{r['tdlm_over_backbone']:6.3f} {r['graphs']['tdlm']:7d}")
        if args.backbone_addmm:
            with backbone_addmm():
                r = compiled_counts("llada-8b", args.compiled_prompt, args.compiled_gen, args.warm, args.width)
            result["compiled_backbone_addmm"] = {"llada-8b": r}
            print(f"{'llada-8b':10} {r['backbone_kernels_per_nfe']:9d} {r['tdlm_kernels_per_nfe']:7d} "
                  f"{r['tdlm_over_backbone']:6.3f} {r['graphs']['tdlm']:7d}  (what-if: backbone attention output "
                  f"as addmm)")
        if args.loop:
            result["compiled_loop"] = {}
            print(f"\ncompiled graphs of the decode loop (batch 1, width {args.width}): kernels backbone / tdlm "
                  f"(per temporal layer)")
            for name in args.compiled_models.split(","):
                result["compiled_loop"][name] = {}
                for cache, in_order in (("none", False), ("prefix", False), ("dual", True), ("dual", False)):
                    r = compiled_loop_counts(name, args.compiled_prompt, args.compiled_gen, 8, args.width, cache,
                                             in_order)  # fmt: skip
                    key = cache if cache != "dual" else f"dual {'rows in order' if in_order else 'gathered'}"
                    result["compiled_loop"][name][key] = r
                    print(f"{name:10} {key:22s} first graph "
                          f"{r['backbone']['refresh']} / {r['tdlm']['refresh']} "
                          f"({r.get('refresh_kernels_per_temporal_layer')}), window {r['backbone']['window']} / "
                          f"{r['tdlm']['window']} ({r.get('window_kernels_per_temporal_layer')})", flush=True)
        for name, r in result["compiled"].items():
            print(f"{name}: {r['kernels_per_temporal_layer']} kernels per temporal layer (target <= 3)")
    e = result["eager"]
    result["load_after"] = os.getloadavg()
    result["targets"] = {
        "temporal_layer_over_block_le_0.5": {k: v["temporal_layer_over_block"] <= 0.5 for k, v in e.items()},
        "compiled_tdlm_over_backbone_le_1.10": {k: v["tdlm_over_backbone"] <= 1.10
                                                for k, v in result["compiled"].items()},
        "compiled_kernels_per_temporal_layer_le_3": {k: v["kernels_per_temporal_layer"] <= 3
                                                     for k, v in result["compiled"].items()},
    }
    if args.against:
        result["before"] = older_counts(args.against, args.prompt, args.gen, args.warm)
        print_before_after(result["before"], result)
    write_result(args.out, result)


def older_counts(ref: str, prompt: int, gen: int, warm: int) -> dict:
    """The eager counts of the older code ``--against REF`` names: that tree's own ``bench/dispatch_count.py`` run in
    a subprocess (its root first on its ``sys.path``, so its ``tdlm``) at this run's shape, eager only (a compiled
    count of old code would take minutes per model; compare those with ``--carry``)."""
    import subprocess
    import tempfile

    tree = older_tree(ref, ("tdlm", "bench", "configs"))
    script = tree / "bench" / "dispatch_count.py"
    if not script.is_file():
        raise SystemExit(f"--against {ref}: {script} is not there to count the older code with")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        cmd = [sys.executable, str(script), "--no-compiled", "--out", str(out), "--prompt", str(prompt), "--gen",
               str(gen), "--warm", str(warm)]  # fmt: skip
        subprocess.run(cmd, cwd=tree, check=True)
        return json.loads(out.read_text()) | {"against": ref}


def print_before_after(before: dict, after: dict) -> None:
    print(f"\n{'':22} {'before':>8} {'after':>8}")
    for name in after["eager"]:
        b, a = before["eager"].get(name, {}), after["eager"][name]
        for key in ("block_ops", "temporal_layer_ops", "temporal_layer_over_block", "tdlm_ops_per_nfe",
                    "tdlm_over_backbone"):  # fmt: skip
            print(f"{name + ' ' + key:40} {b.get(key, float('nan')):>8} {a[key]:>8}")
        bc, ac = before.get("compiled", {}).get(name, {}), after.get("compiled", {}).get(name, {})
        for key in ("backbone_kernels_per_nfe", "tdlm_kernels_per_nfe", "tdlm_over_backbone"):
            print(f"{name + ' compiled ' + key:40} {bc.get(key, float('nan')):>8} {ac.get(key, float('nan')):>8}")


if __name__ == "__main__":
    main()
