"""The run folder of a training job: who may write it, what a resume may trust, and what it must refuse.

Layout (``--output-dir``)::

    run_config.json            the recipe (rewritten only by a resume that accepted a changed recipe;
                               the previous one is kept as run_config.step-<N>.json)
    ds_config.json             the resolved DeepSpeed JSON
    metrics.jsonl              one record per logged step (a torn last line is dropped on resume)
    summary.json               written once, when the run finishes
    checkpoints/step-<N>/      DeepSpeed checkpoint files + SHA256SUMS.json (written after every rank saved)
    checkpoints/latest         DeepSpeed's pointer: names only a verified tag (written by rank 0 after verifying)
    prompts_checked.json       the trajectories whose teacher prompts passed the evaluation-overlap check
    .ranks/<launch>/           host and pid of each rank, to name a lost one (RollCall)
    adapter/                   the exported adapter
    .lock                      flock held by rank 0 for the whole run (pid, host, start time inside)

Policy:

=============================================  ===================================================
found                                          action
=============================================  ===================================================
another live run holds ``.lock``               TDLMError at once, naming its pid and host
``.lock`` names a holder that died             warning naming it (stale lock); taken over
run files, no ``--resume``                     TDLMError naming the folder and both ways out
``--resume``, recipe differs from run_config   TDLMError naming every changed field, unless
                                               ``--allow-recipe-change`` (both configs kept)
``--resume``, run finished (summary.json)      a no-op that says so; nothing is rewritten
newest checkpoint without SHA256SUMS.json      skipped with a warning (its save did not finish)
checkpoint file whose sha256 differs           TDLMError naming the file (never unpickled)
a checkpoint write fails (disk full)           every rank stops (exit 74); the partial tag is removed;
                                               ``latest`` and older tags untouched
a rank stops answering / dies mid-run          the survivors name it (RollCall) and exit 76
=============================================  ===================================================

Checkpoints are loaded with pickle by DeepSpeed, so a checkpoint folder is *trusted input*: the checksums
catch corruption and files swapped after the run wrote them, not an attacker who can rewrite both.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from tdlm.config import to_dict
from tdlm.data.folder_lock import FolderLock
from tdlm.errors import TDLMError
from tdlm.models.fingerprints import check_listed_files, sha256_file
from tdlm.training.config import RunConfig

log = logging.getLogger("tdlm.training")

CHECKPOINT_DIR = "checkpoints"
LOCK = ".lock"
SUMS = "SHA256SUMS.json"
RUN_FILES = ("run_config.json", "metrics.jsonl", "summary.json", CHECKPOINT_DIR)
TAG_RE = re.compile(r"^step-(\d+)$")
# The recipe: what a resume must not change silently (sections, or section.field).
RECIPE = ("model", "data", "optim", "train.micro_batch_size", "train.grad_accum", "train.max_steps",
          "train.seed", "train.zero_stage")


# -- the lock --------------------------------------------------------------------------------------
class RunLock(FolderLock):
    """The run folder's :class:`~tdlm.data.folder_lock.FolderLock` (the evaluator's and generation's too), taken on
    construction and held for the life of the run: a second run is refused naming the holder, a dead holder's lock
    (released by the kernel, its line still in the file) is reported as stale and taken over."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(run_dir, "training run")
        self.acquire()


# -- what a launch may do with the folder ----------------------------------------------------------
def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else {}
    return d


def recipe_diff(old: dict, new: dict) -> list[str]:
    """``field: old -> new`` for every recipe field that differs."""
    out = []
    for key in RECIPE:
        a, b = _get(old, key), _get(new, key)
        if isinstance(a, dict) and isinstance(b, dict):
            for f in sorted(set(a) | set(b)):
                if a.get(f) != b.get(f):
                    out.append(f"{key}.{f}: {a.get(f)!r} -> {b.get(f)!r}")
        elif a != b:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def finished_step(run_dir: Path) -> int | None:
    """The step a finished run ended at (summary.json), else None."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    try:
        steps = json.loads(path.read_text()).get("steps")
    except json.JSONDecodeError:
        return None
    return int(steps) if isinstance(steps, int) else None


def check_run_dir(run: RunConfig, resume: bool, allow_recipe_change: bool, world_size: int) -> str:
    """Decide what this launch does with ``run.output_dir``: "fresh", "resume" or "finished".

    Reads only files (every rank may call it before any process group exists).
    """
    out = Path(run.output_dir)
    present = [name for name in RUN_FILES if (out / name).exists()]
    if not resume:
        if present:
            raise TDLMError(f"{out} already holds a training run ({', '.join(present)}): continue it with --resume, "
                            f"or train into another --output-dir (or delete this folder)")
        return "fresh"
    if "run_config.json" not in present:
        raise TDLMError(f"--resume: {out} holds no run (no run_config.json); start it without --resume")
    try:
        old = json.loads((out / "run_config.json").read_text())
    except json.JSONDecodeError as e:
        raise TDLMError(f"--resume: {out / 'run_config.json'} is not valid JSON ({e})") from e
    new = to_dict(run)
    diffs = recipe_diff(old, new)
    old_world = None
    try:  # the resolved DS JSON holds train_batch_size = micro_batch x grad_accum x world
        ds = json.loads((out / "ds_config.json").read_text())
        old_world = int(ds["train_batch_size"]) // (int(ds["train_micro_batch_size_per_gpu"]) *
                                                      int(ds["gradient_accumulation_steps"]))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        pass
    if old_world is not None and old_world != world_size:
        diffs.append(f"world size: {old_world} -> {world_size} (the data order and the global batch depend on it)")
    if diffs and not allow_recipe_change:
        raise TDLMError(f"--resume: the recipe differs from the run's ({out / 'run_config.json'}): "
                        f"{'; '.join(diffs)}; resume with the same settings, or pass --allow-recipe-change to "
                        f"continue with the new ones (the old run_config.json is kept)")
    done = finished_step(out)
    if done is not None and done >= run.train.max_steps and not diffs:
        return "finished"
    return "resume"


def keep_old_config(run_dir: Path, step: int) -> Path:
    """Before a resume with an accepted recipe change: keep the previous run_config.json beside the new one."""
    src = run_dir / "run_config.json"
    dst = run_dir / f"run_config.step-{step}.json"
    os.replace(src, dst)
    return dst


# -- checkpoint checksums --------------------------------------------------------------------------
def _files(tag_dir: Path) -> list[Path]:
    return sorted(p for p in tag_dir.rglob("*") if p.is_file() and p.name != SUMS)


def write_checksums(tag_dir: Path) -> Path:
    """SHA256SUMS.json over every file of one checkpoint tag (after all ranks wrote theirs)."""
    sums = {str(p.relative_to(tag_dir)): {"sha256": sha256_file(p).hexdigest(), "bytes": p.stat().st_size}
            for p in _files(tag_dir)}
    tmp = tag_dir / f"{SUMS}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"files": sums}, indent=1) + "\n")
    os.replace(tmp, tag_dir / SUMS)
    return tag_dir / SUMS


def verify_checksums(tag_dir: Path) -> None:
    """Every file listed with its sha256, none missing, none added; raises TDLMError naming the file."""
    try:
        listed = json.loads((tag_dir / SUMS).read_text())["files"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise TDLMError(f"{tag_dir / SUMS}: unreadable checksum list ({e})") from e
    check_listed_files(tag_dir, {name: e["sha256"] for name, e in listed.items()},
                       {str(p.relative_to(tag_dir)) for p in _files(tag_dir)}, SUMS,
                       added="checkpoints are loaded with pickle, so files added afterwards are never read",
                       changed="refusing to load it (checkpoints are unpickled)")


def newest_verified_tag(ckpt_dir: Path) -> str:
    """The newest ``step-N`` whose files all match their checksums (tags whose save never finished are
    skipped with a warning); raises TDLMError when none exists or the newest complete one was altered."""
    tags = sorted(((int(m.group(1)), p) for p in ckpt_dir.glob("step-*")
                   if p.is_dir() and (m := TAG_RE.match(p.name))), reverse=True)
    for _, tag_dir in tags:
        if not (tag_dir / SUMS).exists():
            log.warning("%s: no %s (the run stopped while saving it); using an older checkpoint", tag_dir, SUMS)
            print(f"warning: {tag_dir}: no {SUMS} (the run stopped while saving it); using an older checkpoint",
                  file=sys.stderr, flush=True)
            continue
        verify_checksums(tag_dir)
        return tag_dir.name
    raise TDLMError(f"--resume: no complete checkpoint in {ckpt_dir} (nothing to resume)")


def rotate_checkpoints(ckpt_dir: Path, newest: str, keep_last: int) -> list[str]:
    """Verify the checkpoint just written, then delete all but the ``keep_last`` newest ``step-N`` folders
    (0 = keep every one). Never deletes anything when the new one does not verify: the older ones are then the
    only resumable state. Returns the deleted tag names."""
    import shutil

    verify_checksums(ckpt_dir / newest)
    if keep_last <= 0:
        return []
    tags = sorted(((int(m.group(1)), p) for p in ckpt_dir.glob("step-*")
                   if p.is_dir() and (m := TAG_RE.match(p.name))), reverse=True)  # fmt: skip
    gone = []
    for _, tag_dir in tags[keep_last:]:
        shutil.rmtree(tag_dir, ignore_errors=True)
        gone.append(tag_dir.name)
    latest = ckpt_dir / "latest"  # DeepSpeed's pointer file: keep it naming a tag that exists
    if latest.exists() and latest.read_text().strip() in gone:
        latest.write_text(newest)
    return gone


# -- stopping: Ctrl-C, preemption -------------------------------------------------------------------
# Exit codes of launcher/train.py (and of each rank under deepspeed / torchrun). EX_TEMPFAIL (sysexits.h) for
# "stopped at a verified checkpoint": a Slurm requeue script resubmits with --resume on exactly this code.
EXIT_OK = 0
EXIT_FAILED = 1  # anything unexpected (a traceback)
EXIT_BAD_INPUT = 2  # a one-line config / input error, before any work
EXIT_NO_SPACE = 74  # EX_IOERR: a checkpoint could not be written (disk full); the previous one is intact
EXIT_PREEMPTED = 75  # SIGINT, SIGTERM or SIGUSR1: checkpoint saved (or nothing to save yet); resume with --resume
EXIT_PEER_LOST = 76  # a rank (node) was lost mid-run: resumable from the newest verified checkpoint with --resume
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """The first of SIGINT / SIGTERM / SIGUSR1 this rank received. The handler only records it: the training
    loop asks every rank at each update boundary (:func:`tdlm.training.distributed.agree_to_stop`, one all-reduce),
    so the ranks stop after the same update, checkpoint together and exit, instead of one rank dying inside a gloo
    collective and its peers hanging or tracing back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        # Until training has written anything (set by the launcher, cleared by setup before the run files): nothing
        # to save, and the rank may sit in a blocking call (the rendezvous, a load) that never returns to Python if
        # a peer is gone, so a stop ends the process itself a second later.
        self.immediate = False
        self.hint = "run the same command again"
        self._ending = False

    def handler(self, signum: int, frame: object = None) -> None:
        if self.signum is None:  # Ctrl-C under deepspeed: SIGINT, then the launcher's SIGTERM; the first counts
            self.signum = signum
        if self.immediate and not self._ending:
            self._ending = True
            threading.Thread(target=self._end_soon, name="tdlm-stop", daemon=True).start()

    def _end_soon(self, delay: float = 1.0) -> None:
        time.sleep(delay)  # the main thread usually gets there first (Stopped, or an input error's exit)
        if not self.immediate or self.signum is None:
            return
        if os.environ.get("RANK", "0") == "0":
            print(f"{stop_verb(self.signum)} ({signal_name(self.signum)}) before the first update; nothing saved; "
                  f"{self.hint}", file=sys.stderr, flush=True)
        os._exit(EXIT_PREEMPTED)

    def install(self, pending: int | None = None) -> StopRequest:
        """Take over the stop signals (main thread only); ``pending`` = a signal caught before this was possible."""
        for s in STOP_SIGNALS:
            signal.signal(s, self.handler)
        if pending is not None:
            self.handler(pending)
        return self

    @property
    def requested(self) -> bool:
        return self.signum is not None


STOP = StopRequest()  # one per process: signal handlers are per process


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stop_verb(signum: int) -> str:
    """SIGINT is the user's Ctrl-C (interrupted); SIGTERM / SIGUSR1 come from a scheduler (preempted)."""
    return "interrupted" if signum == signal.SIGINT else "preempted"


class Stopped(Exception):
    """Raised on every rank when the ranks agreed to stop; ``message`` is the one line rank 0 prints."""

    def __init__(self, message: str, step: int | None) -> None:
        super().__init__(message)
        self.message, self.step = message, step


class RunAborted(Exception):
    """Raised on every surviving rank when the run cannot go on but its newest verified checkpoint can (a full disk
    at a checkpoint, a lost peer). ``message`` is the one line that rank ``printer`` prints; ``exit_code`` is the
    launcher's status."""

    def __init__(self, message: str, exit_code: int, printer: int = 0) -> None:
        super().__init__(message)
        self.message, self.exit_code, self.printer = message, exit_code, printer


def write_latest(ckpt_dir: Path, tag: str) -> None:
    """DeepSpeed's ``latest`` pointer, written atomically and only for a verified tag (a full disk leaves the old
    pointer, never a torn one)."""
    tmp = ckpt_dir / f"latest.tmp-{os.getpid()}"
    try:
        tmp.write_text(tag)
        os.replace(tmp, ckpt_dir / "latest")
    finally:
        tmp.unlink(missing_ok=True)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# -- which rank was lost -----------------------------------------------------------------------------
ROLL = ".ranks"  # <run>/.ranks/<launch id>/rank-<r>.json (who) and alive-<r> (still here after a failure)


class RollCall:
    """Names the ranks that are gone after a collective failed, through the run folder (which every node shares,
    docs/multi-node.md), because the process group is unusable by then and the c10d store may have died with the
    node that hosted it.

    At start each rank writes ``rank-<r>.json`` (host, pid). After a failure each survivor writes ``alive-<r>`` and
    waits up to ``wait_s`` for the others: a rank that wrote ``alive`` is here; one on this host whose pid is dead
    is lost at once; one that says nothing by the deadline is lost.
    """

    def __init__(self, run_dir: str | Path, launch_id: str, rank: int, world: int) -> None:
        self.dir = Path(run_dir) / ROLL / launch_id
        self.rank, self.world = rank, world
        self.host = socket.gethostname()
        try:  # a roll call that cannot be written (full disk) only makes the lost ranks "?": never a reason to stop
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / f"rank-{rank}.json").write_text(json.dumps({"host": self.host, "pid": os.getpid()}))
        except OSError:
            pass

    def _who(self, r: int) -> dict:
        try:
            return json.loads((self.dir / f"rank-{r}.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def missing(self, wait_s: float = 15.0) -> tuple[list[int], list[int]]:
        """(lost ranks, surviving ranks) as this rank sees them after a failure."""
        try:
            (self.dir / f"alive-{self.rank}").write_text(str(os.getpid()))
        except OSError:
            pass
        deadline = time.monotonic() + wait_s
        while True:
            alive, lost, unknown = [], [], []
            for r in range(self.world):
                if r == self.rank or (self.dir / f"alive-{r}").exists():
                    alive.append(r)
                    continue
                who = self._who(r)
                if who.get("host") == self.host and not Path(f"/proc/{who.get('pid')}").exists():
                    lost.append(r)
                else:
                    unknown.append(r)
            if not unknown or time.monotonic() >= deadline:
                return sorted(lost + unknown), alive
            time.sleep(0.2)

    def describe(self, r: int) -> str:
        who = self._who(r)
        return f"rank {r} (host {who.get('host', '?')}, pid {who.get('pid', '?')})"

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.dir.parent.rmdir()  # only when no other launch's records remain
        except OSError:
            pass


# -- the launcher's life ---------------------------------------------------------------------------
LAUNCHERS = ("deepspeed", "torchrun", "torch.distributed.run", "torch/distributed/run", "torch.distributed.launch")


def _proc(pid: int) -> tuple[str, str] | None:
    """(cmdline, start time) of a live process, else None (a zombie, killed but not yet reaped, is dead)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return None
        return cmd, fields[19]
    except (OSError, IndexError):
        return None


def launcher_ancestors() -> list[tuple[int, str, str]]:
    """(pid, cmdline, start time) of the launcher processes above this rank (deepspeed / torchrun chain)."""
    out = []
    pid = os.getppid()
    while pid > 1:
        info = _proc(pid)
        if info is None or not any(k in info[0] for k in LAUNCHERS):
            break
        out.append((pid, *info))
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out


def stop_with_launcher(interval: float = 1.0, grace_s: float = 300.0) -> threading.Thread | None:
    """When any launcher process above this rank dies (killed alone), end this rank too.

    A rank's direct parent is DeepSpeed's per-node ``launch.py`` or torchrun's agent; killing the
    ``deepspeed`` runner above it leaves that parent alive, so a watcher checks the whole chain (pid and
    start time, so a reused pid does not count as alive). The parent's death also arrives as SIGTERM
    (PR_SET_PDEATHSIG). Either way the rank stops as if preempted (checkpoint, exit :data:`EXIT_PREEMPTED`); a rank
    still alive ``grace_s`` later is ended with ``os._exit(1)``.
    """
    if not sys.platform.startswith("linux"):
        return None
    chain = launcher_ancestors()
    if not chain:
        return None
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            for pid, cmd, start in chain:
                info = _proc(pid)
                if info is None or info[1] != start:
                    print(f"error: launcher process {pid} ({cmd.strip()[:80]}) is gone; stopping rank "
                          f"{os.environ.get('RANK', '?')}", file=sys.stderr, flush=True)
                    # SIGTERM is a stop request (StopRequest): the ranks agree at the next update boundary and
                    # checkpoint. The hard exit only ends a rank that cannot get there (a peer died mid-collective).
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(grace_s)
                    os._exit(1)
            time.sleep(interval)

    t = threading.Thread(target=watch, name="tdlm-launcher-watch", daemon=True)
    t.start()
    return t


def free_port() -> int:
    """A free local TCP port for the training launch: DeepSpeed's default 29500 is taken by any other training
    on the machine, and the launch then dies with EADDRINUSE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def training_resume_args(train_dir: Path) -> list[str]:
    """``--resume`` when ``train_dir`` holds a run that can continue (or is finished); a run that stopped before
    its first verified checkpoint cannot, so its folder is moved aside and training starts over."""
    if not any((train_dir / name).exists() for name in RUN_FILES):
        return []
    if (train_dir / "run_config.json").exists():
        if finished_step(train_dir) is not None:
            return ["--resume"]
        try:
            newest_verified_tag(train_dir / "checkpoints")
            return ["--resume"]
        except TDLMError:
            pass
    dest = train_dir.with_name(f"{train_dir.name}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(train_dir, dest)
    print(f"{train_dir} stopped before its first checkpoint: moved to {dest}; training starts over", flush=True)
    return []
