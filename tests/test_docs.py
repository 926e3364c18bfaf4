"""README.md, docs/*.md, docs/reports/*.md and bench/README.md stay true: their Python blocks run, the paths and names
they cite exist, the quickstart commands parse, README stays a front door, and the shipped benchmark copies are the
pinned files, found in the documented order (docs/benchmarks.md).

A Python block that cannot run on this CPU says so on its first line (``# not run: needs LLaDA-8B weights ...``);
the test then checks that the marker names such a need and that the block really has one (an 8B / 7B checkpoint id,
CUDA or a Hub upload), so a marker cannot hide a runnable block that broke.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tdlm.tasks import base

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md"))  # the documentation proper: each is linked from README.md
REPORTS = sorted((REPO / "docs" / "reports").glob("*.md"))  # dated measurements, each linked from a page
# bench/README.md states the benches' commands and result files, so it is held to the same checks
DOCS = [REPO / "README.md", *PAGES, REPO / "bench" / "README.md", *REPORTS]
README_MAX_LINES = 250

NOT_RUN = re.compile(r"#\s*not run:\s*(?P<why>\S.*)")
NEEDS = re.compile(r"LLaDA-8B|Dream-7B|Dream-v0|8B|7B|GPU|CUDA|network|Hub", re.I)
# what makes a block unrunnable here: a release checkpoint, a GPU, or a write to the Hub
HAS_NEED = re.compile(r"GSAI-ML/|Dream-org/|\bcuda\b|push_to_hub|upload_folder")
# repository paths as the pages write them; brace lists and globs are expanded / matched
PATH = re.compile(r"(?<![\w/.<>-])((?:tdlm|configs|ds_configs|launcher|eval|ray_jobs|scripts|bench|tests|data)"
                  r"/[\w./{},*-]*[\w*}])")
NAME = re.compile(r"`(tdlm(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\]\((?!https?:)([^)#\s]*)(?:#([\w-]+))?\)")


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def python_blocks() -> list[tuple[str, str]]:
    """(``file:line``, code) of every ```python block of the pages in DOCS."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
            out.append((f"{rel(doc)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return out


BLOCKS = python_blocks()


def test_the_pages_have_python_blocks():
    # the README's own snippet, the model page's two modes, the Hub page's CPU and 8B snippets at least
    assert len(BLOCKS) >= 4 and any(w.startswith("README.md") for w, _ in BLOCKS), [w for w, _ in BLOCKS]


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_python_block_runs_as_written(where, code, tmp_path):
    first = code.splitlines()[0] if code.strip() else ""
    marker = NOT_RUN.match(first)
    if marker:
        assert NEEDS.search(marker["why"]), f"{where}: '# not run:' must name what it needs (8B weights, GPU, network)"
        assert HAS_NEED.search(code), f"{where}: marked '# not run' but uses no checkpoint, GPU or Hub write: run it"
        return
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{where} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[: m.start()] + alt + path[m.end():])]


def cited_paths(text: str) -> set[str]:
    return {q.rstrip(".") for p in PATH.findall(text) for q in _expand(p)}


def test_every_repository_path_in_readme_and_docs_exists():
    missing = []
    for doc in DOCS:
        for p in sorted(cited_paths(doc.read_text())):
            found = list(REPO.glob(p)) if "*" in p else [REPO / p] if (REPO / p).exists() else []
            if not found:
                missing.append(f"{rel(doc)}: {p}")
    assert not missing, missing


def test_path_check_sees_old_and_brace_paths():
    # the check itself: the module paths of the flat layout and a brace list are read as paths
    assert {"tdlm/adapter.py", "configs/gen_llada_8b.yaml", "configs/gen_dream_7b.yaml"} <= cited_paths(
        "`tdlm/adapter.py` and `configs/gen_{llada_8b,dream_7b}.yaml`, not runs/eval/x or /data/traj/x")
    assert not (REPO / "tdlm/adapter.py").exists()


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(mod) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj = importlib.import_module(mod)
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_tdlm_name_in_readme_and_docs_resolves():
    names = {n for doc in DOCS for n in NAME.findall(doc.read_text())}
    assert {"tdlm.decode", "tdlm.hub.save_pretrained", "tdlm.TDLM.from_pretrained"} <= names
    bad = sorted(n for n in names if not _resolves(n))
    assert not bad, bad
    assert not _resolves("tdlm.TDLM.push_to_hub") and not _resolves("tdlm.contamination")  # moved in the regroup


def _slug(heading: str) -> str:
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_links_between_pages_resolve():
    bad = []
    for doc in DOCS:
        for target, anchor in LINK.findall(doc.read_text()):
            page = (doc.parent / target).resolve() if target else doc
            if not page.exists():
                bad.append(f"{rel(doc)}: {target}")
            elif anchor and page.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}
                if anchor not in slugs:
                    bad.append(f"{rel(doc)}: {target}#{anchor}")
    assert not bad, bad
    linked = {(REPO / t).resolve() for t, _ in LINK.findall((REPO / "README.md").read_text())}
    assert {p.resolve() for p in PAGES} <= linked, "every docs/ page is linked from README.md"
    from_pages = {(doc.parent / t).resolve() for doc in PAGES for t, _ in LINK.findall(doc.read_text()) if t}
    unlinked = [rel(r) for r in REPORTS if r.resolve() not in from_pages]
    assert not unlinked, f"a report nobody links to: {unlinked}"


# -- README: a front door -------------------------------------------------------------------------
def readme() -> str:
    return (REPO / "README.md").read_text()


def quickstart_commands() -> list[list[str]]:
    section = readme().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S):
        lines += [ln.split(" #")[0].strip() for ln in re.sub(r"\\\n\s*", " ", block).splitlines()]
    return [shlex.split(ln) for ln in lines if ln and not ln.startswith("#")]


def test_readme_is_a_front_door():
    text = readme()
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, at most {README_MAX_LINES}: move details to docs/"
    for heading in ("## Quickstart", "## Entry points", "## Measured headline", "## Documentation", "## Citation"):
        assert heading in text, heading
    assert "TDLM: Temporal Self-Conditioning Diffusion Language Model" in text  # the paper, by its title


def _script(path: str):
    spec = importlib.util.spec_from_file_location(f"_doc_{Path(path).stem}", REPO / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quickstart_commands_parse(monkeypatch):
    """Each quickstart command (tiny preset and LLaDA-8B) names real files and parses with its entry point's own
    argument parser; tests/test_quickstart.py runs the set-up and the tiny ones from a fresh clone."""
    from tdlm.training.launch import parse_launch

    monkeypatch.chdir(REPO)
    cmds = quickstart_commands()
    assert [c[0] for c in cmds] == ["make", "source", "python", "deepspeed", "python", "python", "deepspeed", "python"]
    assert any("tiny" in " ".join(c) for c in cmds) and any("llada_8b" in " ".join(c) for c in cmds)
    for c in cmds:
        if c[0] == "make":
            assert re.search(rf"^{c[1]}:", (REPO / "Makefile").read_text(), re.M), c
            continue
        if c[0] == "source":
            assert c[1:] == [".venv/bin/activate"], c  # the Makefile's VENV default
            assert re.search(r"^VENV \?= \.venv$", (REPO / "Makefile").read_text(), re.M)
            continue
        script = next(a for a in c if a.endswith(".py"))
        args = c[c.index(script) + 1:]
        assert (REPO / script).is_file(), script
        if script == "launcher/train.py":
            launch = parse_launch(args)
            assert launch.run.train.max_steps > 0
        else:
            # a script that is only a wrapper of a console script: its parser lives in the library
            lib = {"ray_jobs/generate_trajectories.py": "tdlm.generation.cli"}.get(script)
            cfg = (importlib.import_module(lib) if lib else _script(script)).parse_args(args)
            assert cfg is not None, c


def test_flagless_training_is_documented_as_it_runs():
    """The issue's false statement: a launch without --config does not use configs/tiny.yaml."""
    from tdlm.training.config import RunConfig

    run = RunConfig()
    text = (REPO / "docs/training.md").read_text()
    assert (run.model.backbone, run.train.max_steps, run.optim.lr, run.output_dir) == ("tiny-arith", 750, 1e-3,
                                                                                      "runs/train")
    assert "**750\nupdates**" in text or "**750 updates**" in text
    assert f"**`{run.output_dir}`**" in text and f"`{run.data.trajectories}`" in text
    assert "uses `configs/tiny.yaml`" not in readme() + text


# -- the shipped benchmark copies (docs/benchmarks.md) ---------------------------------------------
SHIPPED = REPO / "data" / "benchmarks"


def pinned_checksums() -> dict[str, tuple[str, int]]:
    """file -> (sha256, bytes) as written in data/benchmarks/README.md."""
    text = (SHIPPED / "README.md").read_text()
    out = {}
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        name = section.split()[0]
        m = re.search(r"^- sha256: `([0-9a-f]{64})` \(([\d,]+) bytes\)", section, re.M)
        assert m, f"data/benchmarks/README.md: no sha256 line for {name}"
        out[name] = (m.group(1), int(m.group(2).replace(",", "")))
    return out


def test_shipped_benchmarks_match_their_checksums():
    pinned = pinned_checksums()
    assert set(pinned) == {"gsm8k_test.jsonl", "math500_test.jsonl", "mbpp_sanitized_test.jsonl"}
    assert sorted(p.name for p in SHIPPED.glob("*.jsonl")) == sorted(pinned)
    for name, (sha, size) in pinned.items():
        data = (SHIPPED / name).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (sha, size), f"data/benchmarks/{name} was changed"


def test_every_task_file_is_shipped():
    from tdlm.tasks import gsm8k, math500, mbpp

    for spec in (gsm8k.SPEC, math500.SPEC, mbpp.SPEC):
        assert (SHIPPED / spec.local_file).is_file(), spec.local_file


def test_data_dir_lookup_order(tmp_path, monkeypatch):
    """Env var first (load_records), then the shipped copy, then ../shared/benchmarks (default_data_dir)."""
    shipped, shared = tmp_path / "checkout" / "data" / "benchmarks", tmp_path / "shared" / "benchmarks"
    monkeypatch.setattr(base, "SHIPPED_DATA_DIR", shipped)
    monkeypatch.setattr(base, "SHARED_DATA_DIR", shared)
    assert base.default_data_dir() == shipped  # neither exists: the error names where the files belong
    shared.mkdir(parents=True)
    assert base.default_data_dir() == shared  # a package without data/ beside ../shared
    shipped.mkdir(parents=True)
    assert base.default_data_dir() == shipped  # the shipped copy wins

    spec = base.DatasetSpec("none/none", None, "test", "tiny.jsonl", 1, ("q",))
    for folder, q in ((shipped, "shipped"), (shared, "shared"), (tmp_path / "env", "env")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tiny.jsonl").write_text(f'{{"q": "{q}"}}\n')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # step 2 (the Hub) is off here; base's own tests cover it
    monkeypatch.delenv(base.DATA_DIR_ENV, raising=False)
    assert base.load_records(spec)[0] == [{"q": "shipped"}]
    monkeypatch.setenv(base.DATA_DIR_ENV, str(tmp_path / "env"))
    assert base.load_records(spec)[0] == [{"q": "env"}]
    assert base.load_records(spec, data_dir=shared)[0] == [{"q": "shared"}]  # an explicit data_dir beats all


def test_default_data_dir_is_the_shipped_copy_in_this_checkout():
    assert base.default_data_dir() == SHIPPED == base.SHIPPED_DATA_DIR
