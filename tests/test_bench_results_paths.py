"""Committed benchmark results name files relative to the repository root: no machine's absolute paths."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench_module(name: str):
    """``bench/<name>.py`` loaded from its file as a module of its own: no ``sys.path`` entry for bench/ (its
    scripts' sibling imports would shadow library names for every later test)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _absolute(value, where: str):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _absolute(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _absolute(v, f"{where}[{i}]")
    elif isinstance(value, str) and value.startswith("/"):
        yield f"{where}: {value}"


def test_committed_results_hold_no_absolute_paths():
    found = [hit for p in sorted((REPO / "bench" / "results").glob("*.json"))
             for hit in _absolute(json.loads(p.read_text()), p.name)]  # fmt: skip
    assert not found, found


def test_write_result_names_repository_paths_relative_to_the_root(tmp_path):
    benchlib = bench_module("benchlib")
    out = benchlib.write_result(tmp_path / "r.json", {"adapter": str(REPO / "runs" / "demo" / "train" / "adapter"),
                                                      "root": [str(REPO)], "n": 3, "elsewhere": "/opt/x"})
    assert json.loads(out.read_text()) == {"adapter": "runs/demo/train/adapter", "root": ["."], "n": 3,
                                           "elsewhere": "/opt/x"}
