"""History policies (Table 2 of the TDLM paper) and the step-wise temporal cache.

A policy decides which earlier evaluations J_p(i) a masked position may retrieve (Eq. 8-9):

* ``full``     - every earlier evaluation j < i (the paper's main setting);
* ``last:k``   - the k most recent earlier evaluations, i-k <= j < i;
* ``current``  - only the current evaluation's own entry j = i (plus the sink); the learned
  Q/K/sink gate is kept but no history is used;
* ``latent:M`` - bounded memory: M latent vectors per position and temporal layer, folded forward by
  a Perceiver block after each evaluation (``tdlm/temporal/perceiver.py``). The query reads the latents, not
  the entries, so memory is constant in the number of steps. This policy is recurrent: it has no
  parallel mask, and needs perceiver weights trained with it (:class:`LatentCache`).

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


@dataclass
class LayerHistory:
    """Keys/values of one temporal layer: (B, C, N, M, d_h) with validity (B, C, N); C = the capacity."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    valid: torch.Tensor | None = None


@dataclass
class TemporalCache:
    """Step-wise temporal memory of one decoding request batch.

    Every response position p has its own ring of C slots per temporal layer: slot
    ``count[b, p] % C`` receives the rotated key and value of h_{l,p}(S_i) when evaluation i computes p
    while p is masked, and ``count`` then advances for p alone. So ``last:k`` (C = k) keeps the k most recent
    evaluations *of that position* in every cache mode: under the dual cache a position outside the active
    block is not computed by a window step and keeps its entries (Table 2's restriction, position by
    position). ``full`` needs C >= the number of evaluations: :meth:`TDLM.new_cache` with ``length``
    preallocates C = ``length`` (decoding reveals at least one token per evaluation); without it storage
    starts at 8 slots and doubles on the host before an evaluation that could overflow it.

    Validity is a mask, never a shape: every evaluation reads all C slots and attends where ``valid``
    (A_{p,i,j} of Section 2.3), so the shapes of one request batch never change and a compiled step
    neither recompiles nor syncs. Revealing a position invalidates all of its entries; changing blocks
    resets nothing. Unwritten slots hold zeros (a masked-out zero entry contributes exactly 0).
    """

    batch_size: int
    policy: HistoryPolicy
    prompt_len: int | None = None
    length: int | None = None  # response positions N
    steps: int = 0  # evaluations seen (host counter; never read inside a compiled step)
    capacity: int = 0  # C: slots per position and layer (0 before allocation)
    count: torch.Tensor | None = None  # (B, N) int64: entries ever written per position
    layers: dict[int, LayerHistory] = field(default_factory=dict)

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

    def allocate(self, layers, length: int, heads: int, head_dim: int, dtype: torch.dtype, device,
                 capacity: int | None = None) -> None:  # fmt: skip
        """Allocate zeroed storage for ``layers`` at once: C = ``capacity`` (``full``), k (``last:k``)."""
        if not self.policy.uses_cache:
            return
        if self.policy.kind == "last":
            capacity = self.policy.k
        elif capacity is None or capacity < 1:
            raise TDLMError(f"history {self.policy} needs a capacity >= 1 (the most evaluations); got {capacity}")
        B, shape = self.batch_size, (self.batch_size, capacity, length, heads, head_dim)
        self.capacity = capacity
        self.count = torch.zeros((B, length), dtype=torch.long, device=device)
        for layer in layers:
            self.layers[layer] = LayerHistory(
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros((B, capacity, length), dtype=torch.bool, device=device),
            )

    def reserve(self, evaluations: int) -> None:
        """Host side, before an evaluation: grow ``full`` storage (doubling) so ``evaluations`` entries fit."""
        if self.policy.kind != "full" or not self.layers or evaluations <= self.capacity:
            return
        grow = self.capacity
        while self.capacity + grow < evaluations:
            grow *= 2
        for lh in self.layers.values():
            lh.keys = torch.cat([lh.keys, lh.keys.new_zeros((lh.keys.shape[0], grow, *lh.keys.shape[2:]))], 1)
            lh.values = torch.cat([lh.values, torch.zeros_like(lh.keys[:, self.capacity :])], 1)
            lh.valid = torch.cat([lh.valid, lh.valid.new_zeros((lh.valid.shape[0], grow, lh.valid.shape[2]))], 1)
        self.capacity += grow

    def visible(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Keys, values (B, C, N, M, d_h) and validity (B, C, N) of every slot; None before allocation."""
        lh = self.layers.get(layer)
        if lh is None or lh.keys is None:
            return None
        return lh.keys, lh.values, lh.valid

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, written: torch.Tensor) -> None:
        """Store this evaluation's entry for ``layer``: k, v (B, N, M, d_h) where ``written`` (B, N) (masked and
        computed), each position in its own next slot; other slots and positions are left as they are."""
        if not self.policy.uses_cache:
            return
        if layer not in self.layers:  # eager callers without preallocation: allocate on the first entry
            B, N, M, D = k.shape
            cap = 8 if self.policy.kind == "full" else self.policy.k
            if not self.layers:
                self.capacity = cap
                self.count = torch.zeros((B, N), dtype=torch.long, device=k.device)
            shape = (B, self.capacity, N, M, D)
            self.layers[layer] = LayerHistory(k.new_zeros(shape), v.new_zeros(shape),
                                              torch.zeros(shape[:3], dtype=torch.bool, device=k.device))  # fmt: skip
        lh = self.layers[layer]
        slot = (self.count % self.capacity)[:, None]  # (B, 1, N)
        w = written[:, None]  # (B, 1, N)
        lh.valid.scatter_(1, slot, w | lh.valid.gather(1, slot))
        ks = slot[..., None, None].expand(-1, -1, -1, *k.shape[2:])  # (B, 1, N, M, d_h)
        w5 = w[..., None, None]
        lh.keys.scatter_(1, ks, torch.where(w5, k[:, None], lh.keys.gather(1, ks)))
        lh.values.scatter_(1, ks, torch.where(w5, v[:, None], lh.values.gather(1, ks)))

    def commit(self, masked: torch.Tensor, written: torch.Tensor | None = None) -> None:
        """Finish an evaluation whose input had ``masked`` (B, N) response positions, of which it computed and
        stored ``written`` (default: all masked). Tensor work only; the host counter ``steps`` is advanced by
        the caller (:meth:`TDLM.forward_groups`), so a compiled evaluation never reads a changing int."""
        if not self.policy.uses_cache or not self.layers:
            return
        self.count += masked if written is None else written
        # A position revealed in this input is never masked again: its history is dead.
        for lh in self.layers.values():
            lh.valid &= masked[:, None, :]

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (finished requests leave the batch)."""
        index = index.to(torch.long)
        for lh in self.layers.values():
            if lh.keys is not None:
                lh.keys = lh.keys.index_select(0, index.to(lh.keys.device))
                lh.values = lh.values.index_select(0, index.to(lh.values.device))
                lh.valid = lh.valid.index_select(0, index.to(lh.valid.device))
        if self.count is not None:
            self.count = self.count.index_select(0, index.to(self.count.device))
        self.batch_size = int(index.numel())

    def valid_entries(self) -> torch.Tensor | None:
        """(B, N) number of usable history entries per position (first temporal layer)."""
        if not self.layers:
            return None
        lh = next(iter(self.layers.values()))
        return lh.valid.sum(1)

    def nbytes(self) -> int:
        total = 0 if self.count is None else self.count.numel() * self.count.element_size()
        for lh in self.layers.values():
            for t in (lh.keys, lh.values, lh.valid):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total


@dataclass
class LatentCache(TemporalCache):
    """Step-wise memory of ``latent:M``: per temporal layer, latents (B, N, M, d) of every position.

    Instead of a growing list of entries each layer holds M vectors per response position, so the
    size is B N (L_t M d + 1) elements plus B progress counts, whatever the number of steps.
    ``r_last`` (B,) is the revealed-token count of the input that last updated the latents (0 before
    the first update; it rotates the latent keys, see ``tdlm/temporal/model.py``). ``alive`` (B, N) marks
    positions masked in every evaluation so far; a revealed position's latents are dead.
    The latents carry autograd history when written under grad (training through the recurrence).
    """

    latents: dict[int, torch.Tensor] = field(default_factory=dict)
    r_last: torch.Tensor | None = None
    alive: torch.Tensor | None = None

    def visible(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        raise TDLMError("a latent cache holds latents, not history entries; read it with cache.read(layer)")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor) -> None:
        raise TDLMError("a latent cache holds latents, not history entries; write it with cache.write(...)")

    def read(self, layer: int) -> torch.Tensor | None:
        """Latents (B, N, M, d) of ``layer``, or None before the first evaluation (use the initial ones)."""
        return self.latents.get(layer)

    def write(self, latents: dict[int, torch.Tensor]) -> None:
        """Replace the latents of the layers in ``latents`` (each (B, N, M, d)) after an evaluation."""
        for layer, t in latents.items():
            if t.shape[:2] != (self.batch_size, self.length):
                raise TDLMError(
                    f"latents of layer {layer} have shape {tuple(t.shape)}; cache holds batch "
                    f"{self.batch_size} x {self.length} positions"
                )
            self.latents[layer] = t

    def progress(self, device: torch.device) -> torch.Tensor:
        """(B,) r at which the latents were last updated (0 for the learned initial latents)."""
        if self.r_last is None:
            self.r_last = torch.zeros(self.batch_size, dtype=torch.long, device=device)
        return self.r_last

    def commit(self, masked: torch.Tensor) -> None:
        """Finish an evaluation whose input had ``masked`` (B, N) response positions."""
        self.steps += 1
        self.r_last = (~masked).sum(-1)
        self.alive = masked.clone() if self.alive is None else self.alive & masked

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (finished requests leave the batch)."""
        index = index.to(torch.long)
        for layer, t in self.latents.items():
            self.latents[layer] = t.index_select(0, index.to(t.device))
        if self.r_last is not None:
            self.r_last = self.r_last.index_select(0, index.to(self.r_last.device))
        if self.alive is not None:
            self.alive = self.alive.index_select(0, index.to(self.alive.device))
        self.batch_size = int(index.numel())

    def valid_entries(self) -> torch.Tensor | None:
        """(B, N) evaluations folded into each live position's latents (0 where dead)."""
        if self.alive is None:
            return None
        return self.alive.long() * self.steps

    def nbytes(self) -> int:
        tensors = [*self.latents.values(), self.r_last, self.alive]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
