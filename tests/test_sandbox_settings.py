"""The hostile catalogue (tests/test_sandbox_hostile.py) in the settings this machine can reproduce besides root:

- **unprivileged with user namespaces**: the evaluator runs as a plain uid (``setpriv``), with the system
  ``python3``; bubblewrap and the in-house namespaces must both give every guarantee (limits: one process, no
  fork, since such a user cannot create cgroups here) and contain every sample;
- **refused user namespaces, as root**: the evaluator is uid 0 in an outer user namespace whose
  ``/proc/sys/user/max_user_namespaces`` is 0 (what many cluster nodes look like from a container): bubblewrap
  cannot start, the in-house namespaces still can, ``auto`` picks them, every sample is contained;
- **refused user namespaces, unprivileged**: no namespace can be made. Scoring refuses up front with one line
  naming what the kernel refused; with ``allow_weak`` each result records the weakened guarantees, and what does
  not depend on namespaces (the verdict, seccomp, the limits) still holds.

The evaluator side cannot import ``tdlm`` as a whole there (torch is in the root-only venv), so the runner loads
``tdlm.evaluation.sandbox`` alone (it imports only ``tdlm.errors``), with ``pyseccomp`` copied next to it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import SANDBOX_BACKENDS
from test_sandbox_hostile import CATALOGUE, HOSTILE, HostFixture, fill

from tdlm.evaluation.sandbox import backend_unavailable

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"
UID = 54321  # a uid nobody on this machine uses

RUNNER = r'''
import json, os, sys, types
repo, spec_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # pyseccomp.py is next to it (-I ignores PYTHONPATH)
for name, sub in (("tdlm", "tdlm"), ("tdlm.evaluation", "tdlm/evaluation")):  # skip the packages' heavy __init__
    m = types.ModuleType(name)
    m.__path__ = [os.path.join(repo, sub)]
    sys.modules[name] = m
from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import SandboxLimits, isolation_support, require_sandbox, run_python
spec = json.load(open(spec_path))
os.environ["TDLM_SBX_SECRET"] = spec["secret"]  # the evaluator's own environment holds a secret too
out = {"uid": os.getuid(), "backends": {}}
for backend in spec["backends"]:
    base = SandboxLimits(backend=backend)
    res = {"support": isolation_support(base)}
    try:
        require_sandbox(base, allow_weak=False)
        res["refusal"] = None
    except TDLMError as e:
        res["refusal"] = str(e)
    if res["refusal"] is None or mode == "weak":
        weak = mode == "weak"
        res["control"] = run_python("def f(x):\n    return 2 * x\n", base, checks=["assert f(3) == 6"],
                                    allow_weak=weak).passed
        res["samples"] = {}
        for e in spec["entries"]:
            lim = SandboxLimits(backend=backend, **{**spec["hostile"], **e.get("limits", {})})
            code = e["code"].replace("__EVALPID__", str(os.getpid()))
            if e.get("pre"):
                run_python(e["pre"], lim, allow_weak=weak)
            r = run_python(code, lim, checks=e["tests"], test_imports=e.get("test_imports", []), allow_weak=weak)
            res["samples"][e["name"]] = {"passed": r.passed, "status": r.status, "weakened": list(r.weakened),
                                         "mechanism": r.mechanism, "backend": r.backend, "detail": r.detail}
    out["backends"][backend] = res
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
def env():
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to simulate the other settings")
    origin = importlib.util.find_spec("pyseccomp")
    if origin is None or not origin.origin:
        pytest.skip("pyseccomp is not installed")
    host = HostFixture()
    d = tempfile.mkdtemp(prefix="tdlm-sbx-settings-", dir="/var/tmp")
    os.chmod(d, 0o755)
    shutil.copy(origin.origin, os.path.join(d, "pyseccomp.py"))
    Path(d, "runner.py").write_text(RUNNER)
    Path(d, "userns_wrap.py").write_text(USERNS_WRAP)
    ctx = {k: v for k, v in host.ctx().items() if k != "EVALPID"}
    entries = [{**e, "code": fill(e["code"], ctx), "pre": fill(e.get("pre", ""), ctx),
                "tests": [fill(t, ctx) for t in e["tests"]]} for e in CATALOGUE]  # fmt: skip
    for n in os.listdir(d):
        os.chmod(os.path.join(d, n), 0o644)
    yield {"dir": d, "host": host, "entries": entries}
    host.close()
    shutil.rmtree(d, ignore_errors=True)
    # the weak-mode run (no private /tmp, by design) leaves the state samples' files on the host: remove them
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        for name in ("tdlm-sbx-left", "blob0", "blob1", "blob2"):
            p = os.path.join(folder, name)
            if os.path.exists(p) and os.stat(p).st_uid == UID:
                os.remove(p)


def run_setting(env: dict, prefix: list[str], backends: list[str], mode: str = "strict") -> dict:
    spec = os.path.join(env["dir"], f"spec-{'-'.join(backends)}-{mode}.json")
    Path(spec).write_text(json.dumps({"secret": env["host"].secret, "backends": backends, "hostile": HOSTILE,
                                      "entries": env["entries"]}))  # fmt: skip
    os.chmod(spec, 0o644)
    cmd = [*prefix, SYSTEM_PYTHON, "-I", os.path.join(env["dir"], "runner.py"), str(REPO), spec, mode]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd="/",
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


SETPRIV = ["setpriv", "--reuid", str(UID), "--regid", str(UID), "--clear-groups"]


def assert_contained(res: dict, host: HostFixture) -> None:
    assert res["control"] is True, res
    breached = {k: v for k, v in res["samples"].items() if v["passed"]}
    assert not breached, breached
    assert all(host.secret not in v["detail"] for v in res["samples"].values())
    assert host.daemons() == []


def skip_if_not_installed(backend: str) -> None:
    if why := backend_unavailable(backend):
        pytest.skip(f"sandbox backend {backend!r}: {why}")


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_unprivileged_with_user_namespaces(env, backend):
    skip_if_not_installed(backend)
    out = run_setting(env, [*SETPRIV, "--"], [backend])
    assert out["uid"] == UID
    res = out["backends"][backend]
    assert res["support"]["level"].startswith("full;") and res["refusal"] is None, (backend, res["support"])
    assert res["support"]["mechanism"] == "rlimit-nofork", res["support"]  # no cgroup for this user here
    assert_contained(res, env["host"])
    assert {v["backend"] for v in res["samples"].values()} == {backend}


def test_refused_user_namespaces_as_root_bwrap_refuses(env):
    skip_if_not_installed("bwrap")
    out = run_setting(env, [sys.executable, os.path.join(env["dir"], "userns_wrap.py")], ["bwrap"])
    bw = out["backends"]["bwrap"]
    assert bw["refusal"] and "namespace" in bw["refusal"], bw["support"]  # bubblewrap needs a user namespace
    assert "samples" not in bw  # refused up front: nothing ran


def test_refused_user_namespaces_as_root_auto_uses_inhouse(env):
    out = run_setting(env, [sys.executable, os.path.join(env["dir"], "userns_wrap.py")], ["auto"])
    auto = out["backends"]["auto"]
    assert auto["support"]["backend"] == "inhouse" and auto["support"]["level"].startswith("full;"), auto["support"]
    assert_contained(auto, env["host"])


def test_refused_user_namespaces_unprivileged_fails_closed(env):
    prefix = [sys.executable, os.path.join(env["dir"], "userns_wrap.py"), *SETPRIV]
    out = run_setting(env, prefix, ["auto"], mode="weak")
    res = out["backends"]["auto"]
    refusal = res["refusal"]
    assert refusal and "\n" not in refusal, res
    assert "CLONE_NEWUSER" in refusal and "user.max_user_namespaces" in refusal, refusal
    assert "allow_weak_sandbox" in refusal and "filesystem" in refusal and "network" in refusal, refusal
    # weak mode, allowed explicitly: every row says what it lacked; the verdict, seccomp and limits still hold
    samples = res["samples"]
    assert res["control"] is True
    assert all({"filesystem", "network", "pid", "ipc"} <= set(v["weakened"]) for v in samples.values()), samples
    held = [e["name"] for e in CATALOGUE if e["cat"] in ("verdict", "limits")] + ["keyring", "unshare_setns_mount",
                                                                                   "ptrace_the_evaluator",
                                                                                   "nested_user_namespace",
                                                                                   "vsock_netlink_packet_sockets"]
    # without a private tmpfs nothing bounds the files a sample makes: reported, as the guarantee it lacks
    assert "limits" in samples["tmp_inode_flood"]["weakened"], samples["tmp_inode_flood"]
    breached = [n for n in held if samples[n]["passed"] and n not in ("reference_solution_from_disk",
                                                                      "tmp_inode_flood")]  # fmt: skip
    assert not breached, {n: samples[n] for n in breached}
