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


def sampled_states(bb, prompt_len: int, N: int, seed: int, B: int = 2, K: int = 5) -> torch.Tensor:
    """(B, K, L) inputs S_0..S_{K-1} along random trajectories, s_0 = 0 (all masked)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        tokens, a, T = random_trajectory(g, prompt_len, N, bb.vocab_size, bb.mask_token_id, steps=12)
        steps = [0] + sorted(torch.randperm(T - 1, generator=g)[: K - 1].add(1).tolist())
        rows.append(torch.stack([state_at(tokens, a, s, prompt_len, bb.mask_token_id) for s in steps]))
    return torch.stack(rows)


def randomize_temporal(model, seed: int = 0) -> None:
    """Nonzero W_O and sink (and, for latent:M, initial latents large enough to matter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.temporal.values():
            mod.o_proj.weight.copy_(torch.randn(mod.o_proj.weight.shape, generator=g) * 0.2)
            mod.sink.fill_(float(torch.randn((), generator=g)))
            latents = getattr(getattr(mod, "memory", None), "latents", None)
            if latents is not None:
                latents.copy_(torch.randn(latents.shape, generator=g))


def stepwise(model, x: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Evaluate the K states of x (B, K, L) one after another through a temporal cache."""
    cache = model.new_cache(x.shape[0])
    return torch.stack([model.forward_step(x[:, i], prompt_len, cache) for i in range(x.shape[1])], dim=1)


@pytest.fixture(scope="module")
def one_thread():
    """Decode on 1 torch thread, like the Ray CPU actors (num_cpus=1): in-process and actor runs then agree
    bit for bit, and on the shared 2-core machine 2 threads run ~8x slower under load."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["tiny-llada", "tiny-dream"])
def backbone_name(request) -> str:
    return request.param
