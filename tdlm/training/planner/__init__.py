"""Memory planner for TDLM training: the model of peak memory per GPU (:mod:`.model`), its check against
real training steps (:mod:`.measure`) and the command line (:mod:`.cli`, ``python -m tdlm.training.planner``)."""

from __future__ import annotations

import importlib
from typing import Any

# Names resolve on first use (PEP 562): `import tdlm...` and the CLIs' argument parsing then cost no torch /
# DeepSpeed import, so a bad flag is reported in a second rather than after ~10-40 s of imports.
_EXPORTS: dict[str, str] = {
    "Measurement": "tdlm.training.planner.measure",
    "PeakMeter": "tdlm.training.planner.measure",
    "init_random_": "tdlm.training.planner.measure",
    "measure_peak": "tdlm.training.planner.measure",
    "random_batch": "tdlm.training.planner.measure",
    "tensor_bytes": "tdlm.training.planner.measure",
    "train_step": "tdlm.training.planner.measure",
    "COMPONENTS": "tdlm.training.planner.model",
    "DSKnobs": "tdlm.training.planner.model",
    "GiB": "tdlm.training.planner.model",
    "Inventory": "tdlm.training.planner.model",
    "MemoryPlan": "tdlm.training.planner.model",
    "inventory": "tdlm.training.planner.model",
    "max_micro_batch": "tdlm.training.planner.model",
    "plan": "tdlm.training.planner.model",
    "readme_table": "tdlm.training.planner.model",
    "resolve_backbone": "tdlm.training.planner.model",
}
__all__ = sorted(_EXPORTS)


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
