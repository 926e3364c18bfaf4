"""The decode engine's refill (issue 48): ``decode(..., batch_size=k)`` admits the next request into a row as soon as
one finishes, under both storage plans.

A request's tokens, NFE and reveal steps must not depend on the rows beside it, on when it was admitted or into which
slot: the engine's results equal a per-request ``decode()`` for every policy, cache mode, storage plan and backbone,
whatever the arrival order. The comparisons run in float64 (tests/conftest.py: EXACT_DTYPE says why).
"""

from __future__ import annotations

import random

import pytest
import torch

from tdlm.decoding import decode, loop
from tdlm.decoding.loop import EngineStats
from tdlm.decoding.static_plan import static_bytes
from tdlm.errors import TDLMError
from tests.conftest import EXACT_DTYPE, live_tdlm, sharp_backbone

BACKBONES = ("tiny-llada", "tiny-dream")
KW = dict(gen_length=16, block_size=8, threshold=0.9)
POLICIES = ("original", "threshold", "tdlm", "credit", "soft")


def _prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 2 to 40 tokens (two prompt buckets), in a seeded random order."""
    g = random.Random(seed)
    return [[3, *(g.randrange(10, 120) for _ in range(g.choice([1, 2, 4, 7, 12, 39])))] for _ in range(n)]


def _key(r):
    return r.tokens, r.nfe, r.reveal_step


@pytest.fixture(scope="module")
def exact():
    return {name: sharp_backbone(name, dtype=EXACT_DTYPE) for name in BACKBONES}


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("name", BACKBONES)
def test_refill_decodes_what_each_request_decodes_alone(exact, name, cache):
    """Eight requests over two prompt buckets in batches of 3 (the static plan decodes in bucket 4), in prompt order
    under the dynamic plan and in a shuffled arrival order under the static one, for every policy (tdlm with ``full``):
    every request's tokens, NFE and reveal steps equal its own decode; refills happened, and each result reached
    ``on_result`` once."""
    bb = exact[name]
    prompts = _prompts(8, seed=1)
    order = list(range(8))
    random.Random(2).shuffle(order)
    for policy in POLICIES:
        target = live_tdlm(bb) if policy == "tdlm" else bb
        alone = [decode(target, [p], policy=policy, cache=cache, **KW)[0] for p in prompts]
        for storage, arrival in (("dynamic", list(range(8))), ("static", order)):
            stats, seen = EngineStats(), []
            out = decode(target, [prompts[i] for i in arrival], policy=policy, cache=cache, storage=storage,
                         batch_size=3, stats=stats, on_result=lambda i, r: seen.append((i, r)), **KW)  # noqa: B023
            assert [_key(out[k]) for k in range(8)] == [_key(alone[i]) for i in arrival], (policy, storage)
            assert sorted(i for i, _ in seen) == list(range(8)) and all(out[i] is r for i, r in seen)
            assert stats.admissions >= 2, (policy, storage, stats)  # each bucket refilled


def test_a_refilled_request_keeps_its_partial_canvas_and_its_states(exact):
    """``canvas`` (an on-policy roll-out's partial responses) and ``record_states`` follow each request through the
    refill; seconds are each request's own (from its admission)."""
    bb = exact["tiny-llada"]
    prompts = _prompts(5, seed=3)
    canvas = [[bb.mask_token_id] * 16 for _ in prompts]
    canvas[1][:5] = [40, 41, 42, 43, 44]
    canvas[3][8:10] = [50, 51]
    alone = [decode(bb, [p], canvas=[c], record_states=True, **KW)[0] for p, c in zip(prompts, canvas, strict=True)]
    for storage in ("dynamic", "static"):
        out = decode(bb, prompts, canvas=canvas, record_states=True, batch_size=2, storage=storage, **KW)
        assert [(*_key(r), r.states) for r in out] == [(*_key(r), r.states) for r in alone], storage
        assert out[1].tokens[:5] == [40, 41, 42, 43, 44] and out[1].reveal_step[:5] == [0] * 5
        assert all(0 < r.seconds for r in out)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("name", BACKBONES)
def test_roll_out_canvases_through_refill_decode_as_alone(exact, name, cache):
    """On-policy roll-outs' partial canvases (random density, EOS among the given tokens) through refill in batches of
    3, every backbone policy, with and without the early stop: each request equals its own decode, and every step
    1..T reveals a token (a roll-out record with an empty step is refused when read back)."""
    bb = exact[name]
    g = random.Random(7)
    prompts = _prompts(9, seed=5)
    canvas = []
    for _ in prompts:
        dense = g.random()
        row = [g.choice([g.randrange(10, 120), bb.eos_token_id]) if g.random() < dense else bb.mask_token_id
               for _ in range(16)]  # fmt: skip
        row[g.randrange(16)] = bb.mask_token_id
        canvas.append(row)
    for k, policy in enumerate(("original", "threshold", "credit", "soft", "entropy")):
        opts = dict(policy=policy, cache=cache, stop_at_eos=bool(k % 2), entropy_threshold=1.0, **KW)
        alone = [decode(bb, [p], canvas=[c], **opts)[0] for p, c in zip(prompts, canvas, strict=True)]
        for storage in ("dynamic", "static"):
            stats = EngineStats()
            out = decode(bb, prompts, canvas=canvas, batch_size=3, storage=storage, stats=stats, **opts)
            assert [_key(r) for r in out] == [_key(r) for r in alone], (policy, storage)
            assert stats.admissions >= 2, (policy, storage)
            for r in out:
                assert set(range(1, r.nfe + 1)) <= set(r.reveal_step), (policy, storage, r.reveal_step)


def test_the_static_plan_refills_in_place(exact, monkeypatch):
    """Over 40 requests in batches of 4 the static plan admits into freed slots of one bucket: the canvas a step reads
    is at one address at every evaluation, nothing more is held after the first decode, and the finished rows' work
    is what refill removes (occupancy above the chunked loop's)."""
    bb = sharp_backbone("tiny-llada")  # its own pool
    prompts = [[3, *(p[1:6])] for p in _prompts(40, seed=4)]  # one prompt bucket
    seen: set[int] = set()
    orig = loop.backbone_eval

    def step(backbone, x, *args, **kwargs):
        seen.add(x.data_ptr())
        return orig(backbone, x, *args, **kwargs)

    monkeypatch.setattr(loop, "backbone_eval", step)
    refill, chunked = EngineStats(), EngineStats()
    decode(bb, prompts, storage="static", cache="none", batch_size=4, stats=refill, **KW)
    held = static_bytes(bb)
    decode(bb, prompts, storage="static", cache="none", batch_size=4, **KW)
    assert len(seen) == 1 and static_bytes(bb) == held
    assert refill.admissions == 36
    for start in range(0, 40, 4):
        decode(bb, prompts[start : start + 4], storage="static", stats=chunked, **KW)
    assert refill.useful == chunked.useful  # the same work of the requests themselves
    assert refill.occupancy > chunked.occupancy and refill.evaluations < chunked.evaluations


def test_a_latent_history_waits_for_an_empty_batch(exact):
    """``latent:M`` folds every evaluation of its batch into latents that start from learned values read for the whole
    batch: no row joins a running batch, so its refill is chunked, and still equal to per-request decodes."""
    model = live_tdlm(exact["tiny-llada"], history="latent:2")
    prompts = _prompts(5, seed=5)
    stats = EngineStats()
    out = decode(model, prompts, policy="tdlm", batch_size=2, stats=stats, **KW)
    alone = [decode(model, [p], policy="tdlm", **KW)[0] for p in prompts]
    assert [_key(r) for r in out] == [_key(r) for r in alone]
    # chunks of 2 in each prompt bucket (admission order), each as long as its slowest row
    buckets: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        buckets.setdefault(-(-len(p) // 32), []).append(i)
    chunked = [ids[k : k + 2] for b in sorted(buckets) for ids in [buckets[b]] for k in range(0, len(ids), 2)]
    assert stats.evaluations == sum(max(alone[i].nfe for i in c) for c in chunked)


def test_batch_size_is_checked_in_one_line(exact):
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(TDLMError, match=r"^decode: batch_size must be a positive integer or None; got "):
            decode(exact["tiny-llada"], [[3, 4]], batch_size=bad, **KW)
    assert torch.equal(torch.tensor(decode(exact["tiny-llada"], [[3, 4]], batch_size=7, **KW)[0].tokens),
                       torch.tensor(decode(exact["tiny-llada"], [[3, 4]], **KW)[0].tokens))  # fmt: skip


class _Clock:
    """A stand-in for ``time`` in the loop: every ``perf_counter()`` call advances one second."""

    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        self.t += 1.0
        return self.t


@pytest.mark.parametrize("batch_size", [3, None])
@pytest.mark.parametrize("storage", ["dynamic", "static"])
def test_each_requests_seconds_run_from_its_admission_to_its_end(exact, storage, batch_size, monkeypatch):
    """With a clock that advances one second per reading (two readings per evaluation), every request's seconds are
    twice its NFE, also for the requests admitted into freed rows: its own evaluations, not the batch's. In one batch
    (no refill) too, where the static plan keeps a finished row in place to the batch's end: its seconds still stop
    at its own last evaluation."""
    monkeypatch.setattr(loop, "time", _Clock())
    out = decode(exact["tiny-llada"], _prompts(7, seed=6), storage=storage, batch_size=batch_size, **KW)
    assert len({r.nfe for r in out}) > 1  # requests of different lengths
    assert [r.seconds for r in out] == [2.0 * r.nfe for r in out]


@pytest.mark.parametrize("storage", ["dynamic", "static"])
def test_credit_starts_from_zero_for_a_request_admitted_into_the_block_its_slot_ended_in(exact, storage):
    """One block per response (gen_length = block_size), so a request admitted into a freed row starts in the block the
    row's last request ended in: its credit must still start from zero."""
    kw = dict(KW, gen_length=8, block_size=8, policy="credit")
    prompts = _prompts(6, seed=7)
    alone = [decode(exact["tiny-dream"], [p], **kw)[0] for p in prompts]
    out = decode(exact["tiny-dream"], prompts, storage=storage, batch_size=2, **kw)
    assert [_key(r) for r in out] == [_key(r) for r in alone]


def test_a_refill_writes_the_request_into_the_finished_row_in_place(exact, monkeypatch):
    """Dynamic plan, policy tdlm: while requests wait, a finished row's batch row is handed to the next request in
    place. Its temporal history rows are emptied (no entry, only the sink valid, each position in its own column, so
    the new request inherits neither the old one's entries nor its ring counts), and nothing copies the storage to
    admit it: no row leaves and joins (TemporalCache.select / extend) before the queue is empty, and the batch keeps
    its rows. (That the results stay those of per-request decodes: the invariance test above.)"""
    from tdlm.temporal.history import TemporalCache

    model = live_tdlm(exact["tiny-llada"])
    prompts = [[3, *p[1:9]] for p in _prompts(9, seed=8)]  # one prompt bucket: one canvas
    calls: dict[str, list] = {"select": [], "extend": [], "reset_rows": []}
    orig = {name: getattr(TemporalCache, name) for name in calls}
    state = {"queue": True}

    def spy(name):
        def call(self, arg, *a, **k):
            out = orig[name](self, arg, *a, **k)
            calls[name].append(state["queue"])
            if name == "reset_rows":
                N = self.length
                assert self.width == N  # a new request needs every position's column
                assert not self.count[arg].any() and not self.valid[arg][..., 1:].any()
                assert torch.equal(self.cols[arg], torch.arange(N).expand(len(arg), N))
            return out

        return call

    for name in calls:
        monkeypatch.setattr(TemporalCache, name, spy(name))
    stats = EngineStats()
    seen = []

    def on_result(i, r):  # the last requests to finish: the queue emptied long before
        seen.append(i)
        state["queue"] = len(seen) < 2

    decode(model, prompts, policy="tdlm", batch_size=3, stats=stats, on_result=on_result, **KW)
    assert stats.admissions == 6 and len(calls["reset_rows"]) >= 3, (stats, calls)
    assert not calls["extend"] and not any(calls["select"]), calls  # leaves only in the tail


def test_a_reset_row_of_a_compacted_dynamic_history_starts_empty_and_the_others_keep_theirs():
    """TemporalCache.reset_rows on a dynamic history that compacted: the storage is widened back to N columns, the
    reset row holds nothing, and every other row keeps its usable entries position by position."""
    from tdlm.temporal.history import HistoryPolicy, TemporalCache

    B, N = 3, 24
    cache = TemporalCache(batch_size=B, policy=HistoryPolicy.parse("full"))
    cache.allocate([0], N, heads=1, head_dim=2, dtype=torch.float64, device="cpu", capacity=N)
    g = torch.Generator().manual_seed(0)
    masked = torch.ones(B, N, dtype=torch.bool)
    for step in range(3):  # three evaluations; rows reveal their first positions at different paces
        cache.reserve(step + 1)
        masked[0, : 6 * step] = False
        masked[1, : 4 * step] = False
        masked[2, : 5 * step] = False
        kv = torch.randn((B, N, 2, 1, 2), generator=g, dtype=torch.float64)
        cache.append(0, kv, masked)
        cache.commit(masked)
        cache.steps += 1
    assert cache.compact(masked, int(masked.sum(1).max())) and cache.width == 16  # rows 0-2: 12, 16, 14 masked
    masked[1] = False  # row 1 finished: a new request takes its row
    before = cache.valid_entries()
    cache.reset_rows(torch.tensor([1]))
    assert cache.width == N and cache.batch_size == B
    after = cache.valid_entries()
    assert torch.equal(after[[0, 2]], before[[0, 2]]) and not after[1].any()
    assert torch.equal(cache.cols[1], torch.arange(N)) and not cache.count[1].any()
