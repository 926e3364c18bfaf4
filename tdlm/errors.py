"""User-facing errors.

Every error a user can cause by bad input (a wrong path, an unknown name, a mismatched adapter, a
tensor of the wrong rank) is raised as :class:`TDLMError` with one line that says what was expected.
Entry points print the message without a traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


class TDLMError(ValueError):
    """Bad input: the message names the file / field / argument and the expected value."""


def lazy_exports(module_name: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` / ``__dir__`` (PEP 562) for a package facade whose names resolve on first use: ``exports`` maps
    each name to the module holding it (a submodule named like the name is returned itself). Importing the facade
    then costs no torch / DeepSpeed import, so a CLI's bad flag is one line in a second. Lives here, the lowest
    layer, because every facade (``tdlm``, ``tdlm.training``, ``tdlm.training.planner``) needs it."""

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        module = importlib.import_module(target)
        value = module if target.rsplit(".", 1)[-1] == name else getattr(module, name)
        setattr(sys.modules[module_name], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(exports))

    return __getattr__, __dir__
