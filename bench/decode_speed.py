"""TDLM's time per evaluation against the backbone's, eager and compiled, side by side (issue 26).

Commands (from the repository root, venv active)::

    python bench/decode_speed.py                         # tiny-multi + medium -> bench/results/decode_speed.json
    python bench/decode_speed.py --suite tiny --rounds 7 # only the demo's setting
    python bench/decode_speed.py --profile               # + where TDLM's extra time goes (torch.profiler)
    python bench/decode_speed.py --quick                 # small shapes, 2 rounds; prints only unless --out is given
    python bench/decode_speed.py --storage dynamic,static # the static storage plan beside the dynamic one (issue 41)
                                                         #   -> bench/results/decode_speed_storage.json
    python bench/decode_speed.py --against REF           # the decoding loop of REF (revision or folder) beside today's
                                                         #   -> bench/results/decode_speed_against.json

**Settings.**

* ``tiny``: the demo's. The shipped ``tiny-multi`` backbone (fp32) with the demo's trained adapter (``--adapter``,
  default ``runs/demo/train/adapter``: 3 temporal of 6 layers, 2 x 32 heads, history ``full``), the first
  ``--batch`` (50, the demo's evaluation batch) multi-v1 test problems in one batch, 56 tokens in one block,
  tau 0.9: exactly what ``make demo``'s evaluator decodes.
* ``medium``: the real ``tdlm.models.llada.LLaDA`` class at d 512 x 8 layers (seeded random weights, the LM head
  x ``--head-scale`` so blocks take a few evaluations), a 256-token prompt + 256 tokens, block 32, batch 1,
  tau 0.9, without a cache and with the dual cache; TDLM is the default config (4 dispersed layers of 4 x 64)
  with history ``last:32`` and W_O = 0, so its tokens equal threshold's (Prop. 1).

**Timing** (:mod:`timing`, the shared harness). In one process, per setting, the four candidates backbone /
TDLM x eager / compiled (``compile=True``: inductor, fullgraph) decode the same request batch once per round, in
an order rotated every round, after untimed warm-ups (a whole decode each, so compiled rows exclude compilation).
One torch thread; process CPU seconds (robust to other processes on a shared machine; wall seconds are kept
too). Time per NFE = seconds / the rows' mean NFE (:func:`batch_nfe`: one evaluation of the whole batch; rows
leave when done, so seconds / evaluations would favour the method whose rows finish late). Reported: TDLM /
backbone per NFE as min/min and as the median of per-round ratios, and compiled / eager.

**Targets** (issue 26): TDLM <= 1.15x the backbone per evaluation on ``tiny``, eager and compiled; <= 1.10x on
``medium``, uncached and dual; compiled never slower than eager for TDLM. The verdict uses min/min.

``--storage dynamic,static`` (issue 41) adds the static storage plan (``DecodeConfig.storage="static"``: buffers at
fixed addresses, batch buckets with padding rows, prompts padded to 32 tokens, finished rows kept; what CUDA graphs
need) as candidates ``backbone@static`` and ``tdlm@static`` beside the dynamic plan's in the same rounds, and reports
static / dynamic per NFE for each method and mode; the CPU rule: a plan that runs by default may not be more than 5%
slower per NFE than the other (``static_within_5pct``), else the CPU keeps the dynamic default.

``--against REF`` (every bench's flag for older code, ``benchlib.add_against``: a git revision or a folder holding an
older checkout) adds the candidates ``backbone@REF`` and ``tdlm@REF``: the same decodes through
``tdlm/decoding/loop.py`` as it was there (``git archive`` of that one file, loaded into a module of its own; every
other module is today's), beside today's loop in the same rounds, and reports today / REF per NFE (a change of the
loop may not slow the plan that runs by default by more than 5%: ``now_within_5pct``).

``--profile`` adds, per setting, the self CPU time per evaluation of every aten op (eager) and of every inductor
kernel (compiled, ``torch._inductor.config.cpp.enable_kernel_profile``) for one decode of each method, and the
ops / kernels where TDLM spends the most beyond the backbone.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from benchlib import add_against, machine, older_tree, write_result  # noqa: E402  (bench/ is on sys.path as a script)
from timing import interleaved, ratio, summary  # noqa: E402

import tdlm  # noqa: E402
from tdlm.errors import TDLMError  # noqa: E402

RESULTS = REPO / "bench" / "results" / "decode_speed.json"
DEFAULT_ADAPTER = REPO / "runs" / "demo" / "train" / "adapter"
MEDIUM = dict(
    d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, mlp_hidden_size=1376, vocab_size=1024,
    embedding_size=1024, mask_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
)  # fmt: skip
TARGETS = {"tiny": 1.15, "medium": 1.10, "compiled_over_eager_max": 1.0, "static_over_dynamic_max": 1.05}
STORAGE_RESULTS = REPO / "bench" / "results" / "decode_speed_storage.json"
AGAINST_RESULTS = REPO / "bench" / "results" / "decode_speed_against.json"


def loop_at(ref: str):
    """``tdlm/decoding/loop.py`` of the older code ``--against REF`` names (a git revision or a folder: benchlib's
    ``older_tree``), as a module of its own (its imports are today's)."""
    import types

    path = older_tree(ref, ("tdlm/decoding/loop.py",)) / "tdlm" / "decoding" / "loop.py"
    if not path.is_file():
        raise TDLMError(f"--against {ref}: {path} is not a file")
    mod = types.ModuleType(f"tdlm_decoding_loop_at_{Path(ref).name or ref}")
    mod.__file__ = f"{ref}:tdlm/decoding/loop.py"
    sys.modules[mod.__name__] = mod  # dataclasses look their module up there
    exec(compile(path.read_text(), mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - this repository's own history
    return mod


MODES = (("eager", False), ("compiled", True))


def tiny_setting(adapter: Path, batch: int) -> dict:
    """The demo's evaluation batch: tiny-multi + the demo adapter, ``batch`` test prompts, 56 tokens, one block."""
    from tdlm.data.tokenizer import encode_prompts, load_tokenizer, stop_token_ids
    from tdlm.tasks.multi import load_split
    from tdlm.tasks.toydata import MULTI_GEN_LENGTH

    if not (adapter / "adapter.safetensors").exists():
        raise TDLMError(f"--adapter {adapter}: no adapter.safetensors there; run `make demo` first (it trains the "
                        f"demo adapter into runs/demo/train/adapter) or pass the folder of one")  # fmt: skip
    bb = tdlm.load_backbone("tiny-multi", dtype="float32")
    model = tdlm.TDLM.from_adapter(bb, adapter).eval()
    # The same adapter with W_O = 0 decodes the backbone's own tokens (Prop. 1): the same evaluations with the
    # same rows, so its time per evaluation against the backbone's is the temporal overhead alone.
    zero = tdlm.TDLM.from_adapter(bb, adapter).eval()
    with torch.no_grad():
        for mod in zero.temporal.values():
            mod.o_proj.weight.zero_()
    tok = load_tokenizer("tiny-multi")
    prompts = encode_prompts(tok, [p.prompt for p in load_split("test", batch)])
    cfg = tdlm.DecodeConfig(gen_length=MULTI_GEN_LENGTH, block_size=MULTI_GEN_LENGTH, threshold=0.9)
    kw = {"tokenizer": tok, "stop_ids": stop_token_ids(tok, bb.eos_token_id)}
    return {"name": "tiny", "label": f"tiny-multi + demo adapter, batch {batch}", "model": model, "prompts": prompts,
            "cfg": cfg, "kw": kw, "target": TARGETS["tiny"], "zero": zero}  # fmt: skip


def medium_settings(head_scale: float, history: str, quick: bool) -> list[dict]:
    from tdlm.models.loading import random_backbone

    backbone = random_backbone("llada", MEDIUM, 0, "medium-llada")
    with torch.no_grad():
        backbone.model.transformer.ff_out.weight.mul_(head_scale)
    model = tdlm.TDLM(backbone, tdlm.TemporalConfig(history=history)).eval()
    prompt_len, gen = (64, 64) if quick else (256, 256)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(8, MEDIUM["vocab_size"], (prompt_len,), generator=g).tolist()
    return [{"name": f"medium-{cache}", "label": f"medium LLaDA d512x8, {prompt_len}+{gen}, cache {cache}",
             "model": model, "prompts": [prompt], "cfg": tdlm.DecodeConfig(gen_length=gen, block_size=32,
                                                                           threshold=0.9, cache=cache),
             "kw": {}, "target": TARGETS["medium"]} for cache in ("none", "dual")]  # fmt: skip


def candidates(s: dict, compile_: str, modes=MODES, static: bool = False, against: tuple | None = None) -> dict:
    """``method/mode`` -> a decode of the setting's batch; ``static``: also ``method@static/mode``, the same decode
    under the static storage plan; ``against`` (rev, loop module): also ``method@rev/mode`` through that loop (either
    way no W_O = 0 row)."""
    model = s["model"]
    out = {}
    methods = [("backbone", model.backbone, "threshold", "dynamic", tdlm.decode), ("tdlm", model, "tdlm", "dynamic",
                                                                                  tdlm.decode)]  # fmt: skip
    if static:
        methods += [("backbone@static", model.backbone, "threshold", "static", tdlm.decode),
                    ("tdlm@static", model, "tdlm", "static", tdlm.decode)]
    if against is not None:
        rev, old = against
        methods += [(f"backbone@{rev}", model.backbone, "threshold", None, old.decode),
                    (f"tdlm@{rev}", model, "tdlm", None, old.decode)]
    if s.get("zero") is not None and not static and against is None:
        methods.append(("tdlm-zero", s["zero"], "tdlm", "dynamic", tdlm.decode))
    for method, target, policy, storage, fn in methods:
        for mode, comp in modes:
            c = compile_ if comp else False
            plan = {} if storage is None else {"storage": storage}  # (a loop before the storage plans has no field)
            out[f"{method}/{mode}"] = (lambda t=target, p=policy, c=c, plan=plan, fn=fn: fn(
                t, s["prompts"], s["cfg"], policy=p, compile=c, **plan, **s["kw"]))
    return out


def evaluations(results) -> int:
    """Evaluations of one batched decode: its longest row's NFE (rows leave the batch when done)."""
    return max(r.nfe for r in results)


def batch_nfe(results) -> float:
    """The NFE of one full batch: the rows' mean NFE. A decode's evaluations hold sum(NFE) rows in all (rows leave
    when done), so seconds / mean NFE is the time of one evaluation of the whole batch, whatever the order in which
    rows finish; for batch 1 it is seconds per NFE."""
    return sum(r.nfe for r in results) / len(results)


def measure(s: dict, rounds: int, compile_: str, modes=MODES, static: bool = False,
            against: tuple | None = None) -> dict:  # fmt: skip
    cands = candidates(s, compile_, modes, static, against)
    print(f"[{s['label']}] warm-up (compiles the compiled rows' graphs) ...", file=sys.stderr, flush=True)
    t = interleaved(cands, rounds, warmup=1)
    per = lambda x: batch_nfe(x.value)  # noqa: E731
    ms = {n: [1000 * v for v in t.seconds(n, "cpu", per)] for n in cands}
    wall = {n: [1000 * v for v in t.seconds(n, "wall", per)] for n in cands}
    per_eval = {n: [1000 * v for v in t.seconds(n, "cpu", lambda x: evaluations(x.value))] for n in cands}
    toks = {n: [[r.tokens for r in x.value] for x in t.samples[n]] for n in cands}
    rows = []
    for n in cands:
        method, mode = n.split("/")
        rows.append({"setting": s["name"], "method": method, "mode": mode,
                     "evaluations": evaluations(t.samples[n][0].value), "nfe_mean": per(t.samples[n][0]),
                     "ms_per_nfe": summary(ms[n]), "wall_ms_per_nfe": summary(wall[n]), "ms_runs": ms[n],
                     "ms_per_evaluation": summary(per_eval[n]),
                     # without an eager row in this process: the same tokens in every round of this one
                     "same_tokens_as_eager": all(x == toks.get(f"{method}/eager", toks[n])[0] for x in toks[n])})
    res = {"setting": s["name"], "label": s["label"], "rounds": rounds, "orders": t.orders, "rows": rows,
           "modes": [m for m, _ in modes],
           "tdlm_over_backbone": {m: ratio(ms[f"tdlm/{m}"], ms[f"backbone/{m}"]) for m, _ in modes},
           "target_tdlm_over_backbone_max": s["target"]}  # fmt: skip
    if static:  # the same requests, the same tokens (tests/test_static_*.py): per NFE of the requests' rows
        keys = ("static_over_dynamic", "static_same_tokens", "static_within_5pct")
        res.update(zip(keys, _paired(ms, toks, modes, "@static", ""), strict=True))
    if against is not None:  # the same decodes through the loop at rev: today / rev per NFE
        res["against"] = against[0]
        keys = ("now_over_rev", "rev_same_tokens", "now_within_5pct")
        res.update(zip(keys, _paired(ms, toks, modes, "", f"@{against[0]}"), strict=True))
    if s.get("zero") is not None and not static and against is None:  # identical trajectories: per evaluation
        res["tdlm_zero_over_backbone_per_evaluation"] = {
            m: ratio(per_eval[f"tdlm-zero/{m}"], per_eval[f"backbone/{m}"]) for m, _ in modes}
        res["tdlm_zero_same_tokens_as_backbone"] = all(
            toks[f"tdlm-zero/{m}"][0] == toks[f"backbone/{m}"][0] for m, _ in modes)
    res["verdict"] = {f"tdlm_over_backbone_{m}": res["tdlm_over_backbone"][m]["of_min"] <= s["target"]
                      for m, _ in modes}
    if len(modes) == 2:
        res["compiled_over_eager"] = {m: ratio(ms[f"{m}/compiled"], ms[f"{m}/eager"]) for m in ("backbone", "tdlm")}
        res["verdict"]["tdlm_compiled_not_slower"] = (res["compiled_over_eager"]["tdlm"]["of_min"]
                                                      <= TARGETS["compiled_over_eager_max"])
    return res


def _paired(ms: dict, toks: dict, modes, new: str, old: str) -> tuple[dict, bool, dict]:
    """For backbone and tdlm in each mode: ``method{new}`` / ``method{old}`` per NFE, whether the two decoded the same
    tokens, and whether each ratio (min/min) is within the 5% rule."""
    methods = ("backbone", "tdlm")
    q = {m: {k: ratio(ms[f"{k}{new}/{m}"], ms[f"{k}{old}/{m}"]) for k in methods} for m, _ in modes}
    same = all(toks[f"{k}{new}/{m}"][0] == toks[f"{k}{old}/{m}"][0] for k in methods for m, _ in modes)
    ok = {f"{k}/{m}": r["of_min"] <= TARGETS["static_over_dynamic_max"] for m, by in q.items() for k, r in by.items()}
    return q, same, ok


def _op_table(prof, per: int, top: int = 40) -> dict[str, float]:
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {e.key: e.self_cpu_time_total / 1000 / per for e in rows[:top] if e.self_cpu_time_total > 0}


def profile(s: dict, compile_: str) -> dict:
    """Self CPU ms per evaluation of each op (eager) / inductor kernel (compiled), one decode per method."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch._inductor.config.cpp.enable_kernel_profile = True
    out: dict = {}
    for name, fn in candidates(s, compile_).items():
        fn()  # warm: compiled graphs built, allocator pools filled
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            res = fn()
        out[name] = {"evaluations": evaluations(res), "self_ms_per_evaluation": _op_table(prof, evaluations(res))}
    for mode, _ in MODES:
        a, b = out[f"backbone/{mode}"]["self_ms_per_evaluation"], out[f"tdlm/{mode}"]["self_ms_per_evaluation"]
        diff = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
        out[f"tdlm_minus_backbone/{mode}"] = dict(sorted(diff.items(), key=lambda kv: -kv[1])[:15])
    return out


def table(results: list[dict]) -> list[str]:
    lines = ["| setting | mode | backbone ms/NFE (min / median) | TDLM ms/NFE (min / median) | TDLM / backbone "
             "(min / median of rounds) | target | TDLM compiled / eager | same tokens |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for res in results:
        by = {(r["method"], r["mode"]): r for r in res["rows"]}
        for mode in res["modes"]:
            b, t = by[("backbone", mode)], by[("tdlm", mode)]
            q = res["tdlm_over_backbone"][mode]
            met = "met" if res["verdict"][f"tdlm_over_backbone_{mode}"] else "NOT MET"
            ce = res.get("compiled_over_eager", {}).get("tdlm", {"of_min": float("nan"),
                                                                 "median_of_rounds": float("nan")})
            bm, tm = b["ms_per_nfe"], t["ms_per_nfe"]
            same = b["same_tokens_as_eager"] and t["same_tokens_as_eager"]
            lines.append(
                f"| {res['label']} | {mode} | {bm['min']:.1f} / {bm['median']:.1f} | {tm['min']:.1f} / "
                f"{tm['median']:.1f} | {q['of_min']:.3f} / {q['median_of_rounds']:.3f} | "
                f"<= {res['target_tdlm_over_backbone_max']:.2f}: {met} | {ce['of_min']:.3f} / "
                f"{ce['median_of_rounds']:.3f} | {same} |")
            if "tdlm_zero_over_backbone_per_evaluation" in res:
                z, zr = by[("tdlm-zero", mode)], res["tdlm_zero_over_backbone_per_evaluation"][mode]
                bm, zm = b["ms_per_evaluation"], z["ms_per_evaluation"]
                met = "met" if zr["of_min"] <= res["target_tdlm_over_backbone_max"] else "NOT MET"
                lines.append(
                    f"| {res['label']}, W_O = 0 (the backbone's trajectory), per evaluation | {mode} | {bm['min']:.1f} "
                    f"/ {bm['median']:.1f} | {zm['min']:.1f} / {zm['median']:.1f} | {zr['of_min']:.3f} / "
                    f"{zr['median_of_rounds']:.3f} | <= {res['target_tdlm_over_backbone_max']:.2f}: {met} | - | "
                    f"{res['tdlm_zero_same_tokens_as_backbone']} |")
    return lines


def storage_table(results: list[dict]) -> list[str]:
    """static / dynamic per NFE of each setting, method and mode (min/min and median of per-round ratios)."""
    return _pair_table(results, "static", "dynamic", "static", "static_over_dynamic", "static_within_5pct",
                       "static_same_tokens")  # fmt: skip


def against_table(results: list[dict]) -> list[str]:
    """today / the loop at rev per NFE of each setting, method and mode."""
    rev = results[0]["against"] if results else "?"
    return _pair_table(results, rev, rev, "today", "now_over_rev", "now_within_5pct", "rev_same_tokens",
                       new_is_base=True)  # fmt: skip


def _pair_table(results, suffix: str, old: str, new: str, key: str, ok_key: str, same_key: str,
                new_is_base: bool = False) -> list[str]:  # fmt: skip
    lines = [f"| setting | mode | method | {old} ms/NFE (min) | {new} ms/NFE (min) | {new} / {old} (min / median) "
             f"| <= 1.05 | same tokens |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for res in results:
        by = {(r["method"], r["mode"]): r for r in res["rows"]}
        for mode in res["modes"]:
            for method in ("backbone", "tdlm"):
                q = res[key][mode][method]
                a, b = by[(method, mode)]["ms_per_nfe"]["min"], by[(f"{method}@{suffix}", mode)]["ms_per_nfe"]["min"]
                o, n = (b, a) if new_is_base else (a, b)
                ok = "yes" if res[ok_key][f"{method}/{mode}"] else "no"
                lines.append(f"| {res['label']} | {mode} | {method} | {o:.2f} | {n:.2f} | {q['of_min']:.3f} / "
                             f"{q['median_of_rounds']:.3f} | {ok} | {res[same_key]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=("tiny", "medium", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per setting (default: tiny 7, medium 3)")
    ap.add_argument("--adapter", type=Path, default=DEFAULT_ADAPTER, help="the demo adapter folder (tiny suite)")
    ap.add_argument("--batch", type=int, default=50, help="tiny suite: prompts in the batch (the demo's 50)")
    ap.add_argument("--head-scale", type=float, default=110.0)
    ap.add_argument("--history", default="last:32", help="medium suite: TDLM history")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", default="true", help="DecodeConfig.compile of the compiled rows (default inductor)")
    ap.add_argument("--profile", action="store_true", help="add per-op / per-kernel profiles")
    ap.add_argument("--modes", default="eager,compiled", help="comma-separated subset of eager,compiled")
    ap.add_argument("--quick", action="store_true", help="batch 8, medium 64 + 64, 2 rounds")
    ap.add_argument("--storage", default="dynamic", help="dynamic, or dynamic,static: the static storage plan's "
                    "candidates beside the dynamic plan's (JSON to bench/results/decode_speed_storage.json)")
    add_against(ap, "the same decodes through its tdlm/decoding/loop.py, side by side (JSON to "
                "bench/results/decode_speed_against.json)")
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS.relative_to(REPO)}; none with --quick)")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be >= 1; got {args.rounds}")
    modes = tuple(m for m in MODES if m[0] in args.modes.split(","))
    if not modes or len(modes) != len(set(args.modes.split(","))):
        ap.error(f"--modes {args.modes!r}: expected a comma-separated subset of eager,compiled")
    if args.storage not in ("dynamic", "dynamic,static"):
        ap.error(f"--storage {args.storage!r}: expected dynamic or dynamic,static")
    static = args.storage == "dynamic,static"
    against = None
    if args.against:
        try:
            against = (args.against, loop_at(args.against))
        except TDLMError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    settings = []
    try:
        if args.suite in ("tiny", "all"):
            settings.append(tiny_setting(args.adapter, 8 if args.quick else args.batch))
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.suite in ("medium", "all"):
        settings += medium_settings(args.head_scale, args.history, args.quick)
    results, profiles = [], {}
    with torch.inference_mode():
        for s in settings:
            rounds = args.rounds or (2 if args.quick else 7 if s["name"] == "tiny" else 3)
            results.append(measure(s, rounds, args.compile, modes, static, against))
            print("\n".join(table(results[-1:])[2:]), flush=True)
            if static:
                print("\n".join(storage_table(results[-1:])[2:]), flush=True)
            if against:
                print("\n".join(against_table(results[-1:])[2:]), flush=True)
            if args.profile:
                profiles[s["name"]] = profile(s, args.compile)
    lines = table(results)
    print("\n" + "\n".join(lines))
    if static:
        lines = storage_table(results)
        print("\n" + "\n".join(lines))
    if against:
        lines = against_table(results)
        print("\n" + "\n".join(lines))
    result = {"machine": machine(), "load_before": load0, "load_after": os.getloadavg()[0],
              "settings": {"suite": args.suite, "batch": args.batch, "adapter": str(args.adapter),
                           "head_scale": args.head_scale, "history": args.history, "threads": args.threads,
                           "compile": args.compile, "modes": args.modes, "quick": args.quick, "medium": MEDIUM,
                           "storage": args.storage, "against": args.against,
                           "clock": "process CPU seconds / mean NFE of the batch's rows"},
              "targets": TARGETS, "results": results, "table": lines,
              **({"profile": profiles} if profiles else {})}  # fmt: skip
    out = args.out or (None if args.quick else AGAINST_RESULTS if against else STORAGE_RESULTS if static else RESULTS)
    if out:
        write_result(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
