"""One backbone replica that decodes whole shards (the body of a Ray actor; also usable in-process).

The class is plain Python so tests and benches can run it without Ray; the driver wraps it with
``ray.remote``. A replica loads the backbone (plus the TDLM adapter for policy ``tdlm``) and the
backbone's tokenizer once, then for every shard: chat template -> token ids
(:func:`tdlm.data.tokenizer.encode_prompts`), batches of ``batch_size`` prompts of similar length (less
left padding), :func:`tdlm.decode`, and one :class:`~tdlm.data.trajectories.TrajectoryRecord` per prompt
in prompt order. It writes no files: the driver is the only writer of the output dir.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tdlm.data.trajectories import TrajectoryRecord
from tdlm.decoding import DecodeConfig, decode
from tdlm.errors import TDLMError
from tdlm.models.loading import backbone_fingerprint  # noqa: F401  (re-exported)
from tdlm.models.placement import actor_device, describe_placement
from tdlm.temporal.adapter_files import adapter_fingerprint  # noqa: F401  (re-exported)

# Test-only fault injection (see FaultInjection.from_env). Inert unless the variable is set.
CRASH_ENV = "TDLM_TEST_CRASH_SHARD"  # "<k>": the actor decoding shard k hard-exits on its first attempt
KILL_ENV = "TDLM_TEST_KILL_AFTER_SHARDS"  # "<n>": the driver SIGKILLs itself after writing its n-th shard
BARRIER_ENV = "TDLM_TEST_SHARD_BARRIER"  # "<n>": no replica decodes until n distinct replicas reached a shard
BARRIER_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class FaultInjection:
    """Deliberate crashes for the fault-tolerance tests; ``None`` fields do nothing.

    ``crash_shard``: the replica decoding that shard calls ``os._exit`` on the first attempt (a marker
    file records that the attempt happened, so the retry - in a restarted or new actor - succeeds).
    ``kill_after``: the driver kills itself with SIGKILL right after the n-th shard file of the run is
    renamed into place and before ``manifest.json`` lists it (the hardest point to resume from).
    ``barrier``: a replica's first shard waits (files in ``barrier_dir``) until that many distinct
    replicas hold a shard, so a test sees work spread over replicas however slowly one starts.
    """

    crash_shard: int | None = None
    crash_marker: str | None = None
    kill_after: int | None = None
    barrier: int | None = None
    barrier_dir: str | None = None

    @classmethod
    def from_env(cls, marker_dir: str) -> FaultInjection | None:
        crash, kill, barrier = (os.environ.get(v) for v in (CRASH_ENV, KILL_ENV, BARRIER_ENV))
        if not crash and not kill and not barrier:
            return None
        try:
            k = int(crash) if crash else None
            n = int(kill) if kill else None
            b = int(barrier) if barrier else None
        except ValueError as e:
            raise TDLMError(f"{CRASH_ENV}/{KILL_ENV}/{BARRIER_ENV} must be integers; "
                            f"got {crash!r}/{kill!r}/{barrier!r}") from e  # fmt: skip
        token = f"{os.getpid()}-{time.time_ns()}"
        marker = os.path.join(marker_dir, f"crash-shard-{k}-{token}") if k is not None else None
        bdir = os.path.join(marker_dir, f"shard-barrier-{token}") if b else None
        return cls(crash_shard=k, crash_marker=marker, kill_after=n, barrier=b, barrier_dir=bdir)


@dataclass
class WorkerSpec:
    """What every replica loads and how it decodes (sent to each actor's constructor)."""

    backbone: str
    decode: dict  # DecodeConfig fields
    batch_size: int = 16
    chat: bool = True
    adapter: str | None = None
    dtype: str | None = None
    device: str | None = "cpu"  # None: what the process was given (:func:`actor_device`; the driver's Ray actors)
    allow_other_backbone: bool = False
    threads: int | None = None  # torch intra-op threads on CPU; None = leave as set by Ray/OMP
    faults: FaultInjection | None = None


@dataclass
class ShardTask:
    index: int
    source_ids: list[str]
    texts: list[str]
    attempt: int = 1


@dataclass
class ShardResult:
    index: int
    records: list[TrajectoryRecord]
    seconds: float  # wall time of tokenisation + decoding in the actor
    worker: dict = field(default_factory=dict)  # pid / host / device of the replica


class ShardWorker:
    """A backbone replica. Construction never raises: errors are kept and re-raised by :meth:`info`,
    so that a bad path or adapter reaches the driver as one clean TDLMError instead of an actor that
    Ray restarts until its restart budget is gone."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.error: BaseException | None = None
        self._progress: tuple[int, int] | None = None  # (shard, prompts decoded) while run_shard runs
        self.device: str | None = None
        try:
            self.device = actor_device(spec.device)  # before loading: placement() reports it even if loading fails
            self._load()
        except Exception as e:  # re-raised by info() on the driver's first call
            self.error = e

    def _load(self) -> None:
        from tdlm.data.tokenizer import load_tokenizer, stop_token_ids
        from tdlm.models.loading import load_backbone
        from tdlm.temporal.model import TDLM

        spec = self.spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.config = DecodeConfig(**spec.decode).validate()
        self.backbone = load_backbone(spec.backbone, dtype=spec.dtype, device=self.device)
        self.model = (TDLM.from_adapter(self.backbone, spec.adapter, allow_other_backbone=spec.allow_other_backbone)
                      .to(self.device) if spec.adapter else self.backbone)
        self.tokenizer = load_tokenizer(spec.backbone)
        self.stop_ids = stop_token_ids(self.tokenizer, self.backbone.eos_token_id)
        self.fingerprint = backbone_fingerprint(spec.backbone)
        self.adapter_fingerprint = adapter_fingerprint(spec.adapter) if spec.adapter else None
        self.meta = {"pid": os.getpid(), "host": socket.gethostname(), "device": self.device,
                     "threads": torch.get_num_threads()}  # fmt: skip

    def info(self) -> dict:
        """What this replica loaded (the driver checks all replicas agree with the manifest)."""
        if self.error is not None:
            raise self.error
        return {
            "backbone_id": self.backbone.backbone_id,
            "backbone": self.fingerprint,
            "adapter": self.adapter_fingerprint,
            **self.meta,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def placement(self) -> dict:
        """:func:`describe_placement` of this replica, also when loading failed (then with the error)."""
        return {**describe_placement(self.device), "error": None if self.error is None else repr(self.error)}

    def progress(self) -> tuple[int, int] | None:
        """(shard index, prompts of it decoded so far) while :meth:`run_shard` runs, else None. The driver runs the
        actor with two threads and asks this between results, so its progress line moves with every decode batch
        rather than once per shard (a 256-prompt shard once showed 0% for two minutes, then 100%)."""
        return self._progress

    def _maybe_crash(self, index: int) -> None:
        f = self.spec.faults
        if f is None or f.crash_shard != index or f.crash_marker is None:
            return
        if not os.path.exists(f.crash_marker):
            Path(f.crash_marker).touch()
            os._exit(1)  # a hard death mid-shard, as an OOM kill or a lost node looks to Ray

    def _maybe_wait_at_barrier(self) -> None:
        f = self.spec.faults
        if f is None or not f.barrier or f.barrier_dir is None or getattr(self, "_passed_barrier", False):
            return
        os.makedirs(f.barrier_dir, exist_ok=True)
        Path(f.barrier_dir, str(os.getpid())).touch()
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        while len(os.listdir(f.barrier_dir)) < f.barrier and time.monotonic() < deadline:
            time.sleep(0.05)
        self._passed_barrier = True

    def run_shard(self, task: ShardTask) -> ShardResult:
        from tdlm.data.tokenizer import encode_prompts

        if self.error is not None:
            raise self.error
        self._maybe_wait_at_barrier()
        self._maybe_crash(task.index)
        t0 = time.perf_counter()
        ids = encode_prompts(self.tokenizer, task.texts, chat=self.spec.chat)
        # Similar lengths share a batch so little compute goes to left padding; decode() gives the
        # same tokens batched or alone, so the grouping does not change the output.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        results: list = [None] * len(ids)
        bs = self.spec.batch_size
        self._progress = (task.index, 0)
        try:
            for start in range(0, len(order), bs):
                chunk = order[start : start + bs]
                out = decode(self.model, [ids[i] for i in chunk], self.config, tokenizer=self.tokenizer,
                             stop_ids=self.stop_ids)  # fmt: skip
                for i, r in zip(chunk, out, strict=True):
                    results[i] = r
                self._progress = (task.index, start + len(chunk))
        finally:
            self._progress = None
        settings = self.config.to_dict()
        records = [
            TrajectoryRecord.from_decode(r, sid, text, self.backbone.backbone_id, settings)
            for r, sid, text in zip(results, task.source_ids, task.texts, strict=True)
        ]
        return ShardResult(task.index, records, time.perf_counter() - t0, dict(self.meta))
