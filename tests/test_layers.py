"""The import graph: no cycle anywhere in the tree, and no import from a layer of the package to a layer above it.

The graph is read from the source (``ast`` over every module of ``tdlm/``, imports inside functions included, so a
lazy import cannot hide an upward dependency). The cycle check covers the whole tree (:func:`tree_graph`): the
package and the entry-point folders ``SCRIPT_DIRS``, whose files run as scripts with their own folder first on
``sys.path``, so a bare ``import gpu_check`` in ``bench/`` is an edge to ``bench/gpu_check.py``; a cycle among them
is only held together by import order (a deferred import, a ``sys.modules`` alias) and breaks when either side is
imported first. ``LAYERS`` is the architecture written down, lowest first; layers in
one tuple are siblings that must not import each other. ``tdlm/__init__.py`` (the public facade) may import any
layer and no module may import it; ``tdlm.demo`` is the top entry point.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "tdlm"
# entry points and tools outside the package: no __init__.py, each file run as a script (its folder on sys.path)
SCRIPT_DIRS = ("bench", "scripts", "launcher", "eval", "ray_jobs")

# lowest first; a module may import its own layer or any layer listed before it
LAYERS: list[tuple[str, ...]] = [
    ("tdlm.errors",),
    ("tdlm.config",),
    ("tdlm.tasks",),  # benchmark and toy task definitions: problems, golds (pure Python)
    ("tdlm.models",),  # backbones, loading, spatial KV cache, weight fingerprints
    ("tdlm.temporal",),  # the method: temporal attention, TDLM wrapper, history, Perceiver, adapter files
    ("tdlm.decoding",),  # the blockwise loop, commit rules, prediction-history diagnostic
    ("tdlm.data",),  # trajectories, store, stream, tokenizer, prompts, contamination
    ("tdlm.tracking",),  # W&B runs and the local metrics record
    ("tdlm.training", "tdlm.generation", "tdlm.evaluation"),
    ("tdlm.profiling",),  # bench's instruments: counters, tracers, the GPU cost model at true shape (uses training)
    ("tdlm.hub",),  # adapter repositories and model cards (reads evaluation results)
    ("tdlm.sweep", "tdlm.harness"),
    ("tdlm.onpolicy",),  # on-policy rounds: generation roll-outs + training launches (reuses the sweep's launcher)
    ("tdlm.demo",),
]
FACADE = "tdlm"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the tdlm modules it imports (a ``from pkg import name`` of a submodule counts as that submodule)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        pkg = mod if is_pkg else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == top)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != top:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    deps.add(sub if sub in files else target)
        graph[mod] = {d for d in deps if d != mod}
    return graph


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest prefix of a dotted import that is a known module (``tdlm.models.loading.save_backbone`` ->
    ``tdlm.models.loading``), or None for anything outside the tree (the standard library, torch)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def tree_graph(repo: Path = REPO, script_dirs: tuple[str, ...] = SCRIPT_DIRS) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports: the package (:func:`import_graph`) plus every ``*.py`` of
    ``script_dirs``, named ``<dir>.<file>``. In a script folder a bare import of a sibling file (``from gpu_check
    import x``) is an edge to ``<dir>.gpu_check``; ``tdlm...`` and ``<dir>.<file>`` imports resolve as dotted names."""
    graph = import_graph(repo / "tdlm") if (repo / "tdlm").is_dir() else {}
    folders = {d: {p.stem: p for p in sorted((repo / d).glob("*.py"))} for d in script_dirs if (repo / d).is_dir()}
    known = set(graph) | {f"{d}.{stem}" for d, files in folders.items() for stem in files}
    for d, files in folders.items():
        for stem, path in files.items():
            names: list[str] = []
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names += [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps: set[str] = set()
            for name in names:
                top = name.split(".")[0]
                target = _resolve(f"{d}.{name}", known) if top in files else _resolve(name, known)
                if target:
                    deps.add(target)
            graph[f"{d}.{stem}"] = deps - {f"{d}.{stem}"}
    return graph


def cycle_groups(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, as the strongly connected components of more than one module (Tarjan): the count the
    whole-tree check holds at zero, each component named in full, not only the first closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on.add(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            group = []
            while True:
                x = stack.pop()
                on.discard(x)
                group.append(x)
                if x == m:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return out


def layer_of(mod: str) -> int | None:
    for i, group in enumerate(LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in group):
            return i
    return None


def owner(mod: str) -> str | None:
    for group in LAYERS:
        for p in group:
            if mod == p or mod.startswith(p + "."):
                return p
    return None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among modules (as a closed path), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        if mod == FACADE:
            continue
        lm = layer_of(mod)
        if lm is None:
            out.append(f"{mod}: in no layer (add its package to LAYERS in tests/test_layers.py)")
            continue
        for d in sorted(deps):
            if d == FACADE:
                out.append(f"{mod} imports the facade {FACADE} (import the module that defines the name)")
                continue
            ld = layer_of(d)
            if ld is None:
                out.append(f"{mod} imports {d}, which is in no layer")
            elif ld > lm:
                out.append(f"{mod} (layer {owner(mod)}) imports {d} (higher layer {owner(d)})")
            elif ld == lm and owner(d) != owner(mod):
                out.append(f"{mod} imports its sibling layer {owner(d)} ({d})")
    return out


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()))}"


def test_no_import_cycles_anywhere_in_the_tree():
    graph = tree_graph()
    assert {m.split(".")[0] for m in graph} == {"tdlm", *SCRIPT_DIRS}  # every folder was read
    assert "bench.gpu_check_common" in graph["bench.gpu_check_compare"]  # bare sibling imports are edges
    assert "tdlm.models.loading" in graph["scripts.train_tiny_backbone"]  # and imports of the package
    assert cycle_groups(graph) == [], f"import cycles: {cycle_groups(graph)}"


def test_imports_only_go_down_the_layers():
    assert violations(import_graph()) == []


def test_top_level_holds_folders_and_at_most_three_modules():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert modules == ["__init__.py", "config.py", "errors.py"]
    for d in ROOT.iterdir():
        if d.is_dir() and d.name != "__pycache__" and any(d.rglob("*.py")):
            assert layer_of(f"tdlm.{d.name}") is not None, f"tdlm/{d.name}/ is in no layer"


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "tdlm"
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_planted_cycle_is_found(tmp_path):
    root = _plant(tmp_path, {
        "__init__.py": "",
        "models/__init__.py": "",
        "models/a.py": "from tdlm.temporal.b import x\n",
        "temporal/__init__.py": "",
        "temporal/b.py": "def f():\n    from tdlm.models import a  # lazy import: still an edge\n",
    })
    graph = import_graph(root)
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"tdlm.models.a", "tdlm.temporal.b"}
    assert any("tdlm.models.a (layer tdlm.models) imports tdlm.temporal.b" in v for v in violations(graph))


def _plant_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_planted_circle_between_scripts_is_found(tmp_path):
    repo = _plant_tree(tmp_path, {
        "tdlm/__init__.py": "",
        "tdlm/models/__init__.py": "",
        "tdlm/models/loading.py": "",
        "bench/a.py": "import sys\nfrom b import shared\nfrom tdlm.models.loading import save_backbone\n",
        "bench/b.py": "def f():\n    from a import g  # deferred: still an edge\n",
        "bench/leaf.py": "import json\n",
        "scripts/c.py": "import leaf  # no sibling of that name in scripts/: not an edge to bench.leaf\n",
        "eval/d.py": "from bench.leaf import x\nimport e\n",
        "eval/e.py": "import d\n",
    })
    graph = tree_graph(repo)
    assert graph["bench.a"] == {"bench.b", "tdlm.models.loading"}
    assert graph["scripts.c"] == set() and graph["eval.d"] == {"bench.leaf", "eval.e"}
    assert cycle_groups(graph) == [["bench.a", "bench.b"], ["eval.d", "eval.e"]]
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) in ({"bench.a", "bench.b"}, {"eval.d", "eval.e"})
    (repo / "bench" / "b.py").write_text("from leaf import x\n")  # the shared names moved to a leaf: no circle
    (repo / "eval" / "e.py").write_text("")
    assert cycle_groups(tree_graph(repo)) == [] and find_cycle(tree_graph(repo)) is None


def test_the_gpu_check_circle_planted_back_is_found(tmp_path):
    """The circle this check was extended for: bench/gpu_check.py and gpu_check_compare.py importing each other."""
    bench = tmp_path / "bench"
    shutil.copytree(REPO / "bench", bench, ignore=shutil.ignore_patterns("results", "__pycache__", "*.json"))
    assert cycle_groups(tree_graph(tmp_path, ("bench",))) == []
    compare = bench / "gpu_check_compare.py"
    compare.write_text(compare.read_text().replace("from gpu_check_common import (", "from gpu_check import ("))
    assert cycle_groups(tree_graph(tmp_path, ("bench",))) == [["bench.gpu_check", "bench.gpu_check_compare"]]


@pytest.mark.parametrize("importer, imported, words", [
    ("temporal/model.py", "from tdlm.hub import save_pretrained\n", "higher layer tdlm.hub"),
    ("training/loop.py", "import tdlm.evaluation.report\n", "sibling layer tdlm.evaluation"),
    ("generation/driver.py", "import tdlm\n", "imports the facade"),
    ("models/common.py", "from ..temporal import attention\n", "higher layer tdlm.temporal"),
])
def test_planted_upward_import_is_named(tmp_path, importer, imported, words):
    root = _plant(tmp_path, {"__init__.py": "", importer: imported, "temporal/attention.py": "",
                             "hub/__init__.py": "", "evaluation/report.py": ""})
    assert any(words in v for v in violations(import_graph(root))), violations(import_graph(root))


def private_library_names(folders: tuple[str, ...] = SCRIPT_DIRS, repo: Path = REPO) -> list[str]:
    """``file:line name`` for each private name of the library (a ``_x`` in ``tdlm...``) that a file outside it imports
    or reads as an attribute: a script leaning on one breaks silently when the library renames what it never
    promised to keep."""
    found = []
    for folder in folders:
        for path in sorted((repo / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            aliases = {}  # local name -> the tdlm module it names (import tdlm.x as y)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    aliases.update({(a.asname or a.name): a.name for a in node.names if a.name.split(".")[0] == "tdlm"})
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tdlm" and not node.level:
                    names = [a.name for a in node.names]
                    names += [p for p in node.module.split(".") if p.startswith("_") and not p.startswith("__")]
                elif isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
                    base = ast.unparse(node.value)
                    if base.split(".")[0] in aliases or base.split(".")[0] == "tdlm":
                        names = [node.attr]
                found += [f"{path.relative_to(repo)}:{node.lineno} {n}" for n in names
                          if n.startswith("_") and not n.startswith("__")]  # fmt: skip
    return found


def test_no_file_outside_the_library_uses_a_private_library_name():
    assert private_library_names() == []


def test_a_planted_private_import_is_named(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text("import tdlm.demo as d\nfrom tdlm.models.loading import _seed, ok\n"
                                             "d._run()\nprint(d.run_stage)\n")  # fmt: skip
    assert private_library_names(("bench",), tmp_path) == ["bench/x.py:2 _seed", "bench/x.py:3 _run"]
