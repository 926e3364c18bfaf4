"""tdlm: temporal self-conditioning (TDLM) on frozen masked-diffusion language models."""

from __future__ import annotations

from tdlm.errors import lazy_exports

# Names resolve on first use (PEP 562, tdlm.errors.lazy_exports): no torch / DeepSpeed import until one is used.
_EXPORTS: dict[str, str] = {
    "TDLM": "tdlm.temporal.model",
    "PRESETS": "tdlm.models",
    "Backbone": "tdlm.models",
    "DecodeConfig": "tdlm.decoding",
    "DecodeResult": "tdlm.decoding",
    "decode": "tdlm.decoding",
    "tokenizer": "tdlm.data.tokenizer",
    "trajectories": "tdlm.data.trajectories",
    "HistoryPolicy": "tdlm.temporal.history",
    "TDLMError": "tdlm.errors",
    "TemporalAttention": "tdlm.temporal.attention",
    "TemporalCache": "tdlm.temporal.history",
    "TemporalConfig": "tdlm.temporal.model",
    "load_backbone": "tdlm.models",
    "resolve_layers": "tdlm.temporal.attention",
    "save_backbone": "tdlm.models",
    "save_pretrained": "tdlm.models",  # deprecated name of save_backbone (a TDLM's adapter: TDLM.save_pretrained)
    "temporal_parameter_count": "tdlm.temporal.attention",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
