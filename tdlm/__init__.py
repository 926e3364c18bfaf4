"""tdlm: temporal self-conditioning (TDLM) on frozen masked-diffusion language models."""

from tdlm.data import tokenizer, trajectories
from tdlm.decoding import DecodeConfig, DecodeResult, decode
from tdlm.errors import TDLMError
from tdlm.models import PRESETS, Backbone, load_backbone, save_pretrained
from tdlm.temporal.attention import TemporalAttention, resolve_layers, temporal_parameter_count
from tdlm.temporal.history import HistoryPolicy, TemporalCache
from tdlm.temporal.model import TDLM, TemporalConfig

__all__ = [
    "TDLM",
    "PRESETS",
    "Backbone",
    "DecodeConfig",
    "DecodeResult",
    "decode",
    "tokenizer",
    "trajectories",
    "HistoryPolicy",
    "TDLMError",
    "TemporalAttention",
    "TemporalCache",
    "TemporalConfig",
    "load_backbone",
    "resolve_layers",
    "save_pretrained",
    "temporal_parameter_count",
]
__version__ = "0.1.0"
