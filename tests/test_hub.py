"""Hub adapters: save_pretrained / from_pretrained / push_to_hub through huggingface_hub, the model card, the rename
away from PEFT's file name (old folders still load). The network boundary is HfApi.create_repo / upload_folder, which
these tests replace with recorders; loading by repo id reads the Hugging Face cache with HF_HUB_OFFLINE set."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tdlm
import tdlm.hub
from tdlm.temporal.adapter_files import ADAPTER_CONFIG, ADAPTER_CONFIG_LEGACY, ADAPTER_WEIGHTS
from tests.conftest import randomize_temporal

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def backbone():
    return tdlm.load_backbone("tiny-arith", dtype="float32")


@pytest.fixture
def model(backbone):
    m = tdlm.TDLM(backbone, tdlm.TemporalConfig(layers="dispersed:2", heads=2, head_dim=16, history="last:3"))
    randomize_temporal(m, seed=3)
    return m


def _same_weights(a, b) -> None:
    sa, sb = a.adapter_state_dict(), b.adapter_state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _hf_cache(cache: Path, repo_id: str, files: Path, commit: str = "0" * 40) -> None:
    """The Hugging Face cache layout a `hf download` leaves behind (refs/main -> snapshots/<commit>/files)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(files, repo / "snapshots" / commit)


def test_save_pretrained_writes_tdlm_files_and_a_card(tmp_path, model):
    out = tdlm.hub.save_pretrained(model, tmp_path / "ad")
    assert sorted(p.name for p in out.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md"])
    assert ADAPTER_CONFIG != "adapter_config.json"  # PEFT's name: Hub tooling would take it for a PEFT adapter
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: tdlm" in card
    assert "`tiny-arith`" in card and "2 (1, 4)" in card and "`last:3`" in card
    assert f"{model.num_temporal_parameters():,}" in card
    assert "No evaluation recorded yet" in card
    again = tdlm.TDLM.from_pretrained("tiny-arith", out, dtype="float32")
    _same_weights(model, again)
    assert str(again.policy) == "last:3"


def test_from_pretrained_reads_a_hub_repo_from_the_cache_offline(tmp_path, model, backbone, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = tdlm.hub.save_pretrained(model, tmp_path / "files")
    _hf_cache(tmp_path / "cache", "someone/tdlm-tiny-arith", files)
    loaded = tdlm.TDLM.from_pretrained(backbone, "someone/tdlm-tiny-arith", cache_dir=tmp_path / "cache")
    _same_weights(model, loaded)
    x = torch.randint(3, 100, (1, 3, 24))
    x[:, :, 10:] = backbone.mask_token_id
    x[:, 2, 10:14] = 40
    with torch.no_grad():
        assert torch.equal(model.forward_states(x, 10), loaded.forward_states(x, 10))
    with pytest.raises(tdlm.TDLMError, match=r"^adapter 'someone/not-cached': not a local folder and not in the "
                                             r"Hugging Face cache.*hf download someone/not-cached"):
        tdlm.TDLM.from_pretrained(backbone, "someone/not-cached", cache_dir=tmp_path / "cache")
    with pytest.raises(tdlm.TDLMError, match="not a folder, and not a Hub repo id"):
        tdlm.TDLM.from_pretrained(backbone, str(tmp_path / "no" / "such" / "folder"))
    # the backbone check of from_adapter holds for Hub adapters too
    other = tdlm.load_backbone("tiny-arith", dtype="float32")
    with torch.no_grad():
        other.blocks[0].q_proj.weight.add_(0.01)
    other.weight_fingerprint = None
    with pytest.raises(tdlm.TDLMError, match="allow_other_backbone=True"):
        tdlm.TDLM.from_pretrained(other, "someone/tdlm-tiny-arith", cache_dir=tmp_path / "cache")


def test_push_to_hub_uploads_the_adapter_and_card_through_hfapi(tmp_path, model, monkeypatch):
    from huggingface_hub import HfApi

    calls = {}

    def create_repo(self, repo_id, **kw):
        calls["create_repo"] = (repo_id, kw)

    def upload_folder(self, *, repo_id, folder_path, **kw):
        folder = Path(folder_path)
        allow = kw["allow_patterns"]
        calls["upload"] = {"repo_id": repo_id, "kw": kw,
                           "files": {p.name: p.read_bytes() for p in folder.iterdir() if p.name in allow}}
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    info = tdlm.hub.push_to_hub(model, "someone/tdlm-tiny", private=True, commit_message="first adapter")
    assert info == "commit-info"
    assert calls["create_repo"] == ("someone/tdlm-tiny", {"private": True, "exist_ok": True, "repo_type": "model"})
    up = calls["upload"]
    assert up["repo_id"] == "someone/tdlm-tiny" and up["kw"]["commit_message"] == "first adapter"
    assert sorted(up["files"]) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md"])
    ref = tdlm.hub.save_pretrained(model, tmp_path / "ref")
    assert up["files"][ADAPTER_WEIGHTS] == (ref / ADAPTER_WEIGHTS).read_bytes()
    assert json.loads(up["files"][ADAPTER_CONFIG]) == json.loads((ref / ADAPTER_CONFIG).read_text())
    assert b'TDLM.from_pretrained("tiny-arith", "someone/tdlm-tiny")' in up["files"]["README.md"]
    # an old folder (PEFT's file name) is not pushed as is
    legacy = tmp_path / "legacy"
    shutil.copytree(ref, legacy)
    (legacy / ADAPTER_CONFIG).rename(legacy / ADAPTER_CONFIG_LEGACY)
    from tdlm.hub import upload_adapter_folder

    with pytest.raises(tdlm.TDLMError, match="save_pretrained it first"):
        upload_adapter_folder(legacy, "someone/x")


def test_old_folders_with_peft_file_name_still_load_and_peft_adapters_are_refused(tmp_path, model, backbone):
    out = model.save_adapter(tmp_path / "old")
    (out / ADAPTER_CONFIG).rename(out / ADAPTER_CONFIG_LEGACY)  # a folder written before the rename
    _same_weights(model, tdlm.TDLM.from_adapter(backbone, out))
    _same_weights(model, tdlm.TDLM.from_pretrained(backbone, out))
    from tdlm.evaluation.config import read_adapter_config
    from tdlm.temporal.adapter_files import adapter_fingerprint

    assert read_adapter_config(str(out))["layers"] == [1, 4]
    new = model.save_adapter(tmp_path / "new")
    assert adapter_fingerprint(str(out)) == adapter_fingerprint(str(new))  # same content: evaluations resume
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / ADAPTER_CONFIG_LEGACY).write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (peft / ADAPTER_WEIGHTS).write_bytes(b"")
    with pytest.raises(tdlm.TDLMError, match=r"a PEFT adapter \(peft_type='LORA'\), not a TDLM adapter"):
        tdlm.TDLM.from_adapter(backbone, peft)


def test_card_holds_the_evaluation_table_and_the_cli_writes_it(tmp_path, model):
    from tdlm.decoding.config import DecodeSettings
    from tdlm.evaluation import EvalConfig, evaluate

    ad = tdlm.hub.save_pretrained(model, tmp_path / "ad")
    ev = tmp_path / "eval"
    evaluate(EvalConfig(backbone="tiny-arith", output_dir=str(ev), tasks=["arith"], limit=3, adapters=[f"mine={ad}"],
                        policies=["original", "tdlm"], thresholds=[0.9], workers=1, wandb_mode="disabled", warmup=0,
                        decode=DecodeSettings(gen_length=40, block_size=40, dtype="float32")))
    proc = subprocess.run([sys.executable, "-m", "tdlm.hub", "card", str(ad), "--eval", str(ev), "--repo-id",
                           "someone/tdlm-tiny"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    card = (ad / "README.md").read_text()
    summary = json.loads((ev / "summary.json").read_text())
    tdlm_run = next(r for r in summary["runs"] if r["policy"] == "tdlm")
    assert "| Arith (tiny-arith held-out) | Original (one token per step) | 3 |" in card
    acc, nfe = 100 * tdlm_run["accuracy"], tdlm_run["nfe_mean"]
    assert f"| **TDLM τ=0.9** (history last:3) | 3 | {acc:.2f} | {nfe:.2f} |" in card
    # a copy of the weights elsewhere (save_pretrained of the loaded model) still finds its evaluation
    loaded = tdlm.TDLM.from_pretrained("tiny-arith", ad, dtype="float32")
    copy = tdlm.hub.save_pretrained(loaded, tmp_path / "copy", [ev])
    assert hashlib.sha256((copy / ADAPTER_WEIGHTS).read_bytes()).digest() == hashlib.sha256(
        (ad / ADAPTER_WEIGHTS).read_bytes()).digest()
    assert "**TDLM τ=0.9**" in (copy / "README.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "tdlm.hub", "card", str(tmp_path / "missing")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1
