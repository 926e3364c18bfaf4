"""Memory a sample holds outside its own address space counts against its limit (issue items 2 and 3).

Each hostile probe tries to hold ``3 * MEM`` of kernel memory that no address-space limit sees and returns what it
holds as the kernel counts it (``SO_MEMINFO`` for sockets, the bytes queued / touched for IPC and pipes); its assert
holds only if it got all of it, so ``passed`` means a breach.

- **Item 2, TCP / UDP buffers.** bubblewrap brings the sample's loopback up and a cgroup v1 does not charge socket
  buffers: the filter refuses AF_INET / AF_INET6 there. The in-house namespace keeps its loopback down (no route).
  Hostile: both backends, with and without a cgroup. Controls: the same probe with the filter's inet rule removed
  (bubblewrap: it holds the memory, past a cgroup v1 too), and outside the sandbox under the same RLIMIT_AS.
- **Item 3, the no-cgroup fallback** (one process, no fork, RLIMIT_AS): detached System V shared memory, System V
  message queues and semaphores, AF_UNIX socket buffers and pipe buffers are refused; POSIX message queues
  (RLIMIT_MSGQUEUE 0) and POSIX timers (RLIMIT_SIGPENDING) are bounded in every setting. Hostile: both backends,
  with and without a cgroup (where a cgroup charges them: contained, killed at the limit). Control: the same probes
  with the fallback's rules removed hold the memory.
- Honest code in every setting: a sample that computes with ordinary memory passes; AF_UNIX socketpairs work where
  a cgroup charges them and are refused in the fallback; a few canonical MBPP solutions pass in the fallback.

The controls use a private hook (the rule tables of :mod:`tdlm.evaluation.sandbox.host`, rebuilt fresh and
restored afterwards), never a setting a caller can reach.
"""

from __future__ import annotations

import ast
import resource
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import SANDBOX_BACKENDS
from sandbox_helpers import SETTINGS, rule_tables
from sandbox_helpers import limits_for as setting_limits

from tdlm.evaluation.sandbox import core, host, isolation_support, run_python

MEM = 32 << 20  # the sample's memory_bytes: small, so 3x is cheap on a shared machine
TARGET = 3 * MEM
FAST = dict(timeout_s=20.0, cpu_s=5, memory_bytes=MEM)

COMMON = """
import ctypes, fcntl, os, socket, struct, time
TARGET = __TARGET__
libc = ctypes.CDLL(None, use_errno=True)
def meminfo(s):  # SO_MEMINFO: rmem_alloc, rcvbuf, wmem_alloc, sndbuf, fwd_alloc, wmem_queued, ...
    return struct.unpack("9I", s.getsockopt(socket.SOL_SOCKET, 55, 36))
def fill(s):
    s.setblocking(False)
    while True:
        try:
            s.send(b"x" * 65536)
        except (BlockingIOError, InterruptedError):
            return
def report(held, why=""):
    print("held", held, why)
    return held
"""
PROBES = {
    # item 2: TCP over the loopback, each connection with the largest buffers the sysctls allow, never read
    "tcp": """
KEEP = []
def f():
    held = 0
    try:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        srv.listen(128)
        KEEP.append(srv)
        while held < TARGET:
            c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
            c.connect(srv.getsockname())
            a, _ = srv.accept()
            a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
            KEEP.extend((c, a))
            fill(c)
            time.sleep(0.01)
            fill(c)
            held += meminfo(c)[5] + meminfo(a)[0]
    except OSError as e:
        return report(held, "errno %d" % e.errno)
    return report(held)
""",
    # item 2: UDP datagrams queued on receivers that never read
    "udp": """
KEEP = []
def f():
    held = 0
    try:
        while held < TARGET:
            r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
            r.bind(("127.0.0.1", 0))
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.connect(r.getsockname())
            KEEP.extend((r, s))
            s.setblocking(False)
            for _ in range(4096):
                try:
                    s.send(b"x" * 60000)
                except OSError:
                    break
            held += meminfo(r)[0]
    except OSError as e:
        return report(held, "errno %d" % e.errno)
    return report(held)
""",
    # item 3: System V shared memory, touched, then detached (in no process's address space or RSS)
    "sysv_shm": """
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
def f():
    held, seg = 0, 8 << 20
    while held < TARGET:
        sid = libc.shmget(0, seg, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if sid < 0:
            return report(held, "shmget errno %d" % ctypes.get_errno())
        p = libc.shmat(sid, None, 0)
        if p is None or p == ctypes.c_void_p(-1).value:
            return report(held, "shmat errno %d" % ctypes.get_errno())
        ctypes.memset(p, 1, seg)
        libc.shmdt(p)
        held += seg
    return report(held)
""",
    # item 3: System V message queues, each filled to its msgmnb
    "sysv_msg": """
def f():
    held = 0
    buf = ctypes.create_string_buffer(8 + 8000)
    ctypes.memmove(buf, (1).to_bytes(8, "little"), 8)
    while held < TARGET:
        qid = libc.msgget(0, 0o1600)
        if qid < 0:
            return report(held, "msgget errno %d" % ctypes.get_errno())
        while libc.msgsnd(qid, buf, 8000, 0o4000) == 0:  # IPC_NOWAIT
            held += 8000
    return report(held)
""",
    # item 3: System V semaphore arrays (no byte count from user space: refused or not is what is checked)
    "sysv_sem": """
def f():
    sid = libc.semget(0, 1000, 0o1600)
    return report(TARGET if sid >= 0 else 0, "semget errno %d" % ctypes.get_errno())
""",
    # item 3: AF_UNIX socketpairs, both directions filled with the largest buffers the sysctls allow
    "unix": """
KEEP = []
def f():
    held = 0
    try:
        while held < TARGET:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            KEEP.extend((a, b))
            for s in (a, b):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
            fill(a)
            fill(b)
            held += meminfo(a)[2] + meminfo(b)[2]
    except OSError as e:
        return report(held, "errno %d" % e.errno)
    return report(held)
""",
    # item 3: pipe buffers (F_SETPIPE_SZ up to 1 MiB each; the host bounds them only per uid, at 64 MiB by default)
    "pipe": """
KEEP = []
def f():
    held = 0
    try:
        while held < TARGET:
            r, w = os.pipe()
            KEEP.extend((r, w))
            try:
                fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
            except OSError:
                pass
            os.set_blocking(w, False)
            n = 0
            while True:
                try:
                    n += os.write(w, b"x" * 65536)
                except BlockingIOError:
                    break
            if n == 0:
                return report(held, "pipes full")
            held += n
    except OSError as e:
        return report(held, "errno %d" % e.errno)
    return report(held)
""",
}
INET = ("tcp", "udp")
NOCGROUP = ("sysv_shm", "sysv_msg", "sysv_sem", "unix", "pipe")


def probe(name: str, target: int = TARGET) -> str:
    return COMMON.replace("__TARGET__", str(target)) + PROBES[name]


def held(r) -> int:
    """What the probe said it held (0 when it was killed before it could say)."""
    for line in r.stdout.splitlines():
        if line.startswith("held "):
            return int(line.split()[1])
    return 0


def limits_for(backend: str, cgroup: str):
    return setting_limits(backend, cgroup, **FAST)


def run_probe(name: str, lim, target: int = TARGET, allow_weak: bool = False):
    return run_python(probe(name, target), lim, checks=[f"assert f() >= {target}"], allow_weak=allow_weak)


def assert_contained(name: str, r, lim) -> None:
    assert not r.passed, (name, r.stdout, r)
    assert r.weakened == (), r.weakened
    assert r.mechanism == (host.cgroups().kind if lim.use_cgroups else "rlimit-nofork"), r.mechanism
    # refused, or killed at the cgroup's limit (before it could report), or held less than the whole limit
    assert held(r) < MEM, (name, held(r), r.stdout, r.detail)


@pytest.fixture
def without_rules(monkeypatch):
    """The private hook of the controls: ``without_rules(NAME=value, ...)`` replaces rule tables of the filter and
    rebuilds it; the real tables and program are back after the test."""
    yield from rule_tables(monkeypatch)


# ------------------------------------------------------------------------------------------ item 2: TCP / UDP
@pytest.mark.parametrize("backend,cgroup", SETTINGS)
def test_tcp_and_udp_buffers_are_refused_or_unroutable(backend, cgroup):
    lim = limits_for(backend, cgroup)
    for name in INET:
        r = run_probe(name, lim)
        assert_contained(name, r, lim)
        assert held(r) == 0, (name, r.stdout)
        # bubblewrap: no AF_INET socket at all (97); in-house: a socket, but the loopback is down (101)
        assert r.stdout.split()[2:] == (["errno", "97"] if backend == "bwrap" else ["errno", "101"]), r.stdout


@pytest.mark.parametrize("cgroup", ["cgroup", "nocgroup"])
def test_control_bwrap_without_the_inet_rule_holds_tcp_and_udp_buffers_past_the_limit(cgroup, without_rules):
    lim = limits_for("bwrap", cgroup)
    if lim.use_cgroups and host.cgroups().kind == "cgroup-v2":
        pytest.skip("cgroup v2 charges TCP / UDP buffers: there is no escape to show under it")
    without_rules(INET_FAMILIES=())
    for name in INET:
        r = run_probe(name, lim)
        assert r.passed and held(r) >= TARGET, (name, r.stdout, r.detail)  # 3x the limit, and the sample lived


def test_bwrap_without_the_filter_does_not_claim_limits_under_a_cgroup_v1(monkeypatch):
    # the filter is what keeps TCP / UDP buffers out under bubblewrap: without it a cgroup v1 bounds nothing of
    # them (the control above), so the probe must not report `limits` as held
    lim = limits_for("bwrap", "cgroup")
    if host.cgroups().kind != "cgroup-v1":
        pytest.skip(f"needs a cgroup v1 (here: {host.cgroups().kind})")

    def missing(*args):
        raise ImportError("No module named 'pyseccomp'")

    monkeypatch.setattr(host, "seccomp_program", missing)
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_required", {})
    support = isolation_support(lim)
    assert support["works"] and support["mechanism"] == "cgroup-v1", support
    assert {"seccomp", "limits"} <= set(support["missing"]), support["missing"]


def test_control_outside_the_sandbox_the_tcp_probe_holds_3x_its_address_space_limit():
    code = probe("tcp") + "\nf()\n"

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEM, MEM))

    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30,
                         preexec_fn=cap, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-500:]
    got = int(out.stdout.split()[1])
    assert got >= TARGET, out.stdout


# ------------------------------------------------------------------------------------------ item 3: no cgroup
@pytest.mark.parametrize("backend,cgroup", SETTINGS)
def test_ipc_unix_socket_and_pipe_buffers_are_refused_or_charged(backend, cgroup):
    lim = limits_for(backend, cgroup)
    for name in NOCGROUP:
        if name == "sysv_sem" and lim.use_cgroups:
            continue  # its bytes cannot be counted from user space; charged to the cgroup like the others
        r = run_probe(name, lim)
        assert_contained(name, r, lim)
        if not lim.use_cgroups:  # the fallback: refused outright
            errno = "97" if name == "unix" else "1"  # EAFNOSUPPORT, EPERM
            words = r.stdout.split()
            assert words[1] == "0" and words[-2:] == ["errno", errno], (name, r.stdout)


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_control_fallback_without_its_rules_holds_ipc_unix_socket_and_pipe_buffers(backend, without_rules,
                                                                                   monkeypatch):  # fmt: skip
    lim = limits_for(backend, "nocgroup")
    without_rules(ALLOWED_SYSCALLS=host.ALLOWED_SYSCALLS + host.CGROUP_ONLY_SYSCALLS, NOCGROUP_FAMILIES=())
    # the sample's own process then sees pipes and memfds allowed: `limits` is not held, so weak mode, probed anew
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_required", {})
    for name in NOCGROUP:
        # pipes: the host caps them per uid (pipe-user-pages-soft, 64 MiB by default, shared by every sample of
        # that uid), so the control asks for an eighth of the limit; the rest for 3x the limit
        target = MEM // 8 if name == "pipe" else TARGET
        r = run_probe(name, lim, target, allow_weak=True)
        assert r.passed and held(r) >= target, (name, r.stdout, r.detail)
        assert r.mechanism == "rlimit-nofork" and r.weakened == ("limits",), r


@pytest.mark.parametrize("backend,cgroup", SETTINGS)
def test_posix_message_queues_and_timers_are_bounded_by_rlimits(backend, cgroup):
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def mq():
    return libc.mq_open(b"/tdlm", 0o100 | 0o2, 0o600, None)  # O_CREAT | O_RDWR
def timers():
    tid, n = ctypes.c_void_p(), 0
    while n < 20000 and libc.timer_create(1, None, ctypes.byref(tid)) == 0:  # CLOCK_MONOTONIC
        n += 1
    return n
"""
    lim = limits_for(backend, cgroup)
    # the defaults: ~800 KiB of message queues and ~100,000 timers (~30 MiB) per uid; now no queue, 256 signals
    r = run_python(code, lim, checks=["assert mq() >= 0", "assert timers() > 1000"])
    assert not r.passed and r.checks == (False, False), r


# ------------------------------------------------------------------------------------------ honest code
HONEST = """
import socket
def f(n):
    data = bytearray(n << 20)
    for i in range(0, len(data), 4096):
        data[i] = 1
    return sum(data) // 256
def unix_pair():
    try:
        a, b = socket.socketpair()
    except OSError as e:
        return e.errno
    a.sendall(b"ping")
    return b.recv(4).decode()
"""


@pytest.mark.parametrize("backend,cgroup", SETTINGS)
def test_honest_code_runs_and_unix_sockets_work_only_where_a_cgroup_charges_them(backend, cgroup):
    lim = limits_for(backend, cgroup)
    unix = "'ping'" if lim.use_cgroups else "97"  # EAFNOSUPPORT in the fallback
    r = run_python(HONEST, lim, checks=["assert f(4) == 4", f"assert unix_pair() == {unix}"])
    assert r.passed and r.weakened == (), r


@pytest.fixture(scope="module")
def mbpp_sample():
    from tdlm.tasks import load_task
    from tdlm.tasks.base import default_data_dir

    if not (default_data_dir() / "mbpp_sanitized_test.jsonl").exists():
        pytest.skip(f"MBPP not in {default_data_dir()}")
    # every 32nd problem but mbpp/123 (4.5 CPU-s alone; all 257 run in tests/test_sandbox_hostile.py)
    return [p for p in load_task("mbpp", data_dir=default_data_dir()).problems[::32] if p.id != "mbpp/123"]


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_canonical_mbpp_solutions_pass_in_the_fallback(backend, mbpp_sample):
    from tdlm.evaluation.scoring import score

    lim = replace(limits_for(backend, "nocgroup"), memory_bytes=1 << 30, timeout_s=60.0, cpu_s=11)
    problems = mbpp_sample
    scores = [score(p, p.answer, limits=lim) for p in problems]
    assert all(s.correct and s.sandbox.mechanism == "rlimit-nofork" for s in scores), [
        (p.id, s.detail) for p, s in zip(problems, scores, strict=True) if not s.correct]


def test_probe_outputs_parse():
    # the probes are plain Python (a syntax error would read as "contained")
    for name in PROBES:
        ast.parse(probe(name))
