"""Training the temporal modules on a frozen backbone with DeepSpeed (paper Section 2.3, Eq. 5).

* :mod:`.config` - the run config (typed dataclasses; ``configs/*.yaml`` only set values)
* :mod:`.ds_config` - DeepSpeed JSON resolution against the run config
* :mod:`.loop` - set-up, the Eq. 5 step, checkpoints, adapter export (``launcher/train.py`` drives it)
* :mod:`.planner` - peak-memory model, its CPU measurement and ``python -m tdlm.training.planner``
"""

from tdlm.training.config import RunConfig
from tdlm.training.loop import (
    export_adapter,
    load_checkpoint,
    lr_lambda,
    preflight,
    save_checkpoint,
    setup,
    temporal_config,
    train,
    train_step,
    validate_run,
)

__all__ = [
    "RunConfig",
    "export_adapter",
    "load_checkpoint",
    "lr_lambda",
    "preflight",
    "save_checkpoint",
    "setup",
    "temporal_config",
    "train",
    "train_step",
    "validate_run",
]
