"""The decode engine's refill against the fixed chunks it replaces (issue 48), side by side in one process.

Commands (from the repository root, venv active)::

    python bench/engine.py --adapter runs/onpolicy_bench/off/seed0/adapter    # -> bench/results/engine.json
    python bench/engine.py --quick --adapter ...                              # small sizes; prints only
    python bench/engine.py --parts addresses --adapter ...                    # rerun one part, keep the others

**Invariance.** ``--invariance-prompts`` (128 by default; 512, as the issue asks, took 42 min here on one thread)
prompts: the tiny-multi test prompts' (then validation prompts') token ids (tiny-multi's own tokenizer and chat
template), mapped into the tiny backbones' vocabulary (id mod (V - 4) + 4: no special id), in a seeded random arrival
order, through ``decode(..., batch_size=16)`` (refill) for policies original, threshold, tdlm (a seeded random adapter,
history ``full``), credit and soft x cache none, prefix, dual x storage dynamic, static x tiny LLaDA and tiny Dream
(both with a sharpened head, as the tests'), 32 tokens in blocks of 8, tau 0.9: every request's tokens, NFE and reveal
steps against its own ``decode()``. In float64, so that last-bit differences of two batch shapes cannot decide a
near-tie (tests/conftest.py says why).

**Occupancy and throughput** on the demo's evaluation: tiny-multi (fp32) with ``--adapter`` (the demo recipe's adapter),
the first ``--requests`` (150: three waves of 50) multi test problems, 56 tokens in one block, batch ``--batch`` (50,
the demo's), threshold at tau 0.9 and tdlm at tau 0.95, eager (about 0.2 s per evaluation of 50 rows on this CPU).
``chunked``: decode() of consecutive chunks of ``--batch`` problems, each as long as its slowest row (the generation and
evaluation workers' loop before the engine); ``refill``: one ``decode(..., batch_size=--batch)``. Both storage plans.
Interleaved rounds (:mod:`timing`) after one untimed chunk per storage plan (first-call costs and the static plan's
buffers of the bucket), process CPU seconds, one torch thread; requests/s from the minimum over ``--rounds`` (1 by
default). Occupancy: useful row-evaluations / the batch's slots over all evaluations
(:class:`tdlm.decoding.loop.EngineStats`).

**Occupancy at the demo's size.** ``--parts occupancy``: the same model, policies and batch, untimed, over
``--occupancy-requests`` (500: one run of the demo's evaluation) problems, refill against chunks (dynamic plan), with
the schedule replayed from the NFEs; it goes beside the speed part's occupancy in each occupancy target.

**Addresses and graphs.** ``--admissions`` (256) requests through the static plan at batch 8 with the dual cache and
policy tdlm: the data pointer of every state tensor a step receives (temporal history, KV cache, unsplit canvas rows),
recorded at every evaluation, must take one value per argument; then under ``compile="aot_eager"`` (dynamo's trace and
guards, no code generation) the count of compiled graphs after the first 16 requests against after all.

Targets (``targets`` in the JSON, each with its value, bound and verdict): invariance mismatches 0; occupancy >= 0.9
(refill, dynamic plan) per policy; refill / chunked requests/s >= 1.25 (dynamic) per policy; dynamic / static requests/s
with refill <= 1.10 per policy; one address per step argument and no graph compiled after warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from benchlib import exit_with, machine, write_result  # noqa: E402  (bench/ is on sys.path as a script)
from timing import interleaved, summary  # noqa: E402

import tdlm  # noqa: E402
from tdlm.decoding import decode  # noqa: E402
from tdlm.decoding.loop import EngineStats  # noqa: E402
from tdlm.errors import TDLMError  # noqa: E402

POLICIES = ("original", "threshold", "tdlm", "credit", "soft")
CACHES = ("none", "prefix", "dual")
INV = dict(gen_length=32, block_size=8, threshold=0.9)
SPEED_TAU = {"threshold": 0.9, "tdlm": 0.95}


def multi_prompts(n: int) -> list[list[int]]:
    """The first ``n`` multi problems as tiny-multi token ids (its chat template): the test split's 500, then the
    validation split's 300 (the invariance check's 512 only feed random tiny backbones; nothing is scored)."""
    from tdlm.data.tokenizer import encode_prompts, load_tokenizer
    from tdlm.tasks.multi import SPLIT_SIZES, load_split

    most = SPLIT_SIZES["test"] + SPLIT_SIZES["validation"]
    if n > most:
        raise TDLMError(f"{n} prompts asked; the multi test and validation splits hold {most}")
    problems = [p.prompt for p in load_split("test", n)]
    if n > len(problems):
        problems += [p.prompt for p in load_split("validation", n - len(problems))]
    return encode_prompts(load_tokenizer("tiny-multi"), problems)


def sharp(name: str):
    """A tiny random backbone in float64 with its head x 60 (confidences spread over (0, 1], as the tests')."""
    bb = tdlm.load_backbone(name, dtype="float64")
    head = bb.model.transformer.ff_out if bb.family == "llada" else bb.lm_head
    with torch.no_grad():
        head.weight.mul_(60.0)
    return bb


def random_tdlm(bb):
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history="full"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.temporal.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
    return model.eval()


def invariance(n: int, batch: int) -> dict:
    base = multi_prompts(n)
    order = list(range(n))
    random.Random(0).shuffle(order)
    rows, mismatches = [], 0
    for name in ("tiny-llada", "tiny-dream"):
        bb = sharp(name)
        V = bb.vocab_size
        prompts = [[t % (V - 4) + 4 for t in p] for p in base]
        for policy in POLICIES:
            target = random_tdlm(bb) if policy == "tdlm" else bb
            for cache in CACHES:
                alone = [decode(target, [p], policy=policy, cache=cache, **INV)[0] for p in prompts]
                for storage in ("dynamic", "static"):
                    stats = EngineStats()
                    out = decode(target, [prompts[i] for i in order], policy=policy, cache=cache, storage=storage,
                                 batch_size=batch, stats=stats, **INV)  # fmt: skip
                    bad = sum((r.tokens, r.nfe, r.reveal_step) != (alone[i].tokens, alone[i].nfe, alone[i].reveal_step)
                              for r, i in zip(out, order, strict=True))  # fmt: skip
                    mismatches += bad
                    rows.append({"backbone": name, "policy": policy, "cache": cache, "storage": storage,
                                 "requests": n, "mismatches": bad, "admissions": stats.admissions,
                                 "occupancy": round(stats.occupancy, 4)})  # fmt: skip
                    print(f"invariance {name} {policy} {cache} {storage}: {bad} of {n} differ "
                          f"({stats.admissions} admissions)", flush=True)  # fmt: skip
    return {"rows": rows, "mismatches": mismatches, "settings": {**INV, "batch_size": batch, "dtype": "float64"}}


def schedule(nfes: list[int], batch: int) -> dict:
    """The dynamic plan's refill replayed from each request's NFE (a request's NFE does not depend on its batch, so
    this is the engine's schedule): requests take free rows in order between evaluations and hold their row for
    their NFE. Returns the evaluations and the occupancy, split at the evaluation after which the queue is empty
    (from there on the batch drains: the last wave's slowest request sets its length)."""
    rows: list[int] = []  # evaluations left of each row
    queue, busy, steady = list(reversed(nfes)), [], None
    while queue or rows:
        while queue and len(rows) < batch:
            rows.append(queue.pop())
        if not queue and steady is None:
            steady = len(busy)
        busy.append(len(rows))
        rows = [k - 1 for k in rows if k > 1]
    occ = [sum(b) / (batch * len(b)) if b else 0.0 for b in (busy, busy[:steady], busy[steady:])]
    return {"evaluations": len(busy), "occupancy": round(occ[0], 4), "before_drain": round(occ[1], 4),
            "drain": round(occ[2], 4), "drain_evaluations": len(busy) - steady}  # fmt: skip


def demo_models(adapter: Path):
    """(backbone, TDLM, decode keywords, config per policy) of the demo's evaluation: tiny-multi in fp32 with the
    adapter at ``adapter``, its tokenizer's stop ids, 56 tokens in one block at each policy's tau."""
    from tdlm.data.tokenizer import load_tokenizer, stop_token_ids
    from tdlm.tasks.toydata import MULTI_GEN_LENGTH

    if not (adapter / "adapter.safetensors").exists():
        raise TDLMError(f"--adapter {adapter}: no adapter.safetensors there; pass the folder of a tiny-multi adapter "
                        f"(make demo trains one into runs/demo/train/adapter)")  # fmt: skip
    bb = tdlm.load_backbone("tiny-multi", dtype="float32")
    model = tdlm.TDLM.from_adapter(bb, adapter).eval()
    tok = load_tokenizer("tiny-multi")
    kw = {"tokenizer": tok, "stop_ids": stop_token_ids(tok, bb.eos_token_id)}
    cfgs = {policy: tdlm.DecodeConfig(policy=policy, gen_length=MULTI_GEN_LENGTH, block_size=MULTI_GEN_LENGTH,
                                      threshold=tau) for policy, tau in SPEED_TAU.items()}  # fmt: skip
    return bb, model, kw, cfgs


def occupancy(adapter: Path, requests: int, batch: int) -> dict:
    """Occupancy of the dynamic plan at the size of one run of the demo's evaluation (``requests`` multi test
    problems at ``batch``), refill against chunks, untimed: the drain after the queue empties weighs 1 / (waves)."""
    bb, model, kw, cfgs = demo_models(adapter)
    prompts = multi_prompts(requests)
    out: dict = {"requests": requests, "batch_size": batch, "policies": {}}
    for policy, cfg in cfgs.items():
        target = model if policy == "tdlm" else bb
        refill, chunked = EngineStats(), EngineStats()
        res = decode(target, prompts, cfg, batch_size=batch, stats=refill, **kw)
        ref = []
        for k in range(0, len(prompts), batch):
            ref += decode(target, prompts[k : k + batch], cfg, stats=chunked, **kw)
        same = [(r.tokens, r.nfe) for r in res] == [(r.tokens, r.nfe) for r in ref]
        out["policies"][policy] = {"refill": round(refill.occupancy, 4), "chunked": round(chunked.occupancy, 4),
                                   "evaluations": {"refill": refill.evaluations, "chunked": chunked.evaluations},
                                   "schedule": schedule([r.nfe for r in res], batch),
                                   "same_tokens_as_chunked": same}  # fmt: skip
        print(f"occupancy {policy} at {requests} requests: refill {refill.occupancy:.3f}, chunked "
              f"{chunked.occupancy:.3f}, tokens equal: {same}", flush=True)  # fmt: skip
    return out


def speed(adapter: Path, requests: int, batch: int, rounds: int) -> dict:
    bb, model, kw, cfgs = demo_models(adapter)
    prompts = multi_prompts(requests)
    out: dict = {"policies": {}}
    for policy, cfg in cfgs.items():
        target = model if policy == "tdlm" else bb
        tau = cfg.threshold
        stats: dict[str, EngineStats] = {}

        def chunked(storage: str, name: str, target=target, cfg=cfg, stats=stats):
            s = stats[name] = EngineStats()
            res = []
            for k in range(0, len(prompts), batch):
                res += decode(target, prompts[k : k + batch], cfg, storage=storage, stats=s, **kw)
            return res

        def refill(storage: str, name: str, target=target, cfg=cfg, stats=stats):
            stats[name] = EngineStats()
            return decode(target, prompts, cfg, storage=storage, batch_size=batch, stats=stats[name], **kw)

        cands = {f"{mode}@{storage}": (lambda f=f, st=storage, nm=f"{mode}@{storage}": f(st, nm))
                 for mode, f in (("chunked", chunked), ("refill", refill)) for storage in ("dynamic", "static")}
        # Untimed: one chunk per plan first, so that no candidate pays the process's first-call costs or the static
        # plan's allocation of its bucket (the static history is held per bucket and reused, as in a worker).
        for storage in ("dynamic", "static"):
            decode(target, prompts[:batch], cfg, storage=storage, **kw)
        t = interleaved(cands, rounds=rounds)
        ref = [(r.tokens, r.nfe) for r in t.samples["chunked@dynamic"][0].value]
        row: dict = {"tau": tau, "candidates": {}}
        for name in cands:
            same = [(r.tokens, r.nfe) for r in t.samples[name][0].value] == ref
            secs = t.seconds(name)
            st = stats[name]
            row["candidates"][name] = {"cpu_s": summary(secs), "requests_per_s": requests / min(secs),
                                       "evaluations": st.evaluations, "row_evaluations": st.rows,
                                       "cpu_ms_per_row_evaluation": 1e3 * min(secs) / st.rows,
                                       "occupancy": round(st.occupancy, 4),
                                       "admissions": st.admissions, "same_tokens_as_chunked_dynamic": same}  # fmt: skip
            print(f"speed {policy} {name}: {requests / min(secs):.1f} req/s, occupancy {st.occupancy:.3f}, "
                  f"{st.evaluations} evaluations, tokens equal: {same}", flush=True)  # fmt: skip
        c = row["candidates"]
        rps = {k: v["requests_per_s"] for k, v in c.items()}
        row["refill_over_chunked"] = {s: rps[f"refill@{s}"] / rps[f"chunked@{s}"] for s in ("dynamic", "static")}
        row["dynamic_over_static_refill"] = rps["refill@dynamic"] / rps["refill@static"]
        row["dynamic_over_static_chunked"] = rps["chunked@dynamic"] / rps["chunked@static"]
        # The occupancy bound: the replayed schedule (it matches the engine's), and the same NFEs four times over (a
        # longer run with this length distribution, so the drain weighs a quarter as much)
        nfes = [r.nfe for r in t.samples["refill@dynamic"][0].value]
        replay, eng = schedule(nfes, batch), stats["refill@dynamic"]
        replay["matches_engine"] = (replay["evaluations"], replay["occupancy"]) == (eng.evaluations,
                                                                                   round(eng.occupancy, 4))
        row["schedule"] = {"replayed": replay, "requests_x4": schedule(nfes * 4, batch)}
        print(f"schedule {policy}: {row['schedule']}", flush=True)
        out["policies"][policy] = row
    G = next(iter(cfgs.values())).gen_length
    out["settings"] = {"adapter": str(adapter), "requests": requests, "batch_size": batch, "rounds": rounds,
                       "gen_length": G, "block_size": G, "threads": 1,
                       "clock": "process CPU seconds"}  # fmt: skip
    return out


def addresses(n: int, batch: int) -> dict:
    """One address per step argument over ``n`` requests of the static plan; graphs after warm-up."""
    from torch._dynamo.utils import counters

    bb = tdlm.load_backbone("tiny-llada")
    model = random_tdlm(bb)
    V = bb.vocab_size
    prompts = [[t % (V - 4) + 4 for t in p][:30] for p in multi_prompts(n)]  # one prompt bucket
    kw = dict(INV, policy="tdlm", cache="dual", storage="static", batch_size=batch)
    seen: dict[str, set[int]] = {}
    orig = tdlm.TDLM.evaluate_groups

    def record(path: str, obj, depth: int = 0) -> None:
        if isinstance(obj, torch.Tensor):
            seen.setdefault(path, set()).add(obj.data_ptr())
        elif isinstance(obj, (list, tuple)) and depth < 5:
            for k, o in enumerate(obj):
                record(f"{path}[{k}]", o, depth + 1)
        elif isinstance(obj, dict) and depth < 5:
            for k, o in obj.items():
                record(f"{path}[{k}]", o, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module) and depth < 5:
            for k, o in vars(obj).items():
                record(f"{path}.{k}", o, depth + 1)

    def step(self, prompt_len, cache, groups, *a, **k):
        record("cache", cache)
        record("groups", groups)
        return orig(self, prompt_len, cache, groups, *a, **k)

    stats = EngineStats()
    tdlm.TDLM.evaluate_groups = step
    try:
        decode(model, prompts, stats=stats, **kw)
    finally:
        tdlm.TDLM.evaluate_groups = orig
    # What a step writes or reads as state must stay put: the temporal history (entries, validity, counts, columns),
    # the spatial KV cache of every layer (reached through each group's KV step) and the canvas rows of an unsplit
    # evaluation. A split evaluation's row indices, positions and gathered rows are built for that evaluation and
    # never written by a step; the history's front is a view of its columns.
    state = {k: len(v) for k, v in seen.items()
             if k.startswith("cache.") and not k.startswith("cache.front")
             or ".kv.cache." in k or k.endswith(("].input_ids", "].attention_mask"))}  # fmt: skip
    moved = {k: v for k, v in state.items() if v != 1}
    torch._dynamo.reset()
    counters.clear()
    decode(model, prompts[:16], **dict(kw, compile="aot_eager"))
    warm = counters["stats"]["unique_graphs"]
    decode(model, prompts, **dict(kw, compile="aot_eager"))
    after = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return {"requests": n, "batch_size": batch, "admissions": stats.admissions, "arguments_followed": len(state),
            "moved": moved, "graphs_after_warmup": warm, "graphs_after_all": after}  # fmt: skip


def targets_of(result: dict) -> dict:
    """Each target's value, bound and verdict from the parts of ``result``."""
    sp, ad, inv = result["speed"]["policies"], result["addresses"], result["invariance"]
    targets = {"invariance_mismatches": {"value": inv["mismatches"], "bound": "== 0", "met": inv["mismatches"] == 0}}
    for policy, row in sp.items():
        occ = row["candidates"]["refill@dynamic"]["occupancy"]
        targets[f"occupancy_{policy}"] = {"value": occ, "bound": ">= 0.9", "met": occ >= 0.9,
                                          "chunked": row["candidates"]["chunked@dynamic"]["occupancy"]}  # fmt: skip
        if "occupancy" in result:  # the same bound at one demo evaluation run's request count, beside it
            o = result["occupancy"]
            targets[f"occupancy_{policy}"]["at_demo_size"] = {
                "requests": o["requests"], "value": o["policies"][policy]["refill"],
                "met": o["policies"][policy]["refill"] >= 0.9, "chunked": o["policies"][policy]["chunked"]}
        r = row["refill_over_chunked"]["dynamic"]
        targets[f"throughput_{policy}"] = {"value": r, "bound": ">= 1.25", "met": r >= 1.25}
        d = row["dynamic_over_static_refill"]
        targets[f"static_within_1.10_{policy}"] = {"value": d, "bound": "<= 1.10", "met": d <= 1.10,
                                                   "chunked": row["dynamic_over_static_chunked"]}  # fmt: skip
    targets["addresses"] = {"value": len(ad["moved"]), "bound": "== 0 arguments moved", "met": not ad["moved"]}
    targets["graphs_after_warmup"] = {"value": ad["graphs_after_all"] - ad["graphs_after_warmup"], "bound": "== 0",
                                      "met": ad["graphs_after_all"] == ad["graphs_after_warmup"]}  # fmt: skip
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--adapter", type=Path, default=REPO / "runs/demo/train/adapter",
                    help="a tiny-multi adapter folder (the demo recipe's); default runs/demo/train/adapter")
    ap.add_argument("--requests", type=int, default=150, help="multi test problems for occupancy and throughput")
    ap.add_argument("--batch", type=int, default=50, help="batch size (the demo evaluation's)")
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds per candidate")
    ap.add_argument("--invariance-prompts", type=int, default=128)
    ap.add_argument("--occupancy-requests", type=int, default=500,
                    help="requests of the occupancy part (one run of the demo's evaluation: 500 problems)")
    ap.add_argument("--admissions", type=int, default=256, help="requests through the static plan (address check)")
    ap.add_argument("--parts", default="speed,occupancy,addresses,invariance",
                    help="comma-separated parts to run; the others are kept from the result file")
    ap.add_argument("--quick", action="store_true", help="small sizes; prints only unless --out is given")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/engine.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.requests, args.rounds, args.invariance_prompts, args.admissions = 60, 1, 12, 40
        args.occupancy_requests = 100
    parts = set(args.parts.split(","))
    out = args.out or REPO / "bench/results/engine.json"
    result = {}
    if parts != {"speed", "occupancy", "addresses", "invariance"}:  # a part rerun: the others from the last full run
        if not out.exists():
            raise TDLMError(f"--parts {args.parts}: {out} does not exist yet; run every part once first")
        result = json.loads(out.read_text())
    result["machine"] = machine()
    if "speed" in parts:
        result["speed"] = speed(args.adapter, args.requests, args.batch, args.rounds)
    if "occupancy" in parts:
        result["occupancy"] = occupancy(args.adapter, args.occupancy_requests, args.batch)
    if "addresses" in parts:
        result["addresses"] = addresses(args.admissions, 8)
    if "invariance" in parts:
        result["invariance"] = invariance(args.invariance_prompts, 16)
    result["targets"] = targets = targets_of(result)
    for k, v in targets.items():
        print(f"target {k}: {v['value']} ({v['bound']}): {'met' if v['met'] else 'NOT met'}")
        if "at_demo_size" in v:
            d = v["at_demo_size"]
            print(f"  at {d['requests']} requests: {d['value']}: {'met' if d['met'] else 'NOT met'}")
    if args.out is not None or not args.quick:
        write_result(out, result)
    return 0


if __name__ == "__main__":
    exit_with(main)
