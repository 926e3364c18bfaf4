"""The sharded evaluator (tdlm.evaluation, eval/run.py, eval/compare.py).

Fast tests cover the pure parts on synthetic numbers: speedups, aggregation, the Pareto frontier,
shard files (truncated lines, completeness), the grid, the tables, the CLI flags. Model tests run
tiny-llada (random weights: accuracy ~0, plumbing only) with a random TDLM adapter on 3-5 GSM8K / MBPP
problems at gen length 16, block 8. Tests marked ``slow`` start Ray (an in-process cluster with the
settings of shared/notes/ray-wandb-datasets-on-cpu.md) or subprocesses of eval/run.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

import tdlm
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError
from tdlm.evaluation import EvalConfig, IncompleteResults, compute_speedups, evaluate, expand, pareto_front, render
from tdlm.evaluation.metrics import SPEEDUP_FIELDS, aggregate
from tdlm.evaluation.records import Appender, merge, read_records, repair, shard_path
from tdlm.evaluation.report import load_runs
from tdlm.tasks.base import default_data_dir

REPO = Path(__file__).resolve().parents[1]
DATA = default_data_dir()
RUN = REPO / "eval" / "run.py"
COMPARE = REPO / "eval" / "compare.py"
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
needs_data = pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason=f"benchmarks not in {DATA}")


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path_factory, monkeypatch):
    """W&B never reaches a server here: offline, files in a temp dir, quiet."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path_factory.mktemp("wandb")))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def _random_adapter(path: Path, layers: str, seed: int) -> str:
    """A TDLM adapter with random (non-zero W_O) temporal weights, so tdlm decoding differs from the backbone."""
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers=layers, heads=2, head_dim=8, history="full"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.temporal.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_adapter(path)
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"disp": _random_adapter(root / "disp", "dispersed:2", 1),
            "mid": _random_adapter(root / "mid", "middle:2", 2)}


def cfg_for(out: Path, **kw) -> EvalConfig:
    base = dict(backbone="tiny-llada", output_dir=str(out), tasks=["mbpp"], limit=4, gen_length=16, block_size=8,
                data_dir=str(DATA), workers=1, threads=1, warmup=0, score_workers=1, wandb_mode="disabled",
                policies=["threshold"])  # fmt: skip
    base.update(kw)
    section = {k: base.pop(k) for k in [f.name for f in fields(DecodeSettings)] if k in base}  # the decode: section
    return EvalConfig(**base, decode=DecodeSettings(**section))


def with_decode(cfg: EvalConfig, **kw) -> EvalConfig:
    return replace(cfg, decode=replace(cfg.decode, **kw))


def samples_of(result, task: str, name: str) -> list[dict]:
    return read_records(Path(result.output_dir) / "runs" / task / name / "samples.jsonl")


# -- fast: metrics, records, grid, tables ---------------------------------------------------------
def _run(task, policy, acc, nfe, sec, tau=None, backbone="bb", **kw) -> dict:
    return {"task": task, "policy": policy, "accuracy": acc, "nfe_mean": nfe, "seconds_mean": sec, "threshold": tau,
            "backbone": backbone, "gen_length": 256, "block_size": 32, "n": 10, **kw}  # fmt: skip


def test_speedup_math_on_synthetic_numbers():
    runs = [
        _run("gsm8k", "original", 0.80, 256.0, 4.0),
        _run("gsm8k", "threshold", 0.79, 80.0, 1.6, tau=0.9),
        _run("gsm8k", "threshold", 0.70, 40.0, 0.8, tau=0.7),
        _run("gsm8k", "tdlm", 0.79, 40.0, 0.5, tau=0.9, adapter_label="a", history="full"),
        _run("gsm8k", "tdlm", 0.75, 30.0, 0.4, tau=0.95, adapter_label="a", history="full"),
        _run("mbpp", "original", 0.40, 256.0, 8.0),  # another task: its own baselines
        _run("mbpp", "tdlm", 0.41, 64.0, 2.0, tau=0.8, adapter_label="a", history="full"),
        _run("gsm8k", "threshold", 0.5, 10.0, 1.0, tau=0.9, backbone="other"),  # another backbone, no original
    ]
    compute_speedups(runs, reference_tau=0.9)
    orig, thr9, thr7, tdlm9, tdlm95, morig, mtdlm, other = runs
    assert orig["speedup_vs_original"] == 1.0 and orig["nfe_ratio_vs_original"] == 1.0
    assert thr9["speedup_vs_original"] == pytest.approx(4.0 / 1.6) and thr9["nfe_ratio_vs_original"] == 3.2
    assert tdlm9["speedup_vs_original"] == 8.0 and tdlm9["nfe_ratio_vs_original"] == 6.4
    assert tdlm9["speedup_vs_threshold"] == pytest.approx(1.6 / 0.5) and tdlm9["nfe_ratio_vs_threshold"] == 2.0
    # the reference tau (0.9, Fast-dLLM's released setting) is the threshold baseline of every run
    assert tdlm95["threshold_baseline_tau"] == 0.9 and tdlm95["speedup_vs_threshold"] == pytest.approx(4.0)
    assert thr7["speedup_vs_threshold"] == pytest.approx(2.0) and thr7["threshold_baseline_tau"] == 0.9
    assert mtdlm["speedup_vs_original"] == 4.0 and mtdlm["nfe_ratio_vs_original"] == 4.0
    assert mtdlm["speedup_vs_threshold"] is None and mtdlm["threshold_baseline_tau"] is None
    assert other["speedup_vs_original"] is None and other["speedup_vs_threshold"] == 1.0
    # without the reference tau the run's own tau is the baseline
    runs2 = compute_speedups([
        _run("gsm8k", "threshold", 0.7, 40.0, 0.8, tau=0.7),
        _run("gsm8k", "tdlm", 0.7, 20.0, 0.4, tau=0.7, adapter_label="a", history="full"),
    ])
    assert runs2[1]["speedup_vs_threshold"] == 2.0 and runs2[1]["threshold_baseline_tau"] == 0.7


def test_a_baseline_run_twice_in_one_group_gives_no_ratio_against_either():
    """Two folders combined, each with threshold at tau 0.9 (or each with original): which one is the baseline is
    unknown, so the ratios against it are None, never against the first or the last one read, and no other tau
    stands in for the ambiguous reference. A group with one of each still compares."""
    runs = [
        _run("gsm8k", "original", 0.80, 256.0, 4.0),
        _run("gsm8k", "original", 0.80, 250.0, 5.0),
        _run("gsm8k", "threshold", 0.79, 80.0, 1.6, tau=0.9),
        _run("gsm8k", "threshold", 0.78, 60.0, 1.2, tau=0.9),
        _run("gsm8k", "threshold", 0.70, 40.0, 0.8, tau=0.95),
        _run("gsm8k", "tdlm", 0.79, 40.0, 0.5, tau=0.95, adapter_label="a", history="full"),
        _run("mbpp", "original", 0.40, 256.0, 8.0),
        _run("mbpp", "threshold", 0.40, 64.0, 4.0, tau=0.9),
        _run("mbpp", "tdlm", 0.41, 32.0, 2.0, tau=0.95, adapter_label="a", history="full"),
    ]
    compute_speedups(runs, reference_tau=0.9)
    tdlm = runs[5]
    for field in SPEEDUP_FIELDS:
        assert tdlm[field] is None, (field, tdlm[field])
    mtdlm = runs[8]
    assert mtdlm["speedup_vs_threshold"] == 2.0 and mtdlm["speedup_vs_original"] == 4.0
    assert mtdlm["threshold_baseline_tau"] == 0.9


def test_aggregate():
    s = [{"correct": True, "nfe": 10, "seconds": 1.0, "status": "correct"},
         {"correct": False, "nfe": 20, "seconds": 3.0, "status": "unparsed"},
         {"correct": True, "nfe": 30, "seconds": 2.0, "status": "correct"}]  # fmt: skip
    a = aggregate(s)
    assert (a["n"], a["correct"]) == (3, 2) and a["accuracy"] == pytest.approx(2 / 3)
    assert (a["nfe_mean"], a["seconds_mean"], a["seconds_median"], a["seconds_total"]) == (20.0, 2.0, 2.0, 6.0)
    assert a["status_counts"] == {"correct": 2, "unparsed": 1}
    assert a["seconds_sd"] == pytest.approx(1.0) and a["seconds_se"] == pytest.approx(1.0 / 3**0.5)
    assert (a["seconds_p10"], a["seconds_p90"]) == (pytest.approx(1.2), pytest.approx(2.8))
    assert aggregate([])["accuracy"] is None


def test_method_rows_are_timed_interleaved_in_rotated_order(tmp_path):
    """One job per batch; round k holds every run's k-th batch (each shard's), the runs rotated by k, so load
    changes land on every method alike; only a run's first batch warms up; resumed problems are left out."""
    from tdlm.evaluation.driver import plan_runs, shard_jobs

    cfg = cfg_for(tmp_path, tasks=["gsm8k"], policies=["original", "threshold"], thresholds=[0.5, 0.9], limit=8,
                  batch_size=2, warmup=1)
    plans = plan_runs(cfg)
    names = [p.spec.name for p in plans]
    assert len(names) == 3
    jobs, skipped = shard_jobs(cfg, plans, 2)
    assert skipped == 0 and len(jobs) == 3 * 2 * 2  # 3 runs x 2 shards x 2 batches of 2
    run_of = {str(p.run_dir): p.spec.name for p in plans}
    seq = [(run_of[j.run_dir], j.shard) for j in jobs]
    r0 = [n for n, w in seq[:6] if w == 0]
    r1 = [n for n, w in seq[6:] if w == 0]
    assert r0 == names and r1 == names[1:] + names[:1], (r0, r1)
    assert all(len(j.problems) == 2 for j in jobs)
    assert [j.warmup for j in jobs] == [1] * 6 + [0] * 6
    every = sorted(p[0] for j in jobs if run_of[j.run_dir] == names[0] for p in j.problems)
    assert every == sorted(p.id for p in plans[0].task.problems)  # each problem exactly once


def test_a_job_holds_job_batches_batches_and_its_rounds_still_rotate(tmp_path):
    """``job_batches`` batches per job (the worker refills a finished row's slot from the job's next problems): 7
    problems in 2 shards at batch 1 and 3 batches per job give shard 0 (4 problems) jobs of 3 + 1 and shard 1 (3
    problems) one job of 3; round k still holds every run's k-th job, rotated; each problem exactly once; a value
    below 1 is one line naming the field."""
    from tdlm.evaluation.driver import plan_runs, shard_jobs

    cfg = cfg_for(tmp_path, tasks=["gsm8k"], policies=["original", "threshold"], thresholds=[0.9], limit=7,
                  batch_size=1, warmup=1, job_batches=3)  # fmt: skip
    plans = plan_runs(cfg)
    names = [p.spec.name for p in plans]
    jobs, _ = shard_jobs(cfg, plans, 2)
    run_of = {str(p.run_dir): p.spec.name for p in plans}
    seq = [(run_of[j.run_dir], j.shard, len(j.problems), j.warmup) for j in jobs]
    assert seq == [(names[0], 0, 3, 1), (names[0], 1, 3, 1), (names[1], 0, 3, 1), (names[1], 1, 3, 1),
                   (names[1], 0, 1, 0), (names[0], 0, 1, 0)], seq  # fmt: skip
    for plan in plans:
        got = sorted(p[0] for j in jobs if j.run_dir == str(plan.run_dir) for p in j.problems)
        assert got == sorted(p.id for p in plan.task.problems)
    with pytest.raises(TDLMError, match=r"^job_batches must be >= 1; got 0$"):
        cfg_for(tmp_path, job_batches=0).validate()


def test_storage_and_compile_reach_the_decode_config_the_worker_decodes_with(tmp_path, monkeypatch):
    """``storage`` travels as ``compile`` does, outside DecodeConfig.to_dict (the run's identity), and the evaluator's
    compile once never reached its workers: what is checked is the DecodeConfig the worker hands to decode, for every
    decode of every run (the jobs are what Ray actors get too; every field: tests/test_decode_settings.py)."""
    import tdlm.evaluation.worker as worker_mod
    from tdlm.evaluation.driver import plan_runs, run_in_process, shard_jobs

    seen, real = [], worker_mod.decode

    def spy(model, prompts, config, **kw):
        seen.append((config.policy, config.storage, config.compile))
        return real(model, prompts, replace(config, compile=False), **kw)  # eager: the setting is what is checked

    monkeypatch.setattr(worker_mod, "decode", spy)
    cfg = cfg_for(tmp_path, tasks=["gsm8k"], policies=["original", "threshold"], limit=2, batch_size=2, warmup=1,
                  storage="static", compile="eager").validate()
    plans = plan_runs(cfg)
    jobs, _ = shard_jobs(cfg, plans, 1)
    run_in_process(cfg, jobs)
    assert sorted(seen) == [("original", "static", "eager")] * 2 + [("threshold", "static", "eager")] * 2  # + warm-up
    assert [len(read_records(shard_path(p.run_dir, 0, 1))) for p in plans] == [2, 2]


def test_storage_is_not_part_of_a_runs_identity_and_each_resumes_the_other(tmp_path):
    """Static and dynamic storage decode the same tokens: same run names and run.json, and a run decoded with one
    resumes with the other (its samples are skipped, nothing is refused)."""
    from tdlm.evaluation.driver import plan_runs, shard_jobs

    dynamic = cfg_for(tmp_path, tasks=["gsm8k"], policies=["original", "threshold"], limit=3)
    first = plan_runs(dynamic)
    with Appender(shard_path(first[0].run_dir, 0, 1)) as a:  # one sample of the dynamic run on disk
        p = first[0].task.problems[0]
        a.write({"id": p.id, "index": p.index, "prompt": p.prompt})
    for storage in ("static", "dynamic"):
        again = plan_runs(with_decode(dynamic, storage=storage))  # same folder: compared with run.json, not refused
        assert [(q.spec.name, q.identity) for q in again] == [(q.spec.name, q.identity) for q in first], storage
        assert "storage" not in json.dumps(again[0].identity)
        jobs, skipped = shard_jobs(with_decode(dynamic, storage=storage), again, 1)
        assert skipped == 1 and {j.settings.storage for j in jobs} == {storage}


def test_storage_is_checked_in_one_line_before_anything_is_loaded(tmp_path):
    """A bad value, static with a spatial KV cache, or static with a latent:M history (named, or an adapter's own):
    one line naming the field, from DecodeSettings' one check, at validate() / expand() (no weights read)."""
    from tdlm.evaluation.config import parse_args
    from tdlm.temporal.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    with pytest.raises(TDLMError, match=r"^decode storage 'statc' unknown; expected one of dynamic, static; did you "
                                        r"mean 'static'\?$"):  # fmt: skip
        cfg_for(tmp_path, storage="statc").validate()
    with pytest.raises(TDLMError, match=r"^compile='reduce-overhead' captures CUDA graphs, .*"
                                        r"cache='dual'.*; use storage='static' with it, or compile=True$"):  # fmt: skip
        cfg_for(tmp_path, compile="reduce-overhead", caches=["none", "dual"]).validate()
    cfg_for(tmp_path, storage="static", compile="reduce-overhead", caches=["none", "dual"]).validate()
    with pytest.raises(TDLMError, match=r"^decode.history: storage='static' does not cover history latent:2: "
                                        r".*use storage='dynamic'$"):  # fmt: skip
        cfg_for(tmp_path, storage="static", policies=["tdlm"], adapters=["a"],
                histories=["full", "latent:2"]).validate()
    lat = tmp_path / "lat"  # an adapter trained with latent:2: its config file is all expand() reads
    lat.mkdir()
    (lat / ADAPTER_CONFIG).write_text(json.dumps({"history": "latent:2"}))
    (lat / ADAPTER_WEIGHTS).write_bytes(b"")
    cfg = cfg_for(tmp_path, policies=["tdlm"], adapters=[str(lat)], storage="static").validate()
    with pytest.raises(TDLMError, match=r"^adapter lat: decode.history: storage='static' does not cover "
                                        r"history latent:2"):  # fmt: skip
        expand(cfg)
    assert [r.history for r in expand(with_decode(cfg, storage="dynamic"))] == ["latent:2"]
    assert parse_args(["--backbone", "b", "--output-dir", "o", "--storage", "static"]).decode.storage == "static"
    assert parse_args(["--backbone", "b", "--output-dir", "o"]).decode.storage == "dynamic"
    with pytest.raises(SystemExit):
        parse_args(["--backbone", "b", "--output-dir", "o", "--storage", "statc"])


def test_comparison_runs_sharing_a_group_get_distinct_names():
    """Evaluations that share a user-given group (a sweep's trials, ``--group table1`` across backbones) must not
    share the comparison run's name; the default group is one per output folder already."""
    from tdlm.evaluation.summaries import comparison_name

    a = EvalConfig(backbone="b", output_dir="runs/sweep/eval/baselines", group="tiny-table4")
    b = EvalConfig(backbone="b", output_dir="runs/sweep/eval/layers-0-1", group="tiny-table4")
    assert comparison_name(a, "tiny-table4") != comparison_name(b, "tiny-table4")
    assert comparison_name(a, "tiny-table4") == "tiny-table4/baselines/comparison"
    default = EvalConfig(backbone="b", output_dir="runs/x")
    assert comparison_name(default, "x-1a2b3c") == "x-1a2b3c/comparison"


def test_pareto_front():
    pts = [(1.0, 50.0), (2.0, 60.0), (2.0, 55.0), (3.0, 58.0), (0.5, 40.0), (4.0, 70.0), (1.0, 50.0)]
    assert pareto_front(pts) == [4, 0, 1, 5]  # (2, 55) and (3, 58) are dominated by (2, 60); duplicates once
    assert pareto_front([]) == []


def test_shard_files_resume_and_completeness(tmp_path):
    run = tmp_path / "run"
    p0, p1 = shard_path(run, 0, 2), shard_path(run, 1, 2)
    with Appender(p0) as a:
        a.write({"id": "t/0", "index": 0})
        a.write({"id": "t/2", "index": 2})
    with Appender(p1) as a:
        a.write({"id": "t/1", "index": 1})
    with p1.open("a") as fh:  # a kill in the middle of a write
        fh.write('{"id": "t/3", "ind')
    assert [r["id"] for r in read_records(p1)] == ["t/1"]  # the cut line does not count
    with pytest.raises(IncompleteResults, match=r"1 missing: t/3"):
        merge(run, ["t/0", "t/1", "t/2", "t/3"])
    with Appender(p1) as a:  # reopening cuts the partial line before appending
        a.write({"id": "t/3", "index": 3})
    assert p1.read_text().count("\n") == 2 and [r["id"] for r in read_records(p1)] == ["t/1", "t/3"]
    assert [r["id"] for r in merge(run, ["t/0", "t/1", "t/2", "t/3"])] == ["t/0", "t/1", "t/2", "t/3"]
    assert [r["id"] for r in merge(run, ["t/1", "t/0"])] == ["t/1", "t/0"]  # a smaller limit ignores the rest
    with Appender(shard_path(run, 0, 1)) as a:  # an earlier run with another worker count wrote t/2 too
        a.write({"id": "t/2", "index": 2})
    with pytest.raises(IncompleteResults, match=r"1 duplicate: t/2 \(shard-000-of-001.jsonl and shard-000-of-002"):
        merge(run, ["t/0", "t/1", "t/2", "t/3"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(TDLMError, match=r"bad.jsonl:2: not a JSON record"):
        read_records(bad)
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"id": "a"}\n{"id": "b"}')  # valid JSON but unterminated: dropped, as readers do
    assert repair(cut) == len('{"id": "b"}') and cut.read_text() == '{"id": "a"}\n'


def test_grid_and_validation(adapters):
    cfg = EvalConfig(backbone="tiny-llada", output_dir="x", tasks=["gsm8k", "mbpp"],
                     policies=["original", "threshold", "entropy", "tdlm"], thresholds=[0.8, 0.9],
                     tdlm_thresholds=[0.95], entropy_thresholds=[0.4],
                     adapters=[adapters["disp"], f"m={adapters['mid']}"],
                     histories=["full", "last:3"]).validate()  # fmt: skip
    names = [r.name for r in expand(cfg) if r.task == "gsm8k"]
    assert names == ["original", "threshold-tau0.8", "threshold-tau0.9", "entropy-H0.4", "tdlm-disp-tau0.95-full",
                     "tdlm-disp-tau0.95-last3", "tdlm-m-tau0.95-full", "tdlm-m-tau0.95-last3"]  # fmt: skip
    assert len(expand(cfg)) == 16
    default = EvalConfig(backbone="b", output_dir="x", adapters=[adapters["disp"]])
    assert default.resolved_policies() == ["original", "threshold", "tdlm"]
    assert [r.history for r in expand(default) if r.policy == "tdlm"] == ["full"]  # the adapter's own history
    bad = [
        ({"policies": ["tdlm"]}, "needs --adapter"),
        ({"policies": ["beam"]}, "policy 'beam' unknown"),
        ({"tasks": ["humaneval"]}, "task 'humaneval' unknown"),
        ({"adapters": [adapters["disp"]], "policies": ["threshold"]}, "only used by policy 'tdlm'"),
        ({"adapters": [f"a={adapters['disp']}", f"a={adapters['mid']}"]}, "label 'a' used twice"),
        ({"gen_length": 20, "block_size": 8}, "multiple of block_size"),
        ({"thresholds": [1.5]}, r"tau=1.5 must be in \[0, 1\]"),
        ({"histories": ["sometimes"]}, "history policy 'sometimes' not understood"),
        ({"thresholds": [0.9, 0.9]}, "duplicate"),
        ({"batch_size": 0}, "decode.batch_size must be an integer >= 1"),
    ]
    for kw, msg in bad:
        with pytest.raises(TDLMError, match=msg):
            section = {k: kw.pop(k) for k in ("gen_length", "block_size", "batch_size") if k in kw}
            EvalConfig(backbone="b", output_dir="x", decode=DecodeSettings(**section), **kw).validate()


def _synthetic_runs() -> list[dict]:
    alloc8 = {"layers": [1, 3], "num_layers": 4}
    alloc16 = {"layers": [1, 2], "num_layers": 4}
    runs = [_run("gsm8k", "original", 0.8, 256.0, 4.0), _run("mbpp", "original", 0.4, 256.0, 6.0),
            _run("gsm8k", "threshold", 0.79, 80.0, 1.6, tau=0.9),
            _run("mbpp", "threshold", 0.39, 90.0, 2.0, tau=0.9)]  # fmt: skip
    for h, acc in (("current", 0.76), ("last:1", 0.776), ("full", 0.79), ("last:5", 0.78)):
        runs.append(_run("gsm8k", "tdlm", acc, 40.0, 0.6, tau=0.9, adapter_label="d16", history=h, allocation=alloc16))
    runs.append(_run("gsm8k", "tdlm", 0.7786, 40.15, 0.571, tau=0.9, adapter_label="d8", history="full",
                     allocation=alloc8))  # fmt: skip
    return compute_speedups(runs)


def test_tables_have_the_papers_shape():
    md = render(_synthetic_runs())
    main = md.split("## History")[0]
    assert "| Method | GSM8K Acc | GSM8K NFE | GSM8K Sec | GSM8K Speedup | MBPP Acc |" in main
    assert "| Original | 80.00 | 256.00 | 4.000 | 1.00× | 40.00 | 256.00 | 6.000 | 1.00× |" in main
    assert "| Fast-dLLM τ=0.9 | 79.00 | 80.00 | 1.600 | 2.50× | 39.00 | 90.00 | 2.000 | 3.00× |" in main
    assert "| TDLM τ=0.9 [d16, full] | 79.00 | 40.00 | 0.600 | 6.67× | – | – | – | – |" in main
    hist = md.split("## History restriction (Table 2)")[1].split("\n## ")[0]
    rows = [line for line in hist.splitlines() if line.startswith("| ") and "History" not in line]
    order = [line.split("|")[1].strip() for line in rows]
    assert order == ["current", "last:1", "last:5", "full"]
    alloc = md.split("## Temporal-layer allocation (Table 4)")[1].split("## All runs")[0]
    assert "| d16 | 2 of 4: 1,2 | 79.00 | 40.00 | 0.600 |" in alloc
    assert "| d8 | 2 of 4: 1,3 | 77.86 | 40.15 | 0.571 |" in alloc
    assert "× thr" in md.split("## All runs")[1]


def _compare_cli():
    """eval/compare.py as a module (run in-process: a subprocess would spend ~8 s importing torch under load)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tdlm_eval_compare_cli", COMPARE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_cli_prints_tables_from_summaries(tmp_path, capsys):
    runs = _synthetic_runs()
    a, b = tmp_path / "a", tmp_path / "b"
    for d, part in ((a, runs[:4]), (b, runs[4:])):  # baselines in one dir, TDLM runs in the other
        d.mkdir()
        items = [{**r, "run_dir": f"{d}/{i}"} for i, r in enumerate(part)]
        (d / "summary.json").write_text(json.dumps({"runs": items}))
    compare = _compare_cli()
    assert compare.main([str(a), str(b), "--markdown", str(tmp_path / "t.md"), "--plots-dir",
                         str(tmp_path / "plots")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| TDLM τ=0.9 [d16, full] | 79.00 | 40.00 | 0.600 | 6.67× |" in out  # speedup across dirs
    assert (tmp_path / "t.md").read_text() == out
    assert (tmp_path / "plots" / "pareto_gsm8k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not found" in err


def _run_cli():
    """eval/run.py as a module (it is a script folder, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tdlm_eval_run_cli", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_config_field_has_a_flag():
    run_cli = _run_cli()
    parser = run_cli.build_parser()
    dests = {a.dest for a in parser._actions} - {"help", "config"}
    swept = ("policy", "threshold", "entropy_threshold", "cache", "history")  # the grid's lists: no flag of their own
    section = {f"decode.{f.name}" for f in fields(DecodeSettings) if f.name not in swept}
    assert dests == {f for f in EvalConfig.__dataclass_fields__ if f != "decode"} | section
    assert all(a.help for a in parser._actions)
    cfg = run_cli.parse_args(["--backbone", "tiny-llada", "--output-dir", "o", "--tasks", "gsm8k", "mbpp",
                              "--thresholds", "0.8", "0.9", "--history", "full", "last:3", "--adapter", "a=x", "b=y",
                              "--no-chat", "--workers", "2"])  # fmt: skip
    assert (cfg.tasks, cfg.thresholds, cfg.histories, cfg.adapters, cfg.chat, cfg.workers) == (
        ["gsm8k", "mbpp"], [0.8, 0.9], ["full", "last:3"], ["a=x", "b=y"], False, 2)
    assert (cfg.decode.gen_length, cfg.decode.block_size, cfg.decode.batch_size) == (256, 32, 1)  # the paper's
    with pytest.raises(TDLMError, match="--output-dir is required"):
        run_cli.parse_args(["--backbone", "tiny-llada"])


def test_yaml_config_and_flag_override(tmp_path):
    run_cli = _run_cli()
    cfg = run_cli.parse_args(["--config", str(REPO / "configs" / "eval_tiny.yaml"), "--limit", "2"])
    assert cfg.backbone == "tiny-llada" and cfg.limit == 2 and cfg.decode.gen_length == 32
    (tmp_path / "bad.yaml").write_text("backbone: tiny-llada\noutput_dir: o\ngen_lenght: 3\n")
    with pytest.raises(TDLMError, match=r"unknown key\(s\) \['gen_lenght'\]"):
        run_cli.parse_args(["--config", str(tmp_path / "bad.yaml")])


# -- model runs ------------------------------------------------------------------------------------
@needs_data
def test_single_worker_end_to_end_with_wandb_tables_and_plots(tmp_path, adapters):
    """GSM8K: original / threshold / TDLM with two adapters x two histories; every output file parses.
    (W&B is off here to save ~2 s per run; the resume test checks the offline W&B runs.)"""
    cfg = cfg_for(tmp_path / "e2e", tasks=["gsm8k"], limit=2, warmup=1, group="tiny-cmp",
                  policies=["original", "threshold", "tdlm"], adapters=[adapters["disp"], adapters["mid"]],
                  histories=["full", "current"])  # fmt: skip
    res = evaluate(cfg)
    assert (res.computed, res.skipped, res.workers) == (12, 0, 1)
    out = Path(res.output_dir)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["group"] == "tiny-cmp" and len(summary["runs"]) == 6
    by_name = {r["name"]: r for r in summary["runs"]}
    orig = by_name["original"]
    assert orig["nfe_mean"] == 16.0 and orig["speedup_vs_original"] == 1.0 and orig["n"] == 2
    for r in summary["runs"]:
        assert r["accuracy"] is not None and 0 <= r["accuracy"] <= 1 and r["seconds_mean"] > 0
        assert r["speedup_vs_original"] == pytest.approx(orig["seconds_mean"] / r["seconds_mean"])
        assert r["nfe_ratio_vs_original"] == pytest.approx(16.0 / r["nfe_mean"])
        assert r["speedup_vs_threshold"] is not None and r["threshold_baseline_tau"] == 0.9
        assert json.loads((Path(r["run_dir"]) / "summary.json").read_text()) == r
    tdlm_run = by_name["tdlm-mid-tau0.9-current"]
    assert tdlm_run["allocation"]["layers"] == [1, 2] and tdlm_run["history"] == "current"
    samples = samples_of(res, "gsm8k", "tdlm-disp-tau0.9-full")
    assert [s["id"] for s in samples] == ["gsm8k/0000", "gsm8k/0001"]
    for s in samples:
        assert {"id", "prompt", "generation", "extracted", "correct", "nfe", "seconds"} <= set(s)
        assert s["prompt"].endswith("within \\boxed{}.") and s["status"] in ("correct", "wrong", "unparsed")
    table = (out / "table.md").read_text()
    assert table == res.table and "## History restriction (Table 2)" in table
    assert "## Temporal-layer allocation (Table 4)" in table and "| Original |" in table
    import matplotlib.image

    png = matplotlib.image.imread(out / "pareto_gsm8k.png")
    assert png.ndim == 3 and png.shape[0] > 100
    # the random adapter really changes decoding (otherwise TDLM rows would only test the backbone path)
    base = samples_of(res, "gsm8k", "threshold-tau0.9")
    assert any(a["generation"] != b["generation"] or a["nfe"] != b["nfe"] for a, b in zip(samples, base, strict=True))

    again = evaluate(cfg)  # a finished evaluation: nothing decoded, nothing rescored, same numbers
    assert (again.computed, again.skipped) == (0, 12)
    assert json.loads((out / "summary.json").read_text())["runs"] == summary["runs"]

    with pytest.raises(TDLMError, match=r"settings differ .*gen_length: 16 -> 32"):
        evaluate(with_decode(cfg, gen_length=32))


@needs_data
def test_resume_skips_done_samples_after_a_cut_write(tmp_path):
    cfg = cfg_for(tmp_path / "ref", policies=["original", "threshold"], limit=4, wandb_mode=None, group="g")
    ref = evaluate(cfg)  # W&B from the environment: offline, WANDB_DIR in a temp dir
    for r in ref.runs:  # one offline W&B run per grid point, in its run dir, plus the comparison run
        assert list((Path(r["run_dir"]) / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run"
    assert list((tmp_path / "ref" / "comparison" / "wandb").glob("offline-run-*/run-*.wandb"))
    run_dir = tmp_path / "ref" / "runs" / "mbpp" / "threshold-tau0.9"
    shard = shard_path(run_dir, 0, 1)
    lines = shard.read_text().splitlines(keepends=True)
    assert len(lines) == 4
    # simulate a kill during the third record: two complete lines and half of the third
    shard.write_text(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2])
    (run_dir / "samples.jsonl").unlink()
    res = evaluate(cfg)
    assert (res.computed, res.skipped) == (2, 6)
    new = shard.read_text().splitlines(keepends=True)
    assert new[:2] == lines[:2]  # the done samples were kept, not recomputed (same measured seconds)
    for a, b in zip(samples_of(ref, "mbpp", "threshold-tau0.9"), samples_of(res, "mbpp", "threshold-tau0.9"),
                    strict=True):  # fmt: skip
        assert (a["id"], a["generation"], a["nfe"], a["correct"]) == (b["id"], b["generation"], b["nfe"], b["correct"])
    # completeness: a stray shard file with a duplicate record is refused, a missing record too
    dup = shard_path(run_dir, 1, 2)
    dup.write_text(new[3])
    with pytest.raises(IncompleteResults, match="1 duplicate: mbpp/"):
        evaluate(cfg)
    dup.unlink()
    assert len(merge(run_dir, [f"mbpp/{i}" for i in (11, 12, 14, 16)])) == 4
    with pytest.raises(IncompleteResults, match="1 missing: mbpp/999"):
        merge(run_dir, ["mbpp/11", "mbpp/999"])


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    old = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
             _temp_dir="/tmp/ray_tdlm_eval", logging_level="WARNING")  # fmt: skip
    yield ray
    ray.shutdown()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@needs_data
@pytest.mark.slow
def test_two_ray_actors_equal_a_single_worker(tmp_path, adapters, ray_cluster):
    common = dict(limit=5, policies=["threshold", "tdlm"], adapters=[adapters["disp"]])
    single = evaluate(cfg_for(tmp_path / "single", **common))
    sharded = evaluate(cfg_for(tmp_path / "sharded", workers=2, warmup=1, **common))
    assert (sharded.workers, sharded.computed) == (2, 10)
    for name in ("threshold-tau0.9", "tdlm-disp-tau0.9-full"):
        run_dir = tmp_path / "sharded" / "runs" / "mbpp" / name
        files = {p.name: [r["index"] for r in read_records(p)] for p in sorted((run_dir / "shards").glob("*.jsonl"))}
        assert files == {"shard-000-of-002.jsonl": [0, 2, 4], "shard-001-of-002.jsonl": [1, 3]}
        pids = {r["worker"]["pid"] for p in (run_dir / "shards").glob("*.jsonl") for r in read_records(p)}
        assert len(pids) == 2 and os.getpid() not in pids  # two actor processes, not the driver
        a, b = samples_of(single, "mbpp", name), samples_of(sharded, "mbpp", name)
        assert [(s["id"], s["generation"], s["nfe"], s["correct"]) for s in a] == \
               [(s["id"], s["generation"], s["nfe"], s["correct"]) for s in b]  # fmt: skip
    tokens = {r["id"]: r["tokens"] for p in (tmp_path / "single").glob("runs/mbpp/*/shards/*.jsonl")
              for r in read_records(p) if "tdlm" in str(p)}  # fmt: skip
    tokens2 = {r["id"]: r["tokens"] for p in (tmp_path / "sharded").glob("runs/mbpp/*/shards/*.jsonl")
               for r in read_records(p) if "tdlm" in str(p)}  # fmt: skip
    assert tokens == tokens2
    # a resumed run may use another worker count: the 2-shard results finish in-process
    shard_path(tmp_path / "sharded" / "runs" / "mbpp" / "threshold-tau0.9", 1, 2).unlink()
    res = evaluate(cfg_for(tmp_path / "sharded", workers=1, **common))
    assert (res.computed, res.skipped) == (2, 8)
    runs = load_runs([tmp_path / "single", tmp_path / "sharded"])
    assert len(runs) == 4


@needs_data
@pytest.mark.slow
def test_killed_cli_run_resumes_without_recomputing(tmp_path):
    out = tmp_path / "killed"
    args = [sys.executable, str(RUN), "--backbone", "tiny-llada", "--tasks", "mbpp", "--limit", "4",
            "--gen-length", "16", "--block-size", "8", "--policies", "threshold", "--workers", "1", "--threads", "1",
            "--warmup", "0", "--score-workers", "1", "--data-dir", str(DATA), "--output-dir", str(out)]  # fmt: skip
    env = {**os.environ, "TDLM_EVAL_TEST_KILL_AFTER": "2", "OMP_NUM_THREADS": "1"}
    first = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == -9, first.stderr[-2000:]  # SIGKILLed right after the second flushed record
    shard = shard_path(out / "runs" / "mbpp" / "threshold-tau0.9", 0, 1)
    before = shard.read_text()
    assert before.count("\n") == 2 and not (out / "summary.json").exists()
    env.pop("TDLM_EVAL_TEST_KILL_AFTER")
    second = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "2 samples decoded, 2 resumed" in second.stdout and "| Fast-dLLM τ=0.9 |" in second.stdout
    after = shard.read_text()
    assert after.startswith(before) and after.count("\n") == 4
    sessions = [r["worker"]["session"] for r in read_records(shard)]
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]  # two processes, no sample done twice



@needs_data
def test_cli_error_is_one_line(tmp_path, capsys):
    run_cli = _run_cli()
    args = ["--backbone", "tiny-llada", "--tasks", "mbpp", "--limit", "2", "--data-dir", str(DATA),
            "--output-dir", str(tmp_path / "o"), "--policies", "tdlm"]  # fmt: skip
    assert run_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: policy 'tdlm' needs --adapter DIR (a folder written by TDLM.save_adapter)"
    assert run_cli.main(args[:-2] + ["--backbone", str(tmp_path / "missing")]) == 2
    assert "unknown backbone" in capsys.readouterr().err


def test_an_adapter_from_another_backbone_is_refused_unless_allowed(tmp_path):
    # Same architecture, other weights (a Base adapter on an Instruct model): the evaluation refuses the adapter
    # (one line naming it) unless allow_other_backbone / --allow-other-backbone.
    import shutil

    from tdlm.models.loading import _resolve_folder

    shutil.copytree(_resolve_folder("tiny-arith"), tmp_path / "other")  # tokenizer files come along
    other = tdlm.load_backbone("tiny-arith", dtype="float32")
    with torch.no_grad():
        other.blocks[0].q_proj.weight.add_(0.01)
    for f in (tmp_path / "other").glob("*.safetensors*"):
        f.unlink()
    tdlm.save_backbone(other, tmp_path / "other")
    adapter = tdlm.TDLM(tdlm.load_backbone("tiny-arith", dtype="float32"),
                        tdlm.TemporalConfig(layers="dispersed:2", heads=2, head_dim=8)).save_adapter(tmp_path / "ad")
    cfg = cfg_for(tmp_path / "refused", backbone=str(tmp_path / "other"), adapters=[str(adapter)], tasks=["arith"],
                  policies=["tdlm"], limit=1, gen_length=40, block_size=40, dtype="float32")
    with pytest.raises(TDLMError, match=r"trained on backbone 'tiny-arith'.*fingerprint=.*--allow-other-backbone"):
        evaluate(cfg)
    result = evaluate(replace(cfg, output_dir=str(tmp_path / "allowed"), allow_other_backbone=True))
    assert [r["policy"] for r in result.runs] == ["tdlm"]
    assert len(samples_of(result, "arith", result.runs[0]["name"])) == 1
