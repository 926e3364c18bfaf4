"""LDLM Perceiver attention and the bounded-memory latent history (``history="latent:M"``).

Perceiver attention block, exactly as the LDLM atlas plate states it (seed
``001_a10e93c47a284272``: Meshchaninov et al., "LDLM", arXiv:2605.07933v1, encoder block
"Perceiver attention", pinned implementation e18c42a). Latents u (..., T, d) ask; the latents and the
features h (..., S, d) answer:

* stream norms  u_bar = gamma_a * u / max(||u||_2 / sqrt(d), eps),  h_bar likewise with gamma_b,
  eps = 1e-5;
* fused projections  [q k^a v^a] = u_bar W_QKV (d -> 3 d_attn),  [k^b v^b] = h_bar W_KV (d -> 2 d_attn),
  no biases;
* keys and values of both streams concatenated along positions: k = [k^a; k^b], v = [v^a; v^b];
* per-head norms  Q = gamma_Q * Q^h / max(||Q^h||_2 / sqrt(d_h), eps),  K likewise with gamma_K
  (gamma_Q, gamma_K of size d_h, shared by the heads);
* S = Q K^T,  softcap  F = 50 tanh(S / (50 sqrt(d_h))),  A = softmax over all T + S positions;
* O = A V, heads merged, Delta = o W_O (d_attn -> d). Nothing encodes position inside the block.

Parameters: 2 d + 3 d d_attn + 2 d d_attn + 2 d_h + d_attn d; at d = 768 with 12 heads of 64 that
is 3,540,608 per block (21,243,648 for LDLM's 6), the seed's count.

:class:`LatentMemory` uses the block as TDLM's bounded per-position history: each masked response
position keeps M latent vectors per temporal layer, initialised from M learned vectors and updated
after each evaluation by ``latents <- latents + Perceiver(latents, [h_{l,p}(S_i)])`` where
h_{l,p}(S_i) is the representation before the layer's temporal correction, the same vector full
history stores (TDLM paper, Eq. 2 and Eq. 7). Memory per position is M d per layer, independent of
the number of steps. How :class:`tdlm.TDLM` reads it is documented in ``tdlm/temporal/model.py``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tdlm.errors import TDLMError

SOFTCAP = 50.0  # LDLM's score cap: F = 50 tanh(S / (50 sqrt(d_h)))
NORM_EPS = 1e-5


def clamped_rms_normalize(x: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """x / max(||x||_2 / sqrt(d), eps) over the last axis, in float32 or wider.

    The seed's normaliser (a max with eps, not torch's sqrt(mean + eps)). The sum of squares is
    accumulated in float64 so that activations near the float32 range (1e30) do not overflow it;
    ||x||_2 / sqrt(d) is then at most max|x| and fits the working dtype again.
    """
    work = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(work)
    rms = torch.linalg.vector_norm(xf, dim=-1, keepdim=True, dtype=torch.float64) / math.sqrt(x.shape[-1])
    return xf / rms.to(work).clamp_min(eps)  # an all-zero row stays zero (0 / eps)


class ClampedRMSNorm(nn.Module):
    """gamma * x / max(||x||_2 / sqrt(d), eps) (seed: stream and per-head norms), gamma = 1 at init."""

    def __init__(self, dim: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = clamped_rms_normalize(x, self.eps)
        return (self.weight.to(y.dtype) * y).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def softcap(scores: torch.Tensor, head_dim: int, cap: float = SOFTCAP) -> torch.Tensor:
    """F = cap tanh(S / (cap sqrt(d_h))): ~S / sqrt(d_h) for small S, |F| <= cap always."""
    return cap * torch.tanh(scores / (cap * math.sqrt(head_dim)))


class PerceiverAttention(nn.Module):
    """LDLM Perceiver attention: ``forward(latents (..., T, d), features (..., S, d)) -> (..., T, d)``.

    Returns the attention update Delta only; the caller adds the residual. Module names follow the
    seed's symbols: ``norm_a`` (gamma_a), ``norm_b`` (gamma_b), ``qkv`` (W_QKV), ``kv`` (W_KV),
    ``q_norm`` (gamma_Q), ``k_norm`` (gamma_K), ``o_proj`` (W_O).
    """

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float = NORM_EPS, cap: float = SOFTCAP) -> None:
        super().__init__()
        if dim < 1 or heads < 1 or head_dim < 1:
            raise TDLMError(f"perceiver dims must be >= 1; got dim={dim}, heads={heads}, head_dim={head_dim}")
        self.dim, self.heads, self.head_dim, self.cap = dim, heads, head_dim, cap
        d_attn = heads * head_dim
        self.norm_a = ClampedRMSNorm(dim, eps)  # latent stream u
        self.norm_b = ClampedRMSNorm(dim, eps)  # feature stream h
        self.qkv = nn.Linear(dim, 3 * d_attn, bias=False)  # [q k^a v^a] = u_bar W_QKV
        self.kv = nn.Linear(dim, 2 * d_attn, bias=False)  # [k^b v^b] = h_bar W_KV
        self.q_norm = ClampedRMSNorm(head_dim, eps)
        self.k_norm = ClampedRMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(d_attn, dim, bias=False)  # W_O
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The seed states no initialisation. Inputs to every projection are unit-RMS after the norms,
        # so N(0, 1/fan_in) keeps q/k/v and the update Delta at unit RMS per coordinate.
        with torch.no_grad():
            for lin in (self.qkv, self.kv, self.o_proj):
                nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))
            for norm in (self.norm_a, self.norm_b, self.q_norm, self.k_norm):
                norm.weight.fill_(1.0)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))  # (..., T, H, d_h)

    def qkv_heads(
        self, latents: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normalised Q (..., T, H, d_h) and K, V (..., T + S, H, d_h) of the two joined streams."""
        if latents.shape[-1] != self.dim or features.shape[-1] != self.dim:
            raise TDLMError(
                f"perceiver of dim {self.dim} got latents {tuple(latents.shape)} and features {tuple(features.shape)}"
            )
        d_attn = self.heads * self.head_dim
        w = self.qkv.weight
        u_bar = self.norm_a(latents.to(w.dtype))
        h_bar = self.norm_b(features.to(w.dtype))
        q, k_a, v_a = self.qkv(u_bar).split(d_attn, dim=-1)
        k_b, v_b = self.kv(h_bar).split(d_attn, dim=-1)
        k = torch.cat([k_a, k_b], dim=-2)  # positions: T latents then S features
        v = torch.cat([v_a, v_b], dim=-2)
        return self.q_norm(self._heads(q)), self.k_norm(self._heads(k)), self._heads(v)

    def _capped(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        work = torch.promote_types(q.dtype, torch.float32)  # scores and softmax in float32 at least
        s = torch.einsum("...thd,...shd->...hts", q.to(work), k.to(work))  # S = Q K^T, (..., H, T, T + S)
        return softcap(s, self.head_dim, self.cap)

    def logits(self, latents: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Softcapped scores F (..., H, T, T + S) in float32 or wider."""
        q, k, _ = self.qkv_heads(latents, features)
        return self._capped(q, k)

    def forward(self, latents: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_heads(latents, features)
        a = torch.softmax(self._capped(q, k), dim=-1)  # over all positions of both streams
        o = torch.einsum("...hts,...shd->...thd", a.to(v.dtype), v)  # (..., T, H, d_h)
        return self.o_proj(o.flatten(-2)).to(latents.dtype)  # (..., T, d)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, softcap={self.cap}"


def perceiver_parameter_count(dim: int, heads: int, head_dim: int) -> int:
    """2 d + 3 d d_attn + 2 d d_attn + 2 d_h + d_attn d (seed's per-instance accounting)."""
    d_attn = heads * head_dim
    return 2 * dim + 3 * dim * d_attn + 2 * dim * d_attn + 2 * head_dim + d_attn * dim


class LatentMemory(nn.Module):
    """M learned initial latents (M, d) and the Perceiver block that folds each new entry into them."""

    def __init__(self, dim: int, num_latents: int, heads: int, head_dim: int) -> None:
        super().__init__()
        if num_latents < 1:
            raise TDLMError(f"latent memory needs num_latents >= 1; got {num_latents}")
        self.num_latents = num_latents
        self.latents = nn.Parameter(torch.empty(num_latents, dim))
        self.perceiver = PerceiverAttention(dim, heads, head_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Small initial latents (std 0.02, the usual learned-query init): the temporal keys/values
        # read from them on the first evaluation are near zero, so the first-step correction starts
        # near the cold-start value of full history (zero) even with a nonzero W_O.
        with torch.no_grad():
            nn.init.normal_(self.latents, std=0.02)
        self.perceiver.reset_parameters()

    def initial(self, *batch_shape: int) -> torch.Tensor:
        """The learned initial latents broadcast to (*batch_shape, M, d) (a view, no copy)."""
        return self.latents.expand(*batch_shape, *self.latents.shape)

    def update(self, latents: torch.Tensor, entry: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """latents (..., M, d) + Perceiver(latents, entry (..., d)) where ``alive`` (...) is True.

        Positions that are not alive (revealed: their history is dead) keep their latents unchanged.
        """
        delta = self.perceiver(latents, entry.unsqueeze(-2))  # features stream of one entry
        return torch.where(alive[..., None, None], latents + delta, latents)

    def extra_repr(self) -> str:
        return f"num_latents={self.num_latents}"
