"""The TDLM operator on the native backbones: Props. 1-2, Eq. 11, masking, gradients, counts."""

from __future__ import annotations

import math

import pytest
import torch

import tdlm
from tdlm.temporal.adapter_files import ADAPTER_CONFIG
from tdlm.temporal.attention import sink_softmax, temporal_rope
from tests.conftest import randomize_temporal, sampled_states, stepwise

P, N = 7, 24  # prompt length, response length
POLICIES = ["full", "last:1", "last:3", "current"]


ALIGNMENTS = ["prediction", "input"]


@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("history", POLICIES)
def test_prop1_zero_wo_is_bit_identical_to_backbone(backbone_name, history, alignment):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history=history, alignment=alignment))
    for mod in model.temporal.values():  # init must be zero, sink arbitrary does not matter
        assert torch.count_nonzero(mod.o_proj.weight) == 0
        with torch.no_grad():
            mod.sink.fill_(-1.3)
    x = sampled_states(bb, P, N, seed=1)
    B, K, L = x.shape
    with torch.no_grad():
        ref = bb(x.reshape(B * K, L)).view(B, K, L, -1)
        par = model.forward_states(x, P)
        assert torch.equal(par, ref)
        cache = model.new_cache(B)
        for i in range(K):
            step = model.forward_step(x[:, i], P, cache)
            assert torch.equal(step, bb(x[:, i]))


@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("history", POLICIES)
def test_prop2_parallel_equals_stepwise(backbone_name, history, alignment):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history=history, alignment=alignment))
    randomize_temporal(model, seed=3)
    x = sampled_states(bb, P, N, seed=2, K=6)
    with torch.no_grad():
        par = model.forward_states(x, P)
        seq = stepwise(model, x, P)
        base = bb(x.reshape(-1, x.shape[-1])).view_as(par)
    rel = ((par - seq).abs().max() / seq.abs().max()).item()
    assert rel <= 1e-5, rel
    # the adapter is live: it really changes the logits after the first state
    assert (par[:, 1:] - base[:, 1:]).abs().max() > 1e-3
    if history != "current":  # first evaluation has no history -> exactly the backbone (Prop. 1)
        assert torch.equal(par[:, 0], base[:, 0])


def test_revealed_and_prompt_positions_are_never_corrected():
    # With the only temporal layer being the last block, everything after the correction is
    # position-wise (FFN, final norm, LLaDA head): uncorrected positions keep the backbone's logits.
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers=[bb.num_layers - 1], history="full"))
    randomize_temporal(model, seed=4)
    x = sampled_states(bb, P, N, seed=5, K=5)
    with torch.no_grad():
        par = model.forward_states(x, P)
        base = bb(x.reshape(-1, x.shape[-1])).view_as(par)
    masked = torch.zeros(x.shape, dtype=torch.bool)
    masked[..., P:] = x[..., P:] == bb.mask_token_id
    assert torch.equal(par[~masked], base[~masked])
    assert (par[:, 1:][masked[:, 1:]] - base[:, 1:][masked[:, 1:]]).abs().max() > 1e-3


@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_dream_alignment_decides_which_hidden_state_is_corrected(alignment):
    # Dream predicts token p from h at p - 1. With the last block as the only temporal layer everything
    # after the correction is position-wise, so the aligned logits of token p differ from the backbone's
    # exactly where h at p - 1 was corrected: prediction-aligned, where token p is masked (in this state
    # and an earlier one, so there is history); input-aligned, where token p - 1 is.
    bb = tdlm.load_backbone("tiny-dream")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers=[bb.num_layers - 1], history="full", alignment=alignment))
    assert model.offset == (1 if alignment == "prediction" else 0)
    randomize_temporal(model, seed=4)
    x = sampled_states(bb, P, N, seed=5, K=5)
    with torch.no_grad():
        par = model.forward_states(x, P)
        seq = stepwise(model, x, P)
        base = bb(x.reshape(-1, x.shape[-1])).view_as(par)
    assert ((par - seq).abs().max() / seq.abs().max()).item() <= 1e-5  # Prop. 2 with this alignment
    B, K, L = x.shape
    masked = torch.zeros(x.shape, dtype=torch.bool)
    masked[..., P:] = x[..., P:] == bb.mask_token_id
    with_history = masked & (masked.cumsum(1) > 1)  # masked now and in some earlier state (A_{p,i,j})
    corrected = with_history if alignment == "prediction" else torch.roll(with_history, 1, dims=-1)
    corrected[..., : P + (alignment == "input")] = False
    changed = (par - base).abs().amax(-1) > 1e-6
    assert torch.equal(changed, corrected)
    assert corrected.any()


def test_alignment_is_a_no_op_without_logit_shift():
    bb = tdlm.load_backbone("tiny-llada")
    x = sampled_states(bb, P, N, seed=6, K=4)
    pred = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", alignment="prediction"))
    randomize_temporal(pred, seed=2)
    inp = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", alignment="input"))
    inp.temporal.load_state_dict(pred.temporal.state_dict())
    with torch.no_grad():
        assert torch.equal(pred.forward_states(x, P), inp.forward_states(x, P))


def test_alignment_is_recorded_in_the_adapter_and_old_adapters_load_input_aligned(tmp_path):
    import json

    bb = tdlm.load_backbone("tiny-dream")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="middle:2"))
    assert model.config.alignment == "prediction"
    model.save_adapter(tmp_path / "a")
    cfg_path = tmp_path / "a" / ADAPTER_CONFIG
    assert json.loads(cfg_path.read_text())["alignment"] == "prediction"
    assert tdlm.TDLM.from_adapter(bb, tmp_path / "a").offset == 1
    raw = json.loads(cfg_path.read_text())
    del raw["alignment"]  # written before the field existed
    cfg_path.write_text(json.dumps(raw))
    old = tdlm.TDLM.from_adapter(bb, tmp_path / "a")
    assert old.config.alignment == "input" and old.offset == 0
    with pytest.raises(tdlm.TDLMError, match="alignment must be one of prediction, input"):
        tdlm.TDLM(bb, tdlm.TemporalConfig(alignment="left"))


def test_sink_bound_eq11():
    g = torch.Generator().manual_seed(0)
    mod = tdlm.TemporalAttention(hidden_size=32, heads=3, head_dim=8)
    with torch.no_grad():
        mod.o_proj.weight.copy_(torch.randn(mod.o_proj.weight.shape, generator=g))
    for sink in (-4.0, 0.0, 2.5):
        with torch.no_grad():
            mod.sink.fill_(sink)
        h_now = torch.randn(10, 32, generator=g)
        hist = torch.randn(10, 6, 32, generator=g) * 3  # 6 earlier entries per position
        r_now, r_hist = torch.tensor(9), torch.arange(6)
        q, _, _ = mod.project(h_now, r_now)  # (10, M, dh)
        _, k, v = mod.project(hist, r_hist[None, :].expand(10, 6))  # (10, 6, M, dh)
        scores = torch.einsum("nmd,njmd->nmj", q, k) / math.sqrt(mod.head_dim)
        w = sink_softmax(scores, torch.ones_like(scores, dtype=torch.bool), mod.sink)
        z = torch.einsum("nmj,njmd->nmd", w, v)
        delta = mod.output(z, h_now)  # (10, d)
        V = v.norm(dim=-1).max()
        pi_sink = 1 - w.sum(-1)  # (10, M)
        bound = torch.linalg.matrix_norm(mod.o_proj.weight, ord=2) * V * ((1 - pi_sink) ** 2).sum(-1).sqrt()
        assert (delta.norm(dim=-1) <= bound * (1 + 1e-5)).all()
        # pi_sink really is exp(b) / Z
        Z = math.exp(sink) + scores.exp().sum(-1)
        assert torch.allclose(pi_sink, math.exp(sink) / Z, rtol=1e-4, atol=1e-6)  # 1 - sum(w) in fp32


def test_temporal_rope_is_relative():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    a = (temporal_rope(q, torch.tensor(5)) * temporal_rope(k, torch.tensor(2))).sum(-1)
    b = (temporal_rope(q, torch.tensor(13)) * temporal_rope(k, torch.tensor(10))).sum(-1)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gradients_reach_only_temporal_parameters(backbone_name):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb).train()
    randomize_temporal(model, seed=7)
    x = sampled_states(bb, P, N, seed=8, K=4)
    logits = model.forward_states(x, P)
    logits.float().logsumexp(-1).mean().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("temporal.") for n in trainable)
    assert all(p.grad is None for p in bb.parameters())
    for n, p in model.temporal.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert any(p.grad.abs().sum() > 0 for p in model.temporal.parameters())
    assert not bb.training


def test_activation_checkpointing_gives_identical_gradients():
    bb = tdlm.load_backbone("tiny-llada")
    x = sampled_states(bb, P, N, seed=9, K=4)
    grads, state = [], None
    for ckpt in (False, True):
        model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all"))
        randomize_temporal(model, seed=1)
        if state is None:
            state = model.temporal.state_dict()
        model.temporal.load_state_dict(state)
        model.activation_checkpointing = ckpt
        model.forward_states(x, P).logsumexp(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.temporal.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layers,heads,head_dim", [("all", 2, 16), ("dispersed:2", 4, 8), ([0, 2], 1, 64)])
def test_parameter_count_formula(layers, heads, head_dim):
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers=layers, heads=heads, head_dim=head_dim))
    L_t, d, d_t = len(model.layer_ids), bb.hidden_size, heads * head_dim
    assert model.num_temporal_parameters() == L_t * (4 * d * d_t + 1)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == L_t * (4 * d * d_t + 1)


def test_paper_parameter_counts():
    # LLaDA main setting: 16 layers, d = 4096, 4 x 64 -> 16 * (4 * 4096 * 256 + 1)
    assert tdlm.temporal_parameter_count(4096, 16, 4, 64) == 67_108_880
    assert tdlm.temporal_parameter_count(3584, 14, 4, 84) == 14 * (4 * 3584 * 336 + 1)


def test_layer_allocations():
    assert tdlm.resolve_layers("middle:16", 32) == list(range(8, 24))
    assert tdlm.resolve_layers("middle:14", 28) == list(range(7, 21))
    assert tdlm.resolve_layers("dispersed:16", 32) == list(range(1, 32, 2))
    assert tdlm.resolve_layers("dispersed:8", 32) == [2, 6, 10, 14, 18, 22, 26, 30]
    assert tdlm.resolve_layers("all", 4) == [0, 1, 2, 3]
    assert tdlm.resolve_layers([3, 1], 4) == [1, 3]
    assert tdlm.resolve_layers("0,2", 4) == [0, 2]
    for n in (1, 5, 16, 32):
        d = tdlm.resolve_layers(f"dispersed:{n}", 32)
        assert len(set(d)) == n and d == sorted(d)


def test_backbone_defaults_follow_the_paper():
    from tdlm.models import Dream, DreamConfig, LLaDA, LLaDAConfig

    with torch.device("meta"):
        llada, dream = LLaDA(LLaDAConfig()), Dream(DreamConfig())
    t = tdlm.TemporalConfig().resolved(llada)
    assert (t.layers, t.heads, t.head_dim) == (list(range(1, 32, 2)), 4, 64)
    t = tdlm.TemporalConfig().resolved(dream)
    assert (t.layers, t.heads, t.head_dim) == (list(range(7, 21)), 4, 84)
    assert llada.mask_token_id == 126336 and dream.mask_token_id == 151666


def test_dream_logits_are_shifted_inside_the_backbone():
    bb = tdlm.load_backbone("tiny-dream")
    x = torch.randint(3, 128, (1, 10))
    with torch.no_grad():
        h, ctx = bb.prepare(x)
        for i in range(bb.num_layers):
            h = bb.layer(i, h, ctx)
        raw = bb.lm_head(bb.model.norm(h))
        out = bb(x)
    assert torch.equal(out[:, 1:], raw[:, :-1]) and torch.equal(out[:, 0], raw[:, 0])
