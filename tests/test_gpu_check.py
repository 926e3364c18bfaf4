"""bench/gpu_check.sh's stages: every stage at toy size on the CPU (--dry-run), its deadlines (the wrapper's start,
a stage's cap, the overall one), its faults (planted with $TDLM_GPU_CHECK_HOOKS), a restarted stage child's rows,
and --fetch's wheels. The settings and budget are tests/test_gpu_check_plan.py's; the rows' comparison with the
predictions is tests/test_gpu_check_compare.py's."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gpu_check_helpers import (
    REPO,
    benchlib,
    gpu_check,
    gpu_check_common,
    gpu_check_compare,
    gpu_check_nfe,
    gpu_check_plan,
    gpu_check_stages,
    gpu_check_wheels,
    gpu_train_probe,
    run_check,
    stage,
)


def test_the_gpu_checks_files_are_loaded_without_bench_on_sys_path():
    """Each file once, under the name its siblings import it by, and bench/ on no sys.path entry."""
    assert not [p for p in sys.path if p and Path(p).resolve() == REPO / "bench"], sys.path
    assert gpu_check_nfe.find_setting is gpu_check_plan.find_setting is gpu_check.find_setting
    assert gpu_check_stages.nfe_item is gpu_check_nfe.nfe_item
    assert gpu_check_compare.RATIOS is gpu_check_common.RATIOS and gpu_train_probe.write_result is benchlib.write_result


@pytest.mark.slow  # child processes under wall-clock deadlines: run where no other test competes
def test_gpu_check_dry_run_writes_every_stage(tmp_path):
    proc, _ = run_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stages = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("gpu_*_dryrun.json")}
    assert set(stages) == {"gpu_train_dryrun.json", "gpu_nfe_dryrun.json", "gpu_deepspeed_dryrun.json"}
    assert all(s["status"] == "ok" for s in stages.values()), {k: s.get("error") for k, s in stages.items()}
    assert (tmp_path / "gpu_check_dryrun.log").read_text().count("[gpu_check]") > 10
    train = stages["gpu_train_dryrun.json"]
    assert [r["layers"] for r in train["rows"]] == ["all", "dispersed:4"] and train["loss_finite"] is True
    for row in train["rows"]:  # measured peak of real steps next to the plan, every loss finite
        assert row["status"] == "ok" and 0.75 <= row["ratio"] <= 1.25 and row["loss_finite"], row
    nfe = stages["gpu_nfe_dryrun.json"]
    order = [s["name"] for s in gpu_check_plan.nfe_settings(dry_run=True)]
    assert [r["item"] for r in nfe["rows"]] == order  # run in the planned order, each one recorded
    # the planned order: the CUDA-graph pair first (the depth option: 2 of the toy's 8 layers), then compile=True
    assert order[:3] == ["llada-8b/b1/none/reduce-overhead/2L", "llada-8b/b1/none/compiled-static/2L",
                         "llada-8b/b1/none/compiled"], order  # fmt: skip
    settings = {(r["model"], r["batch"], r["cache"], r["mode"]) for r in nfe["rows"]}
    assert {(m, b, c, "eager") for m in ("llada-8b", "dream-7b") for b in (1, 8) for c in ("none", "dual")} <= settings
    for r in nfe["rows"]:
        assert r["tdlm_over_backbone"] > 0 and r["threshold_nfe"] == r["tdlm_nfe"], r
        assert len(r["tdlm_nfe"]) == r["batch"]
        if r.get("mode") in ("compiled", "compiled-static", "reduce-overhead"):  # one scope per mode
            assert r["compile_scope"] == r["scope"] == gpu_check_plan.compile_scope(r["mode"]), r
        if r["mode"] == "compiled":  # the launch profile (on a CPU: operators inside the compiled region)
            for policy in ("threshold", "tdlm"):
                prof = r[f"{policy}_launches"]
                assert prof["nfe"] == max(r[f"{policy}_nfe"]) and prof["regions_per_nfe"] >= 1, prof
                assert prof["cpu_ops_in_region_per_nfe"] > 0 and prof["region_host_ms_per_nfe"] > 0, prof
        if r["mode"] == "reduce-overhead":  # on a CPU: the static plan under dynamo's eager backend
            assert (r["compile"], r["storage"]) == ("eager", "static"), r
            for policy in ("threshold", "tdlm"):  # no CUDA graph on a CPU: none skipped, none replayed
                assert r[f"{policy}_cudagraph_skips"] == 0 and r[f"{policy}_launches"]["graph_launches"] == 0, r
        if r["purpose"] == "memory":  # decode peak after a reset: the model's bytes plus what the decode adds
            for policy in ("threshold", "tdlm"):
                mem = r[f"{policy}_memory"]
                assert mem["decode_peak"] > mem["model_bytes"] > 0, mem
    ds = stages["gpu_deepspeed_dryrun.json"]
    assert ds["zero_stage"] == 3 and ds["loss_finite"] is True
    (row,) = ds["rows"]
    assert len(row["losses"]) == 3 and all(math.isfinite(x) for x in row["losses"]), row
    assert "before the measured steps" in row["peak_reset"]["when"] and row["peak_delta"] > 0, row
    assert row["planner"]["zero"] == 3 and row["planner"]["world_size"] == 1 and row["planner"]["total"] > 0
    div = next(r for r in nfe["rows"] if r["purpose"] == "diverge")  # 3 requests in bucket 4, dual, reduce-overhead
    assert div["item"] == "llada-8b/b3/dual/reduce-overhead/2L/diverge" and div["status"] == "ok", div
    assert (div["batch"], div["cache"], div["compile"], div["storage"]) == (3, "dual", "eager", "static"), div
    for policy in ("threshold", "tdlm"):  # the planted request finishes first, the others later: rows finish apart
        got = div[f"{policy}_nfe"]
        assert len(got) == 3 and got[0] < min(got[1:]) and len(set(got)) >= 2, (policy, got)
        assert div[f"{policy}_cudagraph_skips"] == 0 and div[f"{policy}_launches"]["graph_launches"] == 0, div
    pvm = json.loads((tmp_path / "predicted_vs_measured_dryrun.json").read_text())
    what = {r["what"]: r for r in pvm["rows"]}
    for policy in ("threshold", "tdlm"):
        apart = what[f"rows finish apart llada-8b b3 (bucket 4) dual {policy}"]
        assert apart["measured"] >= 2 and apart["predicted"] == 2 and apart["nfe"] == div[f"{policy}_nfe"], apart
        ms = what[f"ms/NFE llada-8b b3 dual reduce-overhead diverge {policy}"]
        assert ms["measured"] > 0 and ms["predicted"] > 0 and "no cudaGraphLaunch" in ms["not_cuda_graphs"], ms
    assert what["DeepSpeed peak, dispersed:4, ZeRO-3 one rank"]["predicted"] == row["planner"]["total"] / 2**30
    mem_rows = [r for w, r in what.items() if w.startswith("decode peak")]
    rows = {r["item"]: r for r in nfe["rows"]}
    for cache in ("none", "dual"):  # the reduce-overhead rows beside their predictions (true_shape.json)
        for policy in ("threshold", "tdlm"):
            ro = what[f"ms/NFE llada-8b b1 {cache} reduce-overhead {policy} (at 2 of 8 layers, x4)"]
            measured = rows[f"llada-8b/b1/{cache}/reduce-overhead/2L"][f"{policy}_ms_per_nfe"]
            assert ro["measured"] == pytest.approx(measured * 4) and ro["scope"] == "model", ro  # per layer
            assert ro["measured"] > 0 and ro["predicted"] > 0, ro
            assert "no cudaGraphLaunch" in ro["not_cuda_graphs"], ro  # a CPU's number is no CUDA-graph number
    ratio = what["reduce-overhead/compiled-static llada-8b b1 none tdlm"]  # same plan, scope and depth
    assert ratio["pairs"] == ["llada-8b/b1/none/reduce-overhead/2L", "llada-8b/b1/none/compiled-static/2L"], ratio
    ro_row, c_row = rows["llada-8b/b1/none/reduce-overhead/2L"], rows["llada-8b/b1/none/compiled-static/2L"]
    assert (c_row["compile"], c_row["storage"]) == ("eager", "static")
    assert 0 < ratio["predicted"] < 1
    assert ratio["measured"] == pytest.approx(ro_row["tdlm_ms_per_nfe"] / c_row["tdlm_ms_per_nfe"])
    assert ro_row["tdlm_reduce_overhead_over_compiled_static"] == pytest.approx(ratio["measured"])
    static = what["compiled-static/compiled llada-8b b1 none tdlm"]  # the storage plan's own ratio: one scope only
    assert static["pairs"] == ["llada-8b/b1/none/compiled-static/2L", None] and static["measured"] is None, static
    assert "model scope" in static["unpaired"] and "tdlm_compiled_static_over_compiled" not in c_row
    compiled = rows["llada-8b/b1/none/compiled"]  # block scope, compared with eager across scopes (eager has none)
    assert compiled["tdlm_compiled_over_eager"] > 0 and compiled["compile_scope"] == "block"
    assert len(mem_rows) == 2 and all(r["measured"] and r["predicted"] for r in mem_rows), mem_rows
    assert pvm["stages"]["train"]["loss_finite"] is True and pvm["stages"]["deepspeed"]["loss_finite"] is True


SLOW = ["llada-8b/b1/none/eager", "llada-8b/b1/dual/eager", "dream-7b/b1/none/eager"]


@pytest.mark.slow  # child processes under wall-clock deadlines: run where no other test competes
def test_a_slow_setting_hits_the_deadline_and_every_finished_setting_stays(tmp_path):
    # The second setting's tdlm policy hangs after its threshold policy finished: the overall deadline (60 s, less
    # the 10 s reserve; a child's start takes 5-20 s on a busy 2-core machine) must stop the stage's child; the
    # first setting and the second's threshold half remain.
    proc, wall = run_check(tmp_path, "--stages", "nfe", "--nfe-settings", ",".join(SLOW), "--deadline-s", "60",
                           hooks=f"sleep:nfe:{SLOW[1]}@tdlm=150", timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert wall < 70, f"the deadline did not stop the run: {wall:.0f} s"
    nfe = stage(tmp_path, "nfe")
    assert nfe["status"] == "deadline" and nfe["deadline_hit"], nfe.get("items")
    assert nfe["items"] == {SLOW[0]: "ok", SLOW[1]: "deadline", SLOW[2]: "not run"}
    rows = {r["item"]: r for r in nfe["rows"]}
    assert rows[SLOW[0]]["tdlm_ms_per_nfe"] > 0 and rows[SLOW[0]]["status"] == "ok"
    assert rows[SLOW[1]]["threshold_ms_per_nfe"] > 0 and "tdlm_ms_per_nfe" not in rows[SLOW[1]]
    assert nfe["children"][0]["stopped"] == "deadline"
    pid = nfe["children"][0]["pid"]
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    pvm = json.loads((tmp_path / "predicted_vs_measured_dryrun.json").read_text())
    assert pvm["stages"]["nfe"]["items"][SLOW[1]] == "deadline"


@pytest.mark.slow  # child processes under wall-clock deadlines: run where no other test competes
def test_a_setting_past_its_cap_or_with_a_cuda_error_is_given_up_and_the_next_runs_in_a_new_child(tmp_path):
    settings = [*SLOW, "dream-7b/b1/dual/eager"]
    proc, _ = run_check(tmp_path, "--stages", "nfe", "--nfe-settings", ",".join(settings), "--setting-cap-s", "6",
                        hooks=f"sleep:nfe:{settings[1]}=90;cudaerror:nfe:{settings[2]}", timeout=400)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]  # the CUDA error is a failure
    nfe = stage(tmp_path, "nfe")
    assert nfe["items"] == dict(zip(settings, ["ok", "cap", "failed", "ok"], strict=True)), nfe["items"]
    assert [(c["stopped"], c["rc"]) for c in nfe["children"]] == [("cap", -9), (None, 3), (None, 0)]
    assert nfe["status"] == "failed" and "CUDA error" in nfe["rows"][2]["error"]


@pytest.mark.slow  # child processes under wall-clock deadlines: run where no other test competes
def test_a_failing_setting_and_a_nan_loss_are_failures_and_the_next_stage_still_runs(tmp_path):
    proc, _ = run_check(tmp_path, "--stages", "train,deepspeed", hooks="raise:train:all;nan:deepspeed")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    train = stage(tmp_path, "train")
    assert train["status"] == "failed" and train["items"] == {"all": "failed", "dispersed:4": "ok"}
    assert "planted" in train["rows"][0]["error"] and train["rows"][1]["loss_finite"] is True
    ds = stage(tmp_path, "deepspeed")
    (row,) = ds["rows"]
    assert ds["status"] == "failed" and ds["loss_finite"] is False, ds.get("error")
    assert row["loss_finite"] is False and "non-finite loss" in row["error"] and len(row["losses"]) == 3
    pvm = json.loads((tmp_path / "predicted_vs_measured_dryrun.json").read_text())
    assert pvm["stages"]["deepspeed"]["loss_finite"] is False


def test_fetch_names_the_wheels_of_the_asked_architecture():
    def fetch(*args: str) -> str:
        proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--fetch", *args, "--print"], cwd=REPO,
                              env=os.environ | {"PYTHON": sys.executable}, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    x86, arm = fetch(), fetch("--arch", "aarch64")
    assert "manylinux2014_x86_64" in x86 and "aarch64" not in x86
    assert "manylinux_2_17_aarch64" in arm and "manylinux2014_aarch64" in arm and "x86_64" not in arm
    assert "pydantic-core" in arm and "deepspeed==" in arm  # DeepSpeed's wheel is py3-none-any: both
    bad = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--fetch", "--arch", "ppc64le", "--print"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "x86_64 or aarch64" in bad.stderr


def _fetch_commands() -> list[list[str]]:
    """The commands ``--fetch --print`` prints, for this interpreter's venv (``$PYTHON``)."""
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--fetch", "--print"], cwd=REPO,
                          env=os.environ | {"PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


def test_fetch_pins_what_the_venv_runs_with_every_dependency_and_checks_it_offline():
    """--fetch carries DeepSpeed and its whole requirement closure (typing-extensions, pydantic-core, ...), each
    pinned to the version this venv runs, torch's subtree left to the image; it ends with an offline ``pip install
    --dry-run --no-index`` for Python 3.12 with the image's torch 2.11 standing in as a stub."""
    import importlib.metadata as md

    pins = gpu_check_wheels.pins()
    names = {p.split("==")[0] for p in pins}
    assert pins[0] == f"deepspeed=={md.version('deepspeed')}"
    assert {"pydantic", "pydantic-core", "typing-extensions", "annotated-types", "typing-inspection", "hjson"} <= names
    assert not names & {"torch", "sympy", "networkx", "filelock", "jinja2", "triton"}  # the image's torch serves them
    for pin in pins:  # pinned to this venv's versions, every one
        name, _, version = pin.partition("==")
        assert version == md.version(name), pin
    build, download, check = _fetch_commands()
    assert build[-1] == pins[0] and "--no-deps" in build  # DeepSpeed's wheel, built here
    assert download[download.index("-d") + 2 :] == pins[1:] and "--no-deps" in download
    assert download[download.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in download
    for flag in ("--dry-run", "--no-index", "--ignore-installed", "--only-binary=:all:"):
        assert flag in check, (flag, check)
    assert check[check.index("--python-version") + 1] == "3.12" and check[-len(pins) :] == pins
    assert "torch==2.11.0" in check  # the image's torch, a stub wheel in the check


def test_the_offline_check_fails_when_a_dependency_was_not_fetched(tmp_path):
    """The --fetch check's own command line, run against an offline folder of metadata-only wheels that carry the
    venv's real requirement metadata: it resolves with every pinned wheel there and fails, naming it, when one
    (typing-extensions: pydantic needs it, the old --fetch left it out) is missing. No network."""
    import importlib.metadata as md

    whl, stub = tmp_path / ".whl", tmp_path / "stub"
    for pin in gpu_check_wheels.pins():
        name, _, version = pin.partition("==")
        requires = [r for r in md.requires(name) or [] if "extra ==" not in r]
        gpu_check_wheels.stub_wheel(whl, name, version, requires)
    gpu_check_wheels.stub_wheel(stub, "torch", "2.11.0")
    *_, check = _fetch_commands()
    check = [str(whl) if a == ".whl" else a.replace("/tmp/gpu-check-stub", str(stub)) for a in check]
    check[0] = sys.executable
    ok = subprocess.run(check, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    report = json.loads((stub / "report.json").read_text())
    assert {i["metadata"]["name"].lower().replace("_", "-") for i in report["install"]} >= {"typing-extensions"}
    next(whl.glob("typing_extensions-*.whl")).unlink()
    bad = subprocess.run(check, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "typing-extensions" in bad.stderr.lower().replace("_", "-"), bad.stderr[-2000:]


# -- fast: the deadline's origin and a restarted child's rows, with a fake clock, a fake run_stage, a fake child ----
NOW = 1_000_000.0  # the fake clock's time


@pytest.fixture
def fake_clock(monkeypatch):
    """gpu_check's ``time.time()`` frozen at NOW (its own module reference only), and the signal handlers main
    installs put back afterwards (main makes SIGINT raise its Interrupted)."""
    import signal
    from types import SimpleNamespace

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(time=lambda: NOW, sleep=time.sleep))
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _fake_stages(monkeypatch) -> list[tuple[str, float]]:
    started: list[tuple[str, float]] = []

    def run_stage(stage, items, path, until, args, cap_s):
        started.append((stage, until))
        return {"stage": stage, "status": "ok", "items": dict.fromkeys(items, "ok"), "seconds": 0.0}

    monkeypatch.setattr(gpu_check, "run_stage", run_stage)
    monkeypatch.setattr(gpu_check, "beside_predicted", lambda out, dry_run: {})
    return started


def test_the_deadline_counts_from_the_wrappers_start_not_the_python_processes(tmp_path, monkeypatch, fake_clock):
    # gpu_check.sh started 300 s before this process (a slow wheel install): of the 420 s, 110 s are left
    monkeypatch.setenv(gpu_check.T0_ENV, str(NOW - 300))
    started = _fake_stages(monkeypatch)
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "train,nfe", "--deadline-s", "420"]) == 0
    end = (NOW - 300) + 420 - gpu_check_plan.RESERVE_S
    assert started == [("train", NOW + 75), ("nfe", end)]  # train: its 75 s cap; nfe: the rest, to the wrapper's end
    assert gpu_check.run_start({gpu_check.T0_ENV: "123.5"}) == 123.5
    assert gpu_check.run_start({}) == NOW  # without the wrapper: this process's start


def test_a_wrapper_start_past_the_deadline_starts_no_stage(tmp_path, monkeypatch, fake_clock):
    monkeypatch.setenv(gpu_check.T0_ENV, str(NOW - 415))  # 5 s left of 420, less the reserve: none
    started = _fake_stages(monkeypatch)
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "train,nfe", "--deadline-s", "420"]) == 0
    assert started == []
    for name in ("train", "nfe"):
        doc = json.loads((tmp_path / f"gpu_{name}.json").read_text())
        assert doc["status"] == "deadline" and doc["error"] == "no time left at its turn", doc
        assert set(doc["items"].values()) == {"not run"}


def test_the_wrapper_exports_its_own_start_to_the_check(tmp_path):
    """gpu_check.sh sets GPU_CHECK_T0 when it starts, replacing any inherited value (a stale one from an earlier
    run would leave no budget; none would start the clock only when Python does)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "T0=$GPU_CHECK_T0 ARGS=$*"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHON": str(fake), "GPU_CHECK_T0": "5.0"}
    before = time.time()
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run", "--stages", "nfe"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    after = time.time()
    assert proc.returncode == 0, proc.stderr
    t0, args = proc.stdout.strip().removeprefix("T0=").split(" ARGS=")
    assert before - 0.01 <= float(t0) <= after and args == "bench/gpu_check.py --dry-run --stages nfe"


# A stand-in for bench/gpu_check_stages.py run as the script it is (its own process, bench/ first on sys.path).
FAKE_CHILD = """import os, sys, types
sys.path[:0] = [{bench!r}]
import gpu_check_stages as s
s.build_context = lambda stage, dry_run: types.SimpleNamespace(info={{"name": "fake"}}, cleanup=lambda: None)
s.STAGES["train"] = (lambda ctx: {{}}, lambda ctx, item, partial: {{"pid": os.getpid()}}, lambda doc: None)
sys.exit(s.main())
"""


def test_a_restarted_child_keeps_the_rows_its_predecessor_wrote(tmp_path, monkeypatch):
    # The stage child is the real child_main with toy settings (no torch): the second setting's CUDA error ends
    # the first child (exit 3, restart), and the parent runs the third in a new child, which must append.
    child = tmp_path / "child.py"
    child.write_text(FAKE_CHILD.format(bench=str(REPO / "bench")))
    monkeypatch.setattr(gpu_check, "CHILD", child)
    monkeypatch.setenv(gpu_check.HOOKS_ENV, "cudaerror:train:b")
    path = tmp_path / "gpu_train.json"
    args = type("Args", (), {"dry_run": True})()
    doc = gpu_check.run_stage("train", ["a", "b", "c"], path, time.time() + 120, args, 0.0)
    assert [(c["rc"], c["stopped"]) for c in doc["children"]] == [(3, None), (0, None)]
    assert [r["item"] for r in doc["rows"]] == ["a", "b", "c"], doc["rows"]
    assert doc["items"] == {"a": "ok", "b": "failed", "c": "ok"} and "CUDA error" in doc["rows"][1]["error"]
    assert doc["rows"][0]["pid"] != doc["rows"][2]["pid"]  # two children wrote them
    assert json.loads(path.read_text())["rows"] == doc["rows"]


def test_a_child_started_on_a_stage_file_appends_to_its_rows(tmp_path, monkeypatch):
    from types import SimpleNamespace

    path = tmp_path / "gpu_train.json"
    gpu_check_common.write_json(path, {"stage": "train", "rows": [{"item": "a", "status": "ok", "by": "first"}],
                                       "running": None, "status": "running"})  # fmt: skip
    monkeypatch.setattr(sys, "path", list(sys.path))  # child_main puts bench/ and the root first
    monkeypatch.setattr(gpu_check_stages, "build_context",
                        lambda stage, dry_run: SimpleNamespace(info={"name": "fake"}, cleanup=lambda: None))
    monkeypatch.setitem(gpu_check_stages.STAGES, "train",
                        (lambda ctx: {}, lambda ctx, item, partial: {"by": "second"}, lambda doc: None))
    monkeypatch.delenv(gpu_check.HOOKS_ENV, raising=False)
    assert gpu_check_stages.child_main("train", ["b"], path, True) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["item"], r["by"]) for r in rows] == [("a", "first"), ("b", "second")], rows


def test_a_deepspeed_that_cannot_be_imported_skips_its_stage_before_any_backbone_is_built(tmp_path, monkeypatch):
    """DeepSpeed's import fails on the GPU image not only with an ImportError: a pydantic / pydantic-core mismatch
    raises SystemError. Any failure marks the stage "skipped" (the environment, not the code under test), and the
    import comes before the backbone is built."""
    import builtins

    real_import = builtins.__import__

    def no_deepspeed(name, *args, **kwargs):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise SystemError("The installed pydantic-core version (2.33.2) is incompatible with pydantic 2.12")
        return real_import(name, *args, **kwargs)

    built = []
    monkeypatch.setattr(sys, "path", list(sys.path))  # child_main puts bench/ and the root first
    monkeypatch.setattr(gpu_check_stages, "build_context", lambda stage, dry_run: built.append(stage))
    monkeypatch.setattr(builtins, "__import__", no_deepspeed)
    monkeypatch.delenv(gpu_check.HOOKS_ENV, raising=False)
    path = tmp_path / "gpu_deepspeed.json"
    assert gpu_check_stages.child_main("deepspeed", ["zero3"], path, True) == 0
    doc = json.loads(path.read_text())
    assert doc["status"] == "skipped" and "SystemError" in doc["reason"] and "pydantic-core" in doc["reason"], doc
    assert built == [] and doc["rows"] == []  # skipped before the backbone, no setting run
