"""The guarantees are what the sample's own process saw, never a backend's name (open issue "a backend trusted by
name"; :mod:`tdlm.evaluation.sandbox.verify`).

- A ``bwrap`` that isolates nothing (a script at the fixed system path that just runs its command): the probe's
  guarantees are all false, the level is weak and names that script, scoring refuses by default with the one-line
  refusal; with ``allow_weak`` the sample runs and cannot forge the report, however it writes to every fd.
- A run that gets less than the probe saw (the real bwrap probed, the fake one in place afterwards): the sample's
  process refuses to run the candidate, the result is an error, the candidate's side effect never happens.
- Honest controls: the real ``/usr/bin/bwrap`` and the in-house launcher report every guarantee, the facts show
  other namespaces than the evaluator's, the sample cannot see the run's host marker file, and the namespaces the
  candidate sees are the ones the check saw (the same process).
- :func:`guarantees_held` on facts with one thing wrong each: that guarantee, and only it, is not held.
"""

from __future__ import annotations

import copy
import glob
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for

from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import (
    GUARANTEES,
    SandboxLimits,
    core,
    isolation_support,
    require_sandbox,
    run_python,
    verify,
)
from tdlm.evaluation.scoring import score_code

FAST = dict(timeout_s=20.0, cpu_s=5)
FAKE_BWRAP = """#!/bin/sh
# isolates nothing: skip bubblewrap's options, run the command after "--" on the host
if [ "$1" = "--version" ]; then echo "bubblewrap 0.0-fake"; exit 0; fi
while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done
shift
exec "$@"
"""
NO_FILTER_BWRAP = """#!/bin/sh
# the real bubblewrap, without the seccomp filter it was given (everything else holds)
skip=0
for a in "$@"; do
    shift
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    if [ "$a" = "--seccomp" ]; then skip=1; continue; fi
    set -- "$@" "$a"
done
exec /usr/bin/bwrap "$@"
"""
MARKERS = os.path.join(tempfile.gettempdir(), "tdlm-sandbox-*", "host-marker")
# the candidate looks for any run's host marker and reports the namespaces it is in
SEES = f"""
import glob, os
def markers():
    return glob.glob({MARKERS!r})
def namespaces():
    return {{n: os.stat("/proc/self/ns/" + n).st_ino for n in ("net", "pid", "mnt", "ipc")}}
"""


def _install(monkeypatch, text: str):
    """``text`` as the only system bwrap, caches cleared (restored by monkeypatch afterwards). The directory is
    world-readable: the launcher runs bwrap as nobody when the evaluator is root."""
    d = Path(tempfile.mkdtemp(prefix="tdlm-fake-bwrap-"))
    d.chmod(0o755)
    fake = d / "bwrap"
    fake.write_text(text)
    fake.chmod(0o755 | stat.S_IXUSR)
    monkeypatch.setattr(core, "BWRAP_PATHS", (str(fake),))
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_required", {})
    return d, str(fake)


@pytest.fixture
def fake_bwrap(monkeypatch):
    d, fake = _install(monkeypatch, FAKE_BWRAP)
    yield fake
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def unfiltered_bwrap(monkeypatch):
    if not os.access("/usr/bin/bwrap", os.X_OK):
        pytest.skip("bubblewrap is not installed in /usr/bin")
    d, fake = _install(monkeypatch, NO_FILTER_BWRAP)
    yield fake
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def facts_seen(monkeypatch):
    """Every facts line the evaluator reads, in order (a spy on the parser; the flags still come from it)."""
    seen: list[dict | None] = []
    parse = verify.parse_facts

    def spy(text: str) -> dict | None:
        seen.append(parse(text))
        return seen[-1]

    monkeypatch.setattr(verify, "parse_facts", spy)
    return seen


def test_a_bwrap_that_isolates_nothing_is_not_reported_as_isolation(fake_bwrap, facts_seen):
    lim = SandboxLimits(backend="bwrap", **FAST)
    support = isolation_support(lim)
    assert support["works"], support  # it ran the trivial program: only the guarantees are missing
    assert support["guarantees"] == dict.fromkeys(GUARANTEES, False), support
    assert support["missing"] == list(GUARANTEES) and support["backend"] == "none", support
    assert support["level"].startswith("weak: ") and fake_bwrap in support["level"], support["level"]
    assert "bubblewrap 0.0-fake" in support["level"], support["level"]
    facts = facts_seen[-1]
    assert facts is not None and facts["status"]["Seccomp"] == 0 and facts["marker"] == "visible", facts
    host = verify.host_namespaces()
    assert all(facts["ns"][n] == host[n] for n in ("net", "pid", "mnt", "ipc")), (facts["ns"], host)
    # fail closed by default, one line, for the sandbox and for scoring alike
    with pytest.raises(TDLMError) as e:
        require_sandbox(lim)
    assert "refusing to score code: missing filesystem, network, pid" in str(e.value), e.value
    assert "\n" not in str(e.value)
    for call in (lambda: run_python(SEES, lim, checks=["assert markers() == []"], names={"markers"}),
                 lambda: score_code("```python\n" + SEES + "```", ["assert markers() == []"], limits=lim)):  # fmt: skip
        with pytest.raises(TDLMError) as e:
            call()
        assert str(e.value) == support["refusal"]


def test_with_allow_weak_the_unisolated_run_records_it_and_cannot_forge_the_report(fake_bwrap, facts_seen):
    """The candidate runs on the host here (weak mode, asked for): it sees the marker, and a forged "everything
    held" report written to every fd it has does not change a single flag - the report was sent and its pipe
    closed before the candidate started."""
    lim = SandboxLimits(backend="bwrap", **FAST)
    r = run_python(SEES, lim, checks=["assert markers() != []"], names={"markers"}, allow_weak=True)
    assert r.passed and r.weakened == tuple(GUARANTEES), r  # the control: unisolated, the host path is visible
    honest = copy.deepcopy(facts_seen[-1])
    assert honest is not None
    forged = copy.deepcopy(honest)
    forged["ns"] = {n: (v[0], v[1] + 1) for n, v in forged["ns"].items()}
    forged.update(status=dict.fromkeys(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), 0) | {
        "Seccomp": 2, "NoNewPrivs": 1}, marker="absent", root_ro=True, proc_own=True, inodes=[16, 16])  # fmt: skip
    line = repr(forged) + "\n"
    forge = f"import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, {line!r}.encode())\n" \
            "    except OSError:\n        pass\n"  # fmt: skip
    r = run_python(forge, lim, allow_weak=True)
    assert r.passed and r.weakened == tuple(GUARANTEES), r
    assert not any((r.network_isolated, r.pid_isolated, r.ipc_isolated, r.filesystem_isolated, r.seccomp)), r
    assert facts_seen[-1]["ns"] == honest["ns"], facts_seen[-1]


def test_a_bwrap_that_drops_the_seccomp_filter_loses_seccomp_and_nothing_it_built(unfiltered_bwrap, facts_seen):
    """Namespaces, root, no_new_privs and the capability drop are bubblewrap's own and hold; the filter it was handed
    is not installed: ``Seccomp: 0`` inside, so seccomp (and the limits that rest on the filter: TCP / UDP under
    bwrap's up loopback) are missing, and scoring refuses."""
    lim = SandboxLimits(backend="bwrap", **FAST)
    support = isolation_support(lim)
    assert support["works"] and support["missing"] == ["limits", "seccomp"], support
    assert unfiltered_bwrap in support["level"] and support["level"].startswith("weak: limits,seccomp;"), support
    facts = facts_seen[-1]
    assert facts["status"]["Seccomp"] == 0 and facts["status"]["NoNewPrivs"] == 1, facts
    with pytest.raises(TDLMError, match="missing limits, seccomp"):
        run_python("pass", lim)


def test_a_run_that_gets_less_than_the_probe_never_runs_the_candidate(monkeypatch, fake_bwrap):
    """Probed with the real bubblewrap (full), then bwrap is replaced by the fake one: the sample's process sees
    nothing held that was required and stops before the candidate's code (which would leave a file on the host)."""
    if core.backend_unavailable("bwrap") is None and os.path.exists("/usr/bin/bwrap"):
        real = "/usr/bin/bwrap"
    else:
        pytest.skip("bubblewrap is not installed in /usr/bin")
    monkeypatch.setattr(core, "BWRAP_PATHS", (real,))
    lim = SandboxLimits(backend="bwrap", **FAST)
    assert require_sandbox(lim)["level"].startswith("full;")
    out = Path(tempfile.mkdtemp(prefix="tdlm-verified-out-"))
    try:
        out.chmod(0o777)
        ran = str(out / "ran")
        touch = f"try:\n    open({ran!r}, 'w').close()\nexcept OSError:\n    pass\ndef f():\n    return 1\n"
        ok = run_python(touch, lim, checks=["assert f() == 1"], names={"f"})
        assert ok.passed and not (out / "ran").exists(), ok  # control: in the real sandbox the host dir is absent
        monkeypatch.setattr(core, "BWRAP_PATHS", (fake_bwrap,))  # the cached plan and probe stay "full"
        r = run_python(touch, lim, checks=["assert f() == 1"], names={"f"})
        assert r.status == "error" and not r.passed and not (out / "ran").exists(), r
        assert "after the probe" in r.detail and "\n" not in r.detail, r.detail
        assert "not held inside the sample's process: filesystem, network, pid, ipc" in r.stderr, r.stderr
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_honest_backends_verify_every_guarantee_from_inside(backend, facts_seen):
    lim = sandbox_limits_for(backend, **FAST)
    support = isolation_support(lim)
    assert support["guarantees"] == dict.fromkeys(GUARANTEES, True) and support["missing"] == [], support
    if backend == "bwrap":
        assert f"bwrap {core._bwrap_path()} (bubblewrap " in support["level"], support["level"]
    r = run_python(SEES, lim, checks=["assert markers() == []", "assert len(namespaces()) == 4"],
                   names={"markers", "namespaces"})  # fmt: skip
    assert r.passed and r.weakened == () and r.backend == backend, r
    facts = facts_seen[-1]
    assert facts is not None, facts_seen
    host = verify.host_namespaces()
    assert all(facts["ns"][n][1] != host[n][1] for n in ("net", "pid", "mnt", "ipc", "uts")), (facts["ns"], host)
    assert facts["status"]["Seccomp"] == 2 and facts["status"]["NoNewPrivs"] == 1, facts
    assert facts["marker"] == "absent" and facts["root_ro"] and facts["proc_own"], facts
    assert all(facts["status"][k] == 0 for k in verify.CAPS) and 0 not in facts["uid"], facts
    # the candidate is in the namespaces the check saw: the same process, checked right before it
    seen = run_python(SEES + "print(namespaces())", lim)
    assert seen.passed, seen
    assert eval(seen.stdout) == {n: facts_seen[-1]["ns"][n][1] for n in ("net", "pid", "mnt", "ipc")}  # noqa: S307


def test_the_marker_is_a_real_host_file_during_the_run(monkeypatch):
    """The filesystem check looks for a file that exists on the host for exactly this run (else "absent" would
    prove nothing): it is there when the run's expectations are made, and gone with the run's tree."""
    seen = []
    expectations = verify.expectations

    def spy(**k):
        seen.append((k["marker"], os.path.isfile(k["marker"])))
        return expectations(**k)

    monkeypatch.setattr(verify, "expectations", spy)
    lim = sandbox_limits_for("inhouse", **FAST)
    assert run_python("pass", lim).passed
    marker, existed = seen[-1]
    assert existed and glob.fnmatch.fnmatch(marker, MARKERS) and not os.path.exists(marker), seen


# ------------------------------------------------------------------------------------------ the rule itself
def _good() -> tuple[dict, dict]:
    host = {n: (4, 1000 + i) for i, n in enumerate(verify.NAMESPACES)}
    expect = {"ns": host, "marker": "/tmp/x/host-marker", "rlimits": {"AS": 100, "CPU": 5, "NPROC": -1, "MEMLOCK": 0},
              "cgroup": {"memory": "/a/s", "pids": "/s"}, "inodes": 4096, "inet": "netns", "require": []}  # fmt: skip
    facts = {"uid": (65534, 65534), "ns": {n: (4, v[1] + 500) for n, v in host.items()},
             "status": dict.fromkeys(verify.CAPS, 0) | {"Seccomp": 2, "NoNewPrivs": 1},
             "rlimits": {"AS": 100, "CPU": 5, "NPROC": 70, "MEMLOCK": 0}, "cgroup": {"memory": "/a/s", "pids": "/s"},
             "inodes": [4096, 4096], "root_ro": True, "proc_own": True, "marker": "absent",
             "one_process": {"fork": 1, "pipe2": 1, "memfd_create": 1}, "offlist": 1}  # fmt: skip
    return facts, expect


def _set(d: dict, path: str, value) -> None:
    *keys, last = path.split(".")
    for k in keys:
        d = d[k]
    d[last] = value


# (where, the wrong value, the guarantees that must then not hold)
WRONG = [
    ("ns.net", "host", {"network", "limits"}),  # in-house: TCP / UDP bounded by the down loopback
    ("ns.net", None, {"network", "limits"}),
    ("ns.pid", "host", {"pid"}),
    ("proc_own", False, {"pid"}),
    ("ns.ipc", "host", {"ipc"}),
    ("ns.mnt", "host", {"filesystem"}),
    ("ns.mnt", "otherdev", {"filesystem"}),
    ("marker", "visible", {"filesystem"}),
    ("marker", "error", {"filesystem"}),
    ("root_ro", False, {"filesystem"}),
    ("status.Seccomp", 0, {"seccomp", "limits"}),  # no filter: the no-fork rule is gone too (no cgroup below)
    ("status.Seccomp", 1, {"seccomp", "limits"}),
    ("status.NoNewPrivs", 0, {"seccomp", "limits"}),
    ("offlist", 0, {"seccomp", "limits"}),  # a filter, but not the allowlist: getpriority goes through
    ("offlist", None, {"seccomp", "limits"}),
    ("status.CapEff", 1 << 21, {"privileges"}),
    ("status.CapPrm", 1, {"privileges"}),
    ("status.CapAmb", 1, {"privileges"}),
    ("uid", (0, 0), {"privileges"}),
    ("uid", (65534, 0), {"privileges"}),
    ("rlimits.AS", None, {"limits"}),
    ("rlimits.CPU", 6, {"limits"}),
    ("rlimits.NPROC", None, {"limits"}),
    ("rlimits.MEMLOCK", 65536, {"limits"}),
    ("rlimits.MEMLOCK", None, {"limits"}),
    # no cgroup: the filter must be seen refusing processes, pipes and memfds (EPERM), not merely be there
    ("one_process.fork", 0, {"limits"}),
    ("one_process.pipe2", 22, {"limits"}),
    ("one_process.memfd_create", 22, {"limits"}),
    ("one_process", {}, {"limits"}),
    ("one_process", None, {"limits"}),
    ("inodes", [None, 4096], {"limits"}),
    ("inodes", [4096, 10**7], {"limits"}),
]


@pytest.mark.parametrize("where, value, lost", WRONG, ids=[f"{w}={v}" for w, v, _ in WRONG])
def test_each_fact_decides_its_guarantee(where, value, lost):
    facts, expect = _good()
    expect_nocg = dict(expect, cgroup=None)  # no cgroup: tasks bounded by the seccomp filter
    assert verify.guarantees_held(facts, expect_nocg) == dict.fromkeys(GUARANTEES, True)
    if value == "host":
        value = expect["ns"][where.split(".")[1]]
    elif value == "otherdev":
        value = (5, facts["ns"]["mnt"][1])
    _set(facts, where, value)
    held = verify.guarantees_held(facts, expect_nocg)
    assert {k for k, v in held.items() if not v} == lost, held


def test_limits_rules_for_the_cgroup_and_the_network():
    facts, expect = _good()
    assert all(verify.guarantees_held(facts, expect).values())
    for seen, ok in (({"memory": "/a/s", "pids": "/other"}, False), ({"memory": "/a/s"}, False),
                     ({"memory": "/", "pids": "/"}, True)):  # fmt: skip  # "/": a cgroup namespace of its own
        f = copy.deepcopy(facts)
        f["cgroup"] = seen
        assert verify.guarantees_held(f, expect)["limits"] is ok, seen
    f = copy.deepcopy(facts)
    f["cgroup"] = {"memory": "/", "pids": "/"}
    f["ns"]["cgroup"] = expect["ns"]["cgroup"]  # "/" in the evaluator's own cgroup namespace proves nothing
    assert verify.guarantees_held(f, expect)["limits"] is False
    # TCP / UDP buffers: bwrap's loopback is up, so the filter must hold; in-house, the network namespace
    f = copy.deepcopy(facts)
    f["ns"]["net"] = expect["ns"]["net"]
    assert verify.guarantees_held(f, expect)["limits"] is False
    assert verify.guarantees_held(f, dict(expect, inet="filtered"))["limits"] is True
    assert verify.guarantees_held(f, dict(expect, inet="charged"))["limits"] is True
    f = copy.deepcopy(facts)
    f["status"]["Seccomp"] = 0
    assert verify.guarantees_held(f, dict(expect, inet="filtered"))["limits"] is False
    # a cgroup that charges kernel memory bounds the files: no inode limit needed
    f = copy.deepcopy(facts)
    f["inodes"] = [10**7, 10**7]
    assert verify.guarantees_held(f, expect)["limits"] is False
    assert verify.guarantees_held(f, dict(expect, inodes=None))["limits"] is True
    # a bounding set is tolerated only under no_new_privs (it can grant nothing through exec then)
    f = copy.deepcopy(facts)
    f["status"]["CapBnd"] = (1 << 41) - 1
    assert verify.guarantees_held(f, expect)["privileges"] is True
    f["status"]["NoNewPrivs"] = 0
    assert verify.guarantees_held(f, expect)["privileges"] is False


def test_nothing_reported_is_nothing_held():
    assert verify.parse_facts("") is None and verify.parse_facts("garbage\n") is None
    assert verify.parse_facts("[1, 2]\n") is None
    facts, expect = _good()
    assert verify.parse_facts(repr(facts) + "\n" + repr({"forged": 1}) + "\n") == facts  # the first line only
    assert not any(verify.guarantees_held({}, expect).values())
