"""Pieces shared by the native backbones: RMSNorm, rotary embeddings, bidirectional attention and
the :class:`Backbone` base class with its explicit temporal insertion point.

A block is split into ``attend`` (pre-norm spatial attention + residual) and ``feed_forward``
(pre-norm SwiGLU + residual). The representation between the two is ``h_{l,p}(S_i)`` of the TDLM
paper (Section 2.2, Eq. 2): the point where a temporal correction is inserted. Callers that need it
(``tdlm.TDLM``) drive the layer loop through :meth:`Backbone.prepare`, :meth:`Backbone.layer` and
:meth:`Backbone.head`; nothing is patched or hooked.

A forward may use the spatial key/value cache (:mod:`tdlm.models.kv_cache`, Fast-dLLM's prefix and dual
cache): ``prepare(..., kv=KVStep)`` either refreshes it (a full forward that stores every layer's keys and
values) or computes only a window of positions whose attention reads the other positions' keys/values
from the cache (:func:`spatial_attention`); ``head`` then maps the selected canvas positions into the window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tdlm.errors import TDLMError
from tdlm.models.kv_cache import KVStep, LayerKV

# insert(layer_index, h) -> h~ ; h is (B, L, d), after spatial attention, before the FFN.
InsertFn = Callable[[int, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 (both LLaDA and Qwen2/Dream do this)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (B, 1, L, head_dim) for half-split RoPE at integer positions (B, L)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids.float()[..., None] * inv_freq  # (B, L, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, L, hd)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by the tables, computed in the tables' dtype when it is wider (full-precision RoPE), returned in
    x's dtype."""
    work = x.to(cos.dtype) if cos.dtype != x.dtype else x
    return (work * cos + rotate_half(work) * sin).to(x.dtype)


@dataclass
class ForwardContext:
    """Per-forward tensors shared by all layers: rotary tables and the key-padding mask."""

    cos: torch.Tensor  # (B, 1, L, hd)
    sin: torch.Tensor  # (B, 1, L, hd)
    attn_mask: torch.Tensor | None  # (B, 1, 1, L) bool, True = real token; None = no padding
    first_token: torch.Tensor | None = None  # (B,) index of each row's first real token if padded
    kv: KVStep | None = None  # spatial KV cache use of this forward (refresh or window); None = none
    # Window steps compute x[:, w] for canvas positions window_start + w, w < W, of a canvas of canvas_len.
    window_start: torch.Tensor | None = None  # (B,)
    canvas_len: int | None = None


def bidirectional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """Full (non-causal) SDPA; q (B, H, L, hd), k/v (B, Hkv, L, hd). Padding keys are excluded.

    Grouped-query attention (Hkv < H) uses SDPA's ``enable_gqa`` only without a mask: a mask together with
    ``enable_gqa`` is not served by the fused kernels and falls back to the math kernel, which materialises
    the fp32 scores (B, H, L, L). With a mask the K/V heads are repeated instead (query head a reads KV head
    a // (H / Hkv), as ``enable_gqa`` does), which keeps the fused kernels.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and attn_mask is not None:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False,
                                          enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip


def spatial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int | LayerKV | None = None
) -> torch.Tensor:
    """Bidirectional attention of the computed positions (rotated q (B, H, W, hd), k/v (B, Hkv, W, hd)).

    Without a spatial KV cache W = L and this is :func:`bidirectional_attention`. A refresh stores k, v of
    ``layer`` and attends as usual; a window step attends over all L keys: the cached ones with the
    window's fresh entries written in (:meth:`tdlm.models.kv_cache.LayerKV.merged`). ``layer``: the layer index,
    or that layer's storage already looked up (:meth:`tdlm.models.kv_cache.SpatialKVCache.slot`; a block compiled
    once for every layer gets it so, see :meth:`Backbone.layer`).
    """
    kv = ctx.kv
    if kv is not None:
        if layer is None:
            raise TDLMError("a forward with a spatial KV cache must pass the layer index to attend(x, ctx, layer)")
        slot = layer if isinstance(layer, LayerKV) else kv.cache.slot(layer, kv, k.shape, k.dtype, k.device)
        if kv.refresh:
            slot.write(k, v, kv.rows)
        else:
            k, v = slot.merged(k, v, kv)
    return bidirectional_attention(q, k, v, ctx.attn_mask)


@dataclass(frozen=True)
class BlockRegions:
    """A backbone's repeated pieces compiled once and reused by every layer (decode ``compile_scope="block"``,
    :func:`tdlm.decoding.compiled.block_regions`): the layer loop stays eager and calls these in place of the block's
    own methods (:meth:`Backbone.layer`). Dynamo caches one graph per step kind for the shared code; parameters are
    graph inputs, so layer 31 reuses layer 0's graph."""

    attend: Callable  # (block, x, ctx, layer_kv: LayerKV | None) -> h: block.attend
    feed_forward: Callable  # (block, h) -> block.feed_forward(h)
    temporal_step: Callable | None = None  # (module, *args, **kw) -> TemporalAttention.step(module, *args, **kw)


class Backbone(nn.Module):
    """A frozen masked-diffusion denoiser ``input_ids (B, L) -> logits (B, L, V)``.

    Subclasses define ``embed``, ``blocks`` (each with ``attend``/``feed_forward``), ``project``
    (final norm + LM head of hidden states) and the attributes below. Logits returned by
    :meth:`forward` / :meth:`head` are *aligned*: entry p predicts the token at position p. A backbone
    with ``logit_shift = 1`` (Dream) predicts token p from the hidden state at p - 1; :meth:`head`
    applies the shift, so callers never see it.
    """

    family: str = ""
    logit_shift: int = 0  # the hidden state at p - logit_shift predicts token p
    # Identity of the weights (tdlm.models.fingerprints), set by the loaders; None = not known (built in code).
    weight_fingerprint: str | None = None
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    vocab_size: int
    num_layers: int
    hidden_size: int
    head_dim: int
    kv_heads: int  # key/value heads per layer (the spatial KV cache's second dimension)
    rope_theta: float
    # Rotary embedding computed and applied in float32 whatever the compute dtype (LLaDA's release:
    # rope_full_precision=True); False = tables rounded to the compute dtype (Qwen2 / Dream's release).
    rope_full_precision: bool = False
    backbone_id: str = ""
    supports_kv_cache: bool = False  # blocks call spatial_attention with their layer index (tdlm/models/kv_cache.py)
    # The compiled regions :meth:`layer` runs instead of the block's methods; set by a decode with
    # compile_scope="block" for its duration only (tdlm.decoding.compiled.block_regions), None otherwise.
    block_regions: BlockRegions | None = None

    blocks: nn.ModuleList

    # -- pieces -------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embedding_weight(self) -> torch.Tensor:
        """The input embedding matrix (V, d) that :meth:`embed` looks up (decoding's soft iteration mixes its rows)."""
        raise NotImplementedError

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of hidden states (..., d) -> (..., V), no alignment applied."""
        raise NotImplementedError

    def source_positions(
        self, rows: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext | None = None
    ) -> torch.Tensor:
        """Hidden-state index whose projection predicts token ``pos`` of row ``rows`` (both (S,)).

        ``pos - logit_shift``, except at a row's first real token (0 unpadded, ``ctx.first_token``
        when left-padded), which keeps its own logits as in the release's ``cat([logits[:, :1], ...])``.
        """
        if self.logit_shift == 0:
            return pos
        first = torch.zeros_like(pos) if ctx is None or ctx.first_token is None else ctx.first_token[rows]
        return torch.where(pos > first, pos - self.logit_shift, pos)

    def final(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """Aligned logits (B, L, V) of every position."""
        logits = self.project(x)
        if self.logit_shift == 0:
            return logits
        B, L = x.shape[:2]
        rows = torch.arange(B, device=x.device)[:, None].expand(B, L).reshape(-1)
        pos = torch.arange(L, device=x.device).expand(B, L).reshape(-1)
        return logits[rows, self.source_positions(rows, pos, ctx)].view(B, L, -1)

    def default_temporal(self) -> dict:
        """Default temporal allocation for this backbone (paper Section 3.1)."""
        raise NotImplementedError

    def config_dict(self) -> dict:
        raise NotImplementedError

    # -- the layer loop ------------------------------------------------------------------------
    def check_input_ids(self, input_ids: torch.Tensor, what: str = "input_ids") -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TDLMError(f"{what} must be a 2-D LongTensor [batch, length]; got shape {shape}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TDLMError(f"{what} must hold integer token ids; got dtype {input_ids.dtype}")

    def prepare(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, kv: KVStep | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ForwardContext]:
        """Embeddings (B, L, d) and the per-forward context.

        With an attention mask (1 = token, 0 = padding) rotary positions count real tokens only, so
        a left-padded row sees exactly the positions it would see unpadded. With a window step ``kv``
        the embeddings are those of the window's positions only, (B, W, d), rotated at their canvas
        positions; the key-padding mask still spans the whole canvas (the cached keys).
        ``inputs_embeds`` (B, L, d), when given, replaces ``embed(input_ids)`` (a window step gathers its
        positions from it); ``input_ids`` still give the shape.
        """
        B, L = input_ids.shape
        if kv is not None and not self.supports_kv_cache:
            raise TDLMError(f"{type(self).__name__} has no spatial KV cache path; use cache 'none'")
        if attention_mask is None:
            pos = torch.arange(L, device=input_ids.device).expand(B, L)
            mask = None
        else:
            if attention_mask.shape != input_ids.shape:
                raise TDLMError(
                    f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}; "
                    f"got {tuple(attention_mask.shape)}"
                )
            am = attention_mask.to(torch.bool)
            pos = (am.long().cumsum(-1) - 1).clamp(min=0)
            # A given mask is always applied (an all-ones one changes nothing): testing for padding would
            # synchronise with the host and give a compiled step two shapes of graph. Callers without
            # padding pass None.
            mask = am[:, None, None, :]
        first = None if mask is None else am.long().argmax(-1)
        if inputs_embeds is not None and inputs_embeds.shape[:2] != input_ids.shape:
            raise TDLMError(f"inputs_embeds must have shape (batch, length, d) with (batch, length) = "
                            f"{tuple(input_ids.shape)}; got {tuple(inputs_embeds.shape)}")  # fmt: skip
        if kv is not None and not kv.refresh:
            where = kv.positions()  # (B, W)
            if inputs_embeds is None:
                x = self.embed(input_ids.gather(1, where))
            else:
                x = inputs_embeds.gather(1, where[..., None].expand(-1, -1, inputs_embeds.shape[-1]))
            cos, sin = rope_cos_sin(pos.gather(1, where), self.head_dim, self.rope_theta, self.rope_dtype(x.dtype))
            return x, ForwardContext(cos=cos, sin=sin, attn_mask=mask, first_token=first, kv=kv,
                                     window_start=kv.start, canvas_len=L)  # fmt: skip
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rope_cos_sin(pos, self.head_dim, self.rope_theta, self.rope_dtype(x.dtype))
        return x, ForwardContext(cos=cos, sin=sin, attn_mask=mask, first_token=first, kv=kv)

    def rope_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype of the rotary tables for a forward computing in ``dtype`` (see ``rope_full_precision``)."""
        return torch.promote_types(dtype, torch.float32) if self.rope_full_precision else dtype

    def layer(
        self, index: int, x: torch.Tensor, ctx: ForwardContext, insert: InsertFn | None = None
    ) -> torch.Tensor:
        """One block: spatial attention, the Eq. 2 insertion point, then the feed-forward sublayer.

        With :attr:`block_regions` set (a decode with ``compile_scope="block"``) the attention and the feed-forward
        run as the compiled regions shared by every layer; the layer's spatial KV storage is looked up (or
        allocated) here, eagerly, so the index never enters the compiled graph."""
        block = self.blocks[index]
        regions = self.block_regions
        if regions is not None:
            kv = ctx.kv
            slot = None
            if kv is not None:  # a refresh computes the whole canvas: k, v (B, H_kv, L, hd) in the stream's dtype
                slot = kv.cache.slot(index, kv, (x.shape[0], self.kv_heads, x.shape[1], self.head_dim), x.dtype,
                                     x.device)  # fmt: skip
            h = regions.attend(block, x, ctx, slot)
            if insert is not None:
                h = insert(index, h)
            return regions.feed_forward(block, h)
        h = block.attend(x, ctx) if ctx.kv is None else block.attend(x, ctx, index)  # (B, L, d): h_{l,p}(S_i)
        if insert is not None:
            h = insert(index, h)  # h~_{l,p}(S_i)
        return block.feed_forward(h)

    def head(
        self, x: torch.Tensor, ctx: ForwardContext | None = None, select: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Aligned logits: (B, L, V), or (S, V) for the S positions where ``select`` (B, L) is True, or (B, S, V)
        at the canvas positions of an integer ``select`` (B, S) (:meth:`_head_at`, static shapes).

        With ``select`` the LM head runs on the S hidden states that predict those positions only
        (gathered first, the logit shift applied to the gather), in row-major order of ``select``.
        Training reads a few percent of all positions, so this is most of the logits' memory.
        After a window step (spatial KV cache) ``select`` is over the canvas (B, canvas_len) and is
        required; every selected position must be predicted from inside the window.
        """
        if select is not None and select.dtype != torch.bool:
            return self._head_at(x, ctx, select)
        if ctx is not None and ctx.window_start is not None:
            if select is None or select.shape != (x.shape[0], ctx.canvas_len):
                got = None if select is None else tuple(select.shape)
                raise TDLMError(f"a window step needs select of shape {(x.shape[0], ctx.canvas_len)} "
                                f"(batch, canvas length); got {got}")  # fmt: skip
            rows, pos = select.nonzero(as_tuple=True)
            src = self.source_positions(rows, pos, ctx) - ctx.window_start[rows]
            if bool(((src < 0) | (src >= x.shape[1])).any()):
                raise TDLMError(f"select names positions whose predicting hidden state is outside the computed "
                                f"window of {x.shape[1]} positions")  # fmt: skip
            return self.project(x[rows, src])  # (S, V)
        if select is None:
            return self.final(x, ctx)
        if select.shape != x.shape[:2]:
            raise TDLMError(f"select must have shape {tuple(x.shape[:2])} (batch, length); got {tuple(select.shape)}")
        rows, pos = select.nonzero(as_tuple=True)
        return self.project(x[rows, self.source_positions(rows, pos, ctx)])  # (S, V)

    def _head_at(self, x: torch.Tensor, ctx: ForwardContext | None, positions: torch.Tensor) -> torch.Tensor:
        """Aligned logits (B, S, V) at canvas ``positions`` (B, S) int of each row: a gather by index, so the
        shapes are static and nothing syncs with the host (the decode loop's path; a boolean ``select`` needs
        ``nonzero``). After a window step the predicting hidden states must lie inside the window, which the
        decode loop guarantees by construction (a block's positions and the window that covers them)."""
        if positions.dim() != 2 or positions.shape[0] != x.shape[0]:
            raise TDLMError(f"select positions must have shape (batch={x.shape[0]}, S); got {tuple(positions.shape)}")
        rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(positions)
        src = self.source_positions(rows, positions, ctx)
        if ctx is not None and ctx.window_start is not None:
            src = src - ctx.window_start[:, None]
        return self.project(x[rows, src])  # (B, S, V)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        insert: InsertFn | None = None,
        select: torch.Tensor | None = None,
        kv: KVStep | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, L, V), aligned so that entry p predicts the token at p; (S, V) with ``select``.

        ``kv`` uses the spatial KV cache (a refresh, or a window step, which needs ``select``).
        ``inputs_embeds`` (B, L, d) replaces the embeddings of ``input_ids`` (:meth:`prepare`).
        """
        self.check_input_ids(input_ids)
        if inputs_embeds is None:
            x, ctx = self.prepare(input_ids, attention_mask, kv)
        else:
            x, ctx = self.prepare(input_ids, attention_mask, kv, inputs_embeds)
        for i in range(self.num_layers):
            x = self.layer(i, x, ctx, insert)
        return self.head(x, ctx, select)

    # -- bookkeeping ---------------------------------------------------------------------------
    def freeze(self) -> Backbone:
        for p in self.parameters():
            p.requires_grad_(False)
        return self.eval()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- costs, from the config (the model states them; tdlm.profiling measures them) -------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes the spatial KV cache holds per canvas position of one row: keys and values of every layer
        (``kv_heads`` x ``head_dim`` each) in the parameters' dtype. A cache of B rows over L positions holds
        B L times this (``tdlm.decoding.static_plan.kv_cache_bytes``)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * next(self.parameters()).element_size()

    def matmul_flops_per_token(self) -> int:
        """FLOPs of one position through the blocks' and the head's weight matrices in one evaluation: 2 per
        weight of every 2-D parameter but the embedding table (a gather, no multiply), as nanochat states its
        model's FLOPs; attention's own (position x position) work is not included."""
        emb = self.embedding_weight()
        return 2 * sum(p.numel() for p in self.parameters() if p.dim() == 2 and p is not emb)
