"""Temporal attention (TDLM paper, Section 2.2 and Appendix B.1).

At a temporal layer l, a masked position p of the current input S_i queries the earlier
representations of the *same* position at the *same* layer:

* Eq. (7): q = R(r_i) W_Q h, k = R(r_j) W_K h_j, v = W_V h_j per head, bias-free, where R(r) is a
  temporal RoPE over the revealed-token count r with omega_u = 10000^(-2u/d_h);
* Eq. (8): e = q.k / sqrt(d_h), Z = exp(b_l) + sum_j exp(e_j), with one learned sink logit b_l per
  layer shared by the heads and a *zero* value vector;
* Eq. (9): z = sum_j exp(e_j)/Z v_j;
* Eq. (10): TempAttn = W_O concat_a z_a, W_O in R^{d x d_t}, zero-initialised (Prop. 1);
* Eq. (2): h~ = h + m_{i,p} TempAttn(...), applied only at currently masked positions.

Parameters per layer: 4 d d_t + 1 (the fused 3 d_t x d projection W_Q, W_K, W_V, one d x d_t, one sink logit).

How it is computed (:class:`TemporalAttention`): at batch 1 on a GPU an evaluation is bound by kernel launches,
so a layer issues few operations. One matmul gives [W_Q h; W_K h; W_V h]; one rotation applies R(r) to q and k
(and the identity to v); one ``scaled_dot_product_attention`` evaluates Eq. 8-9 over the history with the sink
as an extra key of zeros and value of zeros, whose score q.0 + b_l = b_l comes from an additive bias column (the
history validity A_{p,i,j} is the rest of that bias: 0 or -inf); W_O and Eq. 2 are one batched multiply-add
into h in place. Eq. 7-10 themselves are unchanged (tests/test_reference_math.py, tests/test_fused_attention.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tdlm.errors import TDLMError


def temporal_rope(x: torch.Tensor, r: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate x (..., M, d_h) by the revealed-token count r (...) (Eq. 7's R(r)).

    Half-split pairs (x_u, x_{u + d_h/2}) rotate by r * omega_u, omega_u = base^(-2u/d_h).
    """
    return rope_rotate(x, rope_tables(r[..., None], x.shape[-1], base, x.dtype))


def rope_tables(r: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of R(r) (Eq. 7) for revealed counts r: (*r.shape, d_h) each.

    ``cos`` repeats cos(r omega_u) over both halves; ``sin`` is -sin(r omega_u) on the first half and +sin on
    the second, so that :func:`rope_rotate` is x cos + swap_halves(x) sin. Angles are taken in float64 (r
    reaches a few hundred, omega_0 = 1) and rounded once to ``dtype``.
    """
    u = torch.arange(head_dim // 2, device=r.device, dtype=torch.float64)
    omega = base ** (-2.0 * u / head_dim)  # (d_h/2,)
    ang = r.to(torch.float64)[..., None] * omega  # (*r, d_h/2)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def rope_rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """R(r) x for x (..., d_h) and tables broadcastable to it (:func:`rope_tables`).

    x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin on the half-split pairs (u, u + d_h/2) of LLaDA / Qwen RoPE;
    rolling the last dim by d_h/2 swaps the halves, so the rotation is a product and a multiply-add.
    """
    cos, sin = tables
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def qkv_rope_tables(
    r: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables (*r.shape, 3, d_h) that rotate a fused [q; k; v] in one call: R(r) on q and k, identity on v
    (cos 1, sin 0: v * 1 + swap(v) * 0 is v exactly)."""
    cos, sin = rope_tables(r, head_dim, base, dtype)
    return torch.stack((cos, cos, torch.ones_like(cos)), -2), torch.stack((sin, sin, torch.zeros_like(sin)), -2)


def sink_softmax(scores: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention weights over history entries with a zero-value sink (Eq. 8-9).

    scores (..., H), allowed (..., H) bool, sink scalar logit b_l. Returns weights (..., H) whose sum
    is 1 - pi_sink; disallowed entries get exactly zero weight. Computed in float32 at least.
    (The unfused form of :func:`sink_attention`, kept for analyses that need the weights themselves.)
    """
    work = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(work).masked_fill(~allowed, float("-inf"))
    b = sink.to(work).expand(*s.shape[:-1], 1)
    w = torch.softmax(torch.cat([b, s], dim=-1), dim=-1)
    return w[..., 1:]


def sink_bias(allowed: torch.Tensor, sink: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask (..., 1 + H) for :func:`sink_attention`: b_l in the sink column, then log 1 = 0
    where an entry is allowed (A_{p,i,j} = 1, Section 2.3) and log 0 = -inf where not."""
    return torch.cat((sink.to(dtype).expand(*allowed.shape[:-1], 1), allowed.to(dtype).log()), -1)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Eq. 8-9 as one ``scaled_dot_product_attention``: z = sum_j exp(e_j) / Z v_j, Z = exp(b_l) + sum_j exp(e_j).

    q (*lead, M, Lq, d_h), k/v (*lead, M, H, d_h) (rotated, Eq. 7), ``bias`` (*lead, 1 | M, Lq, 1 + H) from
    :func:`sink_bias`; at least one lead dim. The sink is an extra key of zeros (score q.0 / sqrt(d_h) + b_l
    = b_l) with a zero value, prepended to the H entries: the softmax over the 1 + H scores is Eq. 8 and the
    zero value removes the sink's share from Eq. 9. A disallowed entry has weight exp(-inf) = 0, and the sink
    keeps every row finite (no empty softmax). Lead dims are flattened to the one batch dim that the fused
    CPU/GPU kernels take. Returns z (*lead, M, Lq, d_h).
    """
    lead = q.shape[:-3]
    k, v = F.pad(k, (0, 0, 1, 0)), F.pad(v, (0, 0, 1, 0))  # the sink's zero key and value in front
    if bias.shape[: len(lead)] != lead:
        bias = bias.expand(*lead, *bias.shape[len(lead) :])
    if len(lead) > 1:
        q, k, v, bias = (t.flatten(0, len(lead) - 1) for t in (q, k, v, bias))
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return z.unflatten(0, lead) if len(lead) > 1 else z


def step_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                   written_out: bool = False) -> torch.Tensor:  # fmt: skip
    """Eq. 8-9 for one query per position and head over that position's own slots: q (P, M, 1, d_h), keys /
    values (P, M, 1 + C, d_h) (the sink's zeros in slot 0), ``bias`` (P, 1, 1, 1 + C) -> z (P, M, 1, d_h).

    One ``scaled_dot_product_attention``, or with ``written_out`` the same softmax written out (q.k, + bias,
    softmax, weighted sum of values), which inductor fuses into one kernel that reads each key and value once:
    these are P M tiny problems of one query (P = batch x response positions, 5,600 at the demo's shape), where
    the fused SDPA kernel pays per problem (16 against 10 ms per layer at the demo's shape, CPU;
    ``docs/decoding.md``). The decoding loop's inductor step uses it (:func:`tdlm.decoding.compiled.compiled_steps`);
    eager and the debugging backends keep SDPA, so they decode eager's tokens bit for bit. The two agree to fp32
    rounding (``tests/test_fused_attention.py``), which can still flip a confidence that sits on the threshold."""
    if not written_out:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
    scores = (q * keys).sum(-1, keepdim=True) * (q.shape[-1] ** -0.5) + bias.transpose(-1, -2)  # (P, M, 1 + C, 1)
    return (scores.softmax(-2) * values).sum(-2, keepdim=True)


class _ProjectionView:
    """W^Q_l, W^K_l or W^V_l as rows of the fused projection, read like the ``nn.Linear`` it used to be."""

    def __init__(self, fused: nn.Linear, part: int, width: int) -> None:
        self.fused, self.rows = fused, slice(part * width, (part + 1) * width)

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.rows]

    @property
    def in_features(self) -> int:
        return self.fused.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


QKV_PARTS = ("q_proj", "k_proj", "v_proj")


def fuse_qkv_keys(state: dict) -> dict:
    """``state`` (an adapter's tensors) with every triple ``<m>.q_proj.weight``, ``<m>.k_proj.weight``,
    ``<m>.v_proj.weight`` of adapters written before the fused projection replaced by ``<m>.qkv.weight``
    (3 d_t x d, rows in Q, K, V order); other keys unchanged."""
    out = dict(state)
    for key in state:
        if not key.endswith(".q_proj.weight"):
            continue
        base = key[: -len("q_proj.weight")]
        parts = [f"{base}{p}.weight" for p in QKV_PARTS]
        if all(p in state for p in parts) and f"{base}qkv.weight" not in state:
            out[f"{base}qkv.weight"] = torch.cat([out.pop(p) for p in parts], 0)
    return out


class TemporalAttention(nn.Module):
    """One layer's temporal module: M heads of width d_h over a position's own history.

    Fused form of Eq. 7-10: one matmul projects Q, K and V (``qkv``, rows [W_Q; W_K; W_V], each head a's
    rows a*d_h..(a+1)*d_h of its block), one rotation applies R(r) to q and k together, and one
    ``scaled_dot_product_attention`` evaluates Eq. 8-9 with the sink as a zero key/value whose score is b_l
    (:func:`sink_attention`). ``q_proj`` / ``k_proj`` / ``v_proj`` read the three blocks; state dicts with
    the separate weights of earlier versions load (a load_state_dict pre-hook concatenates them).
    """

    def __init__(self, hidden_size: int, heads: int, head_dim: int, rope_base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise TDLMError(f"temporal head_dim must be even for temporal RoPE; got {head_dim}")
        self.heads, self.head_dim, self.rope_base = heads, head_dim, rope_base
        d_t = heads * head_dim
        self.qkv = nn.Linear(hidden_size, 3 * d_t, bias=False)  # [W^Q_l; W^K_l; W^V_l] (3 d_t x d)
        self.o_proj = nn.Linear(d_t, hidden_size, bias=False)  # W^O_l, zero at init
        self.sink = nn.Parameter(torch.zeros(1))  # b_l (1-D: ZeRO-3 cannot partition 0-d tensors)
        self.register_load_state_dict_pre_hook(_fuse_legacy_qkv)
        self.reset_parameters()

    @property
    def q_proj(self) -> _ProjectionView:
        return _ProjectionView(self.qkv, 0, self.heads * self.head_dim)

    @property
    def k_proj(self) -> _ProjectionView:
        return _ProjectionView(self.qkv, 1, self.heads * self.head_dim)

    @property
    def v_proj(self) -> _ProjectionView:
        return _ProjectionView(self.qkv, 2, self.heads * self.head_dim)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            d_t, std = self.heads * self.head_dim, 1.0 / math.sqrt(self.qkv.in_features)
            for part in range(3):  # one draw per block, in Q, K, V order (as three separate layers drew)
                nn.init.normal_(self.qkv.weight[part * d_t : (part + 1) * d_t], std=std)
            nn.init.zeros_(self.o_proj.weight)
            self.sink.zero_()

    # -- fused pieces --------------------------------------------------------------------------
    def rope(self, r: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`qkv_rope_tables` of this layer for counts r (...) -> (..., 3, d_h)."""
        return qkv_rope_tables(r, self.head_dim, self.rope_base, dtype or self.qkv.weight.dtype)

    def step_rope(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for :meth:`step` at counts r (b,): (b, 1, 3, 1, d_h). The same for every temporal layer of
        a model (one rope_base and d_h), so an evaluation computes them once."""
        return tuple(t[:, None, :, None] for t in self.rope(r))  # type: ignore[return-value]

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """[W_Q h; W_K h; W_V h] of h (..., d) in one matmul -> (..., 3, M, d_h), not rotated."""
        return self.qkv(h.to(self.qkv.weight.dtype)).unflatten(-1, (3, self.heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Eq. 8-9 (:func:`sink_attention`) with ``allowed`` (*lead, 1 | M, Lq, H) bool as the history mask."""
        return sink_attention(q, k, v, sink_bias(allowed, self.sink, q.dtype))

    def states(self, h: torch.Tensor, r: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Parallel mode: Eq. 7-9 for K states of a trajectory at once, keys from the same states.

        h (B, K, N, d) before the correction, r (B, K) revealed counts, ``allowed`` (B, N, K_i, K_j) bool
        (A_{p,i,j} = policy(i, j) m_{j,p}) -> z (B, K, N, d_t), the heads' outputs before W_O.
        """
        qkv = self.project_qkv(h).permute(0, 2, 3, 4, 1, 5)  # (B, N, 3, M, K, d_h)
        tables = tuple(t.transpose(1, 2)[:, None, :, None] for t in self.rope(r))  # (B, 1, 3, 1, K, d_h)
        x = rope_rotate(qkv, tables)  # q and k rotated by their state's r_i, in one call
        z = self.attend(x[:, :, 0], x[:, :, 1], x[:, :, 2], allowed[:, :, None])  # (B, N, M, K, d_h)
        return z.permute(0, 3, 1, 2, 4).flatten(-2)

    def step(
        self,
        h: torch.Tensor,
        r: torch.Tensor,
        history: tuple[torch.Tensor, torch.Tensor] | None,
        own: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        masked: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        written_out: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Step-wise mode: one evaluation's Eq. 7-9 over a temporal cache, and its own entry.

        h (b, N, d) before the correction, r (b,), ``history`` = (kv, allowed) in the attention's layout
        (:class:`tdlm.temporal.history.LayerHistory`): kv (b, N, 2, M, 1 + C, d_h) with keys at [:, :, 0], values
        at [:, :, 1] and the sink's zero key / value in slot 0, and ``allowed`` (b, N, 1 + C) bool, True where
        a slot may be attended (column 0, the sink, always True). None: nothing stored yet, only the sink, so
        the correction is exactly zero (Prop. 1). ``own`` (b, N) bool instead attends to this evaluation's own
        entry where True (history ``current``). ``rope``: :meth:`step_rope` of r, if already computed.
        ``masked`` (b, N, 1) = m_{i,p}: an unmasked query then sees the sink alone, so its z is exactly 0 and
        Eq. 2's mask needs no multiply after the attention (:meth:`correct` with ``masked=None``); the model
        folds m into ``allowed`` once per evaluation instead. ``bias``: this layer's additive mask (b, N, 1 + C),
        :meth:`step_bias` of ``allowed`` (with ``masked`` folded in), if the caller built it already (the model
        builds every temporal layer's at once per evaluation, :func:`step_biases`). ``written_out``: the
        attention's form for inductor (:func:`step_attention`).
        Returns (z (b, N, d_t) or None, kv (b, N, 2, M, d_h): this evaluation's rotated key and value).
        """
        x = rope_rotate(self.project_qkv(h), rope if rope is not None else self.step_rope(r))  # (b, N, 3, M, d_h)
        entry = x[:, :, 1:]  # (b, N, 2, M, d_h): [R(r) W_K h, W_V h]
        if own is not None:
            ones = torch.ones_like(own[..., None])
            history = F.pad(entry.unsqueeze(-2), (0, 0, 1, 0)), torch.cat((ones, own[..., None]), -1)
        if history is None:
            return None, entry
        kv, allowed = history
        b, N, M, dh = h.shape[0], h.shape[1], self.heads, self.head_dim
        if masked is not None:
            sink = torch.arange(allowed.shape[-1], device=allowed.device) == 0
            allowed = allowed & (masked | sink)
        q = x[:, :, 0].reshape(b * N, M, 1, dh)  # one query per position and head
        keys, values = kv[:, :, 0].flatten(0, 1), kv[:, :, 1].flatten(0, 1)  # views (b N, M, 1 + C, d_h)
        bias = self.step_bias(allowed) if bias is None else bias
        z = step_attention(q, keys, values, bias.view(b * N, 1, 1, -1), written_out)
        return z.view(b, N, M * dh), entry

    def step_bias(self, allowed: torch.Tensor) -> torch.Tensor:
        """Additive mask over the sink and C slots (..., 1 + C) from ``allowed``: b_l in the sink's column 0,
        log 1 = 0 where allowed and -inf where not (:func:`sink_bias` with the sink already in the layout)."""
        row = F.pad(self.sink.to(self.qkv.weight.dtype), (0, allowed.shape[-1] - 1))  # (1 + C,): b_l, 0, ..., 0
        return torch.where(allowed, row, float("-inf"))

    @staticmethod
    def step_biases(modules: Sequence[TemporalAttention], allowed: torch.Tensor) -> torch.Tensor:
        """:meth:`step_bias` of every module in ``modules`` at once, (len(modules), *allowed.shape): one stack of
        the sink logits and one ``where`` per evaluation instead of a pad and a ``where`` per layer (the same
        values, bit for bit)."""
        first = modules[0]
        sinks = torch.cat([m.sink for m in modules]).to(first.qkv.weight.dtype)  # (L_t,): b_l of each layer
        rows = F.pad(sinks[:, None], (0, allowed.shape[-1] - 1))  # (L_t, 1 + C): b_l, 0, ..., 0
        return torch.where(allowed, rows.view(len(modules), *([1] * (allowed.dim() - 1)), -1), float("-inf"))

    def latent(self, h: torch.Tensor, r: torch.Tensor, latents: torch.Tensor, r_latents: torch.Tensor) -> torch.Tensor:
        """``latent:M``: Eq. 7-9 of h (b, N, d) at counts r (b,) over each position's latents (b, N, M_lat, d),
        keys rotated by ``r_latents`` (broadcastable to (b, N, M_lat)), plus the sink; every latent allowed.
        Returns z (b, N, d_t)."""
        q = self.project_query(h, r[:, None])  # (b, N, M, d_h)
        k, v = self.project_key_value(latents, r_latents)  # (b, N, M_lat, M, d_h)
        every = torch.ones((), dtype=torch.bool, device=h.device).expand(*k.shape[:2], 1, 1, k.shape[2])
        z = self.attend(q.unsqueeze(-2), k.transpose(2, 3), v.transpose(2, 3), every)  # (b, N, M, 1, d_h)
        return z.flatten(-3)

    def correct(
        self, h: torch.Tensor, a: int, b: int, z: torch.Tensor, masked: torch.Tensor | None,
        part: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Eq. 10 and Eq. 2 at rows a..b of h (B, L, d): h~ = h + m W_O z, z (B, b - a, d_t), ``masked``
        (B, b - a, 1) = m_{i,p} (None: z is already 0 where m = 0); ``part`` = h[:, a:b] if the caller holds
        it. m W_O z = W_O (m z) exactly (m is 0 or 1).

        Without autograd the correction is added in place, one batched multiply-add into h (no copy of h);
        with autograd out of place, since the projections saved the slice of h they read.
        """
        w = self.o_proj.weight
        zm = z.to(w.dtype) if masked is None else z.to(w.dtype) * masked
        part = h[:, a:b] if part is None else part
        if torch.is_grad_enabled() or h.dtype != w.dtype:
            return h.slice_scatter(part + F.linear(zm, w).to(h.dtype), 1, a, b)
        part.baddbmm_(zm, w.t().expand(h.shape[0], -1, -1))
        return h

    def correct_at(self, h: torch.Tensor, a: int, b: int, z: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Eq. 10 and Eq. 2 for z (B, W, d_t) of the positions ``pos`` (B, W) of rows a..b of h (B, L, d):
        h~[:, a + pos] = h + W_O z. z is exactly 0 at a column whose position is not masked (its query saw the
        sink alone), so such columns, and columns repeating a position, add exact zeros. In place without
        autograd (one scatter-add into h), out of place with it."""
        w = self.o_proj.weight
        delta = F.linear(z.to(w.dtype), w).to(h.dtype)  # (B, W, d)
        index = pos[..., None].expand_as(delta)
        if torch.is_grad_enabled():
            return h.slice_scatter(h[:, a:b].scatter_add(1, index, delta), 1, a, b)
        h[:, a:b].scatter_add_(1, index, delta)
        return h

    def project(self, h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (..., d), r broadcastable to h.shape[:-1] -> q, k, v (..., M, d_h), q/k rotated (Eq. 7)."""
        tables = tuple(t[..., None, :] for t in self.rope(r.expand(h.shape[:-1])))  # (..., 3, 1, d_h)
        x = rope_rotate(self.project_qkv(h), tables)
        return x[..., 0, :, :], x[..., 1, :, :], x[..., 2, :, :]

    def project_query(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """q = R(r) W_Q h (..., M, d_h) alone (Eq. 7), for memories whose keys are not entries of h."""
        q = self.q_proj(h.to(self.qkv.weight.dtype)).unflatten(-1, (self.heads, self.head_dim))
        return temporal_rope(q, r.expand(h.shape[:-1]), self.rope_base)

    def project_key_value(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k = R(r) W_K x, v = W_V x (..., M, d_h) of memory vectors x (..., d) at progress r (one matmul)."""
        d_t = self.heads * self.head_dim
        kv = F.linear(x.to(self.qkv.weight.dtype), self.qkv.weight[d_t:])
        kv = kv.unflatten(-1, (2, self.heads, self.head_dim))
        return temporal_rope(kv[..., 0, :, :], r.expand(x.shape[:-1]), self.rope_base), kv[..., 1, :, :]

    def output(self, z: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """z (..., M, d_h) -> W_O concat_a z_a (..., d) (Eq. 10), in the dtype of ``like``."""
        out = self.o_proj(z.flatten(-2).to(self.o_proj.weight.dtype))
        return out.to(like.dtype)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, rope_base={self.rope_base}"


def _fuse_legacy_qkv(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: separate W_Q / W_K / W_V of an older state dict -> the fused ``qkv.weight``."""
    parts = [f"{prefix}{p}.weight" for p in QKV_PARTS]
    if all(p in state_dict for p in parts) and f"{prefix}qkv.weight" not in state_dict:
        state_dict[f"{prefix}qkv.weight"] = torch.cat([state_dict.pop(p) for p in parts], 0)


def temporal_parameter_count(hidden_size: int, num_layers: int, heads: int, head_dim: int) -> int:
    """L_t (4 d d_t + 1) (paper Section 2.4)."""
    return num_layers * (4 * hidden_size * heads * head_dim + 1)


_ALLOC = re.compile(r"^(dispersed|middle):(\d+)$")


def resolve_layers(spec: str | Sequence[int], num_layers: int, backbone: str = "backbone") -> list[int]:
    """Zero-based temporal layer indices from an allocation spec.

    * ``"all"``: every layer.
    * ``"middle:N"``: N consecutive layers centred in the stack, starting at (n - N) // 2
      (``middle:16`` of 32 = 8..23, as in Table 5; ``middle:14`` of 28 = 7..20).
    * ``"dispersed:N"``: the centre of each of N equal slices of the stack,
      ``floor((2k + 1) n / (2N))`` for k = 0..N-1 (16 of 32 = 1, 3, ..., 31; 8 of 32 = 2, 6, ..., 30).
      The paper does not publish its dispersed indices; this rule spreads layers evenly and never
      puts two in one slice.
    * an explicit list of indices (or a comma-separated string of them).
    """
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s == "all":
            return list(range(num_layers))
        m = _ALLOC.match(s)
        if m:
            kind, n = m.group(1), int(m.group(2))
            if not 1 <= n <= num_layers:
                raise TDLMError(
                    f"layer allocation {spec!r}: N must be in 1..{num_layers} for {backbone} "
                    f"with {num_layers} layers"
                )
            if kind == "middle":
                start = (num_layers - n) // 2
                return list(range(start, start + n))
            return [((2 * k + 1) * num_layers) // (2 * n) for k in range(n)]
        if re.fullmatch(r"\s*-?\d+(\s*,\s*-?\d+)*\s*", s):
            spec = [int(x) for x in s.split(",")]
        else:
            raise TDLMError(
                f"layer allocation {spec!r} not understood; expected 'all', 'dispersed:N', 'middle:N' "
                f"or a list of layer indices"
            )
    layers = [int(i) for i in spec]
    if not layers:
        raise TDLMError("layer allocation is empty; give at least one temporal layer")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise TDLMError(
            f"temporal layer(s) {bad} out of range for {backbone} with {num_layers} layers "
            f"(valid: 0..{num_layers - 1})"
        )
    if len(set(layers)) != len(layers):
        raise TDLMError(f"layer allocation {layers} lists a layer twice")
    return sorted(layers)
