"""Dream (Dream-v0-Instruct-7B architecture, Qwen2-style), written natively.

GQA attention with biased q/k/v and bias-free ``o_proj``, SwiGLU MLP, RMSNorm, half-split RoPE,
bidirectional attention. Names equal the release keys (``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``).

Dream was initialised from an autoregressive model and keeps its **logit shift**: the token at
position p is predicted from the hidden state at p-1. ``logit_shift = 1`` makes :meth:`Backbone.head`
apply the shift, so every caller sees aligned logits (entry p predicts position p), as the release's
``diffusion_generate`` does with ``cat([logits[:, :1], logits[:, :-1]], 1)``; a left-padded row's first
real token keeps its own logits, as position 0 does unpadded.

Reference: Ye et al., "Dream 7B" (2025).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tdlm.errors import TDLMError
from tdlm.models.common import Backbone, ForwardContext, RMSNorm, apply_rope, spatial_attention
from tdlm.models.kv_cache import LayerKV


@dataclass
class DreamConfig:
    hidden_size: int = 3584
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    intermediate_size: int = 18944
    vocab_size: int = 152064
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    mask_token_id: int = 151666
    eos_token_id: int = 151643
    pad_token_id: int = 151643
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    # Not in the release: toy checkpoints written by tdlm carry their own temporal defaults.
    tdlm_temporal_default: dict | None = None

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> DreamConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        for required in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if required not in values:
                raise TDLMError(f"{source}: Dream config is missing field '{required}'")
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        if isinstance(values.get("eos_token_id"), list):
            values["eos_token_id"] = values["eos_token_id"][0]
        cfg = cls(**values)
        if cfg.hidden_size % cfg.num_attention_heads:
            raise TDLMError(
                f"{source}: hidden_size={cfg.hidden_size} is not divisible by "
                f"num_attention_heads={cfg.num_attention_heads}"
            )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise TDLMError(
                f"{source}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        return cfg

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d.get("tdlm_temporal_default") is None:
            d.pop("tdlm_temporal_default")
        d.update(model_type="Dream", architectures=["DreamModel"])
        return d


class DreamAttention(nn.Module):
    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = d // self.n_heads
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)

    def forward(self, a: torch.Tensor, ctx: ForwardContext, layer: int | LayerKV | None = None) -> torch.Tensor:
        B, L, _ = a.shape
        q = self.q_proj(a).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, hd)
        k = self.k_proj(a).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, L, hd)
        v = self.v_proj(a).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        o = spatial_attention(q, k, v, ctx, layer).transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(o)


class DreamMLP(nn.Module):
    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DreamLayer(nn.Module):
    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DreamAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DreamMLP(cfg)

    def attend(self, x: torch.Tensor, ctx: ForwardContext, layer: int | LayerKV | None = None) -> torch.Tensor:
        """x + attention of the computed positions (all L, or a window of W with the spatial KV cache of ``layer``)."""
        return x + self.self_attn(self.input_layernorm(x), ctx, layer)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))


class _DreamModel(nn.Module):
    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DreamLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Dream(Backbone):
    """Dream denoiser with the logit shift applied inside; keys are the release's keys."""

    family = "dream"
    logit_shift = 1
    supports_kv_cache = True

    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _DreamModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mask_token_id = cfg.mask_token_id
        self.eos_token_id = cfg.eos_token_id
        self.pad_token_id = cfg.pad_token_id
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.hidden_size = cfg.hidden_size
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.rope_theta = cfg.rope_theta

    @property
    def blocks(self) -> nn.ModuleList:  # type: ignore[override]
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embedding_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))  # (..., V); from position p it predicts p + 1

    def default_temporal(self) -> dict:
        if self.cfg.tdlm_temporal_default:
            return dict(self.cfg.tdlm_temporal_default)
        # Paper Section 3.1: fourteen middle layers (of 28), four heads of width 84.
        n = self.num_layers
        return {"layers": f"middle:{max(1, n // 2)}", "heads": 4, "head_dim": 84}

    def config_dict(self) -> dict:
        return self.cfg.to_dict()
