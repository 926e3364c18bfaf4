"""Native backbones: release key names, folder round trip, padding, bad input."""

from __future__ import annotations

import json

import pytest
import torch

import tdlm
from tdlm.models.loading import PRESETS, build_backbone, save_backbone

LLADA_BLOCK_KEYS = {
    "attn_norm.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "attn_out.weight",
    "ff_norm.weight", "ff_proj.weight", "up_proj.weight", "ff_out.weight",
}
DREAM_LAYER_KEYS = {
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
}


def test_llada_state_dict_uses_release_keys():
    bb = tdlm.load_backbone("tiny-llada")
    keys = set(bb.state_dict())
    expected = {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"}
    for i in range(bb.num_layers):
        expected |= {f"model.transformer.blocks.{i}.{k}" for k in LLADA_BLOCK_KEYS}
    assert keys == expected


def test_dream_state_dict_uses_release_keys():
    bb = tdlm.load_backbone("tiny-dream")
    keys = set(bb.state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(bb.num_layers):
        expected |= {f"model.layers.{i}.{k}" for k in DREAM_LAYER_KEYS}
    assert keys == expected


def test_release_configs_build_the_published_shapes():
    from tdlm.models import Dream, DreamConfig, LLaDA, LLaDAConfig

    with torch.device("meta"):
        llada = LLaDA(LLaDAConfig())
        dream = Dream(DreamConfig())
    assert 7.5e9 < llada.num_parameters() < 8.5e9  # LLaDA-8B
    assert 7.0e9 < dream.num_parameters() < 8.0e9  # Dream-7B (Qwen2.5-7B shape)
    assert dream.model.layers[0].self_attn.k_proj.weight.shape == (512, 3584)  # GQA 4 KV heads


@pytest.mark.parametrize("name", list(PRESETS))
def test_release_folder_round_trip(name, tmp_path):
    bb = tdlm.load_backbone(name)
    folder = save_backbone(bb, tmp_path / "ckpt", max_shard_bytes=100_000)  # forces several shards
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(bb.state_dict()) and set(index["weight_map"].values()) == set(shards)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["mask_token_id"] == bb.mask_token_id
    loaded = tdlm.load_backbone(str(folder))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    x = torch.randint(3, 128, (2, 17))
    with torch.no_grad():
        assert torch.equal(loaded(x), bb(x))


def test_release_style_config_json_is_accepted(tmp_path):
    # A config.json written the way the LLaDA release writes it (extra fields, AutoMap, etc.).
    bb = tdlm.load_backbone("tiny-llada")
    folder = save_backbone(bb, tmp_path / "ckpt")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("tdlm_temporal_default")
    cfg.update(
        {"auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"}, "activation_type": "silu",
         "alibi": False, "layer_norm_type": "rms", "mlp_ratio": 4, "init_device": "meta"}
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded = tdlm.load_backbone(str(folder))
    assert loaded.mask_token_id == 2 and loaded.default_temporal()["heads"] == 4


def test_bf16_checkpoint_on_cpu_warns_unless_a_dtype_is_chosen(tmp_path, caplog):
    folder = save_backbone(tdlm.load_backbone("tiny-llada").to(torch.bfloat16), tmp_path / "ckpt")
    with caplog.at_level("WARNING", logger="tdlm.models"):
        assert next(tdlm.load_backbone(str(folder)).parameters()).dtype == torch.bfloat16
    assert "dtype='float32'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tdlm.models"):
        assert next(tdlm.load_backbone(str(folder), dtype="float32").parameters()).dtype == torch.float32
    assert caplog.text == ""


def _pad_left(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    am = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = r
        am[i, L - len(r):] = 1
    return ids, am


def test_padded_batch_equals_per_sample(backbone_name):
    bb = tdlm.load_backbone(backbone_name)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (9, 16, 12)]
    ids, am = _pad_left(rows, bb.pad_token_id)
    with torch.no_grad():
        batched = bb(ids, attention_mask=am)
        for i, r in enumerate(rows):
            single = bb(r[None])[0]
            assert torch.allclose(batched[i, -len(r):], single, rtol=1e-5, atol=1e-5)


def test_tdlm_padded_batch_equals_per_sample(backbone_name):
    bb = tdlm.load_backbone(backbone_name)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all"))
    with torch.no_grad():
        for mod in model.temporal.values():
            mod.o_proj.weight.normal_(0, 0.2)
    g = torch.Generator().manual_seed(1)
    N = 10
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (5, 9)]
    resp = torch.randint(3, 128, (2, N), generator=g)
    reveal = torch.randint(1, 4, (2, N), generator=g)  # reveal steps 1..3
    outs_b, outs_s = [], []
    cache_b = model.new_cache(2)
    caches = [model.new_cache(1) for _ in prompts]
    for s in range(3):
        r = torch.where(reveal <= s, resp, torch.full_like(resp, bb.mask_token_id))
        rows = [torch.cat([p, r[i]]) for i, p in enumerate(prompts)]
        ids, am = _pad_left(rows, bb.pad_token_id)
        P = ids.shape[1] - N
        with torch.no_grad():
            outs_b.append(model.forward_step(ids, P, cache_b, attention_mask=am)[:, P:])
            outs_s.append(
                torch.stack([model.forward_step(rows[i][None], len(p), caches[i])[0, len(p):]
                             for i, p in enumerate(prompts)])
            )
    for b, s in zip(outs_b, outs_s, strict=True):
        assert torch.allclose(b, s, rtol=1e-5, atol=1e-5)


def test_bad_inputs_give_one_line_errors(tmp_path):
    with pytest.raises(tdlm.TDLMError, match="unknown backbone 'nope'"):
        tdlm.load_backbone("nope")
    with pytest.raises(tdlm.TDLMError, match="never downloads"):
        tdlm.load_backbone("GSAI-ML/Not-A-Cached-Model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(tdlm.TDLMError, match="no config.json"):
        tdlm.load_backbone(str(empty))
    (empty / "config.json").write_text(json.dumps(PRESETS["tiny-llada"]["config"] | {"model_type": "llada"}))
    with pytest.raises(tdlm.TDLMError, match="no weights found"):
        tdlm.load_backbone(str(empty))
    (empty / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(tdlm.TDLMError, match="not a supported backbone"):
        tdlm.load_backbone(str(empty))
    bb = tdlm.load_backbone("tiny-llada")
    with pytest.raises(tdlm.TDLMError, match=r"out of range .* 4 layers \(valid: 0..3\)"):
        tdlm.TDLM(bb, tdlm.TemporalConfig(layers=[1, 7]))
    with pytest.raises(tdlm.TDLMError, match="not understood"):
        tdlm.TDLM(bb, tdlm.TemporalConfig(layers="sparse:3"))
    with pytest.raises(tdlm.TDLMError, match="history policy"):
        tdlm.TDLM(bb, tdlm.TemporalConfig(history="last:0"))
    model = tdlm.TDLM(bb)
    with pytest.raises(tdlm.TDLMError, match=r"shape \[B, K, L\]; got shape \(2, 5\)"):
        model.forward_states(torch.zeros(2, 5, dtype=torch.long), 1)
    with pytest.raises(tdlm.TDLMError, match=r"2-D LongTensor \[batch, length\]; got shape \(5,\)"):
        bb(torch.zeros(5, dtype=torch.long))
    with pytest.raises(tdlm.TDLMError, match="prompt_len"):
        model.forward_step(torch.zeros(1, 5, dtype=torch.long), 9, model.new_cache(1))


def test_truncated_checkpoint_is_reported(tmp_path):
    bb = tdlm.load_backbone("tiny-dream")
    folder = save_backbone(bb, tmp_path / "ckpt", max_shard_bytes=100_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (folder / victim).unlink()
    with pytest.raises(tdlm.TDLMError, match="shard"):
        tdlm.load_backbone(str(folder))
    cfg = build_backbone("dream", PRESETS["tiny-dream"]["config"])
    assert cfg.num_layers == 4
