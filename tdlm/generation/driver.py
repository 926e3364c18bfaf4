"""The driver: plan shards, run replicas on Ray, write shards, report progress.

Recipe of :func:`generate`:

1. validate the config (tau in (0, 1], H > 0, ...), check that the backbone and adapter resolve on this machine
   and, for Hub prompts, that the Hub answers (else offline: local cache only, no retries), load the prompts,
   refuse evaluation problems among them unless ``allow_eval_prompts`` (:mod:`tdlm.data.contamination`: by
   source name, then by prompt hash), fingerprint backbone/adapter (:func:`prepare`); all before any folder is
   made or Ray starts;
2. lock and check the output dir (:meth:`ShardStore.open`): refuse changed settings or bad files,
   adopt a complete shard written just before a kill, list the shards left to do (nothing left:
   return without starting Ray);
3. connect to Ray: ``address`` / ``RAY_ADDRESS`` (set by ``ray job submit``), else a fresh local
   cluster (``ray.init(address="local")``);
4. start replicas: one per GPU (``num_gpus=1``), or CPU replicas with ``cpus_per_actor`` CPUs each,
   never more than shards to do; each with ``max_restarts`` / ``max_task_retries``, so Ray itself
   restarts a replica that dies and retries the shard it held;
5. hand shards to idle replicas; write each returned shard (atomic rename), then list it in the
   manifest. A shard whose replica is gone for good (Ray's retries spent) is put back in the queue
   and the replica replaced: the driver-level pass, bounded by ``max_shard_attempts`` per shard, run by the
   actor pool (:class:`tdlm.data.ray_pool.ActorPool`), which also watches the head and the nodes.
   Only the driver writes, and the pool hands each shard's result over once, so each prompt lands in exactly one row;
6. finish: check every prompt id appears once in shard order, NFE statistics, status "complete".

Ray patterns (actors + retries + driver redo pass + tmp/rename) follow the measurements in
``shared/notes/ray-wandb-datasets-on-cpu.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from tdlm.data import ray_pool
from tdlm.data.contamination import check_teacher_prompts
from tdlm.data.prompts import load_prompts
from tdlm.data.ray_pool import ActorPool, Loss, NodeNamed, PoolJob
from tdlm.data.ray_watch import HeadLost, head_lost  # noqa: F401 - re-exported
from tdlm.data.store import ShardStore
from tdlm.errors import TDLMError
from tdlm.generation.config import GenerationConfig
from tdlm.generation.worker import (
    FaultInjection,
    ShardResult,
    ShardTask,
    ShardWorker,
    WorkerSpec,
    adapter_fingerprint,
    backbone_fingerprint,
)
from tdlm.temporal.adapter_files import trained_history

log = logging.getLogger("tdlm.generation")

# Results are a few MB per shard at most (token-id lists) and weights are read from disk by each
# replica, so a local cluster needs only a small object store (Ray's default takes 30% of RAM).
LOCAL_OBJECT_STORE_BYTES = 512 * 1024**2
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor in the driver of a submitted job


class _Replica(NodeNamed, ShardWorker):
    """The Ray actor: a :class:`ShardWorker` that also names its node (the pool redoes the shards of a dead one)."""


@dataclass
class GenerationSummary:
    output_dir: str
    num_prompts: int
    num_shards: int
    computed_shards: list[int] = field(default_factory=list)  # written by this run
    skipped_shards: int = 0  # already finished before this run (incl. adopted)
    adopted_shards: int = 0
    redone_shards: int = 0  # driver-level redo passes
    seconds: float = 0.0
    trajectories_per_s: float | None = None
    nfe: dict = field(default_factory=dict)


# -- Ray connection ---------------------------------------------------------------------------------
def connect_ray(address: str | None) -> bool:
    """Connect (address / RAY_ADDRESS) or start a local cluster; True if this call initialised Ray."""
    return ray_pool.connect_ray(address, LOCAL_OBJECT_STORE_BYTES)


def replica_resources(cfg: GenerationConfig, shards_todo: int) -> tuple[int, dict]:
    """(number of replicas, Ray resource options): one per GPU, else CPU replicas of cpus_per_actor."""
    import ray

    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    if gpus:
        n, opts = gpus, {"num_gpus": 1, "num_cpus": cfg.cpus_per_actor}
    else:
        n, opts = max(1, cpus // cfg.cpus_per_actor), {"num_cpus": cfg.cpus_per_actor}
    if cfg.actors is not None:
        if cfg.actors > n:
            log.warning("%d actors requested; the cluster fits %d now (the rest wait for resources)", cfg.actors, n)
        n = cfg.actors
    return max(1, min(n, shards_todo)), opts


def worker_spec(cfg: GenerationConfig, gpu: bool, faults: FaultInjection | None = None) -> WorkerSpec:
    """What every replica of ``cfg`` loads and decodes with (``gpu``: the replicas hold a GPU each)."""
    return WorkerSpec(
        backbone=cfg.backbone,
        decode=cfg.decode,  # the validated section itself: every field reaches the replica (none dropped on the way)
        chat=cfg.chat,
        adapter=cfg.adapter,
        allow_other_backbone=cfg.allow_other_backbone,
        # Each replica places itself on what Ray gave it (tdlm.models.placement.actor_device: cuda:0 of its own
        # CUDA_VISIBLE_DEVICES with num_gpus=1, else cpu); a device chosen here would be the driver's view.
        device=None,
        threads=None if gpu else cfg.cpus_per_actor,
        faults=faults,
        rollout=cfg.rollout(),
    )


def replica_launcher(cfg: GenerationConfig, shards_todo: int,
                     faults: FaultInjection | None = None) -> tuple[int, dict, Callable[[], object]]:  # fmt: skip
    """(number of replicas, their Ray resource options, a function that starts one replica actor)."""
    n, resources = replica_resources(cfg, shards_todo)
    spec = worker_spec(cfg, resources.get("num_gpus", 0) > 0, faults)
    # Two threads per replica: run_shard in one, progress() answered in the other (per-batch progress).
    launch = ray_pool.actor_launcher(_Replica, spec, resources, max_restarts=cfg.max_restarts,
                                     max_task_retries=cfg.max_task_retries, max_concurrency=2)  # fmt: skip
    return n, resources, launch


# -- progress -------------------------------------------------------------------------------------
class Progress:
    """prompts done / total, trajectories/s and ETA: a tqdm bar on a terminal, plus plain log lines
    every ``interval`` seconds (``ray job logs`` is not a terminal and keeps only those)."""

    def __init__(self, total: int, done: int, interval: float) -> None:
        self.total, self.done, self.base = total, done, done
        self.inflight: dict[int, int] = {}  # shard -> prompts decoded in it so far (replicas' decode batches)
        self.interval = interval
        self.t0: float | None = None  # set when the first shard is handed out (after replica start-up)
        self.last = time.monotonic()
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="traj", desc="trajectories", file=sys.stdout)

    def start(self) -> None:
        if self.t0 is None:
            self.t0 = time.monotonic()

    def shown(self) -> int:
        return self.done + sum(self.inflight.values())

    def rate(self) -> float | None:
        if self.t0 is None or self.shown() == self.base:
            return None
        return (self.shown() - self.base) / max(time.monotonic() - self.t0, 1e-9)

    def line(self, extra: str = "") -> str:
        rate, shown = self.rate(), self.shown()
        eta = "?" if not rate else str(dt.timedelta(seconds=round((self.total - shown) / rate)))
        pct = 100.0 * shown / self.total
        speed = f"{rate:.2f} traj/s" if rate else "- traj/s"
        return f"progress {shown}/{self.total} prompts ({pct:.1f}%) | {speed} | ETA {eta}{extra}"

    def _redraw(self) -> None:
        if self.bar is not None:
            self.bar.n = self.shown()
            self.bar.refresh()

    def partial(self, inflight: dict[int, int]) -> None:
        """Prompts decoded so far inside shards still running; they count until their shard is written."""
        self.inflight = {i: n for i, n in inflight.items() if n}
        self._redraw()

    def add(self, n: int, extra: str = "", shard: int | None = None) -> None:
        self.done += n
        self.inflight.pop(shard, None)
        self._redraw()
        self.tick(extra)

    def tick(self, extra: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.interval:
            self.last = now
            log.info(self.line(extra))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- the job ------------------------------------------------------------------------------------
def _fingerprints(cfg: GenerationConfig) -> tuple[str | None, str | None]:
    """Backbone/adapter fingerprints if the driver sees the files; else the replicas' are used."""
    fps: list[str | None] = []
    for fn, arg in ((backbone_fingerprint, cfg.backbone), (adapter_fingerprint, cfg.adapter)):
        if arg is None:
            fps.append(None)
            continue
        try:
            fps.append(fn(arg))
        except TDLMError as e:
            log.info("driver cannot fingerprint %s (%s); checking the replicas' copy instead", arg, e)
            fps.append(None)
    return fps[0], fps[1]


def _tdlm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tdlm")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "unknown"


def _cause(e: Exception) -> BaseException:
    return getattr(e, "cause", None) or e


def check_models_and_hub(cfg: GenerationConfig) -> str | None:
    """Before any prompt is read, folder made or Ray started: the backbone (and adapter) resolve on this machine,
    named when they do not (``ray job submit`` runs this on the head node, which must see them like every node).
    Prompts from the Hub: one quick probe; when the Hub cannot be reached, the Hugging Face libraries go offline
    (local cache only, no retry loop) and the reason is returned for the error message."""
    from tdlm.models.loading import check_backbone_available, hub_offline, hub_unreachable

    try:
        check_backbone_available(cfg.backbone)
    except TDLMError as e:
        raise (e if repr(cfg.backbone) in str(e) else TDLMError(f"backbone {cfg.backbone!r}: {e}")) from None
    if cfg.adapter:
        adapter_fingerprint(cfg.adapter)  # names the folder and the missing file
    if cfg.adapter and cfg.decode.history is None:  # the adapter's own history (static: no latent:M), before Ray
        try:
            replace(cfg.decode, history=str(trained_history(cfg.adapter))).validate()
        except TDLMError as e:
            raise TDLMError(f"--adapter {cfg.adapter}: {e}") from None
    if cfg.prompt_source().is_local():
        return None
    why = hub_unreachable()
    if why:
        hub_offline()
    return why


def prepare(cfg: GenerationConfig) -> ShardStore:
    """Step 1 of the recipe: the checked job as an (unopened, unlocked) :class:`ShardStore`.

    Raises TDLMError for a bad config and for evaluation problems among the prompts (unless
    ``cfg.allow_eval_prompts``); the store writes the prompts' source, split and per-prompt hashes
    and the contamination report into ``manifest.json``.
    """
    cfg.validate()
    if os.environ.get(RAY_JOB_ENV) and not os.path.isabs(os.path.expanduser(cfg.output_dir)):
        raise TDLMError(
            f"--output-dir {cfg.output_dir!r} is relative, but a Ray job runs in a temporary copy of its "
            f"working dir (the shards would be lost with it); give an absolute path"
        )
    offline = check_models_and_hub(cfg)
    src = cfg.prompt_source()
    try:
        prompts = load_prompts(src)
    except TDLMError as e:
        if offline:
            raise TDLMError(f"{e} (the Hugging Face Hub cannot be reached: {offline}; only the local cache was "
                            f"read, nothing retried)") from None
        raise
    provenance = check_teacher_prompts(src, [p.text for p in prompts], cfg.allow_eval_prompts)
    fp_backbone, fp_adapter = _fingerprints(cfg)
    identity = cfg.identity(prompts, fp_backbone, fp_adapter)
    return ShardStore(cfg.output_dir, prompts, cfg.shard_size, identity, provenance=provenance)


def generate(cfg: GenerationConfig) -> GenerationSummary:
    """Generate (or finish) the teacher trajectories of ``cfg`` in ``cfg.output_dir``; see the module docstring."""
    t_start = time.monotonic()
    store = prepare(cfg)
    prompts = store.prompts
    summary = GenerationSummary(str(store.root), len(prompts), store.num_shards)
    with store:
        todo = store.open()
        summary.skipped_shards = store.num_shards - len(todo)
        summary.adopted_shards = store.adopted
        if not todo:
            log.info("%s: all %d shards finished; nothing to do", store.root, store.num_shards)
            summary.nfe = store.finalize()
            summary.seconds = time.monotonic() - t_start
            return summary
        log.info("%s: %d prompts in %d shards of %d; %d finished, %d to do", store.root, len(prompts),
                 store.num_shards, cfg.shard_size, summary.skipped_shards, len(todo))  # fmt: skip
        faults = FaultInjection.from_env(tempfile.gettempdir())
        if faults is not None:
            log.warning("TEST FAULT INJECTION ACTIVE: %s", faults)
        started_ray = connect_ray(cfg.address)
        lost = False
        try:
            _run(cfg, store, todo, faults, summary)
        except HeadLost:
            # Every Ray call now blocks on the dead GCS or exits the process from C++ (ray.shutdown does, also in
            # its atexit hook), so none is made: the one-line error is the last thing this driver prints.
            lost = True
            atexit.unregister(ray_shutdown())
            raise
        finally:
            if faults is not None and faults.crash_marker:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(faults.crash_marker)
            if faults is not None and faults.barrier_dir:
                shutil.rmtree(faults.barrier_dir, ignore_errors=True)
            if started_ray and not lost:
                ray_shutdown()()
        summary.nfe = store.finalize()
    summary.seconds = time.monotonic() - t_start
    nfe = summary.nfe
    log.info("done: %d trajectories in %s (%d shards computed, %d skipped); NFE mean %.2f median %s min %d max %d",
             len(prompts), store.root, len(summary.computed_shards), summary.skipped_shards, nfe["mean"],
             nfe["median"], nfe["min"], nfe["max"])  # fmt: skip
    return summary


def ray_shutdown():
    import ray

    return ray.shutdown


class _ShardPool(ActorPool):
    """The generation job on the pool: a job is one shard (one shared queue, one shard per replica at a time), its
    result is written by this driver and listed in the manifest; a lost replica is always replaced."""

    noun = "replica"

    def __init__(self, cfg: GenerationConfig, store: ShardStore, faults: FaultInjection | None,
                 summary: GenerationSummary, launch: Callable[[], object], n_actors: int) -> None:  # fmt: skip
        super().__init__(launch, range(n_actors), log=log, max_attempts=cfg.max_shard_attempts,
                         max_replacements=cfg.max_shard_attempts * n_actors, head_timeout_s=cfg.head_timeout_s,
                         poll_s=min(cfg.log_interval, 1.0))  # fmt: skip
        self.cfg, self.store, self.faults, self.summary, self.n_actors = cfg, store, faults, summary, n_actors
        self.failures: list[dict] = []
        self.processes: list[dict] = []  # every replica that came up (Ray's own restarts are invisible here)
        self.progress = Progress(len(store.prompts), store.finished_prompts(), cfg.log_interval)
        self.written = 0

    def submit(self, handle, job: PoolJob):
        ps = self.store.shard_prompts(job.key)  # type: ignore[arg-type]
        task = ShardTask(job.key, [p.source_id for p in ps], [p.text for p in ps], job.attempts)  # type: ignore[arg-type]
        self.progress.start()
        return handle.run_shard.remote(task)

    def ready(self, slot: int, info: dict) -> None:
        self.store.check_actor_identity(info)
        self.processes.append({k: info[k] for k in ("pid", "host", "device", "threads", "node_id")})
        log.info("replica %d up: pid %s on %s (%s, CUDA_VISIBLE_DEVICES=%s, %s threads)", slot, info["pid"],
                 info["host"], info["device"], info["cuda_visible_devices"], info["threads"])  # fmt: skip

    def kept(self) -> str:
        done = self.store.num_shards - len(self.store.todo())
        return f"{done}/{self.store.num_shards} shards finished and kept in {self.store.root}"

    def idle(self) -> None:
        self.progress.partial(_inflight(self))
        self.progress.tick(f" | {self.n_actors - self.starting()}/{self.n_actors} replicas up")

    def task_failed(self, job: PoolJob, slot: int, msg: str, cause: BaseException) -> None:
        if isinstance(cause, TDLMError) or job.attempts >= self.cfg.max_shard_attempts:
            raise TDLMError(f"shard {job.key} failed (attempt {job.attempts}): {msg}")
        self.failures.append({"shard": job.key, "attempt": job.attempts, "error": msg})
        log.warning("shard %d attempt %d failed (%s); retrying", job.key, job.attempts, msg)

    def start_failed(self, slot: int, msg: str) -> None:
        raise TDLMError(f"replica failed to start: {msg}")

    def gave_up(self, job: PoolJob, slot: int, loss: Loss) -> None:
        if loss.node:
            raise TDLMError(f"shard {job.key}: its replica's node died on all {job.attempts} attempts")
        raise TDLMError(f"shard {job.key}: replica died on all {job.attempts} attempts ({type(loss.error).__name__})")

    def job_lost(self, job: PoolJob, slot: int, loss: Loss) -> None:
        error = "node died" if loss.node else type(loss.error).__name__
        self.failures.append({"shard": job.key, "attempt": job.attempts, "error": error})
        if loss.node:
            log.warning("shard %d: the node of replica %d died; redoing the shard", job.key, slot)
        else:
            log.warning("shard %d: replica died (%s); redoing the shard", job.key, error)
        self.summary.redone_shards += 1

    def actor_gone(self, slot: int, loss: Loss, taker: int | None, moved: int) -> None:
        log.warning("replica %d is gone (%s); starting a new one", slot, type(loss.error).__name__)

    def keep_dying(self, slot: int, loss: Loss) -> str:
        last = f"{type(loss.error).__name__}: {loss.error}"
        return f"replicas keep dying ({self.replacements} replaced); last error: {last}"

    def done(self, job: PoolJob, value: ShardResult) -> None:
        store, index = self.store, job.key
        entry = store.write_shard(value.index, value.records, value.seconds, value.worker, job.attempts,
                                  extra=value.extra)  # fmt: skip
        self.written += 1
        if self.faults is not None and self.faults.kill_after == self.written:
            log.warning("TEST FAULT INJECTION: SIGKILL after shard %d file, before the manifest", index)
            os.kill(os.getpid(), signal.SIGKILL)
        store.commit(entry)
        self.summary.computed_shards.append(index)  # type: ignore[arg-type]
        self.progress.add(len(value.records), f" | shard {index} done ({value.seconds:.1f} s)", shard=index)


def _inflight(pool: ActorPool) -> dict[int, int]:
    """shard -> prompts decoded so far, asked of every replica holding a shard (a replica that died or does not
    answer within a second counts nothing; its shard's result, or its failure, comes through the pool)."""
    import ray

    busy = {slot: jobs[0].key for slot, jobs in pool.running().items()}
    refs = {slot: pool.handles[slot].progress.remote() for slot in busy}  # type: ignore[attr-defined]
    out: dict[int, int] = {}
    for slot, ref in refs.items():
        try:
            got = ray.get(ref, timeout=1.0)
        except Exception:  # GetTimeoutError, RayActorError: no number this time
            continue
        if got is not None and got[0] == busy[slot]:
            out[got[0]] = int(got[1])
    return out


def _run(cfg: GenerationConfig, store: ShardStore, todo: list[int], faults: FaultInjection | None,
         summary: GenerationSummary) -> None:  # fmt: skip
    """Steps 4-5 of the recipe: replicas, dispatch, writes, driver-level redo pass (on :class:`ActorPool`)."""
    import ray

    n_actors, resources, launch = replica_launcher(cfg, len(todo), faults)
    log.info("starting %d replica(s) of %s (%s each)", n_actors, cfg.backbone, resources)
    pool = _ShardPool(cfg, store, faults, summary, launch, n_actors)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    try:
        pool.run(PoolJob(index, None, position) for position, index in enumerate(todo))
    finally:
        pool.progress.close()
        pool.close()
    pool.progress.tick(force=True)
    rate = pool.progress.rate()
    summary.trajectories_per_s = rate
    store.record_run({
        "started": started,
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ray_address": ray.get_runtime_context().gcs_address,
        "replicas": n_actors,
        "replica_resources": resources,
        "replica_replacements": pool.replacements,
        "replica_processes": pool.processes,
        "computed_shards": sorted(summary.computed_shards),
        "adopted_shards": store.adopted,
        "failures": pool.failures,
        "trajectories_per_s": rate,
        "settings": cfg.run_settings(),
        "versions": {"tdlm": _tdlm_version(), "torch": torch.__version__, "ray": ray.__version__,
                     "python": sys.version.split()[0]},
    })  # fmt: skip
