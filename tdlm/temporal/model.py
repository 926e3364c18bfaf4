"""TDLM: a frozen masked-diffusion backbone with temporal attention at selected layers.

Two evaluation modes compute the same function (Prop. 2):

* **parallel** over K sampled states of one trajectory, ``forward_states(input_ids (B, K, L))``:
  spatial attention runs on each state independently; at a temporal layer the causal mask
  A_{p,i,j} = 1[j < i] m_{j,p} (Section 2.3, restricted further by the history policy) lets S_i
  retrieve from earlier sampled states. Keys/values come from h *before* the layer's correction, so
  all states are evaluated together layer by layer. Used for training (Eq. 5).
* **step-wise** with a cache, ``forward_step(input_ids (B, L), prompt_len, cache)``: one denoiser
  evaluation during decoding, retrieving earlier entries and appending its own (Section 2.4).

With every W_O = 0 both modes equal the backbone bit for bit (Prop. 1).

**Bounded-memory history** ``latent:M`` (``tdlm/temporal/perceiver.py``): each temporal layer owns M learned
initial latents (M, d) and an LDLM Perceiver block. A masked position's query q = R(r_i) W_Q h (Eq. 7)
attends, with the zero-value sink (Eq. 8-9), to k = R(r_last) W_K u, v = W_V u of its M latents u
instead of the full history; then the latents absorb the current pre-correction entry,
u <- u + Perceiver(u, [h_{l,p}(S_i)]). Choices:

* RoPE on latent keys: rotated by r_last, the revealed count of the input whose entry last updated
  them (0 for the learned initial latents). The score then depends on r_i - r_last, the tokens
  revealed since the summary was refreshed, as the newest full-history key's does; latents fold in
  many entries, so no single older r is theirs.
* The query reads the latents *before* they absorb S_i, so, as in full history, S_i's own entry is
  not retrieved by S_i.
* The policy is recurrent, so ``forward_states`` evaluates the K states in order through
  :meth:`TDLM.forward_step` with a fresh cache, stacking logits; it equals step-wise decoding
  exactly, and gradients flow through the latent updates (nothing is detached).
* It is not history-only: on the first evaluation the query already sees the learned initial
  latents, so Prop. 1's cold-start half does not apply (nonzero W_O may correct S_0). A zero W_O
  still gives the backbone bit for bit in both modes.
* Perceiver weights exist only for adapters built with ``latent:M``; switching between latent and
  entry-based policies (or to another M) raises :class:`TDLMError`.

Masked positions m_{i,p} are the response positions p >= prompt_len holding the mask token; r_i is
the number of revealed response tokens. Batches are left-padded (prompts of different lengths end at
the same index ``prompt_len``), so the response region is the same slice for every row.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from tdlm.errors import TDLMError
from tdlm.models.common import Backbone, ForwardContext
from tdlm.models.kv_cache import KVStep
from tdlm.temporal.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_FORMAT_VERSION,
    ADAPTER_WEIGHTS,
    adapter_config_path,
    resolve_adapter,
)
from tdlm.temporal.attention import (
    TemporalAttention,
    fuse_qkv_keys,
    resolve_layers,
    temporal_parameter_count,
)
from tdlm.temporal.history import HistoryPolicy, LatentCache, TemporalCache
from tdlm.temporal.perceiver import NORM_EPS, SOFTCAP, LatentMemory, perceiver_parameter_count

ALIGNMENTS = ("prediction", "input")


@dataclass
class TemporalConfig:
    """Temporal module settings; ``None`` takes the backbone's default (paper Section 3.1)."""

    layers: str | list[int] | None = None  # "dispersed:N" | "middle:N" | "all" | [indices]
    heads: int | None = None  # M
    head_dim: int | None = None  # d_h; d_t = M * d_h
    history: str = "full"  # "full" | "last:k" | "current" | "latent:M"
    rope_base: float = 10000.0  # temporal RoPE base (Eq. 7)
    # Perceiver block of latent:M only (tdlm/temporal/perceiver.py); None = the temporal heads x head_dim, so
    # d_attn = d_t (LDLM's d_attn = d would be ~100M parameters per layer at d = 4096).
    perceiver_heads: int | None = None
    perceiver_head_dim: int | None = None
    # Which hidden state of a masked token p is corrected and keeps history, for backbones with a logit
    # shift (Dream predicts p from h at p - 1): "prediction" (default) = the one whose logits decide p;
    # "input" = the one at p itself. The paper does not say; both equal for LLaDA (no shift).
    alignment: str = "prediction"

    def resolved(self, backbone: Backbone) -> TemporalConfig:
        d = backbone.default_temporal()
        layers = self.layers if self.layers is not None else d["layers"]
        policy = HistoryPolicy.parse(self.history)
        out = dataclasses.replace(
            self,
            layers=resolve_layers(layers, backbone.num_layers, backbone.backbone_id or backbone.family),
            heads=self.heads if self.heads is not None else d["heads"],
            head_dim=self.head_dim if self.head_dim is not None else d["head_dim"],
            history=str(policy),
        )
        if out.heads < 1 or out.head_dim < 2:
            raise TDLMError(f"temporal heads must be >= 1 and head_dim >= 2; got {out.heads} x {out.head_dim}")
        if out.head_dim % 2:
            raise TDLMError(f"temporal head_dim must be even (RoPE rotates pairs); got {out.head_dim}")
        if out.alignment not in ALIGNMENTS:
            raise TDLMError(f"temporal alignment must be one of {', '.join(ALIGNMENTS)}; got {out.alignment!r}")
        if not policy.recurrent:
            if (self.perceiver_heads, self.perceiver_head_dim) != (None, None):
                raise TDLMError(f"perceiver_heads/perceiver_head_dim apply to history 'latent:M' only; got {policy}")
            return out
        out.perceiver_heads = out.perceiver_heads if out.perceiver_heads is not None else out.heads
        out.perceiver_head_dim = out.perceiver_head_dim if out.perceiver_head_dim is not None else out.head_dim
        if out.perceiver_heads < 1 or out.perceiver_head_dim < 1:
            raise TDLMError(
                f"perceiver heads and head_dim must be >= 1; got {out.perceiver_heads} x {out.perceiver_head_dim}"
            )
        return out


@dataclass
class StepGroup:
    """Rows of one step-wise evaluation that one forward computes (see :meth:`TDLM.forward_groups`)."""

    input_ids: torch.Tensor  # (b, L)
    attention_mask: torch.Tensor | None = None
    select: torch.Tensor | None = None  # (b, L) bool: return only these positions' logits
    kv: KVStep | None = None  # spatial KV cache use (refresh or window step)
    rows: torch.Tensor | None = None  # indices of these rows in the cache's batch; None = all, in order


def _merge_rows(parts: list[tuple[torch.Tensor | None, torch.Tensor]], B: int) -> torch.Tensor:
    """Tensors (b_g, ...) of row groups -> (B, ...); a single group of all rows is returned as is."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    first = parts[0][1]
    out = first.new_empty((B, *first.shape[1:]))
    for rows, t in parts:
        out[rows] = t
    return out


def _history_rows(t: torch.Tensor, rows: torch.Tensor | None, j: torch.Tensor | None) -> torch.Tensor:
    """History t (B, N, ...) of ``rows`` (None: all) at response positions ``j`` (b, W) (None: all N); the whole
    storage itself (no copy) when both are None."""
    if j is None:
        return t if rows is None else t[rows]
    ri = torch.arange(j.shape[0], device=j.device) if rows is None else rows
    return t[ri[:, None], j]  # (b, W, ...)


def _merge_entries(parts: list, B: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This evaluation's entry of one layer, (B, n, 2, M, dh) keys/values and (B, n) validity by storage column,
    from the groups' parts (rows, target, kv, valid): ``target`` (b, w) the storage column of each of the part's
    entries (N, the cache's width: none), or None for columns 0.. in order. One part of all rows in order is
    returned as is, so n < N after a window step over the cache's front; otherwise n = N, and columns no part
    computed stay invalid (zero keys/values)."""
    if len(parts) == 1 and parts[0][0] is None and parts[0][1] is None:
        return parts[0][2], parts[0][3]
    k0 = parts[0][2]
    KV = k0.new_zeros((B, N + 1, *k0.shape[2:]))  # column N: where window rows outside the response land
    valid = torch.zeros((B, N + 1), dtype=torch.bool, device=k0.device)
    for rows, target, kv, m in parts:
        ri = (torch.arange(kv.shape[0], device=kv.device) if rows is None else rows)[:, None]
        cols = torch.arange(kv.shape[1], device=kv.device)[None] if target is None else target
        KV[ri, cols], valid[ri, cols] = kv, m
    return KV[:, :N], valid[:, :N]


class TDLM(nn.Module):
    """Frozen backbone + temporal modules; only the temporal modules are trainable."""

    def __init__(self, backbone: Backbone, config: TemporalConfig | None = None) -> None:
        super().__init__()
        self.backbone = backbone.freeze()
        self.config = (config or TemporalConfig()).resolved(backbone)
        self.policy = HistoryPolicy.parse(self.config.history)
        self.layer_ids: list[int] = list(self.config.layers)  # type: ignore[arg-type]
        # The temporal slice of h starts `offset` positions before the response: h at p - offset
        # stands for response token p (its logits predict p under the backbone's shift).
        self.offset = backbone.logit_shift if self.config.alignment == "prediction" else 0
        param = next(backbone.parameters())
        self.temporal = nn.ModuleDict(
            {
                str(i): TemporalAttention(
                    backbone.hidden_size, self.config.heads, self.config.head_dim, self.config.rope_base
                )
                for i in self.layer_ids
            }
        )
        if self.policy.recurrent:
            # The latent memory is part of each temporal layer, so it trains, counts and saves with it.
            for mod in self.temporal.values():
                mod.add_module(
                    "memory",
                    LatentMemory(
                        backbone.hidden_size,
                        self.policy.num_latents,
                        self.config.perceiver_heads,
                        self.config.perceiver_head_dim,
                    ),
                )
        self.temporal.to(device=param.device, dtype=param.dtype if param.dtype.is_floating_point else torch.float32)
        self.activation_checkpointing = False

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def mask_token_id(self) -> int:
        return self.backbone.mask_token_id

    def train(self, mode: bool = True) -> TDLM:
        super().train(mode)
        self.backbone.eval()  # the backbone is frozen; it never enters training mode
        return self

    def num_temporal_parameters(self) -> int:
        return sum(p.numel() for p in self.temporal.parameters())

    def expected_temporal_parameters(self) -> int:
        """L_t (4 d d_t + 1) (Section 2.4), plus L_t (M d + Perceiver) for latent:M."""
        d, n = self.backbone.hidden_size, len(self.layer_ids)
        total = temporal_parameter_count(d, n, self.config.heads, self.config.head_dim)
        if self.num_latents:
            per = self.num_latents * d + perceiver_parameter_count(
                d, self.config.perceiver_heads, self.config.perceiver_head_dim
            )
            total += n * per
        return total

    @property
    def num_latents(self) -> int:
        """M of the latent memory the temporal layers carry (0: entry-based history, no perceiver)."""
        memory = getattr(self.temporal[str(self.layer_ids[0])], "memory", None)
        return memory.num_latents if isinstance(memory, LatentMemory) else 0

    def set_history(self, history: str | HistoryPolicy) -> None:
        """Change the inference-time history restriction (Table 2) of a fixed checkpoint."""
        policy = HistoryPolicy.parse(history)
        _check_history_switch(self.policy, self.num_latents, policy)
        self.policy = policy
        self.config = dataclasses.replace(self.config, history=str(self.policy))

    def new_cache(self, batch_size: int, length: int | None = None) -> TemporalCache:
        """A temporal cache for one request batch. ``length`` (the response positions N) preallocates an
        entry-based history at once, C = N slots for ``full`` (decoding reveals at least one token per
        evaluation, so N evaluations at most) and k for ``last:k``: the static storage a compiled step needs."""
        cls = LatentCache if self.policy.recurrent else TemporalCache
        cache = cls(batch_size=batch_size, policy=self.policy)
        if length is not None and not self.policy.recurrent:
            self._allocate(cache, length, capacity=length)
        return cache

    def _allocate(self, cache: TemporalCache, length: int, capacity: int | None) -> None:
        p = next(self.temporal.parameters())
        cache.allocate(self.layer_ids, length, self.config.heads, self.config.head_dim, p.dtype, p.device,
                       capacity=capacity)  # fmt: skip

    def temporal_cache_bytes(self, batch_size: int, length: int, steps: int) -> int:
        """``cache.nbytes()`` after ``steps`` evaluations of ``length`` response positions.

        Entry-based policies store, per layer, the sink's zero slot and C entry slots of key + value (2 d_t
        each), plus per position one validity flag per slot (shared by the layers), an int64 write count and the
        int64 position of its storage column;
        C = max(8, 2^ceil(log2 steps)) for ``full`` (storage doubles), the same capped at k for ``last:k``;
        ``current`` stores nothing. ``latent:M`` stores M d per position and layer, whatever ``steps`` is.
        (A cache made with ``new_cache(B, length)`` caps ``full``'s C at ``length``.)
        """
        if steps <= 0 or not self.policy.uses_cache:
            return 0
        es = next(self.temporal.parameters()).element_size()
        B, N, L_t = batch_size, length, len(self.layer_ids)
        if self.policy.recurrent:  # latents + alive flags (B, N) + r_last (B,) int64
            return L_t * B * N * self.num_latents * self.backbone.hidden_size * es + B * N + B * 8
        d_t = self.config.heads * self.config.head_dim
        cap = max(8, 1 << (steps - 1).bit_length())
        cap = min(cap, self.policy.k) if self.policy.kind == "last" else cap
        return L_t * B * N * 2 * (1 + cap) * d_t * es + B * N * (1 + cap) + 2 * B * N * 8

    # -- shared pieces -------------------------------------------------------------------------
    def _masked(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """m_{i,p} over the response region, (..., N) bool."""
        return input_ids[..., prompt_len:] == self.backbone.mask_token_id

    def _check_prompt_len(self, prompt_len: int, L: int) -> None:
        lo = self.offset
        if not isinstance(prompt_len, int) or not lo <= prompt_len < L:
            raise TDLMError(
                f"prompt_len must be an int in {lo}..{L - 1} for sequences of length {L}; got {prompt_len!r}"
                + (" (prediction-aligned temporal layers read h at prompt_len - 1)" if lo else "")
            )

    def _slice(self, h: torch.Tensor, prompt_len: int) -> tuple[int, int]:
        """Span [a, b) of h whose rows stand for the N response tokens (shifted by ``offset``)."""
        a = prompt_len - self.offset
        return a, a + h.shape[1] - prompt_len

    def _run_layer(self, i: int, x: torch.Tensor, ctx: ForwardContext, insert) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self.backbone.layer, i, x, ctx, insert, use_reentrant=False)
        return self.backbone.layer(i, x, ctx, insert)

    def _run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        insert,
        select: torch.Tensor | None = None,
        kv: KVStep | None = None,
    ) -> torch.Tensor:
        x, ctx = self.backbone.prepare(input_ids, attention_mask, kv)
        first = self.layer_ids[0]
        # Below the lowest temporal layer nothing depends on temporal parameters: no autograd there.
        with torch.no_grad():
            for i in range(first):
                x = self.backbone.layer(i, x, ctx, None)
        for i in range(first, self.backbone.num_layers):
            x = self._run_layer(i, x, ctx, insert)
        return self.backbone.head(x, ctx, select)

    # -- parallel mode (training) --------------------------------------------------------------
    def forward_states(
        self,
        input_ids: torch.Tensor,
        prompt_len: int,
        attention_mask: torch.Tensor | None = None,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, K, L, V) for K states S_0..S_{K-1} of each trajectory, evaluated together.

        input_ids (B, K, L) in trajectory order; attention_mask (B, L) or (B, K, L), 1 = token.
        ``select`` (B, K, L) bool returns only the logits of those positions, (S, V) in row-major
        order (training: the supervised positions of Eq. 5; the LM head runs on nothing else).
        A recurrent history (``latent:M``) evaluates the states in order with a fresh cache instead.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 3:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TDLMError(f"forward_states expects input_ids of shape [B, K, L]; got shape {shape}")
        B, K, L = input_ids.shape
        self._check_prompt_len(prompt_len, L)
        if select is not None and select.shape != input_ids.shape:
            raise TDLMError(
                f"select must have the shape of input_ids {tuple(input_ids.shape)}; got {tuple(select.shape)}"
            )
        flat = input_ids.reshape(B * K, L)
        self.backbone.check_input_ids(flat)
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                attention_mask = attention_mask[:, None].expand(B, K, L)
            attention_mask = attention_mask.reshape(B * K, L)
        if self.policy.recurrent:
            # S_i's latents depend on S_{i-1}'s layer outputs: no parallel mask, run the steps in order.
            cache = self.new_cache(B)
            am = None if attention_mask is None else attention_mask.view(B, K, L)
            steps = [
                self.forward_step(
                    input_ids[:, i], prompt_len, cache, None if am is None else am[:, i],
                    None if select is None else select[:, i],
                )
                for i in range(K)
            ]
            if select is None:
                return torch.stack(steps, dim=1)  # (B, K, L, V)
            # The steps give rows in (K, B, L) order; put them back in select's (B, K, L) order.
            order = torch.zeros((K, B, L), dtype=torch.long, device=input_ids.device)
            sel_t = select.transpose(0, 1)
            order[sel_t] = torch.arange(int(sel_t.sum()), device=input_ids.device)
            return torch.cat(steps)[order.transpose(0, 1)[select]]  # (S, V)
        masked = self._masked(input_ids, prompt_len)  # (B, K, N)
        r = (~masked).sum(-1)  # (B, K) revealed response tokens r_i
        allowed = self.policy.parallel_mask(K, input_ids.device)[None, None] & masked.transpose(1, 2)[:, :, None, :]
        # allowed: (B, N, K_i, K_j) = policy(i, j) * m_{j,p}
        mcol = masked.reshape(B * K, L - prompt_len, 1)  # m_{i,p} per flat row

        def insert(layer: int, h: torch.Tensor) -> torch.Tensor:
            mod = self.temporal[str(layer)] if str(layer) in self.temporal else None
            if mod is None:
                return h
            a, b = self._slice(h, prompt_len)
            hr = h[:, a:b].reshape(B, K, L - prompt_len, -1)  # (B, K, N, d)
            z = mod.states(hr, r, allowed)  # (B, K, N, d_t): Eq. 7-9, one SDPA over the K states
            return mod.correct(h, a, b, z.reshape(B * K, L - prompt_len, -1), mcol)  # Eq. 10 + Eq. 2

        logits = self._run(flat, attention_mask, insert, None if select is None else select.reshape(B * K, L))
        return logits if select is not None else logits.view(B, K, L, -1)

    # -- step-wise mode (decoding) -------------------------------------------------------------
    def forward_step(
        self,
        input_ids: torch.Tensor,
        prompt_len: int,
        cache: TemporalCache,
        attention_mask: torch.Tensor | None = None,
        select: torch.Tensor | None = None,
        kv: KVStep | None = None,
    ) -> torch.Tensor:
        """Logits (B, L, V) for one evaluation; retrieves from and appends to ``cache``.

        ``select`` (B, L) bool returns only those positions' logits, (S, V) in row-major order. ``kv``
        uses the backbone's spatial KV cache (:mod:`tdlm.models.kv_cache`): a refresh, or a window step
        (which needs ``select``); see :meth:`forward_groups` for what enters the temporal history then.
        """
        return self.forward_groups(prompt_len, cache, [StepGroup(input_ids, attention_mask, select, kv)])[0]

    def forward_groups(self, prompt_len: int, cache: TemporalCache, groups: list[StepGroup],
                       evaluate=None) -> list[torch.Tensor]:  # fmt: skip
        """One evaluation of a batch whose rows are computed by separate forwards, one per group.

        Decoding with a spatial KV cache splits a batch into the rows that refresh (a full forward) and
        the rows that run a window step. Every group reads the history as it was before this evaluation;
        the entries of all groups are appended once, then the evaluation is committed, so a split batch
        is the same evaluation as an unsplit one. Returns each group's logits.

        History rule with a spatial KV cache: a masked response position gets an entry (and its
        temporal correction, Eq. 2) in an evaluation only if that evaluation computes its hidden state -
        every masked position at a refresh and at a ``prefix`` step, only the active block at a ``dual``
        step (under prediction alignment the hidden state at p - offset stands for token p). Positions
        not computed get an invalid entry, which attention masks out (A_{p,i,j} of Section 2.3 with
        m_{j,p} = 0), so a zero W_O still gives the backbone with the same cache bit for bit (Prop. 1).
        ``evaluate`` replaces :meth:`evaluate_groups` (the tensor work), e.g. by its compiled form.
        """
        if not groups:
            raise TDLMError("forward_groups needs at least one group of rows")
        for g in groups:
            self.backbone.check_input_ids(g.input_ids)
        L = groups[0].input_ids.shape[1]
        self._check_prompt_len(prompt_len, L)
        if len(groups) > 1 and any(g.rows is None for g in groups):
            raise TDLMError("forward_groups with several groups needs each group's rows (indices into the batch)")
        B = sum(g.input_ids.shape[0] for g in groups)
        cache.check(B, prompt_len, L - prompt_len)
        if self.policy.recurrent:
            masked = _merge_rows([(g.rows, self._masked(g.input_ids, prompt_len)) for g in groups], B)
            if not isinstance(cache, LatentCache):
                raise TDLMError(f"history {self.policy} needs a latent cache; create it with model.new_cache(B)")
            if any(g.kv is not None and not g.kv.refresh and g.kv.cache.mode == "dual" for g in groups):
                raise TDLMError(f"cache 'dual' cannot serve history {self.policy} (its latents keep one progress "
                                f"count per request); allowed caches: none, prefix")  # fmt: skip
            return self._latent_step(prompt_len, cache, groups, masked)
        if self.policy.uses_cache and not cache.layers:  # a cache made without `length`: unbounded `full`
            self._allocate(cache, L - prompt_len, capacity=None)
        cache.reserve(cache.steps + 1)  # host: the storage's bucket for this evaluation, before the step reads it
        logits = (evaluate or TDLM.evaluate_groups)(self, prompt_len, cache, groups)
        cache.steps += 1
        return logits

    def evaluate_groups(self, prompt_len: int, cache: TemporalCache, groups: list[StepGroup],
                        written_out: bool = False) -> list[torch.Tensor]:  # fmt: skip
        """The tensor work of one entry-based evaluation (:meth:`forward_groups` without its host checks and
        counters): every group's forward reads the history as it was, then this evaluation's entries are
        written and committed in place. Static shapes, no host synchronisation and no Python state that
        changes from step to step, so ``torch.compile(TDLM.evaluate_groups, fullgraph=True)`` traces it
        once per step kind (:mod:`tdlm.decoding.loop`). ``written_out``: the temporal attention's form for
        inductor (:func:`tdlm.temporal.attention.step_attention`)."""
        L = groups[0].input_ids.shape[1]
        B, N = sum(g.input_ids.shape[0] for g in groups), L - prompt_len
        masked = _merge_rows([(g.rows, self._masked(g.input_ids, prompt_len)) for g in groups], B)
        if cache.cols is not None:  # by storage column: the position each holds (none: not masked)
            masked = masked.gather(1, cache.cols.clamp(max=N - 1)) & (cache.cols < N)
        pending: dict[int, list] = {}
        logits = [self._entry_group(g, prompt_len, cache, pending, written_out) for g in groups]
        written, slot = None, None
        for layer, parts in pending.items():
            kv, written = _merge_entries(parts, B, cache.width)
            slot = cache.slots(written) if slot is None else slot  # the same columns at every layer
            cache.append(layer, kv, written, slot)
        cache.commit(masked, written, slot)
        return logits

    def _slots(self, kv: KVStep | None, prompt_len: int, L: int, cache: TemporalCache | None = None,
               rows: torch.Tensor | None = None):  # fmt: skip
        """For a window step: (j, inside, dump, col) (b, W_win) - the response position j each window row stands
        for, whether it is one and has a storage column, the scatter target (its column; the cache's width W
        for the others, dropped afterwards) and its column clamped to a valid index. None otherwise."""
        if kv is None or kv.refresh:
            return None
        N = L - prompt_len
        j = kv.positions() + self.offset - prompt_len
        inside = (j >= 0) & (j < N)
        j = j.clamp(0, N - 1)
        if cache is None or cache.cols is None:
            return j, inside, torch.where(inside, j, N), j
        col = cache.held(j, rows)
        inside = inside & (col < cache.width)
        return j, inside, torch.where(inside, col, cache.width), col.clamp(max=cache.width - 1)

    def _entry_group(self, g: StepGroup, prompt_len: int, cache: TemporalCache, pending: dict,
                     written_out: bool = False) -> torch.Tensor:  # fmt: skip
        """One group's forward under an entry-based history; its entries go to ``pending`` (appended later)."""
        masked = self._masked(g.input_ids, prompt_len)  # (b, N)
        N = masked.shape[1]
        r = (~masked).sum(-1)  # (b,)
        window = g.kv is not None and not g.kv.refresh
        front = cache.front if window and self.policy.kind != "current" else None
        slots = None if front is not None else self._slots(g.kv, prompt_len, g.input_ids.shape[1], cache, g.rows)
        # Full forwards compute every storage column's position: pos (b, W) (None: the cache has no columns,
        # history `current`: all N positions in order). A window step over the cache's front computes its first
        # w columns: pos (b, w) then indexes the window's rows. Otherwise a window step computes its own rows
        # (slots) and looks their columns up.
        cols = None if cache.cols is None or slots is not None else _history_rows(cache.cols, g.rows, None)
        pos = None if cols is None else cols.clamp(max=N - 1)
        target = None  # where this group's entries go: None = the columns 0.. in order
        narrow = front is not None
        if narrow:
            cols = _history_rows(front, g.rows, None)  # (b, w) positions of the first w columns
            row = cols - (g.kv.start + self.offset - prompt_len)[:, None]  # their window rows
            m = (row >= 0) & (row < g.kv.width) & (cols < N)  # in the window: computed
            m = m & masked.gather(1, cols.clamp(max=N - 1))  # masked and computed
            pos = row.clamp(0, g.kv.width - 1)
        elif slots is not None:
            m = slots[1] & masked.gather(1, slots[0])  # masked and computed
            target = slots[2]
        else:
            m = masked if cols is None else masked.gather(1, pos) & (cols < N)
        mcol = m.unsqueeze(-1)
        j = None if slots is None else slots[3]  # the window rows' storage columns
        w = None if not narrow else cols.shape[1]
        # The loop's host promises (TemporalCache.claim_rows / set_front(aligned=True)): the columns are rows of h
        # in order, so each temporal layer reads a slice of h and corrects it in place (no gather / scatter-add).
        if narrow:
            in_order = cache.front_aligned and g.kv.cache.mode == "dual"
        else:
            in_order = slots is None and pos is not None and cache.suffix
        shift = self.backbone.logit_shift - self.offset  # window row of the front's column 0 (in_order, narrow)
        allowed = None  # (b, W or w or W_win, 1 + C): valid and masked-and-computed, or the sink; shared by the layers
        biases = None  # (L_t, b, ..., 1 + C): every temporal layer's additive mask, built once per evaluation
        if self.policy.kind != "current" and cache.valid is not None:
            valid = cache.valid[:, :w] if narrow else cache.valid
            allowed = _history_rows(valid, g.rows, j) & (mcol | cache.sink_column())
            biases = TemporalAttention.step_biases([self.temporal[str(i)] for i in self.layer_ids], allowed)
        order = {layer: k for k, layer in enumerate(self.layer_ids)}
        tables: dict = {}  # this evaluation's temporal RoPE tables, computed at the first temporal layer

        def insert(layer: int, h: torch.Tensor) -> torch.Tensor:
            mod = self.temporal[str(layer)] if str(layer) in self.temporal else None
            if mod is None:
                return h
            if in_order:  # the columns' rows, a slice: the window's rows from `shift`, or the last W response rows
                b = shift + pos.shape[1] if narrow else self._slice(h, prompt_len)[1]
                a = b - pos.shape[1]
                hr = h[:, a:b]  # (b, w or W, d), a view
            elif slots is None:
                a, b = (0, h.shape[1]) if narrow else self._slice(h, prompt_len)
                hr = h[:, a:b]  # (b, N, d), or the window (b, W_win, d)
                if pos is not None:  # at the storage columns' positions, (b, W or w, d)
                    hr = hr.gather(1, pos[..., None].expand(-1, -1, hr.shape[-1]))
            else:
                a, b, hr = 0, h.shape[1], h  # (b, W_win, d): the window
            if "rope" not in tables:  # R(r) tables: one per evaluation, shared by the temporal layers
                tables["rope"] = mod.step_rope(r)
            if self.policy.kind == "current":
                z, _ = mod.step(hr, r, None, own=m, rope=tables["rope"], masked=mcol)  # (b, N or W, d_t)
            else:
                vis = cache.visible(layer)
                # the storage itself or its first w columns, a view (no copy), unless a row group or a window
                # without a front gathers its rows
                store = None if vis is None else (vis[0][:, :w] if narrow else vis[0])
                history = None if vis is None else (_history_rows(store, g.rows, j), allowed)
                bias = None if biases is None else biases[order[layer]]
                # Eq. 7-9: 1 matmul, rope, SDPA
                z, kv = mod.step(hr, r, history, rope=tables["rope"], bias=bias, written_out=written_out)
                pending.setdefault(layer, []).append((g.rows, target, kv, m))
                if z is None:
                    return h
            if pos is not None and not in_order:  # Eq. 10 + Eq. 2 added at the columns' positions (z = 0 where m = 0)
                return mod.correct_at(h, a, b, z, pos)
            return mod.correct(h, a, b, z, None, hr)  # Eq. 10 + Eq. 2 (z = 0 where m = 0), in place without autograd

        return self._run(g.input_ids, g.attention_mask, insert, g.select, g.kv)

    def _latent_step(
        self, prompt_len: int, cache: LatentCache, groups: list[StepGroup], masked: torch.Tensor
    ) -> list[torch.Tensor]:
        """One evaluation under ``latent:M``: read the latents, correct (Eq. 2), fold in h (Perceiver)."""
        B = masked.shape[0]
        # Read from a snapshot and write into a per-call dict, so that a checkpointed layer recomputed
        # during backward sees this step's latents and cannot overwrite a later step's cache.
        lat_in = dict(cache.latents)
        r_all = cache.progress(masked.device)  # (B,)
        lat_out: dict[int, list] = {}
        logits = [self._latent_group(g, prompt_len, lat_in, r_all, lat_out) for g in groups]
        cache.write({layer: _merge_rows(parts, B) for layer, parts in lat_out.items()})
        cache.commit(masked)
        return logits

    def _latent_group(
        self, g: StepGroup, prompt_len: int, lat_in: dict, r_all: torch.Tensor, lat_out: dict
    ) -> torch.Tensor:
        input_ids = g.input_ids
        Bg, L = input_ids.shape
        N = L - prompt_len
        masked = self._masked(input_ids, prompt_len)
        r = (~masked).sum(-1)
        r_lat = (r_all if g.rows is None else r_all[g.rows])[:, None, None]  # (b, 1, 1) -> over (N, M)
        slots = self._slots(g.kv, prompt_len, L)
        m = masked if slots is None else slots[1] & masked.gather(1, slots[0])  # masked and computed
        mcol = m.unsqueeze(-1)
        ar = torch.arange(Bg, device=input_ids.device)[:, None]

        def insert(layer: int, h: torch.Tensor) -> torch.Tensor:
            mod = self.temporal[str(layer)] if str(layer) in self.temporal else None
            if mod is None:
                return h
            if slots is None:
                a, b = self._slice(h, prompt_len)
                hr = h[:, a:b]  # (b, N, d): h_{l,p}(S_i), before the correction
            else:
                a, b, hr = 0, h.shape[1], h  # (b, W, d): the window
            lat = lat_in.get(layer)
            if lat is None:
                lat = mod.memory.initial(Bg, N)  # (b, N, M, d) learned initial latents
            elif g.rows is not None:
                lat = lat[g.rows]
            lat_w = lat if slots is None else lat[ar, slots[0]]  # (b, N or W, M, d)
            # q rotated by r_i; latent keys by r_last; one SDPA over the M latents + sink (Eq. 7-9)
            z = mod.latent(hr, r, lat_w, r_lat)  # (b, N or W, d_t)
            new = mod.memory.update(lat_w, hr, m)  # u + Perceiver(u, [h]) where masked (and computed)
            if slots is not None:  # write the window's latents back; other positions keep theirs
                new = torch.cat([lat, lat[:, :1]], 1).index_put((ar, slots[2]), new)[:, :N]
            lat_out.setdefault(layer, []).append((g.rows, new))
            return mod.correct(h, a, b, z, mcol)  # Eq. 10 + Eq. 2 (after the update, which read h uncorrected)

        return self._run(input_ids, g.attention_mask, insert, g.select, g.kv)

    def forward(self, input_ids: torch.Tensor, prompt_len: int, cache: TemporalCache | None = None, **kw):
        if cache is None:
            return self.forward_states(input_ids, prompt_len, **kw)
        return self.forward_step(input_ids, prompt_len, cache, **kw)

    # -- adapter I/O ---------------------------------------------------------------------------
    def adapter_config(self) -> dict:
        bb = self.backbone
        return {
            "format_version": ADAPTER_FORMAT_VERSION,
            "backbone": {
                "id": bb.backbone_id,
                "family": bb.family,
                "hidden_size": bb.hidden_size,
                "num_layers": bb.num_layers,
                "vocab_size": bb.vocab_size,
                "fingerprint": backbone_identity(bb),
            },
            "layers": list(self.layer_ids),
            "heads": self.config.heads,
            "head_dim": self.config.head_dim,
            "history": str(self.policy),
            "rope_base": self.config.rope_base,
            "alignment": self.config.alignment,
            "num_parameters": self.num_temporal_parameters(),
            **({"perceiver": self._perceiver_config()} if self.num_latents else {}),
            # the run that trained it (recipe, teacher, run folder, W&B run), kept through load and save
            **({"training": self.training_record} if getattr(self, "training_record", None) else {}),
        }

    def _perceiver_config(self) -> dict:
        return {
            "num_latents": self.num_latents,
            "heads": self.config.perceiver_heads,
            "head_dim": self.config.perceiver_head_dim,
            "norm_eps": NORM_EPS,
            "softcap": SOFTCAP,
        }

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"temporal.{k}": v.detach().cpu().contiguous() for k, v in self.temporal.state_dict().items()}

    def save_adapter(self, directory: str | os.PathLike) -> Path:
        """Write ``adapter.safetensors`` + ``tdlm_adapter.json`` (no backbone weights)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.adapter_state_dict(), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (out / ADAPTER_CONFIG).write_text(json.dumps(self.adapter_config(), indent=2) + "\n")
        return out

    @classmethod
    def from_adapter(
        cls,
        backbone: Backbone,
        directory: str | os.PathLike,
        history: str | None = None,
        allow_other_backbone: bool = False,
    ) -> TDLM:
        """Attach a saved adapter to ``backbone``; dims are checked before any tensor is loaded.

        The adapter records the backbone it was trained on (family, vocabulary, weight fingerprint);
        another backbone of the same shape (a Base adapter on an Instruct model) is refused unless
        ``allow_other_backbone``.
        """
        d = Path(directory)
        cfg_path, w_path = adapter_config_path(d), d / ADAPTER_WEIGHTS
        if not w_path.exists():
            raise TDLMError(f"{d}: missing {w_path.name} (expected a folder written by TDLM.save_adapter)")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise TDLMError(f"{cfg_path}: invalid JSON: {e}") from e
        if raw.get("format_version") != ADAPTER_FORMAT_VERSION:
            raise TDLMError(
                f"{cfg_path}: format_version={raw.get('format_version')!r}; this tdlm reads version "
                f"{ADAPTER_FORMAT_VERSION}"
            )
        bb = raw.get("backbone", {})
        for field, have in (("hidden_size", backbone.hidden_size), ("num_layers", backbone.num_layers)):
            if bb.get(field) != have:
                raise TDLMError(
                    f"{cfg_path}: adapter was trained for backbone.{field}={bb.get(field)} "
                    f"({bb.get('id')}); this backbone has {field}={have} ({backbone.backbone_id})"
                )
        if not allow_other_backbone:
            have = {"family": backbone.family, "vocab_size": backbone.vocab_size,
                    "fingerprint": backbone_identity(backbone)}
            differ = [f"{k}={bb[k]!r} (this backbone: {v!r})" for k, v in have.items()
                      if bb.get(k) is not None and v is not None and bb[k] != v]
            if differ:
                raise TDLMError(
                    f"{cfg_path}: adapter was trained on backbone {bb.get('id')!r}, not this one "
                    f"({backbone.backbone_id!r}): {'; '.join(differ)}; attach it anyway with "
                    f"allow_other_backbone=True (--allow-other-backbone)"
                )
        trained = HistoryPolicy.parse(raw.get("history", "full"))
        perceiver = raw.get("perceiver") or {}
        if trained.recurrent != bool(perceiver) or perceiver.get("num_latents", 0) != trained.num_latents:
            raise TDLMError(
                f"{cfg_path}: history={str(trained)!r} and perceiver={raw.get('perceiver')!r} disagree "
                f"(latent:M needs perceiver.num_latents = M; other policies have no perceiver)"
            )
        for key, have in (("norm_eps", NORM_EPS), ("softcap", SOFTCAP)):
            if key in perceiver and perceiver[key] != have:
                raise TDLMError(f"{cfg_path}: perceiver.{key}={perceiver[key]!r}; this tdlm implements {have}")
        requested = HistoryPolicy.parse(history) if history else trained
        _check_history_switch(trained, trained.num_latents, requested, where=f"{d}: ")
        config = TemporalConfig(
            layers=list(raw["layers"]),
            heads=int(raw["heads"]),
            head_dim=int(raw["head_dim"]),
            history=str(requested),
            rope_base=float(raw.get("rope_base", 10000.0)),
            # Adapters written before the field existed were trained input-aligned.
            alignment=str(raw.get("alignment", "input")),
            perceiver_heads=int(perceiver["heads"]) if perceiver else None,
            perceiver_head_dim=int(perceiver["head_dim"]) if perceiver else None,
        )
        model = cls(backbone, config)
        state = fuse_qkv_keys(load_file(str(w_path)))  # adapters written before the fused W_QKV: separate keys
        expected = model.adapter_state_dict()
        if set(state) != set(expected):
            extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
            raise TDLMError(f"{w_path}: tensors do not match {cfg_path.name} (missing {missing}, extra {extra})")
        for k, t in state.items():
            if t.shape != expected[k].shape:
                raise TDLMError(
                    f"{w_path}: tensor {k} has shape {tuple(t.shape)} but heads={config.heads} x "
                    f"head_dim={config.head_dim} on hidden_size={backbone.hidden_size} needs "
                    f"{tuple(expected[k].shape)}"
                )
        model.temporal.load_state_dict({k.removeprefix("temporal."): v for k, v in state.items()})
        model.training_record = raw.get("training")
        return model

    # -- Hugging Face Hub ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, backbone: Backbone | str, source: str | os.PathLike, history: str | None = None,
                        allow_other_backbone: bool = False, revision: str | None = None,
                        cache_dir: str | os.PathLike | None = None, token: str | bool | None = None,
                        local_files_only: bool | None = None, dtype=None, device="cpu") -> TDLM:
        """``from_adapter`` on a local folder or a Hub repo id (``huggingface_hub.snapshot_download``; offline with
        ``HF_HUB_OFFLINE``). ``backbone``: a Backbone, or a name / folder / cached Hub id for ``tdlm.load_backbone``.
        Writing and uploading (with a model card) are functions of the Hub layer: ``tdlm.hub.save_pretrained`` and
        ``tdlm.hub.push_to_hub``."""
        from tdlm.models.loading import load_backbone

        folder = resolve_adapter(source, revision, cache_dir, token, local_files_only)
        bb = load_backbone(backbone, dtype=dtype, device=device) if isinstance(backbone, str) else backbone
        model = cls.from_adapter(bb, folder, history=history, allow_other_backbone=allow_other_backbone)
        return model.to(next(bb.parameters()).device).eval()


def backbone_identity(backbone: Backbone) -> str | None:
    """The backbone's weight fingerprint (set by the loaders; computed for a backbone built in code)."""
    if backbone.weight_fingerprint is not None:
        return backbone.weight_fingerprint
    params = list(backbone.parameters())
    if not params or any(p.is_meta or p.numel() == 0 for p in params):  # meta or ZeRO-3 partitioned
        return None
    from tdlm.models.fingerprints import weight_fingerprint_module

    return weight_fingerprint_module(backbone)


def _check_history_switch(current: HistoryPolicy, num_latents: int, new: HistoryPolicy, where: str = "") -> None:
    """Refuse history changes the temporal weights were not built for (latent <-> entries, other M)."""
    if new.recurrent and num_latents == 0:
        raise TDLMError(
            f"{where}history {str(new)!r} needs perceiver weights, but this adapter was built with history "
            f"{str(current)!r}; build TDLM with TemporalConfig(history={str(new)!r}) and train it"
        )
    if new.recurrent and new.num_latents != num_latents:
        raise TDLMError(
            f"{where}this adapter has {num_latents} learned latents per layer; history {str(new)!r} needs "
            f"{new.num_latents}"
        )
    if not new.recurrent and num_latents:
        raise TDLMError(
            f"{where}this adapter was trained with history 'latent:{num_latents}' (its keys read latents); "
            f"history {str(new)!r} would feed them raw entries"
        )
