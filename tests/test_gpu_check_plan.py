"""bench/gpu_check_plan.py: the decode settings (default, quick, opt-in), their pairs, the stage deadlines and
caps, the predicted timeline that fits the default set into its budget, what it leaves out, and docs/gpu.md's
statement of it."""

from __future__ import annotations

import json

import pytest

from tests.gpu_check_helpers import REPO, gpu_check, gpu_check_common, gpu_check_plan


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
