"""The MBPP sandbox (tdlm.evaluation.sandbox) against real and hostile programs.

* every canonical MBPP sanitized solution (test_imports + code + test_list) passes, and solutions mutated to
  ``return None`` fail, through :func:`tdlm.evaluation.scoring.score_code` as the evaluator calls it;
* hostile programs are contained, reported as a failure within their time limit, and leave the host as it was:
  infinite loops, a fork bomb, a memory bomb, writing / deleting outside the sandbox's temp dir, sockets to a
  port of this test process, killing the parent, printing gigabytes;
* a wrong solution never passes by ending the run early with status 0 (sys.exit, os._exit, SystemExit, exiting
  hooks, killing the parent) or by tampering (rebinding AssertionError, patching builtins, printing or writing
  guessed tokens, scanning the process for the completion token); correct solutions that rebind builtins still
  pass. (Filesystem / IPC / /proc isolation: test_sandbox_filesystem.py.)

Two configurations: ``default`` is ``SandboxLimits()`` with this interpreter, what
:class:`tdlm.evaluation.scoring.Scorer`
uses; ``nobody`` (root only) is an interpreter the sandbox can run as uid 65534 (a venv under a 0700 ``/root``
cannot be; the system python can), where the uid drop protects the filesystem and makes ``RLIMIT_NPROC``
binding. A protection the sandbox reports as unavailable (``network_isolated`` / ``pid_isolated`` /
``privileges_dropped`` False) is an expected failure with the reason spelled out, never a silent pass.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from tdlm.evaluation import sandbox
from tdlm.evaluation.sandbox import SandboxLimits, isolation_support, run_python
from tdlm.evaluation.scoring import score_code

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "benchmarks"
HOSTILE = SandboxLimits(timeout_s=2.0)  # the Scorer's defaults, with a short wall clock
SLACK_S = 3.0  # kill + reap + temp-dir removal on a loaded 2-core machine


def _nobody_python() -> str | None:
    """An interpreter the sandbox runs as nobody (root only): this one, else the system python."""
    if os.geteuid() != 0:
        return None
    for p in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if p and sandbox._can_drop_to_nobody(p):
            return p
    return None


@pytest.fixture(scope="module")
def support() -> dict[str, bool]:
    return isolation_support()


@pytest.fixture(scope="module", params=["default", "nobody"])
def limits(request) -> SandboxLimits:
    if request.param == "default":
        return HOSTILE
    py = _nobody_python()
    if py is None:
        pytest.skip("not root, or no interpreter here runs identically as nobody: no uid drop to test")
    return replace(HOSTILE, python=py)


def _nprocs() -> int:
    return sum(1 for p in os.listdir("/proc") if p.isdigit())


def _tasks_of(uid: int) -> int:
    """Processes + threads owned by ``uid`` (what RLIMIT_NPROC counts)."""
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{p}/task"))
            except OSError:
                pass
    return n


def _ended_in_time(r, limits: SandboxLimits) -> None:
    assert not r.passed and r.status in ("failed", "timeout"), r
    assert r.seconds < limits.timeout_s + SLACK_S, f"took {r.seconds:.1f} s"


# -- MBPP: real programs ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mbpp():
    if not (DATA / "mbpp_sanitized_test.jsonl").exists():
        pytest.skip(f"MBPP not in {DATA}")
    from tdlm.tasks import load_task

    return load_task("mbpp", data_dir=DATA)


class _ReturnNone(ast.NodeTransformer):
    def visit_Return(self, node: ast.Return) -> ast.Return:
        return ast.copy_location(ast.Return(value=ast.Constant(None)), node)


def return_none(code: str) -> str:
    """The solution with every ``return x`` replaced by ``return None``."""
    return ast.unparse(ast.fix_missing_locations(_ReturnNone().visit(ast.parse(code))))


@pytest.mark.slow
def test_all_canonical_mbpp_solutions_pass(mbpp):
    # The default 10 s wall clock is sized for an idle machine; mbpp/123 (amicable numbers to 9999) needs
    # ~4.5 CPU seconds and took 17 s of wall time at load 13 on 2 cores. The CPU budget (11 s) is the same
    # as the default's; only the wall clock is relaxed so machine load cannot fail a correct solution.
    lim = SandboxLimits(timeout_s=60.0, cpu_s=11)
    assert len(mbpp) == 257
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda p: score_code(p.answer, p.tests, p.test_imports, lim), mbpp.problems))
    failed = [(p.id, s.status, s.detail) for p, s in zip(mbpp.problems, scores, strict=True) if not s.correct]
    assert not failed, f"{len(failed)} canonical solutions fail in the sandbox: {failed[:5]}"


def test_mutated_mbpp_solutions_fail(mbpp):
    sample = mbpp.problems[::8]  # 33 problems across the split
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda p: score_code(return_none(p.answer), p.tests, p.test_imports), sample))
    passed = [p.id for p, s in zip(sample, scores, strict=True) if s.correct]
    assert not passed, f"'return None' mutants pass: {passed}"
    assert all(s.status == "failed" for s in scores)  # an assert or a TypeError on None, never a timeout


# -- hostile programs -------------------------------------------------------------------------------
def test_infinite_loops_time_out(limits):
    spin_threads = "import threading\ndef spin():\n    while True:\n        pass\nfor _ in range(4):\n" \
                   "    threading.Thread(target=spin).start()"
    codes = ("while True:\n    pass", "import time\ntime.sleep(3600)", spin_threads)
    with ThreadPoolExecutor(len(codes)) as pool:  # run_python is thread-safe; concurrent runs save time
        results = list(pool.map(lambda c: run_python(c, limits), codes))
    for r in results:
        assert r.status == "timeout", r
        _ended_in_time(r, limits)


def test_fork_bomb_is_contained_and_the_host_recovers(limits, support):
    r_probe = run_python("pass", limits)
    if os.geteuid() == 0 and not r_probe.privileges_dropped:
        # Root is exempt from RLIMIT_NPROC, so only the wall clock and the PID namespace teardown would bound
        # the bomb; on a shared machine it could take every pid (pid_max) from other users in that window.
        pytest.xfail("sandbox code runs as root here (no uid drop for this interpreter): RLIMIT_NPROC does not "
                     "bind, so a fork bomb is not bounded; not run")  # fmt: skip
    uid = sandbox.NOBODY if r_probe.privileges_dropped else os.getuid()
    before, tasks_before = _nprocs(), _tasks_of(uid)
    peak = [tasks_before]
    stop = threading.Event()

    def watch() -> None:  # tasks of the sample's uid while the bomb runs (RLIMIT_NPROC counts those)
        while not stop.is_set():
            peak[0] = max(peak[0], _tasks_of(uid))
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    try:
        r = run_python(bomb, limits)
    finally:
        stop.set()
        t.join()
    _ended_in_time(r, limits)
    # RLIMIT_NPROC = the uid's tasks at launch + max_processes (+ slack for the uid's other activity)
    bound = limits.max_processes + (2 if uid == sandbox.NOBODY else 20)
    assert peak[0] - tasks_before <= bound, f"uid {uid} tasks rose by {peak[0] - tasks_before} (bound {bound})"
    # the PID namespace teardown kills the rest asynchronously: the counts come back within seconds
    deadline = time.monotonic() + 5.0
    while (_nprocs() > before + 20 or _tasks_of(uid) > tasks_before + 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _nprocs() <= before + 20, f"{_nprocs() - before} more processes than before the bomb"
    # (+2: another test's sandbox may run as nobody at the same moment)
    assert _tasks_of(uid) <= tasks_before + 2, f"{_tasks_of(uid) - tasks_before} bomb tasks survived"


def test_memory_bomb_fails_and_we_are_unharmed(limits):
    codes = ("x = bytearray(8 << 30)", "xs = []\nwhile True:\n    xs.append(bytearray(64 << 20))")
    with ThreadPoolExecutor(len(codes)) as pool:
        results = list(pool.map(lambda c: run_python(c, limits), codes))
    at_once, growing = results
    _ended_in_time(at_once, limits)
    assert at_once.status == "failed" and "MemoryError" in at_once.stderr, at_once
    # zero-filling 1 GiB in 64 MiB steps can outlast a 2 s clock on a loaded machine: either end is contained
    _ended_in_time(growing, limits)
    assert growing.status == "timeout" or "MemoryError" in growing.stderr, growing
    big = bytearray(256 << 20)  # this process still allocates freely
    assert len(big) == 256 << 20


def test_writing_and_deleting_outside_the_temp_dir(limits, tmp_path):
    # tmp_path is under the host's /tmp: with filesystem isolation the sample does not even see it
    tmp_path.chmod(0o755)  # readable by all (like most host dirs); only write permission protects it
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("keep me")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "file").write_text("x")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    mode = sentinel.stat().st_mode
    code = f"""
import os, shutil
errors = []
for action in (lambda: os.remove({str(sentinel)!r}),
               lambda: open({str(tmp_path / "new.txt")!r}, "w").write("pwned"),
               lambda: shutil.rmtree({str(tree)!r}),
               lambda: os.chmod({str(sentinel)!r}, 0)):
    try:
        action()
    except OSError as e:
        errors.append(type(e).__name__)
print(errors)
raise SystemExit(1 if errors else 0)
"""
    r = run_python(code, limits)
    after = sorted(str(p) for p in tmp_path.rglob("*"))
    untouched = after == before and sentinel.read_text() == "keep me" and sentinel.stat().st_mode == mode
    if r.filesystem_isolated:
        assert untouched, f"files changed outside the sandbox: {set(before) ^ set(after)}"
        assert r.status == "failed" and r.stdout.strip() == str(["FileNotFoundError"] * 4)
    elif r.privileges_dropped:
        assert untouched, f"files changed outside the sandbox: {set(before) ^ set(after)}"
        assert r.status == "failed" and "PermissionError" in r.stdout
    elif not untouched:
        pytest.xfail(f"sandbox code runs as uid {os.geteuid()} without a uid drop ({limits.python} cannot run as "
                     "nobody): tdlm.evaluation.sandbox protects the filesystem only by the uid drop, so it "
                     "deleted / wrote "
                     "host files outside its temp dir")  # fmt: skip


def test_socket_to_a_host_port_fails(limits, support):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'exfiltrate')\nprint('connected')")  # fmt: skip
    try:
        r = run_python(code, limits)
        try:
            conn, _ = server.accept()
            conn.close()
            reached = True
        except BlockingIOError:
            reached = False
    finally:
        server.close()
    if not r.network_isolated:
        assert reached or r.status != "passed"
        pytest.xfail("no network namespace on this machine: the sandbox reports network_isolated=False")
    assert not reached and r.status == "failed" and "connected" not in r.stdout, r
    _ended_in_time(r, limits)
    r = run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", limits)
    assert r.status == "failed" and r.network_isolated


def test_killing_the_parent_leaves_the_caller_alive(limits):
    # The sandbox call runs in a helper process, so that a sample that *can* kill its parent kills the
    # helper, not pytest; the helper surviving and reporting is the property under test. HELPER is the
    # helper's host pid (the sample's parent when there is no PID namespace).
    kill_parent = ("import os, signal\n"
                   "for target in (os.getppid(), HELPER):\n"
                   "    for sig in (signal.SIGTERM, signal.SIGKILL):\n"
                   "        try:\n            os.kill(target, sig)\n        except OSError:\n            pass\n"
                   "print('still here')\nraise SystemExit(3)")  # fmt: skip
    kill_group = "import os, signal\nos.killpg(0, signal.SIGKILL)"  # its own process group
    # The helper imports tdlm.evaluation.sandbox without tdlm/__init__ (which imports torch: ~6 s under load).
    helper = f"""
import dataclasses, json, os, sys, types
pkg = types.ModuleType("tdlm")
pkg.__path__ = [{str(REPO / "tdlm")!r}]
sys.modules["tdlm"] = pkg
from tdlm.evaluation.sandbox import SandboxLimits, run_python
lim = SandboxLimits(timeout_s={limits.timeout_s}, python={limits.python!r})
for code in ({kill_parent!r}, {kill_group!r}):
    r = run_python(code.replace("HELPER", str(os.getpid())), lim)
    print(json.dumps(dataclasses.asdict(r)), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", helper], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the sandbox's caller died (rc {out.returncode}): {out.stderr[-500:]}"
    first, second = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first["status"] == "failed" and first["returncode"] == 3 and first["stdout"] == "still here\n", first
    assert second["status"] == "failed", second  # killed itself (root) or EPERM (nobody: the group has root)
    assert first["seconds"] < limits.timeout_s and second["seconds"] < limits.timeout_s


def test_printing_gigabytes_is_capped_and_quick(limits):
    codes = ("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(4096):\n    sys.stdout.write(chunk)",
             "import os\nchunk = b'y' * (1 << 20)\nwhile True:\n    try:\n        os.write(2, chunk)\n"
             "    except OSError:\n        pass")  # fmt: skip
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(codes)) as pool:
        results = list(pool.map(lambda c: run_python(c, limits), codes))
    assert time.monotonic() - t0 < limits.timeout_s + SLACK_S
    for r in results:
        _ended_in_time(r, limits)  # 4 GiB asked for: the 16 MiB file-size cap stops it (or the clock)
        assert len(r.stdout) < limits.output_bytes + 200 and len(r.stderr) < limits.output_bytes + 200
        assert "truncated" in r.stdout + r.stderr


def test_signal_handlers_do_not_outlive_the_timeout(limits):
    code = ("import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
            "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.01)")  # fmt: skip
    r = run_python(code, limits)
    assert r.status == "timeout" and r.returncode == -signal.SIGKILL
    _ended_in_time(r, limits)


# -- checks: a pass needs every assert to run under the harness (tdlm.evaluation.sandbox._DRIVER) --------------------
WRONG = "def f(x):\n    return 0\n"  # fails both tests below
TESTS = ["assert f(1) == 2", "assert f(2) == 3"]
# Each appends to WRONG; the old harness (exit status 0 = pass) passed the ones marked *.
EARLY_EXITS = {
    "sys.exit(0)*": "import sys\nsys.exit(0)",
    "os._exit(0)*": "import os\nos._exit(0)",
    "raise SystemExit*": "raise SystemExit",
    "exit() builtin*": "exit()",
    "SystemExit(0) from the function under test*": "def f(x):\n    raise SystemExit(0)",
    "os._exit(0) from the function under test*": "def f(x):\n    import os\n    os._exit(0)",
    "excepthook exits 0*": "import os, sys\nsys.excepthook = lambda *a: os._exit(0)",
    "atexit hook exits 0*": "import atexit, os\natexit.register(os._exit, 0)",
    "thread calls os._exit(0)*": "import os, threading\nthreading.Thread(target=os._exit, args=(0,)).start()\n"
    "import time\ntime.sleep(5)",
    "kill the parent, then exit 0*": "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\n"
    "os._exit(0)",
    "kill the parent": "import os\nos.kill(os.getppid(), 9)",
    "kill itself": "import os\nos.kill(os.getpid(), 9)",
    "kill its process group": "import os\nos.killpg(0, 9)",
    "SIGTERM to itself with SIG_DFL": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
}
TAMPERING = {
    "AssertionError rebound in the module": "AssertionError = type('X', (Exception,), {})",
    "builtins.AssertionError replaced": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})",
    "print / __import__ / exec / compile patched": "import builtins, os\nbuiltins.print = lambda *a, **k: None\n"
    "builtins.__import__ = lambda *a, **k: None\nbuiltins.exec = lambda *a, **k: None\n"
    "builtins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\nos.write = lambda fd, b: len(b)",
    "excepthook swallows errors*": "import os, sys\nsys.excepthook = lambda *a: None\n"
    "sys.stderr = open(os.devnull, 'w')\nimport atexit\natexit.register(os._exit, 0)",
    "stdout / stderr closed, then exit 0*": "import os\nos.close(1)\nos.close(2)\nos._exit(0)",
    "guessed tokens printed and written to every fd*": "import os, secrets\nfor _ in range(50):\n"
    "    t = secrets.token_hex(16)\n    print(t, flush=True)\n    for fd in range(3, 64):\n        try:\n"
    "            os.write(fd, t.encode())\n        except OSError:\n            pass\nos._exit(0)",
}


@pytest.mark.parametrize("table", ["early_exits", "tampering"])
def test_early_exits_and_tampering_do_not_pass(table, limits):
    cases = EARLY_EXITS if table == "early_exits" else TAMPERING
    with ThreadPoolExecutor(4) as pool:
        results = pool.map(lambda tail: score_code(WRONG + tail, TESTS, (), limits), cases.values())
        scores = dict(zip(cases, results, strict=True))
    passed = {name: (s.status, s.sandbox.returncode) for name, s in scores.items() if s.correct}
    assert not passed, f"hostile samples passed: {passed}"
    for name, s in scores.items():
        assert s.status in ("failed", "timeout") and s.sandbox.checks_completed is False, (name, s)
        if s.sandbox.returncode == 0:  # the harness says why a clean exit is a failure
            assert "no completion token" in s.detail, (name, s.detail)


def test_scanning_for_the_token_finds_nothing(limits, monkeypatch):
    # The sample looks everywhere it could (argv, env, cmdline, environ, every open fd, files in cwd and the
    # private dirs, /proc of every visible process) and replays every 32-hex string it finds; the test fixes the
    # token so it can check none of those places held it.
    known = "5ca1ab1e" * 4
    monkeypatch.setattr(sandbox, "secrets", type("S", (), {"token_hex": staticmethod(lambda n: known)}))
    scan = r"""
import os, re, sys
found = set()
def grab(data):
    found.update(m.decode() for m in re.findall(rb"[0-9a-f]{32}", data))
grab(" ".join(sys.argv).encode()); grab(repr(dict(os.environ)).encode())
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
    for leaf in ("cmdline", "environ"):
        try:
            grab(open(f"/proc/{pid}/{leaf}", "rb").read())
        except OSError:
            pass
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            with open(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                grab(f.read(1 << 20))
        except OSError:
            pass
for d in (".", "/tmp", "/var/tmp", "/dev/shm"):
    for root, _, files in os.walk(d):
        for n in files:
            try:
                grab(open(os.path.join(root, n), "rb").read(1 << 20))
            except OSError:
                pass
print(sorted(found), flush=True)
for t in found:
    for fd in range(3, 64):
        try:
            os.write(fd, t.encode())
        except OSError:
            pass
os._exit(0)
"""
    s = score_code(WRONG + scan, TESTS, (), limits)
    assert not s.correct and s.sandbox.checks_completed is False, s
    assert known not in s.sandbox.stdout, "the sample found the completion token"
    assert s.sandbox.stdout.startswith("["), s.sandbox  # the scan itself ran to the end


def test_correct_solutions_that_rebind_builtins_still_pass(limits):
    right = "def f(x):\n    return x + 1\n"
    tails = (
        "AssertionError = ValueError\nprint = lambda *a, **k: None\nmax = min",
        "import builtins\nbuiltins.print = lambda *a, **k: None",
        "if __name__ == '__main__':\n    print(f(1))",
        "import sys\nsys.stdout = open('/dev/null', 'w')\nprint('hidden')",
        "import atexit\natexit.register(print, 'bye')",
        "import threading\nthreading.Thread(target=print, args=('thread',)).start()",
    )
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda tail: score_code(right + tail, TESTS, (), limits), tails))
    for tail, s in zip(tails, scores, strict=True):
        assert s.correct and s.sandbox.checks_completed, (tail, s)
