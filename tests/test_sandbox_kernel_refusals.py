"""What the seccomp filter and rlimits refuse, probed from inside a sample at every value, not only the ones a rule
was written around (open issues "tests that catch faults one step past the tested values" and "allow what MBPP
needs and nothing else").

- Socket families: ``socket`` / ``socketpair`` of *every* family number 0..63 (AF_MAX is 46), each with four socket
  types, plus 64-bit forms whose low half is an allowed family. The expected policy is written out here per setting
  (never read back from the filter's own tables, which a fault would change too): bubblewrap with a cgroup allows
  AF_UNIX only (its loopback is up: no AF_INET / AF_INET6, the largest of them included), bubblewrap without a cgroup
  nothing; the in-house backend AF_INET / AF_INET6 (its loopback is down) and AF_UNIX only with a cgroup. A TCP
  connection over ``::1`` and ``127.0.0.1`` never gets through.
- The no-cgroup fallback refuses the raw ``pipe`` syscall beside ``pipe2`` (and ``os.pipe``); with a cgroup, which
  charges the buffers, both work.
- Every setting refuses AIO (``io_setup``, ``io_submit``), ``io_uring_setup``, ``memfd_secret``, ``inotify_init``,
  ``inotify_init1`` and ``fanotify_init``, and runs the sample with ``RLIMIT_MEMLOCK`` 0.
- bubblewrap comes from fixed system paths only, never from PATH.

The syscalls go through ``libc.syscall`` with their x86_64 numbers (the wrappers would pick other calls). Controls:
the same probe with the filter's rules removed (a private hook: the rule tables of
:mod:`tdlm.evaluation.sandbox.host`, restored afterwards) opens every family and makes every call, so each refusal
seen above is the filter's, not the kernel's.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import SANDBOX_BACKENDS
from sandbox_helpers import SETTINGS, probed_once, rule_tables
from sandbox_helpers import limits_for as setting_limits

from tdlm.evaluation.sandbox import backend_unavailable, core, host, isolation_support, run_python

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers are x86_64's")

FAST = dict(timeout_s=20.0, cpu_s=5, output_bytes=100_000)
EAFNOSUPPORT, EPERM = errno.EAFNOSUPPORT, errno.EPERM
# the families a sample may open, per setting (AF_UNIX 1, AF_INET 2, AF_INET6 10); every other number is refused
ALLOWED = {("bwrap", "cgroup"): {1}, ("bwrap", "nocgroup"): set(), ("inhouse", "cgroup"): {1, 2, 10},
           ("inhouse", "nocgroup"): {2, 10}}  # fmt: skip
FAMILIES = list(range(64))
WIDE = [(1 << 32) | f for f in (1, 2, 10)] + [(1 << 63) | 10]  # the kernel reads the low 32 bits: refused always
REFUSED_EVERYWHERE = ("io_setup", "io_submit", "io_uring_setup", "memfd_secret", "inotify_init", "inotify_init1",
                      "fanotify_init")  # fmt: skip
PIPES = ("pipe", "pipe2", "os.pipe")

PROBE = """
import ctypes, json, os, resource, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
U = ctypes.c_ulong

def call(nr, *args):  # the result, or -errno
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *args)
    return r if r >= 0 else -ctypes.get_errno()

def families(numbers):
    out = {}
    for fam in numbers:
        got = []
        for typ in (1, 2, 3, 5):  # SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET
            fd = call(41, U(fam), typ, 0)  # socket
            if fd >= 0:
                os.close(fd)
            got.append(fd)
            pair = (ctypes.c_int * 2)(-1, -1)
            r = call(53, U(fam), typ, 0, pair)  # socketpair
            if r >= 0:
                os.close(pair[0])
                os.close(pair[1])
            got.append(r)
        out[str(fam)] = got
    return out

def loopback(family, addr):
    try:
        srv = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        return "socket errno %d" % e.errno
    try:
        srv.bind((addr, 0))
        srv.listen(1)
        c = socket.create_connection(srv.getsockname()[:2], timeout=2)
        a, _ = srv.accept()
        c.sendall(b"hi")
        return "connected " + a.recv(2).decode()
    except OSError as e:
        return "errno %d" % e.errno

fds = (ctypes.c_int * 2)()
aio = ctypes.c_ulong(0)
uring = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
CALLS = {  # name: (x86_64 number, arguments); each succeeds (or fails other than EPERM) where not filtered
    "pipe": (22, (fds,)), "pipe2": (293, (fds, 0)),
    "io_setup": (206, (1, ctypes.byref(aio))), "io_submit": (209, (U(0), 0, None)),
    "io_uring_setup": (425, (1, uring)), "memfd_secret": (447, (0,)),
    "inotify_init": (253, ()), "inotify_init1": (294, (0,)),
    "fanotify_init": (300, (0x200, 0)),  # FAN_CLASS_NOTIF | FAN_REPORT_FID: allowed unprivileged since 5.13
}
calls = {name: call(nr, *args) for name, (nr, args) in CALLS.items()}
try:
    os.pipe()
    calls["os.pipe"] = 0
except OSError as e:
    calls["os.pipe"] = -e.errno
page = ctypes.create_string_buffer(4096)
ctypes.set_errno(0)
calls["mlock"] = libc.mlock(page, 4096) or -ctypes.get_errno()
print(json.dumps({"families": families(__FAMILIES__), "calls": calls,
                  "memlock": list(resource.getrlimit(resource.RLIMIT_MEMLOCK)),
                  "inet6": loopback(socket.AF_INET6, "::1"), "inet": loopback(socket.AF_INET, "127.0.0.1")}))
""".replace("__FAMILIES__", repr(FAMILIES + WIDE))


def limits_for(backend: str, cgroup: str):
    return setting_limits(backend, cgroup, **FAST)


def run_probe(lim, weakened: tuple[str, ...] = ()) -> dict:
    r = run_python(PROBE, lim, allow_weak=bool(weakened))
    assert r.passed and r.weakened == weakened, (r.status, r.detail, r.stderr[-500:])
    assert r.mechanism == (host.cgroups().kind if lim.use_cgroups else "rlimit-nofork"), r.mechanism
    return json.loads(r.stdout)


@pytest.fixture(params=SETTINGS, ids=[f"{b}-{cg}" for b, cg in SETTINGS])
def probed(request) -> tuple[tuple[str, str], dict]:
    """(setting, what the probe saw there): one sandboxed run per setting, shared by the tests below."""
    setting = request.param
    return setting, probed_once(("kernel_refusals", *setting), lambda: run_probe(limits_for(*setting)))


@pytest.fixture
def without_rules(monkeypatch):
    """``without_rules(NAME=value, ...)``: replace rule tables of the filter and rebuild it (restored after)."""
    yield from rule_tables(monkeypatch)


def opened(results: list[int]) -> bool:
    return any(r >= 0 for r in results)


# ------------------------------------------------------------------------------------------ socket families
def test_every_refused_socket_family_is_refused_and_every_allowed_one_opens(probed):
    setting, got = probed
    allowed = ALLOWED[setting]
    seen = got["families"]
    assert sorted(map(int, seen)) == sorted(FAMILIES + WIDE)
    # every number outside the policy, the largest refused family (AF_INET6 where refused) and 63 included:
    # EAFNOSUPPORT from socket and socketpair, with every type
    wrong = {f: r for f, r in seen.items() if int(f) not in allowed and r != [-EAFNOSUPPORT] * 8}
    assert wrong == {}, (setting, wrong)
    # the honest side: each allowed family opens (so a refusal above is not the probe failing)
    assert all(opened(seen[str(f)]) for f in allowed), (setting, {f: seen[str(f)] for f in allowed})


def test_no_tcp_connection_over_the_ipv6_or_ipv4_loopback(probed):
    (backend, _), got = probed
    if backend == "bwrap":  # its loopback is up: no AF_INET6 / AF_INET socket at all
        assert got["inet6"] == got["inet"] == f"socket errno {EAFNOSUPPORT}", got
    else:  # a socket, but the in-house loopback is down: ::1 is not even an address, 127.0.0.1 has no route
        assert (got["inet6"], got["inet"]) == (f"errno {errno.EADDRNOTAVAIL}", f"errno {errno.ENETUNREACH}"), got


def test_control_without_the_family_rules_the_probe_opens_them_and_connects_over_ipv6(without_rules):
    # bubblewrap without a cgroup refuses AF_UNIX, AF_INET and AF_INET6; with those rules gone the same probe
    # opens all three and connects over ::1: the refusals above are the filter's
    lim = limits_for("bwrap", "nocgroup")
    without_rules(INET_FAMILIES=(), NOCGROUP_FAMILIES=())
    got = run_probe(lim)
    assert all(opened(got["families"][str(f)]) for f in (1, 2, 10)), got["families"]
    assert got["inet6"] == got["inet"] == "connected hi", got


# ------------------------------------------------------------------------------------------ syscalls, rlimits
def test_raw_pipe_is_refused_beside_pipe2_only_in_the_fallback(probed):
    (_, cgroup), got = probed
    pipes = {k: got["calls"][k] for k in PIPES}
    if cgroup == "nocgroup":  # pipe buffers are kernel memory no address-space limit counts
        assert pipes == dict.fromkeys(PIPES, -EPERM), pipes
    else:  # charged to the cgroup: honest code may use pipes (subprocess, multiprocessing)
        assert pipes == dict.fromkeys(PIPES, 0), pipes


def test_aio_io_uring_memfd_secret_inotify_fanotify_are_refused_and_memlock_is_zero(probed):
    setting, got = probed
    calls = {k: got["calls"][k] for k in REFUSED_EVERYWHERE}
    assert calls == dict.fromkeys(REFUSED_EVERYWHERE, -EPERM), (setting, calls)
    assert got["memlock"] == [0, 0], (setting, got["memlock"])
    assert got["calls"]["mlock"] == -EPERM, got["calls"]  # RLIMIT_MEMLOCK 0 without CAP_IPC_LOCK


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_control_without_the_syscall_rules_every_call_goes_through(backend, without_rules, monkeypatch):
    # once on the allowlist, each refused call succeeds or fails with another errno (io_submit of no context:
    # EINVAL; io_uring_setup: ENOMEM under RLIMIT_MEMLOCK 0 on some kernels): the EPERM above is the filter's.
    # With pipes allowed the sample's process no longer sees itself as one process: `limits` is missing (weak mode)
    lim = limits_for(backend, "nocgroup")
    without_rules(ALLOWED_SYSCALLS=host.ALLOWED_SYSCALLS + REFUSED_EVERYWHERE + ("pipe", "pipe2"))
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_required", {})
    calls = run_probe(lim, ("limits",))["calls"]
    through = {k: calls[k] for k in (*REFUSED_EVERYWHERE, *PIPES)}
    assert all(v != -EPERM for v in through.values()), through
    assert all(through[k] >= 0 for k in (*PIPES, "io_setup", "inotify_init", "inotify_init1")), through


def test_probe_source_parses():
    compile(PROBE, "<probe>", "exec")


# ------------------------------------------------------------------------------------------ bubblewrap's path
@pytest.fixture
def open_dir():
    """A directory that the sandbox's launcher can reach and write after it dropped to nobody (tmp_path cannot)."""
    d = Path(tempfile.mkdtemp(prefix="tdlm-sbx-path-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_bwrap_is_never_taken_from_path(open_dir, monkeypatch):
    """A ``bwrap`` on PATH (a venv's bin, ~/.local/bin) is neither resolved nor run when no fixed system path
    holds one; the same file at a fixed path is (the control)."""
    tmp_path = open_dir
    marker = tmp_path / "ran"
    fake_dir = tmp_path / "bin"
    fake_dir.mkdir(mode=0o755)
    fake = fake_dir / "bwrap"
    fake.write_text(f"#!/bin/sh\necho ran > {marker}\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("PATH", f"{fake_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    # the shipped list: system directories only, whatever PATH holds
    assert set(core.BWRAP_PATHS) <= {"/usr/bin/bwrap", "/bin/bwrap", "/usr/local/bin/bwrap"}, core.BWRAP_PATHS
    assert core._bwrap_path() != str(fake)
    monkeypatch.setattr(core, "BWRAP_PATHS", (str(tmp_path / "usr" / "bin" / "bwrap"),))
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_required", {})
    assert core._bwrap_path() is None
    why = backend_unavailable("bwrap")
    assert why is not None and "PATH is not searched" in why and "\n" not in why, why
    support = isolation_support(core.SandboxLimits(backend="auto", timeout_s=20.0))
    assert support["backend"] == "inhouse" and support["works"], support
    assert not marker.exists(), "the bwrap found on PATH was run"
    monkeypatch.setattr(core, "BWRAP_PATHS", (str(tmp_path / "absent"), str(fake)))
    assert core._bwrap_path() == str(fake) and backend_unavailable("bwrap") is None
