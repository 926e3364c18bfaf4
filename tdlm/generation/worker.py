"""One backbone replica that decodes whole shards (the body of a Ray actor; also usable in-process).

The class is plain Python so tests and benches can run it without Ray; the driver wraps it with
``ray.remote``. A replica loads the backbone (plus the TDLM adapter for policy ``tdlm``) and the
backbone's tokenizer once, then for every shard: chat template -> token ids
(:func:`tdlm.data.tokenizer.encode_prompts`), :func:`tdlm.decode` ``batch_size`` rows at a time with refill, in
order of prompt length (less left padding), and one :class:`~tdlm.data.trajectories.TrajectoryRecord` per prompt
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
from tdlm.decoding.config import DecodeSettings
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
    # the job's decode section, validated by the driver and received as that same object: the replica loads in its
    # dtype, restricts the adapter to its history and decodes its batch_size rows with it (none of it re-checked here)
    decode: DecodeSettings
    chat: bool = True
    adapter: str | None = None
    device: str | None = "cpu"  # None: what the process was given (:func:`actor_device`; the driver's Ray actors)
    allow_other_backbone: bool = False
    threads: int | None = None  # torch intra-op threads on CPU; None = leave as set by Ray/OMP
    faults: FaultInjection | None = None
    rollout: dict | None = None  # GenerationConfig.rollout(): roll in with the adapter, roll out with the backbone


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
    extra: dict = field(default_factory=dict)  # a roll-out's measurements (exposure gap, student NFE, s*)


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
        self.config = spec.decode
        self.backbone = load_backbone(spec.backbone, dtype=spec.decode.dtype, device=self.device)
        self.model = (TDLM.from_adapter(self.backbone, spec.adapter, history=spec.decode.history,
                                        allow_other_backbone=spec.allow_other_backbone)
                      .to(self.device) if spec.adapter else self.backbone)  # fmt: skip
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
        self._progress = (task.index, 0)
        try:
            results = self._decode_sorted(ids, self.model, self.config, task.index)
        finally:
            self._progress = None
        settings = self.config.to_dict()
        records = [
            TrajectoryRecord.from_decode(r, sid, text, self.backbone.backbone_id, settings)
            for r, sid, text in zip(results, task.source_ids, task.texts, strict=True)
        ]
        extra: dict = {}
        if self.spec.rollout is not None:
            records, extra = self._roll_out(task, ids, records)
        return ShardResult(task.index, records, time.perf_counter() - t0, dict(self.meta), extra)

    def _decode_sorted(self, ids: list[list[int]], model, config: DecodeConfig, shard: int,
                       canvas: list[list[int]] | None = None) -> list:  # fmt: skip
        """Decode ``batch_size`` rows at a time with the engine's refill, admitted in order of prompt length (one canvas
        per prompt bucket: less left padding); decode() gives the same tokens batched or alone, so neither the order
        nor the refill changes the output. Results in the order of ``ids``."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        done = [0]

        def finished(k: int, r) -> None:
            done[0] += 1
            self._progress = (shard, done[0])

        out = decode(model, [ids[i] for i in order], config, tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                     canvas=None if canvas is None else [canvas[i] for i in order],
                     batch_size=self.spec.decode.batch_size, on_result=finished)  # fmt: skip
        results: list = [None] * len(ids)
        for i, r in zip(order, out, strict=True):
            results[i] = r
        return results

    def _roll_out(self, task: ShardTask, ids: list[list[int]], students: list[TrajectoryRecord]):
        """Roll-out (tdlm.data.onpolicy): from each student canvas at its s*, the frozen backbone finishes the
        response; returns the hybrid records and the shard's measurements (exposure gap on the first gap_prompts)."""
        import dataclasses

        from tdlm.data.onpolicy import SwitchDistribution, hybrid_record, switch_canvas

        ro = self.spec.rollout
        dist = SwitchDistribution.parse(ro["switch"])
        teacher_cfg = dataclasses.replace(self.config, policy=ro["teacher_policy"])
        provenance = {"round": ro["round"], "adapter_version": ro["adapter_version"],
                      "adapter_fingerprint": self.adapter_fingerprint}  # fmt: skip
        mask = self.backbone.mask_token_id
        steps = [dist.draw(r.T, ro["switch_seed"], r.source_id) for r in students]
        todo = [i for i, (r, s) in enumerate(zip(students, steps, strict=True)) if s < r.T]
        outs = self._decode_sorted([ids[i] for i in todo], self.backbone, teacher_cfg, task.index,
                                   [switch_canvas(students[i], steps[i], mask) for i in todo]) if todo else []
        by_row = dict(zip(todo, outs, strict=True))
        hybrids = []
        for i, (stu, s) in enumerate(zip(students, steps, strict=True)):
            t = by_row.get(i)
            hybrids.append(hybrid_record(stu, s, None if t is None else t.tokens, None if t is None else t.reveal_step,
                                         0 if t is None else t.T, provenance))  # fmt: skip
        extra = {"student_nfe_sum": sum(r.T for r in students), "switch_step_sum": sum(steps),
                 "student_tokens": sum(len(r.response_ids) for r in students)}  # fmt: skip
        n_gap = min(ro["gap_prompts"], len(students))
        if n_gap:
            teach = self._decode_sorted(ids[:n_gap], self.backbone, teacher_cfg, task.index)
            settings = teacher_cfg.to_dict()
            teachers = [TrajectoryRecord.from_decode(r, stu.source_id, stu.prompt_text, self.backbone.backbone_id,
                                                     settings) for r, stu in zip(teach, students, strict=False)]
            seed = ro["switch_seed"] * 1_000_003 + task.index
            extra["gap"] = {"prompts": n_gap, "student": eq5_loss(self.model, students[:n_gap], seed),
                            "teacher": eq5_loss(self.model, teachers, seed)}  # fmt: skip
        return hybrids, extra


GAP_STATES = 8  # K states sampled per record for the exposure gap (the paper's K)


def eq5_loss(model, records: list[TrajectoryRecord], seed: int, states: int = GAP_STATES) -> list[float]:
    """[sum of Eq. 5's cross-entropy, supervised tokens] of ``model`` (a TDLM) on ``records``, K states each drawn with
    a generator seeded by ``seed`` (records of one response length, as decoding gives)."""
    from tdlm.data.trajectories import IGNORE_INDEX, build_batch, trajectory_loss

    bb = model.backbone
    device = next(bb.parameters()).device
    g = torch.Generator().manual_seed(seed)
    batch = build_batch(records, states, bb.mask_token_id, bb.pad_token_id, g).to(device)
    select = batch.labels != IGNORE_INDEX
    with torch.no_grad():
        logits = model(batch.input_ids, batch.prompt_len, attention_mask=batch.attention_mask, select=select)
        ce, n = trajectory_loss(logits, batch.labels[select])
    return [float(ce), int(n)]
