"""The static storage plan beyond the temporal history (issue 41): the spatial KV cache, the canvas and the per-row
state at fixed addresses, batch buckets with padding rows and prompt buckets (tdlm/decoding/static_plan.py).

What CUDA-graph trees need from a compiled step (every tensor it writes in place static, at one address at every
replay) is checked on this CPU by following, at every compiled step of two decodes of one bucket with different
prompts, every tensor the step changed; the static plan must decode what the dynamic one and eager decoding do.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tdlm.decoding import decode, loop
from tdlm.decoding.loop import POLICIES
from tdlm.decoding.static_plan import batch_bucket, kv_cache_bytes, prompt_bucket, static_bytes, static_canvas
from tdlm.models.kv_cache import SpatialKVCache
from tdlm.temporal.history import TemporalCache
from tests.conftest import EXACT_DTYPE, EXACT_TOL, live_tdlm, sharp_backbone

# three requests (bucket 4: one padding row), left-padded, rows finishing at different evaluations; a second batch
# of other prompts and other lengths in the same prompt bucket
PROMPTS_A = [[3, 5, 50, 51], [3, 4, 70, 71, 72, 73, 74, 75, 76], [3, 9, 60, 61, 62]]
PROMPTS_B = [[3, 4, 40], [7, 8, 9, 10, 11], [3, 4, 80, 81, 82, 83]]
KW = dict(gen_length=16, block_size=8, threshold=0.9)
BACKBONES = ("tiny-llada", "tiny-dream")


@pytest.fixture(scope="module")
def backbones():
    return {name: sharp_backbone(name) for name in BACKBONES}


@pytest.fixture(scope="module")
def exact_backbones():
    """The backbones in float64, for the comparisons of the two plans' decisions (tests/conftest.py: EXACT_DTYPE)."""
    return {name: sharp_backbone(name, dtype=EXACT_DTYPE) for name in BACKBONES}


def _key(results):
    return [(r.tokens, r.nfe, r.reveal_step) for r in results]


def _record_logits(monkeypatch) -> list[torch.Tensor]:
    """Per evaluation: the block logits (b, block, V) of every row the loop holds, as the commit rule reads them."""
    seen: list[torch.Tensor] = []
    orig = loop.merge_logits

    def run(groups, outs, b):
        out = orig(groups, outs, b)
        seen.append(out.clone())
        return out

    monkeypatch.setattr(loop, "merge_logits", run)
    return seen


def _same_as_dynamic(target, prompts, monkeypatch, **kw) -> None:
    seen = _record_logits(monkeypatch)
    dynamic = decode(target, prompts, **kw)
    dyn = list(seen)
    seen.clear()
    static = decode(target, prompts, storage="static", **kw)
    assert _key(static) == _key(dynamic), kw
    nfe = [r.nfe for r in dynamic]
    assert len(seen) == len(dyn) == max(nfe)
    assert all(s.shape[0] == batch_bucket(len(prompts)) for s in seen)  # padding and finished rows stay
    assert next(target.parameters()).dtype == EXACT_DTYPE  # float64: tests/conftest.py says why
    tol = EXACT_TOL
    for i, (s, d) in enumerate(zip(seen, dyn, strict=True)):
        live = [r for r in range(len(prompts)) if nfe[r] > i]  # the rows the dynamic plan still holds, in order
        torch.testing.assert_close(s[live], d, rtol=tol, atol=tol, msg=lambda m, i=i: f"{kw} evaluation {i}: {m}")


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("name", BACKBONES)
def test_every_policy_with_a_kv_cache_decodes_under_the_static_plan_what_it_does_under_the_dynamic_one(
        exact_backbones, name, cache, monkeypatch):  # fmt: skip
    """Tokens, NFE and reveal steps equal and every live row's block logits within EXACT_TOL in float64, for every
    policy (tdlm with ``full`` and ``last:2``), on a batch of three (bucket 4: a padding row) whose rows finish apart,
    and on one row (no padding row: the static history's columns are looked up instead of the dynamic plan's
    aligned slice)."""
    bb = exact_backbones[name]
    for policy in POLICIES:
        targets = [live_tdlm(bb, history=h) for h in ("full", "last:2")] if policy == "tdlm" else [bb]
        for target in targets:
            for prompts in (PROMPTS_A, PROMPTS_A[1:2]):
                _same_as_dynamic(target, prompts, monkeypatch, policy=policy, cache=cache, **KW)


@pytest.mark.parametrize("name", BACKBONES)
def test_a_batch_in_a_larger_bucket_and_a_stop_token_decode_as_the_dynamic_plan(exact_backbones, name, monkeypatch):
    """Five requests in bucket 8 (three padding rows), rows that stop early at a stop token, and one prompt that fills
    its 32-token bucket (decoded without an attention mask), with each cache."""
    bb = exact_backbones[name]
    five = [*PROMPTS_A, *PROMPTS_B[:2]]
    stop = {"tiny-llada": [91], "tiny-dream": [23]}[name]
    full = [[3, 4, *range(40, 70)]]
    for cache in ("none", "prefix", "dual"):
        _same_as_dynamic(bb, full, monkeypatch, policy="threshold", cache=cache, **KW)
        _same_as_dynamic(bb, five, monkeypatch, policy="threshold", cache=cache, **KW)
        _same_as_dynamic(bb, PROMPTS_A, monkeypatch, policy="threshold", cache=cache, stop_at_eos=True,
                         stop_ids=stop, **dict(KW, threshold=0.6))  # fmt: skip


def test_buckets():
    assert [batch_bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert [prompt_bucket(n) for n in (1, 31, 32, 33, 64, 65)] == [32, 32, 32, 64, 64, 96]


def test_the_held_buffers_are_one_set_per_bucket_and_their_bytes_are_stated(backbones):
    bb = sharp_backbone("tiny-llada")  # its own pool
    assert static_bytes(bb) == 0
    decode(bb, PROMPTS_A, cache="dual", storage="static", **KW)
    first = static_bytes(bb)
    decode(bb, PROMPTS_B, cache="dual", storage="static", **KW)  # same bucket: (4, 32 + 16), nothing new
    assert static_bytes(bb) == first
    B, L = 4, 32 + KW["gen_length"]
    kv = B * kv_cache_bytes(bb.num_layers, bb.kv_heads, bb.head_dim, L, 4)
    canvas = (2 * B * L + B * KW["gen_length"] + B) * 8  # ids, attention mask, reveal steps, NFE (int64)
    assert first == kv + canvas
    decode(bb, PROMPTS_A[:1], cache="dual", storage="static", **KW)  # bucket 1: a second set
    assert static_bytes(bb) == first + (kv + canvas) // 4
    # the padding row of the 3-request batch (bucket 4) decoded nothing: no NFE, no reveal, no mask in its response
    held = static_canvas(bb, B, L, KW["gen_length"], "dual")
    assert held.nfe[3].item() == 0 and not held.reveal[3].any() and not (held.ids[3, 32:] == bb.mask_token_id).any()
    assert held.nfe[:3].min().item() > 0


# -- compiled steps: every tensor a step writes stays at one address ------------------------------------------------


def _tensors(obj, path: str, out: dict[str, torch.Tensor], seen: set[int]) -> None:
    """Every tensor reachable from a compiled step's argument ``obj`` (caches, KV steps, step groups), by path."""
    if isinstance(obj, torch.Tensor):
        out[path] = obj
        return
    if isinstance(obj, torch.nn.Module) or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, f"{path}[{k}]", out, seen)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _tensors(v, f"{path}[{i}]", out, seen)
    elif dataclasses.is_dataclass(obj) or isinstance(obj, TemporalCache | SpatialKVCache):
        for k, v in vars(obj).items():
            _tensors(v, f"{path}.{k}", out, seen)


def _record_writes(monkeypatch) -> list[dict[str, int]]:
    """Per call of a compiled step: the address of every tensor the call changed, named by where the step reached it
    (a tensor whose content is equal before and after is not counted: mutation is read from the content, because
    inference tensors keep no version counter)."""
    calls: list[dict[str, int]] = []

    def around(fn, args):
        reach: dict[str, torch.Tensor] = {}
        _tensors(list(args[1:]), "args", reach, set())
        by_ptr = {}
        for name, t in reach.items():  # one name per storage: a tensor reached twice is one tensor
            by_ptr.setdefault((t.data_ptr(), t.shape, t.stride()), (name, t))
        before = {k: t.clone() for k, (_, t) in by_ptr.items()}
        out = fn(*args)
        calls.append({name: k[0] for k, (name, t) in by_ptr.items() if not torch.equal(before[k], t)})
        return out

    _around_compiled_steps(monkeypatch, around)
    return calls


def _around_compiled_steps(monkeypatch, around) -> None:
    """Every call of either compiled step (backbone, TDLM) of the decodes that follow runs as ``around(step, args)``."""
    real = loop.compiled_steps

    def steps(backend, mode):
        return tuple((lambda fn: lambda *args: around(fn, args))(step) for step in real(backend, mode))

    monkeypatch.setattr(loop, "compiled_steps", steps)


def _name(path: str) -> str:
    """A tensor's name without the group it was reached through (one cache serves every group of an evaluation)."""
    return path.split(".", 1)[1] if path.startswith("args[") and "]." in path else path


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("name", BACKBONES)
def test_every_tensor_a_compiled_step_writes_stays_at_one_address_through_two_decodes_of_a_bucket(
        backbones, name, cache, monkeypatch):  # fmt: skip
    """``compile="eager"`` (dynamo's fullgraph trace and guards, no code generation), tdlm ``last:2`` and threshold: at
    every compiled step of two decodes of bucket 4 with different prompts (other prompt lengths), every tensor the
    step wrote (history entries, validity, counts; the spatial KV cache of every layer) is at the address it had at
    every other step; tokens, NFE and reveal steps equal eager decoding. The same record under the dynamic plan sees
    tensors move (uncached tdlm: its history grows and compacts; dual threshold: its KV cache drops finished rows).
    (tests/test_static_plan.py follows the history of ``full`` and ``last:2`` through eager decodes.)"""
    bb = backbones[name]
    model = live_tdlm(bb, history="last:2")
    torch._dynamo.reset()
    try:
        for policy, target in (("tdlm", model), ("threshold", bb)):
            calls = _record_writes(monkeypatch)
            kw = dict(KW, policy=policy, cache=cache, compile="eager")
            for prompts in (PROMPTS_A, PROMPTS_B):
                compiled = decode(target, prompts, storage="static", **kw)
                assert _key(compiled) == _key(decode(target, prompts, storage="static", **dict(kw, compile=False)))
            addresses: dict[str, set[int]] = {}
            for call in calls:
                for path, ptr in call.items():
                    addresses.setdefault(_name(path), set()).add(ptr)
            written = set(addresses)
            if policy == "tdlm":
                assert any(".kv" in n and "layers" in n for n in written), written  # the history's entries
                assert any("valid" in n for n in written) and any("count" in n for n in written), written
            if cache != "none":
                assert any("keys" in n for n in written) and any("values" in n for n in written), written
            moved = {n: len(p) for n, p in addresses.items() if len(p) != 1}
            assert not moved, f"{policy}: tensors a compiled step wrote at several addresses: {moved}"
            if (policy, cache) in (("tdlm", "none"), ("threshold", "dual")):  # the record sees a move when there is one
                calls.clear()
                for prompts in (PROMPTS_A, PROMPTS_B):
                    decode(target, prompts, **kw)
                dyn: dict[str, set[int]] = {}
                for call in calls:
                    for path, ptr in call.items():
                        dyn.setdefault(_name(path), set()).add(ptr)
                assert any(len(p) > 1 for p in dyn.values()), "the dynamic plan's tensors never moved"
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("cache,bound", [("none", 1), ("prefix", 3), ("dual", 2)])
def test_a_static_256_token_decode_compiles_a_fixed_number_of_graphs_and_a_second_decode_none(cache, bound):
    """Batch 1, 256 tokens in blocks of 32 (8 blocks), tdlm ``full``, dynamo's ``eager`` backend: the static plan's
    graphs are uncached 1; dual: refresh and window (2; the window's history columns are looked up, one shape in
    every block); prefix: refresh, window, the window again with a dynamic width (3); whatever the steps and blocks.
    A second decode of another prompt of another length in the same prompt bucket compiles nothing; both decode
    eager's tokens, NFE and reveal steps. (Not compared with the dynamic plan here: this sharp toy repeats tokens whose
    confidences tie to the last bits, so 1e-7 decides which of two positions an evaluation commits first; the static
    and dynamic plans are compared on the other tests' shapes.)"""
    from torch._dynamo.utils import counters

    model = live_tdlm(sharp_backbone("tiny-llada"), history="full")
    kw = dict(policy="tdlm", cache=cache, gen_length=256, block_size=32, threshold=0.6)
    torch._dynamo.reset()
    counters.clear()
    try:
        graphs = []
        for prompt in ([3, 4, 40, 41, 42], [3, 4, 50, 51, 52, 53, 54, 55]):
            compiled = decode(model, [prompt], storage="static", compile="eager", **kw)
            graphs.append(counters["stats"]["unique_graphs"])
            assert compiled[0].nfe > 256 // 32, "too few evaluations to show the bound"
            assert _key(compiled) == _key(decode(model, [prompt], storage="static", **kw))
        assert 1 <= graphs[0] <= bound and graphs[1] == graphs[0], graphs
        assert counters["graph_break"] == {}, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_finished_or_padding_row_is_never_refreshed_again(backbones, cache, monkeypatch):
    """Under the static plan a row that is done (a padding row from the start, a request once it finished, here at a
    stop token before the last block) rides the window steps: no refresh after the first evaluation includes it (a
    refresh is a full forward of its canvas)."""
    refreshed: list[set[int]] = []  # per evaluation: the rows of its refresh forward
    orig = loop.step_groups

    def run(kv_cache, blk, kv_blk, *args):
        groups = orig(kv_cache, blk, kv_blk, *args)
        rows: set[int] = set()
        for r, step in groups:
            if step is not None and step.refresh:
                rows |= set(range(len(blk))) if r is None else set(r.tolist())
        refreshed.append(rows)
        return groups

    monkeypatch.setattr(loop, "step_groups", run)
    res = decode(backbones["tiny-llada"], PROMPTS_A, cache=cache, storage="static",
                 stop_at_eos=True, stop_ids=[91], **dict(KW, gen_length=32))  # fmt: skip
    nfe = [r.nfe for r in res]
    assert len(set(nfe)) > 1 and refreshed[0] == {0, 1, 2, 3}  # rows finish apart; everyone refreshes first
    for i, rows in enumerate(refreshed[1:], start=1):
        done = {3} | {r for r in range(3) if nfe[r] <= i}
        assert not rows & done, (i, rows, done)
    assert any(refreshed[1:]), "no later refresh at all: the test shows nothing"


# Per evaluation, built from the host's view of the rows and never written by a step: each group's positions
# (``select`` / the backbone step's third argument), its row indices, a window's starts and first recomputed
# positions. Under CUDA-graph trees such an input is copied into the graph's own buffer at each replay (a few
# integers per row); everything else a step reads is held state and must be marked static and stay put.
PER_EVALUATION = ("select", "args[2]", "rows", "start", "fresh_from")


def _marked(t: torch.Tensor) -> bool:
    """Carries torch's static-address mark, or is a view of a tensor that does (the temporal history's ``front``:
    its first columns, from column 0, so at the marked tensor's address)."""
    return any(hasattr(x, "_dynamo_static_input_type") for x in (t, t._base) if x is not None)


def _record_arguments(monkeypatch) -> list[dict[str, tuple[int, bool, bool]]]:
    """Per call of a compiled step: every tensor argument (what the step reads as well as what it writes), named by
    where the step reached it, as (address, marked static (:func:`_marked`), the call changed it)."""
    calls: list[dict[str, tuple[int, bool, bool]]] = []

    def around(fn, args):
        reach: dict[str, torch.Tensor] = {}
        _tensors(list(args[1:]), "args", reach, set())
        before = {name: t.clone() for name, t in reach.items()}
        out = fn(*args)
        calls.append({_name(name): (t.data_ptr(), _marked(t), not torch.equal(before[name], t))
                      for name, t in reach.items()})  # fmt: skip
        return out

    _around_compiled_steps(monkeypatch, around)
    return calls


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_every_tensor_a_compiled_step_reads_is_marked_static_at_one_address_or_built_for_its_evaluation(
        backbones, cache, monkeypatch):  # fmt: skip
    """Two decodes of bucket 4 with different prompts (tdlm ``last:2`` and threshold, dynamo's ``eager`` backend):
    every tensor argument of every compiled step, read or written, either carries the static-address mark and has one
    address through both decodes, or is one of the per-evaluation index tensors (:data:`PER_EVALUATION`); the canvas
    goes in unmarked only as the gathered rows of a split evaluation. Every tensor a step writes is marked (an unmarked
    one makes CUDA-graph trees skip the graph). The held canvas ends holding the tokens the decode returned, so the
    steps read the canvas the plan writes, not a copy. (The test above follows only what a step writes.)"""
    from tdlm.decoding.static_plan import static_canvas

    bb = backbones["tiny-llada"]
    model = live_tdlm(bb, history="last:2")
    torch._dynamo.reset()
    try:
        for policy, target in (("tdlm", model), ("threshold", bb)):
            calls = _record_arguments(monkeypatch)
            kw = dict(KW, policy=policy, cache=cache, compile="eager")
            canvas = []
            for prompts in (PROMPTS_A, PROMPTS_B):
                res = decode(target, prompts, storage="static", **kw)
                held = static_canvas(bb, batch_bucket(len(prompts)), prompt_bucket(max(map(len, prompts)))
                                     + KW["gen_length"], KW["gen_length"], cache)  # fmt: skip
                canvas.append(held.ids.data_ptr())
                assert [held.ids[i, -KW["gen_length"]:].tolist() for i in range(len(prompts))] == \
                    [r.tokens for r in res], policy  # fmt: skip
            addresses: dict[str, set[int]] = {}
            unmarked: set[str] = set()
            for call in calls:
                split = any(n.endswith("rows") for n in call)  # the evaluation gathers some rows of the batch
                for name, (ptr, marked, written) in call.items():
                    assert marked or not written, f"{policy}: a step wrote {name}, which is not marked static"
                    if marked:
                        addresses.setdefault(name, set()).add(ptr)
                    elif not name.endswith(PER_EVALUATION):
                        assert split and name.endswith(("input_ids", "attention_mask", "args[0]", "args[1]")), \
                            f"{policy}: {name} goes into a compiled step unmarked"  # fmt: skip
                        unmarked.add(name)
                    if name in ("input_ids", "args[0]") and marked:
                        assert ptr == canvas[-1] or ptr in canvas, f"{policy}: {name} is not the held canvas"
            moved = {n: len(p) for n, p in addresses.items() if len(p) != 1}
            assert not moved, f"{policy}: marked tensors a compiled step read at several addresses: {moved}"
            assert any(n in addresses for n in ("input_ids", "args[0]")), "the canvas never went in whole"
            if cache != "none":  # the KV cache of every layer is read through the steps
                assert sum("keys" in n for n in addresses) == bb.num_layers, sorted(addresses)
    finally:
        torch._dynamo.reset()
