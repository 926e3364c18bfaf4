"""Which rows of one evaluation run which forward, decided on the host (paper Section 2.4 with the spatial KV cache):
the refresh and window groups of an evaluation and their logits merged back in row order, and the temporal history's
front for the next dual window steps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tdlm.models.kv_cache import KVStep, SpatialKVCache
from tdlm.temporal.history import column_bucket


def rows_of(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t[rows]


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as a device index tensor without a host synchronisation (pinned, non-blocking on CUDA)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def step_groups(
    kv_cache: SpatialKVCache | None,
    blk: list[int],
    kv_blk: list[int],
    block_start: torch.Tensor,
    host_starts: list[int],
    bs: int,
    L: int,
    shift: int,
) -> list[tuple[torch.Tensor | None, KVStep | None]]:
    """(rows, KV step) of the forwards of one evaluation: one without a cache; with one, the rows whose
    block starts (a refresh) and the rows inside a block (a window step), each group only if present.
    Decided on the host from the host mirror of each row's active block (``blk``, read back with the stop
    check) and of the block its KV cache holds (``kv_blk``, updated here): no device read."""
    if kv_cache is None:
        return [(None, None)]
    refresh = [i for i, (a, c) in enumerate(zip(blk, kv_blk, strict=True)) if a != c]
    for i in refresh:
        kv_blk[i] = blk[i]
    if len(refresh) == len(blk):
        return [(None, KVStep(kv_cache, True))]
    if not refresh:
        return [(None, KVStep.window(kv_cache, block_start, bs, L, shift, host_starts=host_starts))]
    fresh = set(refresh)
    stay = [i for i in range(len(blk)) if i not in fresh]
    r1, r0 = index_tensor(refresh, block_start.device), index_tensor(stay, block_start.device)
    window = KVStep.window(kv_cache, block_start[r0], bs, L, shift, r0, [host_starts[i] for i in stay])
    return [(r1, KVStep(kv_cache, True, rows=r1)), (r0, window)]


def merge_logits(groups: list, outs: list[torch.Tensor], b: int) -> torch.Tensor:
    """(b, bs, V) block logits from each group's (b_g, bs, V) logits."""
    if len(groups) == 1:
        return outs[0]
    merged = outs[0].new_empty((b, *outs[0].shape[1:]))
    for (rows, _), out in zip(groups, outs, strict=True):
        merged[rows] = out
    return merged


def window_front(blocks: Sequence[int], compacted_blocks: Sequence[int], compacted_masked: Sequence[int],
                 block_size: int, extra: int, length: int) -> int:
    """Host side: how many of the temporal history's first storage columns hold every masked position that the
    rows' next dual window steps compute (:meth:`tdlm.temporal.history.TemporalCache.set_front`), from what the
    host knows: each row's active block now (``blocks``), at its cache's last compaction (``compacted_blocks``)
    and the masked positions that block had then (``compacted_masked``).

    A row reveals only in its active block, so its masked positions are the active block's and every position
    after it, and the columns (in position order) a compaction keeps are exactly those. So a row still in the
    block it was in at the compaction has that block's masked positions in columns 0 .. n0 - 1; a row k0 < k
    blocks on holds n0 + (k - k0 - 1) x block_size columns of revealed positions before its block and the block
    after them. ``extra``: window positions past the block's end (Dream's window under prediction alignment, 1).
    Rounded up as storage widths are (:func:`column_bucket`, at most ``length``, the response's positions)."""
    most = 0
    for k, k0, n0 in zip(blocks, compacted_blocks, compacted_masked, strict=True):
        most = max(most, n0 if k == k0 else n0 + (k - k0) * block_size)
    return column_bucket(most + extra, length)
