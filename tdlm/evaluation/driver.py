"""The evaluation driver: plan runs and shards, decode (in-process or on Ray), score, report.

Recipe of :func:`evaluate`:

1. validate the config, expand the grid of runs (:func:`tdlm.evaluation.config.expand`), load the tasks;
2. per run: check or write ``run.json`` (identity settings; a changed setting is refused), read the done
   ids from its shard files, and split the remaining problems over W workers (problem i -> shard i % W);
3. decode: W = 1 runs one :class:`EvalWorker` in this process (no Ray); W > 1 starts W Ray actors, one per
   GPU (``num_gpus=1``) or CPU actors (``num_cpus=threads``). Actor w decodes shard w of every run, each
   appending its own file. Ray restarts a dead actor and retries its shard (``max_restarts`` /
   ``max_task_retries``); once those are spent (or its node is reported dead) the actor pool
   (:class:`tdlm.data.ray_pool.ActorPool`) moves its jobs to a live actor in the plan's order (bounded by
   ``max_shard_attempts``), and starts a new one only when none is left. A retry skips the samples its shard
   file already holds. Workers write the shard files themselves, so on a multi-node cluster ``output_dir``
   (and the checkpoint / adapters) must be on storage every node shares; a node-local dir shows up as missing
   samples at the merge. The whole job holds ``<output_dir>/.lock`` (:class:`tdlm.data.folder_lock.FolderLock`):
   one evaluation per output folder, a second one is refused at once naming the holder, a dead holder's lock is
   taken over;
4. merge each run's shards and check every problem appears exactly once; score with
   :class:`tdlm.evaluation.scoring.Scorer` here in the driver, after decoding, so scoring never competes with the
   timed decodes for CPU (Math-Verify runs in the Scorer's processes' main threads, code in the sandbox);
   scores of unchanged generations are reused from the previous ``samples.jsonl``;
5. metrics and speedups (:mod:`tdlm.evaluation.metrics`); per run ``samples.jsonl`` + ``summary.json`` + a
   W&B run (group = the comparison; :mod:`tdlm.evaluation.summaries`); for the job ``summary.json``,
   ``table.md`` and ``pareto_<task>.png``, plus a W&B comparison run with the tables and plots.

Output layout::

    <output_dir>/.lock  summary.json  table.md  pareto_<task>.png  comparison/ (W&B)
    <output_dir>/runs/<task>/<run>/run.json  shards/shard-<w>-of-<W>.jsonl  samples.jsonl  summary.json  wandb/
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tdlm.data import ray_pool
from tdlm.data.folder_lock import FolderLock
from tdlm.data.ray_pool import ActorPool, Loss, NodeNamed, PoolJob
from tdlm.data.ray_watch import HeadLost, head_lost  # noqa: F401 - re-exported
from tdlm.data.store import atomic_write_text
from tdlm.data.trajectories import write_error
from tdlm.errors import TDLMError
from tdlm.evaluation.config import (
    EvalConfig,
    adapter_fingerprint,
    backbone_fingerprint,
    expand,
    read_adapter_config,
)
from tdlm.evaluation.metrics import compute_speedups
from tdlm.evaluation.paired import attach_paired
from tdlm.evaluation.paired import settings as paired_settings
from tdlm.evaluation.plot import plot_all
from tdlm.evaluation.records import done_ids, merge, read_records, shard_of
from tdlm.evaluation.report import render
from tdlm.evaluation.summaries import SUMMARY, Plan, log_comparison, log_run, run_summary
from tdlm.evaluation.worker import EvalWorker, ShardJob, WorkerSpec
from tdlm.tasks import load_task

log = logging.getLogger("tdlm.evaluation")

RUN_IDENTITY = "run.json"
SAMPLES = "samples.jsonl"
IDENTITY_VERSION = 1
# Only small records travel through Ray (the workers write their own files), so a small store does.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2


@dataclass
class EvalResult:
    output_dir: str
    runs: list[dict]
    table: str
    summary_path: str
    table_path: str
    plots: list[str] = field(default_factory=list)
    computed: int = 0  # samples decoded by this call
    skipped: int = 0  # samples found done from an earlier call
    workers: int = 1


# -- small helpers ------------------------------------------------------------------------------------
# What a failed write of a merged file leaves: the shards hold every decoded sample, so a rerun only rescores.
KEPT = "every sample is kept in the shard files (the rerun decodes nothing)"


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n", f"{path.name} is unchanged; {KEPT}")


def _write_jsonl(path: Path, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                      f"{path.name} is unchanged; {KEPT}")


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, "<unset>"), new.get(k, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def backbone_id(name_or_path: str) -> str:
    """The id load_backbone gives the model, without loading it (preset name or config ``_name_or_path``)."""
    from tdlm.models.loading import PRESETS, _resolve_folder

    if name_or_path in PRESETS:
        return name_or_path
    cfg = _resolve_folder(name_or_path) / "config.json"
    try:
        return str(json.loads(cfg.read_text()).get("_name_or_path") or name_or_path)
    except (OSError, json.JSONDecodeError) as e:
        raise TDLMError(f"{cfg}: cannot read the backbone config: {e}") from e


# -- 1-2: plan ----------------------------------------------------------------------------------------
def plan_runs(cfg: EvalConfig) -> list[Plan]:
    """Expand the grid, load tasks, and check/write every run's identity (``run.json``)."""
    specs = expand(cfg)
    if cfg.reference is not None and cfg.reference not in {s.name for s in specs}:
        names = sorted({s.name for s in specs})
        raise TDLMError(f"reference={cfg.reference!r} is not a run of this evaluation; expected one of "
                        f"{', '.join(names)}")  # fmt: skip
    tasks = {t: load_task(t, cfg.data_dir, cfg.limit) for t in cfg.tasks}
    for t, task in tasks.items():
        if not task.problems:
            raise TDLMError(f"task {t}: no problems to evaluate (limit={cfg.limit})")
    bb = backbone_fingerprint(cfg.backbone)
    adapter_fps = {path: adapter_fingerprint(path) for path in cfg.adapter_dirs().values()}
    out = Path(cfg.output_dir).resolve()
    plans = []
    for spec in specs:
        task = tasks[spec.task]
        identity = {
            "version": IDENTITY_VERSION,
            "backbone": bb,
            "dtype": cfg.decode.dtype,
            "chat": cfg.chat,
            "task": spec.task,
            "prompt_version": task.prompt_version,
            "decode": spec.settings(cfg).to_dict(),
            "adapter": adapter_fps.get(spec.adapter) if spec.adapter else None,
            "history": spec.history,
            "batch_size": cfg.decode.batch_size,  # changes what "seconds" measures
        }
        run_dir = out / "runs" / spec.task / spec.name
        path = run_dir / RUN_IDENTITY
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise TDLMError(f"{path}: invalid JSON ({e}); expected this run's settings") from e
            changes = _diff(old, identity)
            if changes:
                raise TDLMError(f"{run_dir}: settings differ from the results already there ({'; '.join(changes)}); "
                                f"use another --output-dir or delete the run dir")  # fmt: skip
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            _write_json(path, identity)
        plans.append(Plan(spec, run_dir, task, identity))
    return plans


def shard_jobs(cfg: EvalConfig, plans: list[Plan], num_shards: int) -> tuple[list[ShardJob], int]:
    """Jobs for the problems without a record yet (any earlier worker count); returns (jobs, samples done).

    One job per ``job_batches`` batches of a run's shard (the worker decodes a job with refill: a finished row's slot
    takes the job's next problem), ordered in rounds so that the methods are timed interleaved: round k holds the
    k-th job of every run's shard, runs in an order rotated by k (A B C, B C A, ...). A worker runs its jobs in this
    order, so a change of machine load during an evaluation lands on every run alike, not on the runs that happened
    to be decoded at that time; only each run's first job warms up (``warmup``: the worker keeps its models)."""
    per_run: list[list[list[ShardJob]]] = []  # [plan][round] -> the round's jobs of that run (one per shard)
    skipped = 0
    for plan in plans:
        done = done_ids(plan.run_dir)
        todo = [p for p in plan.task.problems if p.id not in done]
        skipped += len(plan.task.problems) - len(todo)
        settings = plan.spec.settings(cfg)  # the object the worker decodes with (every field, none dropped)
        per_job = settings.batch_size * cfg.job_batches
        rounds: list[list[ShardJob]] = []
        for w in range(num_shards):
            probs = [(p.id, p.index, p.prompt) for p in todo if shard_of(p.index, num_shards) == w]
            for k, start in enumerate(range(0, len(probs), per_job)):
                if len(rounds) <= k:
                    rounds.append([])
                rounds[k].append(ShardJob(plan.spec.to_dict(), str(plan.run_dir), w, num_shards,
                                          probs[start : start + per_job], settings, cfg.warmup if k == 0 else 0))
        per_run.append(rounds)
    jobs = []
    for k in range(max((len(r) for r in per_run), default=0)):
        n = len(per_run)
        for i in (*range(k % n, n), *range(k % n)):
            jobs.extend(per_run[i][k] if k < len(per_run[i]) else [])
    return jobs, skipped


def num_workers(cfg: EvalConfig) -> int:
    """``workers`` if set, else one per GPU of the Ray cluster the actors would run on (at least 1).

    That is the cluster's GPUs, not this process's: with an address, or a Ray connection its caller already made,
    the driver may run on a head without GPUs (its ``torch.cuda.device_count()`` is 0 and the job would run
    in-process on its CPU) or see other GPUs than the workers. Only for a fresh local cluster, which Ray sizes from
    the GPUs this process sees, is ``torch.cuda.device_count()`` the same number."""
    if cfg.workers is not None:
        return cfg.workers
    import ray

    if ray.is_initialized() or cfg.ray_address or os.environ.get("RAY_ADDRESS"):
        _connect_ray(cfg.ray_address)
        return max(1, int(ray.cluster_resources().get("GPU", 0)))
    return max(1, torch.cuda.device_count())


# -- 3: decode ----------------------------------------------------------------------------------------
def _bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, disable=total == 0)


def worker_spec(cfg: EvalConfig, device: str | None, threads: int | None) -> WorkerSpec:
    """What a worker loads, in process and on Ray alike: the decode section goes as the object itself (its dtype)."""
    return WorkerSpec(cfg.backbone, cfg.decode, device, threads, cfg.chat, cfg.allow_other_backbone)


def run_in_process(cfg: EvalConfig, jobs: list[ShardJob]) -> None:
    worker = EvalWorker(worker_spec(cfg, cfg.device, cfg.threads))
    info = worker.info()
    log.info("worker up in-process: %s on %s (%s threads)", info["backbone_id"], info["device_name"], info["threads"])
    with _bar(sum(len(j.problems) for j in jobs), "decode") as bar:
        for job in jobs:
            bar.set_postfix_str(Path(job.run_dir).name, refresh=False)
            worker.run_shard(job, progress=bar.update)


def _connect_ray(address: str | None) -> bool:
    """Connect to ``address`` / RAY_ADDRESS or start a fresh local cluster; True if this call initialised Ray."""
    return ray_pool.connect_ray(address, LOCAL_OBJECT_STORE_BYTES)


class _RayWorker(NodeNamed, EvalWorker):
    """The Ray actor: an :class:`EvalWorker` that also names its node (the pool moves the jobs of a dead one)."""


def worker_launcher(cfg: EvalConfig, num_shards: int) -> tuple[dict, Callable[[], object]]:
    """(Ray resource options of a worker actor, a function that starts one): one GPU each when the cluster has GPUs
    (decided from the cluster's resources, not from what this driver process sees), else ``threads`` CPUs each."""
    import ray

    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    threads = cfg.threads or 1
    if gpus:
        opts = {"num_gpus": 1, "num_cpus": 1}
        if num_shards > gpus:
            log.warning("%d workers but %d GPUs: the extra actors wait for a free GPU", num_shards, gpus)
    else:
        opts = {"num_cpus": threads}
        if num_shards * threads > cpus:
            log.warning("%d CPU workers x %d threads but %d CPUs: some actors wait", num_shards, threads, cpus)
    # device None: each actor places itself on what Ray gave it (worker.resolve_device: cuda:0 of its own
    # CUDA_VISIBLE_DEVICES with num_gpus=1, else cpu); --device names the in-process worker's device only.
    spec = worker_spec(cfg, None, None if gpus else threads)
    return opts, ray_pool.actor_launcher(_RayWorker, spec, opts, max_restarts=cfg.max_restarts,
                                         max_task_retries=cfg.max_task_retries)  # fmt: skip


IN_FLIGHT = 2  # jobs submitted ahead per actor: it never waits for the driver, and a lost driver leaves little queued
# Test-only: while the file this variable names exists, no job is submitted (the actors start and report; the
# three-node test freezes a worker that is up before it decodes anything, so that its node's loss always leaves
# jobs for the driver to move: tests/test_ray_cluster.py).
HOLD_ENV = "TDLM_EVAL_TEST_HOLD"


class _ShardPool(ActorPool):
    """The evaluation on the pool: a job is one batch of one run's shard, homed to the worker of its shard (one writer
    per shard file); the worker appends the samples itself, the driver only counts them. Only when no worker is left
    is a lost one replaced (the cluster may have no room for it); a task error stops the evaluation."""

    noun = "worker"

    def __init__(self, cfg: EvalConfig, launch: Callable[[], object], slots: list[int], num_shards: int,
                 bar) -> None:  # fmt: skip
        super().__init__(launch, slots, log=log, max_attempts=cfg.max_shard_attempts,
                         max_replacements=cfg.max_shard_attempts * max(1, num_shards),
                         head_timeout_s=cfg.head_timeout_s, in_flight=IN_FLIGHT, keep_size=False,
                         hold=os.environ.get(HOLD_ENV))  # fmt: skip
        self.cfg, self.bar = cfg, bar

    def ready(self, slot: int, info: dict) -> None:
        log.info("worker %d up: pid %s on %s (%s %s, CUDA_VISIBLE_DEVICES=%s, node %s)", slot, info["pid"],
                 info["host"], info["device"], info["device_name"], info["cuda_visible_devices"],
                 info["node_id"][:12])  # fmt: skip

    def kept(self) -> str:
        left = sum(len(job.payload.problems) for job in self.queued())  # type: ignore[attr-defined]
        return f"{left} sample(s) of this call not submitted; finished samples are kept in {self.cfg.output_dir}"

    def task_failed(self, job: PoolJob, slot: int, msg: str, cause: BaseException) -> None:
        shard: ShardJob = job.payload  # type: ignore[assignment]
        raise TDLMError(f"{shard.run_dir} shard {shard.shard}: {msg}")  # tdlm code raised: not worth a retry

    def gave_up(self, job: PoolJob, slot: int, loss: Loss) -> None:
        shard: ShardJob = job.payload  # type: ignore[assignment]
        raise TDLMError(f"{shard.run_dir} shard {shard.shard}: workers died on all {job.attempts} attempts")

    def done(self, job: PoolJob, value) -> None:
        self.bar.update(value.computed)


def run_on_ray(cfg: EvalConfig, jobs: list[ShardJob], num_shards: int) -> None:
    """One actor per shard with work; each runs its shard's jobs in the plan's order (at most ``IN_FLIGHT`` submitted
    ahead), on :class:`tdlm.data.ray_pool.ActorPool`.

    An actor that is gone for good (Ray's restarts spent, or its node dead) is killed and its remaining jobs move, in
    the plan's order, to the live actor with the least work left: any actor may append to any shard file, and one actor
    runs one job at a time, so each file keeps one writer. Only when no actor is left is a new one started (the cluster
    may have no room for it). The head is watched: once it is lost the job stops in one line.
    """
    import ray

    started = _connect_ray(cfg.ray_address)
    pool: _ShardPool | None = None
    try:
        opts, launch = worker_launcher(cfg, num_shards)
        slots = sorted({job.shard for job in jobs})
        log.info("starting %d Ray actor(s) of %s (%s each)", len(slots), cfg.backbone, opts)
        with _bar(sum(len(j.problems) for j in jobs), "decode") as bar:
            pool = _ShardPool(cfg, launch, slots, num_shards, bar)
            pool.run(PoolJob((j.run_dir, j.shard, j.problems[0][0]), j, i, j.shard) for i, j in enumerate(jobs))
    finally:
        lost = pool is not None and pool.lost
        if pool is not None:
            pool.close()  # kills nothing after a lost head (ray.kill would block on a dead GCS)
        if lost:  # ray.shutdown (also its atexit hook) exits the process from C++ on a dead head: no Ray call
            import atexit

            atexit.unregister(ray.shutdown)
        elif started:
            ray.shutdown()


# -- 4: merge and score -------------------------------------------------------------------------------
def _code_limits(cfg: EvalConfig):
    from tdlm.evaluation.sandbox import SandboxLimits

    return SandboxLimits(timeout_s=cfg.code_timeout_s, cpu_s=cfg.code_cpu_s)


def check_sandbox(cfg: EvalConfig, plans: list[Plan]) -> dict | None:
    """For a job with code tasks, before anything is decoded: probe the sandbox once
    (:func:`tdlm.evaluation.sandbox.require_sandbox`) and fail closed: raise its one-line refusal (what the kernel
    refused, how to get it) when a guarantee is missing, unless ``cfg.allow_weak_sandbox`` (then warn; every code
    row records ``sandbox_weakened``). Returns the probe (the job's summary.json; its ``level`` goes into each code
    run's summary and W&B config)."""
    from tdlm.evaluation.sandbox import require_sandbox
    from tdlm.evaluation.scoring import CODE_TASKS

    if not any(p.task.name in CODE_TASKS for p in plans):
        return None
    support = require_sandbox(_code_limits(cfg), cfg.allow_weak_sandbox)  # raises TDLMError when not allowed
    if support["missing"]:
        log.warning("sandbox: scoring with weakened guarantees (allow_weak_sandbox): missing %s (%s)",
                    ", ".join(support["missing"]), "; ".join(support["notes"]) or "no notes")  # fmt: skip
    else:
        log.info("sandbox: full isolation (%s, %s)", support["backend"], support["mechanism"])
    return support


def _score_all(cfg: EvalConfig, plans: list[Plan], merged: list[list[dict]]) -> list[list[dict]]:
    """Scored sample lists per run; unchanged generations keep their previous score."""
    from tdlm.evaluation.scoring import Scorer

    scored: list[list[dict | None]] = []
    todo: list[tuple[int, int]] = []
    for k, (plan, recs) in enumerate(zip(plans, merged, strict=True)):
        old = {r["id"]: r for r in read_records(plan.run_dir / SAMPLES)}
        row: list[dict | None] = []
        for i, rec in enumerate(recs):
            prev = old.get(rec["id"])
            if prev is not None and prev.get("generation") == rec["generation"] and "correct" in prev:
                row.append(_sample(rec, prev))
            else:
                row.append(None)
                todo.append((k, i))
        scored.append(row)
    if todo:
        problems = {(k, i): plans[k].task.problems[i] for k, i in todo}
        limits = _code_limits(cfg)
        with Scorer(cfg.score_workers, sandbox=limits, allow_weak_sandbox=cfg.allow_weak_sandbox) as scorer, \
                _bar(len(todo), "score") as bar:  # fmt: skip

            def one(key: tuple[int, int]):
                s = scorer.score(problems[key], merged[key[0]][key[1]]["generation"])
                bar.update(1)
                return s

            with ThreadPoolExecutor(cfg.score_workers) as pool:
                for (k, i), s in zip(todo, pool.map(one, todo), strict=True):
                    scored[k][i] = _sample(merged[k][i], {"extracted": s.extracted, "correct": s.correct,
                                                          "status": s.status, "score_detail": s.detail,
                                                          "sandbox_weakened": list(s.weakened)})  # fmt: skip
        errors = [scored[k][i] for k, i in todo if scored[k][i]["status"] == "error"]  # type: ignore[index]
        if errors:  # counted as wrong; the summaries' status_counts show them too
            log.warning("%d sample(s) could not be scored (first: %s)", len(errors), errors[0]["score_detail"])
    return scored  # type: ignore[return-value]


def _sample(rec: dict, score: dict) -> dict:
    """The per-sample output row: id, prompt, generation, extracted answer, correct, NFE, seconds."""
    worker = rec.get("worker") or {}
    return {
        "id": rec["id"], "index": rec["index"], "prompt": rec["prompt"], "generation": rec["generation"],
        "extracted": score.get("extracted"), "correct": bool(score["correct"]), "status": score.get("status"),
        "score_detail": score.get("score_detail", ""), "nfe": rec["nfe"], "seconds": rec["seconds"],
        "prompt_tokens": rec.get("prompt_tokens"), "batch_size": rec.get("batch_size"),
        "device": worker.get("device_name") or worker.get("device"),
        # code rows scored with allow_weak_sandbox: the sandbox guarantees this sample did not get
        **({"sandbox_weakened": score["sandbox_weakened"]} if score.get("sandbox_weakened") else {}),
    }  # fmt: skip


def check_adapters_fit(cfg: EvalConfig) -> None:
    """Before the first decode: every adapter must have been trained on this backbone (family, vocabulary, weight
    fingerprint, width, depth), else the job would decode hours of baselines before a TDLM worker refused it.

    The backbone is built on the meta device and its fingerprint read from the first row of each weight tensor in
    the checkpoint files, so nothing is loaded; the rule is :meth:`tdlm.temporal.model.TDLM.from_adapter`'s.
    """
    from tdlm.models.fingerprints import weight_fingerprint_files
    from tdlm.models.loading import PRESETS, _resolve_folder, _weight_files, load_backbone_meta
    from tdlm.temporal.adapter_files import adapter_config_path

    dirs = cfg.adapter_dirs()
    if not dirs or "tdlm" not in cfg.resolved_policies():
        return
    meta = load_backbone_meta(cfg.backbone)
    if cfg.backbone in PRESETS:
        fingerprint = f"preset:{cfg.backbone}"
    else:
        names = {n for n, _ in meta.named_parameters()}
        fingerprint = weight_fingerprint_files(_weight_files(_resolve_folder(cfg.backbone)), names)
    for label, folder in dirs.items():
        path = adapter_config_path(folder)
        bb = read_adapter_config(folder).get("backbone") or {}
        for key, want in (("hidden_size", meta.hidden_size), ("num_layers", meta.num_layers)):
            if bb.get(key) != want:
                raise TDLMError(f"{path}: adapter {label!r} was trained for backbone.{key}={bb.get(key)} "
                                f"({bb.get('id')}); --backbone {cfg.backbone} has {key}={want}")
        if cfg.allow_other_backbone:
            continue
        have = {"family": meta.family, "vocab_size": meta.vocab_size, "fingerprint": fingerprint}
        differ = [f"{k}={bb[k]!r} (this backbone: {v!r})" for k, v in have.items()
                  if bb.get(k) is not None and v is not None and bb[k] != v]
        if differ:
            raise TDLMError(f"{path}: adapter {label!r} was trained on backbone {bb.get('id')!r}, not --backbone "
                            f"{cfg.backbone}: {'; '.join(differ)}; nothing was decoded; pass --allow-other-backbone "
                            f"to attach it anyway")


def _default_group(cfg: EvalConfig, out: Path) -> str:
    from tdlm.tracking import experiment_group

    what = {"backbone": cfg.backbone, "adapters": cfg.adapters, "tasks": cfg.tasks,
            "gen_length": cfg.decode.gen_length, "block_size": cfg.decode.block_size, "limit": cfg.limit}
    return experiment_group(None, out.name, what)


# -- the job ------------------------------------------------------------------------------------------
def evaluate(cfg: EvalConfig) -> EvalResult:
    """Run (or finish) the evaluation of ``cfg``; see the module docstring."""
    t0 = time.monotonic()
    cfg.validate()
    out = Path(cfg.output_dir).resolve()
    check_adapters_fit(cfg)  # before plan_runs writes run.json files and long before the baselines decode
    # One writer per output folder, for the whole job: two evaluations into one folder once appended the same
    # samples to one shard file and the merge refused the duplicates at the end. Taken before plan_runs writes
    # anything, held through merge, scoring and the report; a dead holder's lock is taken over (its samples resume).
    with FolderLock(out, "evaluation"):
        return _evaluate(cfg, out, t0)


def _evaluate(cfg: EvalConfig, out: Path, t0: float) -> EvalResult:
    """:func:`evaluate` with the output folder's lock held."""
    plans = plan_runs(cfg)
    # The experiment, not the folder name: explicit --group, else the folder and a hash of what is compared.
    group = cfg.group or _default_group(cfg, out)
    W = num_workers(cfg)
    jobs, skipped = shard_jobs(cfg, plans, W)
    computed = sum(len(j.problems) for j in jobs)
    log.info("%s: %d run(s), %d samples to decode, %d already done, %d worker(s)", out, len(plans), computed,
             skipped, W)  # fmt: skip
    sandbox = check_sandbox(cfg, plans)  # before decoding: a weaker sandbox is announced up front
    if jobs:
        if W == 1:
            run_in_process(cfg, jobs)
        else:
            run_on_ray(cfg, jobs, W)
    merged = []
    for plan in plans:
        recs = merge(plan.run_dir, [p.id for p in plan.task.problems])
        for rec, prob in zip(recs, plan.task.problems, strict=True):
            if rec["prompt"] != prob.prompt or rec["index"] != prob.index:
                raise TDLMError(f"{plan.run_dir}: the stored prompt of {rec['id']} differs from the task's "
                                f"(the data or prompt format changed); use another --output-dir")  # fmt: skip
        merged.append(recs)
    t_score = time.monotonic()
    scored = _score_all(cfg, plans, merged)
    log.info("planned + decoded in %.1f s, scored in %.1f s", t_score - t0, time.monotonic() - t_score)
    bb_id = backbone_id(cfg.backbone)
    runs = [run_summary(cfg, plan, samples, bb_id) for plan, samples in zip(plans, scored, strict=True)]
    compute_speedups(runs, cfg.reference_tau)
    reference = cfg.reference_run()
    attach_paired(runs, reference, {s["run_dir"]: smp for s, smp in zip(runs, scored, strict=True)})
    if sandbox is not None:  # the isolation level is part of each code run's record and W&B config
        from tdlm.evaluation.scoring import CODE_TASKS

        for plan, summary in zip(plans, runs, strict=True):
            if plan.task.name in CODE_TASKS:
                summary["sandbox"] = {k: sandbox[k] for k in ("level", "backend", "mechanism")}
    try:  # a full disk while writing the merged files: one line, nothing half-written left to trust
        changed = False
        for plan, samples, summary in zip(plans, scored, runs, strict=True):
            _write_jsonl(plan.run_dir / SAMPLES, samples)
            before = (plan.run_dir / SUMMARY).read_text() if (plan.run_dir / SUMMARY).exists() else None
            log_run(cfg, group, summary, samples)
            changed |= before != (plan.run_dir / SUMMARY).read_text()
        table = render(runs, reference, {s["run_dir"]: smp for s, smp in zip(runs, scored, strict=True)})
        atomic_write_text(out / "table.md", table, f"table.md is unchanged; {KEPT}")
        plots = plot_all(runs, out)
        _write_json(out / SUMMARY, {"group": group, "backbone": cfg.backbone, "backbone_id": bb_id,
                                    "output_dir": str(out), "workers": W, "config": cfg.to_dict(), "runs": runs,
                                    "table": "table.md", "plots": [p.name for p in plots],
                                    "paired": paired_settings(reference),
                                    **({"sandbox": sandbox} if sandbox is not None else {})})  # fmt: skip
        if changed:
            log_comparison(cfg, group, runs, table, plots)
    except OSError as e:
        raise write_error(Path(e.filename) if e.filename else out / SUMMARY, e, KEPT) from None
    log.info("done in %.1f s: %d decoded, %d resumed; %s", time.monotonic() - t0, computed, skipped, out / "table.md")
    return EvalResult(str(out), runs, table, str(out / SUMMARY), str(out / "table.md"), [str(p) for p in plots],
                      computed, skipped, W)  # fmt: skip
