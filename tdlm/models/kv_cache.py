"""Spatial key/value cache of the backbones' attention: Fast-dLLM's prefix and dual cache.

Fast-dLLM (Wu et al., 2025; ``generate_with_prefix_cache`` / ``generate_with_dual_cache`` in
NVlabs/Fast-dLLM ``llada/generate.py``) observes that in blockwise decoding the keys and values of
positions outside the active block barely change while that block is decoded. At temperature 0 its
semantics, which this module implements for both native backbones, are:

* **refresh** - at each block start one full forward computes every position and stores the rotated
  keys/values of every position at every layer (``SpatialKVCache.store``); its logits commit by the
  decoding rule like any other evaluation (one NFE);
* **prefix** - each later step of the block computes the *window* ``[s - shift, L)`` (the block and
  everything after it); keys/values of the positions before the window come from the refresh;
* **dual** - each later step computes only the window ``[s - shift, e)`` of the block ``[s, e)``;
  keys/values on both sides come from the refresh, and the window's own entries are replaced by the
  new ones (``SpatialKVCache.merged``).

``shift`` is the backbone's ``logit_shift``: Dream predicts token s from the hidden state at s - 1, so
its window starts one position to the left and includes that position (its keys/values are recomputed
with the rest of the window). For LLaDA ``shift = 0`` and the window is exactly Fast-dLLM's.

Attention inside a window step is the backbone's bidirectional attention of the window's queries over
all L keys (padding keys excluded). Rotary positions are the canvas positions, so a cached key and a
recomputed one are rotated alike. Where the cache is stored: :class:`SpatialKVCache` (one per decoding
batch, rows aligned with the active requests); how one forward uses it: :class:`KVStep`, carried by
:class:`tdlm.models.common.ForwardContext` to each block's attention (``spatial_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tdlm.errors import TDLMError

CACHE_MODES = ("none", "prefix", "dual")


def check_cache_mode(mode: str) -> str:
    if mode not in CACHE_MODES:
        raise TDLMError(f"cache {mode!r} unknown; expected one of {', '.join(CACHE_MODES)}")
    return mode


@dataclass
class SpatialKVCache:
    """Rotated keys and values (B, H_kv, L, d_h) of every canvas position at every layer.

    Written by a refresh (a full forward) for some or all rows; read by the window steps that follow.
    A window step writes its recomputed entries into the rows it reads in place: those positions are
    recomputed at every step of the block anyway, and the next block starts with a refresh.
    """

    mode: str
    batch_size: int
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    # The static storage plan (:meth:`allocate`): every layer's keys and values at their final size and a fixed
    # address, written in place only, rows kept until the batch ends (tdlm/decoding/static_plan.py).
    static: bool = False

    def __post_init__(self) -> None:
        check_cache_mode(self.mode)
        if self.mode == "none":
            raise TDLMError("cache 'none' keeps no keys/values; create a SpatialKVCache for 'prefix' or 'dual'")

    def allocate(self, layers, heads: int, length: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """The static plan: (B, ``heads``, ``length``, ``head_dim``) keys and values for each of ``layers`` now, each
        marked with ``torch._dynamo.mark_static_address`` (a refresh then copies into them, never allocates: a
        tensor allocated inside a compiled step would be a CUDA-graph output that the next recording reuses)."""
        for layer in layers:
            for store in (self.keys, self.values):
                store[layer] = torch.zeros((self.batch_size, heads, length, head_dim), dtype=dtype, device=device)
                torch._dynamo.mark_static_address(store[layer])
        self.static = True

    def slot(self, layer: int, step: KVStep, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
             device: torch.device | str) -> LayerKV:  # fmt: skip
        """``layer``'s keys and values as a :class:`LayerKV` for ``step``, whose k, v have ``shape`` (b, H_kv, W, d_h)
        (a refresh: W = L). A refresh of every row allocates the layer's storage when it has none or the batch's
        shape changed (otherwise the storage of one request batch stays put from block to block: a compiled refresh
        mutates its inputs instead of handing out new tensors, which CUDA graphs need); a refresh of some rows
        allocates zeros for the whole batch once; a window step reads what a refresh stored."""
        if not step.refresh:
            if layer not in self.keys:
                raise TDLMError(f"spatial KV cache has no entries for layer {layer}; a block starts with a refresh")
        elif step.rows is None:
            if shape[0] != self.batch_size:
                raise TDLMError(f"spatial KV cache holds {self.batch_size} rows; a refresh gave {shape[0]}")
            if layer not in self.keys or self.keys[layer].shape != shape:
                self.keys[layer] = torch.empty(shape, dtype=dtype, device=device)
                self.values[layer] = torch.empty(shape, dtype=dtype, device=device)
        elif layer not in self.keys:  # (a static cache has every layer from the start: no allocation here)
            self.keys[layer] = torch.zeros((self.batch_size, *shape[1:]), dtype=dtype, device=device)
            self.values[layer] = torch.zeros((self.batch_size, *shape[1:]), dtype=dtype, device=device)
        return LayerKV(self.keys[layer], self.values[layer])

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Refresh: keep the full-canvas k, v (b, H_kv, L, d_h) of ``layer`` for ``rows`` (None = every row)."""
        self.slot(layer, KVStep(self, True, rows), k.shape, k.dtype, k.device).write(k, v, rows)

    def merged(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: KVStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Window step: the cached k, v of ``step.rows`` with the window's fresh entries written in
        (:meth:`LayerKV.merged`); k, v (b, H_kv, W, d_h), returns (b, H_kv, L, d_h)."""
        return self.slot(layer, step, k.shape, k.dtype, k.device).merged(k, v, step)

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (finished requests leave the batch)."""
        if self.static:
            raise TDLMError("a static spatial KV cache keeps every row in place until the batch ends; select() "
                            "would move it")  # fmt: skip
        index = index.to(torch.long)
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = t.index_select(0, index.to(t.device))
        self.batch_size = int(index.numel())

    def extend(self, n: int) -> None:
        """Admit ``n`` new rows at the end of the batch (dynamic storage; the decode engine's refill). Their entries are
        zeros until their first evaluation, a refresh, writes every position; a static cache keeps its rows, and a
        refresh of a freed row overwrites it whole."""
        if self.static:
            raise TDLMError("a static spatial KV cache keeps its rows in place; a refresh overwrites a freed row")
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = torch.cat([t, t.new_zeros((n, *t.shape[1:]))], 0)
        self.batch_size += n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in (self.keys, self.values) for t in s.values())


@dataclass
class LayerKV:
    """One layer's keys and values (B, H_kv, L, d_h) of a :class:`SpatialKVCache`, as tensors
    (:meth:`SpatialKVCache.slot`).

    What a block compiled once for every layer reads and writes (decode ``compile_scope="block"``,
    :meth:`tdlm.models.common.Backbone.layer`): a layer index inside the compiled block would be a constant of its
    graph (dynamo guards on the int and on the dict lookup it keys), so every layer would compile a graph of its own.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def write(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Refresh: the full-canvas k, v (b, H_kv, L, d_h) of ``rows`` (None = every row) into the storage, in place."""
        if rows is None:
            self.keys.copy_(k)
            self.values.copy_(v)
        else:
            self.keys[rows] = k
            self.values[rows] = v

    def merged(self, k: torch.Tensor, v: torch.Tensor, step: KVStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Window step: the cached k, v of ``step.rows`` with the window's fresh entries written in.

        k, v (b, H_kv, W, d_h) are the window's new keys/values; returns (b, H_kv, L, d_h).
        """
        K, V = self.keys, self.values
        if step.rows is not None:
            K, V = K[step.rows], V[step.rows]  # a copy: the window's entries never outlive this step
        idx = step.positions()[:, None, :, None].expand(-1, K.shape[1], -1, K.shape[3])
        fresh = step.fresh()
        if fresh is not None:  # prefix with rows in different blocks: keep cached entries before a row's window
            keep = ~fresh[:, None, :, None]
            k = torch.where(keep, K.gather(2, idx), k)
            v = torch.where(keep, V.gather(2, idx), v)
        return K.scatter_(2, idx, k), V.scatter_(2, idx, v)


@dataclass
class KVStep:
    """How one forward uses a :class:`SpatialKVCache`: a refresh, or a window step.

    ``rows`` are the cache rows this forward's batch rows are (None: all of them, in order). A window
    step computes ``width`` canvas positions from ``start`` (b,) on; ``fresh_from`` (b,) is each row's
    first position whose keys/values it recomputes (None: all window positions; prefix steps over rows
    in different blocks share one window that starts at the leftmost row's and keep the cached entries
    of the positions before each row's own window).
    """

    cache: SpatialKVCache
    refresh: bool
    rows: torch.Tensor | None = None
    start: torch.Tensor | None = None
    width: int = 0
    fresh_from: torch.Tensor | None = None

    def positions(self) -> torch.Tensor:
        """(b, W) canvas positions of the window."""
        return self.start[:, None] + torch.arange(self.width, device=self.start.device)

    def fresh(self) -> torch.Tensor | None:
        """(b, W) bool: window positions whose keys/values are recomputed; None when all are."""
        if self.fresh_from is None:
            return None
        return self.positions() >= self.fresh_from[:, None]

    @classmethod
    def window(
        cls,
        cache: SpatialKVCache,
        block_start: torch.Tensor,
        block_size: int,
        length: int,
        shift: int,
        rows: torch.Tensor | None = None,
        host_starts: list[int] | None = None,
    ) -> KVStep:
        """The window step of ``cache.mode`` for rows whose active blocks start at canvas ``block_start`` (b,).

        ``host_starts``: the same starts as host ints, when the caller knows them (the decode loop does): a
        ``prefix`` window's width is a shape, so reading it from the device would synchronise."""
        first = block_start - shift  # Dream: the hidden state left of the block predicts its first token
        if cache.mode == "dual":
            return cls(cache, False, rows, first, block_size + shift)
        starts = host_starts if host_starts is not None else block_start.tolist()
        lo = min(starts) - shift
        fresh_from = None if len(set(starts)) == 1 else first
        return cls(cache, False, rows, torch.full_like(first, lo), length - lo, fresh_from)
