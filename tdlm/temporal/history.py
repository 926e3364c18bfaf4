"""History policies (Table 2 of the TDLM paper) and the step-wise temporal cache.

A policy decides which earlier evaluations J_p(i) a masked position may retrieve (Eq. 8-9):

* ``full``     - every earlier evaluation j < i (the paper's main setting);
* ``last:k``   - the k most recent earlier evaluations, i-k <= j < i;
* ``current``  - only the current evaluation's own entry j = i (plus the sink); the learned
  Q/K/sink gate is kept but no history is used;
* ``latent:M`` - bounded memory: M latent vectors per position and temporal layer, folded forward by
  a Perceiver block after each evaluation (``tdlm/temporal/perceiver.py``). The query reads the latents, not
  the entries, so memory is constant in the number of steps. This policy is recurrent: it has no
  parallel mask, and needs perceiver weights trained with it (:class:`tdlm.temporal.latent_cache.LatentCache`).

In every case an entry j is usable at position p only if p was masked in S_j (A_{p,i,j} of
Section 2.3). The same policy object gives the parallel mask over K sampled states and the window
of cache entries in step-wise decoding, so Prop. 2 holds policy by policy (``latent:M`` instead
evaluates sampled states one after another, which is the step-wise computation itself).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from tdlm.errors import TDLMError


@dataclass(frozen=True)
class HistoryPolicy:
    kind: str  # "full" | "last" | "current" | "latent"
    k: int = 0  # k of last:k, M of latent:M

    @classmethod
    def parse(cls, spec: str | HistoryPolicy) -> HistoryPolicy:
        if isinstance(spec, HistoryPolicy):
            return spec
        s = str(spec).strip().lower()
        if s in ("full", "current"):
            return cls(s)
        m = re.fullmatch(r"(last|latent):(\d+)", s)
        if m and int(m.group(2)) >= 1:
            return cls(m.group(1), int(m.group(2)))
        raise TDLMError(
            f"history policy {spec!r} not understood; expected 'full', 'current', 'last:k' or 'latent:M' (k, M >= 1)"
        )

    def __str__(self) -> str:
        return f"{self.kind}:{self.k}" if self.kind in ("last", "latent") else self.kind

    @property
    def uses_cache(self) -> bool:
        return self.kind != "current"

    @property
    def recurrent(self) -> bool:
        """True for ``latent:M``: the state after S_i depends on S_i, so inputs are evaluated in order."""
        return self.kind == "latent"

    @property
    def num_latents(self) -> int:
        """M of ``latent:M``; 0 for the entry-based policies."""
        return self.k if self.kind == "latent" else 0

    def parallel_mask(self, K: int, device: torch.device | None = None) -> torch.Tensor:
        """(K_i, K_j) bool: which sampled input j may serve input i, before the m_{j,p} factor."""
        if self.recurrent:
            raise TDLMError(f"history {self} is recurrent and has no parallel mask; evaluate the states in order")
        i = torch.arange(K, device=device)[:, None]
        j = torch.arange(K, device=device)[None, :]
        if self.kind == "full":
            return j < i
        if self.kind == "last":
            return (j < i) & (j >= i - self.k)
        return j == i

    def window(self, n: int) -> tuple[int, int]:
        """Cache entries [start, n) visible to the next evaluation, given n stored entries."""
        if self.recurrent:
            raise TDLMError(f"history {self} stores latents, not entries; it has no window")
        if self.kind == "full":
            return 0, n
        if self.kind == "last":
            return max(0, n - self.k), n
        return n, n


def _grid(slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and position indices (B, 1), (1, N) that pair with a (B, N) slot index in advanced indexing."""
    return (torch.arange(slot.shape[0], device=slot.device)[:, None],
            torch.arange(slot.shape[1], device=slot.device)[None])


MIN_SLOTS = 8  # the smallest history storage; capacities double from here (bucket sizes)
COLUMN_STEP = 8  # storage columns (positions held) shrink in multiples of this


def column_bucket(masked: int, length: int) -> int:
    """Storage columns for a batch whose row with the most masked response positions has ``masked`` of them:
    ``masked`` rounded up to a multiple of 8 (at least 8), at most ``length`` (:meth:`TemporalCache.compact`)."""
    return min(length, max(COLUMN_STEP, -(-masked // COLUMN_STEP) * COLUMN_STEP))


def slot_bucket(entries: int, most: int | None = None) -> int:
    """Slots to hold ``entries`` entries: the smallest of 8, 16, 32, ... that does, capped at ``most``.

    History storage only takes these sizes, so a compiled step sees a bounded number of shapes
    (ceil(log2(most / 8)) + 1 of them) while attention reads about the filled part, not ``most`` slots."""
    cap = MIN_SLOTS
    while cap < entries:
        cap *= 2
    return cap if most is None else max(1, min(cap, most))


@dataclass
class LayerHistory:
    """Keys and values of one temporal layer in the attention's layout: ``kv`` (B, N, 2, M, 1 + C, d_h), keys at
    [:, :, 0] and values at [:, :, 1]. Slot 0 is the sink's zero key and value (Eq. 8-9), written once when the
    storage is allocated; entries live in slots 1..C. ``kv[:, :, 0].flatten(0, 1)`` is the (B N, M, 1 + C, d_h)
    key tensor of ``scaled_dot_product_attention`` as a view: nothing is copied to attend."""

    kv: torch.Tensor | None = None


@dataclass
class TemporalCache:
    """Step-wise temporal memory of one decoding request batch.

    Every response position p has its own ring of C slots per temporal layer: slot
    ``count[b, p] % C`` receives the rotated key and value of h_{l,p}(S_i) when evaluation i computes p
    while p is masked, and ``count`` then advances for p alone. So ``last:k`` (at most k slots) keeps the k most
    recent evaluations *of that position* in every cache mode: under the dual cache a position outside the active
    block is not computed by a window step and keeps its entries (Table 2's restriction, position by
    position). ``full`` needs C >= the number of evaluations: :meth:`TDLM.new_cache` with ``length``
    bounds C by ``length`` (decoding reveals at least one token per evaluation).

    Storage is in the attention's layout (:class:`LayerHistory`) and sized by the host, before an evaluation
    that could overflow it, to :func:`slot_bucket` of the entries a position can hold (8, 16, 32, ... slots, at
    most k for ``last:k`` and ``max_capacity`` for ``full``): attention reads the filled part, rounded up to a
    bucket, and growing copies the storage once per bucket, not once per evaluation. Below ``max_capacity``
    no ring has wrapped (count <= evaluations < C), so a slot keeps its meaning when the storage grows.

    Validity is a mask shared by the temporal layers (an evaluation writes the same positions at every layer):
    ``valid`` (B, W, 1 + C) bool, column 0 the sink (always True), True where a slot holds a usable entry
    (A_{p,i,j} of Section 2.3). Between bucket changes the shapes of one request batch never change and a
    compiled step neither recompiles nor syncs. Revealing a position invalidates all of its entries; changing
    blocks resets nothing. Unwritten slots hold zeros (a masked-out zero entry contributes exactly 0).

    Storage columns: the storage holds W <= N *columns*, ``cols`` (B, W) the response position each holds (N: none).
    At allocation W = N and column w holds position w. Eq. 2 multiplies the correction by m_{i,p}, and a revealed
    position is never masked again, so its history is never read or written again: :meth:`compact`, called by the
    decoding loop between evaluations, drops such columns once the row with the most masked positions fits in
    fewer (:func:`column_bucket`), and every per-position cost of a temporal layer (projections, attention, entry
    writes) then scales with the masked positions instead of N. Results are unchanged: the attention of a
    position reads only its own column. ``count``, ``valid`` and the storage are indexed by column; the
    readers :meth:`entry_validity` and :meth:`valid_entries` answer by position. A window step of the prefix /
    dual cache reads and writes the first ``front`` columns (:meth:`set_front`), a view, when the loop can promise
    that they hold every position it computes.
    """

    batch_size: int
    policy: HistoryPolicy
    prompt_len: int | None = None
    length: int | None = None  # response positions N
    steps: int = 0  # evaluations seen (host counter; never read inside a compiled step)
    capacity: int = 0  # C: slots per position and layer (0 before allocation)
    max_capacity: int | None = None  # the most C may grow to (None: unbounded ``full``)
    count: torch.Tensor | None = None  # (B, W) int64: entries ever written per column's position
    valid: torch.Tensor | None = None  # (B, W, 1 + C) bool, slot 0 the sink
    cols: torch.Tensor | None = None  # (B, W) int64: the response position each storage column holds (N: none)
    layers: dict[int, LayerHistory] = field(default_factory=dict)
    # (B, w) view cols[:, :w]: the columns that hold every masked position the next window step computes, set by
    # the decoding loop (:meth:`set_front`); None: a window step looks its positions' columns up instead
    front: torch.Tensor | None = None
    # Host promises of the decoding loop that the storage columns are rows of h in order, so a temporal layer reads
    # a slice of h and adds its correction in place instead of gathering and scattering rows (:meth:`claim_rows`):
    # ``suffix``: column w of every row holds response position N - W + w; ``front_aligned``: the front's column w
    # holds the position of a dual window's row (logit shift - alignment offset) + w.
    suffix: bool = False
    front_aligned: bool = False
    # The static storage plan (:meth:`allocate` with ``static=True``): every tensor at its final size and a fixed
    # address for the whole decode, written in place only (no bucket growth, no compaction, rows stay).
    static: bool = False

    def check(self, batch_size: int, prompt_len: int, length: int) -> None:
        if batch_size != self.batch_size:
            raise TDLMError(f"cache was created for batch size {self.batch_size}; got a batch of {batch_size}")
        if self.prompt_len is None:
            self.prompt_len, self.length = prompt_len, length
        elif (prompt_len, length) != (self.prompt_len, self.length):
            raise TDLMError(
                f"cache holds prompt_len={self.prompt_len} and {self.length} response positions; "
                f"got prompt_len={prompt_len} with {length} (use a new cache per request batch)"
            )

    @property
    def n(self) -> int:
        """Entries a position that was computed at every evaluation holds now (min(steps, C))."""
        return min(self.steps, self.capacity) if self.layers else 0

    def _most(self) -> int | None:
        return self.policy.k if self.policy.kind == "last" else self.max_capacity

    def allocate(self, layers, length: int, heads: int, head_dim: int, dtype: torch.dtype, device,
                 capacity: int | None = None, static: bool = False) -> None:  # fmt: skip
        """Allocate zeroed storage for ``layers`` at once, the first bucket (:func:`slot_bucket`) of a history of
        at most ``capacity`` entries (``full``; None: unbounded) or k (``last:k``).

        ``static``: the final size at once, C = min(k or ``capacity``, ``length``) slots (an evaluation writes a
        position at most once and reveals at least one of the ``length`` positions, so no position is written more
        than ``length`` times and only ``last:k``'s ring of k wraps), each tensor marked with
        ``torch._dynamo.mark_static_address``: what CUDA-graph trees need to replay a step that writes it in place."""
        if not self.policy.uses_cache:
            return
        if self.policy.kind == "full":
            if capacity is not None and capacity < 1:
                raise TDLMError(f"history {self.policy} needs a capacity >= 1 (the most evaluations); got {capacity}")
            if static and capacity is None:
                raise TDLMError(f"a static history {self.policy} needs a capacity (the most evaluations); got None")
            self.max_capacity = capacity
        B, C = self.batch_size, slot_bucket(1, self._most())
        if static:
            C = min(self._most(), length)
        self.capacity, self.length = C, length
        self.count = torch.zeros((B, length), dtype=torch.long, device=device)
        self.cols = torch.arange(length, device=device).expand(B, length).contiguous()
        self.valid = torch.zeros((B, length, 1 + C), dtype=torch.bool, device=device)
        self.valid[:, :, 0] = True
        for layer in layers:
            self.layers[layer] = LayerHistory(
                torch.zeros((B, length, 2, heads, 1 + C, head_dim), dtype=dtype, device=device))
        self.static = static
        if not static:
            self._slots_dynamic()
            return
        for t in self._tensors():
            torch._dynamo.mark_static_address(t)

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor the history holds: what a step reads and writes."""
        return [t for t in (self.count, self.valid, self.cols, *(lh.kv for lh in self.layers.values()))
                if t is not None]

    def reset(self) -> None:
        """Empty a static history in place for the next decode of its batch size: the same tensors at the same
        addresses, as :meth:`allocate` left them (zero entries and counts, only the sink valid, column w holding
        position w)."""
        if not self.static:
            raise TDLMError("reset() empties a static history in place; a dynamic one is made anew per decode")
        self.count.zero_()
        self.valid.zero_()
        self.valid[:, :, 0] = True
        self.cols.copy_(torch.arange(self.cols.shape[1], device=self.cols.device).expand_as(self.cols))
        for lh in self.layers.values():
            lh.kv.zero_()
        self.steps, self.prompt_len = 0, None
        self.front, self.suffix, self.front_aligned = None, False, False

    def _slots_dynamic(self) -> None:
        """Tell torch.compile that the slot count varies (the buckets), so one graph per step kind serves all of
        them instead of one per bucket, or a second when dynamo would notice the change itself."""
        for lh in self.layers.values():
            torch._dynamo.maybe_mark_dynamic(lh.kv, 4)
            torch._dynamo.maybe_mark_dynamic(lh.kv, 1)  # the columns (compact)
        torch._dynamo.maybe_mark_dynamic(self.valid, 2)
        for t in (self.valid, self.count, self.cols):
            torch._dynamo.maybe_mark_dynamic(t, 1)

    def reserve(self, evaluations: int) -> None:
        """Host side, before an evaluation: grow the storage to the bucket that holds ``evaluations`` entries
        per position (at most ``max_capacity``, or k). The only copy of the history, once per bucket. A static
        history has its final size already."""
        if not self.layers or self.static:
            return
        want = slot_bucket(evaluations, self._most())
        if want <= self.capacity:
            return
        grow = want - self.capacity
        for lh in self.layers.values():
            lh.kv = torch.cat([lh.kv, lh.kv.new_zeros((*lh.kv.shape[:4], grow, lh.kv.shape[5]))], 4)
        self.valid = torch.cat([self.valid, self.valid.new_zeros((*self.valid.shape[:2], grow))], 2)
        self.capacity = want
        self._slots_dynamic()

    @property
    def width(self) -> int:
        """W: storage columns per row (N until :meth:`compact`)."""
        return 0 if self.cols is None else self.cols.shape[1]

    def compact(self, still: torch.Tensor, most: int) -> bool:
        """Host side, between evaluations: keep the storage columns of the positions masked in ``still`` (B, N)
        bool (the next input's m_{i,p}), in position order, in :func:`column_bucket` of ``most`` columns (the
        most masked positions of a row, known on the host: no device read here); the other columns of a row
        are empty (position N, no valid entry). Nothing is done unless that is fewer columns than now. A dropped
        position was revealed: it is never masked again, so Eq. 2 never corrects it and its entries are never
        read (A_{p,i,j} = 0) or written again. Returns whether it compacted. One gather of the storage, at most
        N / 8 times per decode. A static history keeps its columns (a gather would move the storage)."""
        if not self.layers or self.cols is None or self.static:
            return False
        N, W = self.length, self.width
        width = column_bucket(most, N)
        if width >= W:
            return False
        keep = still.gather(1, self.cols.clamp(max=N - 1)) & (self.cols < N)  # (B, W)
        idx = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :width]  # kept columns first
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None]
        kept = keep.gather(1, idx)  # (B, width)
        self.cols = torch.where(kept, self.cols.gather(1, idx), N)
        self.count = self.count.gather(1, idx)
        self.valid = self.valid[rows, idx] & (kept[:, :, None] | self.sink_column())
        for lh in self.layers.values():
            lh.kv = lh.kv[rows, idx]
        self.front = None  # promises about the old columns
        self.suffix = self.front_aligned = False
        self._slots_dynamic()
        return True

    def claim_rows(self, suffix: bool) -> None:
        """Host side: promise (or withdraw) that column w of every row holds response position N - W + w, the
        last W positions in order, which the decoding loop knows from its blocks (a single row under the dual cache).
        A full forward's temporal layer then reads its columns' hidden states as the slice h[:, b - W : b] of
        the response rows and adds Eq. 2 into that slice in place, where it would gather them and scatter-add the
        correction back: two ops fewer per temporal layer and their traffic, the same values (the same rows).
        Inductor on a CPU already fuses the two into neighbouring kernels (docs/decoding.md)."""
        self.suffix = bool(suffix) and self.cols is not None

    def set_front(self, columns: int | None, aligned: bool = False) -> None:
        """Host side, before an evaluation: promise that the first ``columns`` storage columns of every row hold
        each masked position its next window step computes (None: no promise). The decoding loop knows this
        from its blocks (:func:`tdlm.decoding.step_groups.window_front`): columns are in position order and a row's
        masked positions are its active block's and everything after it, so the block's columns come first once
        the revealed positions before it have been compacted away. A window step then attends over a narrow
        view of the storage, ``kv[:, :columns]``, instead of gathering its positions' columns: no copy of the
        history per layer, and the temporal work scales with those columns, not the window's positions.

        ``aligned``: the loop also promises that front column w holds the position of window row s0 + w of a
        dual window step (s0 = the backbone's logit shift - the model's alignment offset; the rows stand for the
        block's positions in order), so a temporal layer reads the rows as a slice of h and corrects them in
        place (no gather, no scatter-add); the loop then passes at most the window's rows from s0."""
        self.front_aligned = False
        if columns is None or self.cols is None or not self.layers:
            self.front = None
            return
        self.front_aligned = aligned
        width = max(1, min(columns, self.width))
        if self.static:
            # A compiled step's inputs must be held tensors under CUDA-graph trees, which copy any unmarked input at
            # every replay: the columns themselves when the front is all of them (the static prefix plan's front),
            # else a view at their address, marked.
            self.front = self.cols if width == self.width else self.cols[:, :width]
            if width != self.width:
                torch._dynamo.mark_static_address(self.front)
            return
        self.front = self.cols[:, :width]
        torch._dynamo.maybe_mark_dynamic(self.front, 1)

    def held(self, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The storage column of each response position in ``positions`` (b, P) of batch ``rows`` (None: all),
        W where the position has no column (it was revealed and dropped)."""
        cols = self.cols if rows is None else self.cols[rows]
        W, N = cols.shape[1], self.length
        where = torch.full((cols.shape[0], N + 1), W, dtype=torch.long, device=cols.device)
        where.scatter_(1, cols, torch.arange(W, device=cols.device).expand_as(cols))
        return where.gather(1, positions)

    def by_position(self, t: torch.Tensor) -> torch.Tensor:
        """t (B, W, ...) by column -> (B, N, ...) by position, zeros where no column holds the position."""
        out = t.new_zeros((t.shape[0], self.length + 1, *t.shape[2:]))
        out[torch.arange(t.shape[0], device=t.device)[:, None], self.cols] = t
        return out[:, : self.length]

    def visible(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """History of ``layer`` in the attention's layout: kv (B, W, 2, M, 1 + C, d_h) and the shared validity
        (B, W, 1 + C), sink slot first, by storage column (``cols``); None before allocation."""
        lh = self.layers.get(layer)
        if lh is None or lh.kv is None:
            return None
        return lh.kv, self.valid

    def slots(self, written: torch.Tensor) -> torch.Tensor:
        """(B, N) slot of this evaluation's entry per position: its ring's next slot (1 + count % C) where
        ``written``, else the sink's slot 0, which receives zeros and so stays the zero key / value."""
        count = self.count[:, : written.shape[1]]  # the first columns only after a window step over a front
        return torch.where(written, count % (self.valid.shape[2] - 1) + 1, 0)

    def append(self, layer: int, kv: torch.Tensor, written: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """Store this evaluation's entry for ``layer``: kv (B, N, 2, M, d_h) (keys, values) where ``written``
        (B, N) (masked and computed), each position in its own next slot (``slot``: :meth:`slots`, shared by the
        layers of one evaluation); other slots and positions are left as they are. Validity and the counts advance
        in :meth:`commit`, once for all layers."""
        if not self.policy.uses_cache:
            return
        lh = self.layers[layer]
        slot = self.slots(written) if slot is None else slot
        value = torch.where(written[:, :, None, None, None], kv, 0)  # (B, n, 2, M, d_h), n <= W columns from 0
        if torch.compiler.is_compiling():
            # inductor lowers an in-place scatter_ on a graph input to a copy of the whole storage (44 ms per layer
            # at the demo's shape) and an index_put_ to a store of the written slots (0.4 ms)
            b, n = _grid(slot)
            lh.kv[b, n, :, :, slot] = value
        else:  # eager: scatter_ is the faster of the two (1.5 against 2.4 ms); into a view of the first n columns
            lh.kv[:, : value.shape[1]].scatter_(
                4, slot[:, :, None, None, None, None].expand(*value.shape[:4], 1, value.shape[4]), value.unsqueeze(-2))

    def commit(self, masked: torch.Tensor, written: torch.Tensor | None = None,
               slot: torch.Tensor | None = None) -> None:
        """Finish an evaluation whose input had ``masked`` (B, N) response positions, of which it computed and
        stored ``written`` (default: all masked) in ``slot`` (:meth:`slots`). Tensor work only; the host counter
        ``steps`` is advanced by the caller (:meth:`TDLM.forward_groups`), so a compiled evaluation never reads a
        changing int."""
        if not self.policy.uses_cache or not self.layers:
            return
        written = masked if written is None else written
        slot = self.slots(written) if slot is None else slot
        # After a window step over a front (:meth:`set_front`) ``written`` covers the first n columns only.
        n = written.shape[1]
        # unwritten positions set the sink's column, True already (index_put_ when compiling: see append)
        if torch.compiler.is_compiling():
            b, c = _grid(slot)
            self.valid[b, c, slot] = True
        else:
            self.valid[:, :n].scatter_(2, slot[:, :, None], True)
        self.count[:, :n] += written
        # A position revealed in this input is never masked again: its history is dead (the sink stays). Over
        # every column (the others are masked or dead already), since inductor's CPU code for this AND into a
        # slice of a bool tensor does not compile (torch 2.13: VecMask<int> / VecMask<float> in one ?:).
        self.valid &= masked[:, :, None] | self.sink_column()

    def sink_column(self) -> torch.Tensor:
        """(1 + C,) bool, True at the sink's column 0 only."""
        return torch.arange(self.valid.shape[2], device=self.valid.device) == 0

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (finished requests leave the batch)."""
        if self.static:
            raise TDLMError("a static history keeps every row in place until the batch ends; select() would move it")
        index = index.to(torch.long)
        for lh in self.layers.values():
            if lh.kv is not None:
                lh.kv = lh.kv.index_select(0, index.to(lh.kv.device))
        for name in ("count", "valid", "cols"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index.to(t.device)))
        self.batch_size = int(index.numel())
        self.front = None  # a promise about the old rows
        self.front_aligned = False  # (the suffix holds row by row: it stays)
        if self.layers:
            self._slots_dynamic()

    def extend(self, n: int) -> None:
        """Admit ``n`` new rows at the end of the batch (the decode engine refilling freed rows; dynamic storage): each
        with every response position in its own column (position w in column w), no entry and only the sink valid, as
        :meth:`allocate` leaves a row. A compacted storage is widened back to N columns first (:meth:`_widen`).
        Promises about the columns (:meth:`set_front`, :meth:`claim_rows`) are withdrawn."""
        if self.static:
            raise TDLMError("a static history keeps its rows in place; admit into a freed row with reset_rows()")
        if n < 1:
            return
        self.batch_size += n
        self.front, self.suffix, self.front_aligned = None, False, False
        if not self.layers:  # not allocated yet: allocation sizes it for the whole batch
            return
        self._widen()
        N, dev = self.length, self.cols.device
        self.cols = torch.cat([self.cols, torch.arange(N, device=dev).expand(n, N)], 0)
        self.count = torch.cat([self.count, self.count.new_zeros((n, N))], 0)
        self.valid = torch.cat([self.valid, self.sink_column().expand(n, N, -1)], 0)
        for lh in self.layers.values():
            lh.kv = torch.cat([lh.kv, lh.kv.new_zeros((n, *lh.kv.shape[1:]))], 0)
        self._slots_dynamic()

    def _widen(self) -> None:
        """A compacted storage back to N columns, the old rows' new columns empty (position N), as compaction leaves
        the columns of a row with fewer masked positions (it compacts again when the loop next can): a new request
        needs a column for each of its N positions."""
        N, W = self.length, self.width
        if W >= N:
            return
        pad = N - W
        self.cols = torch.cat([self.cols, self.cols.new_full((self.cols.shape[0], pad), N)], 1)
        self.count = torch.cat([self.count, self.count.new_zeros((self.count.shape[0], pad))], 1)
        self.valid = torch.cat([self.valid, self.sink_column().expand(self.valid.shape[0], pad, -1)], 1)
        for lh in self.layers.values():
            lh.kv = torch.cat([lh.kv, lh.kv.new_zeros((lh.kv.shape[0], pad, *lh.kv.shape[2:]))], 1)
        self._slots_dynamic()

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empty the batch rows ``rows`` in place for new requests in freed rows (the decode engine's refill): no entry,
        only the sink valid, column w holding position w, as :meth:`allocate` leaves a row; the other rows are
        unchanged. A static history keeps every address. A dynamic one is first widened back to N columns if it
        compacted (:meth:`_widen`, the one copy), and withdraws its promises about the columns: the new row's count
        starts from 0, so it does not inherit the old row's entries, and a refill costs no copy of the storage (a
        finished row leaving and a new one joining would copy it twice, :meth:`select` and :meth:`extend`)."""
        if not self.layers:
            return
        if not self.static:
            self._widen()
            self.front, self.suffix, self.front_aligned = None, False, False
            self.cols[rows] = torch.arange(self.length, device=self.cols.device)
        self.count[rows] = 0
        self.valid[rows] = self.sink_column()
        for lh in self.layers.values():
            lh.kv[rows] = 0

    def entry_validity(self) -> torch.Tensor | None:
        """(B, C, N) bool: which slot of each position holds a usable entry (the sink left out)."""
        return None if self.valid is None else self.by_position(self.valid[:, :, 1:]).transpose(1, 2)

    def valid_entries(self) -> torch.Tensor | None:
        """(B, N) number of usable history entries per position."""
        return None if self.valid is None else self.by_position(self.valid[:, :, 1:].sum(-1))

    def nbytes(self) -> int:
        tensors = (self.count, self.valid, self.cols)
        total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        for lh in self.layers.values():
            if lh.kv is not None:
                total += lh.kv.numel() * lh.kv.element_size()
        return total
