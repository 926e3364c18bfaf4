"""Training the temporal modules on a frozen backbone with DeepSpeed (paper Section 2.3, Eq. 5).

* :mod:`.config` - the run config (typed dataclasses; ``configs/*.yaml`` only set values)
* :mod:`.ds_config` - DeepSpeed JSON resolution against the run config
* :mod:`.loop` - set-up, the Eq. 5 step, checkpoints, adapter export (``launcher/train.py`` drives it)
* :mod:`.planner` - peak-memory model, its CPU measurement and ``python -m tdlm.training.planner``
"""

from __future__ import annotations

import importlib
from typing import Any

# Names resolve on first use (PEP 562): `import tdlm...` and the CLIs' argument parsing then cost no torch /
# DeepSpeed import, so a bad flag is reported in a second rather than after ~10-40 s of imports.
_EXPORTS: dict[str, str] = {
    "RunConfig": "tdlm.training.config",
    "export_adapter": "tdlm.training.loop",
    "load_checkpoint": "tdlm.training.loop",
    "lr_lambda": "tdlm.training.loop",
    "preflight": "tdlm.training.loop",
    "save_checkpoint": "tdlm.training.loop",
    "setup": "tdlm.training.loop",
    "temporal_config": "tdlm.training.loop",
    "train": "tdlm.training.loop",
    "train_step": "tdlm.training.loop",
    "validate_run": "tdlm.training.loop",
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
