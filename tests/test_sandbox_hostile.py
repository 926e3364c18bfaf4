"""The MBPP sandbox (tdlm.evaluation.sandbox) against hostile samples, in the setting this process runs in (root
here): every category of issue 22, each with at least two samples written for it, through both backends
(bubblewrap and the in-house namespaces) and, for the limits, both mechanisms (a cgroup, and the fallback of one
process without fork).

Each hostile sample is phrased as an MBPP task whose assert holds *only if the attack worked*: it returns the
secret it managed to read, True if it got more memory / CPU / tasks than allowed, the value another sample left
behind, and so on. So ``passed`` means a breach, and every sample must score as not passed. A few attacks also
get a host-side check (no daemon left, a short result excerpt). :data:`CATALOGUE` is shared with
tests/test_sandbox_settings.py, which replays it as an unprivileged user (with and without user namespaces).

Also here: every canonical MBPP solution passes (and mutated ones fail) through ``score_code``, as the evaluator
calls it.
"""

from __future__ import annotations

import ast
import builtins
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for

from tdlm.evaluation.sandbox import SandboxLimits, isolation_support, run_python, split_asserts
from tdlm.evaluation.scoring import score, score_code
from tdlm.tasks.base import default_data_dir
from tdlm.tasks.mbpp import PLACEHOLDER, reference_names

REPO = Path(__file__).resolve().parents[1]
DATA = default_data_dir()
MBPP_FILE = DATA / "mbpp_sanitized_test.jsonl"
HOSTILE = dict(timeout_s=15.0, cpu_s=3)
BACKENDS = list(SANDBOX_BACKENDS)

# ------------------------------------------------------------------------------------------ the catalogue
# (category, name, code, asserts, limits overrides, code of a sample run just before, for state between samples)
# Placeholders __NAME__ are filled from the host fixture (:func:`host_fixture`).
CATALOGUE: list[dict] = [
    # -- 1. passes without solving: the task is f(x) == 2 * x; every sample returns something else and cheats
    dict(cat="verdict", name="gc_clears_the_tests", code="""
import gc
def f(x):
    for o in gc.get_objects():
        if isinstance(o, list) and o and all(isinstance(c, type(f.__code__)) for c in o):
            o.clear()
    return 0
f(0)
""", tests=["assert f(3) == 6", "assert f(4) == 8"]),
    dict(cat="verdict", name="frame_edit_of_the_caller", code="""
import sys
def f(x):
    fr = sys._getframe(1)
    while fr is not None:
        for k, v in list(fr.f_locals.items()):
            if isinstance(v, list):
                v[:] = []
        fr = fr.f_back
    return -1
""", tests=["assert f(3) == 6"]),
    dict(cat="verdict", name="settrace_skips_checks", code="""
import sys
def tracer(frame, event, arg):
    if event == "line" and "call" in frame.f_code.co_filename:
        raise SystemExit(0)
    return tracer
sys.settrace(tracer)
def f(x):
    return 0
""", tests=["assert f(3) == 6"]),
    dict(cat="verdict", name="always_equal_object", code="""
class E:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = object.__hash__
def f(x):
    return E()
""", tests=["assert f(3) == 6", "assert f(4) == 8"]),
    dict(cat="verdict", name="int_subclass_always_equal", code="""
class I(int):
    def __eq__(self, other): return True
def f(x):
    return I(0)
""", tests=["assert f(3) == 6"]),
    dict(cat="verdict", name="rebinding_set", code="""
import builtins
builtins.set = lambda *a: 1
set = lambda *a: 1
def f(x):
    return [0]
""", tests=["assert set(f(3)) == set((6,))"]),
    dict(cat="verdict", name="patching_math_isclose", code="""
import math
math.isclose = lambda *a, **k: True
def f(x):
    return 0.0
""", tests=["assert math.isclose(f(3), 6.0, rel_tol=0.001)"], test_imports=["import math"]),
    dict(cat="verdict", name="early_exit_status_0", code="""
import os, sys, atexit
atexit.register(lambda: os._exit(0))
def f(x):
    sys.exit(0)
""", tests=["assert f(3) == 6"]),
    dict(cat="verdict", name="reference_solution_from_disk", code="""
import json
def remove_Occ(s, ch):
    return None
for path in ["__MBPP__", "/work/shared/benchmarks/mbpp_sanitized_test.jsonl"]:
    try:
        for line in open(path):
            rec = json.loads(line)
            if rec["task_id"] == 11:
                exec(rec["code"])
    except OSError:
        pass
""", tests=['assert remove_Occ("hello","l") == "heo"', 'assert remove_Occ("abcda","a") == "bcd"']),
    # -- 2. things to read: each returns what it read; the assert holds only if it read the secret
    dict(cat="read", name="home_token_file", code="""
def f():
    for p in ["__HOME__/.netrc", "__HOME__/.cache/huggingface/token"]:
        try:
            return open(p).read().strip()
        except OSError:
            pass
    return None
""", tests=["assert f() == '__SECRET__'"]),
    dict(cat="read", name="earlier_samples_jsonl", code="""
import os
def f():
    for root, dirs, files in os.walk("__HOME__"):
        for n in files:
            if n == "samples.jsonl":
                return open(os.path.join(root, n)).read().strip()
    return None
""", tests=["assert f() == '__SECRET__'"]),
    dict(cat="read", name="unix_socket_outside_tmp", code="""
import socket
def f():
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    try:
        s.connect("__SOCK__")
        return s.recv(100).decode()
    except OSError as e:
        return str(e)
""", tests=["assert f() == '__SECRET__'"]),
    dict(cat="read", name="abstract_unix_socket", code="""
import socket
def f():
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    try:
        s.connect("\\0__ABSTRACT__")
        return s.recv(100).decode()
    except OSError as e:
        return str(e)
""", tests=["assert f() == '__SECRET__'"]),
    dict(cat="read", name="evaluator_environ", code="""
import os
def f():
    found = None
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                env = open("/proc/%s/environ" % p, "rb").read()
            except OSError:
                continue
            for kv in env.split(b"\\0"):
                if kv.startswith(b"TDLM_SBX_SECRET="):
                    found = kv.split(b"=", 1)[1].decode()
    return found
""", tests=["assert f() == '__SECRET__'"]),
    # -- 3. aggregate limits: True only if the tree got past the limit (256 MiB memory, 1 CPU s, 16 tasks)
    dict(cat="limits", name="memory_across_children", code="""
import os
def f():
    kids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            b = bytearray(100 << 20)
            for i in range(0, len(b), 4096):
                b[i] = 1
            import time; time.sleep(1.0)
            os._exit(0)
        kids.append(pid)
    return all(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) == 0 for k in kids)
""", tests=["assert f() == True"], limits=dict(memory_bytes=256 << 20)),
    dict(cat="limits", name="memfd_not_counted", code="""
import os
def f():
    fds = []
    for _ in range(3):
        fd = os.memfd_create("x")
        chunk = b"x" * (1 << 20)
        for _ in range(100):
            os.write(fd, chunk)
        fds.append(fd)
    return True
""", tests=["assert f() == True"], limits=dict(memory_bytes=256 << 20)),
    dict(cat="limits", name="shm_not_counted", code="""
def f():
    chunk = b"x" * (1 << 20)
    for n in range(3):
        with open("/dev/shm/blob%d" % n, "wb") as fh:
            for _ in range(100):
                fh.write(chunk)
    return True
""", tests=["assert f() == True"], limits=dict(memory_bytes=256 << 20)),
    dict(cat="limits", name="cpu_across_children", code="""
import os, time
def spin(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
def f():
    kids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            spin(0.8)
            os._exit(0)
        kids.append(pid)
    return all(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) == 0 for k in kids)
""", tests=["assert f() == True"], limits=dict(cpu_s=1)),
    dict(cat="limits", name="too_many_tasks", code="""
import threading, time
def f():
    ev = threading.Event()
    n = 0
    try:
        for _ in range(40):
            threading.Thread(target=ev.wait, daemon=True).start()
            n += 1
    except RuntimeError:
        pass
    ev.set()
    return n
""", tests=["assert f() == 40"], limits=dict(max_processes=16)),
    # -- 4. state between samples: a sample just before leaves something; True only if this one sees it
    dict(cat="state", name="keyring", pre="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_ADD_KEY = {"x86_64": 248, "aarch64": 217}[__import__("os").uname().machine]
libc.syscall(SYS_ADD_KEY, b"user", b"tdlm-sbx", b"__SECRET__", len(b"__SECRET__"), -4)  # KEY_SPEC_USER_KEYRING
""", code="""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_REQUEST_KEY, SYS_KEYCTL = {"x86_64": (249, 250), "aarch64": (218, 219)}[os.uname().machine]
def f():
    kid = libc.syscall(SYS_KEYCTL, 10, -4, b"user", b"tdlm-sbx", 0)  # KEYCTL_SEARCH in the user keyring
    if kid < 0:
        kid = libc.syscall(SYS_REQUEST_KEY, b"user", b"tdlm-sbx", None, 0)
    if kid < 0:
        return "errno %d" % ctypes.get_errno()
    buf = ctypes.create_string_buffer(100)
    n = libc.syscall(SYS_KEYCTL, 11, kid, buf, 100)  # KEYCTL_READ
    return buf.raw[:n].decode() if n > 0 else None
""", tests=["assert f() == '__SECRET__'"]),
    dict(cat="state", name="files_in_tmp_and_shm", pre="""
for d in ("/tmp", "/dev/shm", "/var/tmp"):
    try:
        open(d + "/tdlm-sbx-left", "w").write("__SECRET__")
    except OSError:
        pass
""", code="""
def f():
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        try:
            return open(d + "/tdlm-sbx-left").read()
        except OSError:
            pass
""", tests=["assert f() == '__SECRET__'"]),
    dict(cat="state", name="sysv_shared_memory", pre="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
sid = libc.shmget(0x7d1a5b, 4096, 0o1666)  # IPC_CREAT | 0666
if sid >= 0:
    p = libc.shmat(sid, None, 0)
    ctypes.memmove(p, b"__SECRET__\0", len(b"__SECRET__") + 1)
""", code="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
def f():
    sid = libc.shmget(0x7d1a5b, 4096, 0o666)
    if sid < 0:
        return None
    return ctypes.string_at(libc.shmat(sid, None, 0)).decode()
""", tests=["assert f() == '__SECRET__'"]),
    # -- 5. escapes: network, other processes, the kernel's namespace / mount calls
    dict(cat="escape", name="tcp_to_localhost_listener", code="""
import socket
def f():
    try:
        s = socket.create_connection(("127.0.0.1", __PORT__), timeout=3)
        return s.recv(100).decode()
    except OSError as e:
        return str(e)
""", tests=["assert f() == '__SECRET__'"]),
    dict(cat="escape", name="ptrace_the_evaluator", code="""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def f():
    ok = []
    for pid in (__EVALPID__, os.getppid()):
        if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
            ok.append(pid)
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH: a breach, but let the victim run on
    return ok
""", tests=["assert f() != []"]),
    dict(cat="escape", name="daemon_left_running", code="""
import os, sys
def f():
    try:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(20)", "__MARKER__"])
            os._exit(0)
    except OSError:
        pass
    return True
""", tests=["assert f() == False"]),
    dict(cat="escape", name="unshare_setns_mount", code="""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def f():
    got = []
    if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER
        got.append("unshare")
    fd = os.open("/proc/1/ns/net", os.O_RDONLY) if os.path.exists("/proc/1/ns/net") else -1
    if fd >= 0 and libc.setns(fd, 0) == 0:
        got.append("setns")
    if libc.mount(None, b"/", None, 32 | 4096, None) == 0:  # MS_REMOUNT | MS_BIND: read-write again
        got.append("remount")
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None) == 0:
        got.append("mount")
    return got
""", tests=["assert len(f()) > 0"]),
    # -- issue 28, item 3: nothing reachable past the namespaces
    dict(cat="escape", name="nested_user_namespace", code="""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_CLONE, SYS_CLONE3 = {"x86_64": (56, 435), "aarch64": (220, 435)}[os.uname().machine]
def f():
    got = []
    for flag in (0x10000000, 0x40000000, 0x20000):  # CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS (+ SIGCHLD)
        pid = libc.syscall(SYS_CLONE, flag | 17, 0, 0, 0, 0)
        if pid == 0:
            os._exit(0)
        if pid > 0:
            os.waitpid(pid, 0)
            got.append(hex(flag))
    args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)  # struct clone_args, CLONE_NEWUSER
    pid = libc.syscall(SYS_CLONE3, args, 88)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
        got.append("clone3")
    return got
""", tests=["assert f() != []"]),
    dict(cat="escape", name="vsock_netlink_packet_sockets", code="""
import socket
def f():
    opened = []
    # AF_VSOCK (the host's port space), AF_NETLINK netfilter / route, AF_PACKET; the 64-bit form of AF_VSOCK
    for fam, typ, proto in ((40, 1, 0), (16, 3, 12), (16, 3, 0), (17, 3, 0), (0x100000028, 1, 0)):
        try:
            socket.socket(fam, typ, proto).close()
            opened.append(fam)
        except (OSError, OverflowError):
            pass
    return opened
""", tests=["assert f() != []"]),
    # empty files cost no tmpfs bytes, only kernel memory: bounded by the inode limit (in-house, and the bwrap
    # launcher's own tmpfs without a cgroup) or by a cgroup that charges kernel memory (32 MiB here)
    dict(cat="limits", name="tmp_inode_flood", code="""
def f():
    n = 0
    try:
        for i in range(150000):  # in the cwd: the sample's /tmp (weak mode: a host folder removed after the run)
            open("f%d" % i, "w").close()
            n += 1
    except OSError:
        pass
    return n
""", tests=["assert f() == 150000"], limits=dict(tmpfs_inodes=1024, memory_bytes=32 << 20)),
    dict(cat="escape", name="write_outside_tmp", code="""
def f():
    n = 0
    for p in ("/usr/lib/tdlm-sbx", "/tdlm-sbx", "__HOME__/tdlm-sbx-written"):
        try:
            open(p, "w").write("x")
            n += 1
        except OSError:
            pass
    return n
""", tests=["assert f() > 0"]),
]


def fill(text: str, ctx: dict[str, str]) -> str:
    for k, v in ctx.items():
        text = text.replace(f"__{k}__", v)
    return text


class HostFixture:
    """Secrets where a sample could find them on a shared node: a world-readable fake HOME with a token and an
    evaluation output, a Unix socket outside /tmp and an abstract one, a TCP listener on 127.0.0.1, a variable in
    this process's environment. All serve or hold ``secret``; none is reachable from a contained sample."""

    def __init__(self) -> None:
        self.secret = "s" + secrets.token_hex(8)
        self.marker = "tdlm-sbx-daemon-" + secrets.token_hex(4)
        self.home = tempfile.mkdtemp(prefix="tdlm-sbx-home-", dir="/home" if os.access("/home", os.W_OK) else None)
        os.chmod(self.home, 0o755)
        for rel in (".netrc", ".cache/huggingface/token", "evals/run1/samples.jsonl"):
            p = Path(self.home, rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            for d in [p.parent, *p.parent.parents]:
                if str(d).startswith(self.home):
                    os.chmod(d, 0o755)
            p.write_text(self.secret + "\n")
            p.chmod(0o644)
        self.sock_path = os.path.join(self.home, "agent.sock")
        self.abstract = "tdlm-sbx-" + secrets.token_hex(4)
        self._socks = []
        for family, addr in ((socket.AF_UNIX, self.sock_path), (socket.AF_UNIX, "\0" + self.abstract),
                             (socket.AF_INET, ("127.0.0.1", 0))):  # fmt: skip
            s = socket.socket(family)
            s.bind(addr)
            s.listen(16)
            self._socks.append(s)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()
        os.chmod(self.sock_path, 0o777)
        self.port = self._socks[2].getsockname()[1]
        os.environ["TDLM_SBX_SECRET"] = self.secret

    def _serve(self, s: socket.socket) -> None:
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            try:
                c.sendall(self.secret.encode())
            finally:
                c.close()

    def ctx(self) -> dict[str, str]:
        return {"SECRET": self.secret, "HOME": self.home, "SOCK": self.sock_path, "ABSTRACT": self.abstract,
                "PORT": str(self.port), "EVALPID": str(os.getpid()), "MARKER": self.marker,
                "MBPP": str(MBPP_FILE)}  # fmt: skip

    def daemons(self) -> list[int]:
        """Processes still running whose command line holds the daemon sample's marker."""
        out = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    if self.marker.encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                        out.append(int(p))
                except OSError:
                    pass
        return out

    def close(self) -> None:
        for s in self._socks:
            s.close()
        os.environ.pop("TDLM_SBX_SECRET", None)
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="module")
def host():
    h = HostFixture()
    yield h
    h.close()


def run_entry(entry: dict, ctx: dict[str, str], limits: SandboxLimits):
    """Run one catalogue entry (its ``pre`` sample first) and return the SandboxResult of the asserted one."""
    lim = replace(limits, **{**HOSTILE, **entry.get("limits", {})})
    if entry.get("pre"):
        run_python(fill(entry["pre"], ctx), lim)
    return run_python(fill(entry["code"], ctx), lim, checks=[fill(t, ctx) for t in entry["tests"]],
                      test_imports=entry.get("test_imports", []))  # fmt: skip


def test_catalogue_has_two_samples_per_category():
    cats: dict[str, int] = {}
    for e in CATALOGUE:
        cats[e["cat"]] = cats.get(e["cat"], 0) + 1
    assert set(cats) == {"verdict", "read", "limits", "state", "escape"}
    assert min(cats.values()) >= 2, cats


@pytest.fixture(scope="module", params=BACKENDS)
def backend_limits(request):
    return sandbox_limits_for(request.param)  # root here: every guarantee, on both backends


@pytest.mark.parametrize("entry", CATALOGUE, ids=[f"{e['cat']}-{e['name']}" for e in CATALOGUE])
def test_hostile_sample_is_contained(entry, backend_limits, host):
    r = run_entry(entry, host.ctx(), backend_limits)
    assert not r.passed, (entry["name"], r)
    assert r.weakened == () and r.mechanism.startswith("cgroup"), r
    if entry["cat"] in ("read", "state", "escape"):  # contained, not broken: the attack ran and reported back
        assert r.status == "failed" and r.checks_completed, (entry["name"], r)
    assert len(r.detail) <= 200 and host.secret not in r.detail, r.detail
    if entry["name"] == "daemon_left_running":
        time.sleep(0.2)
        assert host.daemons() == [], "a daemon outlived its sample"
    if entry["name"] == "write_outside_tmp":
        assert not os.path.exists(os.path.join(host.home, "tdlm-sbx-written"))


@pytest.mark.parametrize("entry", [e for e in CATALOGUE if e["cat"] in ("limits", "escape")],
                         ids=lambda e: e["name"])  # fmt: skip
def test_no_cgroup_fallback_is_one_process_without_fork(entry, host):
    # the mechanism without a cgroup: seccomp refuses fork / memfd, so per-process rlimits are the aggregate
    lim = SandboxLimits(backend="inhouse", use_cgroups=False)
    r = run_entry(entry, host.ctx(), lim)
    assert not r.passed, (entry["name"], r)
    assert r.mechanism == "rlimit-nofork" and r.weakened == (), r


def test_the_verdict_is_unchanged_for_honest_code_that_does_the_same_things():
    # the controls of the verdict samples: the same tricks around a correct answer still pass
    code = "import math, builtins\nmath.isclose = lambda *a, **k: False\nset = None\ndef f(x):\n    return 2 * x\n"
    checks = ["assert f(3) == 6", "assert set([f(1)]) == {2}", "assert math.isclose(f(1), 2.0)"]
    r = run_python(code, SandboxLimits(**HOSTILE), checks=checks, test_imports=["import math"])
    assert r.passed and r.checks == (True, True, True), r


def test_stderr_never_reaches_results_beyond_a_short_escaped_excerpt(host):
    code = ("import sys\nsys.stderr.write(('\\x1b[31m' + 'A' * 5000 + '\\n') * 20 + 'last \\x00 line')\n"
            "raise SystemExit(3)\n")
    r = run_python(code, SandboxLimits(**HOSTILE), checks=["assert f() == 1"])
    assert not r.passed and len(r.detail) <= 200, r.detail
    assert "\x00" not in r.detail and "\x1b" not in r.detail, r.detail
    s = score_code(code, ["assert f() == 1"], limits=SandboxLimits(**HOSTILE))
    assert len(s.detail) <= 200


# ------------------------------------------------------------------------------------------ canonical MBPP
@pytest.fixture(scope="module")
def mbpp():
    if not MBPP_FILE.exists():
        pytest.skip(f"MBPP not in {DATA}")
    from tdlm.tasks import load_task

    return load_task("mbpp", data_dir=DATA)


class _ReturnNone(ast.NodeTransformer):
    def visit_Return(self, node: ast.Return) -> ast.Return:
        return ast.copy_location(ast.Return(value=ast.Constant(None)), node)


def return_none(code: str) -> str:
    """The solution with every ``return x`` replaced by ``return None``."""
    return ast.unparse(ast.fix_missing_locations(_ReturnNone().visit(ast.parse(code))))


def test_every_shipped_mbpp_assert_splits_into_calls_of_the_reference(mbpp):
    # issue 28: load() refuses a shape the grammar cannot split; here every call is rooted at a reference name and
    # nothing of the candidate's is left in the trusted check
    n = 0
    for p in mbpp.problems:
        names = reference_names(p.answer)
        for split in split_asserts(p.tests, p.test_imports, names):
            n += 1
            assert split.ops and all(op[0] in names for op in split.ops), (p.id, split.source)
            used = {x.id for x in ast.walk(ast.parse(split.check)) if isinstance(x, ast.Name)}
            assert not used & names, (p.id, split.check)
            assert all(u in dir(builtins) or u == "math" or u.startswith(PLACEHOLDER) for u in used), (p.id, used)
    assert n == 776


@pytest.mark.slow
def test_all_canonical_mbpp_solutions_pass(mbpp):
    # mbpp/123 (amicable numbers to 9999) needs ~4.5 CPU seconds; the wall clock is relaxed for a loaded machine,
    # the CPU budget is the evaluator's (11 s). 88 returns a Counter (sent as a dict), 126 defines its own `sum`.
    lim = SandboxLimits(timeout_s=60.0, cpu_s=11)
    assert len(mbpp) == 257
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda p: score(p, p.answer, limits=lim), mbpp.problems))
    failed = [(p.id, s.status, s.detail) for p, s in zip(mbpp.problems, scores, strict=True) if not s.correct]
    assert not failed, f"{len(failed)} canonical solutions fail in the sandbox: {failed[:5]}"
    assert {s.sandbox.backend for s in scores} == {isolation_support(lim)["backend"]}


def test_canonical_solutions_pass_on_the_in_house_backend_too(mbpp):
    lim = SandboxLimits(timeout_s=60.0, cpu_s=11, backend="inhouse")
    sample = [p for p in mbpp.problems if p.id in ("mbpp/88", "mbpp/126")] + list(mbpp.problems[::32])
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda p: score(p, p.answer, limits=lim), sample))
    assert all(s.correct and s.sandbox.backend == "inhouse" for s in scores), [
        (p.id, s.detail) for p, s in zip(sample, scores, strict=True) if not s.correct]


def test_mutated_mbpp_solutions_fail(mbpp):
    sample = mbpp.problems[::8]  # 33 problems across the split
    lim = SandboxLimits(timeout_s=60.0, cpu_s=11)
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda p: score_code(return_none(p.answer), p.tests, p.test_imports, lim,
                                                                     reference=p.answer), sample))
    passed = [p.id for p, s in zip(sample, scores, strict=True) if s.correct]
    assert not passed, f"solutions returning None pass: {passed}"

