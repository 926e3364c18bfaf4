"""One allocation of a sweep: train it with the real launcher, evaluate it, record it (what ``wandb agent`` runs for
each point of the W&B sweep file, and what the local runner runs for each allocation).

Recipe of :func:`run_trial`:

1. resolve the allocation on the backbone's meta copy (indices, parameter count); record ``sweep.json`` the first
   time (the sweep's settings, the trajectories' manifest digest, the seeds) and refuse a trial whose settings or
   trajectories differ from it, so every allocation of a sweep trains on the same data with the same seeds;
2. train: ``<launcher> launcher/train.py --ds DS --config TRAIN_CONFIG model.layers=SPEC wandb.group=EXPERIMENT ...``
   into ``train/<slug>`` (``--resume`` when the folder already holds the run, so a rerun finishes or skips it);
   output is teed to ``train/<slug>.log``. A failed launch (an OOM, say) is recorded as this allocation's result,
   as the paper reports "32, all: Training OOM". In a sweep with ``seeds`` the trial is one (allocation, seed):
   ``<slug>`` is ``<allocation slug>-seed<k>`` (:func:`tdlm.sweep.config.trial_slug`), training gets
   ``train.seed=<k>``, and the W&B group is the allocation's (``<experiment>-<allocation slug>``), shared by its
   seeds;
3. evaluate, in this process: the baselines once per sweep (``eval/baselines``, under a lock, so concurrent agents
   decode them once) and this adapter with ``tdlm`` at every tau (``eval/<slug>``). The evaluation runs record the
   training run they evaluate (``trained_by``; online also as W&B artifact lineage);
4. write the adapter's model card (README.md, with its evaluation table), ``trials/<slug>/trial.json``, and one W&B
   run for the trial (job type ``sweep-trial``: the allocation, its indices and parameter count, the training and
   evaluation runs, and the sweep's metric ``accuracy``). Under ``wandb agent`` that run *is* the sweep's run: the
   agent's ``WANDB_RUN_ID`` / ``WANDB_SWEEP_ID`` are withheld from training and evaluation and used only here.

Layout of ``output_dir``::

    sweep.json  table4.md  train/<slug>/ (run folder, adapter/)  train/<slug>.log
    eval/baselines/  eval/<slug>/  (eval/run.py output dirs)  trials/<slug>/trial.json
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tdlm.config import to_dict
from tdlm.errors import TDLMError
from tdlm.sweep.config import SWEEP_RECORD, TRIAL_RECORD, AllocationPlan, SweepConfig, base_run, plan

REPO = Path(__file__).resolve().parents[2]
BASELINES = "baselines"
AGENT_ENV = ("WANDB_RUN_ID", "WANDB_SWEEP_ID", "WANDB_SWEEP_PARAM_PATH")  # set by `wandb agent` for its run


@dataclass(frozen=True)
class TrialPaths:
    out: Path
    slug: str

    @property
    def train(self) -> Path:
        return self.out / "train" / self.slug

    @property
    def log(self) -> Path:
        return self.out / "train" / f"{self.slug}.log"

    @property
    def adapter(self) -> Path:
        return self.train / "adapter"

    @property
    def eval(self) -> Path:
        return self.out / "eval" / self.slug

    @property
    def baselines(self) -> Path:
        return self.out / "eval" / BASELINES

    @property
    def trial(self) -> Path:
        return self.out / "trials" / self.slug


@contextlib.contextmanager
def file_lock(path: Path):
    """Blocking ``flock`` (concurrent agents on one sweep folder take turns; released if the holder dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# -- 1: the sweep's record ------------------------------------------------------------------------
def prepare_trajectories(cfg: SweepConfig, source: str) -> str:
    """The embedded default's teacher trajectories are generated once (as the launcher does, only for its own
    default folder); returns the sha256 of the trajectories' manifest."""
    from tdlm.data.store import MANIFEST
    from tdlm.data.stream import verify_manifest
    from tdlm.data.toy_trajectories import ensure_toy_trajectories
    from tdlm.training.config import DataConfig

    run = base_run(cfg, source)
    folder = Path(run.data.trajectories)
    if run.data.trajectories == DataConfig.trajectories:
        with file_lock(folder.parent / f".{folder.name}.lock"):
            ensure_toy_trajectories(folder, run.model.backbone)
    verify_manifest(folder)
    return "sha256:" + hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()


def sweep_record(cfg: SweepConfig, source: str, manifest_sha: str) -> dict:
    run = base_run(cfg, source)
    settings = to_dict(cfg)
    # What makes the allocations comparable is fixed; a sweep may grow by allocations (and by training seeds, kept in
    # "seeds"), and where and how a trial runs (launcher, W&B mode, evaluation workers) may differ between agents.
    for key in ("allocations", "launcher", "wandb_mode", "output_dir", "seeds"):
        settings.pop(key)
    for key in ("workers", "threads"):
        settings["eval"].pop(key)
    return {"experiment": cfg.experiment, "settings": settings, "backbone": run.model.backbone,
            "trajectories": {"path": str(Path(run.data.trajectories).resolve()), "manifest": manifest_sha},
            "seeds": {"train": run.train.seed if cfg.seeds is None else list(cfg.seeds), "data": run.data.seed},
            "allocations": list(cfg.allocations),
            "source": source}  # fmt: skip


def ensure_sweep_record(cfg: SweepConfig, source: str, manifest_sha: str) -> dict:
    """Write ``sweep.json`` once; later trials (and agents) must match it, or the folder is refused."""
    out = Path(cfg.output_dir)
    path = out / SWEEP_RECORD
    new = sweep_record(cfg, source, manifest_sha)
    with file_lock(out / ".sweep.lock"):
        if not path.exists():
            _write_json(path, new)
            return new
        old = json.loads(path.read_text())
        diffs = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in ("settings", "trajectories", "backbone")
                 if old.get(k) != new[k]]  # fmt: skip
        if _seed_kind(old.get("seeds")) != _seed_kind(new["seeds"]):
            diffs.append(f"seeds: {old.get('seeds')!r} -> {new['seeds']!r}")
        if diffs:
            raise TDLMError(f"{path}: this folder holds a sweep with other settings or trajectories "
                            f"({'; '.join(d[:200] for d in diffs)}); use another output_dir, or the same settings")
        merged = list(dict.fromkeys(old.get("allocations", []) + list(cfg.allocations)))
        changed = merged != old.get("allocations")
        old["allocations"] = merged
        if isinstance(new["seeds"]["train"], list):  # a sweep with seeds may grow by seeds, as by allocations
            seeds = list(dict.fromkeys(old["seeds"]["train"] + new["seeds"]["train"]))
            changed |= seeds != old["seeds"]["train"]
            old["seeds"]["train"] = seeds
        if changed:
            _write_json(path, old)
        return old


def _seed_kind(seeds: dict | None) -> dict | None:
    """What trials of one sweep folder must agree on: the data seed, and either the one training seed (a sweep
    without ``seeds``) or that training seeds are an axis (their list may grow)."""
    if not isinstance(seeds, dict):
        return seeds
    return seeds | {"train": "per trial"} if isinstance(seeds.get("train"), list) else seeds


# -- 2: training ----------------------------------------------------------------------------------
def launcher_command(cfg: SweepConfig) -> list[str]:
    """``cfg.launcher`` with its program found on PATH or beside this interpreter (a venv's deepspeed)."""
    cmd = list(cfg.launcher)
    exe = shutil.which(cmd[0]) or (str(Path(sys.executable).parent / cmd[0])
                                   if (Path(sys.executable).parent / cmd[0]).exists() else None)  # fmt: skip
    if exe is None:
        raise TDLMError(f"launcher: {cmd[0]!r} not found on PATH or beside {sys.executable}")
    return [exe, *cmd[1:]]


def train_command(cfg: SweepConfig, p: AllocationPlan, paths: TrialPaths) -> list[str]:
    cmd = [*launcher_command(cfg), str(REPO / "launcher" / "train.py"), "--ds", cfg.ds, "--config", cfg.train_config,
           "--output-dir", str(paths.train)]
    if (paths.train / "run_config.json").exists():
        cmd.append("--resume")  # finish an interrupted run, or a no-op for a finished one
    cmd += [*cfg.train_overrides, f"model.layers={json.dumps(p.spec)}", f"wandb.project={cfg.project}",
            f"wandb.group={p.group}", f"wandb.name=train/{p.trial}"]
    if p.seed is not None:
        cmd += [f"train.seed={p.seed}", f"wandb.tags=[seed:{p.seed}]"]
    if cfg.wandb_mode:
        cmd.append(f"wandb.mode={cfg.wandb_mode}")
    return cmd


def run_teed(cmd: list[str], log: Path) -> int:
    """Run ``cmd``, copying its output to ``log`` and to this process's stdout as it comes."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=os.environ.copy())  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            sys.stdout.write(line)
        sys.stdout.flush()
        return proc.wait()


def failure_reason(log: Path, rc: int) -> str:
    """The launch's own one-line error (``error: ...``) or an out-of-memory line, else its exit status."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for line in reversed(lines):
        low = line.lower()
        if "out of memory" in low or "outofmemoryerror" in low:
            return "out of memory: " + line.strip()[-200:]
    for line in reversed(lines):
        if line.strip().startswith("error:") or "TDLMError" in line:
            return line.strip()[-300:]
    return f"launcher exited with status {rc}; see {log}"


# -- 3: evaluation --------------------------------------------------------------------------------
def eval_config(cfg: SweepConfig, output_dir: Path, policies: list[str], adapters: list[str],
                group: str | None = None):  # fmt: skip
    """The evaluation of ``adapters`` (or the baselines); ``group``: its W&B group (default the experiment)."""
    from tdlm.decoding.config import DecodeSettings
    from tdlm.evaluation import EvalConfig

    e = cfg.eval
    backbone = base_run(cfg, "sweep").model.backbone
    decode = DecodeSettings(gen_length=e.gen_length, block_size=e.block_size, dtype=e.dtype, batch_size=e.batch_size)
    return EvalConfig(
        backbone=backbone, output_dir=str(output_dir), tasks=list(e.tasks), policies=policies, adapters=adapters,
        thresholds=list(e.thresholds), tdlm_thresholds=list(e.thresholds), decode=decode, limit=e.limit,
        data_dir=e.data_dir, workers=e.workers, threads=e.threads, group=group or cfg.experiment, project=cfg.project,
        wandb_mode=cfg.wandb_mode,
    )  # fmt: skip


def evaluate_trial(cfg: SweepConfig, p: AllocationPlan, paths: TrialPaths) -> list[dict]:
    """Baselines (once per sweep) and this adapter; returns the runs of both with speedups over their union."""
    from tdlm.evaluation import compute_speedups, evaluate, load_runs

    if cfg.eval.baselines:
        with file_lock(paths.baselines.parent / f".{BASELINES}.lock"):
            evaluate(eval_config(cfg, paths.baselines, list(cfg.eval.baselines), []))
    evaluate(eval_config(cfg, paths.eval, ["tdlm"], [f"{p.trial}={paths.adapter}"], p.group))
    dirs = [paths.eval] + ([paths.baselines] if cfg.eval.baselines else [])
    return compute_speedups(load_runs(dirs), cfg.eval.thresholds[0])


def trial_results(runs: list[dict], p: AllocationPlan) -> list[dict]:
    keep = ("task", "threshold", "history", "n", "accuracy", "nfe_mean", "seconds_mean", "speedup_vs_original",
            "speedup_vs_threshold", "nfe_ratio_vs_threshold", "run_dir")  # fmt: skip
    return [{k: r.get(k) for k in keep} for r in runs if r["policy"] == "tdlm" and r.get("adapter_label") == p.trial]


# -- 4: records and the trial's W&B run -----------------------------------------------------------
def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def trial_wandb(cfg: SweepConfig, p: AllocationPlan, record: dict, agent_env: dict[str, str]) -> dict:
    """The trial's W&B run (under ``wandb agent``: the sweep's run, with the agent's id restored)."""
    from tdlm.tracking import Tracker, run_tags

    os.environ.update(agent_env)
    try:
        config = {"experiment": cfg.experiment, "allocation": p.spec, "layers": p.layers, "num_layers": p.num_layers,
                  "temporal_parameters": p.parameters, "history": p.run.model.history, "backbone": p.run.model.backbone,
                  "trained_by": (record.get("training") or {}).get("wandb"), "status": record["status"],
                  "seed": p.seed, "train_seed": p.run.train.seed}  # fmt: skip
        extra = ["sweep-trial"] + ([f"seed:{p.seed}"] if p.seed is not None else [])
        tracker = Tracker(Path(cfg.output_dir) / "trials" / p.trial, cfg.project, p.group, f"sweep/{p.trial}",
                          config, cfg.wandb_mode, job_type="sweep-trial",
                          tags=run_tags(p.run.model.backbone, p.spec, p.run.model.history, extra))
        metrics: dict = {"temporal_parameters": p.parameters}
        for i, r in enumerate(record.get("results") or []):
            prefix = f"{r['task']}/tau{r['threshold']:g}/"
            for k in ("accuracy", "nfe_mean", "seconds_mean", "speedup_vs_original"):
                if r.get(k) is not None:
                    metrics[prefix + k] = r[k]
                    if i == 0:
                        metrics[k] = r[k]  # the sweep's metric (first task, first tau)
        tracker.log(metrics, step=0)
        tracker.finish(record)
        return tracker.record
    finally:
        for k in agent_env:
            os.environ.pop(k, None)


def check_seed(cfg: SweepConfig, seed: int | None, where: str = "trial") -> None:
    """A trial of a sweep with ``seeds`` names one of them; a sweep without seeds takes none (one line)."""
    if cfg.seeds is None and seed is not None:
        raise TDLMError(f"{where}: seed={seed} needs a sweep with seeds (seeds: [0, 1, 2]); this one has none")
    if cfg.seeds is not None and seed not in cfg.seeds:
        raise TDLMError(f"{where}: give seed=K, one of the sweep's seeds {cfg.seeds}" +
                        ("" if seed is None else f"; got {seed}"))  # fmt: skip


def run_trial(cfg: SweepConfig, spec: str, source: str, where: str | None = None, seed: int | None = None) -> int:
    """Train, evaluate and record one allocation (at training seed ``seed`` in a sweep with ``seeds``); 0 = done,
    1 = training or evaluation failed (recorded). ``where`` names the allocation in errors (``allocation=SPEC``
    when it came from the command line)."""
    from tdlm.hub import write_model_card

    check_seed(cfg, seed)
    agent_env = {k: os.environ.pop(k) for k in AGENT_ENV if k in os.environ}  # only the trial's own run uses them
    p = plan(cfg, spec, source, where, seed)
    out = Path(cfg.output_dir)
    paths = TrialPaths(out, p.trial)
    at = "" if seed is None else f", training seed {seed}"
    print(f"== trial {p.trial}: layers {p.layers} ({p.parameters:,} temporal parameters{at}) -> {out}", flush=True)
    ensure_sweep_record(cfg, source, prepare_trajectories(cfg, source))
    record: dict = {"allocation": p.spec, "slug": p.trial, "allocation_slug": p.slug, "seed": p.seed,
                    "train_seed": p.run.train.seed, "wandb_group": p.group, "layers": p.layers,
                    "num_layers": p.num_layers,
                    "temporal_parameters": p.parameters, "history": p.run.model.history,
                    "backbone": p.run.model.backbone, "train_dir": str(paths.train), "adapter": str(paths.adapter),
                    "eval_dirs": [str(paths.eval)], "status": "training"}  # fmt: skip
    t0 = time.monotonic()
    rc = run_teed(train_command(cfg, p, paths), paths.log)
    record["train_s"] = round(time.monotonic() - t0, 1)
    summary = _read(paths.train / "summary.json")
    if rc != 0 or summary is None or not (paths.adapter / "adapter.safetensors").exists():
        record |= {"status": "training failed", "error": failure_reason(paths.log, rc)}
        _write_json(paths.trial / TRIAL_RECORD, record)
        record["wandb"] = trial_wandb(cfg, p, record, agent_env)
        print(f"trial {p.trial}: training failed: {record['error']}", file=sys.stderr, flush=True)
        return 1
    record["training"] = {"steps": summary.get("steps"), "final_loss": summary.get("final_loss"),
                          "wall_s": summary.get("wall_s"), "wandb": _read(paths.train / "wandb_run.json"),
                          "adapter_artifact": summary.get("adapter_artifact")}  # fmt: skip
    t1 = time.monotonic()
    try:
        runs = evaluate_trial(cfg, p, paths)
    except TDLMError as e:
        record |= {"status": "evaluation failed", "error": str(e)}
        _write_json(paths.trial / TRIAL_RECORD, record)
        record["wandb"] = trial_wandb(cfg, p, record, agent_env)
        raise
    record["eval_s"] = round(time.monotonic() - t1, 1)
    record["results"] = trial_results(runs, p)
    record["status"] = "done"
    if cfg.eval.baselines:
        record["eval_dirs"].append(str(paths.baselines))
    write_model_card(paths.adapter, record["eval_dirs"])
    _write_json(paths.trial / TRIAL_RECORD, record)
    from tdlm.sweep.table import plot_sweep

    # Every finished trial redraws the sweep's comparison (under `wandb agent` there is no end-of-sweep step).
    record["sweep_plots"] = [str(x) for x in plot_sweep(out)]
    record["wandb"] = trial_wandb(cfg, p, record, agent_env)
    _write_json(paths.trial / TRIAL_RECORD, record)
    for r in record["results"]:
        print(f"trial {p.trial}: {r['task']} tau {r['threshold']:g}: accuracy {100 * r['accuracy']:.1f}%, "
              f"NFE {r['nfe_mean']:.2f}, {r['seconds_mean']:.3f} s", flush=True)
    return 0
