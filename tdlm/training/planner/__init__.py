"""Memory planner for TDLM training: the model of peak memory per GPU (:mod:`.model`), its check against
real training steps (:mod:`.measure`) and the command line (:mod:`.cli`, ``python -m tdlm.training.planner``)."""

from tdlm.training.planner.measure import (
    Measurement,
    PeakMeter,
    init_random_,
    measure_peak,
    random_batch,
    tensor_bytes,
    train_step,
)
from tdlm.training.planner.model import (
    COMPONENTS,
    DSKnobs,
    GiB,
    Inventory,
    MemoryPlan,
    inventory,
    max_micro_batch,
    plan,
    readme_table,
    resolve_backbone,
)

__all__ = [
    "COMPONENTS",
    "DSKnobs",
    "GiB",
    "Inventory",
    "Measurement",
    "MemoryPlan",
    "PeakMeter",
    "init_random_",
    "inventory",
    "max_micro_batch",
    "measure_peak",
    "plan",
    "random_batch",
    "readme_table",
    "resolve_backbone",
    "tensor_bytes",
    "train_step",
]
