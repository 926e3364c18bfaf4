"""The GPU check's bench scripts loaded by path (bench/ on no sys.path entry) and the dry-run driver, shared by
tests/test_gpu_check.py, tests/test_gpu_check_plan.py and tests/test_gpu_check_compare.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The GPU check's files, in the order they import each other. bench/ is no package: its files are scripts (on the
# GPU machine too, where each runs with bench/ first on sys.path) and import their siblings by bare name. So, as
# tests/test_bench_results_paths.py's bench_module loads one script from its file with no sys.path entry, these are
# loaded from their files, each under the bare name its siblings import it by. Only these names: bench/ on sys.path
# would make every bench script (engine, timing, ...) importable by a bare name for every later test.
GPU_CHECK_FILES = ("benchlib", "gpu_train_probe", "gpu_check_common", "gpu_check_plan", "gpu_check_compare",
                   "gpu_check", "gpu_check_nfe", "gpu_check_stages", "gpu_check_wheels")  # fmt: skip


def gpu_check_file(name: str):
    """``bench/<name>.py`` as the module ``name`` (once per process: a reload would split the siblings' globals)."""
    path = REPO / "bench" / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        assert Path(loaded.__file__).resolve() == path, f"{name} is already {loaded.__file__}, not bench's"
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before it runs: its siblings, loaded after it, import it by this name
    spec.loader.exec_module(mod)
    return mod


(benchlib, gpu_train_probe, gpu_check_common, gpu_check_plan, gpu_check_compare, gpu_check, gpu_check_nfe,
 gpu_check_stages, gpu_check_wheels) = map(gpu_check_file, GPU_CHECK_FILES)  # fmt: skip


def run_check(tmp_path, *args: str, hooks: str = "", timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    env = os.environ | {"OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
                        gpu_check.HOOKS_ENV: hooks}  # fmt: skip
    env.pop("GPU_CHECK_T0", None)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    return proc, time.monotonic() - t0


def stage(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / f"gpu_{name}_dryrun.json").read_text())
