"""The sample's interpreter: :func:`default_python`, the one that can run as ``nobody`` (uid :data:`NOBODY`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

NOBODY = 65534

_probe_lock = threading.Lock()
_nobody_ok: dict[str, bool] = {}


def _interpreter_fingerprint(argv: list[str], **kw: object) -> str | None:
    code = "import sys; print(sys.version, sys.prefix, sys.base_prefix, sys.executable)"
    try:
        out = subprocess.run(argv + ["-I", "-c", code], capture_output=True, text=True, timeout=30, check=False, **kw)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def can_drop_to_nobody(python: str) -> bool:
    """Does ``python`` start as nobody *and* resolve to the same installation? Probed once per interpreter."""
    if os.geteuid() != 0:
        return False
    with _probe_lock:
        if python not in _nobody_ok:
            mine = _interpreter_fingerprint([python])
            try:
                theirs = _interpreter_fingerprint([python], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/")
            except (OSError, ValueError):
                theirs = None
            _nobody_ok[python] = mine is not None and mine == theirs
        return _nobody_ok[python]


def default_python() -> str:
    """The interpreter for samples: ``sys.executable`` unless only a system ``python3`` can drop to nobody."""
    if os.geteuid() != 0 or can_drop_to_nobody(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and can_drop_to_nobody(candidate):
            return candidate
    return sys.executable
