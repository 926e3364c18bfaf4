"""LLaDA (LLaDA-8B-Instruct architecture), written natively.

Pre-norm blocks with RMSNorm, bias-free q/k/v/out projections, SwiGLU feed-forward and half-split
RoPE, with *bidirectional* attention. Module names equal the released checkpoint keys
(``model.transformer.{wte, blocks.{i}.{attn_norm,q_proj,k_proj,v_proj,attn_out,ff_norm,ff_proj,
up_proj,ff_out}, ln_f, ff_out}``) so a released folder loads as a plain key match.

Reference: Nie et al., "Large Language Diffusion Models" (2025); configuration fields follow the
release's ``config.json`` (``d_model``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``mlp_hidden_size``,
``rope_theta``, ``rms_norm_eps``, ``vocab_size``, ``embedding_size``, ``mask_token_id`` ...).
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
class LLaDAConfig:
    d_model: int = 4096  # hidden size
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    mlp_hidden_size: int = 12288  # SwiGLU inner width
    vocab_size: int = 126464
    embedding_size: int = 126464  # rows of wte / ff_out (>= vocab_size)
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    rope_full_precision: bool = True  # the release rotates q/k in fp32 when the model computes in bf16
    max_sequence_length: int = 4096
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    include_bias: bool = False
    weight_tying: bool = False
    torch_dtype: str = "bfloat16"
    # Not in the release: toy checkpoints written by tdlm carry their own temporal defaults.
    tdlm_temporal_default: dict | None = None

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> LLaDAConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        for required in ("d_model", "n_layers", "n_heads", "vocab_size"):
            if required not in values:
                raise TDLMError(f"{source}: LLaDA config is missing field '{required}'")
        values.setdefault("n_kv_heads", values["n_heads"])
        values.setdefault("embedding_size", values["vocab_size"])
        if values.get("embedding_size") is None:
            values["embedding_size"] = values["vocab_size"]
        cfg = cls(**values)
        if cfg.include_bias or cfg.weight_tying:
            raise TDLMError(
                f"{source}: include_bias/weight_tying must be false for the LLaDA-8B architecture "
                f"(got include_bias={cfg.include_bias}, weight_tying={cfg.weight_tying})"
            )
        if cfg.d_model % cfg.n_heads:
            raise TDLMError(f"{source}: d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
        return cfg

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d.get("tdlm_temporal_default") is None:
            d.pop("tdlm_temporal_default")
        d.update(model_type="llada", architectures=["LLaDAModelLM"])
        return d


class LLaDABlock(nn.Module):
    def __init__(self, cfg: LLaDAConfig) -> None:
        super().__init__()
        d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.attn_out = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)  # gate
        self.up_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, d, bias=False)  # down

    def attend(self, x: torch.Tensor, ctx: ForwardContext, layer: int | LayerKV | None = None) -> torch.Tensor:
        """x + attention of the computed positions (all L, or a window of W with the spatial KV cache of ``layer``)."""
        B, L, _ = x.shape
        a = self.attn_norm(x)
        q = self.q_proj(a).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, hd)
        k = self.k_proj(a).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(a).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        o = spatial_attention(q, k, v, ctx, layer).transpose(1, 2).reshape(B, L, -1)
        return x + self.attn_out(o)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        f = self.ff_norm(h)
        return h + self.ff_out(F.silu(self.ff_proj(f)) * self.up_proj(f))


class _LLaDATransformer(nn.Module):
    def __init__(self, cfg: LLaDAConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.embedding_size, cfg.d_model)
        self.blocks = nn.ModuleList(LLaDABlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.ff_out = nn.Linear(cfg.d_model, cfg.embedding_size, bias=False)  # LM head (untied)


class _LLaDAModel(nn.Module):
    def __init__(self, cfg: LLaDAConfig) -> None:
        super().__init__()
        self.transformer = _LLaDATransformer(cfg)


class LLaDA(Backbone):
    """LLaDA denoiser; ``state_dict`` keys are the release's ``model.transformer.*`` keys."""

    family = "llada"
    supports_kv_cache = True

    def __init__(self, cfg: LLaDAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _LLaDAModel(cfg)
        self.mask_token_id = cfg.mask_token_id
        self.eos_token_id = cfg.eos_token_id
        self.pad_token_id = cfg.pad_token_id
        self.vocab_size = cfg.embedding_size
        self.num_layers = cfg.n_layers
        self.kv_heads = cfg.n_kv_heads
        self.hidden_size = cfg.d_model
        self.head_dim = cfg.d_model // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        self.rope_full_precision = cfg.rope_full_precision

    @property
    def blocks(self) -> nn.ModuleList:  # type: ignore[override]
        return self.model.transformer.blocks

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.wte(input_ids)

    def embedding_weight(self) -> torch.Tensor:
        return self.model.transformer.wte.weight

    def project(self, h: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        return t.ff_out(t.ln_f(h))  # (..., V)

    def default_temporal(self) -> dict:
        if self.cfg.tdlm_temporal_default:
            return dict(self.cfg.tdlm_temporal_default)
        # Paper Section 3.1: sixteen dispersed layers, four heads of width 64 (scaled for toy depths).
        n = self.num_layers
        return {"layers": f"dispersed:{max(1, n // 2)}", "heads": 4, "head_dim": 64}

    def config_dict(self) -> dict:
        return self.cfg.to_dict()
