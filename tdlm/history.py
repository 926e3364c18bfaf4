"""History policies (Table 2 of the TDLM paper) and the step-wise temporal cache.

A policy decides which earlier evaluations J_p(i) a masked position may retrieve (Eq. 8-9):

* ``full``     - every earlier evaluation j < i (the paper's main setting);
* ``last:k``   - the k most recent earlier evaluations, i-k <= j < i;
* ``current``  - only the current evaluation's own entry j = i (plus the sink); the learned
  Q/K/sink gate is kept but no history is used.

In every case an entry j is usable at position p only if p was masked in S_j (A_{p,i,j} of
Section 2.3). The same policy object gives the parallel mask over K sampled states and the window
of cache entries in step-wise decoding, so Prop. 2 holds policy by policy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from tdlm.errors import TDLMError


@dataclass(frozen=True)
class HistoryPolicy:
    kind: str  # "full" | "last" | "current"
    k: int = 0

    @classmethod
    def parse(cls, spec: str | HistoryPolicy) -> HistoryPolicy:
        if isinstance(spec, HistoryPolicy):
            return spec
        s = str(spec).strip().lower()
        if s in ("full", "current"):
            return cls(s)
        m = re.fullmatch(r"last:(\d+)", s)
        if m and int(m.group(1)) >= 1:
            return cls("last", int(m.group(1)))
        raise TDLMError(f"history policy {spec!r} not understood; expected 'full', 'current' or 'last:k' (k >= 1)")

    def __str__(self) -> str:
        return f"last:{self.k}" if self.kind == "last" else self.kind

    @property
    def uses_cache(self) -> bool:
        return self.kind != "current"

    def parallel_mask(self, K: int, device: torch.device | None = None) -> torch.Tensor:
        """(K_i, K_j) bool: which sampled input j may serve input i, before the m_{j,p} factor."""
        i = torch.arange(K, device=device)[:, None]
        j = torch.arange(K, device=device)[None, :]
        if self.kind == "full":
            return j < i
        if self.kind == "last":
            return (j < i) & (j >= i - self.k)
        return j == i

    def window(self, n: int) -> tuple[int, int]:
        """Cache entries [start, n) visible to the next evaluation, given n stored entries."""
        if self.kind == "full":
            return 0, n
        if self.kind == "last":
            return max(0, n - self.k), n
        return n, n


@dataclass
class LayerHistory:
    """Keys/values of one temporal layer: (B, cap, N, M, d_h) with validity (B, cap, N)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    valid: torch.Tensor | None = None


@dataclass
class TemporalCache:
    """Step-wise temporal memory of one decoding request batch.

    Entry j holds, for every response position p, the rotated key and value of h_{l,p}(S_j) at each
    temporal layer and whether p was masked in S_j. Entries are appended after each evaluation;
    revealing a position invalidates all of its entries; changing blocks resets nothing.
    Storage grows by doubling so that appending is amortised O(1) copies; ``last:k`` keeps only the
    k newest entries.
    """

    batch_size: int
    policy: HistoryPolicy
    prompt_len: int | None = None
    length: int | None = None  # response positions N
    n: int = 0  # entries stored (evaluations so far, after trimming for last:k)
    steps: int = 0  # evaluations seen
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

    def visible(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Keys, values (B, H, N, M, d_h) and validity (B, H, N) of the entries the policy exposes."""
        lh = self.layers.get(layer)
        if lh is None or lh.keys is None:
            return None
        start, end = self.policy.window(self.n)
        if end <= start:
            return None
        return lh.keys[:, start:end], lh.values[:, start:end], lh.valid[:, start:end]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor) -> None:
        """Store this evaluation's entry for ``layer``: k, v (B, N, M, d_h), masked (B, N)."""
        if not self.policy.uses_cache:
            return
        lh = self.layers.setdefault(layer, LayerHistory())
        if lh.keys is None:
            cap = 8 if self.policy.kind == "full" else self.policy.k
            B, N, M, D = k.shape
            lh.keys = k.new_empty(B, cap, N, M, D)
            lh.values = v.new_empty(B, cap, N, M, D)
            lh.valid = torch.zeros(B, cap, N, dtype=torch.bool, device=k.device)
        if self.n >= lh.keys.shape[1]:
            if self.policy.kind == "last":  # drop the oldest entry, keep k
                lh.keys = lh.keys.roll(-1, dims=1)
                lh.values = lh.values.roll(-1, dims=1)
                lh.valid = lh.valid.roll(-1, dims=1)
            else:
                grow = lh.keys.shape[1]
                lh.keys = torch.cat([lh.keys, torch.empty_like(lh.keys[:, :grow])], dim=1)
                lh.values = torch.cat([lh.values, torch.empty_like(lh.values[:, :grow])], dim=1)
                lh.valid = torch.cat([lh.valid, torch.zeros_like(lh.valid[:, :grow])], dim=1)
        slot = min(self.n, lh.keys.shape[1] - 1)
        lh.keys[:, slot] = k
        lh.values[:, slot] = v
        lh.valid[:, slot] = masked

    def commit(self, masked: torch.Tensor) -> None:
        """Finish an evaluation whose input had ``masked`` (B, N) response positions."""
        self.steps += 1
        if not self.policy.uses_cache or not self.layers:
            return
        cap = next(iter(self.layers.values())).keys.shape[1]
        self.n = min(self.n + 1, cap) if self.policy.kind == "last" else self.n + 1
        # A position revealed in this input is never masked again: its history is dead.
        for lh in self.layers.values():
            lh.valid[:, : self.n] &= masked[:, None, :]

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (finished requests leave the batch)."""
        index = index.to(torch.long)
        for lh in self.layers.values():
            if lh.keys is not None:
                lh.keys = lh.keys.index_select(0, index.to(lh.keys.device))
                lh.values = lh.values.index_select(0, index.to(lh.values.device))
                lh.valid = lh.valid.index_select(0, index.to(lh.valid.device))
        self.batch_size = int(index.numel())

    def valid_entries(self) -> torch.Tensor | None:
        """(B, N) number of usable history entries per position (first temporal layer)."""
        if not self.layers:
            return None
        lh = next(iter(self.layers.values()))
        return lh.valid[:, : self.n].sum(1)

    def nbytes(self) -> int:
        total = 0
        for lh in self.layers.values():
            for t in (lh.keys, lh.values, lh.valid):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total
