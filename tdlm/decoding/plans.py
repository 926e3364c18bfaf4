"""The two storage plans of the decode engine (:func:`tdlm.decoding.loop.decode`): where the state that a step reads
and writes lives, and how a request joins a running batch and leaves it. The loop asks its plan; it has no storage
branch of its own.

Both hold a canvas of *slots* (token ids and attention mask (S, L), reveal steps (S, G), NFE (S,)), one request per
slot at a time, and the per-row state of the rows in the batch: the temporal history (policy ``tdlm``), the spatial
KV cache (``prefix`` / ``dual``) and the credit / soft state (:mod:`tdlm.decoding.reuse`).

* :class:`DynamicRows` (``storage="dynamic"``): the batch is the occupied slots, gathered for each evaluation. A
  finished row whose slot a waiting request takes at once stays in its batch row, and the request is written into
  that row in place (its per-row state emptied: no copy of the temporal history, the KV cache or the credit / soft
  state); a finished row that nobody replaces leaves (every per-row state keeps the other rows), and a request for
  a slot no row holds joins at the end (every per-row state extends by a row). The temporal history grows in slot
  buckets and compacts its columns.
* :class:`StaticSlots` (``storage="static"``): every tensor at its final size and one address for the bucket
  (tdlm/decoding/static_plan.py), which CUDA-graph trees need. The batch is every slot, always. A finished row stays
  in place, masked (nothing left to commit, no NFE), until a new request is written into its slot in place: its
  prompt, mask, reveal steps, NFE, history rows and credit / soft rows.
"""

from __future__ import annotations

import torch

from tdlm.decoding.reuse import reuse_for
from tdlm.decoding.static_plan import batch_bucket, prompt_bucket, static_canvas
from tdlm.models.kv_cache import SpatialKVCache


class DynamicRows:
    """Rows sized as the decode goes (module docstring)."""

    static = False

    def __init__(self, model, backbone, cfg, slots: int, canvas_len: int, device: torch.device) -> None:
        self.model, self.backbone, self.cfg, self.device = model, backbone, cfg, device
        G = cfg.gen_length
        self.ids = torch.full((slots, canvas_len), backbone.pad_token_id, dtype=torch.long, device=device)
        self.am = torch.zeros((slots, canvas_len), dtype=torch.long, device=device)
        self.reveal = torch.zeros((slots, G), dtype=torch.long, device=device)
        self.nfe = torch.zeros(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(0, dtype=torch.long, device=device)  # the batch's slots, in row order
        self.order: list[int] = []  # its host mirror
        self.cache = self.kv_cache = self.reuse = None
        # A single row under the dual cache compacts only when it changes block, and a row reveals only in its active
        # block, so its history's columns always hold the positions from its active block's start in order: the rows
        # of h that a temporal layer reads, a slice of h (TemporalCache.claim_rows / set_front(aligned=True)): no
        # gather of h and no scatter-add of the correction per temporal layer. Several rows sit in different blocks,
        # so a batch that started with one row withdraws the promise when another joins.
        self.in_order = False

    @staticmethod
    def shape(prompt_len: int, capacity: int) -> tuple[int, int]:
        """(canvas prompt length, slots) for prompts of at most ``prompt_len`` tokens decoded ``capacity`` at a time."""
        return prompt_len, capacity

    @property
    def slots(self) -> int:
        return self.ids.shape[0]

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The batch's rows of a per-slot tensor (a gather)."""
        return t[self.active]

    def free(self, rows: list) -> list[int]:
        """The slots of the finished rows kept for a refill (:meth:`staying`), in row order, then those no row of the
        batch holds."""
        taken = {r.slot for r in rows}
        return [r.slot for r in rows if r.done] + [s for s in range(self.slots) if s not in taken]

    @staticmethod
    def place(rows: list, new: list) -> None:
        """New rows replace the finished rows whose slots they take, in their batch rows; the others join at the end
        of the batch's host rows (as :meth:`admit` writes them in place or appends them to ``active``)."""
        at = {r.slot: i for i, r in enumerate(rows) if r.done}
        for r in new:
            if r.slot in at:
                rows[at[r.slot]] = r
            else:
                rows.append(r)

    @staticmethod
    def staying(rows: list, coming: int) -> list[int]:
        """The batch rows that stay after an evaluation: those still decoding and up to ``coming`` finished ones (the
        requests the next admission writes into their rows, in place: no per-row state is copied for them)."""
        done = [i for i, r in enumerate(rows) if r.done][:coming]
        return sorted([i for i, r in enumerate(rows) if not r.done] + done)

    def can_join(self, rows: int) -> bool:
        """Whether requests may join a batch of ``rows`` rows now: a recurrent ``latent:M`` history only into an empty
        batch (:meth:`tdlm.temporal.latent_cache.LatentCache.extend`)."""
        return rows == 0 or not (self.cfg.policy == "tdlm" and self.model.policy.recurrent)

    def admit(self, slots: list[int], ids: torch.Tensor, am: torch.Tensor) -> None:
        """Requests written into free ``slots``: their canvas rows ``ids`` / ``am`` (n, L) built on the host. A slot a
        finished batch row still holds (:meth:`staying`) keeps its batch row and has its per-row state emptied in
        place; the others join at the end of the batch, where the per-row state extends (or, into an empty batch,
        starts anew)."""
        cfg = self.cfg
        idx = torch.tensor(slots, dtype=torch.long).to(self.device)
        self.ids[idx], self.am[idx] = ids.to(self.device), am.to(self.device)
        self.reveal[idx] = 0
        self.nfe[idx] = 0
        row_of = {s: i for i, s in enumerate(self.order)}
        held = [row_of[s] for s in slots if s in row_of]
        if held:  # the KV cache needs nothing: a row's first evaluation is a refresh that writes all of its entries
            at = torch.tensor(held, dtype=torch.long).to(self.device)
            if self.cache is not None:
                self.cache.reset_rows(at)
            if self.reuse is not None:
                self.reuse.reset(at)
            if self.in_order and self.cache is not None:
                self.cache.claim_rows(False)
            self.in_order = False
        slots = [s for s in slots if s not in row_of]
        n = len(slots)
        if not n:
            return
        idx = torch.tensor(slots, dtype=torch.long).to(self.device)
        if self.active.numel() == 0:
            G = cfg.gen_length
            self.cache = self.model.new_cache(n, length=G) if cfg.policy == "tdlm" else None
            self.kv_cache = SpatialKVCache(cfg.cache, n) if cfg.cache != "none" else None
            self.reuse = reuse_for(cfg, self.backbone, n, G, self.device)
            self.in_order = self.cache is not None and cfg.cache == "dual" and n == 1
            if self.in_order:
                self.cache.claim_rows(self.cache.width == G)
        else:
            for state in (self.cache, self.kv_cache, self.reuse):
                if state is not None:
                    state.extend(n)
            if self.in_order and self.cache is not None:
                self.cache.claim_rows(False)
            self.in_order = False
        self.active = torch.cat([self.active, idx])
        self.order += slots

    def count(self, masked: torch.Tensor) -> None:
        """One NFE for every row of the batch."""
        self.nfe[self.active] += 1

    def reveal_rows(self) -> torch.Tensor:
        """The batch's reveal steps, to be updated and written back with :meth:`write`."""
        return self.reveal[self.active]

    def write(self, resp: torch.Tensor, reveal: torch.Tensor, prompt_len: int) -> None:
        """The batch's responses and reveal steps after an evaluation."""
        self.ids[self.active, prompt_len:] = resp
        self.reveal[self.active] = reveal

    def set_dual_front(self, front: int, most: int, window: int) -> None:
        """The temporal history's front for the next dual window step (:func:`tdlm.decoding.step_groups.window_front`):
        aligned rows for a batch of one row in order, else a view of ``front`` columns unless that is more than
        ``most`` (the step then gathers its positions' columns)."""
        if self.in_order:  # the block's columns are the window's rows from (logit shift - offset), in order
            self.cache.set_front(min(front, window), aligned=True)
        else:
            self.cache.set_front(front if front <= most else None)

    def compacted(self, left: list[int]) -> None:
        """After the history compacted: a batch of one row in order keeps the positions from its block's start."""
        if self.in_order:  # kept: the positions from the new block's start, W of them unless rounded up
            self.cache.claim_rows(self.cache.width == left[0])

    def leave(self, keep: list[int]) -> None:
        """Only the batch rows ``keep`` (positions in row order) stay; the others' slots are free."""
        if len(keep) == self.active.numel():
            return
        if not keep:  # the batch is empty: the next admission starts every per-row state anew
            self.active = self.active[:0]
            self.order = []
            self.cache = self.kv_cache = self.reuse = None
            return
        keep_t = torch.tensor(keep, dtype=torch.long).to(self.device)
        self.active = self.active[keep_t]
        self.order = [self.order[i] for i in keep]
        for state in (self.cache, self.kv_cache, self.reuse):
            if state is not None:
                state.select(keep_t)


class StaticSlots:
    """Every slot at a fixed address, rows kept in place (module docstring)."""

    static = True
    in_order = False

    def __init__(self, model, backbone, cfg, slots: int, canvas_len: int, device: torch.device) -> None:
        self.cfg = cfg
        G = cfg.gen_length
        held = static_canvas(backbone, slots, canvas_len, G, cfg.cache)
        self.ids, self.am, self.reveal, self.nfe = held.ids, held.attention_mask, held.reveal, held.nfe
        self.kv_cache = held.kv_cache
        self.cache = model.new_cache(slots, length=G, static=True) if cfg.policy == "tdlm" else None
        self.reuse = reuse_for(cfg, backbone, slots, G, device)
        self.device = device
        self.active = torch.arange(slots, device=device)
        self.fresh = True  # nothing admitted yet: the history was just emptied, the credit / soft state is new

    @staticmethod
    def shape(prompt_len: int, capacity: int) -> tuple[int, int]:
        """Buckets: prompts left-padded to a multiple of 32 tokens, slots a power of two (static_plan.py)."""
        return prompt_bucket(prompt_len), batch_bucket(capacity)

    @property
    def slots(self) -> int:
        return self.ids.shape[0]

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The batch is every slot: the tensor itself, at its fixed address."""
        return t

    def free(self, rows: list) -> list[int]:
        """The slots of finished rows; every slot before the first fill (row i is slot i)."""
        return [r.slot for r in rows if r.done] if rows else list(range(self.slots))

    @staticmethod
    def place(rows: list, new: list) -> None:
        """New rows replace the finished ones in their slots (row i is slot i); the first fill adds every slot."""
        if not rows:
            rows.extend(new)
            return
        for r in new:
            rows[r.slot] = r

    @staticmethod
    def staying(rows: list, coming: int) -> list[int]:
        """Every row stays in place."""
        return list(range(len(rows)))

    def can_join(self, rows: int) -> bool:
        return True

    def admit(self, slots: list[int], ids: torch.Tensor, am: torch.Tensor) -> None:
        """Requests (or, at the start, padding rows) written into ``slots`` in place: canvas rows ``ids`` / ``am``
        (n, L) built on the host, reveal steps and NFE zeroed, their history rows emptied and their credit / soft
        rows reset. The KV cache needs nothing: a row's first evaluation is a refresh that writes all of its keys
        and values."""
        if self.fresh and slots == list(range(self.slots)):  # the first fill: every slot (padding rows included)
            self.fresh = False
            self.ids.copy_(ids)
            self.am.copy_(am)
            self.reveal.zero_()
            self.nfe.zero_()
            return
        idx = torch.tensor(slots, dtype=torch.long).to(self.device)
        self.ids[idx], self.am[idx] = ids.to(self.device), am.to(self.device)
        self.reveal[idx] = 0
        self.nfe[idx] = 0
        if self.cache is not None:
            self.cache.reset_rows(idx)
        if self.reuse is not None:
            self.reuse.reset(idx)

    def count(self, masked: torch.Tensor) -> None:
        """A finished row that stays evaluates nothing of its own: no NFE."""
        self.nfe += masked.any(1)

    def reveal_rows(self) -> torch.Tensor:
        return self.reveal.clone()

    def write(self, resp: torch.Tensor, reveal: torch.Tensor, prompt_len: int) -> None:
        """In place, at the canvas's fixed addresses."""
        self.ids[:, prompt_len:].copy_(resp)
        self.reveal.copy_(reveal)

    def set_dual_front(self, front: int, most: int, window: int) -> None:
        """The window's columns looked up: one shape whatever the block (a static history never compacts)."""
        self.cache.set_front(None)

    def compacted(self, left: list[int]) -> None:
        return None  # a static history never compacts (TemporalCache.compact returns False)

    def leave(self, keep: list[int]) -> None:
        return None  # rows stay in place until a request is admitted into their slot
