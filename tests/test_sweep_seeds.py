"""Training seeds as an axis of an allocation sweep (``seeds: [0, 1, 2]``): the config and its validation, trial names
and commands, the sweep record (resume, growth by seeds), the local runner's grid, Table 4 as mean ± sd over seeds
with two-level-bootstrap differences from the reference allocation (fake evaluation folders), and the W&B group an
allocation's seeds share (an offline run). The real 3-seed sweep is in docs/sweeps.md."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml

from tdlm.errors import TDLMError
from tdlm.evaluation.metrics import aggregate
from tdlm.evaluation.paired import compare_seeds
from tdlm.sweep import grid, load_sweep_config, plan, table4, wandb_sweep_spec, wandb_sweep_yaml
from tdlm.sweep.config import trial_slug, wandb_group

REPO = Path(__file__).resolve().parents[1]
SEEDS = "configs/sweep_tiny_seeds.yaml"
TINY = "configs/sweep_tiny.yaml"


# -- config, names, commands -----------------------------------------------------------------------------------------
def test_seeds_config_and_its_one_line_mistakes(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    cfg = load_sweep_config(SEEDS)
    assert cfg.seeds == [0, 1, 2] and cfg.allocations == ["dispersed:3", "middle:3"]
    assert load_sweep_config(TINY).seeds is None  # sweeps without seeds: one trial per allocation, as before
    bad = tmp_path / "s.yaml"
    for value, pattern in (("[0, 0, 1]", r"seeds must be a non-empty list of distinct integers >= 0 \(e.g. \[0, 1, "
                                          r"2\]\) or null; got \[0, 0, 1\]$"),
                           ("[]", r"seeds must be a non-empty list .*; got \[\]$"),
                           ("[-1]", r"seeds must be a non-empty list .*; got \[-1\]$"),
                           ("[0, a]", r"seeds: expected .*list.*; got \[0, 'a'\]$"),
                           ("3", r"seeds: expected .*list.*; got 3$")):  # fmt: skip
        bad.write_text((REPO / SEEDS).read_text().replace("seeds: [0, 1, 2]", f"seeds: {value}"))
        with pytest.raises(TDLMError, match=rf"^{re.escape(str(bad))}: {pattern}") as e:
            load_sweep_config(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(TDLMError, match=r"^override 'seeds=\[1, 1\]': seeds must be a non-empty list"):
        load_sweep_config(SEEDS, ["seeds=[1, 1]"])
    with pytest.raises(TDLMError, match=r"train_overrides must be free of train.seed when seeds are given"):
        load_sweep_config(SEEDS, ["train_overrides=[train.seed=3]"])
    load_sweep_config(TINY, ["train_overrides=[train.seed=3]"])  # without seeds the run config's seed is the sweep's


def test_trial_names_groups_and_training_command(monkeypatch, tmp_path):
    from tdlm.sweep.trial import TrialPaths, eval_config, train_command

    monkeypatch.chdir(REPO)
    cfg = load_sweep_config(SEEDS, [f"output_dir={tmp_path}"])
    p = plan(cfg, "middle:3", SEEDS, seed=2)
    assert (p.slug, p.trial, p.group, p.run.train.seed, p.run.data.seed) == (
        "middle-3", "middle-3-seed2", "tiny-seeds-middle-3", 2, 0)  # fmt: skip
    assert plan(cfg, "middle:3", SEEDS, seed=0).group == p.group != plan(cfg, "dispersed:3", SEEDS, seed=2).group
    paths = TrialPaths(tmp_path, p.trial)
    cmd = train_command(cfg, p, paths)
    assert cmd[cmd.index("--output-dir") + 1] == str(tmp_path / "train" / "middle-3-seed2")
    assert cmd[-4:] == ["wandb.group=tiny-seeds-middle-3", "wandb.name=train/middle-3-seed2", "train.seed=2",
                        "wandb.tags=[seed:2]"]
    assert eval_config(cfg, paths.eval, ["tdlm"], [f"{p.trial}={paths.adapter}"], p.group).group == p.group
    assert eval_config(cfg, paths.baselines, ["original"], []).group == "tiny-seeds"  # shared by every trial
    # without seeds: names, group and command as before seeds were an axis
    plain = plan(load_sweep_config(TINY), "middle:3", TINY)
    assert (plain.trial, plain.group, plain.seed) == ("middle-3", "tiny-table4", None)
    cmd = train_command(load_sweep_config(TINY), plain, TrialPaths(tmp_path, plain.trial))
    assert cmd[-2:] == ["wandb.group=tiny-table4", "wandb.name=train/middle-3"] and not any("seed" in c for c in cmd)
    assert (trial_slug("all", None), trial_slug("all", 0), wandb_group("e", "all", None), wandb_group("e", "all", 1)) \
        == ("all", "all-seed0", "e", "e-all")


def test_wandb_file_and_local_runner_run_every_allocation_seed_pair(monkeypatch, capsys):
    import tdlm.sweep.runner as runner
    import tdlm.sweep.table as table
    from tdlm.sweep.runner import agent_command

    monkeypatch.chdir(REPO)
    cfg = load_sweep_config(SEEDS)
    shipped = (REPO / SEEDS.replace(".yaml", ".wandb.yaml")).read_text()
    assert shipped == wandb_sweep_yaml(cfg, SEEDS), f"regenerate it: launcher/sweep.py wandb-file --config {SEEDS}"
    spec = yaml.safe_load(shipped)
    assert spec["parameters"] == {"allocation": {"values": ["dispersed:3", "middle:3"]}, "seed": {"values": [0, 1, 2]}}
    pairs = [(a, k) for a in cfg.allocations for k in cfg.seeds]
    assert [(p["allocation"], p["seed"]) for p in grid(spec, SEEDS)] == pairs
    calls = []
    monkeypatch.setattr(runner.subprocess, "call", lambda cmd, env: calls.append(cmd) or (3 if "seed=1" in cmd else 0))
    monkeypatch.setattr(table, "write_table4", lambda out: ("TABLE", Path(out) / "table4.md"))
    monkeypatch.setattr(table, "plot_sweep", lambda out: [])
    spec = wandb_sweep_spec(cfg, SEEDS, ["eval.limit=5"])
    assert runner.run_sweep(cfg, SEEDS, SEEDS, ["eval.limit=5"]) == 1
    assert calls == [agent_command(spec, {"allocation": a, "seed": k}) for a, k in pairs]
    assert calls[1][-3:] == ["eval.limit=5", "allocation=dispersed:3", "seed=1"]
    captured = capsys.readouterr()
    assert "=== [2/6] allocation dispersed:3, training seed 1: 3 layers, 98,307 parameters" in captured.out
    assert "failed trials: dispersed:3, training seed 1 (exit 3), middle:3, training seed 1 (exit 3)" in captured.err


def test_trial_command_line_names_its_seed_or_refuses_in_one_line(monkeypatch, capsys):
    from tdlm.sweep.cli import main

    monkeypatch.chdir(REPO)
    for args, message in (
        ([SEEDS, "allocation=all"], "error: trial: give seed=K, one of the sweep's seeds [0, 1, 2]"),
        ([SEEDS, "allocation=all", "seed=5"], "error: trial: give seed=K, one of the sweep's seeds [0, 1, 2]; got 5"),
        ([SEEDS, "allocation=all", "seed=one"], "error: trial: seed=one: expected an integer training seed"),
        ([TINY, "allocation=all", "seed=1"], "error: trial: seed=1 needs a sweep with seeds (seeds: [0, 1, 2]); this "
                                             "one has none"),
    ):
        assert main(["trial", "--config", *args, "wandb_mode=disabled", "output_dir=/nonexistent/x"]) == 2
        assert capsys.readouterr().err.strip() == message


def test_sweep_record_resumes_grows_by_seeds_and_refuses_another_seed_layout(monkeypatch, tmp_path):
    from tdlm.sweep.trial import ensure_sweep_record

    monkeypatch.chdir(REPO)
    out = tmp_path / "sweep"
    two = load_sweep_config(SEEDS, [f"output_dir={out}", "seeds=[0, 1]"])
    rec = ensure_sweep_record(two, SEEDS, "sha256:x")
    assert rec["seeds"] == {"train": [0, 1], "data": 0} and "seeds" not in rec["settings"]
    assert ensure_sweep_record(two, SEEDS, "sha256:x") == rec  # a rerun (resume) is the same sweep
    three = load_sweep_config(SEEDS, [f"output_dir={out}", "seeds=[2, 0, 1]"])
    assert ensure_sweep_record(three, SEEDS, "sha256:x")["seeds"]["train"] == [0, 1, 2]
    assert json.loads((out / "sweep.json").read_text())["seeds"] == {"train": [0, 1, 2], "data": 0}
    plain = load_sweep_config(SEEDS, [f"output_dir={out}", "seeds=null"])
    with pytest.raises(TDLMError, match=r"holds a sweep with other settings or trajectories \(seeds: \{'train': \[0, "
                                        r"1, 2\], 'data': 0\} -> \{'train': 0, 'data': 0\}\)"):
        ensure_sweep_record(plain, SEEDS, "sha256:x")
    # a folder written before seeds were an axis (its settings have no "seeds" key) resumes as before
    old = tmp_path / "old"
    cfg = load_sweep_config(TINY, [f"output_dir={old}"])
    rec = ensure_sweep_record(cfg, TINY, "sha256:y")
    legacy = {**rec, "settings": {k: v for k, v in rec["settings"].items() if k != "seeds"}}
    (old / "sweep.json").write_text(json.dumps(legacy))
    assert ensure_sweep_record(cfg, TINY, "sha256:y") == legacy


# -- Table 4 over seeds, from fake evaluation folders -------------------------------------------------------------
N = 200


def _write_run(out: Path, name: str, policy: str, correct, nfe: float, seconds: float, **kw) -> None:
    d = out / "runs" / "arith" / name
    d.mkdir(parents=True)
    samples = [{"id": f"arith/{j:04d}", "correct": bool(c), "nfe": nfe, "seconds": seconds}
               for j, c in enumerate(correct)]  # fmt: skip
    (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    summary = {"name": name, "run_dir": str(d), "task": "arith", "backbone": "tiny-arith", "gen_length": 40,
               "block_size": 40, "task_source": "local:arith.jsonl sha256=ab", "policy": policy, **kw,
               **aggregate(samples)}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))


def _fake_seeded_sweep(root: Path) -> tuple[Path, dict]:
    """Three allocations x seeds 0-2 (seed 2 of `all` failed to train) and the baselines; returns the folder and
    each trial's correctness."""
    rng = np.random.default_rng(21)
    sweep = root / "sweep"
    accuracy = {"dispersed:2": 0.6, "middle:3": 0.62, "all": 0.95}
    layers = {"dispersed:2": [1, 4], "middle:3": [1, 2, 3], "all": [0, 1, 2, 3, 4, 5]}
    correct: dict[str, np.ndarray] = {}
    for alloc, acc in accuracy.items():
        for k in (0, 1, 2):
            s = trial_slug(alloc.replace(":", "-"), k)
            record = {"slug": s, "allocation_slug": alloc.replace(":", "-"), "seed": k, "allocation": alloc,
                      "layers": layers[alloc], "temporal_parameters": 100 * len(layers[alloc]), "status": "done"}
            if alloc == "all" and k == 2:
                record |= {"status": "training failed", "error": "out of memory: CUDA out of memory"}
            else:
                correct[s] = rng.random(N) < acc
                _write_run(sweep / "eval" / s, f"tdlm-{s}-tau0.9-full", "tdlm", correct[s], 5.0 + k / 10,
                           0.04 + k / 100, threshold=0.9, adapter_label=s, history="full")  # fmt: skip
            (sweep / "trials" / s).mkdir(parents=True)
            (sweep / "trials" / s / "trial.json").write_text(json.dumps(record))
    correct["original"] = rng.random(N) < 0.61
    correct["threshold"] = rng.random(N) < 0.6
    _write_run(sweep / "eval" / "baselines", "original", "original", correct["original"], 40.0, 0.27, threshold=None)
    _write_run(sweep / "eval" / "baselines", "threshold-tau0.9", "threshold", correct["threshold"], 5.0, 0.038,
               threshold=0.9)  # fmt: skip
    correct["credit"] = rng.random(N) < 0.6
    _write_run(sweep / "eval" / "baselines", "credit-tau0.9", "credit", correct["credit"], 4.0, 0.03,
               threshold=0.9)  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps({
        "experiment": "tiny-seeds", "backbone": "tiny-arith", "allocations": list(accuracy),
        "seeds": {"train": [0, 1, 2], "data": 0}, "trajectories": {"manifest": "sha256:4b446cfcba31aaaa"},
        "settings": {"train_config": "configs/tiny.yaml", "train_overrides": ["train.max_steps=60"],
                     "eval": {"tasks": ["arith"], "thresholds": [0.9], "gen_length": 40, "block_size": 40,
                              "batch_size": 1}}}))  # fmt: skip
    return sweep, correct


def test_seeded_table4_reports_mean_sd_over_seeds_and_marks_evidence(tmp_path):
    sweep, correct = _fake_seeded_sweep(tmp_path)
    table = table4(sweep)
    assert "mean ± sd over training seeds" in table and "once per training seed (0, 1, 2; data seed 0)" in table
    assert ("| Temporal layers | Parameters | Seeds | Accuracy (%) | NFE | Avg. sec | Speedup | Δacc vs 2, dispersed "
            "(1, 4) (pp) [95% CI] | Evidence |") in table
    assert "2000 resamples, seed 0" in table and "Evidence: yes only when the interval excludes 0" in table
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ")}

    def records(slugs):
        return [[{"id": f"arith/{j:04d}", "correct": bool(c)} for j, c in enumerate(correct[s])] for s in slugs]

    ref = records([f"dispersed-2-seed{k}" for k in range(3)])
    for name, alloc, seeds, evidence in (("3, middle (1, 2, 3)", "middle-3", (0, 1, 2), "no"),
                                         ("6, all (0, 1, 2, 3, 4, 5)", "all", (0, 1), "yes")):  # fmt: skip
        slugs = [f"{alloc}-seed{k}" for k in seeds]
        acc = [correct[s].mean() for s in slugs]
        sec = [0.04 + k / 100 for k in seeds]
        nfe = [5.0 + k / 10 for k in seeds]
        res = compare_seeds(records(slugs), ref)
        lo, hi = res.accuracy_diff_ci
        pp = lambda v: f"{100 * v:+.2f}".replace("-", "−")  # noqa: E731
        assert res.evidence == (evidence == "yes")
        assert rows[name].split(" | ")[2:] == [
            "3" if len(seeds) == 3 else "2 of 3 (1)",
            f"{100 * statistics.fmean(acc):.2f} ± {100 * statistics.stdev(acc):.2f}",
            f"{statistics.fmean(nfe):.2f} ± {statistics.stdev(nfe):.2f}",
            f"{statistics.fmean(sec):.3f} ± {statistics.stdev(sec):.3f}", f"{0.27 / statistics.fmean(sec):.2f}×",
            f"{pp(res.accuracy_diff)} [{pp(lo)}, {pp(hi)}]", f"{evidence} |"]  # fmt: skip
    acc = [correct[f"dispersed-2-seed{k}"].mean() for k in range(3)]
    assert rows["2, dispersed (1, 4)"].startswith(
        f"| 2, dispersed (1, 4) | 200 | 3 | {100 * statistics.fmean(acc):.2f} ± {100 * statistics.stdev(acc):.2f} |")
    assert rows["2, dispersed (1, 4)"].endswith("| reference | – |")
    assert "\n\n- (1) 6, all (0, 1, 2, 3, 4, 5), seed 2: training failed: out of memory: CUDA out of memory\n" in table
    # the baselines: one decode, compared with the reference allocation's seeds the same way
    thr = compare_seeds(records(["threshold"]), ref)
    assert rows["Fast-dLLM τ=0.9 (reference)"].startswith(
        f"| Fast-dLLM τ=0.9 (reference) | – | – | {100 * correct['threshold'].mean():.2f} | 5.00 | 0.038 | 7.11× | ")
    assert rows["Fast-dLLM τ=0.9 (reference)"].endswith(f"| {'yes' if thr.evidence else 'no'} |")
    assert rows["Original (reference)"].startswith("| Original (reference) | – | – |")
    # a training-free baseline other than threshold is named as the evaluation report names it (it once raised)
    credit = compare_seeds(records(["credit"]), ref)
    assert rows["dInfer credit τ=0.9 (reference)"].endswith(f"| {'yes' if credit.evidence else 'no'} |")


def test_table4_without_seeds_names_every_training_free_baseline(tmp_path):
    sweep, _ = _fake_seeded_sweep(tmp_path)
    record = json.loads((sweep / "sweep.json").read_text())
    (sweep / "sweep.json").write_text(json.dumps(record | {"seeds": {"train": 0, "data": 0}}))
    table = table4(sweep)
    assert "over training seeds" not in table
    assert "| dInfer credit τ=0.9 (reference) | – |" in table and "| Fast-dLLM τ=0.9 (reference) | – |" in table


def test_seeded_table4_keeps_rows_it_cannot_compare(tmp_path):
    import shutil

    sweep, _ = _fake_seeded_sweep(tmp_path)
    (sweep / "eval" / "middle-3-seed1" / "runs" / "arith" / "tdlm-middle-3-seed1-tau0.9-full" / "samples.jsonl"
     ).write_text("".join(json.dumps({"id": f"arith/{j:04d}", "correct": True}) + "\n" for j in range(N - 1)))
    shutil.rmtree(sweep / "eval" / "middle-3-seed2")  # trained, not evaluated yet (a sweep still running)
    table = table4(sweep)
    row = next(line for line in table.splitlines() if line.startswith("| 3, middle (1, 2, 3) |"))
    assert row.startswith("| 3, middle (1, 2, 3) | 300 | 2 of 3 (1) | ") and row.endswith("| – (2) | – |")
    assert "- (1) 3, middle (1, 2, 3), seed 2: not evaluated\n" in table
    assert "- (2) 3, middle (1, 2, 3) (seed run 2 of 2) and the first seed run decoded different problems" in table
    assert "- (3) 6, all (0, 1, 2, 3, 4, 5), seed 2: training failed" in table


# -- W&B: the seeds of one allocation share a group ----------------------------------------------------------------
def test_trial_runs_of_one_allocation_share_a_wandb_group_offline(monkeypatch, tmp_path):
    from tdlm.sweep.trial import trial_wandb

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_SERVICE", "")  # wandb.init exports its service's socket; removed again at teardown
    monkeypatch.delenv("WANDB_SERVICE")
    cfg = load_sweep_config(SEEDS, [f"output_dir={tmp_path}", "wandb_mode=offline"])
    p = plan(cfg, "middle:3", SEEDS, seed=1)
    record = {"status": "done", "results": [{"task": "arith", "threshold": 0.9, "accuracy": 0.5, "nfe_mean": 5.0,
                                             "seconds_mean": 0.04, "speedup_vs_original": 6.0}]}  # fmt: skip
    rec = trial_wandb(cfg, p, record, {})
    assert (rec["group"], rec["name"], rec["job_type"], rec["mode"]) == (
        "tiny-seeds-middle-3", "sweep/middle-3-seed1", "sweep-trial", "offline")  # fmt: skip
    assert "seed:1" in rec["tags"]
    import wandb

    wandb.teardown()  # the service writes the .wandb file asynchronously: on a loaded machine finish() returned
    # before its records were on disk (the file held only its header); teardown waits for the service to end
    (run_file,) = list((tmp_path / "trials" / "middle-3-seed1").glob("wandb/offline-run-*/run-*.wandb"))
    raw = run_file.read_bytes()
    for needle in (rec["id"], "tiny-seeds-middle-3", "seed:1", "train_seed"):
        assert needle.encode() in raw, needle
    assert json.loads((tmp_path / "trials" / "middle-3-seed1" / "wandb_run.json").read_text())["group"] == rec["group"]
