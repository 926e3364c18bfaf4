from __future__ import annotations

import os

import pytest
import torch

from tdlm.models.loading import load_backbone
from tdlm.temporal.model import TDLM, TemporalConfig

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
    # The suite's second kernel path (issue 50). Under it inductor finds no vector ISA (pick_vec_isa() is invalid)
    # yet still emits at::vec code for some reductions without its header: a C++ compile error inside torch 2.13
    # (tests/test_compile.py's inductor step, measured). Scalar code (simdlen 1) is what that machine can run.
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 1


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


def randomize_temporal(model, seed: int = 0, scale: float = 0.2, generator: torch.Generator | None = None) -> None:
    """Nonzero W_O (``scale`` standard deviation) and sink (and, for latent:M, initial latents large enough to
    matter), drawn from ``generator`` or a fresh one seeded with ``seed``."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.temporal.values():
            mod.o_proj.weight.copy_(torch.randn(mod.o_proj.weight.shape, generator=g) * scale)
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


@pytest.fixture(autouse=True)
def _no_wandb_service_leak():
    """An in-process ``wandb.init`` exports ``WANDB_SERVICE`` (its service's socket) into ``os.environ``; a later
    test's subprocesses (DeepSpeed ranks, the demo) would then connect to that service, or to a dead socket once it
    is gone. Each test leaves the variable as it found it."""
    before = os.environ.get("WANDB_SERVICE")
    yield
    if before is None:
        os.environ.pop("WANDB_SERVICE", None)
    else:
        os.environ["WANDB_SERVICE"] = before


SANDBOX_BACKENDS = ("bwrap", "inhouse")


def sandbox_limits_for(backend: str, **limits):
    """``SandboxLimits(backend=backend, **limits)`` whose isolation is asserted full; a backend whose program is not
    installed here (bubblewrap, which `make test` installs only where root + apt-get allow) is skipped with the
    reason, never an error, so the other backend's tests still run. An installed backend that cannot isolate
    is a failure."""
    from tdlm.evaluation.sandbox import SandboxLimits, backend_unavailable, isolation_support

    if why := backend_unavailable(backend):
        pytest.skip(f"sandbox backend {backend!r}: {why}")
    lim = SandboxLimits(backend=backend, **limits)
    support = isolation_support(lim)
    assert support["works"] and support["backend"] == backend and support["level"].startswith("full;"), support
    return lim


# -- per-test time limits (pytest-timeout; `timeout` / `timeout_method` in pyproject.toml) -------------------
SLOW_TIMEOUT_S = 1800.0  # slow tests launch DeepSpeed / Ray / the whole demo (its subprocess alone may take 1500 s)
HARD_GRACE_S = 120.0  # the backstop below fires this long after a test's own limit


# The files whose slow tests take longest, longest first (a clean-clone `make test` here, 2026-12-07 22:24: Ray cluster
# losses 333 s with their set-up, demo 305 s, on-policy kills 222 s, allocation sweep 142 s, GPU check 124 s, ...). Both
# passes of `make test` run in pytest-xdist workers with --dist loadfile, which hands out files in collection order: a
# long file handed out last runs alone while the other workers idle, so these go first (longest-processing-time-first).
# The order is the same in every worker, as xdist requires.
LONGEST_FIRST = ("test_ray_cluster.py", "test_demo.py", "test_onpolicy_job.py", "test_sweep.py", "test_gpu_check.py",
                 "test_training.py", "test_multinode_training.py", "test_generation.py", "test_quickstart.py",
                 "test_full_disk.py", "test_memory.py")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Slow multi-process tests get SLOW_TIMEOUT_S unless they set their own ``@pytest.mark.timeout``; the files of
    LONGEST_FIRST are collected first, in that order (a stable sort: every other file keeps its place)."""
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _time_limit(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        value = marker.args[0] if marker.args else marker.kwargs["timeout"]
    else:
        value = item.config.getoption("timeout", None)
        if value is None:
            value = item.config.getini("timeout")
    return float(value or 0)


def _hard_timeout(item, limit: float) -> None:
    import faulthandler
    import sys

    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:  # give fd 1 / 2 back to the terminal, as pytest-timeout's thread method does
        capman.suspend_global_capture(in_=True)
    sys.__stderr__.write(f"\n+++ TIMEOUT: {item.nodeid} still running after {limit:.0f} s (SIGALRM could not "
                         f"interrupt it); stacks follow, then the run ends +++\n")  # fmt: skip
    sys.__stderr__.flush()
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    sys.__stderr__.flush()
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Backstop for pytest-timeout's SIGALRM: a hang inside C code never returns to the interpreter, so the
    signal handler cannot run (and Math-Verify's own ``signal.alarm(0)`` cancels the timer for the rest of a test
    that scores in-process). A watchdog thread then names the test, dumps every thread's stack and exits."""
    import threading

    limit = _time_limit(item)
    timer = None
    if limit > 0:
        timer = threading.Timer(limit + HARD_GRACE_S, _hard_timeout, (item, limit + HARD_GRACE_S))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


# Tests that assert equal decisions (tokens, NFE, reveal steps) between two numerically different paths -- the
# static and the dynamic storage plan, a batch and one row, a replica and decode() -- run them in float64. In float32
# the paths differ in the last bits (sums over other batch and canvas shapes), and those bits decide near-ties of
# confidence against tau or between the top two tokens differently on different CPUs' kernels: two such tests failed
# on a 2-core AMD EPYC and passed here. In float64 the differences are ~1e-15, far below any gap the tiny models'
# decisions have, so the decisions are the same on every CPU and kernel path. EXACT_TOL is the logit tolerance of
# those comparisons: float64 rounding compounded over the few dozen evaluations of a test decode stays below 1e-12
# (soft iteration feeds predictions back, 1.8e-5 in float32 after 11 evaluations); 1e-9 leaves a margin of 1e3.
EXACT_DTYPE = torch.float64
EXACT_TOL = 1e-9


def sharp_backbone(name: str = "tiny-llada", scale: float = 60.0, dtype: torch.dtype = torch.float32):
    """A tiny random backbone with a peaky head, so confidences spread over (0, 1] and blocks take several
    steps under the threshold rule; ``dtype=EXACT_DTYPE`` for comparisons of two paths' decisions."""
    bb = load_backbone(name, dtype=dtype)
    head = bb.model.transformer.ff_out if bb.family == "llada" else bb.lm_head
    with torch.no_grad():
        head.weight.mul_(scale)
    return bb


def live_tdlm(bb, history: str = "full", seed: int = 0) -> TDLM:
    """TDLM with every temporal weight drawn from a seeded generator (the same in every process) and a
    nonzero W_O; latent:M also gets large initial latents."""
    model = TDLM(bb, TemporalConfig(layers="all", history=history))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.temporal.named_parameters():
            if p.dim() == 2 and not name.endswith("memory.latents"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    randomize_temporal(model, scale=0.5, generator=g)  # continues the same stream: W_O, sink, latents
    return model
