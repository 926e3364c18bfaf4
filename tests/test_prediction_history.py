"""tdlm.decoding.prediction_history: replaying the argmax of every evaluation, and the change statistics (issue 15)."""

from __future__ import annotations

import pytest
import torch

import tdlm
from tdlm.decoding import decode
from tdlm.decoding.prediction_history import RequestHistory, change_statistics, decode_histories, replay_argmax
from tdlm.errors import TDLMError

PROMPTS = [[3, 4, 40, 41, 42, 43, 44, 45, 46], [3, 4, 60, 61, 62, 63, 64, 65, 66]]  # equal lengths: no padding


def sharp_backbone(name: str, scale: float = 30.0):
    bb = tdlm.load_backbone(name)
    head = bb.model.transformer.ff_out if bb.family == "llada" else bb.lm_head
    with torch.no_grad():
        head.weight.mul_(scale)
    return bb


def live_tdlm(bb) -> tdlm.TDLM:
    torch.manual_seed(0)  # W_Q / W_K / W_V initialisation
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history="full"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in model.temporal.values():
            mod.o_proj.weight.copy_(torch.randn(mod.o_proj.weight.shape, generator=g) * 0.5)
    return model


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("policy", ["original", "threshold", "tdlm"])
def test_replay_reproduces_every_commit(name, policy):
    """At the evaluation that committed a position, the replayed argmax is the committed token; before it, the replay
    sees exactly the masks decode() saw."""
    bb = sharp_backbone(name)
    model = live_tdlm(bb) if policy == "tdlm" else bb
    out = decode(model, PROMPTS, policy=policy, threshold=0.8, gen_length=24, block_size=24, record_states=True)
    assert max(r.nfe for r in out) >= 3  # some positions wait (this scale and tau: 3 to 24 evaluations)
    for r in out:
        am = replay_argmax(model, r.prompt_ids, r.states)
        assert len(am) == r.nfe and all(len(row) == 24 for row in am)
        for p, (a, tok) in enumerate(zip(r.reveal_step, r.tokens, strict=True)):
            assert am[a - 1][p] == tok
            assert all(r.states[i][p] == bb.mask_token_id for i in range(a))
        stats = change_statistics([RequestHistory(am, r.reveal_step, r.tokens)], min_masked=2)
        assert stats["replay_agreement"] == (1.0 if stats["positions"] else None)
    if policy != "tdlm":
        with pytest.raises(TDLMError, match="needs a tdlm.TDLM"):
            replay_argmax(bb, out[0].prompt_ids, out[0].states, temporal=True)


def test_change_statistics_by_hand():
    # G = 4 positions, T = 4 evaluations. Position 0: committed at 1 (not counted). Position 1: masked 3 evaluations,
    # argmax 5, 6, 6 -> committed 6 (changed, 1 switch). Position 2: masked 4, argmax 7 throughout (unchanged).
    # Position 3: masked 4, argmax 1, 2, 1, 9 -> committed 9, and 9 is an excluded token in the second call.
    argmax = [[0, 5, 7, 1], [0, 6, 7, 2], [0, 6, 7, 1], [0, 0, 7, 9]]
    h = RequestHistory(argmax, reveal_step=[1, 3, 4, 4], tokens=[0, 6, 7, 9])
    s = change_statistics([h], min_masked=3)
    assert s["positions"] == 3 and s["mean_masked_evaluations"] == pytest.approx(11 / 3)
    assert s["changed"] == pytest.approx(2 / 3)
    assert s["switches_per_position"] == pytest.approx((1 + 0 + 3) / 3)
    # earlier pairs: pos1 (5,6) -> 1 of 2; pos2 (7,7,7) -> 3 of 3; pos3 (1,2,1) -> 0 of 3
    assert s["final_equals_earlier"] == pytest.approx(4 / 8)
    assert s["final_equals_first"] == pytest.approx(1 / 3)
    assert s["final_equals_lag"] == {1: pytest.approx(2 / 3), 2: pytest.approx(1 / 3), 3: pytest.approx(1 / 2)}
    assert s["replay_agreement"] == 1.0
    c = change_statistics([h], min_masked=3, exclude_tokens=[9])
    assert c["positions"] == 2 and c["changed"] == 0.5 and c["final_equals_earlier"] == pytest.approx(4 / 5)
    empty = change_statistics([h], min_masked=5)
    assert empty["positions"] == 0 and empty["changed"] is None and empty["final_equals_lag"] == {}
    with pytest.raises(TDLMError, match="min_masked"):
        change_statistics([h], min_masked=1)
    with pytest.raises(TDLMError, match="exceeds"):
        change_statistics([RequestHistory(argmax[:2], [1, 3, 4, 4], [0, 6, 7, 9])])
    with pytest.raises(TDLMError, match="record_states"):
        replay_argmax(tdlm.load_backbone("tiny-llada"), [3, 4], [])


def test_decode_histories_is_decode_then_replay():
    """The demo's one-call helper returns decode()'s results (in prompt order, across its batches) and their replays."""
    bb = sharp_backbone("tiny-llada")
    model = live_tdlm(bb)
    prompts = PROMPTS + [[3, 4, 50, 51, 52, 53, 54, 55, 56]]
    results, histories = decode_histories(model, prompts, "tdlm", 0.8, 24, 24, batch_size=2)
    ref = decode(model, prompts, policy="tdlm", threshold=0.8, gen_length=24, block_size=24, record_states=True)
    assert [r.tokens for r in results] == [r.tokens for r in ref]
    for r, h in zip(ref, histories, strict=True):
        assert h.argmax == replay_argmax(model, r.prompt_ids, r.states)
        assert h.reveal_step == r.reveal_step and h.tokens == r.tokens
