"""Nothing to read (issue 22, item 2) on both backends, and fail closed (item 4) through the evaluator's driver.

The sample's root holds only the interpreter (read-only), its own fresh tmpfs ``/tmp`` and ``/dev/shm``, the
``/dev/null``-like devices and a ``/proc`` of its own PID namespace: the project, the data, HOME, other users'
files, ``/etc`` and ``/sys`` do not exist there; nothing it writes survives it; every file it can see belongs to
the interpreter. The driver refuses MBPP scoring up front when a guarantee is missing, unless
``allow_weak_sandbox``, and then every code row records what it lacked.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for

from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import SandboxLimits, core, host, isolation_support, run_python

REPO = Path(__file__).resolve().parents[1]
LISTING = """
import json, os
seen = []
for root, dirs, files in os.walk("/"):
    if root.startswith("/proc"):
        dirs[:] = []
        continue
    for n in files:
        seen.append(os.path.join(root, n))
print(json.dumps({"top": sorted(os.listdir("/")), "files": seen, "uid": os.getuid(), "cwd": os.getcwd(),
                  "dev": sorted(os.listdir("/dev")), "procs": sorted(p for p in os.listdir("/proc") if p.isdigit()),
                  "tmp": sorted(os.listdir("/tmp"))}))
"""


@pytest.fixture(scope="module", params=SANDBOX_BACKENDS)
def limits(request):
    return sandbox_limits_for(request.param, timeout_s=20.0)


def test_the_root_holds_only_the_interpreter(limits):
    r = run_python(LISTING, replace(limits, output_bytes=1 << 20))
    assert r.passed, r
    got = json.loads(r.stdout)
    interp = host.interpreter_files(limits.python)
    allowed = {op[-1] for op in interp.ops}
    stray = [f for f in got["files"] if not f.startswith(("/tmp/", "/dev/"))
             and not any(f == a or f.startswith(a.rstrip("/") + "/") for a in allowed)]  # fmt: skip
    assert not stray, stray[:10]
    assert set(got["top"]) <= {"usr", "lib", "lib64", "bin", "tmp", "dev", "proc"}, got["top"]
    assert not any(str(REPO) in f or "/work" in f or "/root" in f or "/home" in f for f in got["files"])
    assert got["cwd"] == "/tmp" and got["tmp"] == ["main.py"] and got["procs"] == ["1", "2"], got
    assert {"null", "zero", "urandom"} <= set(got["dev"]), got["dev"]
    assert got["uid"] != 0


def test_the_root_is_read_only_and_tmp_is_fresh_per_sample(limits):
    code = """
import os
bad = []
for p in ("/usr/x", "/x", "/dev/x", "/proc/x"):
    try:
        open(p, "w").write("x")
        bad.append(p)
    except OSError:
        pass
assert not bad, bad
assert os.listdir("/tmp") == ["main.py"] and os.listdir("/dev/shm") == [], os.listdir("/tmp")
open("/tmp/left", "w").write("x")
open("/dev/shm/left", "w").write("x")
"""
    for _ in range(2):  # the second run must not see the first one's files
        r = run_python(code, limits)
        assert r.passed, r.stderr


def test_tmpfs_is_size_capped(limits):
    r = run_python("open('/tmp/big', 'wb').write(b'x' * (8 << 20))\n", replace(limits, tmpfs_bytes=4 << 20))
    assert r.status == "failed" and "No space left" in r.stderr, r


def test_the_interpreter_file_list_follows_symlinks():
    interp = host.interpreter_files("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else core.sys.executable)
    binds = [op[1] for op in interp.ops if op[0] == "bind"]
    assert interp.exe in binds and interp.stdlib in binds
    assert all(os.path.realpath(b) == b for b in binds)  # real paths only; symlinks are recreated as symlinks
    assert all(op[0] in ("bind", "symlink") for op in interp.ops)


# ------------------------------------------------------------------------------------------ fail closed
WEAK = {"works": True, "backend": "none", "mechanism": "rlimit-nofork", "missing": ["filesystem", "network"],
        "level": "weak: filesystem,network", "notes": ["unshare(CLONE_NEWUSER): No space left on device (errno 28)"],
        "refusal": "sandbox: refusing to score code: missing filesystem, network (CLONE_NEWUSER ...)"}  # fmt: skip


def _cfg(allow: bool):
    return SimpleNamespace(code_timeout_s=30.0, code_cpu_s=11, allow_weak_sandbox=allow)


def test_the_driver_refuses_up_front_unless_weak_is_allowed(monkeypatch, caplog):
    from tdlm.evaluation import driver

    mbpp = [SimpleNamespace(task=SimpleNamespace(name="mbpp"))]
    gsm = [SimpleNamespace(task=SimpleNamespace(name="gsm8k"))]
    monkeypatch.setattr(core, "isolation_support", lambda limits: WEAK)
    monkeypatch.setattr(core, "_required", {})
    assert driver.check_sandbox(_cfg(False), gsm) is None  # no code task: no probe
    with pytest.raises(TDLMError, match="refusing to score code: missing filesystem, network") as e:
        driver.check_sandbox(_cfg(False), mbpp)
    assert "\n" not in str(e.value)
    with caplog.at_level(logging.WARNING, logger="tdlm.evaluation"):
        assert driver.check_sandbox(_cfg(True), mbpp) is WEAK
    assert any("weakened" in r.getMessage() and "CLONE_NEWUSER" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    support = driver.check_sandbox(_cfg(False), mbpp)  # this machine, for real: root, everything granted
    assert support["level"].startswith("full;") and support["refusal"] == ""


def test_the_scorer_fails_closed_and_weak_rows_record_it(monkeypatch):
    from tdlm.evaluation import driver
    from tdlm.evaluation.scoring import Scorer
    from tdlm.tasks.base import Problem

    prob = Problem(task="mbpp", id="mbpp/x", index=0, prompt="", answer="", tests=("assert f() == 1",),
                   test_imports=(), raw={})  # fmt: skip
    monkeypatch.setattr(core, "isolation_support", lambda limits: WEAK)
    monkeypatch.setattr(core, "_required", {})
    with Scorer(1) as scorer, pytest.raises(TDLMError, match="refusing to score code"):
        scorer.score(prob, "def f():\n    return 1\n")
    # allowed: the row records the guarantees this sample did not get (a forced weak run: no cgroup -> still
    # full here, so check the plumbing with a result that lacks them)
    with Scorer(1, allow_weak_sandbox=True) as scorer:
        s = scorer.score(prob, "def f():\n    return 1\n")
    assert s.correct
    weak_score = SimpleNamespace(extracted="", correct=True, status="passed", detail="",
                                 weakened=("filesystem", "network"))  # fmt: skip
    row = driver._sample({"id": "mbpp/x", "index": 0, "prompt": "", "generation": "", "nfe": 1, "seconds": 0.1},
                         {"extracted": weak_score.extracted, "correct": True, "status": "passed", "score_detail": "",
                          "sandbox_weakened": list(weak_score.weakened)})  # fmt: skip
    assert row["sandbox_weakened"] == ["filesystem", "network"]
    full = driver._sample({"id": "mbpp/x", "index": 0, "prompt": "", "generation": "", "nfe": 1, "seconds": 0.1},
                          {"extracted": "", "correct": True, "status": "passed", "sandbox_weakened": []})  # fmt: skip
    assert "sandbox_weakened" not in full


def test_an_explicit_backend_that_is_not_installed_is_refused_never_replaced(monkeypatch):
    """Asking for bubblewrap where it is not installed is one line naming it, whatever allow_weak says; the
    in-house namespaces are never substituted silently (issue 31), and ``auto`` still works."""
    from tdlm.evaluation.sandbox import backend_unavailable, require_sandbox

    monkeypatch.setattr(core, "_bwrap_path", lambda: None)
    monkeypatch.setattr(core, "_required", {})
    monkeypatch.setattr(core, "_plans", {})
    lim = SandboxLimits(backend="bwrap", timeout_s=20.0)
    assert "apt-get install bubblewrap" in backend_unavailable("bwrap") and backend_unavailable("auto") is None
    support = isolation_support(lim)
    assert not support["works"] and support["backend"] == "bwrap" and support["mechanism"] == "none", support
    assert "\n" not in support["refusal"] and "'bwrap'" in support["refusal"], support["refusal"]
    for allow in (False, True):
        with pytest.raises(TDLMError, match="bwrap is not installed"):
            require_sandbox(lim, allow_weak=allow)
    with pytest.raises(TDLMError, match="SandboxLimits.backend is 'bwrap'"):
        run_python("print(1)\n", lim)
    auto = SandboxLimits(backend="auto", timeout_s=20.0)
    assert isolation_support(auto)["backend"] == "inhouse" and run_python("print(1)\n", auto).passed
