"""Run untrusted Python (model-written MBPP solutions) in a separate, limited process.

Each call to :func:`run_python` gets:

- a fresh temp directory as cwd and ``HOME``/``TMPDIR``, deleted afterwards;
- its own session / process group (``start_new_session``); on timeout, and after every run, the whole group gets
  ``SIGKILL``. The kill happens while the group leader is still unreaped, so the group id cannot have been recycled;
- rlimits: address space (``RLIMIT_AS``, default 1 GiB), CPU seconds, file size (``RLIMIT_FSIZE``, which also
  bounds stdout/stderr because they go to files), open files, no core dumps, and ``RLIMIT_NPROC`` = tasks the user
  already runs + ``max_processes`` (the limit counts all of a user's tasks, so a fixed small number would break on
  a busy machine);
- where the OS allows: a new network namespace (only a down loopback: no network at all) and a new PID namespace
  (a minimal init is PID 1 there, with ``PR_SET_PDEATHSIG``; the sample is PID 2. When the sample ends, or the
  launcher dies, init exits and the kernel kills every descendant, including ones that called ``setsid`` to
  leave the process group). Root gets these directly;
  other users through an unprivileged user namespace when the kernel permits. When neither works the run still
  happens and :attr:`SandboxResult.network_isolated` / ``pid_isolated`` say so;
- as root, the code runs as ``nobody`` (uid/gid 65534) when a one-time probe shows the same interpreter (same
  ``sys.version`` and prefixes) works for that user; otherwise it stays root (``privileges_dropped=False``);
- ``python -I -B`` (isolated mode: no user site, no ``PYTHON*`` env, script dir not on ``sys.path``; no ``.pyc``
  writes), stdin from ``/dev/null`` (``input()`` raises ``EOFError`` rather than hanging) and a minimal env.

Why a launcher instead of ``preexec_fn``: ``preexec_fn`` runs Python between ``fork`` and ``exec``, which the
``subprocess`` docs call unsafe when the parent has threads (the evaluation driver and :class:`tdlm.scoring.Scorer`
do), and it forces a full ``fork`` of a possibly multi-GiB parent. Instead a small single-threaded Python launcher
(``_LAUNCHER``) applies the limits and namespaces to itself and then ``exec``s the sample; ``subprocess`` can then
use ``vfork``. The launcher reports what it achieved over a close-on-exec pipe: an empty tail after the status
line means ``exec`` succeeded.

This is a boundary against buggy and careless code (infinite loops, memory/disk bombs, fork bombs, stray network
calls), not a hardened jail: there is no syscall filter, and the filesystem is only protected by the uid drop.
Compare openai/human-eval ``execution.py``, which describes itself as not a security sandbox, and EvalPlus
(per-test time limits, 4 GiB cap).
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

from tdlm.errors import TDLMError

Status = Literal["passed", "failed", "timeout", "error"]
NOBODY = 65534

# The launcher runs as `python -I -B -c _LAUNCHER <json>`. It must stay dependency-free and single-threaded.
# Order matters: count tasks (host /proc) -> rlimits -> namespaces (need root or a user ns) -> drop uid -> exec.
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
fd = cfg["status_fd"]
R = resource
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1
libc = ctypes.CDLL(None, use_errno=True)

def setlim(kind, soft, hard=None):
    hard = soft if hard is None else hard
    _, old_hard = R.getrlimit(kind)
    if old_hard != R.RLIM_INFINITY:
        soft, hard = min(soft, old_hard), min(hard, old_hard)
    R.setrlimit(kind, (soft, hard))

def count_tasks(uid):
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat("/proc/" + p).st_uid == uid:
                    n += len(os.listdir("/proc/" + p + "/task"))
            except OSError:
                pass
    return n

drop = cfg["drop_to"] is not None and os.geteuid() == 0
run_uid = cfg["drop_to"] if drop else os.getuid()
if cfg["max_processes"] is not None:
    # root ignores RLIMIT_NPROC, so only count when it will bind
    base = count_tasks(run_uid) if run_uid != 0 else 0
    setlim(R.RLIMIT_NPROC, base + cfg["max_processes"])
setlim(R.RLIMIT_AS, cfg["memory_bytes"])
setlim(R.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1)  # soft -> SIGXCPU, hard -> SIGKILL
setlim(R.RLIMIT_FSIZE, cfg["file_size_bytes"])
setlim(R.RLIMIT_NOFILE, cfg["max_open_files"])
setlim(R.RLIMIT_CORE, 0)

net = pid = userns = False
if (cfg["isolate_network"] or cfg["isolate_pids"]) and os.geteuid() != 0:
    # unprivileged: a user namespace gives the capabilities to create the others
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER) == 0:
        try:
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
            userns = True
        except OSError:
            pass
if cfg["isolate_network"]:
    net = libc.unshare(CLONE_NEWNET) == 0
if cfg["isolate_pids"]:
    pid = libc.unshare(CLONE_NEWPID) == 0

def drop_privileges():
    if drop:
        os.setgroups([])
        os.setgid(cfg["drop_to"])
        os.setuid(cfg["drop_to"])

os.write(fd, (json.dumps({"net": net, "pid": pid, "userns": userns, "dropped": drop}) + "\n").encode())
os.set_inheritable(fd, False)  # close-on-exec: EOF right after a successful exec
argv = cfg["argv"]

def exec_sample():
    try:
        os.execv(argv[0], argv)
    except BaseException as e:
        os.write(fd, ("exec_failed " + repr(e)).encode())
        os._exit(125)

if not pid:
    try:
        drop_privileges()
    except OSError as e:
        os.write(fd, ("exec_failed drop " + repr(e)).encode())
        os._exit(125)
    exec_sample()

# PID namespace: the first child is PID 1 there, a minimal init that runs the sample as PID 2 and reaps orphans.
# The sample must not be PID 1 itself: the kernel drops default-action signals to a namespace init, so
# SIGXCPU / SIGXFSZ from the rlimits would be ignored. When init exits, the kernel kills the whole namespace.
def mirror(status):
    if os.WIFSIGNALED(status):  # die the same way, so returncode == -sig on both paths
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))

life_r, life_w = os.pipe()  # getppid() is 0 inside the namespace, so EOF here says the launcher died
st_r, st_w = os.pipe()  # init -> launcher: the sample's raw wait status
init = os.fork()
if init == 0:
    os.close(life_w)
    os.close(st_r)
    try:
        drop_privileges()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    except OSError as e:
        os.write(fd, ("exec_failed drop " + repr(e)).encode())
        os._exit(125)
    import select
    if select.select([life_r], [], [], 0)[0]:  # the launcher died before prctl took effect
        os._exit(125)
    os.close(life_r)
    sample = os.fork()
    if sample == 0:
        os.close(st_w)
        exec_sample()
    os.close(fd)
    while True:
        pid_done, status = os.wait()
        if pid_done == sample:
            break
    os.write(st_w, str(status).encode())
    os._exit(0)
os.close(life_r)
os.close(st_w)
os.close(fd)
_, init_status = os.waitpid(init, 0)
data = os.read(st_r, 64)
mirror(int(data) if data else init_status)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits and isolation switches for one run. Defaults suit one MBPP program (all asserts)."""

    timeout_s: float = 10.0  # wall clock for the whole program
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    cpu_s: int | None = None  # RLIMIT_CPU; None -> ceil(timeout_s) + 1
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE: any one file, including the captured stdout/stderr
    max_open_files: int = 256
    max_processes: int | None = 64  # extra tasks (processes + threads) the sample may start; None -> no limit
    output_bytes: int = 10_000  # stdout / stderr kept in the result, each
    isolate_network: bool = True
    isolate_pids: bool = True
    drop_privileges: bool = True  # as root, run as nobody when the interpreter works for that user
    # None: this interpreter if it can run as nobody, else a system python3 that can (samples need only the
    # stdlib); a venv under a 0700 /root cannot drop privileges, and without the drop root code is unconfined.
    python: str | None = None

    def __post_init__(self) -> None:
        if self.python is None:
            object.__setattr__(self, "python", default_python())
        if not (self.timeout_s > 0):
            raise TDLMError(f"SandboxLimits.timeout_s: got {self.timeout_s}, expected > 0")
        for name in ("memory_bytes", "file_size_bytes", "max_open_files", "output_bytes"):
            if getattr(self, name) <= 0:
                raise TDLMError(f"SandboxLimits.{name}: got {getattr(self, name)}, expected > 0")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise TDLMError(f"SandboxLimits.cpu_s: got {self.cpu_s}, expected > 0 or None")
        if self.max_processes is not None and self.max_processes < 0:
            raise TDLMError(f"SandboxLimits.max_processes: got {self.max_processes}, expected >= 0 or None")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run (a plain record: ``dataclasses.asdict`` gives the JSON to log).

    ``status``: passed (exit 0), failed (non-zero exit, exception, or killed by the memory / file-size limits),
    timeout (wall clock or CPU-seconds limit), error (the sandbox itself could not start the program).
    ``returncode`` is negative for a signal (-9 after a timeout kill). The ``*_isolated`` / ``privileges_dropped``
    flags record what the OS granted for this run.
    """

    passed: bool
    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    network_isolated: bool
    pid_isolated: bool
    privileges_dropped: bool


_probe_lock = threading.Lock()
_nobody_ok: dict[str, bool] = {}


def _interpreter_fingerprint(argv: list[str], **kw: object) -> str | None:
    code = "import sys; print(sys.version, sys.prefix, sys.base_prefix, sys.executable)"
    try:
        out = subprocess.run(argv + ["-I", "-c", code], capture_output=True, text=True, timeout=30, check=False, **kw)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _can_drop_to_nobody(python: str) -> bool:
    """Does ``python`` start as nobody *and* resolve to the same installation? Probed once per interpreter.

    A venv whose base interpreter sits under a 0700 ``/root`` can silently fall back to another stdlib for other
    users, so starting is not enough: version and prefixes must match.
    """
    if os.geteuid() != 0:
        return False
    with _probe_lock:
        if python not in _nobody_ok:
            mine = _interpreter_fingerprint([python])
            theirs = _interpreter_fingerprint([python], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/")
            _nobody_ok[python] = mine is not None and mine == theirs
        return _nobody_ok[python]


def default_python() -> str:
    """The interpreter for samples: ``sys.executable`` unless only a system ``python3`` can drop to nobody."""
    if os.geteuid() != 0 or _can_drop_to_nobody(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _can_drop_to_nobody(candidate):
            return candidate
    return sys.executable


def _read_capped(path: str, cap: int) -> str:
    with open(path, "rb") as f:
        data = f.read(cap)
        total = os.fstat(f.fileno()).st_size
    text = data.decode("utf-8", errors="replace")
    if total > cap:
        text += f"\n[... truncated: {total} bytes total, {cap} kept]"
    return text


def _rmtree(path: str) -> None:
    def fix(func, p, _exc):  # sample code may chmod its own files to 000
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def _wait_unreaped(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for ``proc`` to exit *without reaping it*; True if it exited within ``timeout_s``."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:  # poll, not select: a busy driver can hold fds above select's FD_SETSIZE (1024)
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            return bool(poller.poll(max(0, int(timeout_s * 1000))))
        finally:
            os.close(pidfd)
    deadline = time.monotonic() + timeout_s  # fallback: poll without reaping
    while time.monotonic() < deadline:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and info.si_pid:
            return True
        time.sleep(0.005)
    return False


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandboxed process and report how it ended. Thread-safe."""
    limits = limits or SandboxLimits()
    drop_to = NOBODY if limits.drop_privileges and _can_drop_to_nobody(limits.python) else None
    root = tempfile.mkdtemp(prefix="tdlm-sandbox-")
    work = os.path.join(root, "work")
    os.mkdir(work)
    with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
        f.write(code)
    if drop_to is not None:
        os.chmod(root, 0o711)  # nobody may traverse root/ but not list or touch the captured output files
        os.chown(work, drop_to, drop_to)
        os.chown(os.path.join(work, "main.py"), drop_to, drop_to)
    out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
    status_r, status_w = os.pipe()
    cfg = {
        "status_fd": status_w,
        "argv": [limits.python, "-I", "-B", "main.py"],
        "memory_bytes": limits.memory_bytes,
        "cpu_s": limits.cpu_s or math.ceil(limits.timeout_s) + 1,
        "file_size_bytes": limits.file_size_bytes,
        "max_open_files": limits.max_open_files,
        "max_processes": limits.max_processes,
        "isolate_network": limits.isolate_network,
        "isolate_pids": limits.isolate_pids,
        "drop_to": drop_to,
    }
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
    }
    t0 = time.monotonic()
    timed_out = False
    returncode: int | None = None
    try:
        with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
            try:
                proc = subprocess.Popen(
                    [limits.python, "-I", "-B", "-c", _LAUNCHER, json.dumps(cfg)],
                    cwd=work,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=fo,
                    stderr=fe,
                    pass_fds=(status_w,),
                    start_new_session=True,  # own session and process group: pgid == proc.pid
                )
            except OSError as e:
                os.close(status_w)
                os.close(status_r)
                why = f"sandbox: cannot start {limits.python}: {e}"
                return SandboxResult(False, "error", None, "", why, time.monotonic() - t0, False, False, False)
            os.close(status_w)  # our copy; EOF on status_r once the launcher exec'd or died
            try:
                timed_out = not _wait_unreaped(proc, limits.timeout_s)
            finally:
                try:  # always: also removes background children the sample left behind
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                returncode = proc.wait()
        seconds = time.monotonic() - t0
        os.set_blocking(status_r, False)  # everyone who held the write end is dead; never wait on it
        with os.fdopen(status_r, "rb") as f:
            try:
                status_text = (f.read(65536) or b"").decode("utf-8", errors="replace")
            except BlockingIOError:
                status_text = ""
        head, _, tail = status_text.partition("\n")
        try:
            report = json.loads(head)
        except ValueError:
            report = None
        stdout = _read_capped(out_path, limits.output_bytes)
        stderr = _read_capped(err_path, limits.output_bytes)
    finally:
        _rmtree(root)

    status: Status
    if tail.startswith("exec_failed"):
        status, stderr = "error", f"sandbox: {tail.strip()}\n{stderr}"
    elif timed_out or returncode == -signal.SIGXCPU:
        status = "timeout"
    elif report is None:
        status, stderr = "error", f"sandbox: the launcher did not report (exit {returncode})\n{stderr}"
    elif returncode == 0:
        status = "passed"
    else:
        status = "failed"
    report = report or {}
    return SandboxResult(
        passed=status == "passed",
        status=status,
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        seconds=seconds,
        network_isolated=bool(report.get("net")),
        pid_isolated=bool(report.get("pid")),
        privileges_dropped=bool(report.get("dropped")),
    )


def isolation_support(limits: SandboxLimits | None = None) -> dict[str, bool]:
    """What the sandbox achieves on this machine (runs one trivial program); for logs and result metadata."""
    r = run_python("pass", limits)
    return {
        "works": r.passed,
        "network_isolated": r.network_isolated,
        "pid_isolated": r.pid_isolated,
        "privileges_dropped": r.privileges_dropped,
    }
