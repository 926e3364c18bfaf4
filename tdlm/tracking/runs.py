"""Run tracking: a stable local record (``metrics.jsonl``, ``summary.json``) plus W&B.

W&B has no public reader for offline runs, so every number that a comparison needs is also written
to JSON next to the run; W&B is for dashboards (``wandb sync`` later for offline runs). Without an API
key W&B runs offline instead of failing; ``WANDB_MODE`` is respected. Non-zero ranks get a null
tracker (nanochat's ``DummyWandb`` pattern) so callers never branch on rank.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def wandb_mode(explicit: str | None = None) -> str:
    """``explicit`` > ``WANDB_MODE`` > online if an API key is configured > offline."""
    if explicit:
        return explicit
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


def _clean(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl; a torn *last* line (a crash or a full disk mid-write) is dropped with a
    warning, a bad line elsewhere is an error naming it."""
    from tdlm.errors import TDLMError

    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                print(f"warning: {path}: dropping a torn last line ({line[:60]!r})", file=sys.stderr, flush=True)
                break
            raise TDLMError(f"{path} line {i + 1}: not JSON ({e}); fix or remove that line") from e
    return out


class NullTracker:
    run = None
    record: dict[str, Any] = {}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_adapter(self, adapter_dir: str | Path, metadata: dict | None = None) -> str | None:
        return None

    def use_adapter(self, adapter_dir: str | Path, training_run_id: str | None) -> str | None:
        return None

    def truncate(self, step: int) -> None:
        pass

    def stop(self, step: int, state: str, signal: str, exit_code: int = 75) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


MAX_TAG_LEN = 64  # W&B refuses longer tags
ADAPTER_ARTIFACT_TYPE = "tdlm-adapter"
RUN_RECORD = "wandb_run.json"  # the W&B run's identity, next to the local metrics


def previous_run_id(run_dir: str | Path) -> str | None:
    """The W&B run id recorded in ``<run_dir>/wandb_run.json`` (the run a resume continues), else None."""
    try:
        rid = json.loads((Path(run_dir) / RUN_RECORD).read_text()).get("id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return rid if isinstance(rid, str) and rid else None


def tag(key: str, value: object) -> str:
    """``key:value`` cut to W&B's tag length (a backbone path keeps its last part)."""
    text = str(value)
    if "/" in text and len(f"{key}:{text}") > MAX_TAG_LEN:
        text = text.rstrip("/").rsplit("/", 1)[-1]
    return f"{key}:{text}"[:MAX_TAG_LEN]


def run_tags(backbone: str | None, allocation: object = None, history: str | None = None,
             extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The tags every training and evaluation run carries: ``backbone:``, ``layers:`` (the allocation spec, or the
    indices), ``history:``; then ``extra``. Duplicates dropped, order kept."""
    out = []
    if backbone:
        out.append(tag("backbone", backbone))
    if allocation is not None:
        layers = ",".join(map(str, allocation)) if isinstance(allocation, list | tuple) else allocation
        out.append(tag("layers", layers))
    if history:
        out.append(tag("history", history))
    out += [str(t)[:MAX_TAG_LEN] for t in extra]
    return list(dict.fromkeys(out))


def experiment_group(explicit: str | None, source: str | None, settings: dict) -> str:
    """The W&B group of a run = its experiment: ``explicit`` (``wandb.group`` / ``--group``), else the config file's
    stem and a short hash of the settings (``tiny_multi-3f9a2c1b``). The output folder's name (the former default)
    is ``train`` or ``eval`` for many experiments, so their runs fell into one group."""
    if explicit:
        return explicit
    import hashlib

    unnamed = ("defaults", "config", "arguments", "run config")  # placeholders callers pass when no file was given
    stem = Path(source).stem if source and source not in unnamed else "defaults"
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{stem}-{digest}"


def grid_tags(task: str | None = None, policy: str | None = None, tau: float | None = None,
              cache: str | None = None, history: str | None = None) -> list[str]:
    """``task:``, ``policy:``, ``tau:``, ``cache:``, ``history:`` tags of one grid point (the ones given)."""
    pairs = (("task", task), ("policy", policy), ("tau", None if tau is None else f"{tau:g}"), ("cache", cache),
             ("history", history))
    return [tag(k, v) for k, v in pairs if v is not None]


def adapter_artifact_name(training_run_id: str) -> str:
    """The W&B artifact an adapter is logged as by the run that trained it (``tdlm-adapter-<run id>``)."""
    return f"{ADAPTER_ARTIFACT_TYPE}-{training_run_id}"


def _adapter_artifact(adapter_dir: str | Path, name: str, metadata: dict | None = None):
    """The adapter's two files (config + weights; a model card beside them is not part of the artifact)."""
    import wandb

    from tdlm.temporal.adapter_files import ADAPTER_WEIGHTS, adapter_config_path

    art = wandb.Artifact(name, type=ADAPTER_ARTIFACT_TYPE, metadata=metadata or {})
    cfg = adapter_config_path(adapter_dir)
    art.add_file(str(cfg), name=cfg.name)
    art.add_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS), name=ADAPTER_WEIGHTS)
    return art


SERVICE_ENV = "WANDB_SERVICE"  # how a W&B client finds an already running wandb-core


def start_detached_service(idle_timeout: str = "15m") -> subprocess.Popen | None:
    """Start W&B's service (``wandb beta core start``) outside this process tree, in the background.

    Under ``deepspeed``, a stop (Ctrl-C, a preemption) makes DeepSpeed's launch.py terminate each rank's whole
    process tree, and the wandb-core that ``wandb.init`` starts as a child of rank 0 exits at once on SIGTERM
    without writing what it holds: an offline run kept 7 bytes and no exit record (measured). A detached service
    belongs to no rank's tree (its starter exits at once; its own session, so no Ctrl-C either). The Tracker shuts
    it down when the run closes; ``idle_timeout`` (counted while no client is connected, so it must outlast the
    set-up before ``wandb.init``) is the fallback. Hand the returned process to :class:`Tracker` (``service=``);
    None when W&B's CLI is missing or a service is already set up.
    """
    exe = Path(sys.executable).with_name("wandb")
    if os.environ.get(SERVICE_ENV) or not exe.exists():
        return None
    try:
        return subprocess.Popen([str(exe), "beta", "core", "start", "--idle-timeout", idle_timeout],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True)  # fmt: skip
    except OSError:
        return None


def _use_service(proc: subprocess.Popen | None) -> None:
    """Point this process's W&B client at the service ``proc`` started (its token is its first stdout line)."""
    if proc is None:
        return
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return
    token = out.strip().splitlines()[0] if proc.returncode == 0 and out.strip() else ""
    if token:
        os.environ[SERVICE_ENV] = token


def _stop_service() -> None:
    """Close this process's W&B connection and shut down the detached service it used (``wandb beta core stop``,
    in-process; its two status lines are W&B's business, not the user's). Failing that, its idle timeout ends it."""
    import contextlib
    import io

    if not os.environ.get(SERVICE_ENV):
        return
    try:
        import wandb
        from wandb.cli import beta_core

        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            wandb.teardown()
            beta_core.stop()
    except BaseException:  # noqa: BLE001 - SystemExit from teardown included: the idle timeout remains
        pass
    os.environ.pop(SERVICE_ENV, None)


def _read_record(run_dir: Path) -> dict:
    try:
        rec = json.loads((run_dir / RUN_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return rec if isinstance(rec, dict) else {}


class Tracker(NullTracker):
    """Appends metrics to ``<run_dir>/metrics.jsonl`` and mirrors them to a W&B run.

    ``wandb_run.json`` beside them records the W&B run's id, project, group, name, tags and job type, the
    artifacts it logged or used, and how each launch of it ended (``exits``: finished, or interrupted / preempted
    at a step), so a comparison (and a later evaluation) can name the run without a W&B server.

    ``resume_id``: continue that W&B run (``resume="allow"``: same id, its history goes on) instead of opening a
    new one - what a training ``--resume`` passes. ``service``: :func:`start_detached_service`'s process.
    """

    def __init__(self, run_dir: str | Path, project: str, group: str | None, name: str | None,
                 config: dict, mode: str | None = None, job_type: str = "train",
                 tags: list[str] | None = None, resume_id: str | None = None,
                 service: subprocess.Popen | None = None) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.run = None
        self.record: dict[str, Any] = {}
        self.wandb_error: str | None = None
        self.own_service = False
        m = wandb_mode(mode)
        if m != "disabled":
            import wandb

            _use_service(service)
            self.own_service = service is not None and bool(os.environ.get(SERVICE_ENV))
            os.environ.setdefault("WANDB_DIR", str(self.dir))
            resume = {"id": resume_id, "resume": "allow"} if resume_id else {}
            self.run = wandb.init(project=project, group=group, name=name, config=config, mode=m,
                                  job_type=job_type, dir=str(self.dir), reinit="finish_previous",
                                  tags=list(tags or []), **resume)
            old = _read_record(self.dir) if resume_id else {}
            self.record = {"id": self.run.id, "project": project, "group": group, "name": name,
                           "job_type": job_type, "tags": list(tags or []), "mode": m,
                           "url": getattr(self.run, "url", None) if m == "online" else None,
                           "artifacts_logged": old.get("artifacts_logged", []),
                           "artifacts_used": old.get("artifacts_used", []), "exits": old.get("exits", [])}
            self._write_record()
            if self.record["exits"]:  # how earlier launches ended, in case W&B died with them (see _wandb)
                self._wandb(lambda: self.run.summary.update({"exits": self.record["exits"]}))

    def _wandb(self, call) -> bool:
        """Run one W&B call. When the W&B service is gone - a preemption's SIGTERM reaches every process of the job,
        and DeepSpeed's launcher terminates each rank's whole process tree, W&B's service included - training goes
        on with the local record alone (metrics.jsonl, wandb_run.json); a finished run says so in one warning."""
        if self.run is None:
            return False
        try:
            call()
            return True
        except Exception as e:  # ConnectionResetError, BrokenPipeError, wandb.Error: whatever the dead service gives
            self.wandb_error = f"{type(e).__name__}: {e}"
            self.run = None
            import contextlib

            with contextlib.suppress(BaseException):  # drop the dead connection now, not in a traceback at exit
                import wandb

                wandb.teardown()
            return False

    def _write_record(self) -> None:
        tmp = self.dir / f"{RUN_RECORD}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(self.record, indent=2) + "\n")
        os.replace(tmp, self.dir / RUN_RECORD)

    def log_adapter(self, adapter_dir: str | Path, metadata: dict | None = None) -> str | None:
        """Log the adapter folder as artifact ``tdlm-adapter-<this run's id>``; returns its name."""
        if self.run is None:
            return None
        name = adapter_artifact_name(self.run.id)
        run = self.run
        if not self._wandb(lambda: run.log_artifact(_adapter_artifact(adapter_dir, name, metadata))):
            return None
        self.record["artifacts_logged"].append(name)
        self._write_record()
        return name

    def use_adapter(self, adapter_dir: str | Path, training_run_id: str | None) -> str | None:
        """Declare the adapter this (evaluation) run reads as an input artifact, so W&B links it to the run that
        trained it. Online only: W&B cannot record artifact use offline (``trained_by`` in the config says it)."""
        if self.run is None or not training_run_id:
            return None
        name = adapter_artifact_name(training_run_id)
        if self.record.get("mode") == "online":
            run = self.run  # same files -> the logged version
            if not self._wandb(lambda: run.use_artifact(_adapter_artifact(adapter_dir, name))):
                return None
            self.record["artifacts_used"].append(name)
            self._write_record()
        return name

    def truncate(self, step: int) -> None:
        """Drop records after ``step`` (a resumed run rewrites them)."""
        if not self.metrics_path.exists():
            return
        keep = [rec for rec in read_metrics(self.metrics_path) if rec.get("step", 0) <= step]
        tmp = self.metrics_path.with_name(f"{self.metrics_path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(rec) + "\n" for rec in keep))
        os.replace(tmp, self.metrics_path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        rec = _clean({"step": step, **metrics})
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        run = self.run
        self._wandb(lambda: run.log(metrics, step=step))

    def _exit(self, entry: dict) -> None:
        import datetime as dt

        self.record.setdefault("exits", []).append(entry | {"time": dt.datetime.now().isoformat(timespec="seconds")})
        self._write_record()

    def stop(self, step: int, state: str, signal: str, exit_code: int = 75) -> None:
        """The launch ends early at ``step`` (``state`` interrupted / preempted): W&B marks the run preempting and
        closes it with ``exit_code``; a resume continues it under the same id."""
        if not self.record:
            return
        self._exit({"state": state, "step": step, "signal": signal, "exit_code": exit_code})
        run = self.run

        def close() -> None:
            run.mark_preempting()
            run.summary.update({"exit_state": state, "stopped_at_step": step, "stop_signal": signal})
            run.finish(exit_code=exit_code)

        self._wandb(close)
        if self.own_service:
            _stop_service()

    def finish(self, summary: dict[str, Any]) -> None:
        from tdlm.data.store import atomic_write_text  # here: the tracking module itself stays import-light

        # whole or absent, and a full disk is one line that leaves no temporary file behind
        atomic_write_text(self.dir / "summary.json", json.dumps(_clean(summary), indent=2) + "\n")
        if self.record:
            self._exit({"state": "finished", "step": summary.get("steps"), "exit_code": 0})
        run = self.run

        def close() -> None:
            run.summary.update(summary | {"exit_state": "finished"})
            run.finish()

        if self.record and not self._wandb(close):
            print(f"warning: W&B stopped responding during the run ({self.wandb_error}); metrics.jsonl, summary.json "
                  f"and {RUN_RECORD} hold everything", file=sys.stderr, flush=True)
        if self.own_service:
            _stop_service()
