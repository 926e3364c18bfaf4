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

Parameters per layer: 4 d d_t + 1 (three d_t x d projections, one d x d_t, one sink logit).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
from torch import nn

from tdlm.errors import TDLMError


def temporal_rope(x: torch.Tensor, r: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate x (..., M, d_h) by the revealed-token count r (...) (Eq. 7's R(r)).

    Half-split pairs (x_u, x_{u + d_h/2}) rotate by r * omega_u, omega_u = base^(-2u/d_h).
    """
    d_h = x.shape[-1]
    u = torch.arange(d_h // 2, device=x.device, dtype=torch.float64)
    omega = base ** (-2.0 * u / d_h)  # (d_h/2,)
    ang = r.to(torch.float64)[..., None, None] * omega  # (..., 1, d_h/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d_h // 2], x[..., d_h // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def sink_softmax(scores: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention weights over history entries with a zero-value sink (Eq. 8-9).

    scores (..., H), allowed (..., H) bool, sink scalar logit b_l. Returns weights (..., H) whose sum
    is 1 - pi_sink; disallowed entries get exactly zero weight. Computed in float32 at least.
    """
    work = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(work).masked_fill(~allowed, float("-inf"))
    b = sink.to(work).expand(*s.shape[:-1], 1)
    w = torch.softmax(torch.cat([b, s], dim=-1), dim=-1)
    return w[..., 1:]


class TemporalAttention(nn.Module):
    """One layer's temporal module: M heads of width d_h over a position's own history."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, rope_base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise TDLMError(f"temporal head_dim must be even for temporal RoPE; got {head_dim}")
        self.heads, self.head_dim, self.rope_base = heads, head_dim, rope_base
        d_t = heads * head_dim
        # Rows a*d_h:(a+1)*d_h of each weight are head a's W^Q_{l,a} / W^K_{l,a} / W^V_{l,a} (d_h x d).
        self.q_proj = nn.Linear(hidden_size, d_t, bias=False)
        self.k_proj = nn.Linear(hidden_size, d_t, bias=False)
        self.v_proj = nn.Linear(hidden_size, d_t, bias=False)
        self.o_proj = nn.Linear(d_t, hidden_size, bias=False)  # W^O_l, zero at init
        self.sink = nn.Parameter(torch.zeros(1))  # b_l (1-D: ZeRO-3 cannot partition 0-d tensors)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for lin in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))
            nn.init.zeros_(self.o_proj.weight)
            self.sink.zero_()

    def project(self, h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (..., d), r broadcastable to h.shape[:-1] -> q, k, v (..., M, d_h), q/k rotated (Eq. 7)."""
        shape = (*h.shape[:-1], self.heads, self.head_dim)
        # One contiguous copy of the (strided) response slice, shared by the three projections: otherwise
        # autograd saves a separate copy for each of W_Q, W_K, W_V.
        x = h.to(self.q_proj.weight.dtype).contiguous()
        q = self.q_proj(x).view(shape)
        k = self.k_proj(x).view(shape)
        v = self.v_proj(x).view(shape)
        r = r.expand(h.shape[:-1])
        return temporal_rope(q, r, self.rope_base), temporal_rope(k, r, self.rope_base), v

    def project_query(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """q = R(r) W_Q h (..., M, d_h) alone (Eq. 7), for memories whose keys are not entries of h."""
        q = self.q_proj(h.to(self.q_proj.weight.dtype)).unflatten(-1, (self.heads, self.head_dim))
        return temporal_rope(q, r.expand(h.shape[:-1]), self.rope_base)

    def project_key_value(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k = R(r) W_K x, v = W_V x (..., M, d_h) of memory vectors x (..., d) at progress r."""
        x = x.to(self.k_proj.weight.dtype)
        k = self.k_proj(x).unflatten(-1, (self.heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.heads, self.head_dim))
        return temporal_rope(k, r.expand(x.shape[:-1]), self.rope_base), v

    def output(self, z: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """z (..., M, d_h) -> W_O concat_a z_a (..., d) (Eq. 10), in the dtype of ``like``."""
        out = self.o_proj(z.flatten(-2).to(self.o_proj.weight.dtype))
        return out.to(like.dtype)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, rope_base={self.rope_base}"


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
