"""The LM head on selected positions only (training's supervised positions; Dream's shift handled)."""

from __future__ import annotations

import pytest
import torch

import tdlm
from tdlm.data.trajectories import trajectory_loss
from tests.conftest import randomize_temporal, sampled_states

P, N = 7, 24
TOL = 1e-5  # fp32; the gathered matmul may block differently from the full one


def _padded(x: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad row 1's prompt by 3 tokens: (B, K, L) ids and (B, L) attention mask."""
    x = x.clone()
    am = torch.ones(x.shape[0], x.shape[-1], dtype=torch.long)
    x[1, :, :3] = pad_id
    am[1, :3] = 0
    return x, am


def _select(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sel = torch.rand(x.shape, generator=g) < 0.2
    sel[..., :P] = False
    sel[0, 0, P] = True  # the first response position: Dream reads h at P - 1 (the last prompt token)
    return sel


@pytest.mark.parametrize("history", ["full", "latent:2"])
def test_selected_logits_equal_full_logits_at_those_positions(backbone_name, history):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history=history))
    randomize_temporal(model, seed=1)
    x, am = _padded(sampled_states(bb, P, N, seed=2, K=4), bb.pad_token_id)
    sel = _select(x, 3)
    with torch.no_grad():
        full = model.forward_states(x, P, am)
        part = model.forward_states(x, P, am, select=sel)
    assert part.shape == (int(sel.sum()), full.shape[-1])
    torch.testing.assert_close(part, full[sel], rtol=TOL, atol=TOL)
    # step-wise mode, and the backbone on its own (first real token of a padded Dream row included)
    full_cache, part_cache = model.new_cache(x.shape[0]), model.new_cache(x.shape[0])
    with torch.no_grad():
        for i in range(x.shape[1]):
            step_full = model.forward_step(x[:, i], P, full_cache, am)
            step_part = model.forward_step(x[:, i], P, part_cache, am, select=sel[:, i])
            torch.testing.assert_close(step_part, step_full[sel[:, i]], rtol=TOL, atol=TOL)
        xs, ss = x[:, 0], sel[:, 0].clone()
        ss[1, 3] = True  # row 1's first real token
        x_emb, ctx = bb.prepare(xs, am)
        h = x_emb
        for i in range(bb.num_layers):
            h = bb.layer(i, h, ctx)
        torch.testing.assert_close(bb.head(h, ctx, ss), bb.head(h, ctx)[ss], rtol=TOL, atol=TOL)


def test_loss_and_gradients_equal_the_full_head(backbone_name):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all"))
    randomize_temporal(model, seed=4)
    x, am = _padded(sampled_states(bb, P, N, seed=5, K=4), bb.pad_token_id)
    sel = _select(x, 6)
    labels = torch.full(x.shape, -100, dtype=torch.long)
    labels[sel] = torch.randint(3, bb.vocab_size, (int(sel.sum()),), generator=torch.Generator().manual_seed(7))
    grads = []
    for use_select in (False, True):
        model.zero_grad(set_to_none=True)
        if use_select:
            logits = model.forward_states(x, P, am, select=sel)
            ce, count = trajectory_loss(logits, labels[sel])
        else:
            ce, count = trajectory_loss(model.forward_states(x, P, am), labels)
        (ce / count).backward()
        grads.append({n: p.grad.clone() for n, p in model.temporal.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-7, msg=n)


def test_select_shape_is_checked():
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all"))
    x = sampled_states(bb, P, N, seed=2, K=3)
    with pytest.raises(tdlm.TDLMError, match="select must have the shape"):
        model.forward_states(x, P, select=torch.ones(x.shape[:2], dtype=torch.bool))
