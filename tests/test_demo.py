"""The embedded default: shipped backbone, default trajectories, and the DEMO_FAST pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tdlm
from tdlm.demo import DemoPlan, _card_accuracy, _reproduction, ensure_toy_trajectories, judge
from tdlm.trajectories import read_parquet

REPO = Path(__file__).resolve().parents[1]


def test_shipped_backbone_loads_with_its_tokenizer():
    bb = tdlm.load_backbone("tiny-arith")
    tok = tdlm.tokenizer.load_tokenizer("tiny-arith")
    assert bb.backbone_id == "tiny-arith" and bb.mask_token_id == tok.mask_token_id == 2
    assert not any(p.requires_grad for p in bb.parameters())
    card = json.loads((REPO / "tdlm" / "assets" / "tiny-arith" / "training.json").read_text())
    assert card["test_size"] == 500 and 0.0 <= card["test_accuracy_original"]["block40"] <= 1.0
    size = sum(f.stat().st_size for f in (REPO / "tdlm" / "assets" / "tiny-arith").glob("*.safetensors"))
    assert size < 5 * 2**20


def test_shipped_backbone_solves_some_held_out_problems():
    from tdlm.tasks import load_task

    bb = tdlm.load_backbone("tiny-arith", dtype="float32")
    tok = tdlm.tokenizer.load_tokenizer("tiny-arith")
    task = load_task("arith", limit=20)
    ids = tdlm.tokenizer.encode_prompts(tok, [p.prompt for p in task])
    res = tdlm.decode(bb, ids, policy="original", gen_length=40, block_size=40, tokenizer=tok,
                      stop_ids=tdlm.tokenizer.stop_token_ids(tok, bb.eos_token_id))
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
    base = {"policy": "threshold", "threshold": 0.9, "accuracy": 0.50, "nfe_mean": 10.0}
    good = {"policy": "tdlm", "threshold": 0.5, "accuracy": 0.495, "nfe_mean": 7.9}
    bad = {"policy": "tdlm", "threshold": 0.9, "accuracy": 0.40, "nfe_mean": 9.0}
    text, facts = judge([base, good, bad])
    assert facts["target_met"] and text.startswith("Target met") and "0.79x" in text
    text, facts = judge([base, bad])
    assert not facts["target_met"] and text.startswith("Target NOT met")


def test_report_rechecks_the_model_card():
    card = {"test_accuracy_original": {"block40": 0.798, "block8": 0.764}, "test_size": 500}
    assert _card_accuracy(card) == "79.8% with block 40, 76.4% with block 8 (500 problems)"
    assert _card_accuracy({}) == "not recorded"
    plan = DemoPlan(Path("x"), prompts=8, train_steps=1, test_problems=500, thresholds=(0.9,), block_size=40)
    same = _reproduction([{"policy": "original", "n": 500, "accuracy": 0.798}], card, plan)
    assert "79.8%" in same and "(identical)" in same
    assert "(DIFFERENT)" in _reproduction([{"policy": "original", "n": 500, "accuracy": 0.79}], card, plan)
    # a subset of the split cannot reproduce the card's number: say nothing rather than compare
    assert _reproduction([{"policy": "original", "n": 12, "accuracy": 0.798}], card, plan) == ""


@pytest.mark.slow
def test_demo_fast_runs_every_stage(tmp_path):
    env = os.environ | {"DEMO_FAST": "1", "DEMO_DIR": str(tmp_path / "demo"), "OMP_NUM_THREADS": "1",
                        "WANDB_MODE": "offline", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "tdlm.demo"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "demo"
    assert len(list((out / "trajectories").glob("shard-*.parquet"))) >= 1
    assert json.loads((out / "trajectories" / "manifest.json").read_text())
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["world_size"] == 2 and summary["zero_stage"] == 3
    assert (out / "train" / "adapter" / "adapter.safetensors").exists()
    ev = json.loads((out / "eval" / "summary.json").read_text())
    assert {r["policy"] for r in ev["runs"]} == {"original", "threshold", "tdlm"}
    assert all(r["n"] == 12 for r in ev["runs"])
    # the shipped weights are bf16 on disk; every stage computes in fp32 (as training and the model card)
    assert json.loads((out / "trajectories" / "manifest.json").read_text())["settings"]["dtype"] == "float32"
    assert {r["dtype"] for r in ev["runs"]} == {"float32"}
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] and "target_met" in report
    assert "Target" in (out / "report.md").read_text()
    assert list(out.glob("pareto_*.png"))
