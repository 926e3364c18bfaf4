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


# -- comparing against older code (decode_speed, sandbox_throughput, dispatch_count) -------------------------------
AGAINST_HELP = ("older code to measure beside today's: a git revision of this repository, or a folder holding an "
                "older checkout (its tdlm/)")


def add_against(ap, what: str) -> None:
    """The one ``--against REF`` flag of every bench that compares with older code; ``what`` says what the bench
    measures of it. :func:`older_tree` turns REF into a folder."""
    ap.add_argument("--against", default=None, metavar="REF", help=f"{AGAINST_HELP}: {what}")


def older_tree(ref: str, paths: tuple[str, ...] = ("tdlm",)) -> Path:
    """The folder of the older code ``--against REF`` names. A folder is an older checkout (or a copy holding its
    ``tdlm/``) and is used as it is; anything else is a git revision of this repository, whose ``paths`` are
    exported (``git archive``, so no worktree or stash touches this checkout) into a fresh temporary folder, removed
    when the process exits. A revision git cannot show is a one-line TDLMError."""
    import atexit
    import io
    import shutil
    import subprocess
    import tarfile
    import tempfile

    from tdlm.errors import TDLMError

    if Path(ref).is_dir():
        return Path(ref).resolve()
    try:
        tar = subprocess.run(["git", "archive", "--format=tar", ref, "--", *paths], cwd=REPO, check=True,
                             capture_output=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        said = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip().splitlines()
        raise TDLMError(f"--against {ref}: neither a folder nor a git revision holding {', '.join(paths)} "
                        f"({said[-1] if said else e})") from None  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix=f"tdlm_at_{ref.replace('/', '_')}_"))
    atexit.register(shutil.rmtree, out, True)  # the bench's children ran from it; nothing reads it afterwards
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(out, filter="data")
    return out
