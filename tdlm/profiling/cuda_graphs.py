"""What inductor's CUDA-graph trees check before they capture a compiled graph, read on a CPU (no GPU needed).

CUDA-graph trees (torch 2.13, ``torch/_inductor/cudagraph_utils.py: check_for_mutation``) run a graph without a CUDA
graph when it mutates an input in place that is neither static (a parameter, a buffer, a tensor given to
``torch._dynamo.mark_static_address``) nor the output of an earlier recorded graph, or when it holds an op a CUDA
graph cannot (``get_first_incompatible_cudagraph_node``). Both are decided on the graph: :func:`probe` records them
for every graph inductor compiles while a callable runs. Driver: ``bench/cuda_graph_readiness.py``.
"""

from __future__ import annotations

import torch


def input_role(val) -> str:
    """What a mutated graph input is, from its shape and dtype as the decode step holds it."""
    if not isinstance(val, torch.Tensor):
        return type(val).__name__
    shape = "x".join(str(s) for s in val.shape)
    if val.dim() == 6:
        return f"temporal history storage {shape}"
    if val.dim() == 4 and val.is_floating_point():
        return f"spatial KV cache {shape}"
    if val.dim() == 3 and val.dtype == torch.bool:
        return f"temporal history validity {shape}"
    if val.dim() == 2 and not val.is_floating_point():
        return f"temporal history counts / columns {shape}"
    return f"{str(val.dtype).removeprefix('torch.')} {shape}"


def probe(decode) -> list[dict]:
    """Run ``decode()`` and return, per graph inductor compiled during it, its mutated inputs and their status."""
    from torch._inductor import output_code
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    seen: list[dict] = []
    orig = output_code.CompiledFxGraph.__init__

    def init(self, current_callable, graph, gm, *rest, **kw):
        orig(self, current_callable, graph, gm, *rest, **kw)
        static = set(rest[6] if len(rest) > 6 else kw.get("static_input_idxs") or ())  # after example_inputs
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        mutated = sorted(self.mutated_input_idxs)
        bad = get_first_incompatible_cudagraph_node(gm)  # an op CUDA graphs cannot hold (e.g. unbacked sizes)
        seen.append({"inputs": len(holders), "static_inputs": len(static),
                     "mutated": [{"input": holders[i].name, "what": input_role(holders[i].meta.get("val")),
                                  "static": i in static} for i in mutated],
                     "incompatible_op": None if bad is None else str(bad.target),
                     "captured": bad is None and all(i in static for i in mutated)})  # fmt: skip

    output_code.CompiledFxGraph.__init__ = init
    try:
        # every graph compiled afresh here: a graph loaded from inductor's caches skips __init__
        with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):  # fmt: skip
            torch._dynamo.reset()
            decode()
    finally:
        output_code.CompiledFxGraph.__init__ = orig
    return seen
