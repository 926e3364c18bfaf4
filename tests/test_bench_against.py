"""Every bench that compares with older code takes the same ``--against REF`` (bench/benchlib.py ``add_against``):
a git revision of this repository or a folder holding an older checkout, made a folder by ``older_tree``."""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

import pytest
from test_bench_results_paths import bench_module

from tdlm.errors import TDLMError

REPO = Path(__file__).resolve().parents[1]
COMPARING = ("decode_speed", "sandbox_throughput", "dispatch_count")  # the benches that measure older code


def test_a_revision_is_exported_as_it_was_committed():
    benchlib = bench_module("benchlib")
    tree = benchlib.older_tree("HEAD", ("tdlm/decoding/loop.py",))
    committed = subprocess.run(["git", "show", "HEAD:tdlm/decoding/loop.py"], cwd=REPO, check=True,
                               capture_output=True, text=True).stdout  # fmt: skip
    assert (tree / "tdlm" / "decoding" / "loop.py").read_text() == committed
    assert not (tree / "tdlm" / "temporal").exists()  # only the paths asked for


def test_a_folder_is_used_as_it_is_and_an_unknown_name_refuses_in_one_line(tmp_path):
    benchlib = bench_module("benchlib")
    assert benchlib.older_tree(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(TDLMError) as e:
        benchlib.older_tree("no-such-revision-anywhere")
    assert "--against no-such-revision-anywhere" in str(e.value) and "\n" not in str(e.value)


def test_the_flag_means_the_same_in_every_bench_that_compares():
    """Each comparing bench declares its older code through ``add_against`` (one meaning of --against), and none
    keeps a flag of its own for it (the old ``--before DIR`` / ``--before OLD.json``)."""
    benchlib = bench_module("benchlib")
    ap = argparse.ArgumentParser()
    benchlib.add_against(ap, "x")
    assert ap.parse_args(["--against", "abc123"]).against == "abc123"
    for name in COMPARING:
        tree = ast.parse((REPO / "bench" / f"{name}.py").read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        uses = [c for c in calls if getattr(c.func, "id", None) == "add_against"]
        own = [c.args[0].value for c in calls if getattr(c.func, "attr", None) == "add_argument" and c.args
               and isinstance(c.args[0], ast.Constant) and c.args[0].value in ("--against", "--before")]  # fmt: skip
        assert len(uses) == 1 and not own, (name, len(uses), own)
        assert "older_tree" in {getattr(c.func, "id", None) for c in calls} | {
            n.name for n in ast.walk(tree) if isinstance(n, ast.alias)}, name
