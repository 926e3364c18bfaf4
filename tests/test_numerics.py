"""Numerics and kernels of the spatial attention at 8B precision (issue 21, item 5).

* LLaDA's release rotates q and k in float32 when the model computes in bf16 (``rope_full_precision=True``
  in its config.json): tables from fp32 angles, q.float() rotated, the result cast back. The reference below is
  that rotation written from its formula; a bf16 LLaDA must reproduce it bit for bit. Dream (Qwen2) rounds its
  tables to the compute dtype, as its release does.
* Dream's grouped-query attention never gives SDPA a mask together with ``enable_gqa`` (that combination is
  served by the math kernel: fp32 scores of (B, 28, L, L)); with a mask the K/V heads are repeated, which must
  equal the grouped computation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tdlm
from tdlm.models import common
from tdlm.models.common import apply_rope, bidirectional_attention
from tdlm.models.loading import random_backbone

LLADA = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=96, vocab_size=128,
             embedding_size=128, rope_theta=500000.0, mask_token_id=2, eos_token_id=1, pad_token_id=0)  # fmt: skip


def released_rotation(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """LLaDA's full-precision RoPE from its formula: x (B, H, L, hd) in bf16, positions (L,).

    inv_freq_u = 1 / theta^(2u / hd) and the angles p * inv_freq_u in fp32, both halves sharing them;
    x' = x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1), all in fp32; cast back to x's dtype.
    """
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (L, hd/2)
    ang = torch.cat((ang, ang), -1)
    xf = x.float()
    rot = torch.cat((-xf[..., hd // 2 :], xf[..., : hd // 2]), -1)
    return (xf * ang.cos() + rot * ang.sin()).to(x.dtype)


def test_llada_bf16_rotary_is_the_released_fp32_rotation():
    bb = random_backbone("llada", LLADA, seed=0).to(torch.bfloat16)
    assert bb.rope_full_precision
    L = 300  # angles reach 300 rad at u = 0: where bf16 tables lose digits
    ids = torch.randint(3, 128, (1, L), generator=torch.Generator().manual_seed(0))
    x, ctx = bb.prepare(ids)
    assert ctx.cos.dtype == torch.float32
    block = bb.blocks[0]
    q = block.q_proj(block.attn_norm(x)).view(1, L, block.n_heads, -1).transpose(1, 2)  # bf16
    ours = apply_rope(q, ctx.cos, ctx.sin)
    ref = released_rotation(q, torch.arange(L), bb.rope_theta)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref)
    # the bf16 tables this replaces differ from the release on many entries (the test can tell them apart)
    old = q * ctx.cos.to(torch.bfloat16) + common.rotate_half(q) * ctx.sin.to(torch.bfloat16)
    assert (old != ref).float().mean() > 0.05
    # a padded, windowed forward builds its tables the same way
    am = torch.ones_like(ids)
    am[:, :4] = 0
    _, ctx_pad = bb.prepare(ids, am)
    assert ctx_pad.cos.dtype == torch.float32
    # the whole forward still computes (and returns) bf16
    assert bb(ids[:, :40]).dtype == torch.bfloat16


def test_dream_keeps_its_release_rotary_dtype():
    dream = tdlm.load_backbone("tiny-dream").to(torch.bfloat16)
    assert not dream.rope_full_precision
    _, ctx = dream.prepare(torch.randint(3, 128, (1, 20)))
    assert ctx.cos.dtype == torch.bfloat16  # Qwen2 rounds cos/sin to the compute dtype


def reference_attention(q, k, v, mask) -> torch.Tensor:
    """Float64 grouped attention: query head a reads KV head a // (H / Hkv); ``mask`` (B, 1, 1, L) bool."""
    B, H, L, hd = q.shape
    G = H // k.shape[1]
    out = torch.empty(B, H, L, hd, dtype=torch.float64)
    for a in range(H):
        s = q[:, a].double() @ k[:, a // G].double().transpose(-1, -2) / math.sqrt(hd)
        s = s.masked_fill(~mask[:, 0], float("-inf"))
        out[:, a] = torch.softmax(s, -1) @ v[:, a // G].double()
    return out


@pytest.mark.parametrize("padded", [True, False])
def test_gqa_with_a_mask_repeats_heads_and_equals_grouped_attention(monkeypatch, padded):
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, L, hd = 2, 6, 2, 9, 8
    q, k, v = (torch.randn(B, h, L, hd, generator=g) for h in (H, Hkv, Hkv))
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
    if padded:
        mask[0, ..., :3] = False
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q_, k_, v_, attn_mask=None, **kw):
        calls.append((q_.shape[1], k_.shape[1], attn_mask is not None, kw.get("enable_gqa", False)))
        return sdpa(q_, k_, v_, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(common.F, "scaled_dot_product_attention", spy)
    out = bidirectional_attention(q, k, v, mask)
    unmasked = bidirectional_attention(q, k, v, None)
    ref = reference_attention(q, k, v, mask)
    assert float((out.double() - ref).abs().max()) <= 1e-6
    assert float((unmasked.double() - reference_attention(q, k, v, torch.ones_like(mask))).abs().max()) <= 1e-6
    # the path this replaces (mask + enable_gqa) gives the same numbers
    assert torch.allclose(out, sdpa(q, k, v, attn_mask=mask, enable_gqa=True), atol=1e-6)
    assert calls[0] == (H, H, True, False)  # with a mask: heads repeated, no enable_gqa
    assert calls[1] == (H, Hkv, False, True)  # without: the grouped kernel


def test_dream_padded_forward_never_combines_mask_and_gqa(monkeypatch):
    dream = tdlm.load_backbone("tiny-dream")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, :5] = 0
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q_, k_, v_, attn_mask=None, **kw):
        seen.append(attn_mask is not None and kw.get("enable_gqa", False))
        return sdpa(q_, k_, v_, attn_mask=attn_mask, **kw)

    with torch.no_grad():
        base = dream(ids, am)
        monkeypatch.setattr(common.F, "scaled_dot_product_attention", spy)
        again = dream(ids, am)
    assert len(seen) == dream.num_layers and not any(seen)
    assert torch.equal(base, again)
    # the padded row equals the same prompt unpadded (positions and keys of padding excluded)
    with torch.no_grad():
        alone = dream(ids[1:, 5:])
    assert torch.allclose(again[1, 6:], alone[0, 1:], atol=1e-5)
