"""The code sandbox (tdlm.evaluation.sandbox): exit statuses, timeouts that kill the whole group, rlimits,
network, caps."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from tdlm.errors import TDLMError
from tdlm.evaluation import sandbox
from tdlm.evaluation.sandbox import SandboxLimits, isolation_support, run_python

FAST = SandboxLimits(timeout_s=3.0)


@pytest.fixture(scope="module")
def support():
    return isolation_support()


def _procs_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (works across PID namespaces)."""
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(p))
            except OSError:
                pass
    return found


def _wait_gone(marker: str, within_s: float = 3.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := _procs_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_pass_fail_and_output(support):
    assert support["works"]
    r = run_python("print('hello')\nimport sys; print('oops', file=sys.stderr)", FAST)
    assert (r.status, r.passed, r.returncode) == ("passed", True, 0)
    assert r.stdout == "hello\n" and r.stderr == "oops\n" and r.seconds > 0
    r = run_python("assert 1 + 1 == 3", FAST)
    assert (r.status, r.passed, r.returncode) == ("failed", False, 1)
    assert "AssertionError" in r.stderr
    r = run_python("def f(:\n  pass", FAST)
    assert r.status == "failed" and "SyntaxError" in r.stderr
    r = run_python("import sys; sys.exit(3)", FAST)
    assert (r.status, r.returncode) == ("failed", 3)


def test_isolated_interpreter_and_fresh_cwd():
    r = run_python(
        "import os, sys\nprint(sys.flags.isolated, sys.flags.dont_write_bytecode)\nprint(os.getcwd())\n"
        "print(sorted(os.listdir('.')))",
        FAST,
    )
    flags, cwd, listing = r.stdout.splitlines()
    assert flags == "1 1" and listing == "['main.py']"
    if r.filesystem_isolated:
        assert cwd == "/tmp"  # the private /tmp, a tmpfs of its own
    else:
        assert not os.path.exists(cwd)  # the temp dir is gone afterwards


def test_env_is_not_inherited(monkeypatch):
    monkeypatch.setenv("SECRET_TDLM_TEST", "leak")
    r = run_python("import os; print(os.environ.get('SECRET_TDLM_TEST'))", FAST)
    assert r.stdout.strip() == "None"


def test_stdin_is_empty():
    r = run_python("input()", FAST)
    assert r.status == "failed" and "EOFError" in r.stderr and r.seconds < 3


def test_timeout_kills_the_whole_group(support):
    marker = f"tdlm-sleeper-{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
if os.fork() == 0:  # a grandchild that leaves the process group; only a PID namespace catches it
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}-setsid"])
time.sleep(0.3)
print("spawned", flush=True)
while True:
    pass
"""
    t0 = time.monotonic()
    r = run_python(code, replace(FAST, timeout_s=2.0))
    assert r.status == "timeout" and not r.passed
    assert 2.0 <= r.seconds < 4 and time.monotonic() - t0 < 5
    assert r.stdout == "spawned\n"  # the grandchildren did start
    assert not _wait_gone(marker + "\x00"), "a child in the sample's process group survived"
    left = _wait_gone(marker + "-setsid")
    if support["pid_isolated"]:
        assert not left, "a setsid grandchild survived although the PID namespace was reported"
    else:
        for pid in left:  # documented limitation without a PID namespace; clean up our own leftovers
            os.kill(pid, 9)


def test_group_is_killed_after_normal_exit_too():
    marker = f"tdlm-bg-{uuid.uuid4().hex}"
    code = (
        f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])"
    )
    r = run_python(code, FAST)
    assert r.status == "passed"
    assert not _wait_gone(marker)


def test_cpu_limit_counts_as_timeout():
    r = run_python("while True:\n    pass", replace(FAST, timeout_s=10.0, cpu_s=1))
    assert r.status == "timeout" and r.seconds < 6


def test_memory_bomb_fails_without_harming_us():
    r = run_python("x = bytearray(4 << 30)", FAST)  # default 1 GiB address-space cap
    assert r.status == "failed" and "MemoryError" in r.stderr, r
    # a growing bomb; a smaller cap keeps the zero-filling short on a loaded machine
    r = run_python("xs = []\nwhile True:\n    xs.append(bytearray(16 << 20))", replace(FAST, memory_bytes=256 << 20))
    assert r.status == "failed" and "MemoryError" in r.stderr, r
    big = bytearray(64 << 20)  # the test process itself is unaffected
    assert len(big) == 64 << 20


def test_huge_file_fails_fast():
    code = "with open('big.bin', 'wb') as f:\n    while True:\n        f.write(b'0' * (1 << 20))"
    r = run_python(code, replace(FAST, file_size_bytes=8 << 20))
    assert r.status == "failed" and r.seconds < 3
    assert "File too large" in r.stderr or r.returncode == -25  # EFBIG, or SIGXFSZ outside a PID namespace


def test_output_is_capped():
    r = run_python("import sys\nprint('a' * 1_000_000)\nsys.stderr.write('b' * 50_000)", FAST)
    assert r.status == "passed"
    assert r.stdout.startswith("a" * 10_000) and "truncated: 1000001 bytes total" in r.stdout
    assert len(r.stdout) < 10_100 and len(r.stderr) < 10_100
    r = run_python("print('x' * 100)", replace(FAST, output_bytes=10))
    assert r.stdout.startswith("xxxxxxxxxx\n[... truncated")


def test_no_network_when_isolated(support):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\nprint('connected')"
    try:
        # control: without the namespace the same code reaches our port, so the check below can fail
        open_run = run_python(code, replace(FAST, isolate_network=False))
        assert open_run.status == "passed" and not open_run.network_isolated
        if not support["network_isolated"]:
            pytest.skip("no network namespace on this machine (recorded as network_isolated=False)")
        r = run_python(code, FAST)
        assert r.network_isolated and r.status == "failed" and "connected" not in r.stdout
        assert "OSError" in r.stderr or "Error" in r.stderr
    finally:
        server.close()


def test_runs_as_nobody_when_the_interpreter_allows():
    if os.geteuid() != 0:
        pytest.skip("privilege drop only applies to root")
    candidates = [sys.executable] + [p for p in (shutil.which("python3"), "/usr/bin/python3") if p]
    python = next((p for p in candidates if sandbox._can_drop_to_nobody(p)), None)
    if python is None:
        pytest.skip("no interpreter here runs identically as nobody")
    code = "import os\nprint(os.getuid(), os.getgid())\nopen('/root/tdlm-sandbox-probe', 'w')"
    r = run_python(code, replace(FAST, python=python))
    assert r.privileges_dropped and r.stdout.startswith("65534 65534")
    assert r.status == "failed" and "PermissionError" in r.stderr
    assert not os.path.exists("/root/tdlm-sandbox-probe")


def test_venv_interpreter_that_breaks_as_nobody_stays_root_and_records_it():
    if os.geteuid() != 0:
        pytest.skip("privilege drop only applies to root")
    r = run_python("pass", replace(FAST, python=sys.executable))
    assert r.privileges_dropped == sandbox._can_drop_to_nobody(sys.executable)


def test_default_interpreter_prefers_one_that_drops_privileges():
    if os.geteuid() != 0:
        pytest.skip("privilege drop only applies to root")
    python = SandboxLimits().python
    system = [p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)]
    if sandbox._can_drop_to_nobody(sys.executable) or any(sandbox._can_drop_to_nobody(p) for p in system):
        assert sandbox._can_drop_to_nobody(python)
        assert run_python("pass", SandboxLimits(timeout_s=30)).privileges_dropped
    else:
        assert python == sys.executable


def test_bad_interpreter_is_an_error_not_a_failure():
    r = run_python("print(1)", replace(FAST, python="/nonexistent/python"))
    assert r.status == "error" and "cannot start" in r.stderr


def test_concurrent_runs_from_threads():
    codes = [f"import time\ntime.sleep(0.2)\nprint({i})" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda c: run_python(c, FAST), codes))
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(6)]
    assert all(r.passed for r in results)


def test_limits_are_validated():
    bad = ({"timeout_s": 0}, {"memory_bytes": 0}, {"cpu_s": -1}, {"max_processes": -2}, {"output_bytes": 0},
           {"tmpfs_bytes": 0}, {"tmpfs_inodes": -1})  # fmt: skip
    for kw in bad:
        with pytest.raises(TDLMError, match="SandboxLimits"):
            SandboxLimits(**kw)


def test_checks_run_in_order_in_the_program_namespace():
    code = "import sys\nlog = []\ndef f(x):\n    log.append(x)\n    return x + 1\nprint(__name__, sys.argv)"
    checks = ["assert f(1) == 2", "assert log == [1]\nassert f(2) == 3", "print('log', log)"]
    r = run_python(code, FAST, checks=checks)
    assert (r.status, r.returncode, r.checks_completed) == ("passed", 0, True), r
    assert r.stdout == "__main__ ['main.py']\nlog [1, 2]\n"
    r = run_python(code, FAST, checks=["assert f(1) == 2", "assert f(2) == 4", "print('not reached')"])
    assert (r.status, r.returncode, r.checks_completed) == ("failed", 1, False)
    assert "not reached" not in r.stdout and r.stderr.strip().endswith("AssertionError")
    assert '"<test 2>", line 1' in r.stderr  # the failing assert is named in the traceback
    r = run_python("def f(:\n  pass", FAST, checks=["assert True"])
    assert r.status == "failed" and "SyntaxError" in r.stderr
    # a check is a statement of its own: the program text cannot swallow it (unterminated string, open block)
    r = run_python("x = '''", FAST, checks=["assert False"])
    assert r.status == "failed" and "SyntaxError" in r.stderr
    r = run_python("if False:", FAST, checks=["    pass"])
    assert r.status == "failed"
    with pytest.raises(TDLMError, match="checks"):
        run_python("pass", FAST, checks=[])
    r = run_python("pass", FAST)
    assert r.passed and r.checks_completed is None  # without checks: exit status 0 is the pass, as before

