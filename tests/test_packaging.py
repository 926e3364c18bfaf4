"""pyproject.toml says what the code needs and installs the entry points as commands (issue 30: ``accelerate`` and
``numpy`` were declared but never imported, and there were no ``[project.scripts]``).

* every declared dependency is imported somewhere in the repository (tdlm, tests, bench, scripts and the entry
  scripts), or is one of :data:`USED_WITHOUT_IMPORT`, whose use is checked instead;
* every third-party module the repository imports comes from a declared dependency or from one of theirs;
* every console script points at a function that exists, and the installed metadata (the editable install) lists
  the same scripts: reinstall with ``pip install -e . --no-deps`` after editing them.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("tdlm", "tests", "bench", "scripts", "eval", "launcher", "ray_jobs")
# Declared, not imported, and why: each entry is (a regex that must match the sources, the reason).
USED_WITHOUT_IMPORT = {
    "numpy": (r"\.numpy\(\)", "Tensor.numpy() needs numpy and torch does not depend on it"),
}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _sources() -> list[Path]:
    return [p for d in SOURCES for p in sorted((REPO / d).rglob("*.py")) if "assets" not in p.parts]


@functools.cache
def imported_modules() -> frozenset[str]:
    """Top-level names of every absolute import in the repository's Python files (module level or not)."""
    names: set[str] = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return frozenset(names)


def _local_names() -> set[str]:
    """Modules that are files of this repository (tdlm, tests' helpers, bench's benchlib, scripts ...)."""
    return {p.stem for p in _sources()} | {"tdlm", "tests"}


@functools.cache
def _packages() -> dict[str, list[str]]:
    return md.packages_distributions()  # reads every installed distribution's file list: once


def _dists_of(module: str) -> set[str]:
    return {d.lower().replace("_", "-") for d in _packages().get(module, [])}


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install: theirs, and what those require (extras only where asked for)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = _name(req.name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in reqs:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (*req.extras, "")):
                todo.append(sub)
    return {k.split("[", 1)[0] for k in seen}


def test_every_declared_dependency_is_used():
    declared = {_name(r) for r in pyproject()["project"]["dependencies"]}
    imported = imported_modules()
    used = {d for m in imported for d in _dists_of(m)}
    text = "\n".join(p.read_text() for p in _sources())
    unused = []
    for dist in sorted(declared - used):
        why = USED_WITHOUT_IMPORT.get(dist)
        if why is None or not re.search(why[0], text):
            unused.append(dist)
    assert not unused, f"declared in pyproject.toml but never imported: {unused}"


def test_every_imported_third_party_module_is_declared_or_comes_with_a_declared_one():
    project = pyproject()["project"]
    allowed = _closure([*project["dependencies"], *project["optional-dependencies"]["dev"]])
    local = _local_names()
    missing = []
    for module in sorted(imported_modules() - set(sys.stdlib_module_names) - local):
        dists = _dists_of(module)
        if not dists & allowed:
            missing.append(f"{module} ({', '.join(sorted(dists)) or 'not installed'})")
    assert not missing, f"imported but neither declared nor required by a declared package: {missing}"


def test_console_scripts_resolve_and_are_installed():
    scripts = pyproject()["project"]["scripts"]
    assert {"tdlm-eval", "tdlm-compare", "tdlm-sweep", "tdlm-plan", "tdlm-harness", "tdlm-hub",
            "tdlm-generate"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        fn = getattr(importlib.import_module(module), func, None)
        assert callable(fn), f"[project.scripts] {name} = {target!r}: no such function"
    installed = {e.name: e.value for e in md.entry_points(group="console_scripts") if e.dist.name == "tdlm"}
    assert installed == scripts, ("the installed tdlm's console scripts differ from pyproject.toml: reinstall "
                                  "(pip install -e . --no-deps)")


@pytest.mark.parametrize("script", ["eval/run.py", "eval/compare.py", "launcher/sweep.py",
                                    "ray_jobs/generate_trajectories.py"])
def test_entry_scripts_are_the_console_scripts(script):
    """The scripts in eval/ and launcher/ call the same functions as the console scripts (thin wrappers)."""
    scripts = pyproject()["project"]["scripts"]
    text = (REPO / script).read_text()
    targets = {"eval/run.py": "tdlm-eval", "eval/compare.py": "tdlm-compare", "launcher/sweep.py": "tdlm-sweep",
               "ray_jobs/generate_trajectories.py": "tdlm-generate"}
    module, func = scripts[targets[script]].split(":")
    assert re.search(rf"^from {re.escape(module)} import {func}\b", text, re.M), f"{script} does not call {module}"
    assert len([ln for ln in text.splitlines() if ln.strip().startswith("def ")]) == 0, f"{script} defines functions"
