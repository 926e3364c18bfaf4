"""Paired comparisons on the same problems (tdlm.evaluation.paired and the paired table of tdlm.evaluation.report):
the statistics against closed forms and known cases, pairing by sample id (never by position), the refusals, and
the table from run folders as eval/compare.py reads them."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

from tdlm.errors import TDLMError
from tdlm.evaluation.metrics import aggregate, compute_speedups
from tdlm.evaluation.paired import (
    RESAMPLES,
    SEED,
    PairingError,
    attach_paired,
    compare,
    mcnemar_exact,
    pair,
    paired_against,
    settings,
    wandb_metrics,
)
from tdlm.evaluation.report import load_runs, paired_table, render


def _recs(correct, nfe=None, seconds=None, prefix="gsm8k/", ids=None) -> list[dict]:
    n = len(correct)
    nfe = [10.0 + i % 7 for i in range(n)] if nfe is None else nfe
    seconds = [0.5 + 0.1 * (i % 5) for i in range(n)] if seconds is None else seconds
    ids = [f"{prefix}{i:04d}" for i in range(n)] if ids is None else ids
    return [{"id": ids[i], "correct": bool(correct[i]), "nfe": nfe[i], "seconds": seconds[i]} for i in range(n)]


def _discordant(b: int, c: int, both: int = 5, neither: int = 3) -> tuple[list[dict], list[dict]]:
    """Run and reference records with exactly b problems only the run solved and c only the reference solved."""
    run_c = [1] * b + [0] * c + [1] * both + [0] * neither
    ref_c = [0] * b + [1] * c + [1] * both + [0] * neither
    return _recs(run_c), _recs(ref_c)


# -- McNemar: textbook values --------------------------------------------------------------------------------------
def test_mcnemar_textbook_values():
    # b=10, c=2: 2 * P(X <= 2), X ~ Bin(12, 1/2) = 2 * (1 + 12 + 66) / 4096
    assert mcnemar_exact(10, 2) == 2 * (1 + 12 + 66) / 4096 == 0.03857421875
    assert mcnemar_exact(2, 10) == 0.03857421875  # symmetric
    assert mcnemar_exact(7, 7) == 1.0 and mcnemar_exact(0, 0) == 1.0  # b = c, and no discordant pair
    assert mcnemar_exact(5, 0) == 2 / 32  # all discordant one way: 2 * 0.5^5
    assert mcnemar_exact(1, 0) == 1.0  # 2 * 0.5 = 1
    # many discordant pairs: exact integers up to the last division (no overflow, no underflow to 0)
    assert mcnemar_exact(700, 600) == pytest.approx(2 * sum(math.comb(1300, k) for k in range(601)) / 2**1300)
    assert 0 < mcnemar_exact(1000, 0) < 1e-300
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_mcnemar_agrees_with_scipy_when_installed():
    stats = pytest.importorskip("scipy.stats")
    for b, c in ((10, 2), (3, 9), (25, 17), (0, 6), (40, 40)):
        assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-12)


def test_known_discordant_counts_from_records():
    run, ref = _discordant(10, 2)
    res = compare(run, ref)
    assert (res.run_only_correct, res.reference_only_correct, res.n) == (10, 2, 20)
    assert res.mcnemar_p == 0.03857421875
    assert res.accuracy_diff == pytest.approx((10 - 2) / 20)


# -- identical runs, closed forms -------------------------------------------------------------------------------------
def test_identical_runs_give_zero_difference_and_unit_ratios_with_zero_width():
    rng = random.Random(3)
    recs = _recs([rng.random() < 0.6 for _ in range(200)], nfe=[rng.randint(8, 64) for _ in range(200)],
                 seconds=[rng.uniform(0.1, 2.0) for _ in range(200)])  # fmt: skip
    res = compare(recs, [dict(r) for r in recs])
    assert res.accuracy_diff == 0.0 and res.accuracy_diff_ci == (0.0, 0.0)
    assert res.mcnemar_p == 1.0 and (res.run_only_correct, res.reference_only_correct) == (0, 0)
    assert res.nfe_ratio == 1.0 and res.nfe_ratio_ci == (1.0, 1.0)
    assert res.seconds_ratio == 1.0 and res.seconds_ratio_ci == (1.0, 1.0)
    assert (res.seed, res.resamples) == (SEED, RESAMPLES) == (0, 2000)


def test_halved_nfe_gives_ratio_two_exactly():
    ref = _recs([1, 0] * 50, nfe=[float(8 + i) for i in range(100)])
    run = _recs([1, 0] * 50, nfe=[float(8 + i) / 2 for i in range(100)])
    res = compare(run, ref)
    assert res.nfe_ratio == 2.0 and res.nfe_ratio_ci == (2.0, 2.0)  # halving is exact in binary floating point


def test_ratio_is_the_ratio_of_means_with_an_interval_around_it():
    rng = np.random.default_rng(5)
    ref_nfe = rng.integers(20, 100, 300).astype(float)
    run_nfe = ref_nfe * rng.uniform(0.3, 0.9, 300)
    res = compare(_recs([1] * 300, nfe=list(run_nfe)), _recs([1] * 300, nfe=list(ref_nfe)))
    assert res.nfe_ratio == pytest.approx(ref_nfe.mean() / run_nfe.mean())  # not the mean of per-problem ratios
    lo, hi = res.nfe_ratio_ci
    assert lo < res.nfe_ratio < hi and hi - lo < 0.3


def _population_draw(n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Reference right with p 0.5; the run flips wrong->right with p 0.3 and right->wrong with p 0.1:
    true difference 0.5 * 0.3 - 0.5 * 0.1 = 0.1."""
    rng = np.random.default_rng(seed)
    ref = rng.random(n) < 0.5
    u = rng.random(n)
    run = np.where(ref, u >= 0.1, u < 0.3)
    return _recs(list(run)), _recs(list(ref))


def test_bootstrap_interval_covers_the_truth_and_matches_the_normal_closed_form():
    covered = sum(lo < 0.1 < hi for lo, hi in (compare(*_population_draw(200, seed)).accuracy_diff_ci
                                               for seed in range(100)))  # fmt: skip
    assert covered >= 90  # a 95% interval: about 95 of 100 draws (88 would be 3 sd below)
    widths = {}
    for n in (250, 4000):
        run, ref = _population_draw(n, seed=13)
        lo, hi = compare(run, ref).accuracy_diff_ci
        assert lo < 0.1 < hi
        d = np.array([r["correct"] for r in run], float) - np.array([r["correct"] for r in ref], float)
        half = 1.959964 * d.std() / math.sqrt(n)  # the normal interval of a mean of n paired differences
        assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
        widths[n] = hi - lo
    assert widths[4000] < widths[250] / 3  # 16x the problems: about a quarter of the width


def test_results_are_deterministic_and_record_seed_and_resamples():
    run, ref = _population_draw(300, seed=2)
    a, b = compare(run, ref), compare(run, ref)
    assert a == b
    d = a.to_dict()
    assert (d["seed"], d["resamples"], d["confidence"]) == (0, 2000, 0.95)
    assert isinstance(d["accuracy_diff_ci"], list) and json.loads(json.dumps(d)) == d
    rng = np.random.default_rng(4)
    nfe = list(rng.uniform(10, 90, 300))
    run, ref = _recs([1] * 300, nfe=nfe), _recs([1] * 300, nfe=list(rng.uniform(10, 90, 300)))
    assert compare(run, ref, seed=1).nfe_ratio_ci != compare(run, ref).nfe_ratio_ci  # the seed is really used
    assert settings()["seed"] == 0 and settings()["resamples"] == 2000


# -- pairing by id ----------------------------------------------------------------------------------------------------
def test_pairing_is_by_id_not_by_position():
    """The same run with its records in another order (another shard layout) is the reference itself: no
    discordant problem, zero-width interval. Pairing by position, or off by one, sees discordant problems."""
    run, ref = _discordant(10, 2, both=30, neither=20)
    res = compare(run, ref)
    shuffled = list(reversed(run))
    random.Random(0).shuffle(shuffled)
    assert compare(shuffled, ref) == res  # the order of the records changes nothing
    assert (res.run_only_correct, res.reference_only_correct) == (10, 2) and res.mcnemar_p == 0.03857421875
    same = compare(list(reversed(ref)), ref)
    assert (same.run_only_correct, same.reference_only_correct) == (0, 0)
    assert same.accuracy_diff_ci == (0.0, 0.0) and same.mcnemar_p == 1.0
    pairs, _, _ = pair(shuffled, ref)
    assert all(a["id"] == b["id"] for a, b in pairs)


def test_shifted_ids_are_other_problems():
    run, ref = _discordant(10, 2)
    shifted = [{**r, "id": f"gsm8k/{int(r['id'].split('/')[1]) + 1:04d}"} for r in run]
    with pytest.raises(PairingError, match=r"different problems: 1 only in run \(gsm8k/0020\); 1 only in reference "
                                           r"\(gsm8k/0000\); 19 shared"):  # fmt: skip
        compare(shifted, ref)
    res = compare(shifted, ref, allow_subset=True)  # the caller's choice: the intersection, recorded
    assert (res.n, res.unpaired_run, res.unpaired_reference) == (19, 1, 1)


def test_pairing_refusals_are_one_line():
    run, ref = _discordant(3, 1)
    cases = [
        (run + [dict(run[0])], ref, "appears twice"),
        ([{"correct": True, "nfe": 1, "seconds": 1}], ref, "without an 'id'"),
        (_recs([1, 0], prefix="mbpp/"), ref, "share no sample id"),
        (run[:-1], ref, "1 only in reference"),
        ([{k: v for k, v in r.items() if k != "correct"} for r in run], ref, "no 'correct' field"),
    ]
    for a, b, msg in cases:
        with pytest.raises(PairingError, match=msg) as e:
            compare(a, b)
        assert "\n" not in str(e.value) and isinstance(e.value, TDLMError)


def test_missing_seconds_leave_the_ratio_out():
    run, ref = _discordant(3, 1)
    res = compare([{k: v for k, v in r.items() if k != "seconds"} for r in run], ref)
    assert res.seconds_ratio is None and res.seconds_ratio_ci is None and res.nfe_ratio is not None


# -- run dicts and the table ------------------------------------------------------------------------------------------
def _write_run(out: Path, name: str, policy: str, samples: list[dict], tau: float | None = None, **kw) -> None:
    """An evaluation output dir as the driver leaves it: runs/<task>/<name>/{samples.jsonl,summary.json}."""
    task = samples[0]["id"].split("/")[0]
    d = out / "runs" / task / name
    d.mkdir(parents=True)
    (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    summary = {"name": name, "run_dir": str(d), "task": task, "policy": policy, "threshold": tau,
               "backbone": "bb", "gen_length": 256, "block_size": 32, "task_source": "local:x.jsonl sha256=ab",
               **kw, **aggregate(samples)}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))


def _fake_pair_of_dirs(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(7)
    n = 120
    ref_c = rng.random(n) < 0.7
    ref_nfe = rng.integers(40, 90, n).astype(float)
    ref = _recs(list(ref_c), nfe=list(ref_nfe), seconds=list(ref_nfe / 50))
    tdlm_c = np.where(ref_c, rng.random(n) > 0.05, rng.random(n) < 0.3)
    tdlm = _recs(list(tdlm_c), nfe=list(ref_nfe * 0.6), seconds=list(ref_nfe * 0.6 / 45))
    orig = _recs(list(ref_c | (rng.random(n) < 0.1)), nfe=[256.0] * n, seconds=[5.0] * n)
    a, b = tmp_path / "baselines", tmp_path / "tdlm"
    _write_run(a, "original", "original", orig)
    _write_run(a, "threshold-tau0.9", "threshold", list(reversed(ref)), tau=0.9)  # another record order
    _write_run(b, "tdlm-d16-tau0.9-full", "tdlm", tdlm, tau=0.9, adapter_label="d16", history="full")
    _write_run(b, "tdlm-d16-tau0.9-last1", "tdlm", tdlm[:-1], tau=0.9, adapter_label="d16", history="last:1")
    return [a, b]


def test_table_from_run_folders(tmp_path):
    runs = compute_speedups(load_runs(_fake_pair_of_dirs(tmp_path)))
    table = paired_table(runs)
    assert "Against `threshold-tau0.9`" in table and "2000 resamples, seed 0" in table
    assert "| Δacc (pp) [95% CI] | McNemar p (b/c) | NFE ratio [95% CI] | s ratio [95% CI] |" in table
    assert "| bb | GSM8K | Fast-dLLM τ=0.9 | 120 | reference | – | – | – |" in table
    row = next(line for line in table.splitlines() if "[d16, full]" in line)
    assert "| 1.67× [1.67, 1.67] |" in row  # NFE 0.6 x the reference's on every problem: 1 / 0.6, no spread
    last1 = next(line for line in table.splitlines() if "[d16, last:1]" in line)
    assert "– (1)" in last1 and "- (1) tdlm-d16-tau0.9-last1 and threshold-tau0.9 decoded different problems" in table
    assert table in render(runs) and "## Paired comparison on the same problems" in render(runs)
    # the numbers are compare()'s on the records paired by id
    recs = {r["name"]: [json.loads(x) for x in (Path(r["run_dir"]) / "samples.jsonl").read_text().splitlines()]
            for r in runs}  # fmt: skip
    res = compare(recs["tdlm-d16-tau0.9-full"], recs["threshold-tau0.9"])
    assert f"({res.run_only_correct}/{res.reference_only_correct})" in row


def test_reference_choice_and_its_absence(tmp_path):
    runs = compute_speedups(load_runs(_fake_pair_of_dirs(tmp_path)))
    table = paired_table(runs, reference="original")
    assert "| bb | GSM8K | Original | 120 | reference |" in table
    none = paired_table(runs, reference="threshold-tau0.7")
    assert none.startswith("No reference run `threshold-tau0.7` found") and "|" not in none
    assert "No reference run" in paired_table([{**r, "run_dir": None, "summary_file": None} for r in runs],
                                              reference="entropy-H0.5")  # fmt: skip


def test_samples_are_found_next_to_a_moved_summary(tmp_path):
    dirs = _fake_pair_of_dirs(tmp_path)
    for f in tmp_path.glob("*/runs/*/*/summary.json"):  # as if written on another machine
        f.write_text(json.dumps({**json.loads(f.read_text()), "run_dir": f"/cluster/x/{f.parent.name}"}))
    runs = load_runs(dirs)
    assert all(Path(r["summary_file"]).is_file() for r in runs)
    assert "decoded different problems" in paired_table(runs) and "no per-sample records" not in paired_table(runs)


def test_attach_paired_fills_runs_and_wandb_fields(tmp_path):
    runs = attach_paired(load_runs(_fake_pair_of_dirs(tmp_path)))
    by_name = {r["name"]: r["paired"] for r in runs}
    assert by_name["threshold-tau0.9"] == {"reference": "threshold-tau0.9", "is_reference": True}
    full = by_name["tdlm-d16-tau0.9-full"]
    assert full["n"] == 120 and full["seed"] == 0 and full["resamples"] == 2000
    assert full["reference_run_dir"].endswith("threshold-tau0.9")
    assert "skipped" in by_name["tdlm-d16-tau0.9-last1"]
    flat = wandb_metrics({"paired": full})
    assert flat["paired/nfe_ratio_ci_low"] == full["nfe_ratio_ci"][0] and flat["paired/resamples"] == 2000
    assert wandb_metrics({"paired": by_name["tdlm-d16-tau0.9-last1"]}) == {}
    # in-memory samples (the driver's) are used instead of the files
    mem = {r["run_dir"]: [json.loads(x) for x in (Path(r["run_dir"]) / "samples.jsonl").read_text().splitlines()]
           for r in runs}  # fmt: skip
    for r in runs:
        (Path(r["run_dir"]) / "samples.jsonl").unlink()
    again = attach_paired([{k: v for k, v in r.items() if k != "paired"} for r in runs], samples=mem)
    assert {r["name"]: r["paired"] for r in again} == by_name


def test_other_data_is_not_paired(tmp_path):
    runs = load_runs(_fake_pair_of_dirs(tmp_path))
    for r in runs:
        if r["name"] == "tdlm-d16-tau0.9-full":
            r["task_source"] = "hub:openai/gsm8k/main/train"
    assert "other data: hub:openai/gsm8k/main/train" in paired_table(runs)


def test_the_default_reference_follows_reference_tau(tmp_path, capsys):
    """Without --reference the paired rows are against the threshold run at --reference-tau, in the evaluator's
    config and in eval/compare.py alike; --reference still wins. 0.8 is one step off the default 0.9, which is also
    a run of the folders: a default that ignored --reference-tau would pair against it."""
    from tdlm.evaluation.config import parse_args
    from tdlm.sweep.cli import compare_main

    base = ["--backbone", "tiny-arith", "--output-dir", str(tmp_path / "eval")]
    assert parse_args(base).reference_run() == "threshold-tau0.9"
    assert parse_args([*base, "--reference-tau", "0.8"]).reference_run() == "threshold-tau0.8"
    assert parse_args([*base, "--reference-tau", "0.8", "--reference", "original"]).reference_run() == "original"

    a, b = _fake_pair_of_dirs(tmp_path)
    recs = [json.loads(x) for x in (a / "runs/gsm8k/threshold-tau0.9/samples.jsonl").read_text().splitlines()]
    _write_run(a, "threshold-tau0.8", "threshold", [{**r, "nfe": r["nfe"] * 1.5} for r in recs], tau=0.8)
    assert compare_main([str(a), str(b), "--reference-tau", "0.8"]) == 0
    table = capsys.readouterr().out
    assert "Against `threshold-tau0.8`" in table and "Against `threshold-tau0.9`" not in table
    assert "| bb | GSM8K | Fast-dLLM τ=0.8 | 120 | reference | – | – | – |" in table
    row = next(line for line in table.splitlines() if "| Fast-dLLM τ=0.9 | 120 |" in line)
    assert "| 1.50× [1.50, 1.50] |" in row  # τ 0.8's NFE is 1.5 x τ 0.9's on every problem


def test_two_reference_runs_in_one_group_are_refused_in_one_line(tmp_path):
    """Two folders that both hold threshold-tau0.9 of the same backbone, task, budget and block size: neither is
    taken silently. Every row of that group says so in one line naming the group, the name and both folders, and
    carries no numbers; a group with one reference (here another block size) is still compared."""
    x, y = _fake_pair_of_dirs(tmp_path / "x"), _fake_pair_of_dirs(tmp_path / "y")
    for f in y[1].rglob("summary.json"):  # y's tdlm runs: another block size, compared with nothing there
        f.write_text(json.dumps({**json.loads(f.read_text()), "block_size": 64}))
    runs = load_runs([*x, y[0]])
    paired = {r["run_dir"]: p for r, p in zip(runs, paired_against(runs), strict=True)}
    dirs = sorted(str(d / "runs/gsm8k/threshold-tau0.9") for d in (x[0], y[0]))
    why = f"2 runs named threshold-tau0.9 for gsm8k, bb, N=256, block 32 ({dirs[0]}, {dirs[1]}); pass one folder"
    assert len(paired) == 6 and all(p == {"reference": "threshold-tau0.9", "skipped": why} for p in paired.values())
    assert "\n" not in why
    table = paired_table(runs)
    assert f"- (1) {why}" in table and "×" not in table
    runs = load_runs([y[0], y[1], x[1]])  # one reference in block 32 (y's baselines) and none in block 64
    block32 = {r["name"]: p for r, p in zip(runs, paired_against(runs), strict=True) if r["block_size"] == 32}
    assert block32["threshold-tau0.9"] == {"reference": "threshold-tau0.9", "is_reference": True}
    assert block32["tdlm-d16-tau0.9-full"]["n"] == 120


def test_the_evaluator_records_paired_comparisons_and_refuses_an_unknown_reference(tmp_path, capsys):
    """eval/run.py end to end on tiny-arith: every run's summary carries its paired comparison against the reference
    (the reference itself marked), the job summary records seed and resamples, table.md shows the paired section;
    a --reference that names no run of the grid is one line before anything is decoded. The grid's threshold run is
    at τ 0.8 with --reference-tau 0.8: the default reference follows it (threshold-tau0.9 is not a run here)."""
    from tdlm.evaluation.cli import main

    out = tmp_path / "eval"
    args = ["--backbone", "tiny-arith", "--tasks", "arith", "--limit", "6", "--workers", "1", "--threads", "1",
            "--warmup", "0", "--score-workers", "1", "--policies", "original", "threshold", "--gen-length", "8",
            "--block-size", "8", "--dtype", "float32", "--output-dir", str(out), "--wandb-mode", "disabled",
            "--thresholds", "0.8", "--reference-tau", "0.8"]
    assert main([*args, "--reference", "threshold-tau0.9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: reference='threshold-tau0.9' is not a run of this evaluation")
    assert not (out / "runs").exists()
    assert main(args) == 0
    job = json.loads((out / "summary.json").read_text())
    assert job["paired"]["reference"] == "threshold-tau0.8"
    assert (job["paired"]["seed"], job["paired"]["resamples"]) == (SEED, RESAMPLES)
    by_name = {r["name"]: r for r in job["runs"]}
    assert by_name["threshold-tau0.8"]["paired"]["is_reference"]
    orig = by_name["original"]["paired"]
    assert orig["n"] == 6 and orig["seed"] == SEED and len(orig["accuracy_diff_ci"]) == 2
    run_summary = json.loads((Path(by_name["original"]["run_dir"]) / "summary.json").read_text())
    assert run_summary["paired"] == orig
    assert "Paired comparison on the same problems" in (out / "table.md").read_text()


def test_sweep_table4_pairs_each_allocation_with_the_baselines_folder(tmp_path):
    """A sweep evaluates each allocation in its own folder (eval/<slug>) and the baselines once (eval/baselines):
    Table 4 pairs across the folders, on the same problems, against threshold τ 0.9."""
    from tdlm.sweep.table import table4

    sweep = tmp_path / "sweep"
    a, b = _fake_pair_of_dirs(tmp_path / "src")
    (sweep / "eval").mkdir(parents=True)
    a.rename(sweep / "eval" / "baselines")
    b.rename(sweep / "eval" / "dispersed-16")
    for f in (sweep / "eval").rglob("summary.json"):  # the run folders moved with them
        s = json.loads(f.read_text())
        f.write_text(json.dumps({**s, "run_dir": str(f.parent), "adapter_label": s.get("adapter_label") and
                                 "dispersed-16"}))  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps({"experiment": "t", "backbone": "bb", "allocations": ["dispersed:16"],
                                                  "settings": {"eval": {"tasks": ["gsm8k"], "thresholds": [0.9]}}}))
    (sweep / "trials" / "dispersed-16").mkdir(parents=True)
    (sweep / "trials" / "dispersed-16" / "trial.json").write_text(json.dumps({
        "slug": "dispersed-16", "allocation": "dispersed:16", "layers": [1, 3], "temporal_parameters": 10,
        "status": "done"}))
    table = table4(sweep)
    assert "| Δacc vs τ 0.9 (pp) [95% CI] | McNemar p (b/c) | NFE ratio vs τ 0.9 [95% CI] |" in table
    full = next(line for line in table.splitlines() if line.startswith("| 16, dispersed (1, 3) |") and "1.67×" in line)
    assert re.search(r"\| [+−]\d+\.\d\d \[[+−]\d+\.\d\d, [+−]\d+\.\d\d\] \| [\d.<]+ \(\d+/\d+\) \| 1\.67× \[1\.67, "
                     r"1\.67\] \|$", full), full
    assert "| Fast-dLLM τ=0.9 (reference) | – |" in table and "| reference | – | – |" in table


# -- several training seeds per side: the two-level bootstrap (tdlm.evaluation.paired.two_level_bootstrap) -----------
def _seed_runs(matrix, prefix="arith/") -> list[list[dict]]:
    """One list of scored records per training seed (row), ids by column."""
    return [[{"id": f"{prefix}{j:04d}", "correct": bool(v)} for j, v in enumerate(row)] for row in np.asarray(matrix)]


def test_two_level_with_one_seed_each_is_the_paired_bootstrap_bit_for_bit():
    """The exact relation: one seed on each side leaves only the problem draw, which is compare()'s own draw."""
    from tdlm.evaluation.paired import compare_seeds

    rng = np.random.default_rng(11)
    run, ref = _recs(list(rng.random(150) < 0.7)), _recs(list(rng.random(150) < 0.6))
    for seed, resamples in ((SEED, RESAMPLES), (5, 300)):
        one = compare(run, ref, seed=seed, resamples=resamples)
        two = compare_seeds([run], [ref], seed=seed, resamples=resamples)
        assert (two.accuracy_diff, two.accuracy_diff_ci) == (one.accuracy_diff, one.accuracy_diff_ci)
        assert (two.n, two.run_seeds, two.reference_seeds, two.seed, two.resamples) == (150, 1, 1, seed, resamples)


def test_two_level_with_identical_seeds_on_each_side_is_the_paired_bootstrap_too():
    """Seeds that agree problem by problem add nothing: three identical seeds per side give compare()'s numbers, so
    the problems stay paired across the two sides however many seeds there are."""
    from tdlm.evaluation.paired import two_level_bootstrap

    rng = np.random.default_rng(12)
    x = rng.random(120) < 0.5
    y = x.copy()
    y[:12] = ~y[:12]  # 12 problems flipped: a small, problem-level difference
    one = compare(_recs(list(y)), _recs(list(x)))
    assert two_level_bootstrap(np.tile(y, (3, 1)), np.tile(x, (3, 1))) == (one.accuracy_diff, one.accuracy_diff_ci)
    assert two_level_bootstrap(np.tile(y, (3, 1)), np.tile(x, (2, 1))) == (one.accuracy_diff, one.accuracy_diff_ci)


def test_two_level_identical_runs_give_zero_with_zero_width():
    from tdlm.evaluation.paired import compare_seeds

    x = np.random.default_rng(13).random(80) < 0.6
    res = compare_seeds(_seed_runs(np.tile(x, (3, 1))), _seed_runs(np.tile(x, (3, 1))))
    assert (res.accuracy_diff, res.accuracy_diff_ci, res.evidence) == (0.0, (0.0, 0.0), False)


def test_two_level_resamples_the_seeds():
    """Seed 0 of the run got every problem wrong and seed 1 every one right; the reference the other way round. Both
    average 50% on every problem, so a bootstrap that keeps all seeds sees no spread at all; resampling the seeds
    draws both seeds of one side 1/4 of the time: a difference of -1 or +1 has probability 1/16 each (> 2.5%)."""
    from tdlm.evaluation.paired import two_level_bootstrap

    run = np.array([[0] * 40, [1] * 40])
    assert two_level_bootstrap(run, run[::-1]) == (0.0, (-1.0, 1.0))


def test_two_level_resamples_each_sides_seeds_on_its_own():
    """An allocation against itself: zero difference, but an interval as wide as its seed-to-seed spread (its seeds
    and the other side's are separate trainings, drawn independently; pairing seeds by number would give [0, 0])."""
    from tdlm.evaluation.paired import two_level_bootstrap

    rng = np.random.default_rng(14)
    spread = np.stack([rng.random(100) < p for p in (0.4, 0.6, 0.8)])
    point, (lo, hi) = two_level_bootstrap(spread, spread)
    assert point == 0.0 and lo < -0.05 and hi > 0.05


def test_two_level_big_deterministic_difference_is_evidence():
    from tdlm.evaluation.paired import compare_seeds

    rng = np.random.default_rng(15)
    good = np.stack([rng.random(100) < 0.9 for _ in range(3)])
    bad = np.stack([rng.random(100) < 0.1 for _ in range(3)])
    res = compare_seeds(_seed_runs(good), _seed_runs(bad))
    assert res.evidence and 0.6 < res.accuracy_diff_ci[0] <= res.accuracy_diff <= res.accuracy_diff_ci[1]
    assert res.accuracy_diff == pytest.approx(good.mean() - bad.mean(), abs=1e-12)
    back = compare_seeds(_seed_runs(bad), _seed_runs(good))
    assert back.evidence and back.accuracy_diff_ci[1] < -0.6
    d = res.to_dict()
    assert (d["seed"], d["resamples"], d["run_seeds"], d["reference_seeds"]) == (SEED, RESAMPLES, 3, 3)
    assert "two-level" in d["interval"] and d["evidence"] is True and "excludes 0" in d["evidence_rule"]


def test_two_level_pairs_by_id_and_refuses_other_problems():
    from tdlm.evaluation.paired import compare_seeds

    rng = np.random.default_rng(16)
    a = _seed_runs(np.stack([rng.random(60) < 0.7 for _ in range(3)]))
    b = _seed_runs(np.stack([rng.random(60) < 0.5 for _ in range(2)]))
    res = compare_seeds(a, b)
    shuffled = [random.Random(k).sample(recs, len(recs)) for k, recs in enumerate(a)]
    assert compare_seeds(shuffled, b) == res and (res.run_seeds, res.reference_seeds) == (3, 2)
    with pytest.raises(PairingError, match=r"^run \(seed run 2 of 3\) and the first seed run decoded different "
                                           r"problems: 1 only in the first seed run \(arith/0059\); 59 shared$"):
        compare_seeds([a[0], a[1][:-1], a[2]], b)
    with pytest.raises(PairingError, match=r"^reference \(seed run 1 of 2\) and the first seed run decoded "):
        compare_seeds(a, [b[0][1:], b[1]])
    with pytest.raises(PairingError, match=r"no 'correct' field"):
        compare_seeds(a, [[{k: v for k, v in r.items() if k != "correct"} for r in b[0]]])
