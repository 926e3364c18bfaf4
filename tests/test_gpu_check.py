"""bench/gpu_check.sh: every stage at toy size on the CPU (--dry-run), its deadlines, its faults, and which
prediction rows a GPU is held to. The stage-running tests plant faults with $TDLM_GPU_CHECK_HOOKS."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The GPU check's files, in the order they import each other. bench/ is no package: its files are scripts (on the
# GPU machine too, where each runs with bench/ first on sys.path) and import their siblings by bare name. So, as
# tests/test_bench_results_paths.py's bench_module loads one script from its file with no sys.path entry, these are
# loaded from their files, each under the bare name its siblings import it by. Only these names: bench/ on sys.path
# would make every bench script (engine, timing, ...) importable by a bare name for every later test.
GPU_CHECK_FILES = ("benchlib", "gpu_train_probe", "gpu_check_common", "gpu_check_plan", "gpu_check_compare",
                   "gpu_check", "gpu_check_nfe", "gpu_check_stages", "gpu_check_wheels")  # fmt: skip


def gpu_check_file(name: str):
    """``bench/<name>.py`` as the module ``name`` (once per process: a reload would split the siblings' globals)."""
    path = REPO / "bench" / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        assert Path(loaded.__file__).resolve() == path, f"{name} is already {loaded.__file__}, not bench's"
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before it runs: its siblings, loaded after it, import it by this name
    spec.loader.exec_module(mod)
    return mod


(benchlib, gpu_train_probe, gpu_check_common, gpu_check_plan, gpu_check_compare, gpu_check, gpu_check_nfe,
 gpu_check_stages, gpu_check_wheels) = map(gpu_check_file, GPU_CHECK_FILES)  # fmt: skip


def test_the_gpu_checks_files_are_loaded_without_bench_on_sys_path():
    """Each file once, under the name its siblings import it by, and bench/ on no sys.path entry."""
    assert not [p for p in sys.path if p and Path(p).resolve() == REPO / "bench"], sys.path
    assert gpu_check_nfe.find_setting is gpu_check_plan.find_setting is gpu_check.find_setting
    assert gpu_check_stages.nfe_item is gpu_check_nfe.nfe_item
    assert gpu_check_compare.RATIOS is gpu_check_common.RATIOS and gpu_train_probe.write_result is benchlib.write_result


def run_check(tmp_path, *args: str, hooks: str = "", timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    env = os.environ | {"OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
                        gpu_check.HOOKS_ENV: hooks}  # fmt: skip
    env.pop("GPU_CHECK_T0", None)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    return proc, time.monotonic() - t0


def stage(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / f"gpu_{name}_dryrun.json").read_text())


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


def test_stage_deadlines_keep_inside_the_overall_deadline():
    t0 = 1000.0
    assert gpu_check.stage_deadline(t0, t0, 420, 75) == t0 + 75
    assert gpu_check.stage_deadline(t0 + 400, t0, 420, 75) == t0 + 420 - gpu_check_plan.RESERVE_S
    assert gpu_check.stage_deadline(t0 + 100, t0, 420, None) == t0 + 420 - gpu_check_plan.RESERVE_S
    full, quick = gpu_check_plan.DEADLINE_S["full"], gpu_check_plan.DEADLINE_S["quick"]
    assert full <= 420 and quick <= 240  # 7 and 4 minutes: 15 device-minutes leave room for a rerun
    for mode, total in (("full", full), ("quick", quick)):
        caps = sum(gpu_check_plan.STAGE_CAP_S[mode].values())
        assert caps + gpu_check_plan.RESERVE_S < total / 2  # nfe keeps the most
    quick_nfe = gpu_check_plan.nfe_settings(quick=True)
    assert all(s["mode"] == "compiled" or s["purpose"] == "memory" for s in quick_nfe)  # no eager, no CUDA graphs
    full = gpu_check_plan.nfe_settings()
    assert [s for s in full if s in quick_nfe] == quick_nfe  # the quick run's settings, in the same order


def test_reduce_overhead_settings_are_timed_against_compile_true_and_each_has_its_prediction():
    """compile="reduce-overhead" (storage="static", model scope) at batch 1 and 8, uncached and dual, at the depth
    option (4 layers, true width), each paired with its compiled-static setting (compile=True, storage="static",
    the same scope, depth and policies); batch 1 uncached first of all (the default run's pair, tdlm), the rest
    opt-in; every one paired with a predicted row of true_shape.json (written before any GPU run) for each policy."""
    every = {s["name"]: s for s in gpu_check_plan.nfe_settings(every=True)}
    full = list(every)
    assert len(full) == len(set(full))  # a name says what a setting runs: no two alike
    ro = [n for n in full if "/reduce-overhead/" in n and "/diverge" not in n]
    bare = {n.removesuffix("/tdlm").removesuffix("/threshold") for n in ro}
    assert bare == {f"llada-8b/b{b}/{c}/reduce-overhead/4L" for b in (1, 8) for c in ("none", "dual")}
    assert full[:2] == ["llada-8b/b1/none/reduce-overhead/4L/tdlm", "llada-8b/b1/none/compiled-static/4L/tdlm"]
    for policy in ("threshold", "tdlm"):  # every pair runs each policy once, across the default and opt-in sets
        assert sum(policy in every[n]["policies"] for n in ro) == 4, policy
    for name in ro:
        assert name.replace("reduce-overhead", "compiled-static") in full, name
        if name not in full[:2]:
            assert full.index(name) > full.index("llada-8b/b8/none/eager/gen256")  # opt-in: after the default set
    assert gpu_check_plan.compile_kw("reduce-overhead", False) == {"compile": "reduce-overhead", "storage": "static",
                                                              "compile_scope": "model"}  # fmt: skip
    assert gpu_check_plan.compile_kw("reduce-overhead", True) == {"compile": "eager", "storage": "static",
                                                             "compile_scope": "model"}  # fmt: skip
    assert gpu_check_plan.compile_kw("compiled-static", False) == {"compile": True, "storage": "static",
                                                              "compile_scope": "model"}  # fmt: skip
    assert gpu_check_plan.compile_kw("compiled", False) == {"compile": True, "compile_scope": "block"}
    assert gpu_check_plan.compile_kw("compiled", True) == {"compile": "eager", "compile_scope": "block"}
    assert gpu_check_plan.compile_kw("eager", True) == {"compile": False}
    dry = [s["name"] for s in gpu_check_plan.nfe_settings(dry_run=True)]
    assert {"llada-8b/b1/none/reduce-overhead/2L", "llada-8b/b1/dual/reduce-overhead/2L"} <= set(dry)
    real = json.loads(gpu_check_common.PREDICTION.read_text())
    sel = gpu_check_common.select_predictions(real, "h200")["gpu_check"]
    predicted = {(r["setting"], r["policy"]): r for r in real["reduce_overhead"]["rows"] if r["gpu"] == "h200"}
    for name in ro:
        base = name.split("/4L")[0]  # true_shape.json names the settings at full depth, both policies
        model, b, cache, _ = base.split("/")
        for policy in every[name]["policies"]:
            pm = sel[(model, int(b[1:]), cache)][f"{policy}_ms_per_nfe"]
            assert 0 < pm["reduce-overhead"] == pm["cuda_graphs"] < pm["compiled"], (name, pm)
            r = predicted[(base, policy)]
            assert r["versus"] == base.replace("reduce-overhead", "compiled-static") and r["gpu"] == "h200"
            assert r["static_versus"] == base.replace("reduce-overhead", "compiled")
            assert r["reduce_overhead_ms_per_nfe"] == pm["reduce-overhead"] and 0 < r["ratio_added"] < 1
            assert r["compile_true_ms_per_nfe"] == pm["compiled-static"] and r["static_over_dynamic"] == 1.0


def test_the_default_set_fits_the_default_budget_and_answers_the_issues_questions():
    """By the check's own prediction (cold compiles per setting, nfe_plan): the nfe stage starts after the start-up
    and the training stages at their caps, and every setting of the default set ends before the default 420 s (less
    the reserve): the reduce-overhead / compiled-static pair, LLaDA's compiled batch 1 (kernels per NFE, host time
    per launch, ms/NFE against the GPU's rows), eager batch 1 and the decode memory. What does not fit is opt-in
    (--all-settings), in a known order, the rows that diverge first. compile=True settings compile by block (the
    faster scope); reduce-overhead and its pair at the model scope, which block refuses for CUDA graphs."""
    plan = gpu_check_plan.nfe_plan()
    default = gpu_check_plan.nfe_settings()
    assert [p["name"] for p in plan] == [s["name"] for s in default]
    budget = gpu_check_plan.DEADLINE_S["full"] - gpu_check_plan.RESERVE_S
    assert all(p["within_budget"] and p["predicted_end_s"] <= budget for p in plan), plan
    names = [p["name"] for p in plan]
    ro = next(n for n in names if "/reduce-overhead/" in n)
    assert ro.replace("reduce-overhead", "compiled-static") in names  # the pair, both inside the budget
    assert "llada-8b/b1/none/compiled" in names and "llada-8b/b8/none/eager/gen256" in names
    ends = [p["predicted_end_s"] for p in plan]
    nfe_start = gpu_check_plan.STARTUP_S + sum(gpu_check_plan.STAGE_CAP_S["full"].values())
    assert ends == sorted(ends) and ends[0] > nfe_start
    # what the default set leaves out is every other setting, named; the rows that diverge lead it
    left = gpu_check_plan.left_out()
    every = [s["name"] for s in gpu_check_plan.nfe_settings(every=True)]
    assert every == names + left and left[0] == "llada-8b/b3/dual/reduce-overhead/4L/diverge/tdlm"
    # ... because they do not fit: the first left-out setting alone overruns what the default set leaves
    diverge = gpu_check_plan.find_setting(left[0], False)
    assert ends[-1] + gpu_check_plan.predicted_seconds(diverge)["total"] > budget
    # alone after the start-up (--stages nfe --nfe-settings NAME), it does fit
    (alone,) = gpu_check_plan.nfe_plan("full", [diverge], ("nfe",))
    assert alone["within_budget"] and alone["predicted_end_s"] == pytest.approx(
        gpu_check_plan.STARTUP_S + gpu_check_plan.predicted_seconds(diverge)["total"])
    scopes = {"compiled": "block", "compiled-static": "model", "reduce-overhead": "model"}
    for s in gpu_check_plan.nfe_settings(every=True):
        assert s["scope"] == scopes.get(s["mode"]), s
        if s["scope"] == "model":  # the model scope's compile grows with depth: the depth option keeps it short
            assert s["layers"] == gpu_check_plan.RO_LAYERS["full"], s
    # the prediction itself: a 32-layer model-scope graph costs what compile_scope.json measured (120 s) per policy;
    # one policy compiles half of what two do; block scope graphs do not grow with depth
    both = gpu_check_plan.find_setting("llada-8b/b1/dual/reduce-overhead/4L", False)
    full_ro = dict(both, layers=None, cache="none", name="x")
    assert gpu_check_plan.predicted_seconds(full_ro)["compile"] == pytest.approx(2 * (46.0 + 2.3 * 32))
    assert 2 * gpu_check_plan.predicted_seconds(full_ro)["compile"] > budget - nfe_start  # why the depth option
    one = dict(full_ro, policies=("tdlm",))
    assert gpu_check_plan.predicted_seconds(one)["compile"] == pytest.approx(46.0 + 2.3 * 32)
    # the rows that diverge compile the graphs counted for them (split groups are new shapes), per policy
    per = gpu_check_plan.COMPILE_S["model_step"] + gpu_check_plan.COMPILE_S["model_layer"] * 4
    for i, policy in enumerate(gpu_check_plan.POLICIES):
        s = gpu_check_plan.find_setting(f"llada-8b/b3/dual/reduce-overhead/4L/diverge/{policy}", False)
        assert gpu_check_plan.predicted_seconds(s)["compile"] == pytest.approx(gpu_check_plan.DIVERGE_GRAPHS[i] * per)
    block = gpu_check_plan.find_setting("llada-8b/b1/none/compiled", False)
    shallow = dict(block, layers=4)
    assert gpu_check_plan.predicted_seconds(block)["compile"] == gpu_check_plan.predicted_seconds(shallow)["compile"]


def test_the_run_prints_what_the_default_set_leaves_out(tmp_path, monkeypatch, capsys):
    """The printed plan at the start of a GPU run: how many settings its prediction reaches, then each one left
    out by default; --all-settings runs them after the default set, --nfe-settings names any of them. No stage runs
    here (the stages are stubbed)."""
    ran = []
    monkeypatch.setattr(gpu_check, "run_stage", lambda stage, items, path, *a: ran.append(items) or {
        "stage": stage, "status": "ok", "items": dict.fromkeys(items, "ok"), "rows": []})
    monkeypatch.setattr(gpu_check, "beside_predicted", lambda out, dry: {})
    monkeypatch.delenv(gpu_check.T0_ENV, raising=False)
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "nfe"]) == 0
    out = capsys.readouterr().out
    default = [s["name"] for s in gpu_check_plan.nfe_settings()]
    assert ran == [default] and f"{len(default)} of {len(default)} decode settings within 420 s" in out, out
    line = next(x for x in out.splitlines() if "left out by default" in x)
    assert all(n in line for n in gpu_check_plan.left_out()) and "--all-settings" in line, line
    assert json.loads((tmp_path / "gpu_nfe.json").read_text())["left_out"] == gpu_check_plan.left_out()
    ran.clear()
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "nfe", "--all-settings"]) == 0
    out = capsys.readouterr().out
    assert ran == [[s["name"] for s in gpu_check_plan.nfe_settings(every=True)]] and "left out" not in out, out
    ran.clear()
    name = gpu_check_plan.left_out()[0]
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "nfe", "--nfe-settings", name]) == 0
    assert ran == [[name]] and "1 of 1 decode settings" in capsys.readouterr().out


def test_a_ratio_is_taken_within_one_compile_scope_and_depth(tmp_path):
    """The default run's rows: compile=True by block at full depth, compiled-static and reduce-overhead at the model
    scope and 4 layers. reduce-overhead / compiled-static pairs (same scope and depth; ms/NFE extrapolated x8 for the
    printed row, the ratio as measured); compiled-static / compiled does not (another scope and depth): no number,
    a reason."""
    def row(mode: str, ms: float, layers: int | None) -> dict:
        name = f"llada-8b/b1/none/{mode}" + (f"/{layers}L" if layers else "")
        return {"item": name, "model": "llada-8b", "batch": 1, "cache": "none", "mode": mode, "purpose": "speed",
                "scope": gpu_check_plan.compile_scope(mode), "threshold_ms_per_nfe": ms, "tdlm_ms_per_nfe": ms,
                **({"layers": layers, "full_layers": 32, "threshold_ms_per_nfe_full_depth": ms * 32 / layers,
                    "tdlm_ms_per_nfe_full_depth": ms * 32 / layers} if layers else {})}  # fmt: skip

    rows = [row("reduce-overhead", 1.0, 4), row("compiled-static", 1.5, 4), row("compiled", 9.0, None)]
    gpu_check_common.write_json(tmp_path / "gpu_nfe_dryrun.json", {"stage": "nfe", "status": "ok", "rows": rows})
    out = {r["what"]: r for r in gpu_check_compare.beside_predicted(tmp_path, True)["rows"]}
    ro = out["reduce-overhead/compiled-static llada-8b b1 none tdlm"]
    assert ro["measured"] == pytest.approx(1.0 / 1.5) and ro["pairs"][1] == "llada-8b/b1/none/compiled-static/4L"
    static = out["compiled-static/compiled llada-8b b1 none tdlm"]
    assert static["measured"] is None and static["pairs"][1] is None and "model scope" in static["unpaired"], static
    assert out["ms/NFE llada-8b b1 none reduce-overhead tdlm (at 4 of 32 layers, x8)"]["measured"] == 8.0
    doc = {"rows": [dict(r) for r in rows]}
    gpu_check_stages.nfe_summary(doc)  # the child's own ratios follow the same rule
    assert "tdlm_reduce_overhead_over_compiled_static" in doc["rows"][0]
    assert "tdlm_compiled_static_over_compiled" not in doc["rows"][1]


def test_a_reduce_overhead_row_is_compared_with_its_prediction_and_its_compile_true_setting(tmp_path):
    """reduce-overhead is held to compile=True on the same static plan (CUDA graphs alone), never to the dynamic
    compile=True (which would mix in the storage plan); static / dynamic is its own ratio."""
    rows = [{"item": f"llada-8b/b8/dual/{mode}", "model": "llada-8b", "batch": 8, "cache": "dual", "mode": mode,
             "purpose": "speed", "threshold_ms_per_nfe": ms, "tdlm_ms_per_nfe": ms * 1.02}
            for mode, ms in (("compiled", 9.0), ("reduce-overhead", 6.3), ("compiled-static", 8.0))]  # fmt: skip
    gpu_check_common.write_json(tmp_path / "gpu_nfe_dryrun.json", {"stage": "nfe", "status": "ok", "rows": rows})
    from gpu_check_compare import beside_predicted

    out = {r["what"]: r for r in beside_predicted(tmp_path, True)["rows"]}
    real = json.loads(gpu_check_common.PREDICTION.read_text())
    pred = {(r["setting"], r["policy"]): r for r in real["reduce_overhead"]["rows"] if r["gpu"] == "h200"}  # dry run
    for policy in ("threshold", "tdlm"):
        p = pred[("llada-8b/b8/dual/reduce-overhead", policy)]
        ms = out[f"ms/NFE llada-8b b8 dual reduce-overhead {policy}"]
        assert ms["predicted"] == p["reduce_overhead_ms_per_nfe"] and ms["measured"] == rows[1][f"{policy}_ms_per_nfe"]
        ratio = out[f"reduce-overhead/compiled-static llada-8b b8 dual {policy}"]
        assert ratio["measured"] == pytest.approx(6.3 / 8.0) and ratio["predicted"] == pytest.approx(p["ratio_added"])
        assert ratio["predicted_overlapped"] == pytest.approx(p["ratio_overlapped"])
        assert ratio["pairs"] == ["llada-8b/b8/dual/reduce-overhead", "llada-8b/b8/dual/compiled-static"]
        assert out[f"ms/NFE llada-8b b8 dual compiled-static {policy}"]["predicted"] == p["compile_true_ms_per_nfe"]
        static = out[f"compiled-static/compiled llada-8b b8 dual {policy}"]
        assert static["measured"] == pytest.approx(8.0 / 9.0) and static["predicted"] == p["static_over_dynamic"]
        assert static["pairs"] == ["llada-8b/b8/dual/compiled-static", "llada-8b/b8/dual/compiled"]
    assert not any(w.startswith("reduce-overhead/compiled ") for w in out)  # no ratio over the dynamic plan


def test_gpu_names_select_only_their_own_prediction_rows():
    assert gpu_check_common.gpu_kind("NVIDIA H200") == "h200"
    assert gpu_check_common.gpu_kind("NVIDIA GH200 480GB") == "gh200"
    assert gpu_check_common.gpu_kind("NVIDIA GH200 144G HBM3e") == "gh200"
    assert gpu_check_common.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"  # the SXM part, as torch names it
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "", None):
        assert gpu_check_common.gpu_kind(other) is None, other
    pred = {
        "gpu_check": {"gpu": "h200", "rows": [
            {"model": "llada-8b", "batch": 1, "cache": "none", "threshold_ms_per_nfe": {"compiled": 7.0}},
            {"model": "llada-8b", "batch": 1, "cache": "dual", "gpu": "gh200",
             "threshold_ms_per_nfe": {"compiled": 9.0}},
            {"model": "llada-8b", "batch": 8, "cache": "dual", "gpu": "h100",
             "threshold_ms_per_nfe": {"compiled": 11.0}},
        ]},
        "nfe": {"llada-8b": {"per_nfe_ms": {"backbone|none": {"h200": {"eager": 17.0}, "gh200": {"eager": 18.0},
                                                              "h100": {"eager": 21.0}}},
                             "compiled_kernels": {"backbone": 418},
                             "launch_us_at_target_by_gpu": {"h200": {"none|launch": 3.7},
                                                            "h100": {"none|launch": 2.9}}}},
        "decode_memory": {"llada-8b": {"rows": [{"policy": "tdlm", "history": "full", "cache": "none", "batch": 8,
                                                 "peak": {"Total": 1}}]}},
        "launch_us": 5.0,
    }  # fmt: skip
    h200 = gpu_check_common.select_predictions(pred, gpu_check_common.gpu_kind("NVIDIA H200"))
    assert set(h200["gpu_check"]) == {("llada-8b", 1, "none")}
    assert h200["per_nfe"][("llada-8b", "backbone", "none")] == {"eager": 17.0}
    gh200 = gpu_check_common.select_predictions(pred, gpu_check_common.gpu_kind("NVIDIA GH200 480GB"))
    assert set(gh200["gpu_check"]) == {("llada-8b", 1, "dual")}  # never the H200 section's rows
    assert gh200["per_nfe"][("llada-8b", "backbone", "none")] == {"eager": 18.0}
    h100 = gpu_check_common.select_predictions(pred, gpu_check_common.gpu_kind("NVIDIA H100 80GB HBM3"))
    assert set(h100["gpu_check"]) == {("llada-8b", 8, "dual")}
    assert h100["per_nfe"][("llada-8b", "backbone", "none")] == {"eager": 21.0}
    assert h100["launch_us_at_target"]["llada-8b"] == {"none|launch": 2.9}
    # a GPU true_shape does not model: no time row, but every GPU-independent one (memory, kernels, launch cost)
    other = gpu_check_common.select_predictions(pred, gpu_check_common.gpu_kind("NVIDIA A100-SXM4-80GB"))
    assert other["gpu_check"] == {} and other["per_nfe"] == {} and other["launch_us_at_target"] == {}
    assert other["decode_memory"] == h200["decode_memory"] == {("llada-8b", "tdlm", "full", "none", 8):
                                                               pred["decode_memory"]["llada-8b"]["rows"][0]}
    assert other["kernels"] == {"llada-8b": {"backbone": 418}} and other["launch_us"] == 5.0
    real = json.loads(gpu_check_common.PREDICTION.read_text())  # today's file: rows of every GPU it models
    assert set(real["gpus"]) == set(gpu_check_common.GPU_KINDS)  # true_shape's GPUS, each a kind gpu_kind names
    n_settings = len({(r["model"], r["batch"], r["cache"]) for r in real["gpu_check"]["rows"]})
    for kind in gpu_check_common.GPU_KINDS:
        assert len(gpu_check_common.select_predictions(real, kind)["gpu_check"]) == n_settings, kind


def _stage_docs(out: Path, gpu_name: str) -> None:
    """The three stage JSONs a real run on ``gpu_name`` would leave (made-up measurements, real setting names)."""
    machine = {"name": gpu_name}
    write = gpu_check_common.write_json
    write(out / "gpu_train.json", {"stage": "train", "status": "ok", "machine": machine,
                                   "rows": [{"item": "all", "layers": "all", "measured": 40 * 2**30,
                                             "predicted": 41 * 2**30}]})  # fmt: skip
    write(out / "gpu_deepspeed.json", {"stage": "deepspeed", "status": "ok", "machine": machine,
                                       "rows": [{"item": "zero3", "layers": "dispersed:16",
                                                 "max_allocated": 30 * 2**30, "planner": {"total": 31 * 2**30}}]})
    speed = {"item": "llada-8b/b1/none/compiled", "model": "llada-8b", "batch": 1, "cache": "none",
             "mode": "compiled", "purpose": "speed", "threshold_ms_per_nfe": 8.0, "tdlm_ms_per_nfe": 8.3,
             "tdlm_launches": {"kernels_per_nfe_compiled": 480.0, "host_us_per_launch": 4.0}}  # fmt: skip
    memory = {"item": "llada-8b/b8/none/eager/gen256", "model": "llada-8b", "batch": 8, "cache": "none",
              "mode": "eager", "purpose": "memory", "gen_length": 256,
              "threshold_memory": {"decode_peak": 20 * 2**30}, "tdlm_memory": {"decode_peak": 22 * 2**30}}
    write(out / "gpu_nfe.json", {"stage": "nfe", "status": "ok", "machine": machine, "block_size": 32,
                                 "rows": [speed, memory]})  # fmt: skip


GPU_INDEPENDENT = ("train peak, llada-8b all, one process", "DeepSpeed peak, dispersed:16, ZeRO-3 one rank",
                   "decode peak llada-8b b8 none gen256 threshold", "decode peak llada-8b b8 none gen256 tdlm",
                   "kernels/NFE in compiled region llada-8b b1 none tdlm", "host µs/launch llada-8b b1 none tdlm")


def test_an_h100_is_held_to_the_h100_rows_and_any_gpu_to_the_gpu_independent_ones(tmp_path):
    """A run on an H100 prints the H100 time predictions (not the H200's), and every run, an unknown GPU's too,
    prints the memory, planner and kernel-count predictions, which do not depend on the GPU."""
    from gpu_check_compare import beside_predicted

    real = json.loads(gpu_check_common.PREDICTION.read_text())
    by_gpu = {r["gpu"]: r for r in real["gpu_check"]["rows"] if (r["model"], r["batch"], r["cache"]) ==
              ("llada-8b", 1, "none")}  # fmt: skip
    seen = {}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"):
        out = tmp_path / name.split()[1]
        out.mkdir()
        _stage_docs(out, name)
        result = beside_predicted(out, False)
        seen[name] = rows = {r["what"]: r for r in result["rows"]}
        for what in GPU_INDEPENDENT:
            assert rows[what]["predicted"] and rows[what]["predicted"] > 0, (name, rows[what])
        assert rows["train peak, llada-8b all, one process"]["planner"] == 41.0
        assert rows["DeepSpeed peak, dispersed:16, ZeRO-3 one rank"]["predicted"] == 31.0
    h100, other = seen["NVIDIA H100 80GB HBM3"], seen["NVIDIA A100-SXM4-80GB"]
    ms = h100["ms/NFE llada-8b b1 none compiled tdlm"]
    h100_ms, h200_ms = (by_gpu[g]["tdlm_ms_per_nfe"]["compiled"] for g in ("h100", "h200"))
    assert ms["predicted"] == h100_ms > h200_ms  # less bandwidth than an H200
    assert ms["predicted_cuda_graphs"] == by_gpu["h100"]["tdlm_ms_per_nfe"]["cuda_graphs"]
    assert h100["host µs/launch llada-8b b1 none tdlm"]["holds_up_to_added"] is not None
    assert other["ms/NFE llada-8b b1 none compiled tdlm"]["predicted"] is None  # time rows need a modelled GPU
    assert other["host µs/launch llada-8b b1 none tdlm"]["holds_up_to_added"] is None
    for what in GPU_INDEPENDENT:  # the same predictions whichever GPU ran them
        assert other[what]["predicted"] == h100[what]["predicted"], what
    pvm = json.loads((tmp_path / "A100-SXM4-80GB" / "predicted_vs_measured.json").read_text())
    assert pvm["gpu_kind"] is None and "GPU-independent" in pvm["gpu_rows"]


def test_kernels_and_host_time_are_counted_inside_the_compiled_region_only():
    us = 1000  # ns
    ev = [  # (name, start_ns, duration_ns, on_device, correlation_id)
        ("Torch-Compiled Region: 0/0", 0, 100 * us, False, 1),
        ("cudaLaunchKernel", 10 * us, 2 * us, False, 11),
        ("cuLaunchKernel", 50 * us, 4 * us, False, 12),
        ("cudaMemcpyAsync", 60 * us, 1 * us, False, 13),
        ("cudaLaunchKernel", 150 * us, 2 * us, False, 14),  # the loop's own eager kernel, outside
        ("Torch-Compiled Region: 0/0", 200 * us, 100 * us, False, 2),
        ("cuLaunchKernelEx", 250 * us, 2 * us, False, 15),
        ("triton_poi_fused_0", 20 * us, 5 * us, True, 11),
        ("ampere_bf16_gemm", 60 * us, 9 * us, True, 12),
        ("Memcpy HtoD (Pageable -> Device)", 61 * us, 1 * us, True, 13),
        ("elementwise_kernel", 160 * us, 1 * us, True, 14),
        ("triton_red_fused_1", 260 * us, 3 * us, True, 15),
        ("cudaGraphLaunch", 320 * us, 3 * us, False, 16),  # a CUDA graph replayed: neither a kernel nor a launch
        ("cuGraphLaunch", 330 * us, 3 * us, False, 17),
    ]
    out = gpu_check_stages.region_counts(ev, evals=2)
    assert out["kernels_per_nfe_compiled"] == 1.5 and out["kernels_per_nfe_compiled_device"] == 1.5
    assert out["launches_outside_per_nfe"] == 0.5 and out["kernels_per_nfe_all"] == 2.0
    assert out["copies_in_region_per_nfe"] == 0.5 and out["regions_per_nfe"] == 1.0
    assert out["host_us_per_launch"] == 200 / 3  # the regions' host wall / the kernels launched inside them
    assert out["launch_api_us_mean"] == 8 / 3 and out["region_host_ms_per_nfe"] == 0.1
    assert out["graph_launches"] == 2 and out["graph_launches_per_nfe"] == 1.0


def test_a_decode_setting_records_inductors_cudagraph_skips_and_its_graph_launches(monkeypatch):
    """Every decode of a setting (the untimed one, the timed one, the profiled one) counts toward its
    ``<policy>_cudagraph_skips``; a reduce-overhead setting is profiled for its graph launches. A fake decode stands
    in for tdlm.decode and skips one graph per call, as inductor does when a graph cannot be captured."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    import tdlm

    monkeypatch.delenv(gpu_check.HOOKS_ENV, raising=False)
    ctx = gpu_check_stages.build_context("nfe", True)  # the toy backbone on the CPU
    calls = []

    def decode(target, req, **kw):
        calls.append(kw)
        counters["inductor"]["cudagraph_skips"] += 1
        return [SimpleNamespace(nfe=4) for _ in req]

    monkeypatch.setattr(tdlm, "decode", decode)
    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", counters["inductor"]["cudagraph_skips"])
    row = gpu_check_stages.nfe_item(ctx, "llada-8b/b1/none/reduce-overhead/2L", lambda r: None)
    assert len(calls) == 6 and all(kw["storage"] == "static" for kw in calls)  # 2 policies x (warm-up, timed, profile)
    for policy in ("threshold", "tdlm"):
        assert row[f"{policy}_cudagraph_skips"] == 3, row
        assert row[f"{policy}_launches"]["graph_launches"] == 0  # a CPU replays no CUDA graph
        why = gpu_check_compare.cuda_graph_proof(row, policy)
        assert "skipped CUDA graphs 3 times" in why and "no cudaGraphLaunch" in why, why
    monkeypatch.setattr(tdlm, "decode", lambda target, req, **kw: [SimpleNamespace(nfe=4) for _ in req])
    row = gpu_check_stages.nfe_item(ctx, "llada-8b/b1/none/compiled-static/2L", lambda r: None)
    assert row["tdlm_cudagraph_skips"] == 0 and "tdlm_launches" not in row  # recorded for every mode


def test_a_reduce_overhead_number_is_a_cuda_graph_number_only_when_proven(tmp_path):
    """A reduce-overhead row whose decodes skipped a CUDA graph, or whose profile replayed none, is marked in the
    comparison as not a CUDA-graph number, its ratio too; one with no skip and graph launches is not marked."""
    from gpu_check_compare import beside_predicted

    def row(batch: int, mode: str, ms: float, skips: int | None = None, graphs: int | None = None) -> dict:
        r = {"item": f"llada-8b/b{batch}/dual/{mode}", "model": "llada-8b", "batch": batch, "cache": "dual",
             "mode": mode, "purpose": "speed", "threshold_ms_per_nfe": ms, "tdlm_ms_per_nfe": ms}  # fmt: skip
        for policy in ("threshold", "tdlm"):
            if skips is not None:
                r[f"{policy}_cudagraph_skips"] = skips
            if graphs is not None:
                r[f"{policy}_launches"] = {"graph_launches": graphs, "graph_launches_per_nfe": graphs / 64}
        return r

    rows = [row(1, "compiled-static", 5.0), row(1, "reduce-overhead", 4.0, skips=2, graphs=64),
            row(8, "compiled-static", 9.0), row(8, "reduce-overhead", 6.0, skips=0, graphs=64),
            row(8, "compiled", 8.5, skips=0)]  # fmt: skip
    gpu_check_common.write_json(tmp_path / "gpu_nfe_dryrun.json", {"stage": "nfe", "status": "ok", "rows": rows})
    out = {r["what"]: r for r in beside_predicted(tmp_path, True)["rows"]}
    for policy in ("threshold", "tdlm"):
        for what in (f"ms/NFE llada-8b b1 dual reduce-overhead {policy}",
                     f"reduce-overhead/compiled-static llada-8b b1 dual {policy}"):  # fmt: skip
            assert "skipped CUDA graphs 2 times" in out[what]["not_cuda_graphs"], out[what]
        for what in (f"ms/NFE llada-8b b8 dual reduce-overhead {policy}",
                     f"reduce-overhead/compiled-static llada-8b b8 dual {policy}"):  # fmt: skip
            assert out[what]["not_cuda_graphs"] is None, out[what]
        assert "not_cuda_graphs" not in out[f"ms/NFE llada-8b b8 dual compiled {policy}"]
    no_graph = row(8, "reduce-overhead", 6.0, skips=0, graphs=0)
    assert "no cudaGraphLaunch" in gpu_check_compare.cuda_graph_proof(no_graph, "tdlm")
    unrecorded = row(8, "reduce-overhead", 6.0, graphs=64)
    assert "not recorded" in gpu_check_compare.cuda_graph_proof(unrecorded, "tdlm")


def test_the_planted_head_row_makes_the_rows_finish_apart_and_is_put_back(monkeypatch):
    """The divergent-rows setting's plant on the toy backbone, decoded eagerly as the setting does (3 requests: the
    static plan's bucket 4, dual cache): request 0 finishes evaluations before the others, which finish together
    (one token per evaluation); without the plant every row finishes at the same evaluation; the head row is the
    same tensor, with the same values, afterwards."""
    import torch

    import tdlm

    monkeypatch.delenv(gpu_check.HOOKS_ENV, raising=False)
    ctx = gpu_check_stages.build_context("nfe", True)
    bb = ctx.backbone
    gen = torch.Generator().manual_seed(3008)
    rows = torch.randint(3, 500, (3, 8), generator=gen).tolist()
    req = [r[: 8 - (i * 8) // 6] for i, r in enumerate(rows)]  # left-padded, as nfe_item builds them
    kw = dict(policy="threshold", cache="dual", gen_length=16, block_size=8, threshold=0.9, storage="static")
    head = bb.model.transformer.ff_out.weight
    before, ptr = head.detach().clone(), head.data_ptr()
    plain = [r.nfe for r in tdlm.decode(bb, req, **kw)]
    assert len(set(plain)) == 1, plain  # random weights: lockstep
    with gpu_check_nfe.plant_divergence(bb, req, 16, ctx.device) as plant:
        planted = [r.nfe for r in tdlm.decode(bb, req, **kw)]
    assert planted[0] < min(planted[1:]) and planted[1:] == plain[1:], planted
    assert plant["peaked_request"] == 0 and abs(max(plant["other_requests_logit_at_mean"], key=abs)) < 1e-6, plant
    assert head.data_ptr() == ptr and torch.equal(head.detach(), before)  # put back in place: no graph re-recorded


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


def test_a_one_policy_setting_runs_and_is_compared_for_that_policy_only(tmp_path, monkeypatch):
    """The default set's pair runs tdlm only (its name ends in the policy): the setting decodes that policy alone,
    and the comparison pairs each policy with the row that ran it, even when another setting of the paired mode ran
    the other policy (the opt-in threshold twin)."""
    from types import SimpleNamespace

    import tdlm

    monkeypatch.delenv(gpu_check.HOOKS_ENV, raising=False)
    ctx = gpu_check_stages.build_context("nfe", True)
    one = {m: gpu_check_plan._setting("llada-8b", 1, "none", m, layers=2, policies=("tdlm",))
           for m in ("reduce-overhead", "compiled-static")}  # fmt: skip
    assert one["reduce-overhead"]["name"] == "llada-8b/b1/none/reduce-overhead/2L/tdlm"
    monkeypatch.setattr(gpu_check_nfe, "find_setting", lambda name, dry: next(s for s in one.values()
                                                                              if s["name"] == name))  # fmt: skip
    calls = []
    monkeypatch.setattr(tdlm, "decode", lambda target, req, **kw: calls.append(kw["policy"]) or [
        SimpleNamespace(nfe=4) for _ in req])
    rows = [gpu_check_stages.nfe_item(ctx, s["name"], lambda r: None) | {"item": s["name"]} for s in one.values()]
    assert calls == ["tdlm"] * 5  # reduce-overhead: warm-up, timed, profiled; compiled-static: warm-up, timed
    assert all(not any(k.startswith("threshold_") for k in r) and r["policies"] == ("tdlm",) for r in rows), rows
    twin = dict(rows[1], item="llada-8b/b1/none/compiled-static/2L/threshold", policies=["threshold"])
    twin = {k: v for k, v in twin.items() if not k.startswith("tdlm_")} | {"threshold_ms_per_nfe": 99.0}
    gpu_check_common.write_json(tmp_path / "gpu_nfe_dryrun.json",
                                {"stage": "nfe", "status": "ok", "rows": [rows[0], rows[1], twin]})  # fmt: skip
    out = {r["what"]: r for r in gpu_check_compare.beside_predicted(tmp_path, True)["rows"]}
    ratio = out["reduce-overhead/compiled-static llada-8b b1 none tdlm"]
    assert ratio["pairs"] == [rows[0]["item"], rows[1]["item"]] and ratio["measured"] == pytest.approx(
        rows[0]["tdlm_ms_per_nfe"] / rows[1]["tdlm_ms_per_nfe"]), ratio
    ms = {w for w in out if w.startswith("ms/NFE llada-8b b1 none reduce-overhead")}  # the policy it ran, no other
    assert ms == {"ms/NFE llada-8b b1 none reduce-overhead tdlm (at 2 of 8 layers, x4)"}, ms


def test_docs_gpu_md_states_the_default_set_as_the_plan_predicts_it():
    """docs/gpu.md's table of the default run (setting, policies, predicted compile, predicted end) and its prose
    numbers are the check's own prediction (nfe_plan), so a change of the set, its order or COMPILE_S shows here."""
    text = (REPO / "docs" / "gpu.md").read_text()
    lines = text[text.index("| setting (default run, in order) |"):].split("\n\n")[0].splitlines()[2:]
    got = [[c.strip().strip("`") for c in line.strip("|").split("|")][:4] for line in lines]
    plan = gpu_check_plan.nfe_plan()
    policies = {s["name"]: s["policies"] for s in gpu_check_plan.nfe_settings()}
    want = [[p["name"], "both" if len(policies[p["name"]]) == 2 else policies[p["name"]][0],
             f"{p['predicted_compile_s']:.0f} s" if p["predicted_compile_s"] else "0",
             f"{p['predicted_end_s']:.0f} s"] for p in plan]  # fmt: skip
    assert got == want, (got, want)
    budget = gpu_check_plan.DEADLINE_S["full"] - gpu_check_plan.RESERVE_S
    nfe_start = gpu_check_plan.STARTUP_S + sum(gpu_check_plan.STAGE_CAP_S["full"].values())
    diverge = gpu_check_plan.find_setting(gpu_check_plan.left_out()[0], False)
    (alone,) = gpu_check_plan.nfe_plan("full", [diverge], ("nfe",))
    pair_end = next(p["predicted_end_s"] for p in plan if "/compiled-static/" in p["name"])
    full_ro = dict(gpu_check_plan.nfe_settings()[0], layers=None, policies=gpu_check_plan.POLICIES)  # 32 layers, both
    quick = gpu_check_plan.nfe_plan("quick")
    prose = " ".join(text.split())
    for said in (f"starts at {nfe_start:.0f} s at the latest", f"ends by {plan[-1]['predicted_end_s']:.0f} s of the "
                 f"{budget:.0f} s", f"{gpu_check_plan.predicted_seconds(diverge)['compile']:.0f} s, more than the "
                 f"{budget - pair_end:.0f} s the pair leaves", f"predicted to end by {alone['predicted_end_s']:.0f} s",
                 f"need {gpu_check_plan.predicted_seconds(full_ro)['compile']:.0f} s of compiling alone",
                 f"the whole nfe share ({budget - nfe_start:.0f} s)", f"it reaches both in "
                 f"{gpu_check_plan.DEADLINE_S['quick']:.0f} s, by {quick[-1]['predicted_end_s']:.0f} s"):  # fmt: skip
        assert said in prose, said


def test_the_compile_constants_are_read_from_compile_scope_json():
    """COMPILE_S (the check's compile-time prediction) is this CPU's bench/results/compile_scope.json: the model
    scope's 4- and 32-layer cold compiles as a per-step and a per-layer cost, the block scope's per region graph at
    32 layers (the deeper, slower one)."""
    rows = {r["layers"]: r for r in json.loads((REPO / "bench/results/compile_scope.json").read_text())["rows"]}
    m4, m32 = rows[4]["model"], rows[32]["model"]
    assert m4["graphs"] == m32["graphs"] == 1
    per_layer = (m32["compile_s"] - m4["compile_s"]) / 28
    block = rows[32]["block"]["compile_s"] / rows[32]["block"]["graphs"]
    assert gpu_check_plan.COMPILE_S == pytest.approx({"model_step": m4["compile_s"] - 4 * per_layer,
                                                 "model_layer": per_layer, "block_graph": block}, rel=0.02)
