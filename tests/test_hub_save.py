"""Which writer writes what: ``TDLM.save_pretrained`` (the adapter and its card, the pair of ``TDLM.from_pretrained``),
``tdlm.hub.save_pretrained`` (the same folder, plus the card's evaluation table), ``tdlm.save_backbone`` (a backbone
release folder) and the deprecated ``tdlm.save_pretrained`` (the old name of ``save_backbone``). A TDLM handed to a
backbone writer used to have every backbone shard written before an AttributeError; it is refused before any file."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file

import tdlm
import tdlm.hub
from tdlm.temporal.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD
from tests.conftest import randomize_temporal


@pytest.fixture(scope="module")
def backbone():
    return tdlm.load_backbone("tiny-arith", dtype="float32")


@pytest.fixture
def model(backbone):
    torch.manual_seed(0)
    m = tdlm.TDLM(backbone, tdlm.TemporalConfig(layers="dispersed:2", heads=2, head_dim=16, history="last:3"))
    randomize_temporal(m, seed=5)
    return m


def _state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def test_tdlm_save_pretrained_writes_the_adapter_and_card_that_from_pretrained_reads(tmp_path, model, backbone):
    out = model.save_pretrained(tmp_path / "ad", repo_id="someone/tdlm-tiny")
    assert out == tmp_path / "ad"
    assert sorted(p.name for p in out.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD])
    card = (out / CARD).read_text()
    assert card.startswith("---\n") and "library_name: tdlm" in card and "`last:3`" in card
    assert 'TDLM.from_pretrained("tiny-arith", "someone/tdlm-tiny")' in card and "No evaluation recorded yet" in card
    # the weights on disk are this model's temporal weights, every one, and nothing of the backbone
    saved, mine = load_file(str(out / ADAPTER_WEIGHTS)), model.adapter_state_dict()
    assert saved.keys() == mine.keys() and all(torch.equal(saved[k], mine[k]) for k in mine)
    assert all(k.startswith("temporal.") for k in saved)
    again = tdlm.TDLM.from_pretrained(backbone, out)
    loaded = again.adapter_state_dict()
    assert loaded.keys() == mine.keys() and all(torch.equal(loaded[k], mine[k]) for k in mine)
    assert str(again.policy) == "last:3" and again.adapter_config() == model.adapter_config()
    # one writer: the Hub layer's folder (no evaluations) is byte for byte the model's
    hub = tdlm.hub.save_pretrained(model, tmp_path / "hub", repo_id="someone/tdlm-tiny")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD):
        assert (hub / name).read_bytes() == (out / name).read_bytes(), name


def test_save_backbone_round_trips_and_the_old_name_still_writes_a_backbone_with_a_warning(tmp_path):
    bb = tdlm.load_backbone("tiny-llada")
    folder = tdlm.save_backbone(bb, tmp_path / "new", max_shard_bytes=100_000)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "config.json").exists()
    back = tdlm.load_backbone(str(folder))
    a, b = _state(bb), _state(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.warns(DeprecationWarning, match="renamed tdlm.save_backbone"):
        old = tdlm.save_pretrained(bb, tmp_path / "old", max_shard_bytes=100_000)
    assert sorted(p.name for p in old.glob("*.safetensors")) == shards
    for name in [*shards, "config.json", "model.safetensors.index.json"]:
        assert (old / name).read_bytes() == (folder / name).read_bytes(), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name warns about nothing
        tdlm.save_backbone(bb, tmp_path / "quiet")


@pytest.mark.parametrize("writer", ["save_pretrained", "save_backbone"])
def test_backbone_writers_refuse_a_tdlm_in_one_line_before_writing_anything(tmp_path, model, writer):
    target = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(tdlm.TDLMError) as err:
            getattr(tdlm, writer)(model, target)
    msg = str(err.value)
    assert "\n" not in msg and "not a TDLM adapter" in msg and "model.save_pretrained(dir)" in msg, msg
    assert msg.startswith(f"tdlm.{writer} "), msg  # names the function the caller called
    assert "tdlm.save_backbone(model.backbone, dir)" in msg
    assert not target.exists(), sorted(p.name for p in target.rglob("*"))  # no shard, not even the folder
    with pytest.raises(tdlm.TDLMError, match=r"writes a tdlm Backbone .*got Linear$"):
        getattr(tdlm, writer)(torch.nn.Linear(2, 2), target)
    assert not target.exists()
