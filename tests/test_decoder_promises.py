"""The decoder's host promises under the dual cache, for one row, at the block sizes where they can break.

A single row under the dual cache (the default evaluation shape: block 32, dual, batch 1) decodes with two promises
of the loop (:mod:`tdlm.decoding.loop`, ``in_order``): the history's storage columns are the row's positions from
its active block's start, in order, so a full forward reads them as the last W rows of h
(``TemporalCache.claim_rows``, only while the width W equals the masked count) and a window step as the window's
rows from (logit shift - alignment offset) (``TemporalCache.set_front(..., aligned=True)``, its front derived from
the block: ``window_front``). Both rest on the loop compacting only when the row changes block.

tests/test_kv_cache.py checks them at block 8 only, where neither premise can fail: inside a block of 8 the masked
count never falls to a smaller storage bucket (multiples of 8), so a compaction could only ever fall on a block
change, and the masked count at a block change is a multiple of 8, so the compacted width always equals it. Here the
same decode runs at blocks 12, 16 and 32 on LLaDA and Dream (both alignments), where the masked count does fall to a
smaller bucket inside a block (a compaction that did not wait for the block change would break the columns' order)
and, at block 12, the compacted width exceeds the masked count (the last block's 12 positions in 16 columns): each
test asserts that its decode reaches those states. Every evaluation's logits equal, within 1e-5 (fp32, rtol and
atol, as tests/test_kv_cache.py), those of the decode without the promises (no ``claim_rows``, no front: its full
forwards gather and scatter, its window steps look their positions' columns up), and so do tokens, NFE and reveal
steps. Faults that pass at block 8 and fail here (each planted once in a copy): claiming the rows whenever the width
is the masked count's bucket (block 12), compacting inside a block (every case), a front capped at 8 + offset
columns instead of block + offset (every case).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import tdlm
from tdlm.decoding import decode
from tdlm.temporal.attention import TemporalAttention
from tdlm.temporal.history import TemporalCache, column_bucket
from tests.conftest import live_tdlm, sharp_backbone

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 4, 40, 41, 42, 43, 44, 45, 46]


def spread_backbone(name: str):
    """A tiny random backbone whose confidences differ from position to position: a peaky head (as
    :func:`tests.conftest.sharp_backbone`, milder) and sharp attention (query / key weights x 10), so the rotary
    positions separate the masked positions' hidden states. With plain random weights every masked position has
    nearly the same confidence and a threshold reveals either one token or the whole block per evaluation."""
    bb = sharp_backbone(name, scale=15.0)
    with torch.no_grad():
        for block in bb.blocks:
            attn = block if bb.family == "llada" else block.self_attn
            attn.q_proj.weight.mul_(10.0)
            attn.k_proj.weight.mul_(10.0)
    return bb


@dataclass
class Evaluation:
    refresh: bool
    block: int  # the row's active block
    masked: int  # masked response positions of its input
    width: int  # the history's storage columns
    suffix: bool  # claim_rows in force (a full forward reads the last W rows of h)
    aligned: bool  # set_front(aligned=True) in force (a window step reads the window's rows as a slice)
    front: int | None  # the front's columns
    scattered: int  # temporal layers that gathered and scattered (TemporalAttention.correct_at)


def _run(model, kw: dict, promises: bool, monkeypatch) -> tuple[list, list[Evaluation], list, list[torch.Tensor]]:
    """One decode; returns its results, what each evaluation saw and its logits, and the row's masked positions at
    each compaction (``promises=False``: no claim_rows, no front)."""
    forward_groups, correct_at, compact = tdlm.TDLM.forward_groups, TemporalAttention.correct_at, TemporalCache.compact
    seen: list[Evaluation] = []
    logits: list = []
    compactions: list[torch.Tensor] = []
    scattered = [0]
    bs, mask_id, P = kw["block_size"], model.backbone.mask_token_id, len(PROMPT)

    def run(self, prompt_len, cache, groups, evaluate=None):
        (g,) = groups  # one row: one group per evaluation
        masked = g.input_ids[0, P:] == mask_id
        before = scattered[0]
        outs = forward_groups(self, prompt_len, cache, groups, evaluate)
        seen.append(Evaluation(g.kv.refresh, int(masked.int().argmax()) // bs, int(masked.sum()), cache.width,
                               cache.suffix, cache.front_aligned, None if cache.front is None else cache.front.shape[1],
                               scattered[0] - before))  # fmt: skip
        logits.append([o.clone() for o in outs])
        return outs

    def scatter(self, *a, **k):
        scattered[0] += 1
        return correct_at(self, *a, **k)

    def recording(self, still, most):
        kept = still[0].clone()
        done = compact(self, still, most)
        if done:
            compactions.append(kept)
        return done

    with monkeypatch.context() as m:
        m.setattr(tdlm.TDLM, "forward_groups", run)
        m.setattr(TemporalAttention, "correct_at", scatter)
        m.setattr(TemporalCache, "compact", recording)
        if not promises:
            set_front = TemporalCache.set_front
            m.setattr(TemporalCache, "claim_rows", lambda self, suffix: None)
            m.setattr(TemporalCache, "set_front", lambda self, columns, aligned=False: set_front(self, None))
        with torch.no_grad():
            out = decode(model, [PROMPT], **kw)
    return out, seen, logits, compactions


CASES = [  # (backbone, alignment, block, gen_length, tau): tau such that every block has window steps, some of them
    # reveal several tokens, and every evaluation reveals one at least
    ("tiny-llada", "prediction", 12, 36, 0.35), ("tiny-llada", "prediction", 16, 32, 0.35),
    ("tiny-llada", "prediction", 32, 64, 0.3),
    ("tiny-dream", "prediction", 12, 36, 0.2), ("tiny-dream", "prediction", 16, 32, 0.25),
    ("tiny-dream", "prediction", 32, 64, 0.25),
    ("tiny-dream", "position", 12, 36, 0.25), ("tiny-dream", "position", 16, 32, 0.25),
    ("tiny-dream", "position", 32, 64, 0.25),
]  # fmt: skip


@pytest.mark.parametrize("name,alignment,bs,G,tau", CASES, ids=[f"{c[0]}-{c[1]}-block{c[2]}" for c in CASES])
def test_a_single_row_keeps_the_dual_cache_promises_past_block_8(name, alignment, bs, G, tau, monkeypatch):
    """One row under the dual cache at block 12, 16 or 32: every evaluation's logits within 1e-5 of the decode
    without the promises, tokens, NFE and reveal steps equal; the decode reaches the states the promises rest on."""
    model = live_tdlm(spread_backbone(name), history="full")
    model.config.alignment = alignment
    model.offset = model.backbone.logit_shift if alignment == "prediction" else 0
    kw = {"policy": "tdlm", "threshold": tau, "cache": "dual", "gen_length": G, "block_size": bs}
    on, seen, logits_on, compactions = _run(model, kw, True, monkeypatch)
    off, seen_off, logits_off, _ = _run(model, kw, False, monkeypatch)

    # -- the same decode: every evaluation's logits (the first that differs first), tokens, NFE, reveal steps ----
    for k, (a, b) in enumerate(zip(logits_on, logits_off, strict=False)):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda s, k=k: f"evaluation {k + 1}: {s}")
    assert on[0].tokens == off[0].tokens
    assert on[0].nfe == off[0].nfe == len(seen) and on[0].reveal_step == off[0].reveal_step

    # -- the decode reached the states that block 8 never does, under the promises -------------------------
    windows = [e for e in seen if not e.refresh]
    refreshes = [e for e in seen if e.refresh]
    assert len(refreshes) == G // bs and {e.block for e in windows} == set(range(G // bs)), seen
    reveals = [on[0].reveal_step.count(k + 1) for k in range(on[0].nfe)]
    assert min(reveals) >= 1 and any(n > 1 for e, n in zip(seen, reveals, strict=True) if not e.refresh), reveals
    # Inside a block the masked count falls to a smaller storage bucket before a window step: a compaction there
    # would not fall on a block change (the loop waits for it; the storage keeps its width).
    stale = [e for e in windows if column_bucket(e.masked, G) < e.width]
    assert stale, [(e.block, e.masked, e.width) for e in windows]
    # Every compaction falls on a block change: the kept positions are the row's positions from a block's start.
    assert compactions, "no compaction"
    for kept in compactions:
        first = int(kept.int().argmax())
        assert first % bs == 0 and kept[first:].all() and not kept[:first].any(), kept
    # The width equals the masked count at every refresh of block 16 or 32, not at block 12 (G - 12 k positions in
    # a multiple of 8 columns): the full forward's promise is withdrawn there and it gathers.
    uneven = [e for e in refreshes if e.width != e.masked]
    assert bool(uneven) == (bs % 8 != 0), [(e.block, e.masked, e.width) for e in refreshes]
    assert all(not e.suffix and e.scattered for e in uneven), uneven
    even = [e for e in refreshes if e.width == e.masked]
    assert all(e.suffix and not e.scattered for e in even), even
    # Every window step reads its rows as a slice (no gather / scatter) over the front derived from the block.
    extra = model.offset
    assert all(e.aligned and not e.scattered and e.front == min(bs + extra, e.width) for e in windows), windows
    # The decode without the promises: its full forwards gather and scatter, its window steps have no front (they
    # look their positions' columns up and correct the whole window).
    assert all(e.front is None and not e.suffix and not e.aligned for e in seen_off), seen_off
    assert all(e.scattered for e in seen_off if e.refresh), seen_off


MULTI = [("tiny-llada", "prediction", 12, 36), ("tiny-llada", "prediction", 16, 32),
         ("tiny-dream", "prediction", 12, 36), ("tiny-dream", "position", 16, 32)]  # fmt: skip
PROMPTS = [PROMPT, [3, 4, 40, 41, 50, 51, 52, 53, 54], [3, 4, 60, 61, 62, 63, 64, 65, 66]]


@pytest.mark.parametrize("name,alignment,bs,G", MULTI, ids=[f"{c[0]}-{c[1]}-block{c[2]}" for c in MULTI])
def test_several_rows_under_the_dual_cache_equal_each_row_alone_past_block_8(name, alignment, bs, G):
    """Three rows under the dual cache at block 12 or 16: the window's front is derived from each row's blocks
    (``window_front``: n0 + (k - k0) x block_size columns); rows that change block at different evaluations decode
    as each row alone. A front counted in blocks of 8 passes every block-8 test and changes a row's tokens here."""
    model = live_tdlm(spread_backbone(name), history="full")
    model.config.alignment = alignment
    model.offset = model.backbone.logit_shift if alignment == "prediction" else 0
    kw = {"policy": "tdlm", "threshold": 0.25, "cache": "dual", "gen_length": G, "block_size": bs}
    together = decode(model, PROMPTS, **kw)
    alone = [decode(model, [p], **kw)[0] for p in PROMPTS]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.nfe for r in together] == [r.nfe for r in alone]
    assert [r.reveal_step for r in together] == [r.reveal_step for r in alone]
    assert len({r.nfe for r in alone}) > 1 or len({tuple(r.reveal_step) for r in alone}) > 1  # rows out of step
