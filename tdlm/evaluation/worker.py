"""One evaluation worker: a backbone replica that decodes shards and appends per-sample records.

Plain Python so that ``--workers 1`` runs it in-process and tests use it without Ray; the driver wraps
it with ``ray.remote`` (one actor per GPU, or CPU actors). The worker loads the backbone and its
tokenizer once, and the TDLM adapters lazily (one :class:`tdlm.TDLM` per adapter folder; the history
restriction is switched with :meth:`tdlm.TDLM.set_history`, which leaves the weights untouched).

For every shard job: open the shard file (cutting an interrupted last line), skip ids already there
(a Ray retry or a resumed evaluation), build prompt ids with the chat template
(:func:`tdlm.data.tokenizer.encode_prompts`), run ``warmup`` untimed decodes so the timed ones exclude
lazy initialisation (CUDA context, allocator, kernel selection), then decode ``batch_size`` rows at a time with
the decode engine's refill (a finished row takes the next problem) and append one flushed record per sample as it
finishes. Records carry the generation, the response token ids,
NFE and the seconds :func:`tdlm.decode` measured (device-synchronised, from the request's admission to its end;
with batch size 1 the latency of that request).
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tdlm.decoding import decode
from tdlm.decoding.config import DecodeSettings
from tdlm.evaluation.records import Appender, read_records, shard_path
from tdlm.models.placement import actor_device, describe_placement

# Test-only fault injection: "<n>" makes the process SIGKILL itself right after writing its n-th record.
KILL_AFTER_ENV = "TDLM_EVAL_TEST_KILL_AFTER"
_SESSION = uuid.uuid4().hex[:12]  # one per process: shows which process wrote a record (resume tests)
_written = 0  # records written by this process (for the fault injection)


@dataclass
class WorkerSpec:
    """What a worker loads (sent to each actor's constructor)."""

    backbone: str
    decode: DecodeSettings  # the job's decode section: the replica loads its weights in decode.dtype
    device: str | None = None  # None: what the process was given (actor_device: a Ray actor's own GPU, else cpu)
    threads: int | None = None  # torch intra-op threads on CPU; None = as set by Ray / OMP
    chat: bool = True
    allow_other_backbone: bool = False  # attach adapters trained on another backbone


@dataclass
class ShardJob:
    """Decode the problems of one shard of one run (only those without a record yet)."""

    run: dict  # RunSpec fields
    run_dir: str
    shard: int
    num_shards: int
    problems: list[tuple[str, int, str]]  # (id, split index, user prompt text)
    # the run's decode settings (RunSpec.settings), validated by the driver and received as that same object:
    # policy, tau, cache, history, compile, storage, batch ... (tests/test_decode_settings.py checks every field)
    settings: DecodeSettings
    warmup: int = 1


@dataclass
class ShardReport:
    run_dir: str
    shard: int
    computed: int  # samples decoded by this call
    skipped: int  # samples that already had a record
    seconds: float
    worker: dict = field(default_factory=dict)


def resolve_device(device: str | None) -> str:
    """``device``, else where this process's replica belongs (:func:`tdlm.models.placement.actor_device`)."""
    return actor_device(device)


class EvalWorker:
    """A backbone replica. Construction never raises: an error is kept and re-raised by :meth:`info`
    and :meth:`run_shard`, so a bad path reaches the driver as one TDLMError instead of an actor that
    Ray restarts until its budget is gone."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.error: BaseException | None = None
        self._adapters: dict[str, object] = {}
        kill = os.environ.get(KILL_AFTER_ENV)
        self.kill_after = int(kill) if kill and kill.isdigit() else None
        self.device: str | None = None
        try:
            self.device = resolve_device(spec.device)  # before loading: placement() reports it even if loading fails
            self._load()
        except Exception as e:  # re-raised on the driver's first call
            self.error = e

    def _load(self) -> None:
        from tdlm.data.tokenizer import load_tokenizer, stop_token_ids
        from tdlm.models.loading import load_backbone

        spec = self.spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.backbone = load_backbone(spec.backbone, dtype=spec.decode.dtype, device=self.device)
        self.tokenizer = load_tokenizer(spec.backbone)
        self.stop_ids = stop_token_ids(self.tokenizer, self.backbone.eos_token_id)
        name = torch.cuda.get_device_name(torch.device(self.device)) if self.device.startswith("cuda") else "cpu"
        self.meta = {"pid": os.getpid(), "host": socket.gethostname(), "device": self.device, "device_name": name,
                     "threads": torch.get_num_threads(), "session": _SESSION}  # fmt: skip

    def info(self) -> dict:
        if self.error is not None:
            raise self.error
        return {"backbone_id": self.backbone.backbone_id, **self.meta,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip

    def placement(self) -> dict:
        """:func:`~tdlm.models.placement.describe_placement` of this worker, also when loading failed (with the
        error)."""
        return {**describe_placement(self.device), "error": None if self.error is None else repr(self.error)}

    def _model(self, run: dict, settings: DecodeSettings):
        if settings.policy != "tdlm":
            return self.backbone
        from tdlm.temporal.model import TDLM

        path = run["adapter"]
        model = self._adapters.get(path)
        if model is None:
            model = TDLM.from_adapter(self.backbone, path, history=settings.history,
                                      allow_other_backbone=self.spec.allow_other_backbone).to(self.device).eval()
            self._adapters[path] = model
        model.set_history(settings.history)
        return model

    def run_shard(self, job: ShardJob, progress: Callable[[int], None] | None = None) -> ShardReport:
        """Decode the shard's remaining problems, appending one record per sample; see the module docstring."""
        from tdlm.data.tokenizer import encode_prompts

        if self.error is not None:
            raise self.error
        t0 = time.perf_counter()
        path = shard_path(job.run_dir, job.shard, job.num_shards)
        with Appender(path) as out:  # cuts an interrupted last line before we read and append
            done = {r["id"] for r in read_records(path)}
            todo = [p for p in job.problems if p[0] not in done]
            if todo:
                cfg = job.settings
                model = self._model(job.run, cfg)
                ids = encode_prompts(self.tokenizer, [p[2] for p in todo], chat=self.spec.chat)
                kw = dict(tokenizer=self.tokenizer, stop_ids=self.stop_ids)
                for _ in range(job.warmup):
                    decode(model, ids[: cfg.batch_size], cfg, **kw)

                def finished(i: int, r) -> None:  # a record as each request finishes: nothing lost on a crash
                    pid, index, prompt = todo[i]
                    out.write({
                        "id": pid, "index": index, "prompt": prompt, "generation": r.text, "nfe": r.nfe,
                        "seconds": r.seconds, "prompt_tokens": len(ids[i]), "tokens": r.tokens,
                        "batch_size": min(cfg.batch_size, len(todo)), "worker": self.meta,
                    })  # fmt: skip
                    self._count_written()
                    if progress is not None:
                        progress(1)

                # one engine run: batch_size rows, a finished row taking the next problem (refill)
                decode(model, ids, cfg, batch_size=cfg.batch_size, on_result=finished, **kw)
        return ShardReport(job.run_dir, job.shard, len(todo), len(job.problems) - len(todo),
                           time.perf_counter() - t0, dict(self.meta))  # fmt: skip

    def _count_written(self) -> None:
        global _written
        _written += 1
        if self.kill_after is not None and _written >= self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # a hard death right after a flushed record
