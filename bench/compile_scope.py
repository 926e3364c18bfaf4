"""Cold compile time and time per NFE of ``compile_scope="model"`` against ``"block"``, side by side in one process.

Commands (from the repository root, venv active)::

    python bench/compile_scope.py           # tiny-llada + a 32-layer LLaDA -> bench/results/compile_scope.json
    python bench/compile_scope.py --quick   # tiny + 8 layers, aot_eager, 2 rounds; prints only unless --out is given

**Settings.** The real ``tdlm.models.llada.LLaDA`` class: ``tiny`` is the ``tiny-llada`` preset (d 64 x 4 layers);
``deep`` is LLaDA-8B's depth and head layout at a small width (d 128 x 32 layers, 2 heads of 64, SwiGLU 344, vocab
1024, seeded random weights, LM head x 60 so blocks take several evaluations). One prompt of 16 tokens, 32 tokens in
blocks of 8, policy threshold (tau 0.9), no spatial cache: one step kind, so the cold compile is that of one graph per
region (block) or of the one step graph (model).

**Cold compile.** Per setting ``torch._dynamo.reset()``; per scope inductor's caches emptied
(``torch._inductor.utils.fresh_cache``: a fresh cache folder and its in-memory caches cleared), then one decode (the
scopes compile different functions, so the second's is cold too);
compile seconds = that decode's wall seconds - the median wall seconds of the same decode warm. Dynamo's
``unique_graphs`` counter gives the graphs it compiled.

**Per NFE** (:mod:`timing`): eager, model and block decode the same request once per round, order rotated, after
the cold decode; process CPU seconds / NFE, one torch thread; min and median. ``same_tokens``: each compiled scope
decoded eager's tokens and NFE (inductor can move the last bits of a logit; the tiny models' decisions keep margins).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from benchlib import exit_with, machine, write_result  # noqa: E402  (bench/ is on sys.path as a script)
from timing import interleaved, ratio, summary  # noqa: E402

import tdlm  # noqa: E402
from tdlm.decoding import decode  # noqa: E402
from tdlm.models.loading import random_backbone  # noqa: E402

RESULTS = REPO / "bench" / "results" / "compile_scope.json"
DEEP = dict(
    d_model=128, n_layers=32, n_heads=2, n_kv_heads=2, mlp_hidden_size=344, vocab_size=1024, embedding_size=1024,
    mask_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
)  # fmt: skip
PROMPT = [[3, 4, *range(40, 54)]]  # 16 tokens
DECODE = dict(policy="threshold", gen_length=32, block_size=8, threshold=0.9)
SCOPES = ("model", "block")


def backbone(depth: int | None):
    """tiny-llada (``depth`` None) or the deep LLaDA at ``depth`` layers, with a peaky head (several evaluations per
    block, as real checkpoints take)."""
    if depth is None:
        bb = tdlm.load_backbone("tiny-llada")
    else:
        bb = random_backbone("llada", {**DEEP, "n_layers": depth}, seed=0, backbone_id=f"deep-llada-{depth}")
    with torch.no_grad():
        bb.model.transformer.ff_out.weight.mul_(60.0)
    return bb


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def cold(bb, backend, scope: str) -> dict:
    """One decode with ``scope``'s regions absent from dynamo's caches and inductor's caches empty: its wall seconds
    and the graphs it compiled."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.utils.counters.clear()
    with fresh_cache():
        t0 = time.perf_counter()
        res = decode(bb, PROMPT, compile=backend, compile_scope=scope, **DECODE)
        wall = time.perf_counter() - t0
        graphs = _graphs()
    return {"wall_s": wall, "graphs": graphs, "key": [(r.tokens, r.nfe) for r in res]}


def measure(name: str, depth: int | None, backend, rounds: int) -> dict:
    bb = backbone(depth)
    eager = decode(bb, PROMPT, **DECODE)
    key = [(r.tokens, r.nfe) for r in eager]
    nfe = eager[0].nfe
    row: dict = {"setting": name, "layers": bb.num_layers, "d_model": bb.hidden_size, "nfe": nfe, "compile": backend}
    # One reset per setting: the two scopes compile different functions (the model scope the step, the block scope
    # its regions), so the second scope's first decode traces cold without a reset between them, and the first
    # scope's graphs stay for the warm rounds below (a reset there would compile 32 layers whole a second time).
    torch._dynamo.reset()
    colds = {scope: cold(bb, backend, scope) for scope in SCOPES}
    for scope in SCOPES:
        print(f"  {name} {scope}: cold decode {colds[scope]['wall_s']:.1f} s, {colds[scope]['graphs']} graphs",
              flush=True)  # fmt: skip
    cands = {"eager": lambda: decode(bb, PROMPT, **DECODE)}
    for scope in SCOPES:
        cands[scope] = lambda s=scope: decode(bb, PROMPT, compile=backend, compile_scope=s, **DECODE)
    torch._dynamo.utils.counters.clear()
    t = interleaved(cands, rounds, warmup=1)
    row["graphs_compiled_warm"] = _graphs()  # graphs compiled after the cold decodes (warm-up and timed rounds)
    for scope in SCOPES:
        warm_wall = summary(t.seconds(scope, "wall"))["median"]
        row[scope] = {
            "cold_decode_s": colds[scope]["wall_s"],
            "compile_s": colds[scope]["wall_s"] - warm_wall,
            "graphs": colds[scope]["graphs"],
            "same_tokens": colds[scope]["key"] == key and all([(r.tokens, r.nfe) for r in s.value] == key
                                                              for s in t.samples[scope]),
        }  # fmt: skip
    for cand in cands:
        row.setdefault(cand, {})["per_nfe_ms"] = summary([1e3 * x for x in t.seconds(cand, "cpu", lambda s: nfe)])
    row["block_over_model_per_nfe"] = ratio(t.seconds("block"), t.seconds("model"))
    row["block_over_model_compile"] = row["block"]["compile_s"] / row["model"]["compile_s"]
    return row


def table(rows: list[dict]) -> list[str]:
    out = [f"{'setting':<14} {'layers':>6} {'scope':<6} {'graphs':>6} {'compile s':>10} {'per NFE ms (min/med)':>22} "
           f"{'same tokens':>11}"]  # fmt: skip
    for r in rows:
        e = r["eager"]["per_nfe_ms"]
        out.append(f"{r['setting']:<14} {r['layers']:>6} {'eager':<6} {'-':>6} {'-':>10} "
                   f"{e['min']:>10.2f} / {e['median']:>9.2f} {'-':>11}")  # fmt: skip
        for scope in SCOPES:
            s = r[scope]
            p = s["per_nfe_ms"]
            out.append(f"{'':<14} {'':>6} {scope:<6} {s['graphs']:>6} {s['compile_s']:>10.1f} "
                       f"{p['min']:>10.2f} / {p['median']:>9.2f} {str(s['same_tokens']):>11}")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="32", help="layers of the deep settings, comma-separated (default 32)")
    ap.add_argument("--compile", default="True", help="compile= value timed (default True: inductor)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="aot_eager, tiny + 8 layers, 2 rounds; prints only")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/compile_scope.json; none with "
                    "--quick)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    backend = {"True": True, "true": True}.get(args.compile, args.compile)
    depths, rounds = [int(d) for d in args.depths.split(",")], args.rounds
    if args.quick:
        backend, depths, rounds = "aot_eager", [8], 2
    settings = [("tiny-llada", None)] + [(f"deep-llada-{d}", d) for d in depths]
    rows = []
    for name, depth in settings:
        print(f"{name}: compile={backend!r}", flush=True)
        rows.append(measure(name, depth, backend, rounds))
    print("\n".join(table(rows)))
    out = args.out or (None if args.quick else RESULTS)
    if out:
        write_result(out, {"machine": machine(), "decode": {**DECODE, "prompt_tokens": len(PROMPT[0]), "batch": 1},
                           "deep_config": DEEP, "rounds": rounds, "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    exit_with(main)
