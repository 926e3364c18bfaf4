"""Storage plans of the step-wise temporal history: where a decode's entries live and how one evaluation's rows
reach them.

The operator (:mod:`tdlm.temporal.model`, Eq. 2 and 7-10) reads a history and writes one entry per masked position
and temporal layer. This module answers the storage questions around it, so the operator reads like the paper:

* how much memory a history takes (:func:`history_bytes`) and which cache a policy needs (:func:`make_cache`);
* which storage column each of a group's rows reads and writes (:func:`group_columns`, :func:`window_slots`):
  the cache may hold fewer columns than response positions (:meth:`TemporalCache.compact`), a window step of
  the spatial KV cache computes only its window, and a batch may be split into row groups;
* how the groups' entries of one evaluation are merged and written, once for the whole batch
  (:func:`write_entries`, :func:`merge_rows`).

The cache itself (ring slots, validity, counts, columns, bucket growth) is :class:`tdlm.temporal.history.TemporalCache`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tdlm.errors import TDLMError
from tdlm.models.kv_cache import KVStep
from tdlm.temporal.history import HistoryPolicy, TemporalCache
from tdlm.temporal.latent_cache import LatentCache


def make_cache(policy: HistoryPolicy, batch_size: int) -> TemporalCache:
    """An empty cache of the kind ``policy`` needs (latents for ``latent:M``, entries otherwise)."""
    cls = LatentCache if policy.recurrent else TemporalCache
    return cls(batch_size=batch_size, policy=policy)


class StaticHistories:
    """The static storage plan's histories of one model: one per (history policy, batch size, response length,
    dtype, device), allocated once at its final size (:meth:`TemporalCache.allocate` with ``static=True``) and
    emptied in place for every later decode of that bucket (:meth:`TemporalCache.reset`), so a compiled step sees
    the same tensors at the same addresses in every decode. Memory: the held histories' :meth:`nbytes`, kept for
    as long as the model lives (one per bucket decoded)."""

    def __init__(self) -> None:
        self.held: dict[tuple, TemporalCache] = {}

    def history(self, model, batch_size: int, length: int | None) -> TemporalCache:
        """The held history of a TDLM ``model`` for this batch size and response ``length``, emptied; on first use
        a new one at its final size."""
        policy = model.policy
        if length is None or policy.recurrent:
            raise TDLMError(f"a static history needs the response length and an entry-based history; got "
                            f"length={length!r}, history {policy}")  # fmt: skip
        p = next(model.temporal.parameters())
        key = (str(policy), batch_size, length, p.dtype, p.device)
        cache = self.held.get(key)
        if cache is None:
            cache = make_cache(policy, batch_size)
            cache.allocate(model.layer_ids, length, model.config.heads, model.config.head_dim, p.dtype, p.device,
                           capacity=length, static=True)  # fmt: skip
            self.held[key] = cache
        else:
            cache.reset()
        return cache

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.held.values())


def history_bytes(policy: HistoryPolicy, batch_size: int, length: int, steps: int, layers: int, heads: int,
                  head_dim: int, hidden_size: int, num_latents: int, element_size: int) -> int:  # fmt: skip
    """``cache.nbytes()`` after ``steps`` evaluations of ``length`` response positions.

    Entry-based policies store, per layer, the sink's zero slot and C entry slots of key + value (2 d_t
    each), plus per position one validity flag per slot (shared by the layers), an int64 write count and the
    int64 position of its storage column;
    C = max(8, 2^ceil(log2 steps)) for ``full`` (storage doubles), the same capped at k for ``last:k``;
    ``current`` stores nothing. ``latent:M`` stores M d per position and layer, whatever ``steps`` is.
    (A cache made with ``TDLM.new_cache(B, length)`` caps ``full``'s C at ``length``.)
    """
    if steps <= 0 or not policy.uses_cache:
        return 0
    B, N, L_t = batch_size, length, layers
    if policy.recurrent:  # latents + alive flags (B, N) + r_last (B,) int64
        return L_t * B * N * num_latents * hidden_size * element_size + B * N + B * 8
    d_t = heads * head_dim
    cap = max(8, 1 << (steps - 1).bit_length())
    cap = min(cap, policy.k) if policy.kind == "last" else cap
    return L_t * B * N * 2 * (1 + cap) * d_t * element_size + B * N * (1 + cap) + 2 * B * N * 8


def merge_rows(parts: list[tuple[torch.Tensor | None, torch.Tensor]], B: int) -> torch.Tensor:
    """Tensors (b_g, ...) of row groups -> (B, ...); a single group of all rows is returned as is."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    first = parts[0][1]
    out = first.new_empty((B, *first.shape[1:]))
    for rows, t in parts:
        out[rows] = t
    return out


def history_rows(t: torch.Tensor, rows: torch.Tensor | None, j: torch.Tensor | None) -> torch.Tensor:
    """History t (B, N, ...) of ``rows`` (None: all) at response positions ``j`` (b, W) (None: all N); the whole
    storage itself (no copy) when both are None."""
    if j is None:
        return t if rows is None else t[rows]
    ri = torch.arange(j.shape[0], device=j.device) if rows is None else rows
    return t[ri[:, None], j]  # (b, W, ...)


def merge_entries(parts: list, B: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def masked_by_column(masked: torch.Tensor, cache: TemporalCache) -> torch.Tensor:
    """m_{i,p} (B, N) by position -> (B, W) by storage column (False where a column holds no position)."""
    if cache.cols is None:
        return masked
    N = masked.shape[1]
    return masked.gather(1, cache.cols.clamp(max=N - 1)) & (cache.cols < N)


def write_entries(cache: TemporalCache, pending: dict[int, list], masked: torch.Tensor) -> None:
    """Write one evaluation's entries, every group's part of every layer (``pending``: layer -> parts of
    :func:`merge_entries`), in the ring slots of the positions they were computed for, then commit the evaluation
    (validity and counts) once for all layers. ``masked`` (B, W) by storage column (:func:`masked_by_column`)."""
    written, slot = None, None
    for layer, parts in pending.items():
        kv, written = merge_entries(parts, masked.shape[0], cache.width)
        slot = cache.slots(written) if slot is None else slot  # the same columns at every layer
        cache.append(layer, kv, written, slot)
    cache.commit(masked, written, slot)


def window_slots(kv: KVStep | None, prompt_len: int, L: int, offset: int, cache: TemporalCache | None = None,
                 rows: torch.Tensor | None = None):  # fmt: skip
    """For a window step: (j, inside, dump, col) (b, W_win) - the response position j each window row stands
    for, whether it is one and has a storage column, the scatter target (its column; the cache's width W
    for the others, dropped afterwards) and its column clamped to a valid index. None otherwise. ``offset``: the
    model's alignment offset (h at p - offset stands for token p)."""
    if kv is None or kv.refresh:
        return None
    N = L - prompt_len
    j = kv.positions() + offset - prompt_len
    inside = (j >= 0) & (j < N)
    j = j.clamp(0, N - 1)
    if cache is None or cache.cols is None:
        return j, inside, torch.where(inside, j, N), j
    col = cache.held(j, rows)
    inside = inside & (col < cache.width)
    return j, inside, torch.where(inside, col, cache.width), col.clamp(max=cache.width - 1)


class GroupColumns(NamedTuple):
    """Where one group's temporal rows meet the storage: the plan of :func:`group_columns`.

    Three cases. A full forward computes every storage column's position. A window step over the cache's front
    (:meth:`TemporalCache.set_front`) computes the first ``w`` columns, a narrow view of the storage. Any other
    window step computes its own rows, whose columns are looked up (``j``) and scattered to (``target``)."""

    m: torch.Tensor  # (b, n) m_{i,p} of each computed entry: masked and computed (Eq. 2's factor)
    pos: torch.Tensor | None  # (b, n) the hidden-state row of each column (None: rows 0..N in order)
    target: torch.Tensor | None  # (b, W_win) storage column each window row's entry goes to (None: 0.. in order)
    j: torch.Tensor | None  # (b, W_win) each window row's storage column, to read its history
    w: int | None  # the front's columns when the step reads the storage's first w columns (narrow), else None
    in_order: bool  # the columns are rows of h in order: read a slice, correct it in place (no gather / scatter)


def group_columns(cache: TemporalCache, rows: torch.Tensor | None, kv: KVStep | None, masked: torch.Tensor,
                  prompt_len: int, L: int, offset: int) -> GroupColumns:  # fmt: skip
    """The storage plan of one group's forward (:class:`GroupColumns`): which column each temporal row stands for.
    ``masked`` (b, N) the group's m_{i,p} by position; ``offset`` the model's alignment offset."""
    N = masked.shape[1]
    window = kv is not None and not kv.refresh
    front = cache.front if window and cache.policy.kind != "current" else None
    slots = None if front is not None else window_slots(kv, prompt_len, L, offset, cache, rows)
    # Full forwards compute every storage column's position: pos (b, W) (None: the cache has no columns, history
    # `current`: all N positions in order). A window step over the cache's front computes its first w columns:
    # pos (b, w) then indexes the window's rows. Otherwise a window step computes its own rows (slots) and looks
    # their columns up.
    cols = None if cache.cols is None or slots is not None else history_rows(cache.cols, rows, None)
    pos = None if cols is None else cols.clamp(max=N - 1)
    target = None
    if front is not None:
        cols = history_rows(front, rows, None)  # (b, w) positions of the first w columns
        row = cols - (kv.start + offset - prompt_len)[:, None]  # their window rows
        m = (row >= 0) & (row < kv.width) & (cols < N)  # in the window: computed
        m = m & masked.gather(1, cols.clamp(max=N - 1))  # masked and computed
        pos = row.clamp(0, kv.width - 1)
    elif slots is not None:
        m = slots[1] & masked.gather(1, slots[0])  # masked and computed
        target = slots[2]
    else:
        m = masked if cols is None else masked.gather(1, pos) & (cols < N)
    # The loop's host promises (TemporalCache.claim_rows / set_front(aligned=True)): the columns are rows of h in
    # order, so each temporal layer reads a slice of h and corrects it in place (no gather / scatter-add).
    if front is not None:
        in_order = cache.front_aligned and kv.cache.mode == "dual"
    else:
        in_order = slots is None and pos is not None and cache.suffix
    return GroupColumns(m, pos, target, None if slots is None else slots[3],
                        None if front is None else cols.shape[1], in_order)  # fmt: skip


def allowed_slots(cache: TemporalCache, rows: torch.Tensor | None, plan: GroupColumns) -> torch.Tensor:
    """(b, n, 1 + C) bool: the slots a group's temporal rows may attend to, shared by the temporal layers - valid
    entries of positions masked and computed now (A_{p,i,j} of Section 2.3), and the sink."""
    valid = cache.valid if plan.w is None else cache.valid[:, : plan.w]
    return history_rows(valid, rows, plan.j) & (plan.m.unsqueeze(-1) | cache.sink_column())


def layer_history(cache: TemporalCache, layer: int, rows: torch.Tensor | None,
                  plan: GroupColumns) -> torch.Tensor | None:  # fmt: skip
    """A group's view of ``layer``'s keys and values (b, n, 2, M, 1 + C, d_h): the storage itself or its first w
    columns, a view (no copy), unless a row group or a window without a front gathers its rows. None before
    allocation."""
    vis = cache.visible(layer)
    if vis is None:
        return None
    store = vis[0] if plan.w is None else vis[0][:, : plan.w]
    return history_rows(store, rows, plan.j)


def scatter_window_latents(lat: torch.Tensor, new: torch.Tensor, slots) -> torch.Tensor:
    """``latent:M`` after a window step: the window's updated latents ``new`` (b, W_win, M, d) written back into
    the latents of all positions ``lat`` (b, N, M, d); positions outside the window keep theirs, and window rows
    outside the response land in a dropped extra position."""
    N = lat.shape[1]
    ar = torch.arange(lat.shape[0], device=lat.device)[:, None]
    return torch.cat([lat, lat[:, :1]], 1).index_put((ar, slots[2]), new)[:, :N]
