"""Would CUDA graphs capture the compiled decode steps? What inductor's CUDA-graph trees check, read on this CPU.

``compile="reduce-overhead"`` (``tdlm.DecodeConfig.compile``) asks inductor to replay each compiled step as a CUDA
graph, which is what makes the launch term of ``bench/true_shape.py`` about 0 (its "CUDA graphs" column). CUDA-graph
trees (torch 2.13, ``torch/_inductor/cudagraph_utils.py: check_for_mutation``) run a graph without a CUDA graph
when it mutates an input in place that is neither static (a parameter, a buffer, a tensor given to
``torch._dynamo.mark_static_address``) nor the output of an earlier recorded graph. That check needs no GPU: it is
made on the graph, as is the check for ops a CUDA graph cannot hold (``get_first_incompatible_cudagraph_node``).
This bench decodes tiny LLaDA and Dream models with ``compile=True`` (inductor, CPU) and records,
for every graph inductor compiles, the inputs it mutates and whether each is static (``CompiledFxGraph``'s
``mutated_input_idxs`` and ``static_input_idxs``, the numbers the trees use), each input named by its shape as the
decode step holds it: a temporal history storage (B, W, 2, M, 1 + C, d_h), its validity (B, W, 1 + C) or counts
(B, W), or a spatial KV cache (B, H, L, d_h). Each cache mode runs with the dynamic storage plan at batch 1, and
with the static plan (``DecodeConfig.storage="static"``, tdlm/decoding/static_plan.py: the history, the spatial KV
cache and the canvas allocated once per bucket at their final size, marked with ``torch._dynamo.mark_static_address``,
written in place only) at batch 1 and for a left-padded batch of
three whose rows finish at different evaluations (``storage`` and ``batch`` of each row).

Only which graphs would be captured is established here; what a capture then costs on a GPU is not.

Usage:  python bench/cuda_graph_readiness.py [--plans dynamic,static] [--models tiny-llada,tiny-dream]
                                            [--out bench/results/cuda_graph_readiness.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from benchlib import machine, write_result  # noqa: E402

import tdlm  # noqa: E402
from tdlm.models.loading import load_backbone  # noqa: E402
from tdlm.profiling.cuda_graphs import probe  # noqa: E402
from tdlm.temporal.model import TDLM, TemporalConfig  # noqa: E402

# one prompt (the paper's latency setting), and a left-padded batch of three whose rows finish at different
# evaluations (the static plan decodes it in bucket 4: a padding row; refresh and window steps of different rows meet)
BATCHES = {"1": [[3, 4, 40, 41, 42, 43]],
           "3 padded": [[3, 5, 50, 51], [3, 4, 70, 71, 72, 73, 74, 75, 76], [3, 9, 60, 61, 62]]}  # fmt: skip
# (cache, storage plan, batch): every cache mode with the dynamic plan at batch 1 (what it leaves uncaptured) and with
# the static plan at batch 1 and padded
RUNS = [(cache, storage, batch) for cache in ("none", "prefix", "dual")
        for storage, batch in (("dynamic", "1"), ("static", "1"), ("static", "3 padded"))]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda_graph_readiness.json"))
    ap.add_argument("--models", default="tiny-llada,tiny-dream")
    ap.add_argument("--plans", default="dynamic,static", help="storage plans to probe (inductor compiles on this CPU "
                    "take minutes per TDLM graph: 'static' alone is the issue-41 check)")
    args = ap.parse_args(argv)
    plans = args.plans.split(",")
    if not plans or set(plans) - {"dynamic", "static"}:
        ap.error(f"--plans {args.plans!r}: expected a comma-separated subset of dynamic,static")
    torch.manual_seed(0)
    result: dict = {"machine": machine(), "load_before": os.getloadavg(), "torch": torch.__version__, "rows": []}
    print(f"{'model':11s} {'cache':6s} {'storage':8s} {'batch':7s} {'policy':9s} {'graphs':>6s} {'captured':>8s}  "
          f"mutated inputs that are not static")
    for name in args.models.split(","):
        bb = load_backbone(name)
        model = TDLM(bb, TemporalConfig(layers="all", history="full")).eval()
        for cache, storage, batch in RUNS:
            if storage not in plans:
                continue
            for policy, target in (("threshold", bb), ("tdlm", model)):
                graphs = probe(lambda t=target, p=policy, c=cache, s=storage, b=batch: tdlm.decode(
                    t, BATCHES[b], policy=p, cache=c, storage=s, gen_length=16, block_size=8, compile=True))
                blocked = sorted({m["what"].split(" 1x")[0].split(" 2x")[0]
                                  for g in graphs for m in g["mutated"] if not m["static"]})  # fmt: skip
                row = {"model": name, "cache": cache, "storage": storage, "batch": batch, "policy": policy,
                       "graphs": graphs, "captured": sum(g["captured"] for g in graphs),
                       "not_static_mutated": blocked}  # fmt: skip
                result["rows"].append(row)
                print(f"{name:11s} {cache:6s} {storage:8s} {batch:7s} {policy:9s} {len(graphs):6d} "
                      f"{row['captured']:8d}  {', '.join(blocked) or '-'}", flush=True)  # fmt: skip
                write_result(args.out, {**result, "complete": False})  # what finished survives a stop
    result["load_after"] = os.getloadavg()
    result["complete"] = True
    for storage in plans:
        rows = [r for r in result["rows"] if r["storage"] == storage]
        n, got = sum(len(r["graphs"]) for r in rows), sum(r["captured"] for r in rows)
        result[f"{storage}_captured"] = {"graphs": n, "captured": got}
        print(f"{storage} plan: {got} of {n} graphs captured")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
