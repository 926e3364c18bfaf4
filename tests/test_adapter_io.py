"""Adapter files and the step-wise cache."""

from __future__ import annotations

import json

import pytest
import torch

import tdlm
from tdlm.temporal.adapter_files import ADAPTER_CONFIG


def test_adapter_round_trip(tmp_path):
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="middle:2", heads=2, head_dim=8, history="last:3"))
    with torch.no_grad():
        for mod in model.temporal.values():
            mod.o_proj.weight.normal_()
            mod.sink.fill_(0.7)
    out = model.save_adapter(tmp_path / "ad")
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    assert cfg["layers"] == [1, 2] and cfg["heads"] == 2 and cfg["head_dim"] == 8
    assert cfg["backbone"]["hidden_size"] == 64 and cfg["backbone"]["id"] == "tiny-llada"
    again = tdlm.TDLM.from_adapter(tdlm.load_backbone("tiny-llada"), out)
    assert str(again.policy) == "last:3"
    for k, v in model.adapter_state_dict().items():
        assert torch.equal(again.adapter_state_dict()[k], v)
    x = torch.randint(3, 128, (1, 3, 20))
    x[:, :, 8:] = bb.mask_token_id
    x[:, 2, 8:12] = 40
    with torch.no_grad():
        assert torch.equal(model.forward_states(x, 8), again.forward_states(x, 8))
    assert tdlm.TDLM.from_adapter(bb, out, history="current").policy.kind == "current"


def test_adapter_on_wrong_backbone_fails_clearly(tmp_path):
    model = tdlm.TDLM(tdlm.load_backbone("tiny-llada"))
    out = model.save_adapter(tmp_path / "ad")
    other = tdlm.load_backbone("tiny-dream")
    with torch.device("meta"):
        from tdlm.models import LLaDA, LLaDAConfig

        big = LLaDA(LLaDAConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden_size=64,
                                vocab_size=128, embedding_size=128))
    with pytest.raises(tdlm.TDLMError, match="hidden_size=64"):
        tdlm.TDLM.from_adapter(big, out)
    # same dims, another family: refused (the adapter records its backbone) unless told otherwise ...
    with pytest.raises(tdlm.TDLMError, match=r"trained on backbone 'tiny-llada'.*family='llada' \(this backbone: "
                                             r"'dream'\).*allow_other_backbone=True"):
        tdlm.TDLM.from_adapter(other, out)
    # ... and then heads x head_dim must still match the tensors
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    cfg["heads"] = 4
    (out / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(tdlm.TDLMError, match="heads=4 x head_dim=16"):
        tdlm.TDLM.from_adapter(other, out, allow_other_backbone=True)
    with pytest.raises(tdlm.TDLMError, match=f"missing {ADAPTER_CONFIG}"):
        tdlm.TDLM.from_adapter(other, tmp_path)


def test_adapter_refuses_a_same_shape_backbone_with_other_weights(tmp_path):
    # "A Base adapter on an Instruct model": same architecture and files sizes, other weights.
    base = tdlm.load_backbone("tiny-llada")
    tdlm.save_backbone(base, tmp_path / "base")
    instruct = tdlm.load_backbone("tiny-llada")
    with torch.no_grad():
        instruct.blocks[0].q_proj.weight.add_(0.01)
    tdlm.save_backbone(instruct, tmp_path / "instruct")
    base, instruct = tdlm.load_backbone(str(tmp_path / "base")), tdlm.load_backbone(str(tmp_path / "instruct"))
    assert base.weight_fingerprint != instruct.weight_fingerprint
    sizes = [sorted(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in ("base", "instruct")]
    assert sizes[0] == sizes[1]
    out = tdlm.TDLM(base).save_adapter(tmp_path / "ad")
    assert json.loads((out / ADAPTER_CONFIG).read_text())["backbone"]["fingerprint"] == base.weight_fingerprint
    tdlm.TDLM.from_adapter(tdlm.load_backbone(str(tmp_path / "base")), out)  # the same weights: fine
    with pytest.raises(tdlm.TDLMError, match=r"fingerprint='w1:[0-9a-f]+' \(this backbone: 'w1:"):
        tdlm.TDLM.from_adapter(instruct, out)
    tdlm.TDLM.from_adapter(instruct, out, allow_other_backbone=True)
    # an adapter written before fingerprints existed still loads
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    del cfg["backbone"]["fingerprint"]
    (out / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    tdlm.TDLM.from_adapter(instruct, out)


def _run(model, states, P):
    cache = model.new_cache(states.shape[0])
    for i in range(states.shape[1]):
        model.forward_step(states[:, i], P, cache)
    return cache


def test_cache_invalidates_revealed_positions_and_keeps_other_blocks():
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb)
    P, N = 4, 8
    x = torch.randint(3, 128, (1, 4, P + N))
    x[:, :, P:] = bb.mask_token_id
    x[:, 2, P] = 50  # step 2 reveals position 0 (first block)
    x[:, 3, P] = 50
    x[:, 3, P + 1] = 51  # step 3 reveals position 1
    with torch.no_grad():
        cache = _run(model, x, P)
    counts = cache.valid_entries()[0]
    assert counts[0] == 0 and counts[1] == 0  # revealed -> history dead
    assert (counts[2:] == 4).all()  # every other position (any block) kept all 4 entries
    assert cache.steps == 4


def test_last_k_bounds_cache_memory():
    bb = tdlm.load_backbone("tiny-llada")
    P, N = 4, 8
    sizes = {}
    for policy in ("full", "last:2", "current"):
        model = tdlm.TDLM(bb, tdlm.TemporalConfig(history=policy))
        sizes[policy] = []
        for steps in (3, 9):
            x = torch.randint(3, 128, (1, steps, P + N))
            x[:, :, P:] = bb.mask_token_id
            with torch.no_grad():
                sizes[policy].append(_run(model, x, P).nbytes())
    assert sizes["full"][1] > sizes["full"][0]
    assert sizes["last:2"][0] == sizes["last:2"][1]
    assert sizes["current"] == [0, 0]


def test_cache_rejects_other_shapes():
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb)
    cache = model.new_cache(1)
    x = torch.full((1, 12), bb.mask_token_id)
    model.forward_step(x, 4, cache)
    with pytest.raises(tdlm.TDLMError, match="prompt_len=4"):
        model.forward_step(x, 5, cache)
    with pytest.raises(tdlm.TDLMError, match="batch size 1"):
        model.forward_step(x.repeat(2, 1), 4, cache)


def test_an_adapter_config_that_is_not_a_json_object_is_one_line(tmp_path):
    """Both readers of an adapter's config (the history read before loading, and the full load) share one reader:
    a config that is JSON but not an object is one line naming the file, not an AttributeError."""
    from tdlm.temporal.adapter_files import trained_history

    model = tdlm.TDLM(tdlm.load_backbone("tiny-llada"), tdlm.TemporalConfig(layers="all", heads=2, head_dim=8))
    d = model.save_adapter(tmp_path / "a")
    assert trained_history(d) == "full"
    (d / ADAPTER_CONFIG).write_text(json.dumps([1, 2]))
    for read in (lambda: trained_history(d), lambda: tdlm.TDLM.from_adapter(tdlm.load_backbone("tiny-llada"), d)):
        with pytest.raises(tdlm.TDLMError, match=rf"{ADAPTER_CONFIG}: expected a JSON object, got list"):
            read()
