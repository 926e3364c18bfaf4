"""Measured peak memory of real training steps on this machine, next to the planner's prediction.

:func:`measure_peak` runs ``steps`` training micro-steps of the recipe in a fresh subprocess
(``python -m tdlm.training.planner --measure``) and reads the exact peak of live tensor bytes from
``torch.profiler`` allocation events (:class:`PeakMeter`; ``torch.cuda.max_memory_allocated`` on a GPU).
``tests/test_memory.py`` and ``bench/gpu_train_probe.py`` compare it with :func:`tdlm.training.planner.plan`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tdlm.errors import TDLMError
from tdlm.models.common import Backbone
from tdlm.models.dream import DreamConfig
from tdlm.models.llada import LLaDAConfig
from tdlm.models.loading import build_backbone
from tdlm.training.planner.model import DTYPES, BackboneSpec, plan


# -- measurement ----------------------------------------------------------------------------------
class PeakMeter:
    """Peak tensor memory inside a ``with`` block, in bytes above the level at entry (``peak_delta``).

    CUDA: ``torch.cuda.max_memory_allocated`` (``peak`` is then absolute). CPU: the allocation events of
    ``torch.profiler`` with ``profile_memory=True``; each carries the allocator's running total, so the maximum
    of that total over the block is the exact peak of live CPU tensor bytes (no RSS or malloc noise).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_delta = 0
        self.peak: int | None = None

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_delta = self.peak - self._start
            return
        self._prof.__exit__(*exc)
        from torch._C._profiler import _EventType

        allocs = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            ev = stack.pop()
            if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu":
                allocs.append((ev.start_time_ns, ev.extra_fields.alloc_size, ev.extra_fields.total_allocated))
            stack.extend(ev.children)
        if allocs:
            allocs.sort()
            base = allocs[0][2] - allocs[0][1]  # allocator total just before the first event
            self.peak_delta = max(t for _, _, t in allocs) - base
        del self._prof


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages of the tensors in modules, optimizers, tensors and dataclasses given."""
    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for o in objs:
        if isinstance(o, nn.Module):
            for t in [*o.parameters(), *o.buffers()]:
                add(t)
        elif isinstance(o, torch.optim.Optimizer):
            for state in o.state.values():
                for t in state.values():
                    add(t)
        elif dataclasses.is_dataclass(o):
            for f in dataclasses.fields(o):
                add(getattr(o, f.name))
        else:
            add(o)
    return sum(seen.values())


def init_random_(backbone: Backbone, seed: int = 0) -> Backbone:
    """Seeded random weights in place (normal(0, 0.02); RMSNorm weights 1), on the parameters' device."""
    g = torch.Generator(device=next(backbone.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if name.endswith("norm.weight") or ".ln_f." in name or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return backbone


def random_batch(backbone: Backbone, micro_batch: int, states: int, seq_len: int, response_len: int, seed: int = 0):
    """A :class:`tdlm.data.trajectories.TrainingBatch` of random teacher trajectories, one token revealed per step."""
    from tdlm.data.trajectories import TrajectoryRecord, build_batch

    g = torch.Generator().manual_seed(seed)
    P, N = seq_len - response_len, response_len
    if P < 1:
        raise TDLMError(f"need a prompt: seq_len={seq_len} must exceed response_len={response_len}")
    special = {backbone.mask_token_id, backbone.pad_token_id, backbone.eos_token_id}
    lo = max(special) + 1 if max(special) < 16 else 0  # toy vocabularies keep specials at the bottom

    def tokens(k: int) -> list[int]:
        ids = torch.randint(lo, backbone.vocab_size, (k,), generator=g)
        ids[torch.isin(ids, torch.tensor(sorted(special)))] = lo + 3
        return ids.tolist()

    records = [
        TrajectoryRecord(
            source_id=f"r{b}",
            prompt_ids=tokens(P),
            response_ids=tokens(N),
            reveal_steps=(torch.randperm(N, generator=g) + 1).tolist(),
            T=N,
        )
        for b in range(micro_batch)
    ]
    return build_batch(records, states, backbone.mask_token_id, backbone.pad_token_id, generator=g)


def train_step(model, batch, optimizer: torch.optim.Optimizer) -> float:
    """One micro-step of Eq. (5): forward over K states, LM head and CE at the supervised tokens, backward, AdamW.

    ``logits`` stays referenced until backward ends, as in a plain training loop (the planner assumes this).
    """
    from tdlm.training.loop import supervised_ce

    loss = supervised_ce(model, batch) / max(batch.num_targets, 1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@dataclass
class Measurement:
    """Measured peak of real training steps (single process, no ZeRO) next to the plan's prediction."""

    peak: int  # bytes: live tensors before the steps + peak allocated during them
    baseline: int  # bytes of parameters, optimizer states and batch before the measured steps
    rss_delta: int  # ru_maxrss growth during the steps (informational; allocator-dependent)
    step_seconds: float
    predicted: dict  # MemoryPlan.to_dict()
    setup: dict

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.peak / self.predicted["total"]


def _current_rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_here(
    spec: BackboneSpec,
    layers,
    heads,
    head_dim,
    states,
    seq_len,
    response_len,
    micro_batch,
    dtype,
    checkpointing,
    steps,
    seed,
) -> Measurement:
    """Run ``steps`` real training steps in this process on the CPU and measure their peak."""
    from tdlm.temporal.model import TDLM, TemporalConfig

    N = seq_len // 2 if response_len is None else response_len
    backbone = init_random_(build_backbone(spec.family, spec.config, spec.name), seed).to(DTYPES[dtype]).freeze()
    backbone.backbone_id = spec.name
    model = TDLM(backbone, TemporalConfig(layers=layers, heads=heads, head_dim=head_dim))
    model.activation_checkpointing = checkpointing
    model.train()
    batch = random_batch(backbone, micro_batch, states, seq_len, N, seed)
    opt = torch.optim.AdamW(model.temporal.parameters(), lr=1e-4)
    train_step(model, batch, opt)  # warm-up: creates the AdamW states
    gc.collect()
    baseline = tensor_bytes(model, opt, batch)
    rss0 = _current_rss()
    t0 = time.perf_counter()
    with PeakMeter("cpu") as meter:
        for _ in range(steps):
            train_step(model, batch, opt)
    dt = (time.perf_counter() - t0) / steps
    rss_delta = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
    predicted = plan(
        spec,
        model.layer_ids,
        model.config.heads,
        model.config.head_dim,
        states=states,
        seq_len=seq_len,
        response_len=N,
        supervised=batch.num_targets,
        micro_batch=micro_batch,
        dtype=dtype,
        checkpointing=checkpointing,
        zero=0,
        world_size=1,
    )
    return Measurement(
        peak=baseline + meter.peak_delta,
        baseline=baseline,
        rss_delta=rss_delta,
        step_seconds=dt,
        predicted=predicted.to_dict(),
        setup=predicted.setup,
    )


def measure_peak(
    backbone: str | os.PathLike | LLaDAConfig | DreamConfig = "tiny-llada",
    layers: str | Sequence[int] | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    *,
    states: int = 8,
    seq_len: int = 128,
    response_len: int | None = None,
    micro_batch: int = 1,
    dtype: str = "fp32",
    checkpointing: bool = False,
    steps: int = 2,
    threads: int = 1,
    seed: int = 0,
    timeout: float = 600.0,
) -> Measurement:
    """Measure the CPU peak of real training steps in a fresh subprocess (``python -m tdlm.training.planner
    --measure``).

    A fresh process keeps the profiler's allocation counter and the heap clean. Config objects are written to a
    temporary folder as ``config.json``; weights are random (nothing is downloaded or loaded). One intra-op thread
    by default: on a shared 2-core machine OpenMP barriers made 2-thread steps 20-50x slower, and the thread count
    does not change tensor memory.
    """
    with tempfile.TemporaryDirectory(prefix="tdlm-mem-") as tmp:
        if isinstance(backbone, LLaDAConfig | DreamConfig):
            (Path(tmp) / "config.json").write_text(json.dumps(backbone.to_dict()))
            backbone = tmp
        lay = None if layers is None else (layers if isinstance(layers, str) else ",".join(str(i) for i in layers))
        cmd = [
            sys.executable,
            "-m",
            "tdlm.training.planner",
            "--measure",
            "--json",
            "--backbone",
            str(backbone),
            "--states",
            str(states),
            "--seq-len",
            str(seq_len),
            "--micro-batch",
            str(micro_batch),
            "--dtype",
            dtype,
            "--checkpointing",
            "on" if checkpointing else "off",
            "--zero",
            "0",
            "--steps",
            str(steps),
            "--seed",
            str(seed),
            "--threads",
            str(threads),
        ]
        for flag, val in (
            ("--layers", lay),
            ("--heads", heads),
            ("--head-dim", head_dim),
            ("--response-len", response_len),
        ):
            if val is not None:
                cmd += [flag, str(val)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Measurement(**out)
