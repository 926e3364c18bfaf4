"""The blockwise decoding loop: policies, batching, trajectories (issue: decoding policies)."""

from __future__ import annotations

import pytest
import torch

import tdlm
import tdlm.data.tokenizer  # tdlm is a lazy facade: the submodule is not imported by `import tdlm`
from tdlm.data.trajectories import TrajectoryRecord, state_at, validate_record
from tdlm.decoding import DecodeConfig, decode
from tests.conftest import live_tdlm, sharp_backbone

PROMPTS = [[3, 4, 40, 41, 42, 43, 44, 45, 46], [3, 4, 60, 61], [3, 4, 70, 71, 72, 73, 74]]
KW = dict(gen_length=32, block_size=8)


def _key(r):
    return (r.tokens, r.reveal_step, r.nfe)


def test_threshold_tau_one_reproduces_original():
    bb = sharp_backbone()
    orig = decode(bb, PROMPTS, policy="original", **KW)
    thr = decode(bb, PROMPTS, policy="threshold", threshold=1.0, **KW)
    assert [_key(r) for r in orig] == [_key(r) for r in thr]
    assert all(r.nfe == r.T == 32 for r in orig)
    fast = decode(bb, PROMPTS, policy="threshold", threshold=0.5, **KW)
    assert all(f.nfe < o.nfe for f, o in zip(fast, orig, strict=True))  # the sharp head commits in parallel


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_tdlm_zero_adapter_reproduces_threshold(name):
    bb = sharp_backbone(name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all"))
    thr = decode(bb, PROMPTS, policy="threshold", threshold=0.7, **KW)
    tdl = decode(model, PROMPTS, policy="tdlm", threshold=0.7, **KW)
    assert [_key(r) for r in thr] == [_key(r) for r in tdl]
    assert any(1 < r.nfe < 32 for r in thr)


@pytest.mark.parametrize("policy", ["original", "threshold", "tdlm", "entropy"])
def test_batched_equals_per_sample(policy):
    bb = sharp_backbone()
    model = live_tdlm(bb) if policy == "tdlm" else bb
    opts = dict(policy=policy, threshold=0.6, entropy_threshold=1.0, **KW)
    batched = decode(model, PROMPTS, **opts)
    single = [decode(model, [p], **opts)[0] for p in PROMPTS]
    assert [_key(r) for r in batched] == [_key(r) for r in single]
    if policy == "tdlm":  # the live adapter really changes decoding relative to the backbone
        base = decode(bb, PROMPTS, policy="threshold", threshold=0.6, **KW)
        assert [_key(r) for r in base] != [_key(r) for r in batched]


@pytest.mark.parametrize("policy", ["original", "threshold", "tdlm"])
def test_recorded_trajectory_replays(policy):
    bb = sharp_backbone()
    model = live_tdlm(bb) if policy == "tdlm" else bb
    results = decode(model, PROMPTS, policy=policy, threshold=0.6, record_states=True, **KW)
    for r in results:
        y, a = torch.tensor(r.tokens), torch.tensor(r.reveal_step)
        assert len(r.states) == r.T == r.nfe
        for s, seen in enumerate(r.states):  # the s-th evaluation saw S at step s
            assert state_at(y, a, s, bb.mask_token_id).tolist() == seen
        assert bb.mask_token_id not in r.tokens
        validate_record(TrajectoryRecord("x", r.prompt_ids, r.tokens, r.reveal_step, r.T))
        if policy == "original":
            assert sorted(r.reveal_step) == list(range(1, 33))


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_the_mask_token_is_never_committed(name, cache):
    """A head that makes the mask token the greedy token at every other forward (as tiny random backbones and the
    soft / credit fusions sometimes do): no policy commits it, so every step 1..T reveals a real token and each
    result is a valid trajectory record (batches of 2, with refill)."""
    bb = sharp_backbone(name)
    head = bb.model.transformer.ff_out if bb.family == "llada" else bb.lm_head
    calls = [0]

    def mask_first(module, args, out):
        calls[0] += 1
        if calls[0] % 2:
            out = out.clone()
            out[..., bb.mask_token_id] = out.max(-1).values + 5.0
        return out

    handle = head.register_forward_hook(mask_first)
    try:
        for policy in ("original", "threshold", "tdlm", "credit", "soft", "entropy"):
            model = live_tdlm(bb) if policy == "tdlm" else bb
            opts = dict(policy=policy, threshold=0.6, entropy_threshold=1.0, cache=cache, **KW)
            for r in decode(model, PROMPTS, batch_size=2, **opts):
                assert bb.mask_token_id not in r.tokens, policy
                validate_record(TrajectoryRecord("x", r.prompt_ids, r.tokens, r.reveal_step, r.T), policy)
    finally:
        handle.remove()
    assert calls[0] > 0


def test_blocks_are_decoded_left_to_right():
    bb = sharp_backbone()
    for r in decode(bb, PROMPTS, policy="threshold", threshold=0.6, **KW):
        a = torch.tensor(r.reveal_step).view(4, 8)
        assert (a[:-1].max(1).values <= a[1:].min(1).values).all()


def test_stop_at_eos_cuts_text_and_saves_evaluations():
    bb = sharp_backbone()
    tok = tdlm.data.tokenizer.build_toy_tokenizer()
    full = decode(bb, PROMPTS, policy="threshold", threshold=0.6, tokenizer=tok, **KW)
    # Treat a token the model emits inside its first block as the stop token.
    stop = full[0].tokens[3]
    stops = {stop, bb.eos_token_id}
    early = decode(bb, PROMPTS, policy="threshold", threshold=0.6, tokenizer=tok, stop_at_eos=True,
                   stop_ids=stops, **KW)
    for f, e in zip(full, early, strict=True):
        assert e.nfe <= f.nfe and bb.mask_token_id not in e.tokens
        cut = next((i for i, t in enumerate(e.tokens) if t in stops), len(e.tokens))
        assert e.text == tok.decode(e.tokens[:cut], skip_special_tokens=True)
        if cut < len(e.tokens):  # later blocks were filled with EOS at the last step, not decoded
            tail = (cut // 8 + 1) * 8
            assert all(t == bb.eos_token_id for t in e.tokens[tail:])
            assert all(a == e.T for a in e.reveal_step[tail:])
    assert early[0].nfe < full[0].nfe


def test_bad_decode_arguments():
    bb = tdlm.load_backbone("tiny-llada")
    with pytest.raises(tdlm.TDLMError, match="needs a tdlm.TDLM"):
        decode(bb, PROMPTS, policy="tdlm")
    with pytest.raises(tdlm.TDLMError, match="unknown"):
        decode(bb, PROMPTS, policy="greedy")
    with pytest.raises(tdlm.TDLMError, match="multiple of block_size"):
        decode(bb, PROMPTS, gen_length=30, block_size=8)
    with pytest.raises(tdlm.TDLMError, match="decode:"):
        decode(bb, PROMPTS, treshold=0.5)
    with pytest.raises(tdlm.TDLMError, match="empty"):
        decode(bb, [[]])
    assert DecodeConfig().validate().threshold == 0.9


def test_chat_template_for_toy_tokenizer():
    tok = tdlm.data.tokenizer.build_toy_tokenizer()
    ids = tdlm.data.tokenizer.encode_prompts(tok, ["2+3=?"])[0]
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<|bos|>", "<|user|>"]
    assert tok.convert_ids_to_tokens(ids[-2:]) == ["<|eot|>", "<|assistant|>"]
    assert tok.decode(ids, skip_special_tokens=True) == "2+3=?"
    assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    bb = tdlm.load_backbone("tiny-llada")
    assert len(tok) == bb.vocab_size and tok.mask_token_id == bb.mask_token_id


@pytest.mark.parametrize("field,value", [("threshold", -0.1), ("threshold", 1.5), ("threshold", float("nan")),
                                         ("entropy_threshold", 0.0), ("entropy_threshold", -1.0)])  # fmt: skip
def test_decode_config_refuses_tau_and_h_outside_their_range(field, value):
    with pytest.raises(tdlm.TDLMError, match=field) as e:
        DecodeConfig(**{field: value}).validate()
    assert "\n" not in str(e.value)
    DecodeConfig(threshold=1.0, entropy_threshold=0.5).validate()  # the edges that stay allowed
    DecodeConfig(threshold=0.0).validate()
