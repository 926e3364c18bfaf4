"""tdlm: temporal self-conditioning (TDLM) on frozen masked-diffusion language models."""

from __future__ import annotations

import importlib
from typing import Any

# Names resolve on first use (PEP 562): `import tdlm...` and the CLIs' argument parsing then cost no torch /
# DeepSpeed import, so a bad flag is reported in a second rather than after ~10-40 s of imports.
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
    "save_pretrained": "tdlm.models",
    "temporal_parameter_count": "tdlm.temporal.attention",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(target)
    value = module if target.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
