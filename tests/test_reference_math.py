"""The temporal operator against an independent reference written from the paper's formulas.

Prop. 1 (model vs backbone) and Prop. 2 (parallel vs step-wise) compare two paths that share the
projections, the temporal RoPE, the score scale and the revealed count r, so an error in that shared
code moves both sides together. Here the expected logits are computed without any of tdlm's temporal
code: the reference reads only the raw weight tensors of each temporal module (W_Q, W_K, W_V, W_O,
the sink logit b_l; for ``latent:M`` the learned latents and the Perceiver weights) and evaluates

* Eq. 7:  q = R(r_i) W^Q_a h,  k_j = R(r_j) W^K_a h_j,  v_j = W^V_a h_j per head a (rows a*d_h..(a+1)*d_h),
          R(r) the 2x2 rotations by r * omega_u, omega_u = 10000^(-2u/d_h), u = 0..d_h/2-1, built as an
          explicit d_h x d_h matrix (pairs (u, u + d_h/2), the half-split layout of LLaDA / Qwen RoPE);
* Eq. 8:  e_j = q.k_j / sqrt(d_h),  Z = exp(b_l) + sum_j exp(e_j)  (one sink logit, zero value);
* Eq. 9:  z_a = sum_j exp(e_j) / Z v_j;
* Eq. 10: TempAttn = W^O concat_a z_a;
* Eq. 2:  h~ = h + m_{i,p} TempAttn, keys/values from h before the correction, history entries j with
          A_{p,i,j} = policy(i, j) m_{j,p};
* r_i = number of revealed response tokens of S_i (Section 2.2: sum_p (1 - m_{i,p})),

position by position and head by head in float64, one state after another, with h taken at the insertion
point through the backbone's public ``insert`` hook (after spatial attention, before the FFN). The model is
then run in both modes (``forward_states`` and ``forward_step`` with a cache) in fp32 and must match to
1e-5 of the logit scale.

The latent history (``latent:M``) reference is the documented design (tdlm/temporal/model.py,
tdlm/temporal/perceiver.py):
the query R(r_i) W_Q h attends to k = R(r_last) W_K u, v = W_V u of the position's M latents u plus the
zero-value sink (r_last = r of the input that last updated u, 0 for the learned initial latents), and then
u <- u + Perceiver(u, [h]) at masked positions, with the Perceiver block of the LDLM seed (001_*: clamped
RMSNorm of both streams, fused W_QKV / W_KV, per-head clamped RMSNorm of queries and keys, softcap
50 tanh(S / (50 sqrt(d_h))), softmax over latents and features, W_O), written out here again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import pytest
import torch

import tdlm
from tests.conftest import randomize_temporal, sampled_states, stepwise

P, N = 5, 12  # prompt length, response length (sampled_states draws trajectories of 12 steps)
ROPE_BASE = 10000.0  # App. B.1
TOL = 1e-5  # fp32 model vs float64 reference, relative to the largest logit


# ----------------------------------------------------------------------------------------------- reference
@functools.cache
def rotation(r: int, d_h: int) -> torch.Tensor:
    """R(r): (d_h, d_h) float64, rotating the pair (x_u, x_{u + d_h/2}) by the angle r * omega_u."""
    R = torch.zeros(d_h, d_h, dtype=torch.float64)
    half = d_h // 2
    for u in range(half):
        angle = r * ROPE_BASE ** (-2.0 * u / d_h)
        c, s = math.cos(angle), math.sin(angle)
        R[u, u], R[u, u + half] = c, -s
        R[u + half, u], R[u + half, u + half] = s, c
    return R


@dataclass
class Weights:
    """One temporal module's raw tensors in float64 (nothing of its forward code is used)."""

    heads: int
    head_dim: int
    Wq: torch.Tensor  # (d_t, d)
    Wk: torch.Tensor
    Wv: torch.Tensor
    Wo: torch.Tensor  # (d, d_t)
    b: float  # sink logit b_l
    latents: torch.Tensor | None = None  # (M, d) learned initial latents (latent:M only)
    perceiver: dict | None = None


def raw_weights(mod) -> Weights:
    f = lambda t: t.detach().to(torch.float64).clone()  # noqa: E731
    w = Weights(mod.heads, mod.head_dim, f(mod.q_proj.weight), f(mod.k_proj.weight), f(mod.v_proj.weight),
                f(mod.o_proj.weight), float(mod.sink.detach().reshape(())))  # fmt: skip
    memory = getattr(mod, "memory", None)
    if memory is not None:
        pc = memory.perceiver
        w.latents = f(memory.latents)
        w.perceiver = {
            "heads": pc.heads, "head_dim": pc.head_dim,
            "gamma_a": f(pc.norm_a.weight), "gamma_b": f(pc.norm_b.weight), "W_QKV": f(pc.qkv.weight),
            "W_KV": f(pc.kv.weight), "gamma_Q": f(pc.q_norm.weight), "gamma_K": f(pc.k_norm.weight),
            "W_O": f(pc.o_proj.weight),
        }  # fmt: skip
    return w


def temp_attn(w: Weights, h: torch.Tensor, r: int, keys: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Eq. 7-10 for one position: h (d,) at progress r attends to ``keys`` = [(x_j (d,), r_j)] + the sink.

    x_j is the vector the key/value is projected from (h_j for entry history, a latent for latent:M).
    """
    dh = w.head_dim
    z = []
    for a in range(w.heads):
        rows = slice(a * dh, (a + 1) * dh)
        q = rotation(r, dh) @ (w.Wq[rows] @ h)
        e = [float(q @ (rotation(rj, dh) @ (w.Wk[rows] @ xj))) / math.sqrt(dh) for xj, rj in keys]
        Z = math.exp(w.b) + sum(math.exp(x) for x in e)  # the sink's value vector is zero
        za = torch.zeros(dh, dtype=torch.float64)
        for x, (xj, _) in zip(e, keys, strict=True):
            za += math.exp(x) / Z * (w.Wv[rows] @ xj)
        z.append(za)
    return w.Wo @ torch.cat(z)


def perceiver(pw: dict, u: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """LDLM Perceiver attention (seed 001, its 22 steps): latents u (T, d) ask, [u; feats (S, d)] answer."""
    H, dh = pw["heads"], pw["head_dim"]
    da = H * dh

    def norm(x, gamma):  # gamma * x / max(||x||_2 / sqrt(dim), 1e-5), row by row
        out = torch.empty_like(x)
        for t in range(x.shape[0]):
            out[t] = gamma * x[t] / max(float(x[t].norm()) / math.sqrt(x.shape[1]), 1e-5)
        return out

    pa = norm(u, pw["gamma_a"]) @ pw["W_QKV"].T  # [q k^a v^a]
    pb = norm(feats, pw["gamma_b"]) @ pw["W_KV"].T  # [k^b v^b]
    q, k, v = pa[:, :da], torch.cat([pa[:, da : 2 * da], pb[:, :da]]), torch.cat([pa[:, 2 * da :], pb[:, da:]])
    o = torch.empty(u.shape[0], da, dtype=torch.float64)
    for a in range(H):
        cols = slice(a * dh, (a + 1) * dh)
        Q, K = norm(q[:, cols], pw["gamma_Q"]), norm(k[:, cols], pw["gamma_K"])
        F = 50.0 * torch.tanh((Q @ K.T) / (50.0 * math.sqrt(dh)))
        A = F.exp() / F.exp().sum(-1, keepdim=True)  # over all T + S positions
        o[:, cols] = A @ v[:, cols]
    return o @ pw["W_O"].T


def history_window(policy: str, i: int) -> list[int]:
    """J(i) before the m_{j,p} factor (Table 2)."""
    if policy == "full":
        return list(range(i))
    if policy.startswith("last:"):
        return list(range(max(0, i - int(policy.split(":")[1])), i))
    assert policy == "current"
    return [i]


@dataclass
class RowMemory:
    """What one request has accumulated, per temporal layer (entries for full/last/current, latents for latent:M)."""

    entries: dict[int, list]  # [(h (N, d), r_j, m_j (N,))] per evaluated state
    latents: dict[int, list]  # latent:M: u_p (M, d) per position
    r_last: dict[int, list]  # latent:M: r of the input that last updated u_p (0 for the learned initial latents)


def reference_insert(layer, h, *, weights, memory, policy, m, r, i, offset):
    """Eq. 2 at one temporal layer for state S_i (h: (1, L, d) after spatial attention, before the FFN)."""
    if layer not in weights:
        return h
    w = weights[layer]
    L = h.shape[1]
    hr = h[0, P - offset : L - offset].to(torch.float64)  # h_{l,p}(S_i) before this layer's correction
    latent = policy.startswith("latent:")
    new = h.clone()
    for p in range(N):
        if not m[p]:  # Eq. 2: only masked positions are corrected
            continue
        if latent:
            keys = [(u_j, memory.r_last[layer][p]) for u_j in memory.latents[layer][p]]
        elif policy == "current":
            keys = [(hr[p], r)]
        else:
            past = memory.entries[layer]
            keys = [(past[j][0][p], past[j][1]) for j in history_window(policy, i) if past[j][2][p]]  # m_{j,p}
        new[0, P - offset + p] = (hr[p] + temp_attn(w, hr[p], r, keys)).to(h.dtype)
    if latent:  # u_p <- u_p + Perceiver(u_p, [h_p]) at masked positions, after the read
        for p in range(N):
            if m[p]:
                u = memory.latents[layer][p]
                memory.latents[layer][p] = u + perceiver(w.perceiver, u, hr[p][None])
                memory.r_last[layer][p] = r
    else:
        memory.entries[layer].append((hr, r, m))
    return new


def reference_logits(model: tdlm.TDLM, x: torch.Tensor, policy: str, offset: int = 0) -> torch.Tensor:
    """(B, K, L, V) logits of TDLM for the states x (B, K, L), evaluated in order, row by row.

    ``offset``: response token p is represented by the hidden state at P + p - offset (0: the token's own
    position; 1: Dream's prediction-aligned mode, where h at p - 1 predicts token p).
    """
    bb = model.backbone
    B, K, L = x.shape
    weights = {int(k): raw_weights(m) for k, m in model.temporal.items()}
    latent = policy.startswith("latent:")
    out = []
    for b in range(B):
        memory = RowMemory(
            entries={layer: [] for layer in weights},
            latents={layer: [w.latents.clone() for _ in range(N)] if latent else [] for layer, w in weights.items()},
            r_last={layer: [0] * N for layer in weights},
        )
        rows = []
        for i in range(K):
            s = x[b, i]
            m = s[P:] == bb.mask_token_id  # m_{i,p}
            r = int((~m).sum())  # r_i: revealed response tokens of S_i
            insert = functools.partial(reference_insert, weights=weights, memory=memory, policy=policy, m=m, r=r,
                                       i=i, offset=offset)  # fmt: skip
            with torch.no_grad():
                rows.append(bb(s[None], insert=insert)[0])
        out.append(torch.stack(rows))
    return torch.stack(out)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.abs().max().clamp_min(1.0))


# ------------------------------------------------------------------------------------------------ tests
def test_reference_rotation_is_the_papers_rope():
    """R(r) is orthogonal, R(a)^T R(b) = R(b - a) (the score depends on r_j - r_i), angle r * 10000^(-2u/d_h)."""
    R3, R7 = rotation(3, 8), rotation(7, 8)
    assert torch.allclose(R3.T @ R3, torch.eye(8, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(R3.T @ R7, rotation(4, 8), atol=1e-12)
    assert R3[1, 1] == pytest.approx(math.cos(3 * 10000 ** (-2 / 8)))
    assert R3[5, 1] == pytest.approx(math.sin(3 * 10000 ** (-2 / 8)))


# Dream predicts token p from the hidden state at p - 1. Which of the two states of a masked token the
# temporal layers correct is the model's documented choice (the paper does not say): "prediction" (the
# state whose logits decide p; TemporalConfig's default) or "input" (the state at p). Both are pinned;
# for LLaDA (no shift) they coincide.
DREAM_SHIFT = 1


def build(name: str, alignment: str | None, **kw) -> tuple[tdlm.TDLM, int]:
    """TDLM on a tiny preset and the reference's offset for its (explicit or default) alignment."""
    bb = tdlm.load_backbone(name)
    fields = {f.name for f in dataclasses.fields(tdlm.TemporalConfig)}
    if alignment is not None:
        if "alignment" not in fields:
            pytest.skip("this TemporalConfig has no alignment option")
        kw["alignment"] = alignment
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(**kw))
    mode = getattr(model.config, "alignment", "input")
    assert mode in ("input", "prediction"), mode
    return model, (DREAM_SHIFT if bb.family == "dream" and mode == "prediction" else 0)


CASES = [
    # backbone, alignment (None = default), temporal layers, history, heads x head_dim, seed
    ("tiny-llada", None, [1], "full", (2, 16), 11),
    ("tiny-llada", None, [2], "full", (3, 8), 12),
    ("tiny-llada", None, [1], "last:2", (2, 16), 13),
    ("tiny-llada", None, [1], "current", (2, 16), 14),
    ("tiny-llada", None, [0, 3], "full", (2, 16), 15),
    ("tiny-dream", None, [1], "full", (2, 16), 16),
    ("tiny-dream", None, [2], "last:1", (2, 8), 17),
    ("tiny-dream", "input", [1], "full", (2, 16), 18),
    ("tiny-dream", "prediction", [1, 3], "current", (2, 16), 19),
]


@pytest.mark.parametrize("name, alignment, layers, history, dims, seed", CASES)
def test_temporal_layer_matches_the_paper_formulas(name, alignment, layers, history, dims, seed):
    """Eq. 2 and 7-10 against the model in both modes, several histories and revealed counts per row."""
    model, offset = build(name, alignment, layers=layers, heads=dims[0], head_dim=dims[1], history=history)
    bb = model.backbone
    randomize_temporal(model, seed=seed)
    x = sampled_states(bb, P, N, seed=seed, B=2, K=6)
    r = (x[..., P:] != bb.mask_token_id).sum(-1)
    assert len(set(r.flatten().tolist())) >= 6  # many revealed counts, and rows differ
    ref = reference_logits(model, x, history, offset)
    with torch.no_grad():
        par = model.forward_states(x, P)
        seq = stepwise(model, x, P)
        base = bb(x.reshape(-1, x.shape[-1])).view_as(par)
    assert _rel(par, ref) <= TOL, ("parallel", _rel(par, ref))
    assert _rel(seq, ref) <= TOL, ("step-wise", _rel(seq, ref))
    # not vacuous: the corrections move the logits far beyond the tolerance
    first = 0 if history == "current" else 1
    assert (ref[:, first:] - base[:, first:]).abs().max() > 1e-2


def test_reference_sees_each_ingredient():
    """The reference itself is sensitive to what the issue lists (score scale, r, sink): a sanity check that
    a model computing any of these differently could not match it by accident."""
    g = torch.Generator().manual_seed(0)
    d, M, dh = 16, 2, 8
    w = Weights(M, dh, *(torch.randn(M * dh, d, generator=g, dtype=torch.float64) for _ in range(3)),
                torch.randn(d, M * dh, generator=g, dtype=torch.float64), 0.3)  # fmt: skip
    h = torch.randn(d, generator=g, dtype=torch.float64)
    hist = [(torch.randn(d, generator=g, dtype=torch.float64), rj) for rj in (0, 2, 5)]
    out = temp_attn(w, h, 7, hist)
    assert not torch.allclose(out, temp_attn(w, h, 8, hist))  # r of the query
    assert not torch.allclose(out, temp_attn(w, h, 7, [(x, rj + 1) for x, rj in hist]))  # r of the keys
    # shifting every r by the same amount changes nothing (relative positions): R(a)^T R(b) = R(b - a)
    assert torch.allclose(out, temp_attn(w, h, 10, [(x, rj + 3) for x, rj in hist]))
    w2 = Weights(**{**w.__dict__, "b": 1.3})
    assert not torch.allclose(out, temp_attn(w2, h, 7, hist))
    assert torch.equal(temp_attn(w, h, 7, []), torch.zeros(d, dtype=torch.float64))  # empty history: zero


@pytest.mark.parametrize("name, alignment, M, seed", [("tiny-llada", None, 2, 21), ("tiny-dream", None, 3, 22),
                                                       ("tiny-dream", "input", 1, 23)])
def test_latent_history_matches_the_reference(name, alignment, M, seed):
    """latent:M: query against R(r_last)-rotated latent keys + sink, then the Perceiver update, in both modes."""
    model, offset = build(name, alignment, layers=[1, 2], heads=2, head_dim=8, history=f"latent:{M}")
    bb = model.backbone
    randomize_temporal(model, seed=seed)
    with torch.no_grad():  # non-trivial norm gains, so a swapped gamma would show
        g = torch.Generator().manual_seed(seed)
        for mod in model.temporal.values():
            for norm in (mod.memory.perceiver.norm_a, mod.memory.perceiver.norm_b,
                         mod.memory.perceiver.q_norm, mod.memory.perceiver.k_norm):  # fmt: skip
                norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    x = sampled_states(bb, P, N, seed=seed, B=2, K=5)
    ref = reference_logits(model, x, f"latent:{M}", offset)
    with torch.no_grad():
        par = model.forward_states(x, P)
        seq = stepwise(model, x, P)
        base = bb(x.reshape(-1, x.shape[-1])).view_as(par)
    assert _rel(par, ref) <= TOL, ("parallel", _rel(par, ref))
    assert _rel(seq, ref) <= TOL, ("step-wise", _rel(seq, ref))
    assert (ref[:, 1:] - base[:, 1:]).abs().max() > 1e-2
