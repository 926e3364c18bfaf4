"""The sandbox fails closed for every caller (issue items 1 and 7), not only in :class:`Scorer`.

Each entry point that scores MBPP code - :class:`tdlm.evaluation.scoring.Scorer`,
:func:`~tdlm.evaluation.scoring.score`, :func:`~tdlm.evaluation.scoring.score_code` and the lm-evaluation-harness
task's ``process_results`` - is tried with a hostile sample in the settings where the sandbox lacks a guarantee:

- **refused**: user namespaces refused, the evaluator unprivileged (uid 54321 in an outer user namespace whose
  ``max_user_namespaces`` is 0, the system ``python3``; as in tests/test_sandbox_settings.py). The hostile sample
  reads the evaluator's environment through ``/proc``, a 0600 file in its HOME, a listener on 127.0.0.1, and writes
  into its output folder. Every entry point must raise the one-line refusal and run nothing: the listener sees no
  connection, the folder stays empty, the sample never reaches the runner. Control in the same setting: with
  ``allow_weak_sandbox`` asked for explicitly, an honest sample passes and the hostile one does read and write
  everything (so the detectors see a breach when there is one);
- **no-seccomp**: ``pyseccomp`` missing (``host.seccomp_program`` raises the ImportError it raises then) and no
  cgroup; the hostile sample forks and makes a user namespace. Refused on both backends; control: the same
  limits with seccomp run the honest sample (passes) and contain the hostile one, and weak mode, asked for, shows
  the attack works without the filter.

Also: a run that loses a guarantee after the one-time probe (its ``/tmp`` tmpfs cannot be mounted, so the in-house
root cannot be built / bubblewrap would get no inode limit) never runs the sample and is an error with one line,
never a pass; the sample's ``/dev`` holds no pty (``os.openpty``, ``/dev/ptmx``, ``/dev/tty`` fail); as root the
in-house sample has an empty capability bounding set, and a launcher that cannot empty it refuses to run anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for

from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import SandboxLimits, backend_unavailable, core, host, require_sandbox, run_python
from tdlm.evaluation.scoring import Scorer, score, score_code
from tdlm.tasks.base import Problem

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"
UID = 54321  # a uid nobody on this machine uses
MARK = "tdlm-fc-hostile"  # in every hostile sample: the spy on the runner looks for it
FAST = dict(timeout_s=20.0, cpu_s=5)

HONEST = "```python\ndef f(x):\n    return 2 * x\n```"
HONEST_REF = "def f(x):\n    return 2 * x\n"
HONEST_TESTS = ("assert f(3) == 6", "assert f(4) == 8")

# the refused setting: everything this sample reads or reaches ends up in f(); it also writes to the output folder
READER = """# tdlm-fc-hostile
import os, socket
def f():
    got = []
    for path in ("/proc/__EVALPID__/environ", "__HOME__/.netrc"):
        try:
            got.append(open(path, "rb").read().decode("latin-1"))
        except OSError as e:
            got.append(repr(e))
    try:
        s = socket.create_connection(("127.0.0.1", __PORT__), timeout=3)
        got.append(s.recv(64).decode())
    except OSError as e:
        got.append(repr(e))
    try:
        with open("__OUT__/samples.jsonl", "w") as out:
            out.write("written by a sample")
    except OSError as e:
        got.append(repr(e))
    return " ".join(got)
"""
READER_REF = "def f():\n    return ''\n"

# the no-seccomp setting: holds only if the sample forked without a cgroup or made a user namespace
FORKER = """# tdlm-fc-hostile
import ctypes, os
def f():
    got = []
    try:
        pid = os.fork()
    except OSError:
        pid = -1
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
        got.append("fork")
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0:
        got.append("user namespace")
    return got
"""
FORKER_TESTS = ("assert f()",)
FORKER_REF = "def f():\n    return []\n"


def problem(answer: str, tests: tuple[str, ...]) -> Problem:
    return Problem(task="mbpp", id="mbpp/fc", index=0, prompt="", answer=answer, tests=tests)


def doc(answer: str, tests: tuple[str, ...]) -> dict:
    return {"task": "mbpp", "id": "mbpp/fc", "index": 0, "prompt": "", "answer": answer, "tests": list(tests),
            "test_imports": []}  # fmt: skip


def entry_points(limits: SandboxLimits | None, allow_weak: bool = False) -> dict:
    """name -> callable(completion, reference, tests) -> correct, for every path that scores code. The harness task
    takes no limits (it scores with the defaults) and has no weak mode."""
    from tdlm.harness.tasks.utils import process_results

    def with_scorer(c, ref, tests):
        with Scorer(1, sandbox=limits, allow_weak_sandbox=allow_weak) as scorer:
            return scorer.score(problem(ref, tests), c).correct

    out = {
        "score_code": lambda c, ref, tests: score_code(c, tests, limits=limits, reference=ref,
                                                       allow_weak_sandbox=allow_weak).correct,
        "score": lambda c, ref, tests: score(problem(ref, tests), c, limits=limits,
                                             allow_weak_sandbox=allow_weak).correct,
        "Scorer.score": with_scorer,
    }  # fmt: skip
    if not allow_weak:
        out["process_results"] = lambda c, ref, tests: process_results(doc(ref, tests), [c])["acc"] == 1.0
    return out


@pytest.fixture
def spy(monkeypatch):
    """Records every program that reaches the runner (core._execute); the probes run ``pass``."""
    ran: list[str] = []
    real = core._execute

    def spying(code, *a, **k):
        ran.append(code)
        return real(code, *a, **k)

    monkeypatch.setattr(core, "_execute", spying)
    return ran


def hostile_ran(ran: list[str]) -> bool:
    return any(MARK in c for c in ran)


# ------------------------------------------------------------------------------------------ good setting (control)
@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_control_full_sandbox_scores_every_entry_point(backend, spy):
    """Here (root, every guarantee): each entry point runs the honest sample (passes) and the hostile one (runs,
    contained: fails). The harness task scores with the default limits (a cgroup: fork is allowed there), so it
    gets the honest sample only."""
    lim = sandbox_limits_for(backend, **FAST, use_cgroups=False)
    for name, run in entry_points(lim).items():
        if name == "process_results" and backend != SANDBOX_BACKENDS[0]:
            continue  # default limits: once is enough
        assert run(HONEST, HONEST_REF, HONEST_TESTS) is True, name
        if name == "process_results":
            continue
        n = len(spy)
        assert run(FORKER, FORKER_REF, FORKER_TESTS) is False, name
        assert hostile_ran(spy[n:]), name  # it did run, and was contained (no fork, no user namespace)


# ------------------------------------------------------------------------------------------ no seccomp
@pytest.fixture
def no_seccomp(monkeypatch):
    """pyseccomp missing: what ``host.seccomp_program`` raises then; fresh probes, restored afterwards."""

    def missing(nofork):
        raise ImportError("No module named 'pyseccomp'")

    monkeypatch.setattr(host, "seccomp_program", missing)
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_required", {})


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_no_seccomp_every_entry_point_refuses_and_runs_nothing(backend, no_seccomp, spy):
    if why := backend_unavailable(backend):
        pytest.skip(f"sandbox backend {backend!r}: {why}")
    lim = SandboxLimits(backend=backend, use_cgroups=False, **FAST)
    for name, run in entry_points(lim).items():
        with pytest.raises(TDLMError) as e:
            run(FORKER, FORKER_REF, FORKER_TESTS)
        msg = str(e.value)
        assert "\n" not in msg and "refusing to score code" in msg and "seccomp" in msg, (name, msg)
        assert "pyseccomp" in msg, (name, msg)
        with pytest.raises(TDLMError, match="refusing to score code"):
            run(HONEST, HONEST_REF, HONEST_TESTS)
    with pytest.raises(TDLMError, match="seccomp"):
        run_python(FORKER, lim, checks=list(FORKER_TESTS))
    assert not hostile_ran(spy), "a hostile sample reached the runner without seccomp"
    # control, same setting: weak mode asked for explicitly runs both, and the attack works without the filter
    for name, run in entry_points(lim, allow_weak=True).items():
        assert run(HONEST, HONEST_REF, HONEST_TESTS) is True, name
        assert run(FORKER, FORKER_REF, FORKER_TESTS) is True, name  # forked (and, in-house, a user namespace)
    r = run_python(FORKER, lim, checks=list(FORKER_TESTS), allow_weak=True)
    assert {"seccomp", "limits"} <= set(r.weakened), r.weakened


# ------------------------------------------------------------------------------------------ refused namespaces
RUNNER = r'''
import json, os, socket, sys, threading, types
repo, spec_path = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # pyseccomp.py is next to it
# the system python has no torch / lm_eval / datasets: skip the packages' heavy __init__ and stub the two modules the
# harness task imports for other things (its dataset loader, the NFE table)
for name, sub in (("tdlm", "tdlm"), ("tdlm.evaluation", "tdlm/evaluation"), ("tdlm.harness", "tdlm/harness")):
    m = types.ModuleType(name)
    m.__path__ = [os.path.join(repo, sub)]
    sys.modules[name] = m
sys.modules["datasets"] = types.ModuleType("datasets")
model = types.ModuleType("tdlm.harness.model")
model.NFE_BY_DOC = {}
sys.modules["tdlm.harness.model"] = model
from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import SandboxLimits, backend_unavailable, core
from tdlm.evaluation.scoring import Scorer, score, score_code
from tdlm.harness.tasks.utils import process_results
from tdlm.tasks.base import Problem

spec = json.load(open(spec_path))
hits = []
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(16)

def serve():
    while True:
        c, _ = srv.accept()
        hits.append(1)
        c.sendall(spec["secret"].encode())
        c.close()

threading.Thread(target=serve, daemon=True).start()
reader = spec["reader"].replace("__EVALPID__", str(os.getpid())).replace("__PORT__", str(srv.getsockname()[1]))
ran = []
real = core._execute

def spying(code, *a, **k):
    ran.append(spec["mark"] in code)
    return real(code, *a, **k)

core._execute = spying
tests = (f"assert f().count({spec['secret']!r}) > 0",)  # `in` on the value is refused at load: count reads it whole
prob = lambda code, ref, t: Problem(task="mbpp", id="mbpp/fc", index=0, prompt="", answer=ref, tests=t)
doc = lambda ref, t: {"task": "mbpp", "id": "mbpp/fc", "index": 0, "prompt": "", "answer": ref, "tests": list(t),
                      "test_imports": []}

def entries(lim, weak):
    def scorer(c, ref, t):
        with Scorer(1, sandbox=lim, allow_weak_sandbox=weak) as s:
            return s.score(prob(c, ref, t), c).correct
    out = {"score_code": lambda c, ref, t: score_code(c, t, limits=lim, reference=ref, allow_weak_sandbox=weak).correct,
           "score": lambda c, ref, t: score(prob(c, ref, t), c, limits=lim, allow_weak_sandbox=weak).correct,
           "Scorer.score": scorer}
    if not weak:
        out["process_results"] = lambda c, ref, t: process_results(doc(ref, t), [c])["acc"] == 1.0
    return out

out = {"uid": os.getuid(), "strict": {}, "weak": {}}
for backend in spec["backends"]:
    lim = SandboxLimits(backend=backend, timeout_s=20.0, cpu_s=5)
    for name, run in entries(lim, False).items():
        if name == "process_results" and backend != "auto":
            continue
        try:
            res = {"correct": run(reader, spec["reader_ref"], tests), "raised": None}
        except TDLMError as e:
            res = {"correct": None, "raised": str(e)}
        out["strict"][f"{name}/{backend}"] = res
out["strict_hits"], out["strict_ran"] = len(hits), sum(ran)
out["strict_files"] = sorted(os.listdir(spec["out"]))
# control: weak mode asked for explicitly - the setting does run code, and the hostile sample does leak
for name, run in entries(SandboxLimits(backend="auto", timeout_s=20.0, cpu_s=5), True).items():
    out["weak"][name] = {"honest": run(spec["honest"], spec["honest_ref"], tuple(spec["honest_tests"])),
                         "hostile": run(reader, spec["reader_ref"], tests)}
out["weak_hits"], out["weak_ran"] = len(hits), sum(ran)
out["weak_files"] = sorted(os.listdir(spec["out"]))
print(json.dumps(out))
'''

USERNS_WRAP = r'''
import ctypes, os, sys
# uid 0..65535 of the host mapped 1:1 into a new user namespace, whose max_user_namespaces is then set to 0
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    os.close(r2)
    if libc.unshare(0x10000000) != 0:
        os._exit(99)
    os.write(w2, b"x")
    os.read(r, 1)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.execvp(sys.argv[1], sys.argv[1:])
os.close(r)
os.close(w2)
os.read(r2, 1)
for m in ("uid_map", "gid_map"):
    with open(f"/proc/{pid}/{m}", "w") as f:
        f.write("0 0 65536")
os.write(w, b"x")
_, st = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(st))
'''


@pytest.fixture(scope="module")
def refused():
    """Runs every entry point as an unprivileged evaluator where user namespaces are refused; returns its report."""
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to simulate refused user namespaces")
    origin = importlib.util.find_spec("pyseccomp")
    if origin is None or not origin.origin:
        pytest.skip("pyseccomp is not installed")
    secret = "s" + os.urandom(8).hex()
    d = tempfile.mkdtemp(prefix="tdlm-fc-", dir="/var/tmp")
    os.chmod(d, 0o755)
    home, out = os.path.join(d, "home"), os.path.join(d, "evals")
    for p in (home, out):
        os.mkdir(p, 0o700)
        os.chown(p, UID, UID)
    netrc = os.path.join(home, ".netrc")
    Path(netrc).write_text(f"machine api.wandb.ai password {secret}\n")
    os.chmod(netrc, 0o600)
    os.chown(netrc, UID, UID)
    shutil.copy(origin.origin, os.path.join(d, "pyseccomp.py"))
    Path(d, "runner.py").write_text(RUNNER)
    Path(d, "userns_wrap.py").write_text(USERNS_WRAP)
    backends = ["auto"] + [b for b in SANDBOX_BACKENDS if not backend_unavailable(b)]
    spec = {"secret": secret, "out": out, "mark": MARK, "backends": backends, "reader_ref": READER_REF,
            "reader": READER.replace("__HOME__", home).replace("__OUT__", out), "honest": HONEST,
            "honest_ref": HONEST_REF, "honest_tests": list(HONEST_TESTS)}  # fmt: skip
    Path(d, "spec.json").write_text(json.dumps(spec))
    for n in ("pyseccomp.py", "runner.py", "userns_wrap.py", "spec.json"):
        os.chmod(os.path.join(d, n), 0o644)
    cmd = [sys.executable, os.path.join(d, "userns_wrap.py"), "setpriv", "--reuid", str(UID), "--regid", str(UID),
           "--clear-groups", "--", SYSTEM_PYTHON, "-I", os.path.join(d, "runner.py"), str(REPO),
           os.path.join(d, "spec.json")]  # fmt: skip
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "WANDB_API_KEY": secret,
           "HF_TOKEN": secret}  # fmt: skip
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd="/", env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        yield {"report": json.loads(res.stdout.strip().splitlines()[-1]), "secret": secret, "backends": backends}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_refused_every_entry_point_refuses_and_nothing_runs(refused):
    rep, secret = refused["report"], refused["secret"]
    assert rep["uid"] == UID
    names = {f"{n}/{b}" for n in ("score_code", "score", "Scorer.score") for b in refused["backends"]}
    assert set(rep["strict"]) == names | {"process_results/auto"}, rep["strict"]
    for name, res in rep["strict"].items():
        msg = res["raised"]
        assert msg is not None, (name, res)  # scored (even as wrong) means it ran
        assert "\n" not in msg and "refusing to score code" in msg and "CLONE_NEWUSER" in msg, (name, msg)
        assert secret not in msg
    # nothing ran: no program with the hostile mark reached the runner, no connection, no file in the output folder
    assert rep["strict_ran"] == 0 and rep["strict_hits"] == 0 and rep["strict_files"] == [], rep


def test_refused_control_weak_mode_runs_and_the_attack_is_real(refused):
    """Same setting, weak mode asked for explicitly: an honest sample passes (the setting runs code), and the same
    hostile sample reads the secret (environ, the 0600 file or the listener) and writes into the output folder."""
    rep = refused["report"]
    assert set(rep["weak"]) == {"score_code", "score", "Scorer.score"}, rep["weak"]
    for name, res in rep["weak"].items():
        assert res == {"honest": True, "hostile": True}, (name, res)
    assert rep["weak_ran"] == 3 and rep["weak_hits"] == 3 and rep["weak_files"] == ["samples.jsonl"], rep


# ------------------------------------------------------------------------------------------ weakened after the probe
@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_a_run_weakened_after_the_probe_never_runs_and_is_never_a_pass(backend):
    """The probe (cached per interpreter / backend / cgroup use) found every guarantee; this run's ``/tmp`` tmpfs
    cannot be mounted (an inode count the kernel rejects): the in-house root cannot be built (before: the sample
    ran in the host's working directory), bubblewrap would get no inode limit (before: scored, ``limits``
    weakened). Now the launcher stops before the sample and the row is an error with one line."""
    lim = sandbox_limits_for(backend, **FAST, use_cgroups=False)  # no cgroup: bwrap needs the launcher's tmpfs
    assert require_sandbox(lim)["level"].startswith("full;")
    broken = replace(lim, tmpfs_inodes=10**23)  # same probe key, a mount option the kernel refuses
    secret = "s" + os.urandom(8).hex()
    d = tempfile.mkdtemp(prefix="tdlm-fc-", dir="/var/tmp")  # world-readable, as files on a shared node are
    os.chmod(d, 0o755)
    leak = Path(d, "token")
    leak.write_text(secret)
    leak.chmod(0o644)
    try:
        _weakened_after_the_probe(backend, lim, broken, leak, secret)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _weakened_after_the_probe(backend, lim, broken, leak, secret):
    reader = (f"# {MARK}\ndef f():\n    try:\n        return open({str(leak)!r}).read()\n"
              "    except OSError:\n        return ''\n")
    probes = [
        ("reader", score_code(reader, (f"assert f() == {secret!r}",), limits=broken, reference=READER_REF)),
        ("honest", score_code(HONEST, HONEST_TESTS, limits=broken, reference=HONEST_REF)),
    ]
    with Scorer(1, sandbox=broken) as scorer:
        probes.append(("Scorer", scorer.score(problem(HONEST_REF, HONEST_TESTS), HONEST)))
    for name, s in probes:
        assert not s.correct and s.status == "error", (name, s)
        assert "\n" not in s.detail and "weakened after the probe" in s.detail, (name, s.detail)
        assert ("filesystem" if backend == "inhouse" else "limits") in s.detail, (name, s.detail)
        assert s.sandbox.stdout == "" and s.sandbox.checks_completed is False, (name, s.sandbox)
    # control: the same limits with an inode count the kernel takes
    assert score_code(HONEST, HONEST_TESTS, limits=lim, reference=HONEST_REF).correct


# ------------------------------------------------------------------------------------------ item 7: /dev, capabilities
PTY = f"""# {MARK}
import os
def f():
    got = []
    try:
        os.openpty()
        got.append("openpty")
    except OSError:
        pass
    for path in ("/dev/ptmx", "/dev/pts/ptmx", "/dev/tty", "/dev/console"):
        try:
            os.close(os.open(path, os.O_RDWR | os.O_NOCTTY))
            got.append(path)
        except OSError:
            pass
    try:
        os.mkdir("/dev/pts/x")
        got.append("/dev/pts writable")
    except OSError:
        pass
    return got
def devices():
    os.write(os.open("/dev/null", os.O_WRONLY), b"x")
    try:
        os.write(os.open("/dev/full", os.O_WRONLY), b"x")
        full = "wrote"
    except OSError as e:
        full = e.errno
    r = [len(open(p, "rb").read(16)) for p in ("/dev/zero", "/dev/urandom", "/dev/random")]
    return sorted(os.listdir("/dev")), full, r
"""


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_no_pty_in_the_samples_dev(backend):
    lim = sandbox_limits_for(backend, **FAST)
    r = run_python(PTY, lim, checks=["assert f()"], names={"f", "devices"})
    assert r.status == "failed" and r.checks == (False,) and r.checks_completed, r  # it ran: no pty anywhere
    # control: the five devices are there and work, nothing else is
    ok = run_python(PTY, lim, checks=["assert devices() == (['full', 'null', 'random', 'shm', 'urandom', 'zero'], "
                                      "28, [16, 16, 16])"], names={"f", "devices"})  # fmt: skip
    assert ok.passed, ok


CAPS = f"""# {MARK}
def caps():
    return {{l.split(":")[0]: l.split()[1] for l in open("/proc/self/status") if l.startswith("Cap")}}
print(caps())
"""
NO_CAPS = {k: "0000000000000000" for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_the_samples_capability_sets_are_empty_bounding_set_included(backend):
    lim = sandbox_limits_for(backend, **FAST)
    r = run_python(CAPS, lim, checks=[f"assert caps() == {NO_CAPS!r}"], names={"caps"})
    assert r.passed, (r.detail, r.stdout, r.stderr[-500:])
    assert r.privileges_dropped == (os.geteuid() == 0), r


def test_a_launcher_that_cannot_empty_the_bounding_set_runs_nothing(monkeypatch):
    """The verification is fail closed: with the drop disabled (a planted fault, in a copy of the launcher), the
    in-house run stops before the sample with one line. Control: the real launcher runs it."""
    if os.geteuid() != 0:
        pytest.skip("the in-house bounding-set drop is checked as root")
    lim = sandbox_limits_for("inhouse", **FAST)
    assert require_sandbox(lim)["level"].startswith("full;")  # probed with the real launcher
    drop = "if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:"
    assert core.LAUNCHER.count(drop) == 1
    monkeypatch.setattr(core, "LAUNCHER", core.LAUNCHER.replace(drop, "if False:"))
    r = run_python(CAPS, lim, checks=[f"assert caps() == {NO_CAPS!r}"], names={"caps"})
    assert r.status == "error" and not r.passed and "capabilities left" in r.detail and "\n" not in r.detail, r
    assert r.checks_completed is False and r.stdout == "", r
    monkeypatch.undo()
    assert run_python(CAPS, lim, checks=[f"assert caps() == {NO_CAPS!r}"], names={"caps"}).passed
