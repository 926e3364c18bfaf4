"""The runner: :class:`SandboxLimits`, :class:`SandboxResult`, :func:`run_python`, :func:`isolation_support`,
:func:`require_sandbox`. See the package docstring for the guarantees and the threat model."""

from __future__ import annotations

import ast
import marshal
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tdlm.errors import TDLMError

from . import host, verify
from .files import fd_with, read_capped, read_nonblocking, read_text, rmtree
from .interpreter import NOBODY, can_drop_to_nobody, default_python
from .launcher import LAUNCHER
from .sample import DRIVER
from .trusted import BUDGETS
from .verdict import excerpt, judge, sample_ops, split_asserts

Status = Literal["passed", "failed", "timeout", "error"]
Backend = Literal["auto", "bwrap", "inhouse"]
OVERHEAD_TASKS = 4  # launcher / bwrap, the PID namespace's init, the sample's first process, slack
MAX_SIGPENDING = 256  # RLIMIT_SIGPENDING: queued signals / POSIX timers of the sample's uid (kernel memory)
SAMPLE_DEVICES = ("null", "zero", "full", "random", "urandom")  # the sample's /dev, on both backends (no pty)
SAMPLE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
              "OMP_NUM_THREADS": "1"}  # fmt: skip
# The guarantees of issue 22 (items 2, 3 and the network namespace, plus seccomp and the uid), in the order a
# refusal names them; each maps to what it means in a record or a warning.
GUARANTEES = {
    "filesystem": "a new root holding only the interpreter (read-only), its own tmpfs and /dev/null-like devices",
    "network": "a network namespace (no network at all, no abstract sockets of the host)",
    "pid": "a PID namespace with its own /proc (no other process visible, leftovers killed)",
    "ipc": "an IPC namespace (no System V / POSIX IPC of the host)",
    "limits": "aggregate memory / task / CPU limits over the whole process tree, kernel buffers included (a cgroup, "
              "or one process: no fork, no System V IPC, pipes or Unix sockets; no TCP / UDP through an up loopback)",
    "seccomp": "a seccomp allowlist of the calls MBPP needs (ptrace, keyctl, setns, mount, bpf ... refused)",
    "privileges": "an unprivileged uid without capabilities (never root)",
}


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits and the backend for one run. Defaults suit one MBPP program (all asserts)."""

    timeout_s: float = 10.0  # wall clock for the whole program
    memory_bytes: int = 1 << 30  # the sample's whole process tree (cgroup) and RLIMIT_AS of each process
    cpu_s: int | None = None  # CPU seconds of the whole tree (cgroup, polled) and RLIMIT_CPU; None -> ceil(timeout)+1
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE: any one file, including the captured stdout/stderr
    max_open_files: int = 256
    max_processes: int = 64  # tasks (processes + threads) the sample may run at once (cgroup pids.max / NPROC)
    output_bytes: int = 10_000  # stdout / stderr kept in the SandboxResult, each (records get a short excerpt)
    value_bytes: int = BUDGETS["value_bytes"]  # the values the sample sends back for the asserts, in all
    tmpfs_bytes: int = 64 << 20  # size of the sample's /tmp and of its /dev/shm (memory, charged to its cgroup)
    tmpfs_inodes: int = 4096  # files + directories in each (bwrap: only where no cgroup charges kernel memory)
    backend: Backend = "auto"  # auto: bubblewrap when on PATH and working, else the in-house namespaces
    use_cgroups: bool = True  # False: force the fallback (one process, no fork, RLIMIT_NPROC), for tests
    # None: this interpreter if it can run as nobody, else a system python3 that can (samples need only the
    # stdlib); a venv under a 0700 /root cannot drop privileges.
    python: str | None = None

    def __post_init__(self) -> None:
        if self.python is None:
            object.__setattr__(self, "python", default_python())
        if not (self.timeout_s > 0):
            raise TDLMError(f"SandboxLimits.timeout_s: got {self.timeout_s}, expected > 0")
        positive = ("memory_bytes", "file_size_bytes", "max_open_files", "output_bytes", "value_bytes", "tmpfs_bytes",
                    "tmpfs_inodes", "max_processes")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise TDLMError(f"SandboxLimits.{name}: got {getattr(self, name)}, expected > 0")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise TDLMError(f"SandboxLimits.cpu_s: got {self.cpu_s}, expected > 0 or None")
        if self.backend not in ("auto", "bwrap", "inhouse"):
            raise TDLMError(f"SandboxLimits.backend: got {self.backend!r}, expected 'auto', 'bwrap' or 'inhouse'")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run (a plain record: ``dataclasses.asdict`` gives the JSON to log).

    ``status``: passed (exit 0 and, with ``checks``, every assert held when the trusted side evaluated it with the
    values the sample sent back), failed, timeout (wall clock or CPU limit), error (the sandbox could not start the
    program, or this run would have had less isolation than the probe found: then the sample never ran).
    ``returncode`` is negative for a signal. ``backend`` (bwrap | inhouse | none) and ``mechanism`` (cgroup-v2 |
    cgroup-v1 | rlimit-nofork | rlimit) say how the run was isolated and limited; ``weakened`` names the
    :data:`GUARANTEES` this run did not get. Every isolation flag is what the sample's own process saw before the
    candidate's code (:mod:`.verify`), never the backend's name. ``checks``: per-assert verdicts (None without checks);
    ``detail``: a short escaped reason (the first failed assert, or the last line of stderr).
    """

    passed: bool
    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    backend: str = "none"
    mechanism: str = "rlimit"
    network_isolated: bool = False
    pid_isolated: bool = False
    ipc_isolated: bool = False
    filesystem_isolated: bool = False
    seccomp: bool = False
    privileges_dropped: bool = False
    weakened: tuple[str, ...] = ()
    checks: tuple[bool, ...] | None = None
    checks_completed: bool | None = None
    detail: str = ""
    notes: tuple[str, ...] = ()  # what the kernel / host refused this run (unshare, mount, cgroup ...)
    verdict_cpu_s: float | None = None  # CPU seconds of the trusted child that decoded the values and judged


# ------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class _Plan:
    """How runs with given limits are isolated on this machine (resolved once per limits)."""

    backend: str  # bwrap | inhouse
    drop_to: int | None
    interp: host.Interpreter | None
    cgroups: bool
    seccomp: bool
    notes: tuple[str, ...]


_plans: dict[tuple, _Plan] = {}
_plans_lock = threading.Lock()


def _plan_key(limits: SandboxLimits) -> tuple:
    return (limits.python, limits.backend, limits.use_cgroups, os.geteuid())


# Where bubblewrap may be: the system's own directories only, never PATH (a `bwrap` earlier on the caller's PATH -
# a venv, ~/.local/bin - would build, or fake, the sandbox and its report)
BWRAP_PATHS = ("/usr/bin/bwrap", "/bin/bwrap", "/usr/local/bin/bwrap")


def _bwrap_path() -> str | None:
    return next((p for p in BWRAP_PATHS if os.path.isfile(p) and os.access(p, os.X_OK)), None)


def backend_unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot be used on this machine at all (its program is not installed), or None.

    Only presence is checked here; whether the kernel lets an installed backend isolate is
    :func:`isolation_support`'s question. ``auto`` is always available (the in-house namespaces need no program).
    """
    if backend == "bwrap" and _bwrap_path() is None:
        return (f"bwrap is not installed (none of {', '.join(BWRAP_PATHS)}; PATH is not searched; "
                "Debian/Ubuntu: apt-get install bubblewrap)")  # fmt: skip
    return None


def _base_plan(limits: SandboxLimits, backend: str) -> _Plan:
    notes = []
    drop_to = NOBODY if can_drop_to_nobody(limits.python) else None
    if os.geteuid() == 0 and drop_to is None:
        notes.append(f"{limits.python} does not run as nobody (uid {NOBODY}): use a system python3")
    try:
        interp = host.interpreter_files(limits.python)
    except OSError as e:
        interp = None
        notes.append(f"interpreter files: {e}")
    cg = host.cgroups()
    use_cg = limits.use_cgroups and cg.kind is not None
    if limits.use_cgroups and cg.kind is None:
        notes.append(f"no cgroup: {cg.note}")
    try:
        host.seccomp_program(not use_cg)
        sec = True
    except (ImportError, OSError) as e:
        sec = False
        notes.append(f"seccomp unavailable ({type(e).__name__}: {e}); install pyseccomp (needs libseccomp2)")
    return _Plan(backend, drop_to, interp, use_cg, sec, tuple(notes))


def _plan(limits: SandboxLimits) -> _Plan:
    if limits.backend != "auto" and (why := backend_unavailable(limits.backend)):
        # an explicit backend is never silently replaced by another one
        raise TDLMError(f"sandbox: SandboxLimits.backend is {limits.backend!r} but {why}; or use backend 'auto'")
    key = _plan_key(limits)
    with _plans_lock:
        if key in _plans:
            return _plans[key]
    tried: list[tuple[int, _Plan]] = []
    order = ["bwrap", "inhouse"] if limits.backend == "auto" else [limits.backend]
    notes: list[str] = []
    for backend in order:
        if backend == "bwrap" and _bwrap_path() is None:
            notes.append(f"bwrap: not installed in {', '.join(BWRAP_PATHS)} (Debian/Ubuntu: apt-get install "
                         "bubblewrap)")  # fmt: skip
            continue
        plan = _base_plan(limits, backend)
        if backend == "bwrap" and plan.interp is None:  # bwrap's root needs the interpreter's file list
            notes.append("bwrap: the interpreter's files are unknown")
            continue
        r = _execute("pass", limits, None, (), plan)
        if not r.passed:
            notes.append(f"{backend}: a trivial program fails ({excerpt(r.stderr, 300)})")
        tried.append((len(r.weakened) + (0 if r.passed else 100), plan))
        if r.passed and not r.weakened:
            break
    if not tried:
        plan = _base_plan(limits, "inhouse")
        tried.append((100, plan))
    best = min(tried, key=lambda t: t[0])[1]
    best = _Plan(best.backend, best.drop_to, best.interp, best.cgroups, best.seccomp, tuple(notes) + best.notes)
    with _plans_lock:
        _plans[key] = best
    return best


def _bwrap_argv(plan: _Plan, limits: SandboxLimits, seccomp_fd: int | None, argv: list[str],
                tmpfs: tuple[str, str] | None) -> list[str]:  # fmt: skip
    assert plan.interp is not None
    a = [_bwrap_path() or "bwrap", "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net",
         "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session",
         "--cap-drop", "ALL", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
         "--clearenv"]  # fmt: skip
    for k, v in SAMPLE_ENV.items():
        a += ["--setenv", k, v]
    for op in plan.interp.ops:
        a += ["--symlink", op[1], op[2]] if op[0] == "symlink" else ["--ro-bind", op[1], op[1]]
    # /dev: the five devices and nothing else (bwrap's --dev would add a devpts instance, /dev/ptmx and /dev/tty:
    # ptys come from the host-wide pool); read-only below, as in the in-house root
    a += ["--size", "65536", "--perms", "0755", "--tmpfs", "/dev"]
    for dev in SAMPLE_DEVICES:
        a += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    if tmpfs is not None:  # the launcher's size- and inode-limited tmpfs mounts
        a += ["--bind", tmpfs[0], "/tmp", "--bind", tmpfs[1], "/dev/shm"]
    else:
        a += ["--size", str(limits.tmpfs_bytes), "--perms", "1777", "--tmpfs", "/tmp",
              "--size", str(limits.tmpfs_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"]  # fmt: skip
    a += ["--proc", "/proc", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
    if seccomp_fd is not None:
        a += ["--seccomp", str(seccomp_fd)]
    return a + ["--", *argv]


# ------------------------------------------------------------------------------------------ run
def run_python(code: str, limits: SandboxLimits | None = None, *, checks: Sequence[str] | None = None,
               test_imports: Sequence[str] = (), names: frozenset[str] | set[str] | None = None,
               allow_weak: bool = False) -> SandboxResult:  # fmt: skip
    """Run ``code`` as ``main.py`` in a fresh sandboxed process and report how it ended. Thread-safe.

    Without ``checks`` the run passes iff the process exits 0. With ``checks`` (MBPP asserts, each one ``assert``
    statement; ``test_imports`` are the import lines they need; ``names`` the names the candidate defines, from the
    task's reference solution, see :func:`tdlm.tasks.mbpp.reference_names`), the evaluator splits each assert
    (:func:`tdlm.evaluation.sandbox.verdict.split_asserts`; a shape it cannot split raises TDLMError before
    anything runs), the sample evaluates only the sub-expressions rooted at the candidate's names and sends the
    values back, and a trusted child process decodes them and evaluates the asserts under budgets
    (:mod:`.trusted`): the run passes iff every assert holds and the process exited 0.

    Fail closed, for every caller: :func:`require_sandbox` first (probed once per limits), so where any of
    :data:`GUARANTEES` is missing this raises its one-line refusal and runs nothing, unless ``allow_weak`` (asked
    for explicitly; then the result's ``weakened`` names what is missing). A run that gets less than the probe
    promised (a new root that cannot be built, a tmpfs that cannot be mounted ...) never runs the sample: it is an
    ``error`` with a one-line ``detail``, never a pass.
    """
    limits = limits or SandboxLimits()
    splits = None
    if checks is not None:
        checks = list(checks)
        if not checks or not all(isinstance(c, str) for c in checks):
            raise TDLMError(f"run_python: checks must be a non-empty list of strings, got {checks!r}")
        splits = split_asserts(checks, list(test_imports), names)
    support = require_sandbox(limits, allow_weak)  # raises the one-line refusal (fail closed)
    return _execute(code, limits, splits, tuple(test_imports), _plan(limits), frozenset(support["missing"]))


def _execute(code: str, limits: SandboxLimits, splits: list | None, test_imports: tuple[str, ...],
             plan: _Plan, accepted: frozenset[str] | None = None) -> SandboxResult:  # fmt: skip
    """One run. ``accepted``: the guarantees the caller may go without (the probe's ``missing``: empty unless weak
    mode was asked for); every other one must hold, or the sample does not run. None: a probe (records only)."""
    calls = sample_ops(splits) if splits is not None else None
    cg = None
    notes: list[str] = []
    if plan.cgroups:
        try:
            cg = host.cgroups().create(limits.memory_bytes, limits.max_processes + OVERHEAD_TASKS)
        except OSError as e:
            notes.append(f"cgroup: {e}")
    nofork = cg is None
    seccomp_fd = None
    if plan.seccomp:
        # bwrap brings the loopback up and no cgroup v1 charges TCP / UDP buffers: no AF_INET / AF_INET6 there
        seccomp_fd = fd_with(host.seccomp_program(nofork, plan.backend == "bwrap"))
    root = tempfile.mkdtemp(prefix="tdlm-sandbox-")
    work, stage = os.path.join(root, "work"), os.path.join(root, "root")
    os.mkdir(work)
    os.mkdir(stage)
    if plan.drop_to is not None:
        os.chmod(root, 0o711)  # nobody may traverse root/ (weak mode's cwd) but not list it or read the outputs
        os.chown(work, plan.drop_to, plan.drop_to)
    out_path, err_path, val_path = (os.path.join(root, n) for n in ("stdout", "stderr", "values"))
    # a host path that exists for this run only: the sample's process must not see it (filesystem, checked inside)
    marker = os.path.join(root, "host-marker")
    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    cpu_s = limits.cpu_s or math.ceil(limits.timeout_s) + 1
    expect = verify.expectations(
        backend=plan.backend, marker=marker, cgroup=cg.paths if cg is not None else None,
        cgroup_kind=cg.kind if cg is not None else None, kmem=cg is not None and cg.kmem,
        tmpfs_inodes=limits.tmpfs_inodes,
        rlimits={"AS": limits.memory_bytes, "CPU": cpu_s, "FSIZE": limits.file_size_bytes,
                 "NOFILE": limits.max_open_files, "NPROC": -1, "MEMLOCK": 0, "MSGQUEUE": 0,
                 "SIGPENDING": MAX_SIGPENDING},
        require=[k for k in GUARANTEES if k not in accepted] if accepted is not None else [],
    )  # fmt: skip
    fds: list[int] = []
    payload_fd = fd_with(marshal.dumps((code, calls, expect)))
    values_fd = os.open(val_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    # the sample's process writes what holds inside on verify_w and closes it before the candidate's code runs
    verify_r, verify_w = os.pipe()
    fds += [payload_fd, values_fd, verify_w] + ([seccomp_fd] if seccomp_fd is not None else [])
    status_r, status_w = os.pipe()
    t0 = time.monotonic()
    timed_out = cpu_out = False
    returncode: int | None = None
    try:
        exe = plan.interp.exe if plan.interp is not None else (limits.python or sys.executable)
        argv = [exe, "-I", "-S", "-B", "-c", DRIVER, f"{payload_fd},{values_fd},{verify_w}"]
        cfg = {
            "status_fd": status_w, "backend": plan.backend, "drop_to": plan.drop_to,
            "cgroup_procs": cg.procs if cg is not None else [],
            "memory_bytes": limits.memory_bytes, "cpu_s": cpu_s, "file_size_bytes": limits.file_size_bytes,
            "max_open_files": limits.max_open_files, "max_tasks": limits.max_processes + OVERHEAD_TASKS,
            "max_sigpending": MAX_SIGPENDING,
            "keep_fds": fds, "seccomp_fd": seccomp_fd, "env": SAMPLE_ENV, "workdir": work, "stage": stage,
            "ops": [list(o) for o in plan.interp.ops] if plan.interp is not None else [],
            "tmpfs_bytes": limits.tmpfs_bytes, "tmpfs_inodes": limits.tmpfs_inodes, "devices": list(SAMPLE_DEVICES),
            # what the launcher must get before it runs the sample (fail closed); nothing for a probe
            "require": [k for k in GUARANTEES if k not in accepted] if accepted is not None else [],
        }  # fmt: skip
        cfg["argv"] = argv
        if plan.backend == "bwrap":
            mounts = (os.path.join(stage, "tmp"), os.path.join(stage, "shm"))
            # a cgroup that charges kernel memory already bounds the files of bwrap's own tmpfs; otherwise the
            # launcher mounts size- and inode-limited ones (and bwrap binds them)
            cfg["bwrap_tmpfs"] = [] if cg is not None and cg.kmem else list(mounts)
            cfg["bwrap_argv"] = _bwrap_argv(plan, limits, seccomp_fd, argv, mounts)
            cfg["bwrap_argv_plain"] = _bwrap_argv(plan, limits, seccomp_fd, argv, None)
        with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
            try:
                proc = subprocess.Popen(
                    [limits.python, "-I", "-S", "-B", "-c", LAUNCHER, marshal.dumps(cfg).hex()],
                    cwd="/", env=SAMPLE_ENV, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                    pass_fds=(status_w, *fds), start_new_session=True,
                )  # fmt: skip
            except OSError as e:
                return SandboxResult(False, "error", None, "", f"sandbox: cannot start {limits.python}: {e}",
                                     time.monotonic() - t0, detail=excerpt(str(e)))  # fmt: skip
            finally:
                for fd in (status_w, *fds):  # our copies; EOF on status_r once the launcher exec'd or died
                    os.close(fd)
                fds = []
            try:
                timed_out, cpu_out = _wait(proc, limits.timeout_s, cg, cpu_s)
            finally:
                try:  # always: also removes background children the sample left behind
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                if cg is not None:
                    cg.kill()
                returncode = proc.wait()
        seconds = time.monotonic() - t0
        if cg is not None and cg.cpu_seconds() >= cpu_s:
            cpu_out = True
        status_text = read_nonblocking(status_r).decode("utf-8", errors="replace")
        status_r = -1
        facts = verify.parse_facts(read_nonblocking(verify_r).decode("utf-8", errors="replace"))
        verify_r = -1
        stdout = read_text(out_path, limits.output_bytes)
        stderr = read_text(err_path, limits.output_bytes)
        values_data, _ = read_capped(val_path, limits.value_bytes)
    finally:
        for fd in fds:
            os.close(fd)
        for r in (status_r, verify_r):
            if r >= 0:
                os.close(r)
        if cg is not None:
            cg.remove()
        rmtree(root)
    return _result(plan, limits, splits, test_imports, cg, nofork, notes, status_text, returncode, timed_out,
                   cpu_out, seconds, stdout, stderr, values_data, accepted, facts, expect)  # fmt: skip


def _wait(proc: subprocess.Popen, timeout_s: float, cg: host.Cgroup | None, cpu_s: float) -> tuple[bool, bool]:
    """Wait for ``proc`` to exit *without reaping it* (its pgid cannot be recycled before the kill), polling the
    cgroup's CPU time; returns (wall clock exceeded, cgroup CPU time exceeded)."""
    deadline = time.monotonic() + timeout_s
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        poller = select.poll()
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True, False
            step = min(left, 0.2) if cg is not None else left
            if pidfd is not None:
                if poller.poll(max(1, math.ceil(step * 1000))):
                    return False, False
            else:
                info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None and info.si_pid:
                    return False, False
                time.sleep(min(step, 0.005))
            if cg is not None and cg.cpu_seconds() > cpu_s:
                return False, True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _result(plan: _Plan, limits: SandboxLimits, splits: list | None, test_imports: tuple[str, ...],
            cg: host.Cgroup | None, nofork: bool, notes: list[str], status_text: str, returncode: int | None,
            timed_out: bool, cpu_out: bool, seconds: float, stdout: str, stderr: str,
            values_data: bytes, accepted: frozenset[str] | None = None, facts: dict | None = None,
            expect: dict | None = None) -> SandboxResult:  # fmt: skip
    report: dict[str, Any] = {}
    exec_failed = ""
    for line in status_text.splitlines():
        if line.startswith("exec_failed"):
            exec_failed = line.strip()
            break
        try:  # the launcher's own lines (the sample never holds this pipe)
            rec = ast.literal_eval(line)
        except (ValueError, SyntaxError):
            continue
        if isinstance(rec, dict):
            report.update(rec)
    # What holds is what the sample's own process saw, right before the candidate's code (:mod:`.verify`): never
    # the backend's name or what the launcher asked for. Nothing reported: nothing held.
    if facts is not None and expect is not None:
        flags = {k: bool(v) for k, v in verify.guarantees_held(facts, expect).items()}
    else:
        flags = dict.fromkeys(GUARANTEES, False)
    mechanism = cg.kind if cg is not None else ("rlimit-nofork" if plan.seccomp else "rlimit")
    backend = plan.backend if any(flags[k] for k in ("filesystem", "network", "pid", "ipc")) else "none"
    weakened = tuple(k for k in GUARANTEES if not flags[k])
    run_notes = [*notes, *(str(v) for v in (report.get("notes") or {}).values())]
    if report.get("fs_note") and str(report["fs_note"]) not in run_notes:
        run_notes.append(str(report["fs_note"]))
    verdicts = None
    completed = None
    detail = ""
    ok = False
    verdict_cpu = None
    if splits is not None:
        v = judge(splits, values_data, test_imports, limits.value_bytes)  # a trusted child; never raises
        ok, verdicts, detail, completed, verdict_cpu = v.ok, v.verdicts, v.detail, v.completed, v.cpu_s
    # a guarantee this run lost after the probe (the launcher refuses to run the sample then; this is the backstop
    # for anything it cannot see): never scored, one line
    lost = [k for k in weakened if k not in accepted] if accepted is not None and facts is not None else []
    status: Status
    if exec_failed:
        status, stderr = "error", f"sandbox: {exec_failed}\n{stderr}"
        detail = f"sandbox: {exec_failed}"
    elif timed_out or cpu_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):  # bwrap: 128 + signal
        status = "timeout"
    elif lost:
        why = next((n for n in run_notes if n), "not held inside the sample's process")
        status = "error"
        detail = f"sandbox: this run lost {', '.join(lost)} after the probe ({why}); not scored"
    elif not report:
        status, stderr = "error", f"sandbox: the launcher did not report (exit {returncode})\n{stderr}"
    elif plan.backend == "bwrap" and returncode != 0 and stderr.startswith("bwrap: ") and not stdout \
            and not values_data:  # fmt: skip
        status = "error"  # bubblewrap refused to build the sandbox: the program never ran (a sample cannot pass so)
    elif facts is None:  # the sample's process never showed what holds: its candidate never ran, nothing passes
        status = "error"
        detail = f"sandbox: the sample's process did not report what holds inside (exit {returncode}); not scored"
    elif returncode == 0 and (splits is None or ok):
        status = "passed"
    else:
        status = "failed"
        if splits is not None and ok and returncode != 0:
            detail = f"every assert held but the program exited with status {returncode}"
    if status != "passed" and not detail:
        detail = excerpt(stderr) or ("timeout" if status == "timeout" else f"exit status {returncode}")
    else:
        detail = excerpt(detail, 200)
    return SandboxResult(
        passed=status == "passed", status=status, returncode=returncode, stdout=stdout, stderr=stderr,
        seconds=seconds, backend=backend, mechanism=mechanism, network_isolated=flags["network"],
        pid_isolated=flags["pid"], ipc_isolated=flags["ipc"], filesystem_isolated=flags["filesystem"],
        seccomp=flags["seccomp"], privileges_dropped=bool(report.get("dropped")), weakened=weakened,
        checks=verdicts, checks_completed=completed, detail=detail, notes=tuple(run_notes), verdict_cpu_s=verdict_cpu,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ probes
def _hint(missing: list[str], notes: list[str]) -> str:
    text = " ".join(notes)
    hints = []
    userns_words = ("CLONE_NEWUSER", "userns", "setting up uid map", "No permissions to create new namespace")
    if any(w in text for w in userns_words):
        hints.append("allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
                     "user.max_user_namespaces > 0) or run the evaluator as root")  # fmt: skip
    if "bwrap: not installed" in text and os.geteuid() != 0:
        hints.append("install bubblewrap (apt-get install bubblewrap)")
    if "seccomp unavailable" in text:
        hints.append("pip install pyseccomp (needs libseccomp2)")
    if "does not run as nobody" in text:
        hints.append(f"provide a python3 that uid {NOBODY} can run (e.g. /usr/bin/python3)")
    if "limits" in missing and "no cgroup" in text:
        hints.append("a writable cgroup (v2 delegation or v1 memory/pids/cpuacct) or pyseccomp for the no-fork rule")
    return "; ".join(hints) or "see the notes"


def isolation_support(limits: SandboxLimits | None = None) -> dict[str, Any]:
    """What the sandbox achieves on this machine (resolves the backend, runs one trivial program).

    Keys: ``works``; ``backend`` / ``mechanism`` (see :class:`SandboxResult`); ``guarantees`` (each of
    :data:`GUARANTEES` -> bool: what the probe's own sample process saw held, :mod:`.verify`, never what its
    backend is supposed to give); ``missing`` (the names this machine does not grant); ``level`` ("full; <tool>;
    verified inside the sample" or "weak: <names>; ...", where <tool> is ``bwrap <path> (<its --version>)`` or the
    in-house launcher: the one string for the evaluation record); ``notes`` (what the kernel / host refused);
    ``refusal`` (the one line MBPP scoring refuses with, "" when nothing is missing).
    """
    limits = limits or SandboxLimits()
    try:
        plan = _plan(limits)
    except TDLMError as e:  # the explicit backend is not installed: nothing can run, and the line says why
        return {"works": False, "backend": limits.backend, "mechanism": "none",
                "guarantees": dict.fromkeys(GUARANTEES, False), "missing": list(GUARANTEES),
                "level": "weak: " + ",".join(GUARANTEES), "notes": [str(e)],
                "refusal": f"{e} (refusing to score code)"}  # fmt: skip
    r = _execute("pass", limits, None, (), plan)
    missing = list(r.weakened) if r.passed else list(GUARANTEES)
    notes = list(plan.notes) + [n for n in r.notes if n not in plan.notes]
    if not r.passed:
        notes.append(excerpt(r.stderr, 300))
    guarantees = {k: k not in missing for k in GUARANTEES}
    refusal = ""
    if missing:
        # the notes that say what the kernel refused first (user namespaces, bwrap), each shortened: one line
        key = ("CLONE_NEWUSER", "bwrap", "namespace", "seccomp", "nobody", "cgroup")
        ranked = sorted(notes, key=lambda n: next((i for i, k in enumerate(key) if k in n), len(key)))
        # no note from the kernel or host: what the sample's own process saw is the reason (a backend that ran but
        # did not isolate, verify.py)
        why = "; ".join(excerpt(n, 160) for n in ranked[:3]) or f"not held inside the sample: {', '.join(missing)}"
        refusal = (f"sandbox: refusing to score code: missing {', '.join(missing)} ({why}); to get them: "
                   f"{_hint(missing, notes)}; or set allow_weak_sandbox: true / --allow-weak-sandbox to score "
                   "with weakened guarantees recorded in every row")  # fmt: skip
    # what ran is part of the record: a guarantee is what the sample's process saw (verify.py), so the line names
    # the program that built it, never lets the name stand for the check
    if plan.backend == "bwrap":
        path = _bwrap_path() or "bwrap"
        tool = f"bwrap {path} ({verify.bwrap_version(path)})"
    else:
        tool = "in-house launcher"
    level = ("full" if not missing else "weak: " + ",".join(missing)) + f"; {tool}; verified inside the sample"
    return {"works": r.passed, "backend": r.backend, "mechanism": r.mechanism, "guarantees": guarantees,
            "missing": missing, "level": level, "notes": notes, "refusal": refusal}  # fmt: skip


_required: dict[tuple, dict[str, Any]] = {}


def require_sandbox(limits: SandboxLimits | None = None, allow_weak: bool = False) -> dict[str, Any]:
    """:func:`isolation_support`, cached per limits; raises :class:`TDLMError` with the one-line ``refusal`` when a
    guarantee is missing and ``allow_weak`` is False (fail closed)."""
    limits = limits or SandboxLimits()
    key = _plan_key(limits)
    with _plans_lock:
        support = _required.get(key)
    if support is None:
        support = isolation_support(limits)
        with _plans_lock:
            _required[key] = support
    if support["missing"] and (not allow_weak or backend_unavailable(limits.backend)):
        raise TDLMError(support["refusal"])  # a backend that is not installed cannot run even weakly
    return support
