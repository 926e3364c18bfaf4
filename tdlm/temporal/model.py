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

This module is the operator. Where the step-wise history lives and which storage column a row reads and writes
are the storage plans of :mod:`tdlm.temporal.storage`; the adapter's files are :mod:`tdlm.temporal.adapter_files`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tdlm.errors import TDLMError
from tdlm.models.common import Backbone, ForwardContext
from tdlm.models.kv_cache import KVStep
from tdlm.temporal import adapter_files
from tdlm.temporal.adapter_files import check_history_switch, resolve_adapter
from tdlm.temporal.attention import TemporalAttention, resolve_layers, temporal_parameter_count
from tdlm.temporal.card import write_card
from tdlm.temporal.history import HistoryPolicy, TemporalCache
from tdlm.temporal.latent_cache import LatentCache
from tdlm.temporal.perceiver import LatentMemory, perceiver_parameter_count
from tdlm.temporal.storage import (
    StaticHistories,
    allowed_slots,
    group_columns,
    history_bytes,
    layer_history,
    make_cache,
    masked_by_column,
    merge_rows,
    scatter_window_latents,
    window_slots,
    write_entries,
)

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
        self.static_histories = StaticHistories()  # the static storage plan's histories, reused across decodes

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
        check_history_switch(self.policy, self.num_latents, policy)
        self.policy = policy
        self.config = dataclasses.replace(self.config, history=str(self.policy))

    def new_cache(self, batch_size: int, length: int | None = None, static: bool = False) -> TemporalCache:
        """A temporal cache for one request batch. ``length`` (the response positions N) preallocates an
        entry-based history at once, C = N slots for ``full`` (decoding reveals at least one token per
        evaluation, so N evaluations at most) and k for ``last:k``: the static storage a compiled step needs.

        ``static`` (needs ``length``): the static storage plan, the history at its final size at fixed addresses
        and the same tensors in every decode of this batch size (:class:`tdlm.temporal.storage.StaticHistories`)."""
        if static and self.policy.uses_cache:
            return self.static_histories.history(self, batch_size, length)
        cache = make_cache(self.policy, batch_size)
        if length is not None and not self.policy.recurrent:
            self._allocate(cache, length, capacity=length)
        return cache

    def _allocate(self, cache: TemporalCache, length: int, capacity: int | None) -> None:
        p = next(self.temporal.parameters())
        cache.allocate(self.layer_ids, length, self.config.heads, self.config.head_dim, p.dtype, p.device,
                       capacity=capacity)  # fmt: skip

    def temporal_cache_bytes(self, batch_size: int, length: int, steps: int) -> int:
        """``cache.nbytes()`` after ``steps`` evaluations of ``length`` response positions
        (:func:`tdlm.temporal.storage.history_bytes`)."""
        return history_bytes(self.policy, batch_size, length, steps, len(self.layer_ids), self.config.heads,
                             self.config.head_dim, self.backbone.hidden_size, self.num_latents,
                             next(self.temporal.parameters()).element_size())  # fmt: skip

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
            masked = merge_rows([(g.rows, self._masked(g.input_ids, prompt_len)) for g in groups], B)
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
        B = sum(g.input_ids.shape[0] for g in groups)
        masked = merge_rows([(g.rows, self._masked(g.input_ids, prompt_len)) for g in groups], B)
        pending: dict[int, list] = {}
        logits = [self._entry_group(g, prompt_len, cache, pending, written_out) for g in groups]
        write_entries(cache, pending, masked_by_column(masked, cache))  # the storage column each position holds
        return logits

    def _entry_group(self, g: StepGroup, prompt_len: int, cache: TemporalCache, pending: dict,
                     written_out: bool = False) -> torch.Tensor:  # fmt: skip
        """One group's forward under an entry-based history; its entries go to ``pending`` (appended later)."""
        masked = self._masked(g.input_ids, prompt_len)  # (b, N)
        r = (~masked).sum(-1)  # (b,)
        # which storage column each temporal row stands for: a full forward, a window step over the cache's front
        # (narrow: its first w columns) or one that looks its window rows' columns up (tdlm/temporal/storage.py)
        plan = group_columns(cache, g.rows, g.kv, masked, prompt_len, g.input_ids.shape[1], self.offset)
        m, pos, in_order, narrow = plan.m, plan.pos, plan.in_order, plan.w is not None
        mcol = m.unsqueeze(-1)
        shift = self.backbone.logit_shift - self.offset  # window row of the front's column 0 (in_order, narrow)
        allowed = None  # (b, W or w or W_win, 1 + C): valid and masked-and-computed, or the sink; shared by the layers
        biases = None  # (L_t, b, ..., 1 + C): every temporal layer's additive mask, built once per evaluation
        if self.policy.kind != "current" and cache.valid is not None:
            allowed = allowed_slots(cache, g.rows, plan)
            biases = TemporalAttention.step_biases([self.temporal[str(i)] for i in self.layer_ids], allowed)
        order = {layer: k for k, layer in enumerate(self.layer_ids)}
        tables: dict = {}  # this evaluation's temporal RoPE tables, computed at the first temporal layer
        # decode compile_scope="block": every temporal layer runs the one compiled step (tdlm.decoding.loop)
        regions = self.backbone.block_regions
        step = TemporalAttention.step if regions is None or regions.temporal_step is None else regions.temporal_step

        def insert(layer: int, h: torch.Tensor) -> torch.Tensor:
            mod = self.temporal[str(layer)] if str(layer) in self.temporal else None
            if mod is None:
                return h
            if in_order:  # the columns' rows, a slice: the window's rows from `shift`, or the last W response rows
                b = shift + pos.shape[1] if narrow else self._slice(h, prompt_len)[1]
                a = b - pos.shape[1]
                hr = h[:, a:b]  # (b, w or W, d), a view
            elif plan.j is None:
                a, b = (0, h.shape[1]) if narrow else self._slice(h, prompt_len)
                hr = h[:, a:b]  # (b, N, d), or the window (b, W_win, d)
                if pos is not None:  # at the storage columns' positions, (b, W or w, d)
                    hr = hr.gather(1, pos[..., None].expand(-1, -1, hr.shape[-1]))
            else:
                a, b, hr = 0, h.shape[1], h  # (b, W_win, d): the window
            if "rope" not in tables:  # R(r) tables: one per evaluation, shared by the temporal layers
                tables["rope"] = mod.step_rope(r)
            if self.policy.kind == "current":
                z, _ = step(mod, hr, r, None, own=m, rope=tables["rope"], masked=mcol)  # (b, N or W, d_t)
            else:
                store = layer_history(cache, layer, g.rows, plan)  # a view of the storage unless rows are gathered
                history = None if store is None else (store, allowed)
                bias = None if biases is None else biases[order[layer]]
                # Eq. 7-9: 1 matmul, rope, SDPA
                z, kv = step(mod, hr, r, history, rope=tables["rope"], bias=bias, written_out=written_out)
                pending.setdefault(layer, []).append((g.rows, plan.target, kv, m))
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
        cache.write({layer: merge_rows(parts, B) for layer, parts in lat_out.items()})
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
        slots = window_slots(g.kv, prompt_len, L, self.offset)
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
                new = scatter_window_latents(lat, new, slots)
            lat_out.setdefault(layer, []).append((g.rows, new))
            return mod.correct(h, a, b, z, mcol)  # Eq. 10 + Eq. 2 (after the update, which read h uncorrected)

        return self._run(input_ids, g.attention_mask, insert, g.select, g.kv)

    def forward(self, input_ids: torch.Tensor, prompt_len: int, cache: TemporalCache | None = None, **kw):
        if cache is None:
            return self.forward_states(input_ids, prompt_len, **kw)
        return self.forward_step(input_ids, prompt_len, cache, **kw)

    # -- adapter files (tdlm/temporal/adapter_files.py) ----------------------------------------------
    def adapter_config(self) -> dict:
        """The ``tdlm_adapter.json`` record: temporal layout, history, alignment, the backbone it is attached to."""
        return adapter_files.adapter_config(self)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        return adapter_files.adapter_state_dict(self)

    def save_adapter(self, directory: str | os.PathLike) -> Path:
        """Write ``adapter.safetensors`` + ``tdlm_adapter.json`` (no backbone weights)."""
        return adapter_files.save_adapter(self, directory)

    def save_pretrained(self, directory: str | os.PathLike, repo_id: str | None = None) -> Path:
        """The adapter files plus the model card: the folder :meth:`from_pretrained` reads, so ``save_pretrained`` /
        ``from_pretrained`` pair on the model as they do in ``transformers``. No backbone weight is written (the
        backbone is loaded by name; ``tdlm.save_backbone`` writes one). The card has no evaluation table: the rows
        come from evaluation folders, which ``tdlm.hub.save_pretrained(model, dir, evaluations=...)`` reads."""
        out = self.save_adapter(directory)
        write_card(out, (), repo_id)
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
        files = adapter_files.read_adapter(backbone, directory, history, allow_other_backbone)
        model = cls(backbone, TemporalConfig(**files.config))
        adapter_files.load_adapter_weights(model, files)
        return model

    # -- Hugging Face Hub ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, backbone: Backbone | str, source: str | os.PathLike, history: str | None = None,
                        allow_other_backbone: bool = False, revision: str | None = None,
                        cache_dir: str | os.PathLike | None = None, token: str | bool | None = None,
                        local_files_only: bool | None = None, dtype=None, device="cpu") -> TDLM:
        """``from_adapter`` on a local folder or a Hub repo id (``huggingface_hub.snapshot_download``; offline with
        ``HF_HUB_OFFLINE``). ``backbone``: a Backbone, or a name / folder / cached Hub id for ``tdlm.load_backbone``.
        :meth:`save_pretrained` writes such a folder (with a model card); the card's evaluation table and uploading
        are functions of the Hub layer: ``tdlm.hub.save_pretrained`` and ``tdlm.hub.push_to_hub``."""
        from tdlm.models.loading import load_backbone

        folder = resolve_adapter(source, revision, cache_dir, token, local_files_only)
        bb = load_backbone(backbone, dtype=dtype, device=device) if isinstance(backbone, str) else backbone
        model = cls.from_adapter(bb, folder, history=history, allow_other_backbone=allow_other_backbone)
        return model.to(next(bb.parameters()).device).eval()
