"""Memory planner for TDLM training: the model of peak memory per GPU (:mod:`.model`), its check against
real training steps (:mod:`.measure`) and the command line (:mod:`.cli`, ``python -m tdlm.training.planner``)."""

from __future__ import annotations

from tdlm.errors import lazy_exports

# Names resolve on first use (PEP 562, tdlm.errors.lazy_exports): no torch / DeepSpeed import until one is used.
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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
