from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


def random_trajectory(
    gen: torch.Generator, prompt_len: int, N: int, vocab: int, mask_id: int, steps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A random teacher trajectory: tokens (prompt_len + N,), reveal step a_p (N,) in 1..T, T.

    Every step 1..T reveals at least one position (as a real decoder does).
    """
    tokens = torch.randint(3, vocab, (prompt_len + N,), generator=gen)
    T = steps or int(torch.randint(2, N + 1, (1,), generator=gen))
    order = torch.randperm(N, generator=gen)
    a = torch.empty(N, dtype=torch.long)
    # first T positions of the order get steps 1..T, the rest random steps in 1..T
    a[order[:T]] = torch.arange(1, T + 1)
    if N > T:
        a[order[T:]] = torch.randint(1, T + 1, (N - T,), generator=gen)
    return tokens, a, T


def state_at(tokens: torch.Tensor, a: torch.Tensor, s: int, prompt_len: int, mask_id: int) -> torch.Tensor:
    """Eq. (3): y_p where a_p <= s, mask otherwise (response region only)."""
    x = tokens.clone()
    resp = x[prompt_len:]
    resp[a > s] = mask_id
    return x


@pytest.fixture(params=["tiny-llada", "tiny-dream"])
def backbone_name(request) -> str:
    return request.param
