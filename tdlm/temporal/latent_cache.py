"""The step-wise memory of history ``latent:M`` (:mod:`tdlm.temporal.history`, Table 2 of the TDLM paper): M latent
vectors per response position and temporal layer, folded forward by the Perceiver block (``tdlm/temporal/perceiver.py``)
after each evaluation, in place of the growing list of entries the other policies keep."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tdlm.errors import TDLMError
from tdlm.temporal.history import TemporalCache


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

    def extend(self, n: int) -> None:
        """A recurrent memory folds every evaluation of a row into its latents and one progress count per row, and a
        new row would start from the learned initial latents that the batch's first evaluation reads for all rows at
        once: the engine admits into a ``latent:M`` batch only when it is empty."""
        raise TDLMError(f"history {self.policy} cannot admit rows into a running batch; start a new batch")

    def reset_rows(self, rows: torch.Tensor) -> None:
        """As :meth:`extend`: a new row's latents would start from the initial ones, read for the whole batch."""
        raise TDLMError(f"history {self.policy} cannot admit rows into a running batch; start a new batch")

    def compact(self, still: torch.Tensor, most: int) -> bool:
        """Latents are kept for every position (the Perceiver folds each one forward): nothing to compact."""
        return False

    def valid_entries(self) -> torch.Tensor | None:
        """(B, N) evaluations folded into each live position's latents (0 where dead)."""
        if self.alive is None:
            return None
        return self.alive.long() * self.steps

    def nbytes(self) -> int:
        tensors = [*self.latents.values(), self.r_last, self.alive]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
