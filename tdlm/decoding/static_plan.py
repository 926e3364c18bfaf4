"""The static storage plan's buffers outside the temporal history: the canvas, the per-row state and the spatial KV
cache, each allocated once per bucket at its final size and reused by every later decode of that bucket.

CUDA-graph trees (``compile="reduce-overhead"``) replay a step only if every tensor it writes in place is static:
a parameter, a buffer, or a tensor given to ``torch._dynamo.mark_static_address``, at the same address at every
replay. The temporal history has its own pool (:class:`tdlm.temporal.storage.StaticHistories`); this module holds
the rest, as the graph pools of dInfer and SGLang do:

* **batch buckets** 1, 2, 4, 8, ...: a batch of B requests decodes in :func:`batch_bucket` (B) rows, the rest
  padding rows that start finished (their response holds no mask, so they commit nothing and count no NFE);
* **prompt buckets** of :data:`PROMPT_BUCKET` tokens: prompts are left-padded to :func:`prompt_bucket` of the
  longest (with an attention mask, which a batch whose prompts all fill the bucket goes without), so prompts of other
  lengths in one bucket share a canvas length (and so every buffer's shape and address, and the compiled graphs);
* per (backbone, batch bucket, canvas length, cache mode): the canvas ids and attention mask, each row's reveal
  steps and NFE, and, with a cache, the spatial KV cache of every layer (:meth:`SpatialKVCache.allocate`).

The pool is keyed by the backbone object (a weak reference: it goes with the model), and grows by one set of
buffers per bucket decoded; :func:`static_bytes` states what it holds.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from tdlm.models.kv_cache import SpatialKVCache

PROMPT_BUCKET = 32  # prompt tokens are padded to a multiple of this (at most 31 padding tokens of attention masked out)


def batch_bucket(batch_size: int) -> int:
    """The smallest power of two >= ``batch_size``: 1, 2, 4, 8, ..."""
    return 1 << max(0, batch_size - 1).bit_length()


def prompt_bucket(prompt_len: int) -> int:
    """``prompt_len`` rounded up to a multiple of :data:`PROMPT_BUCKET`."""
    return -(-prompt_len // PROMPT_BUCKET) * PROMPT_BUCKET


@dataclass
class StaticCanvas:
    """One bucket's canvas and per-row state, written in place only: ids and attention mask (B, L), reveal steps
    (B, G), NFE (B,), and the spatial KV cache (None without one)."""

    ids: torch.Tensor
    attention_mask: torch.Tensor
    reveal: torch.Tensor
    nfe: torch.Tensor
    kv_cache: SpatialKVCache | None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the bucket by name (the KV cache's per layer): what the address test follows."""
        out = {"ids": self.ids, "attention_mask": self.attention_mask, "reveal": self.reveal, "nfe": self.nfe}
        if self.kv_cache is not None:
            for layer in self.kv_cache.keys:
                out[f"kv keys {layer}"] = self.kv_cache.keys[layer]
                out[f"kv values {layer}"] = self.kv_cache.values[layer]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def static_canvas(backbone, batch_size: int, canvas_len: int, gen_length: int, cache: str) -> StaticCanvas:
    """The held buffers of ``backbone`` for this bucket (``batch_size`` already a bucket), on first use allocated
    and marked static. Their contents are whatever the last decode left: the caller writes every entry it reads
    (the decode loop fills the canvas and zeroes reveal and NFE; every row's first evaluation is a refresh that
    writes all of its keys and values before any window step reads them)."""
    p = next(backbone.parameters())
    key = (batch_size, canvas_len, gen_length, cache, p.dtype, p.device)
    pool = _POOLS.setdefault(backbone, {})
    held = pool.get(key)
    if held is None:
        dev = p.device
        kv = None
        if cache != "none":
            kv = SpatialKVCache(cache, batch_size)
            kv.allocate(range(backbone.num_layers), backbone.kv_heads, canvas_len, backbone.head_dim, p.dtype, dev)
        held = StaticCanvas(
            ids=torch.zeros((batch_size, canvas_len), dtype=torch.long, device=dev),
            attention_mask=torch.zeros((batch_size, canvas_len), dtype=torch.long, device=dev),
            reveal=torch.zeros((batch_size, gen_length), dtype=torch.long, device=dev),
            nfe=torch.zeros(batch_size, dtype=torch.long, device=dev),
            kv_cache=kv,
        )
        for name, t in held.tensors().items():
            if not name.startswith("kv "):  # the KV cache marked its own
                torch._dynamo.mark_static_address(t)
        pool[key] = held
    return held


def static_bytes(backbone) -> int:
    """Bytes the static plan holds for ``backbone`` outside the temporal history (every bucket decoded so far)."""
    return sum(c.nbytes() for c in _POOLS.get(backbone, {}).values())


def kv_cache_bytes(num_layers: int, kv_heads: int, head_dim: int, canvas_len: int, element_size: int) -> int:
    """Bytes per row of a spatial KV cache: keys and values of every layer at every canvas position."""
    return 2 * num_layers * kv_heads * canvas_len * head_dim * element_size
