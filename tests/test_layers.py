"""The package's import graph: no cycles between modules, and no import from a layer to a layer above it.

The graph is read from the source (``ast`` over every module of ``tdlm/``, imports inside functions included, so a
lazy import cannot hide an upward dependency). ``LAYERS`` is the architecture written down, lowest first; layers in
one tuple are siblings that must not import each other. ``tdlm/__init__.py`` (the public facade) may import any
layer and no module may import it; ``tdlm.demo`` is the top entry point.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tdlm"

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
