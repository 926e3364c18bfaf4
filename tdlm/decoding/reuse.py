"""Training-free reuse of earlier evaluations: dInfer's credit decoding and soft iteration as decoding policies.

Both run on any backbone (the plain backbone; a :class:`tdlm.TDLM` passed in decodes with its own backbone), with
every cache mode, ``compile`` and batches, inside the one loop of :mod:`tdlm.decoding.loop`, which calls them only
when ``policy`` is ``credit`` or ``soft``. The definitions and defaults were read in inclusionAI/dInfer at commit
fce4e32 (2025-11-15); the code here is this repository's own.

**credit** (``python/dinfer/decoding/parallel_strategy.py``, ``CreditThresholdParallelDecoder._apply_credit_fusion``
and ``decode``; defaults ``credit_alpha=0.7``, ``boost_gamma=0.2``, ``decay_beta=0.8``). Each request keeps a credit
matrix C (block positions x vocabulary) for its active block, zero when the block starts. At every evaluation, with
z the block's logits and p the top-1 probability of z at a position with top-1 token v::

    C <- beta * C;   C[pos, v] += p ** gamma   (still-masked positions only)
    z' = z + alpha * log(C + 1)

and the commit rule then runs on z' (greedy token and its confidence are z''s). C is a decayed sum, an exponential
moving average up to the factor 1 / (1 - beta), of each position's top-1 probabilities across the evaluations of
its block. dInfer's commit rule is ``confidence >= min(max confidence - 1e-5, tau)``; here it is this repository's
Eq. 6 (strict ``> tau``, else the most confident), so that ``credit_alpha=0`` is ``threshold`` token for token.
The probabilities are float64, as the loop's confidences (dInfer: float32).

**soft** (soft iteration; ``python/dinfer/decoding/generate_uniform.py``, ``IterationSmooth.forward``, and the
embedding mix ``H2Embed.__call__`` in ``python/dinfer/model/modeling_llada2_moe.py``; defaults ``cont_weight=0.3``,
``cont_weight_init=0.15``, ``cont_weight_growth=0.02``, ``threshold_decay=0.02``, ``H2Embed`` temperature 1). The
input embedding of a still-masked position is the mask token's embedding plus the expected embedding under its last
computed prediction::

    e_p = E[mask] + w_i * softmax(z_p) @ E          w_i = min(init + growth * i, cap)

where z_p are the aligned logits of position p from the evaluation i (0-based, per request) that last computed p;
a revealed position gets E[token]; the first evaluation sees plain embeddings. ``IterationSmooth`` also warms the
threshold up: evaluation i commits with tau_i = max(1 - i * threshold_decay, tau). Here that is
``soft_threshold_decay``; 0 turns the warm-up off (tau from the first evaluation), which dInfer has no setting for:
its benchmark and serving code run the plain block loop, without the warm-up, when ``cont_weight`` is 0. So
``soft_weight=0, soft_threshold_decay=0`` is ``threshold`` token for token (the mixing path still runs, adding
zeros). The LM head of a ``soft`` evaluation runs on every response position it computes, not only the block.

*Which positions an evaluation updates*, as in ``IterationSmooth``'s three branches: without a cache and at a
refresh, every response position; at a ``prefix`` window step, every position from the block on (all of a row's
masked positions); at a ``dual`` window step, the block only, so a masked position after the block keeps the
prediction of the block's refresh until the next refresh, and the cached keys / values outside the window are
the refresh's, computed from the inputs as they were then (dInfer's dual branch does the same). Each mode is
therefore dInfer's semantics of that mode; none is refused.
"""

from __future__ import annotations

import math

import torch

from tdlm.errors import TDLMError

REUSE_POLICIES = ("credit", "soft")
# dInfer's defaults (the module docstring says where each is defined)
CREDIT_DEFAULTS = {"credit_alpha": 0.7, "credit_decay": 0.8, "credit_gamma": 0.2}
SOFT_DEFAULTS = {"soft_weight": 0.3, "soft_weight_init": 0.15, "soft_weight_growth": 0.02,
                 "soft_threshold_decay": 0.02}  # fmt: skip
REUSE_DEFAULTS = {**CREDIT_DEFAULTS, **SOFT_DEFAULTS}
# field -> (lowest, highest or None, what it is), for the one-line errors
_RANGES = {
    "credit_alpha": (0.0, None, "the credit's weight alpha"),
    "credit_decay": (0.0, 1.0, "the credit's decay beta per evaluation"),
    "credit_gamma": (0.0, None, "the exponent gamma of the top-1 probability"),
    "soft_weight": (0.0, None, "the cap of the soft-iteration weight"),
    "soft_weight_init": (0.0, None, "the soft-iteration weight after the first evaluation"),
    "soft_weight_growth": (0.0, None, "the soft-iteration weight's growth per evaluation"),
    "soft_threshold_decay": (0.0, 1.0, "the threshold warm-up's decay per evaluation (0: off)"),
}


def check_reuse_fields(cfg) -> None:
    """One-line errors for the credit / soft fields of a :class:`~tdlm.decoding.DecodeConfig` (checked whatever the
    policy, so that a bad value in a config file is refused before a long run uses it)."""
    for name, (lo, hi, what) in _RANGES.items():
        v = getattr(cfg, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo
        if not ok or (hi is not None and v > hi):
            want = f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g} and finite"
            raise TDLMError(f"decode {name} ({what}) must be {want}; got {v!r}")


def settings_of(policy: str) -> tuple[str, ...]:
    """The DecodeConfig fields that ``policy`` reads beyond the common ones (part of its run identity)."""
    if policy == "credit":
        return tuple(CREDIT_DEFAULTS)
    if policy == "soft":
        return tuple(SOFT_DEFAULTS)
    return ()


def reuse_for(cfg, backbone, batch: int, gen_length: int, device: torch.device) -> Credit | Soft | None:
    """The per-decode state of ``cfg.policy`` (None for the policies without one)."""
    if cfg.policy == "credit":
        return Credit(cfg, batch, device)
    if cfg.policy == "soft":
        return Soft(cfg, backbone, batch, gen_length, device)
    return None


class Credit:
    """Credit matrices (b, block, V) of the active rows and the block each one belongs to."""

    feeds_inputs = False

    def __init__(self, cfg, batch: int, device: torch.device) -> None:
        self.alpha, self.decay, self.gamma = cfg.credit_alpha, cfg.credit_decay, cfg.credit_gamma
        self.credit: torch.Tensor | None = None  # float32 as dInfer's, allocated at the first evaluation (V known)
        self.block = torch.full((batch,), -1, dtype=torch.long, device=device)

    def logits(self, logits: torch.Tensor, cand: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """The fused block logits z + alpha log(C + 1) in float64, C updated with this evaluation (``cand``: the
        still-masked positions of the block, ``block``: each row's active block)."""
        z = logits.double()
        if self.credit is None:
            self.credit = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        top_p, top = torch.softmax(z, dim=-1).max(-1)  # (b, bs): the unfused top-1 probability and token
        # decay; a row that moved to another block starts from zero (dInfer keeps one matrix per block)
        keep = torch.where(block == self.block, self.decay, 0.0).to(torch.float32)
        self.block = block
        self.credit.mul_(keep[:, None, None])
        self.credit.scatter_add_(2, top[..., None], (top_p.pow(self.gamma) * cand).to(torch.float32)[..., None])
        return z + self.alpha * torch.log1p(self.credit.double())

    def threshold(self, evals: torch.Tensor) -> None:
        return None

    def select(self, keep: torch.Tensor) -> None:
        self.block = self.block[keep]
        if self.credit is not None:
            self.credit = self.credit[keep]

    def extend(self, n: int) -> None:
        """``n`` new rows at the end (the engine's refill, dynamic storage): no block yet, so their first evaluation
        starts their credit from zero."""
        self.block = torch.cat([self.block, self.block.new_full((n,), -1)])
        if self.credit is not None:
            self.credit = torch.cat([self.credit, self.credit.new_zeros((n, *self.credit.shape[1:]))])

    def reset(self, rows: torch.Tensor) -> None:
        """New requests in the freed rows ``rows`` (written in place, either plan): their credit starts from zero."""
        self.block[rows] = -1


class Soft:
    """Each active row's prediction embeddings w_i softmax(z_p) @ E (b, G, d) of its response positions."""

    feeds_inputs = True

    def __init__(self, cfg, backbone, batch: int, gen_length: int, device: torch.device) -> None:
        self.cap, self.init, self.growth = cfg.soft_weight, cfg.soft_weight_init, cfg.soft_weight_growth
        self.tau, self.decay = cfg.threshold, cfg.soft_threshold_decay
        self.table = backbone.embedding_weight()  # (V, d)
        self.mixed = torch.zeros((batch, gen_length, self.table.shape[1]), dtype=self.table.dtype, device=device)

    def evaluate(self, step, backbone, x: torch.Tensor, attention_mask: torch.Tensor | None, groups: list,
                 prompt_len: int, start: torch.Tensor, block_size: int, evals: torch.Tensor) -> list[torch.Tensor]:
        """One evaluation of every group (rows, KV step) of the loop with the mixed input embeddings; returns each
        group's block logits (b_g, block, V) and keeps the predictions of every position it computed.

        ``step(backbone, x, attention_mask, positions, kv, embeds)`` is the loop's (possibly compiled) backbone
        step; ``start``: each row's block start in the response, ``evals``: each row's evaluations before this."""
        P, G = prompt_len, self.mixed.shape[1]
        mask_id, shift = backbone.mask_token_id, backbone.logit_shift
        outs = []
        for rows, kv in groups:
            xg = x if rows is None else x[rows]
            ag = attention_mask if attention_mask is None or rows is None else attention_mask[rows]
            mixed = self.mixed if rows is None else self.mixed[rows]
            emb = backbone.embed(xg)
            resp = emb[:, P:] + torch.where((xg[:, P:] == mask_id)[..., None], mixed, 0.0)
            emb = torch.cat((emb[:, :P], resp), dim=1)
            # the response positions whose aligned logits this forward computes: all of them without a cache and at
            # a refresh; a window's from its first predicted position on (KVStep.window: start - shift, width + shift)
            if kv is None or kv.refresh:
                first, width = torch.zeros_like(xg[:, 0]), G
            else:
                first, width = kv.start + shift - P, kv.width - shift
            pos = first[:, None] + torch.arange(width, device=x.device)  # (b_g, S)
            logits = step(backbone, xg, ag, P + pos, kv, emb)  # (b_g, S, V)
            if logits.shape[-1] != self.table.shape[0]:
                raise TDLMError(f"soft iteration needs logits over the input embedding's rows; the backbone gives "
                                f"{logits.shape[-1]} logits for {self.table.shape[0]} embeddings")  # fmt: skip
            w = (self.init + self.growth * (evals if rows is None else evals[rows]).float()).clamp(max=self.cap)
            pred = torch.softmax(logits.float(), dim=-1).to(self.table.dtype) @ self.table  # (b_g, S, d)
            r = torch.arange(xg.shape[0], device=x.device) if rows is None else rows
            self.mixed[r[:, None], pos] = (w[:, None, None] * pred.float()).to(self.mixed.dtype)
            sg = start if rows is None else start[rows]
            at = (sg - first)[:, None] + torch.arange(block_size, device=x.device)  # the block within the S
            outs.append(logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])))
        return outs

    def logits(self, logits: torch.Tensor, cand: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        return logits.double()

    def threshold(self, evals: torch.Tensor) -> torch.Tensor | None:
        """(b, 1) tau_i = max(1 - i * decay, tau) of the warm-up, or None (tau) when it is off."""
        if self.decay == 0:
            return None
        return (1.0 - evals.double() * self.decay).clamp(min=self.tau)[:, None]

    def select(self, keep: torch.Tensor) -> None:
        self.mixed = self.mixed[keep]

    def extend(self, n: int) -> None:
        """``n`` new rows at the end (the engine's refill, dynamic storage): plain embeddings at their first
        evaluation."""
        self.mixed = torch.cat([self.mixed, self.mixed.new_zeros((n, *self.mixed.shape[1:]))])

    def reset(self, rows: torch.Tensor) -> None:
        """New requests in the freed rows ``rows`` (written in place, either plan): no prediction mixed in yet."""
        self.mixed[rows] = 0
