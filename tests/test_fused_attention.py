"""The fused temporal operator (issue 21, item 4) against the float64 reference of Eq. 7-10.

``TemporalAttention`` computes a layer's temporal attention with one projection matmul for Q, K and V, one
rotation for q and k, one ``scaled_dot_product_attention`` whose extra zero key/value carries the sink logit
b_l as an additive bias, and the correction added in place. Checked here, for the three ways the model calls
it (step-wise over a temporal cache, parallel over K states, latent:M):

* values against ``tests/test_reference_math.py``'s float64 evaluation of Eq. 7-10 (explicit rotation matrices,
  explicit sink normaliser), fp32 within 1e-5 relative;
* gradients of the fused parallel path against the unfused einsum + ``sink_softmax`` path (what training used);
* the in-place correction (no copy of h without autograd, out of place with it);
* old adapters (separate W_Q / W_K / W_V tensors) load, by ``load_state_dict`` and by ``TDLM.from_adapter``;
* one SDPA and two matmuls per temporal layer, and a temporal layer dispatching at most half a backbone block's
  aten ops eager.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

import tdlm
from tdlm.temporal.adapter_files import ADAPTER_WEIGHTS
from tdlm.temporal.attention import TemporalAttention, sink_softmax, temporal_rope
from tests.conftest import randomize_temporal, sampled_states, stepwise
from tests.test_reference_math import raw_weights, rotation, temp_attn

TOL = 1e-5
D, M, DH = 24, 3, 8  # hidden size, temporal heads, head width


def module(seed: int = 0, dtype=torch.float32) -> TemporalAttention:
    g = torch.Generator().manual_seed(seed)
    mod = TemporalAttention(D, M, DH)
    with torch.no_grad():
        mod.qkv.weight.copy_(torch.randn(mod.qkv.weight.shape, generator=g) / math.sqrt(D))
        mod.o_proj.weight.copy_(torch.randn(mod.o_proj.weight.shape, generator=g) * 0.3)
        mod.sink.fill_(0.7)
    return mod.to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def ref_key(w, x: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 k = R(r) W_K x and v = W_V x per head, (M, d_h) each (Eq. 7)."""
    ks, vs = [], []
    for a in range(w.heads):
        rows = slice(a * w.head_dim, (a + 1) * w.head_dim)
        ks.append(rotation(r, w.head_dim) @ (w.Wk[rows] @ x))
        vs.append(w.Wv[rows] @ x)
    return torch.stack(ks), torch.stack(vs)


def test_step_matches_float64_reference():
    """Step-wise: q of this evaluation vs C stored entries per position, some invalid, one position with none."""
    g = torch.Generator().manual_seed(1)
    mod, b, N, C = module(), 2, 5, 4
    w = raw_weights(mod)
    h = torch.randn(b, N, D, generator=g, dtype=torch.float64)
    r = torch.tensor([3, 7])
    xs = torch.randn(b, C, N, D, generator=g, dtype=torch.float64) * 2  # the vectors the entries came from
    r_hist = torch.randint(0, 7, (b, C), generator=g)
    valid = torch.rand(b, C, N, generator=g) > 0.4
    valid[0, :, 2] = False  # nothing stored for this position: only the sink, correction exactly 0
    masked = torch.rand(b, N, generator=g) > 0.3
    keys = torch.empty(b, C, N, M, DH, dtype=torch.float64)
    values = torch.empty_like(keys)
    for i in range(b):
        for c in range(C):
            for p in range(N):
                keys[i, c, p], values[i, c, p] = ref_key(w, xs[i, c, p], int(r_hist[i, c]))
    # the cache's layout: (b, N, 2, M, 1 + C, d_h), the sink's zero key / value in slot 0, validity (b, N, 1 + C)
    kv = F.pad(torch.stack((keys, values), 2).permute(0, 3, 2, 4, 1, 5), (0, 0, 1, 0)).float()
    allowed = F.pad(valid.transpose(1, 2), (1, 0), value=True)
    with torch.no_grad():
        z, entry = mod.step(h.float(), r, (kv, allowed))
        k, v = entry[:, :, 0], entry[:, :, 1]
        out = mod.correct(h.float().clone(), 0, N, z, masked[..., None])
    expect = h.clone()
    for i in range(b):
        for p in range(N):
            if masked[i, p]:
                entries = [(xs[i, c, p], int(r_hist[i, c])) for c in range(C) if valid[i, c, p]]
                expect[i, p] += temp_attn(w, h[i, p], int(r[i]), entries)
    assert rel(out - h.float(), expect - h) <= TOL
    assert torch.equal(out[0, 2], h[0, 2].float())  # no usable entry: h unchanged (zero-value sink)
    # m_{i,p} folded into the attention mask (the model's step path): z is exactly 0 where p is not masked
    with torch.no_grad():
        zm, _ = mod.step(h.float(), r, (kv, allowed), masked=masked[..., None])
        folded = mod.correct(h.float().clone(), 0, N, zm, None)
    assert torch.equal(zm[~masked], torch.zeros_like(zm[~masked])) and torch.equal(folded[~masked], h.float()[~masked])
    assert rel(folded - h.float(), expect - h) <= TOL
    # the entry handed to the cache: R(r) W_K h and W_V h
    for i in range(b):
        kr, vr = ref_key(w, h[i, 1], int(r[i]))
        assert rel(k[i, 1], kr) <= TOL and rel(v[i, 1], vr) <= TOL


def test_states_match_float64_reference():
    """Parallel over K states: state i attends to earlier states j < i where m_{j,p} (full history, Eq. 2)."""
    g = torch.Generator().manual_seed(2)
    mod, B, K, N = module(3), 2, 4, 5
    w = raw_weights(mod)
    h = torch.randn(B, K, N, D, generator=g, dtype=torch.float64)
    r = torch.sort(torch.randint(0, 9, (B, K), generator=g), dim=1).values
    masked = torch.rand(B, K, N, generator=g) > 0.3
    causal = torch.ones(K, K, dtype=torch.bool).tril(-1)
    allowed = causal[None, None] & masked.transpose(1, 2)[:, :, None, :]  # (B, N, Ki, Kj)
    with torch.no_grad():
        z = mod.states(h.float(), r, allowed)  # (B, K, N, d_t)
        delta = mod.correct(torch.zeros(B * K, N, D), 0, N, z.reshape(B * K, N, -1),
                            masked.reshape(B * K, N, 1)).view(B, K, N, D)  # fmt: skip
    expect = torch.zeros(B, K, N, D, dtype=torch.float64)
    for bi in range(B):
        for i in range(K):
            for p in range(N):
                if masked[bi, i, p]:
                    entries = [(h[bi, j, p], int(r[bi, j])) for j in range(i) if masked[bi, j, p]]
                    expect[bi, i, p] = temp_attn(w, h[bi, i, p], int(r[bi, i]), entries)
    assert rel(delta, expect) <= TOL


def test_latent_matches_float64_reference():
    """latent:M: the query (rotated by r_i) reads each position's latents (keys rotated by r_last) + the sink."""
    g = torch.Generator().manual_seed(3)
    mod, b, N, T = module(4), 2, 3, 5
    w = raw_weights(mod)
    h = torch.randn(b, N, D, generator=g, dtype=torch.float64)
    lat = torch.randn(b, N, T, D, generator=g, dtype=torch.float64)
    r, r_last = torch.tensor([4, 9]), torch.tensor([1, 6])
    with torch.no_grad():
        z = mod.latent(h.float(), r, lat.float(), r_last[:, None, None])
        delta = mod.correct(torch.zeros(b, N, D), 0, N, z, torch.ones(b, N, 1, dtype=torch.bool))
    expect = torch.stack([torch.stack([temp_attn(w, h[i, p], int(r[i]), [(u, int(r_last[i])) for u in lat[i, p]])
                                       for p in range(N)]) for i in range(b)])  # fmt: skip
    assert rel(delta, expect) <= TOL


def unfused_states(mod: TemporalAttention, h, r, allowed):
    """The operator as it was before fusion: three projections, per-tensor RoPE, einsum scores, sink_softmax."""
    d_t = mod.heads * mod.head_dim
    W = mod.qkv.weight
    shape = (*h.shape[:-1], mod.heads, mod.head_dim)
    q, k, v = (torch.nn.functional.linear(h, W[i * d_t : (i + 1) * d_t]).view(shape) for i in range(3))
    q, k = temporal_rope(q, r[:, :, None]), temporal_rope(k, r[:, :, None])
    scores = torch.einsum("binmd,bjnmd->bnmij", q, k) / mod.head_dim**0.5
    wts = sink_softmax(scores, allowed[:, :, None], mod.sink)
    z = torch.einsum("bnmij,bjnmd->binmd", wts.to(v.dtype), v)
    return mod.o_proj(z.flatten(-2))


def test_training_gradients_equal_unfused_path():
    g = torch.Generator().manual_seed(5)
    B, K, N = 2, 4, 5
    h = torch.randn(B, K, N, D, generator=g, dtype=torch.float64)
    r = torch.sort(torch.randint(0, 9, (B, K), generator=g), dim=1).values
    masked = torch.rand(B, K, N, generator=g) > 0.3
    allowed = torch.ones(K, K, dtype=torch.bool).tril(-1)[None, None] & masked.transpose(1, 2)[:, :, None, :]
    target = torch.randn(B, K, N, D, generator=g, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        mod = module(6, torch.float64)
        if fused:
            z = mod.states(h, r, allowed)
            out = mod.correct(h.reshape(B * K, N, D), 0, N, z.reshape(B * K, N, -1), masked.reshape(B * K, N, 1))
            out = out.view(B, K, N, D) - h
        else:
            out = unfused_states(mod, h, r, allowed) * masked[..., None]
        ((out - target) ** 2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in mod.named_parameters()})
    for name in grads[1]:
        assert grads[1][name].abs().max() > 0, name
        assert rel(grads[0][name], grads[1][name]) <= 1e-10, name


def test_correction_in_place_without_autograd_and_out_of_place_with_it():
    mod = module(7)
    h = torch.randn(2, 9, D)
    z = torch.randn(2, 4, M * DH)
    m = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)[..., None]
    expect = h.clone()
    expect[:, 3:7] += mod.output(z.unflatten(-1, (M, DH)), h).detach() * m
    with torch.no_grad():
        hh = h.clone()
        out = mod.correct(hh, 3, 7, z, m)
    assert out is hh and rel(out, expect) <= 1e-6  # added into h itself
    assert torch.equal(out[:, :3], h[:, :3]) and torch.equal(out[:, 7:], h[:, 7:])
    assert torch.equal(out[0, 4], h[0, 4])  # an unmasked position is untouched
    hh = h.clone()
    out = mod.correct(hh, 3, 7, z, m)
    assert out is not hh and torch.equal(hh, h) and rel(out, expect) <= 1e-6


def legacy_state(state: dict) -> dict:
    """The state dict an adapter of the unfused operator had: W_Q, W_K, W_V as separate tensors."""
    out = {}
    for key, t in state.items():
        if key.endswith("qkv.weight"):
            base = key[: -len("qkv.weight")]
            for name, part in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3), strict=True):
                out[f"{base}{name}.weight"] = part.clone()
        else:
            out[key] = t
    return out


def test_legacy_separate_projections_load(tmp_path):
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(history="full"))
    randomize_temporal(model, seed=3)
    # load_state_dict with the old keys (the pre-hook concatenates them)
    fresh = tdlm.TDLM(bb, tdlm.TemporalConfig(history="full"))
    fresh.temporal.load_state_dict(legacy_state(model.temporal.state_dict()))
    for name, t in model.temporal.state_dict().items():
        assert torch.equal(fresh.temporal.state_dict()[name], t), name
    mod = model.temporal[str(model.layer_ids[0])]
    d_t = mod.heads * mod.head_dim
    assert torch.equal(mod.k_proj.weight, mod.qkv.weight[d_t : 2 * d_t])  # rows [W_Q; W_K; W_V]
    # an adapter folder written before the fusion
    folder = model.save_adapter(tmp_path / "old")
    state = load_file(str(folder / ADAPTER_WEIGHTS))
    assert any(k.endswith("qkv.weight") for k in state)
    save_file(legacy_state(state), str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    assert any(k.endswith("q_proj.weight") for k in load_file(str(folder / ADAPTER_WEIGHTS)))
    loaded = tdlm.TDLM.from_adapter(bb, folder)
    x = sampled_states(bb, 5, 12, seed=0, B=1, K=3)
    with torch.no_grad():
        assert torch.equal(stepwise(loaded, x, 5), stepwise(model, x, 5))


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) != "aten.detach.default" and not str(func).startswith("prim."):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backbone_name", ["tiny-llada", "tiny-dream"])
def test_temporal_layer_dispatches_at_most_half_a_block(backbone_name):
    """Eager, step-wise with a history: a temporal layer after the first (which also builds the evaluation's
    RoPE tables) dispatches <= half the aten ops of a backbone block, with one SDPA and two matmuls."""
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history="full")).eval()
    randomize_temporal(model, seed=1)
    x = sampled_states(bb, 5, 12, seed=1, B=1, K=4)
    cache = model.new_cache(1)
    per_layer: dict[int, Counter] = {}
    orig = type(bb).layer

    def spy(self, index, h, ctx, insert=None):
        if insert is None:
            return orig(self, index, h, ctx, insert)
        h = self.blocks[index].attend(h, ctx)
        with OpCounter() as c:
            h = insert(index, h)
        per_layer[index] = c.ops
        return self.blocks[index].feed_forward(h)

    with torch.no_grad():
        for i in range(3):
            model.forward_step(x[:, i], 5, cache)
        ctx = bb.prepare(x[:, 3])
        with OpCounter() as block:
            bb.layer(1, *ctx, None)
        type(bb).layer = spy
        try:
            model.forward_step(x[:, 3], 5, cache)
        finally:
            type(bb).layer = orig
    layer = per_layer[model.layer_ids[-1]]
    assert sum(layer.values()) <= sum(block.ops.values()) / 2, (sum(layer.values()), sum(block.ops.values()), layer)
    assert sum(n for op, n in layer.items() if "scaled_dot_product" in op) == 1, layer
    assert sum(n for op, n in layer.items() if op.split(".")[1] in ("mm", "bmm", "baddbmm_", "addmm")) == 2, layer


def test_every_layers_bias_built_at_once_equals_each_layers_own():
    """``step_biases`` (once per evaluation, all temporal layers) is each layer's ``step_bias``, bit for bit and in
    layer order: b_l in the sink column, 0 where a slot is allowed, -inf where not."""
    g = torch.Generator().manual_seed(3)
    mods = [module(seed=s) for s in range(3)]
    with torch.no_grad():
        for k, mod in enumerate(mods):
            mod.sink.fill_(0.25 * (k + 1))
    allowed = torch.rand(2, 5, 1 + 4, generator=g) > 0.5
    allowed[..., 0] = True
    both = TemporalAttention.step_biases(mods, allowed)
    assert both.shape == (3, *allowed.shape)
    for k, mod in enumerate(mods):
        assert torch.equal(both[k], mod.step_bias(allowed))
        assert torch.equal(both[k][..., 0], torch.full(allowed.shape[:-1], 0.25 * (k + 1)))


def test_compiled_step_attention_equals_sdpa_and_the_reference():
    """The step's attention written out (inductor's form: one fused kernel) and SDPA (eager's) both equal the
    float64 Eq. 8-9 within 1e-5 relative, eager and compiled; a slot with -inf bias gets no weight, and a position
    with only the sink gets exactly z = 0."""
    from tdlm.temporal.attention import step_attention

    g = torch.Generator().manual_seed(4)
    P, C = 7, 5
    q, k, v = (torch.randn(P, M, 1 + (0 if i == 0 else C), DH, generator=g, dtype=torch.float64) for i in range(3))
    k[:, :, 0], v[:, :, 0] = 0, 0  # the sink's zero key and value in slot 0
    allowed = torch.rand(P, 1, 1, 1 + C, generator=g) > 0.4
    allowed[..., 0] = True
    allowed[3, ..., 1:] = False  # only the sink
    bias = torch.where(allowed, 0.0, float("-inf")).double()
    bias[..., 0] = 0.7  # b_l
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(DH) + bias
    expect = scores.softmax(-1) @ v  # float64 Eq. 8-9
    eager = step_attention(q.float(), k.float(), v.float(), bias.float())
    written = step_attention(q.float(), k.float(), v.float(), bias.float(), written_out=True)
    compiled = torch.compile(step_attention, backend="inductor", fullgraph=True)(q.float(), k.float(), v.float(),
                                                                               bias.float(), True)  # fmt: skip
    for out in (eager, written, compiled):
        assert rel(out.double(), expect) <= TOL
        assert torch.equal(out[3], torch.zeros_like(out[3]))
    # planted fault: a bias that forgets the -inf mask changes the result beyond the tolerance
    assert rel(step_attention(q.float(), k.float(), v.float(), bias.float().clamp(min=0.0)).double(), expect) > TOL
