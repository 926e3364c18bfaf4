"""The embedded default: shipped backbone, default trajectories, and the DEMO_FAST pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tdlm
import tdlm.data.tokenizer  # tdlm is a lazy facade: its submodules are attributes once imported
from tdlm.data.trajectories import read_parquet
from tdlm.demo import (
    _card_accuracy,
    _reproduction,
    diagnostic_table,
    ensure_toy_trajectories,
    frontier_table,
    judge,
    standard_error,
)

REPO = Path(__file__).resolve().parents[1]


def test_shipped_backbone_loads_with_its_tokenizer():
    bb = tdlm.load_backbone("tiny-arith")
    tok = tdlm.data.tokenizer.load_tokenizer("tiny-arith")
    assert bb.backbone_id == "tiny-arith" and bb.mask_token_id == tok.mask_token_id == 2
    assert not any(p.requires_grad for p in bb.parameters())
    card = json.loads((REPO / "tdlm" / "assets" / "tiny-arith" / "training.json").read_text())
    assert card["test_size"] == 500 and 0.0 <= card["test_accuracy_original"]["block40"] <= 1.0
    size = sum(f.stat().st_size for f in (REPO / "tdlm" / "assets" / "tiny-arith").glob("*.safetensors"))
    assert size < 5 * 2**20


def test_shipped_backbone_solves_some_held_out_problems():
    from tdlm.tasks import load_task

    bb = tdlm.load_backbone("tiny-arith", dtype="float32")
    tok = tdlm.data.tokenizer.load_tokenizer("tiny-arith")
    task = load_task("arith", limit=20)
    ids = tdlm.data.tokenizer.encode_prompts(tok, [p.prompt for p in task])
    res = tdlm.decode(bb, ids, policy="original", gen_length=40, block_size=40, tokenizer=tok,
                      stop_ids=tdlm.data.tokenizer.stop_token_ids(tok, bb.eos_token_id))
    card = json.loads((REPO / "tdlm" / "assets" / "tiny-arith" / "training.json").read_text())
    correct = sum(r.text.strip().endswith(f"\\boxed{{{p.answer}}}") for r, p in zip(res, task, strict=True))
    # the card's accuracy is over 500 problems; 20 of them must not be wildly off it
    assert abs(correct / 20 - card["test_accuracy_original"]["block40"]) < 0.35


def test_default_trajectories_are_generated_once(tmp_path):
    folder = tmp_path / "traj"
    ensure_toy_trajectories(folder, "tiny-arith", n=16)
    shards = sorted(folder.glob("shard-*.parquet"))
    recs = [r for s in shards for r in read_parquet(s)]
    assert len(recs) == 16 and all(r.backbone_id == "tiny-arith" and r.T == 40 for r in recs)
    mtime = shards[0].stat().st_mtime
    ensure_toy_trajectories(folder, "tiny-arith", n=16)
    assert shards[0].stat().st_mtime == mtime
    ensure_toy_trajectories(tmp_path / "other", "tiny-llada")  # not the embedded default: left to preflight
    assert not (tmp_path / "other").exists()


def test_judge_states_the_target_honestly():
    """Met needs all three: accuracy within 1 point, <= 0.8x NFE and <= 0.85x seconds; the NFE half alone is named
    as such, and the training-seed spread at the best setting is quoted."""
    base = {"policy": "threshold", "threshold": 0.9, "accuracy": 0.50, "nfe_mean": 10.0, "seconds_mean": 2.0}
    good = {"policy": "tdlm", "threshold": 0.5, "accuracy": 0.495, "nfe_mean": 7.9, "seconds_mean": 1.6}
    slow = {**good, "seconds_mean": 1.8}  # 0.79x NFE but 0.90x seconds
    bad = {"policy": "tdlm", "threshold": 0.9, "accuracy": 0.40, "nfe_mean": 9.0, "seconds_mean": 1.0}
    seeds = {0.5: {"sd": 0.021, "range": [0.47, 0.52], "seeds": 200}}
    text, facts = judge([base, good, bad], seeds)
    assert facts["target_met"] and text.startswith("Target met") and "0.79x its NFE" in text and "0.80x its sec" in text
    assert "sd 2.1 points" in text and facts["seed_spread_at_best"]["sd"] == 0.021
    text, facts = judge([base, slow, bad], seeds)
    assert not facts["target_met"] and facts["nfe_target_met"] and text.startswith("Target NOT met")
    assert "NFE half holds" in text and "0.90x its seconds" in text
    text, facts = judge([base, bad], {})
    assert not facts["target_met"] and not facts["nfe_target_met"] and "no TDLM setting" in text


def test_evidence_names_each_half_of_the_target_by_its_paired_interval():
    """A half is supported only when its whole 95% interval is on the target's side (Δacc above -1 point; NFE and
    seconds ratios, reference / run, above 1/0.8 and 1/0.85), refuted when the whole interval is on the other side,
    undecided otherwise; without paired numbers nothing is said."""
    from tdlm.demo import evidence

    def run(diff_ci, nfe_ci, sec_ci):
        paired = {"n": 500, "accuracy_diff": sum(diff_ci) / 2, "accuracy_diff_ci": diff_ci,
                  "nfe_ratio": sum(nfe_ci) / 2, "nfe_ratio_ci": nfe_ci, "seconds_ratio": sum(sec_ci) / 2,
                  "seconds_ratio_ci": sec_ci}  # fmt: skip
        return {"policy": "tdlm", "threshold": 0.95, "paired": paired}

    text, facts = evidence([run([-0.042, 0.046], [1.37, 1.40], [1.09, 1.14])])
    assert facts["halves"] == {"accuracy": "undecided", "nfe": "supported", "seconds": "refuted"}, facts
    assert "+0.2 points [-4.2, +4.6]" in text and "1.39x fewer NFE [1.37, 1.40]" in text
    # the edges: an interval touching the bound from the target's side supports it
    _, facts = evidence([run([-0.01, 0.03], [1.25, 1.30], [1.0 / 0.85, 1.3])])
    assert facts["halves"] == {"accuracy": "supported", "nfe": "supported", "seconds": "supported"}, facts
    _, facts = evidence([run([-0.05, -0.0101], [1.0, 1.2499], [0.9, 1.17])])
    assert facts["halves"] == {"accuracy": "refuted", "nfe": "refuted", "seconds": "refuted"}, facts
    assert evidence([{"policy": "tdlm", "threshold": 0.95}]) == ("", {})
    assert evidence([{**run([0.0, 0.0], [1.3, 1.3], [1.2, 1.2]), "threshold": 0.9}]) == ("", {})  # no tau 0.95


def test_report_rechecks_the_model_card():
    card = {"test_accuracy_original": {"block40": 0.798, "block8": 0.764}, "test_size": 500}
    assert _card_accuracy(card) == "79.8% with block 40, 76.4% with block 8 (500 held-out test problems)"
    assert _card_accuracy({}) == "not recorded"
    multi = json.loads((REPO / "tdlm" / "assets" / "tiny-multi" / "training.json").read_text())
    text = _card_accuracy(multi)
    assert text.startswith("66.3% with block 56") and "300 validation problems" in text
    same = _reproduction([{"policy": "original", "n": 500, "accuracy": 0.798}], card, 40)
    assert "79.8%" in same and "(identical)" in same
    assert "(DIFFERENT)" in _reproduction([{"policy": "original", "n": 500, "accuracy": 0.79}], card, 40)
    # a subset of the split cannot reproduce the card's number: say nothing rather than compare
    assert _reproduction([{"policy": "original", "n": 12, "accuracy": 0.798}], card, 40) == ""


def test_frontier_table_gives_standard_errors_and_nfe_ratios():
    assert standard_error(0.5, 100) == pytest.approx(0.05)
    runs = [{"policy": "tdlm", "threshold": 0.9, "n": 400, "accuracy": 0.6, "nfe_mean": 15.0, "seconds_mean": 0.9,
             "seconds_se": 0.02},
            {"policy": "threshold", "threshold": 0.7, "n": 400, "accuracy": 0.5, "nfe_mean": 16.0},
            {"policy": "threshold", "threshold": 0.9, "n": 400, "accuracy": 0.66, "nfe_mean": 30.0,
             "seconds_mean": 1.2},
            {"policy": "original", "threshold": None, "n": 400, "accuracy": 0.66, "nfe_mean": 56.0}]
    lines = frontier_table(runs).splitlines()[2:]
    assert [ln.split(" | ")[:2] for ln in lines] == [["| original", "-"], ["| threshold", "0.9"],
                                                     ["| threshold", "0.7"], ["| tdlm", "0.9"]]
    assert "| 60.0 ± 2.4% | 15.00 | 0.50x | 0.900 ± 0.020 | 0.75x |" in lines[3] and "1.87x" in lines[0]
    assert lines[2].endswith("| - | - |")  # no seconds recorded: none invented


def test_diagnostic_table_reads_change_statistics():
    from tdlm.decoding.prediction_history import RequestHistory, change_statistics

    h = RequestHistory(argmax=[[5, 7], [6, 7], [6, 7]], reveal_step=[3, 3], tokens=[6, 7])
    row = {"method": "TDLM", **change_statistics([h], min_masked=3)}
    table = diagnostic_table([row, {"method": "backbone (threshold)", "positions": 0}])
    # position 0: argmax 5, 6 -> 6 (one of two earlier evaluations agrees); position 1: 7 throughout
    assert "| TDLM | 2 | 3.0 | 50.0% | 75.0% | 50.0% | 100.0% / 50.0% / - / - |" in table
    assert "| backbone (threshold) | 0 |" in table
    from tdlm.demo import diagnostic_summary

    text = diagnostic_summary([row, {"method": "backbone (threshold)", "positions": 0}])
    assert "TDLM: 2 positions waited 3.0 evaluations" in text and "50% of them changed" in text
    assert "first evaluation's argmax 50%" in text and "previous evaluation's 100%" in text
    assert "backbone (threshold): no position stayed masked" in text
    # report.json holds the rows after a JSON round trip (string lag keys): same table and text
    again = json.loads(json.dumps([row]))
    assert diagnostic_table(again) == diagnostic_table([row]) and diagnostic_summary(again) == diagnostic_summary([row])


def test_a_demo_folder_of_another_recipe_is_moved_aside(tmp_path, capsys):
    from tdlm.demo import demo_stamp, set_aside_other_demo

    out = tmp_path / "demo"
    (out / "trajectories").mkdir(parents=True)  # e.g. the former tiny-arith demo: stages, no stamp
    set_aside_other_demo(out, "full")
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("demo.previous-")]
    assert len(moved) == 1 and (moved[0] / "trajectories").is_dir() and "moved to" in capsys.readouterr().out
    assert json.loads((out / "demo.json").read_text()) == demo_stamp("full") and not (out / "trajectories").exists()
    (out / "train").mkdir()
    set_aside_other_demo(out, "full")  # same stamp: the stages stay and resume
    assert (out / "train").is_dir()
    set_aside_other_demo(out, "fast")  # another mode: set aside
    assert not (out / "train").exists() and (out / "demo.json").exists()


def test_demo_recipe_configs_agree_with_each_other():
    """configs/gen_tiny_multi.yaml feeds configs/tiny_multi.yaml: same backbone, the training data is the generation
    output, one block of multi-v1's full length, and both parse through the real entry points."""
    from tdlm.config import load_config
    from tdlm.demo import DEMO_BACKBONE, DEMO_GEN_CONFIG, DEMO_TRAIN_CONFIG
    from tdlm.generation import GenerationConfig
    from tdlm.tasks.toydata import MULTI_GEN_LENGTH
    from tdlm.training.launch import parse_launch

    gen = load_config(GenerationConfig, REPO / DEMO_GEN_CONFIG)
    run = parse_launch(["--ds", str(REPO / "ds_configs/zero3.json"), "--config", str(REPO / DEMO_TRAIN_CONFIG)]).run
    assert gen.backbone == run.model.backbone == DEMO_BACKBONE
    assert gen.output_dir == run.data.trajectories
    assert gen.decode.gen_length == gen.decode.block_size == MULTI_GEN_LENGTH and gen.decode.dtype == "float32"


def check_fast_demo_outputs(out: Path) -> None:
    """What a finished DEMO_FAST run holds: every stage's output, through the real entry points."""
    assert len(list((out / "trajectories").glob("shard-*.parquet"))) >= 1
    assert json.loads((out / "trajectories" / "manifest.json").read_text())
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["world_size"] == 2 and summary["zero_stage"] == 3
    assert (out / "train" / "adapter" / "adapter.safetensors").exists()
    ev = json.loads((out / "eval" / "summary.json").read_text())
    assert {r["policy"] for r in ev["runs"]} == {"original", "threshold", "tdlm", "credit", "soft"}
    assert all(r["n"] == 12 for r in ev["runs"])
    # the shipped weights are bf16 on disk; every stage computes in fp32 (as training and the model card)
    assert json.loads((out / "trajectories" / "manifest.json").read_text())["settings"]["dtype"] == "float32"
    assert {r["dtype"] for r in ev["runs"]} == {"float32"}
    assert {r["task"] for r in ev["runs"]} == {"multi"} and {r["backbone"] for r in ev["runs"]} == {"tiny-multi"}
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] and "target_met" in report
    assert [d["method"] for d in report["diagnostic"]] == ["backbone (threshold)", "TDLM"]
    assert all(0.0 < r["accuracy_se"] or r["accuracy"] in (0.0, 1.0) for r in report["runs"])
    text = (out / "report.md").read_text()
    assert "Target" in text and "## Frontiers" in text and "## Diagnostic" in text
    assert "## Paired on the same problems" in text and all("paired" in r for r in report["runs"])
    assert list(out.glob("pareto_*.png"))


@pytest.mark.slow
def test_demo_fast_resumes_after_an_interruption_at_every_stage(tmp_path):
    """Stop the demo after each stage in turn (TDLM_DEMO_INTERRUPT), rerun it each time: it finishes with every
    stage's output (the same checks a run without interruptions passes: one test, since the fast demo is the suite's
    costliest launch), and a further rerun gives the same report (frontier rows, verdict, diagnostic) without redoing
    any stage."""
    from tdlm.demo import STAGES

    base = os.environ | {"DEMO_FAST": "1", "DEMO_DIR": str(tmp_path / "demo"), "OMP_NUM_THREADS": "1",
                         "WANDB_MODE": "offline", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    out = tmp_path / "demo"
    outputs = {"generation": out / "trajectories" / "manifest.json", "training": out / "train" / "summary.json",
               "evaluation": out / "eval" / "summary.json", "diagnostic": out / "diagnostic.json",
               "report": out / "report.md"}
    for stage in STAGES:
        proc = subprocess.run([sys.executable, "-m", "tdlm.demo"], cwd=REPO, env=base | {"TDLM_DEMO_INTERRUPT": stage},
                              capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 130, f"{stage}: " + proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"stopping after the {stage} stage" in proc.stdout and outputs[stage].exists(), stage
        for earlier in STAGES[: min(STAGES.index(stage), 3)]:  # a launched stage that finished is not launched again
            assert f"{earlier}: reusing" in proc.stdout, (stage, earlier, proc.stdout[-3000:])
        later = STAGES[STAGES.index(stage) + 1:]
        assert not any(outputs[s].exists() for s in later if s != "report"), (stage, later)
    assert not (out / "report.json").exists()  # the last interruption came between report.md and report.json
    proc = subprocess.run([sys.executable, "-m", "tdlm.demo"], cwd=REPO, env=base, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "diagnostic: reusing" in proc.stdout and "moved to" not in proc.stdout
    assert all(f"{s}: reusing" in proc.stdout for s in ("generation", "training", "evaluation")), proc.stdout[-3000:]
    check_fast_demo_outputs(out)
    first = json.loads((out / "report.json").read_text())
    proc = subprocess.run([sys.executable, "-m", "tdlm.demo"], cwd=REPO, env=base, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((out / "report.json").read_text())
    for key in ("verdict", "runs", "diagnostic", "target_met"):
        assert again[key] == first[key], key
    assert json.loads((out / "train" / "summary.json").read_text())["steps"] == 8
    assert not list(tmp_path.glob("demo.previous-*")) and not list(out.glob("train.interrupted-*"))
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, "-m", "tdlm.demo"], cwd=REPO, env=base | {"TDLM_DEMO_INTERRUPT": "trainig"},
                       capture_output=True, text=True, timeout=600, check=True)


def test_a_stage_is_reused_only_when_it_finished_with_the_same_command_inputs_and_outputs(tmp_path):
    """The demo launches a stage again unless its stamp says it finished with the same command and the same bytes
    of what it read, and its outputs are still there: each of those changed one at a time is a rerun."""
    from tdlm.demo import stage_reusable
    from tdlm.demo.plan import mark_finished, sha256_of

    upstream, out, stamp = tmp_path / "manifest.json", tmp_path / "adapter.safetensors", tmp_path / "2_train.done.json"
    upstream.write_text("shards: 4\n")
    out.write_bytes(b"weights")

    def key(cmd=("launcher/train.py", "--max-steps", "8")):
        return {"command": list(cmd), "inputs": {str(upstream): sha256_of(upstream)}}

    assert not stage_reusable(stamp, key(), [out])  # never finished
    mark_finished(stamp, key())
    assert stage_reusable(stamp, key(), [out]) and not list(tmp_path.glob("*.tmp-*"))
    assert not stage_reusable(stamp, key(("launcher/train.py", "--max-steps", "9")), [out])  # another command
    assert not stage_reusable(stamp, key(), [out, tmp_path / "summary.json"])  # an output missing
    upstream.write_text("shards: 5\n")  # the stage before ran again and wrote other bytes
    assert not stage_reusable(stamp, key(), [out])
    mark_finished(stamp, key())
    assert stage_reusable(stamp, key(), [out])
    stamp.write_text('{"command": ')  # a stamp cut short (not written by mark_finished) is no stamp
    assert not stage_reusable(stamp, key(), [out])


def test_demo_help_explains_and_starts_nothing(tmp_path):
    """``python -m tdlm.demo --help`` once started the whole 25-minute demo (it read no arguments): it must print the
    environment variables and exit 0 without a stage, and an unknown flag must be refused (exit 2) just as early."""
    env = os.environ | {"DEMO_DIR": str(tmp_path / "demo")}
    proc = subprocess.run([sys.executable, "-m", "tdlm.demo", "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for var in ("DEMO_DIR", "DEMO_FAST", "DEMO_COMPILE", "TDLM_DEMO_INTERRUPT"):
        assert var in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "tdlm.demo", "--fast"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments: --fast" in proc.stderr, proc.stderr
    assert not (tmp_path / "demo").exists()
