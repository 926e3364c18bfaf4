"""What every bench result records about the machine, and how it is written (``bench/results/*.json``)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path


def machine() -> dict:
    """Date (UTC), versions, platform, CPU count and current 1-minute load: enough to tell runs apart."""
    import torch  # here, not at the top: benches that never load torch (sandbox_throughput) use this module too

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def build_tdlm(size: str, medium: dict, medium_seed: int):
    """TDLM with the default temporal config (zero W_O) on a frozen LLaDA: the ``tiny-llada`` preset, or
    the real class at the bench's ``medium`` config with seeded random weights; ``.backbone`` is the plain one."""
    import tdlm
    from tdlm.models.loading import random_backbone

    if size == "tiny":
        backbone = tdlm.load_backbone("tiny-llada")
    elif size == "medium":
        backbone = random_backbone("llada", medium, medium_seed, "medium-llada")
    else:
        raise ValueError(f"unknown size {size!r}; expected 'tiny' or 'medium'")
    return tdlm.TDLM(backbone, tdlm.TemporalConfig()).eval()


REPO = Path(__file__).resolve().parents[1]


def repo_relative(value, outside: Callable[[str], str] = str):
    """``value`` with every string that names a path inside the repository written relative to its root (results
    JSON is committed: no machine's absolute paths in it), and ``outside(path)`` for other absolute paths; other
    values as they are, containers walked."""
    if isinstance(value, dict):
        return {k: repo_relative(v, outside) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [repo_relative(v, outside) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        try:
            return Path(value).resolve().relative_to(REPO).as_posix() or "."
        except ValueError:
            return outside(value)
    return value


def write_result(path: str | os.PathLike, result: dict) -> Path:
    """Write ``result`` as indented JSON (parents created; paths inside the repository relative to its root) and say
    where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(repo_relative(result), indent=2) + "\n")
    print(f"\nwrote {out}")
    return out


def run_logged(cmd: list, log: Path, env: dict, cwd: Path, mode: str = "w") -> float:
    """Run a stage's command with its output in ``log`` (``mode`` "a" keeps earlier attempts); its seconds, or a
    one-line TDLMError naming the log."""
    import subprocess
    import time

    from tdlm.errors import TDLMError

    cmd = [str(c) for c in cmd]
    print(f"$ {' '.join(cmd)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.time()
    with log.open(mode) as fh:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise TDLMError(f"exit {rc}: {' '.join(cmd[:3])} ...; see {log}")
    return time.time() - t


def exit_with(main: Callable[[], int]) -> None:
    """``sys.exit(main())``, with a TDLMError as one line on stderr and exit status 2."""
    import sys

    from tdlm.errors import TDLMError

    try:
        sys.exit(main())
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
