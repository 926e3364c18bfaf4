"""Training the temporal modules on a frozen backbone with DeepSpeed (paper Section 2.3, Eq. 5).

* :mod:`.config` - the run config (typed dataclasses; ``configs/*.yaml`` only set values)
* :mod:`.ds_config` - DeepSpeed JSON resolution against the run config
* :mod:`.loop` - set-up, the Eq. 5 step, adapter export (:mod:`.entry` drives it)
* :mod:`.entry` - ``launcher/train.py``'s body: command line, checks, training, exit status and its one line
* :mod:`.distributed` - the process group under NCCL's rules: device binding, stop agreement, a lost peer
* :mod:`.checkpoint` - checkpoints every rank writes together, verified, rotated
* :mod:`.session` - what one rank holds while it runs
* :mod:`.planner` - peak-memory model, its CPU measurement and ``python -m tdlm.training.planner``
"""

from __future__ import annotations

from tdlm.errors import lazy_exports

# Names resolve on first use (PEP 562, tdlm.errors.lazy_exports): no torch / DeepSpeed import until one is used.
_EXPORTS: dict[str, str] = {
    "RunConfig": "tdlm.training.config",
    "export_adapter": "tdlm.training.loop",
    "load_checkpoint": "tdlm.training.checkpoint",
    "lr_lambda": "tdlm.training.loop",
    "preflight": "tdlm.training.loop",
    "save_checkpoint": "tdlm.training.checkpoint",
    "setup": "tdlm.training.loop",
    "temporal_config": "tdlm.training.loop",
    "train": "tdlm.training.loop",
    "train_step": "tdlm.training.loop",
    "validate_run": "tdlm.training.loop",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
