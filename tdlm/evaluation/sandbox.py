"""Run untrusted Python (model-written MBPP solutions) in a separate, limited process.

Each call to :func:`run_python` gets:

- a fresh working directory as cwd and ``HOME``/``TMPDIR`` holding only ``main.py``: the private ``/tmp`` (see
  below), else a temp directory on the host; deleted afterwards either way;
- its own session / process group (``start_new_session``); on timeout, and after every run, the whole group gets
  ``SIGKILL``. The kill happens while the group leader is still unreaped, so the group id cannot have been recycled;
- rlimits: address space (``RLIMIT_AS``, default 1 GiB), CPU seconds, file size (``RLIMIT_FSIZE``, which also
  bounds stdout/stderr because they go to files), open files, no core dumps, and ``RLIMIT_NPROC`` = tasks the user
  already runs + ``max_processes`` (the limit counts all of a user's tasks, so a fixed small number would break on
  a busy machine);
- where the OS allows: a new network namespace (only a down loopback: no network at all), a new IPC namespace
  (no System V shared memory / semaphores / message queues or POSIX queues shared with other runs) and a new PID
  namespace (a minimal init is PID 1 there, with ``PR_SET_PDEATHSIG``; the sample is PID 2. When the sample ends,
  or the launcher dies, init exits and the kernel kills every descendant, including ones that called ``setsid``
  to leave the process group);
- where the OS allows, a private view of the filesystem (a new mount namespace, propagation ``rprivate`` so
  nothing reaches the host): a fresh size-capped tmpfs on each of ``/tmp``, ``/var/tmp`` and ``/dev/shm``
  (``tmpfs_bytes`` / ``tmpfs_inodes`` each; gone when the run's last process is), every other mount read-only
  (``mount_setattr(2)`` with ``AT_RECURSIVE``, Linux >= 5.12), and with the PID namespace a ``/proc`` of its own
  (other processes, e.g. concurrent samples, are invisible). So a sample cannot leave files for later samples,
  cannot reach Ray's world-writable session folders under ``/tmp``, and cannot create files anywhere else.
  Skipped (``filesystem_isolated=False``, with the reason in :func:`isolation_support`'s notes) when the
  interpreter itself lives under one of those directories, or the kernel refuses;
- root gets the namespaces directly, other users through an unprivileged user namespace when the kernel permits.
  When neither works the run still happens and the :class:`SandboxResult` flags (``network_isolated``,
  ``pid_isolated``, ``ipc_isolated``, ``filesystem_isolated``, ``proc_isolated``) say what it got;
- as root, the code runs as ``nobody`` (uid/gid 65534) when a one-time probe shows the same interpreter (same
  ``sys.version`` and prefixes) works for that user; otherwise it stays root (``privileges_dropped=False``);
- ``python -I -B`` (isolated mode: no user site, no ``PYTHON*`` env, script dir not on ``sys.path``; no ``.pyc``
  writes), stdin from ``/dev/null`` (``input()`` raises ``EOFError`` rather than hanging) and a minimal env.

Why a launcher instead of ``preexec_fn``: ``preexec_fn`` runs Python between ``fork`` and ``exec``, which the
``subprocess`` docs call unsafe when the parent has threads (the evaluation driver and
:class:`tdlm.evaluation.scoring.Scorer`
do), and it forces a full ``fork`` of a possibly multi-GiB parent. Instead a small single-threaded Python launcher
(``_LAUNCHER``) applies the limits and namespaces to itself and then ``exec``s the sample; ``subprocess`` can then
use ``vfork``. The launcher reports what it achieved over a close-on-exec pipe (JSON lines; EOF with no
``exec_failed`` line means ``exec`` succeeded). Why not bubblewrap: it is not pip-installable (CI and fresh
machines would silently lose the isolation), and the launcher already owns the namespaces, rlimits and PID-1
logic; the mount part is ~40 lines of ``mount`` / ``mount_setattr`` calls.

Checks (``run_python(code, checks=[...])``, what MBPP scoring uses): exit status 0 alone is not a pass, because
the sample runs in the same process as its asserts and can end that process early with status 0
(``sys.exit(0)``, ``os._exit(0)``, ``raise SystemExit``, an ``excepthook`` or ``atexit`` hook that exits 0,
killing its parent). So the harness ``_DRIVER`` runs ``main.py`` as ``__main__``, then each check compiled on its
own, and only after the last one writes a per-run secret token (128 random bits) to an inherited report pipe; the
run passes iff the token came back *and* the exit status is 0. The token is handed over in an unnamed file (memfd)
that the harness reads and closes before the sample's first line runs; it is never in argv, env, the program
text, stdout or on disk, and the harness took its own references to ``os.write`` / ``exec`` / ``compile`` before
the sample could patch builtins or modules. ``assert`` raises the real ``AssertionError`` whatever the sample
rebinds (``LOAD_ASSERTION_ERROR``), and any exception out of a check fails the run.

Threat model. In scope: code that is buggy, careless or reward-hacking without targeting this harness: loops,
memory / disk / fork bombs, network calls, early exits of any kind, killing or signalling other processes,
files left for later runs, rebinding or patching builtins, printing anything (including guessed tokens; the
token is not read from stdout). Out of scope: code written against this harness that digs the token out of the
interpreter's own memory (frame / ``gc`` introspection, ``ctypes``) or forges results with objects whose
``__eq__`` always returns True — anything in the same process as the checks can do what the harness can
(the anchors, human-eval and EvalPlus, share both limits); kernel exploits (there is no syscall filter); and
everything the uid drop would have stopped when it is not available (sample code running as root can undo
read-only mounts). Compare openai/human-eval ``execution.py``, which describes itself as not a security sandbox,
and EvalPlus (per-test time limits, 4 GiB cap).
"""

from __future__ import annotations

import hmac
import json
import math
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tdlm.errors import TDLMError

Status = Literal["passed", "failed", "timeout", "error"]
NOBODY = 65534

# The launcher runs as `python -I -B -c _LAUNCHER <json>`. It must stay dependency-free and single-threaded.
# Order matters: count tasks (host /proc) -> rlimits -> namespaces (need root or a user ns): user, net, ipc, mount
# (+ tmpfs / read-only), pid (its init mounts the new /proc) -> drop uid -> exec.
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
fd = cfg["status_fd"]
R = resource
CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x4000, 1 << 18
# mount_setattr is 442 on x86-64 and aarch64 (GH200) alike: syscalls from 424 on share one number table.
MNT_DETACH, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, SYS_MOUNT_SETATTR = 2, -100, 0x8000, 1, 442
PR_SET_PDEATHSIG = 1
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.syscall.restype = ctypes.c_long

class MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]

def failed(what):
    e = ctypes.get_errno()
    return f"{what}: {os.strerror(e)} (errno {e})"

def set_readonly(path, readonly, recursive):
    # mount_setattr(2), Linux >= 5.12: the only call that changes a whole mount tree at once
    a = MountAttr(MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else MOUNT_ATTR_RDONLY, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    return libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                        ctypes.c_uint(flags), ctypes.byref(a), ctypes.c_size_t(ctypes.sizeof(a))) == 0

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

net = pid = userns = ipc = fs = False
fs_note = None
wants_ns = cfg["isolate_network"] or cfg["isolate_pids"] or cfg["isolate_ipc"] or cfg["isolate_filesystem"]
if wants_ns and os.geteuid() != 0:
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
if cfg["isolate_ipc"]:  # System V shared memory / semaphores / message queues, POSIX message queues
    ipc = libc.unshare(CLONE_NEWIPC) == 0

def under(path, roots):
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)

def private_filesystem():
    # New mount namespace: fresh tmpfs on /tmp, /var/tmp, /dev/shm; every other mount read-only; the program is
    # copied to the private /tmp, which becomes cwd / HOME / TMPDIR. Returns None on success, else why not; on
    # failure before the end nothing visible has changed (the tmpfs mounts are undone).
    dirs, seen = [], set()
    for d in cfg["private_dirs"]:  # skip missing ones and aliases (/var/tmp -> /tmp)
        if os.path.isdir(d) and os.path.realpath(d) not in seen:
            seen.add(os.path.realpath(d))
            dirs.append(d)
    if "/tmp" not in dirs:
        return "no /tmp directory"
    hidden = [os.path.realpath(d) for d in dirs]
    for p in (cfg["argv"][0], sys.executable, sys.prefix, sys.base_prefix, os.path.dirname(os.__file__)):
        if under(p, hidden):
            return f"the interpreter lives under a directory that would be hidden ({p})"
    with open("main.py", "rb") as f:
        program = f.read()
    if libc.unshare(CLONE_NEWNS) != 0:
        return failed("unshare(CLONE_NEWNS)")
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # no mount event reaches the host
        return failed("mount --make-rprivate /")
    opts = f"size={cfg['tmpfs_bytes']},nr_inodes={cfg['tmpfs_inodes']},mode=1777".encode()
    done = []

    def undo(why):
        for d in reversed(done):
            libc.umount2(d.encode(), MNT_DETACH)
        return why

    for d in dirs:
        if libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
            return undo(failed(f"mount tmpfs on {d}"))
        done.append(d)
    if not set_readonly("/", True, True):
        return undo(failed("mount_setattr(/, read-only, recursive)"))
    for d in dirs:  # the recursive call caught the fresh tmpfs mounts too; they were ours, so this cannot fail
        if not set_readonly(d, False, False):
            raise OSError(failed(f"mount_setattr({d}, read-write)"))
    with open("/tmp/main.py", "wb") as f:
        f.write(program)
    if drop:
        os.chown("/tmp/main.py", cfg["drop_to"], cfg["drop_to"])
    os.chdir("/tmp")
    os.environ["HOME"] = os.environ["TMPDIR"] = "/tmp"
    return None

if cfg["isolate_filesystem"]:
    try:
        fs_note = private_filesystem()
    except OSError as e:
        os.write(fd, ("exec_failed filesystem " + repr(e)).encode())
        os._exit(125)
    fs = fs_note is None
if cfg["isolate_pids"]:
    pid = libc.unshare(CLONE_NEWPID) == 0

def drop_privileges():
    if drop:
        os.setgroups([])
        os.setgid(cfg["drop_to"])
        os.setuid(cfg["drop_to"])

report = {"net": net, "pid": pid, "userns": userns, "dropped": drop, "ipc": ipc, "fs": fs, "fs_note": fs_note}
os.write(fd, (json.dumps(report) + "\n").encode())
os.set_inheritable(fd, False)  # close-on-exec: EOF right after a successful exec
argv = cfg["argv"]

def close_harness_fds():  # the sample's copies are its own; a parent's copies must not outlive the fork
    for n in cfg["harness_fds"]:
        try:
            os.close(n)
        except OSError:
            pass

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
    if fs:  # a /proc of this PID namespace: the sample sees its own processes only, not the host's
        proc = libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, None) == 0
        os.write(fd, (json.dumps({"proc": proc, "proc_note": None if proc else failed("mount proc")}) + "\n").encode())
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
    close_harness_fds()
    os.close(fd)
    while True:
        pid_done, status = os.wait()
        if pid_done == sample:
            break
    os.write(st_w, str(status).encode())
    os._exit(0)
os.close(life_r)
os.close(st_w)
close_harness_fds()
os.close(fd)
_, init_status = os.waitpid(init, 0)
data = os.read(st_r, 64)
mirror(int(data) if data else init_status)
"""

# The harness for run_python(..., checks=...): runs as `python -I -B -c _DRIVER <json>` in the sample's process.
# It reads the completion token and the checks from an inherited file and closes it *before* any sample code runs,
# runs main.py as module __main__, then each check (compiled separately: a check is a statement of its own that the
# program text cannot swallow), and only then writes the token to the inherited report pipe, with references to
# os.write / exec / compile taken before the sample could patch them. Any way of ending early (sys.exit,
# os._exit, SystemExit, a signal, an excepthook / atexit hook that exits 0) leaves the pipe without the token.
_DRIVER = r"""
def _tdlm_harness():
    import builtins, json, os, sys, types
    cfg = json.loads(sys.argv[1])
    src = cfg["payload_fd"]
    os.lseek(src, 0, os.SEEK_SET)
    chunks = []
    while True:
        chunk = os.read(src, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(src)
    payload = json.loads(b"".join(chunks))
    token, checks = payload["token"].encode(), payload["checks"]
    del chunks, payload
    write, report, run, comp = os.write, cfg["report_fd"], exec, compile
    tests = [comp(c, f"<test {i + 1}>", "exec", dont_inherit=True) for i, c in enumerate(checks)]
    path = os.path.abspath("main.py")
    with open(path, "rb") as f:
        program = comp(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"] = main
    sys.argv[:] = ["main.py"]
    run(program, main.__dict__)
    for test in tests:
        run(test, main.__dict__)
    write(report, token)

_tdlm_harness()
"""
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # each a fresh tmpfs per run when the filesystem is isolated
TOKEN_BYTES = 16


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
    isolate_ipc: bool = True  # own System V IPC / POSIX message queues
    isolate_filesystem: bool = True  # fresh tmpfs on PRIVATE_DIRS, every other mount read-only, private /proc
    tmpfs_bytes: int = 64 << 20  # size of each private tmpfs (memory, not disk)
    tmpfs_inodes: int = 4096  # files + directories in each private tmpfs
    drop_privileges: bool = True  # as root, run as nobody when the interpreter works for that user
    # None: this interpreter if it can run as nobody, else a system python3 that can (samples need only the
    # stdlib); a venv under a 0700 /root cannot drop privileges, and without the drop root code is unconfined.
    python: str | None = None

    def __post_init__(self) -> None:
        if self.python is None:
            object.__setattr__(self, "python", default_python())
        if not (self.timeout_s > 0):
            raise TDLMError(f"SandboxLimits.timeout_s: got {self.timeout_s}, expected > 0")
        positive = ("memory_bytes", "file_size_bytes", "max_open_files", "output_bytes", "tmpfs_bytes", "tmpfs_inodes")
        for name in positive:
            if getattr(self, name) <= 0:
                raise TDLMError(f"SandboxLimits.{name}: got {getattr(self, name)}, expected > 0")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise TDLMError(f"SandboxLimits.cpu_s: got {self.cpu_s}, expected > 0 or None")
        if self.max_processes is not None and self.max_processes < 0:
            raise TDLMError(f"SandboxLimits.max_processes: got {self.max_processes}, expected >= 0 or None")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run (a plain record: ``dataclasses.asdict`` gives the JSON to log).

    ``status``: passed (exit 0, and with ``checks`` the harness's completion token came back), failed (non-zero
    exit, exception, killed by the memory / file-size limits, or exit 0 before every check ran), timeout (wall
    clock or CPU-seconds limit), error (the sandbox itself could not start the program). ``returncode`` is
    negative for a signal (-9 after a timeout kill). The ``*_isolated`` / ``privileges_dropped`` flags record what
    the OS granted for this run: ``filesystem_isolated`` = fresh tmpfs on /tmp, /var/tmp, /dev/shm and every
    other mount read-only; ``proc_isolated`` = a /proc of the sample's own PID namespace. ``checks_completed``:
    None without checks, else whether every check ran and the harness reached its end.
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
    filesystem_isolated: bool = False
    ipc_isolated: bool = False
    proc_isolated: bool = False
    checks_completed: bool | None = None


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


def _payload_file(data: bytes) -> int:
    """An fd holding ``data`` with no name anywhere (memfd, else an unlinked temp file); not inheritable."""
    try:
        fd = os.memfd_create("tdlm-harness")
    except (AttributeError, OSError):
        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
    os.write(fd, data)
    return fd


def _read_nonblocking(fd: int, cap: int = 65536) -> bytes:
    """What is buffered in a pipe whose writers are all dead (or ignored): never blocks."""
    os.set_blocking(fd, False)
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(cap) or b""
        except BlockingIOError:
            return b""


def run_python(code: str, limits: SandboxLimits | None = None, *, checks: Sequence[str] | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandboxed process and report how it ended. Thread-safe.

    Without ``checks`` the run passes iff the process exits 0. With ``checks`` (e.g. MBPP asserts), ``code`` runs
    as module ``__main__`` under the harness ``_DRIVER``, then each check, compiled separately, in the same
    namespace; the run passes only if the process exits 0 *and* the harness wrote this run's secret completion
    token (``secrets.token_hex(16)``, handed over in an unnamed file that is closed before ``code`` starts) to the
    report pipe after the last check. See the module docstring for the threat model.
    """
    return _run(code, limits or SandboxLimits(), checks)[0]


def _run(code: str, limits: SandboxLimits, checks: Sequence[str] | None) -> tuple[SandboxResult, dict]:
    """:func:`run_python`, plus the launcher's raw report (which also says why an isolation failed)."""
    if checks is not None:
        checks = list(checks)
        if not checks or not all(isinstance(c, str) for c in checks):
            raise TDLMError(f"run_python: checks must be a non-empty list of strings, got {checks!r}")
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
    harness_fds: tuple[int, ...] = ()
    token = b""
    report_r = None
    argv = [limits.python, "-I", "-B", "main.py"]
    if checks is not None:
        token = secrets.token_hex(TOKEN_BYTES).encode()
        payload_fd = _payload_file(json.dumps({"token": token.decode(), "checks": checks}).encode())
        report_r, report_w = os.pipe()
        harness_fds = (payload_fd, report_w)
        argv = [limits.python, "-I", "-B", "-c", _DRIVER, json.dumps({"payload_fd": payload_fd, "report_fd": report_w})]
    cfg = {
        "status_fd": status_w,
        "argv": argv,
        "memory_bytes": limits.memory_bytes,
        "cpu_s": limits.cpu_s or math.ceil(limits.timeout_s) + 1,
        "file_size_bytes": limits.file_size_bytes,
        "max_open_files": limits.max_open_files,
        "max_processes": limits.max_processes,
        "isolate_network": limits.isolate_network,
        "isolate_pids": limits.isolate_pids,
        "isolate_ipc": limits.isolate_ipc,
        "isolate_filesystem": limits.isolate_filesystem,
        "private_dirs": list(PRIVATE_DIRS),
        "tmpfs_bytes": limits.tmpfs_bytes,
        "tmpfs_inodes": limits.tmpfs_inodes,
        "harness_fds": list(harness_fds),
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
                    pass_fds=(status_w, *harness_fds),
                    start_new_session=True,  # own session and process group: pgid == proc.pid
                )
            except OSError as e:
                for fd in (status_w, status_r, *harness_fds):
                    os.close(fd)
                if report_r is not None:
                    os.close(report_r)
                why = f"sandbox: cannot start {limits.python}: {e}"
                done = None if checks is None else False
                t = time.monotonic() - t0
                return SandboxResult(False, "error", None, "", why, t, False, False, False, checks_completed=done), {}
            for fd in (status_w, *harness_fds):  # our copies; EOF on status_r once the launcher exec'd or died
                os.close(fd)
            try:
                timed_out = not _wait_unreaped(proc, limits.timeout_s)
            finally:
                try:  # always: also removes background children the sample left behind
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                returncode = proc.wait()
        seconds = time.monotonic() - t0
        # everyone who held the write ends is dead (or, without a PID namespace, ignored): never wait on them
        status_text = _read_nonblocking(status_r).decode("utf-8", errors="replace")
        reported = _read_nonblocking(report_r) if report_r is not None else b""
        stdout = _read_capped(out_path, limits.output_bytes)
        stderr = _read_capped(err_path, limits.output_bytes)
    finally:
        _rmtree(root)

    report: dict | None = None
    exec_failed = ""
    for line in status_text.splitlines():  # JSON lines from the launcher (and init), or "exec_failed ..."
        if line.startswith("exec_failed"):
            exec_failed = line.strip()
            break
        try:
            report = {**(report or {}), **json.loads(line)}
        except ValueError:
            pass
    completed = None if checks is None else hmac.compare_digest(reported, token)
    status: Status
    if exec_failed:
        status, stderr = "error", f"sandbox: {exec_failed}\n{stderr}"
    elif timed_out or returncode == -signal.SIGXCPU:
        status = "timeout"
    elif report is None:
        status, stderr = "error", f"sandbox: the launcher did not report (exit {returncode})\n{stderr}"
    elif returncode == 0 and completed is not False:
        status = "passed"
    else:
        status = "failed"
        if returncode == 0:  # the harness lost control: sys.exit / os._exit / SystemExit / a hook, before the end
            stderr += "\nsandbox: exit status 0 but the checks did not all run to the end (no completion token)"
    report = report or {}
    result = SandboxResult(
        passed=status == "passed",
        status=status,
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        seconds=seconds,
        network_isolated=bool(report.get("net")),
        pid_isolated=bool(report.get("pid")),
        privileges_dropped=bool(report.get("dropped")),
        filesystem_isolated=bool(report.get("fs")),
        ipc_isolated=bool(report.get("ipc")),
        proc_isolated=bool(report.get("proc")),
        checks_completed=completed,
    )
    return result, report


# What each isolation_support() key protects against, for warnings naming what a machine lacks.
ISOLATION_NAMES = {
    "network_isolated": "network namespace (no network)",
    "pid_isolated": "PID namespace (leftover processes are killed, other processes cannot be signalled)",
    "ipc_isolated": "IPC namespace (no System V / POSIX IPC shared with other runs)",
    "filesystem_isolated": "private /tmp, /var/tmp, /dev/shm and a read-only rest of the filesystem",
    "proc_isolated": "private /proc (other processes invisible)",
    "privileges_dropped": "uid drop to nobody (sample code runs as root)",
}


def isolation_support(limits: SandboxLimits | None = None) -> dict[str, Any]:
    """What the sandbox achieves on this machine (runs one trivial program); for logs and result metadata.

    Keys: ``works`` plus the :class:`SandboxResult` isolation flags, ``missing`` (descriptions of the protections
    this machine does not grant, for a warning; the uid drop counts only as root, and a protection switched off in
    ``limits`` is not missing) and ``notes`` (why the filesystem / proc isolation failed, where known).
    """
    limits = limits or SandboxLimits()
    r, report = _run("pass", limits, None)
    flags = {
        "network_isolated": r.network_isolated,
        "pid_isolated": r.pid_isolated,
        "ipc_isolated": r.ipc_isolated,
        "filesystem_isolated": r.filesystem_isolated,
        "proc_isolated": r.proc_isolated,
        "privileges_dropped": r.privileges_dropped,
    }
    wanted = {
        "network_isolated": limits.isolate_network,
        "pid_isolated": limits.isolate_pids,
        "ipc_isolated": limits.isolate_ipc,
        "filesystem_isolated": limits.isolate_filesystem,
        "proc_isolated": limits.isolate_filesystem and limits.isolate_pids,
        "privileges_dropped": limits.drop_privileges and os.geteuid() == 0,
    }
    missing = [ISOLATION_NAMES[k] for k, got in flags.items() if wanted[k] and not got]
    notes = [f"{k}: {report[k]}" for k in ("fs_note", "proc_note") if report.get(k)]
    if not r.passed:
        notes.append(r.stderr.strip()[-500:])
    return {"works": r.passed, **flags, "missing": missing, "notes": notes}
