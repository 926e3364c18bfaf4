"""LDLM Perceiver attention (seed 001) and the bounded-memory ``latent:M`` history."""

from __future__ import annotations

import json
import math

import pytest
import torch

import tdlm
from tdlm.temporal.adapter_files import ADAPTER_CONFIG
from tdlm.temporal.latent_cache import LatentCache
from tdlm.temporal.perceiver import (
    ClampedRMSNorm,
    LatentMemory,
    PerceiverAttention,
    clamped_rms_normalize,
    perceiver_parameter_count,
    softcap,
)
from tests.conftest import randomize_temporal, sampled_states, stepwise

P, N = 7, 24  # prompt length, response length


# -- the block ---------------------------------------------------------------------------------


def test_parameter_counts_match_the_seed():
    block = PerceiverAttention(768, 12, 64)
    assert sum(p.numel() for p in block.parameters()) == 3_540_608
    with torch.device("meta"):
        six = torch.nn.ModuleList(PerceiverAttention(768, 12, 64) for _ in range(6))
    assert sum(p.numel() for p in six.parameters()) == 21_243_648
    assert perceiver_parameter_count(768, 12, 64) == 3_540_608
    shapes = {n: tuple(p.shape) for n, p in block.named_parameters()}
    assert shapes == {
        "norm_a.weight": (768,),
        "norm_b.weight": (768,),
        "qkv.weight": (2304, 768),
        "kv.weight": (1536, 768),
        "q_norm.weight": (64,),
        "k_norm.weight": (64,),
        "o_proj.weight": (768, 768),
    }
    assert all(m.bias is None for m in (block.qkv, block.kv, block.o_proj))
    for dims in [(64, 2, 16), (96, 3, 8), (32, 1, 5)]:
        assert sum(p.numel() for p in PerceiverAttention(*dims).parameters()) == perceiver_parameter_count(*dims)


def test_clamped_rms_norm_is_the_seed_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g) * 3
    gamma = torch.randn(48, generator=g)
    norm = ClampedRMSNorm(48)
    with torch.no_grad():
        norm.weight.copy_(gamma)
    ref = gamma * x / torch.clamp(x.norm(dim=-1, keepdim=True) / math.sqrt(48), min=1e-5)
    assert torch.allclose(norm(x), ref, rtol=1e-6, atol=1e-6)
    # below eps * sqrt(d) the max() takes eps: x / eps, not a unit-RMS vector
    tiny = torch.full((1, 48), 1e-9)
    assert torch.allclose(clamped_rms_normalize(tiny), tiny / 1e-5)
    assert torch.equal(clamped_rms_normalize(torch.zeros(2, 48)), torch.zeros(2, 48))
    # no overflow of the sum of squares near the float range
    for big in (1e30, 3e38):
        assert torch.allclose(clamped_rms_normalize(torch.full((1, 48), big)), torch.ones(1, 48))


def _reference_perceiver(block: PerceiverAttention, u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The seed's 22 steps for one sample, heads before positions as the atlas writes them."""
    H, dh = block.heads, block.head_dim
    da = H * dh

    def rms(x, gamma):
        return gamma * x / torch.clamp(x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1]), min=1e-5)

    u_bar, h_bar = rms(u, block.norm_a.weight), rms(h, block.norm_b.weight)
    pa, pb = u_bar @ block.qkv.weight.T, h_bar @ block.kv.weight.T
    q, ka, va = pa[:, :da], pa[:, da : 2 * da], pa[:, 2 * da :]
    kb, vb = pb[:, :da], pb[:, da:]
    k, v = torch.cat([ka, kb]), torch.cat([va, vb])
    Q = rms(q.view(-1, H, dh).transpose(0, 1), block.q_norm.weight)  # (H, T, dh)
    K = rms(k.view(-1, H, dh).transpose(0, 1), block.k_norm.weight)  # (H, T + S, dh)
    V = v.view(-1, H, dh).transpose(0, 1)
    S = Q @ K.transpose(1, 2)
    F = 50 * torch.tanh(S / (50 * math.sqrt(dh)))
    A = F.exp() / F.exp().sum(-1, keepdim=True)
    O = A @ V  # (H, T, dh)
    return O.transpose(0, 1).reshape(-1, da) @ block.o_proj.weight.T


def test_perceiver_matches_the_seed_steps():
    torch.manual_seed(0)
    block = PerceiverAttention(48, 3, 8)
    with torch.no_grad():
        for norm in (block.norm_a, block.norm_b, block.q_norm, block.k_norm):
            norm.weight.uniform_(0.5, 1.5)
    u, h = torch.randn(2, 4, 48), torch.randn(2, 6, 48) * 5
    out = block(u, h)
    assert out.shape == (2, 4, 48)
    for b in range(2):
        assert torch.allclose(out[b], _reference_perceiver(block, u[b], h[b]), rtol=1e-5, atol=1e-5)


def test_softcap_bound_on_extreme_inputs():
    block = PerceiverAttention(64, 4, 16)
    g = torch.Generator().manual_seed(1)
    for scale in (1e30, -1e30, 1e-30, 0.0, 1.0):
        u = torch.randn(3, 5, 64, generator=g) * scale
        h = torch.randn(3, 2, 64, generator=g) * scale
        F = block.logits(u, h)
        assert F.shape == (3, 4, 5, 7)  # (..., H, T, T + S): softmax over both streams
        assert torch.isfinite(F).all() and (F.abs() < 50).all(), scale
        assert torch.isfinite(block(u, h)).all()
    # extreme raw scores: capped at 50 (tanh rounds to 1 in float32), never beyond
    s = torch.tensor([-1e30, -1e6, -1.0, 0.0, 1.0, 1e6, 1e30, float("inf")])
    F = softcap(s, 16)
    assert (F.abs() <= 50).all() and F[0] == -50 and F[-1] == 50
    # small scores are the usual S / sqrt(d_h)
    small = torch.linspace(-0.5, 0.5, 11)
    assert torch.allclose(softcap(small, 16), small / 4, rtol=1e-4)


# -- the policy --------------------------------------------------------------------------------
def test_policy_parsing():
    assert tdlm.HistoryPolicy.parse("latent:4") == tdlm.HistoryPolicy("latent", 4)
    assert str(tdlm.HistoryPolicy.parse(" Latent:8 ")) == "latent:8"
    assert tdlm.HistoryPolicy.parse("latent:4").recurrent and not tdlm.HistoryPolicy.parse("full").recurrent
    for bad in ("latent:0", "latent", "latent:-1", "latent:x"):
        with pytest.raises(tdlm.TDLMError, match="latent:M"):
            tdlm.HistoryPolicy.parse(bad)
    with pytest.raises(tdlm.TDLMError, match="recurrent"):
        tdlm.HistoryPolicy.parse("latent:2").parallel_mask(3)
    bb = tdlm.load_backbone("tiny-llada")
    with pytest.raises(tdlm.TDLMError, match=r"history policy 'latent:0' not understood.*k, M >= 1"):
        tdlm.TDLM(bb, tdlm.TemporalConfig(history="latent:0"))
    with pytest.raises(tdlm.TDLMError, match="latent:M' only"):
        tdlm.TDLM(bb, tdlm.TemporalConfig(history="full", perceiver_heads=2))


def test_latent_parameters_exist_only_for_latent_policy():
    bb = tdlm.load_backbone("tiny-llada")
    full = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all"))
    assert full.num_latents == 0 and not any("memory" in n for n, _ in full.named_parameters())
    cfg = tdlm.TemporalConfig(layers="all", history="latent:3", perceiver_heads=2, perceiver_head_dim=8)
    model = tdlm.TDLM(bb, cfg)
    L_t, d = 4, bb.hidden_size
    per_layer = 4 * d * 32 + 1 + 3 * d + perceiver_parameter_count(d, 2, 8)
    assert model.num_temporal_parameters() == model.expected_temporal_parameters() == L_t * per_layer
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(n.startswith("temporal.") for n in trainable)
    assert "temporal.0.memory.latents" in trainable and "temporal.3.memory.perceiver.qkv.weight" in trainable
    # default perceiver width = the temporal width (d_attn = heads x head_dim of the temporal module)
    dflt = tdlm.TDLM(bb, tdlm.TemporalConfig(history="latent:2"))
    assert (dflt.config.perceiver_heads, dflt.config.perceiver_head_dim) == (dflt.config.heads, dflt.config.head_dim)


def test_switching_history_needs_matching_weights():
    bb = tdlm.load_backbone("tiny-llada")
    full = tdlm.TDLM(bb)
    with pytest.raises(tdlm.TDLMError, match="needs perceiver weights"):
        full.set_history("latent:4")
    full.set_history("last:2")  # entry-based policies still switch freely
    lat = tdlm.TDLM(bb, tdlm.TemporalConfig(history="latent:4"))
    with pytest.raises(tdlm.TDLMError, match="has 4 learned latents"):
        lat.set_history("latent:8")
    with pytest.raises(tdlm.TDLMError, match="trained with history 'latent:4'"):
        lat.set_history("full")
    lat.set_history("latent:4")
    with pytest.raises(tdlm.TDLMError, match="latent cache"):
        lat.forward_step(torch.full((1, 12), bb.mask_token_id), 4, full.new_cache(1))


@pytest.mark.parametrize("M", [1, 4])
def test_prop1_zero_wo_is_bit_identical_to_backbone(backbone_name, M):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history=f"latent:{M}"))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for mod in model.temporal.values():
            assert torch.count_nonzero(mod.o_proj.weight) == 0
            mod.sink.fill_(-1.3)
            mod.memory.latents.copy_(torch.randn(mod.memory.latents.shape, generator=g) * 5)
    x = sampled_states(bb, P, N, seed=1)
    B, K, L = x.shape
    with torch.no_grad():
        per_state = torch.stack([bb(x[:, i]) for i in range(K)], dim=1)
        par = model.forward_states(x, P)
        assert torch.equal(par, per_state)
        # the backbone over all B*K states at once is another batch shape: CPU GEMMs at 2 threads may block it
        # differently, so that comparison is numerical (fp32), not Prop. 1's bit-for-bit claim
        torch.testing.assert_close(par, bb(x.reshape(B * K, L)).view_as(par), rtol=1e-5, atol=1e-6)
        cache = model.new_cache(B)
        for i in range(K):
            assert torch.equal(model.forward_step(x[:, i], P, cache), per_state[:, i])
    assert isinstance(cache, LatentCache) and cache.steps == K


@pytest.mark.parametrize("M", [1, 4])
def test_forward_states_equals_stepwise(backbone_name, M):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history=f"latent:{M}"))
    randomize_temporal(model, seed=3)
    x = sampled_states(bb, P, N, seed=2, K=6)
    with torch.no_grad():
        par = model.forward_states(x, P)
        seq = stepwise(model, x, P)
        base = torch.stack([bb(x[:, i]) for i in range(x.shape[1])], dim=1)
    rel = ((par - seq).abs().max() / seq.abs().max()).item()
    assert rel <= 1e-5, rel
    assert (par[:, 1:] - base[:, 1:]).abs().max() > 1e-3  # the adapter is live
    # not history-only: the learned initial latents already correct S_0 when W_O != 0
    assert (par[:, 0] - base[:, 0]).abs().max() > 1e-4


def test_latents_carry_history_and_only_masked_positions_change():
    # Only the last block is temporal: after the correction everything is position-wise, so revealed
    # and prompt positions keep the backbone's logits exactly.
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers=[bb.num_layers - 1], history="latent:2"))
    randomize_temporal(model, seed=4)
    x = sampled_states(bb, P, N, seed=5, K=5)
    with torch.no_grad():
        par = model.forward_states(x, P)
        base = torch.stack([bb(x[:, i]) for i in range(x.shape[1])], dim=1)
        # The same last state after a different history gives different logits: the latents remember.
        other = model.forward_states(torch.cat([x[:, :1], x[:, -1:]], dim=1), P)
    masked = torch.zeros(x.shape, dtype=torch.bool)
    masked[..., P:] = x[..., P:] == bb.mask_token_id
    assert torch.equal(par[~masked], base[~masked])
    assert (other[:, -1] - par[:, -1]).abs().max() > 1e-4


def test_cache_memory_is_constant_in_steps():
    bb = tdlm.load_backbone("tiny-llada")
    sizes: dict[str, list[int]] = {}
    for policy in ("full", "latent:4"):
        model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history=policy))
        sizes[policy] = []
        for steps in (3, 9, 20):
            x = torch.randint(3, 128, (2, steps, P + N))
            x[:, :, P:] = bb.mask_token_id
            cache = model.new_cache(2)
            with torch.no_grad():
                for i in range(steps):
                    model.forward_step(x[:, i], P, cache)
            assert cache.nbytes() == model.temporal_cache_bytes(2, N, steps), (policy, steps)
            sizes[policy].append(cache.nbytes())
    assert sizes["full"][0] < sizes["full"][1] < sizes["full"][2]
    assert len(set(sizes["latent:4"])) == 1
    L_t, d = 4, bb.hidden_size  # per position: L_t M d floats + one alive flag; plus r_last per row
    assert sizes["latent:4"][0] == 2 * N * (L_t * 4 * d * 4 + 1) + 2 * 8


def test_cache_select_equals_running_the_rows_alone():
    bb = tdlm.load_backbone("tiny-dream")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history="latent:3"))
    randomize_temporal(model, seed=6)
    x = sampled_states(bb, P, N, seed=7, B=3, K=5)
    with torch.no_grad():
        cache = model.new_cache(3)
        for i in range(2):
            model.forward_step(x[:, i], P, cache)
        before = cache.nbytes()
        cache.select(torch.tensor([2, 0]))
        assert cache.batch_size == 2 and cache.nbytes() == before * 2 // 3
        rest = torch.stack([model.forward_step(x[[2, 0], i], P, cache) for i in range(2, 5)], dim=1)
        alone = torch.cat([stepwise(model, x[[r]], P) for r in (2, 0)])[:, 2:]
    assert torch.allclose(rest, alone, rtol=1e-5, atol=1e-5)


def test_revealed_positions_have_dead_latents():
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history="latent:2"))
    x = torch.randint(3, 128, (1, 4, P + 8))
    x[:, :, P:] = bb.mask_token_id
    x[:, 2:, P] = 50  # revealed in S_2
    cache = model.new_cache(1)
    with torch.no_grad():
        for i in range(2):
            model.forward_step(x[:, i], P, cache)
        frozen = {k: v[0, 0].clone() for k, v in cache.latents.items()}
        for i in range(2, 4):
            model.forward_step(x[:, i], P, cache)
    counts = cache.valid_entries()[0]
    assert counts[0] == 0 and (counts[1:] == 4).all()
    for k, v in cache.latents.items():
        assert torch.equal(v[0, 0], frozen[k])  # no update after the reveal
    assert int(cache.r_last[0]) == 1


def test_gradients_flow_through_the_latent_updates(backbone_name):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(history="latent:4")).train()
    randomize_temporal(model, seed=7)
    x = sampled_states(bb, P, N, seed=8, K=4)
    model.forward_states(x, P).float().logsumexp(-1).mean().backward()
    assert all(p.grad is None for p in bb.parameters())
    for n, p in model.temporal.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n  # every perceiver weight, norm gain and initial latent


def test_latent_gradients_with_activation_checkpointing():
    bb = tdlm.load_backbone("tiny-llada")
    x = sampled_states(bb, P, N, seed=9, K=4)
    grads, state = [], None
    for ckpt in (False, True):
        model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history="latent:2"))
        randomize_temporal(model, seed=1)
        if state is None:
            state = model.temporal.state_dict()
        model.temporal.load_state_dict(state)
        model.activation_checkpointing = ckpt
        model.forward_states(x, P).logsumexp(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.temporal.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_adapter_round_trip_with_latent_policy(tmp_path):
    bb = tdlm.load_backbone("tiny-llada")
    cfg = tdlm.TemporalConfig(layers="middle:2", heads=2, head_dim=8, history="latent:3", perceiver_heads=4)
    model = tdlm.TDLM(bb, cfg)
    randomize_temporal(model, seed=10)
    out = model.save_adapter(tmp_path / "ad")
    raw = json.loads((out / ADAPTER_CONFIG).read_text())
    assert raw["history"] == "latent:3"
    assert raw["perceiver"] == {"num_latents": 3, "heads": 4, "head_dim": 8, "norm_eps": 1e-5, "softcap": 50.0}
    assert raw["num_parameters"] == model.num_temporal_parameters()
    again = tdlm.TDLM.from_adapter(tdlm.load_backbone("tiny-llada"), out)
    assert str(again.policy) == "latent:3" and again.num_latents == 3
    assert again.adapter_state_dict().keys() == model.adapter_state_dict().keys()
    for k, v in model.adapter_state_dict().items():
        assert torch.equal(again.adapter_state_dict()[k], v), k
    x = sampled_states(bb, P, N, seed=11, K=4)
    with torch.no_grad():
        assert torch.equal(model.forward_states(x, P), again.forward_states(x, P))
    with pytest.raises(tdlm.TDLMError, match="trained with history 'latent:3'"):
        tdlm.TDLM.from_adapter(bb, out, history="full")
    full_dir = tdlm.TDLM(bb).save_adapter(tmp_path / "full")
    with pytest.raises(tdlm.TDLMError, match="needs perceiver weights"):
        tdlm.TDLM.from_adapter(bb, full_dir, history="latent:3")
    raw["perceiver"]["num_latents"] = 5
    (out / ADAPTER_CONFIG).write_text(json.dumps(raw))
    with pytest.raises(tdlm.TDLMError, match="disagree"):
        tdlm.TDLM.from_adapter(bb, out)


def test_latent_memory_update_is_residual():
    mem = LatentMemory(dim=16, num_latents=3, heads=2, head_dim=4)
    lat = mem.initial(2, 5)  # (B, N, M, d)
    assert lat.shape == (2, 5, 3, 16)
    entry = torch.randn(2, 5, 16)
    alive = torch.tensor([[True, False, True, True, False]] * 2)
    with torch.no_grad():
        new = mem.update(lat, entry, alive)
        delta = mem.perceiver(lat, entry[..., None, :])
    assert torch.equal(new[alive], (lat + delta)[alive])
    assert torch.equal(new[~alive], lat[~alive])
