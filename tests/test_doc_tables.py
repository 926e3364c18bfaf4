"""The tables that scripts/doc_tables.py generates from bench/results/*.json match their JSON, and the checker
notices a drifted number anywhere in a table, a JSON that moved, and broken markers (a copy of the pages in tmp)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "doc_tables.py"

_spec = importlib.util.spec_from_file_location("doc_tables", SCRIPT)
dt = importlib.util.module_from_spec(_spec)
sys.modules["doc_tables"] = dt  # dataclasses look their module up while the class is built
_spec.loader.exec_module(dt)


def copy_tree(tmp: Path) -> Path:
    """The registered pages and JSON files (of the tables and of the facts in prose), at their paths under tmp."""
    files = {t.page for t in dt.TABLES} | {t.source for t in dt.TABLES}
    for rel in files | {f.page for f in dt.FACTS} | {s for f in dt.FACTS for s in f.sources}:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp / rel)
    return tmp


def region_lines(root: Path, table) -> tuple[list[str], int]:
    """The page's lines and the 0-based index of the table's begin marker."""
    lines = (root / table.page).read_text().split("\n")
    return lines, lines.index(table.begin())


def plant_wrong_digit(root: Path, table) -> int:
    """Change the last digit of the region's last line; returns that line's 0-based index."""
    lines, begin = region_lines(root, table)
    last = lines.index(dt.END, begin) - 1
    digit = next(i for i in range(len(lines[last]) - 1, -1, -1) if lines[last][i].isdigit())
    wrong = "1" if lines[last][digit] != "1" else "2"
    lines[last] = lines[last][:digit] + wrong + lines[last][digit + 1:]
    (root / table.page).write_text("\n".join(lines))
    return last


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", "--root", str(root)], capture_output=True,
                          text=True, timeout=60)


def test_check_passes_on_the_tree():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert dt.stale() == []


def test_every_table_is_registered_once_with_its_json_and_page():
    names = [t.name for t in dt.TABLES]
    assert len(names) == len(set(names)), names
    required = {("true_shape_batch1", "docs/training.md"), ("true_shape_targets", "docs/training.md"),
                ("true_shape_overhead", "docs/decoding.md")}
    assert required <= {(t.name, t.page) for t in dt.TABLES}
    for t in dt.TABLES:
        assert t.source.startswith("bench/results/") and t.source.endswith(".json"), t
        assert (REPO / t.source).is_file(), t.source
        json.loads((REPO / t.source).read_text())
        assert (REPO / t.page).is_file(), t.page
        assert t.begin() in (REPO / t.page).read_text(), f"{t.page} has no region for {t.name}"


@pytest.mark.parametrize("table", dt.TABLES, ids=[t.name for t in dt.TABLES])
def test_a_wrong_number_in_the_last_row_is_reported(tmp_path, table):
    # the last row, not the first: a checker that compares only the header or first line would pass it
    root = copy_tree(tmp_path)
    last = plant_wrong_digit(root, table)

    msgs = dt.stale(root)
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith(f"{table.page}: table {table.name} is stale"), msgs
    assert f"line {last + 1}:" in msgs[0], msgs  # the page's own line number of the planted row
    proc = check(root)
    assert proc.returncode == 1 and table.name in proc.stderr and table.page in proc.stderr, proc.stderr

    assert dt.write(root) == [f"{table.page}: {table.name}"]
    assert (root / table.page).read_text() == (REPO / table.page).read_text()  # rewritten exactly as before
    assert check(root).returncode == 0


def test_a_moved_json_value_makes_its_table_stale_and_is_written_rounded(tmp_path):
    """The issue's example: GH200 uncached overlapped TDLM 8.98 ms. A JSON value that rounds to another figure
    shows up in the batch-1 table (training.md) and nowhere else; one that rounds the same does not."""
    root = copy_tree(tmp_path)
    path = root / "bench/results/true_shape.json"
    data = json.loads(path.read_text())
    (r,) = [r for r in data["table"]
            if (r["model"], r["cache"], r["history"], r["gpu"]) == ("llada-8b", "none", "full", "gh200")]
    r["tdlm_ms_overlapped"] = round(r["tdlm_ms_overlapped"], 2) + 0.004  # still rounds to the same figure
    path.write_text(json.dumps(data))
    assert dt.stale(root) == []
    r["tdlm_ms_overlapped"] = 8.987
    path.write_text(json.dumps(data))
    msgs = dt.stale(root)
    assert len(msgs) == 1 and "true_shape_batch1" in msgs[0] and "8.99" in msgs[0], msgs
    dt.write(root)
    assert "| cache none, history `full` | GH200 | " in (text := (root / "docs/training.md").read_text())
    assert " 8.89 / 8.99 (" in text


def test_rendering_matches_an_independent_reading_of_the_json():
    """A few cells recomputed here by hand from the JSON, so a renderer that rounds or picks fields differently is
    caught even after someone regenerated the pages with it."""
    d = json.loads((REPO / "bench/results/true_shape.json").read_text())
    training, decoding = (REPO / "docs/training.md").read_text(), (REPO / "docs/decoding.md").read_text()
    rows = {(r["cache"], r["history"], r["gpu"]): r for r in d["table"] if r["model"] == "llada-8b"}
    for gpu, name in (("h200", "H200"), ("gh200", "GH200")):
        r = rows[("none", "full", gpu)]
        overlapped = f"{r['backbone_ms_overlapped']:.2f} / {r['tdlm_ms_overlapped']:.2f} " \
                     f"(+{100 * r['overhead_overlapped']:.1f}%)"
        gsm8k = f"{r['gsm8k_s']:.3f} / {d['paper']['nfe'] * r['tdlm_ms_overlapped'] / 1000:.3f}"
        line = next(ln for ln in training.splitlines() if ln.startswith(f"| cache none, history `full` | {name} |"))
        assert f"| {overlapped} |" in line and line.endswith(f"| {gsm8k} |"), line
    t = d["targets"]["none|full"]
    assert (f"+{100 * t['overhead_launches']:.2f}%, **not met** (holds up to {t['launch_us_at_limit_added']:.1f} µs "
            "per launch)") in training
    dual = rows[("dual", "full", "h200")]
    assert f"| cache dual | {dual['backbone_ms']:.2f} / {dual['tdlm_ms']:.2f}, +{100 * dual['overhead']:.2f}%" \
        in decoding


def _break(root: Path, table, how: str) -> None:
    lines, begin = region_lines(root, table)
    if how == "unclosed":
        del lines[lines.index(dt.END, begin)]
    elif how == "no begin":
        del lines[begin]
    elif how == "unknown name":
        lines[begin] = lines[begin].replace(f"table:{table.name} ", "table:no_such_table ")
    elif how == "twice":
        end = lines.index(dt.END, begin)
        lines[end + 1:end + 1] = ["", *lines[begin:end + 1]]
    (root / table.page).write_text("\n".join(lines))


@pytest.mark.parametrize("how,says", [("unclosed", "is not closed"), ("no begin", "no region for table"),
                                      ("unknown name", "no_such_table is not registered"), ("twice", "twice")])
def test_broken_markers_are_one_clear_error_and_nothing_is_written(tmp_path, how, says):
    root = copy_tree(tmp_path)
    table = next(t for t in dt.TABLES if t.name == "true_shape_targets")  # docs/training.md
    _break(root, table, how)
    # a stale table on the page read first must not be rewritten either: nothing is written before all are read
    plant_wrong_digit(root, next(t for t in dt.TABLES if t.name == "true_shape_overhead"))  # docs/decoding.md
    before = {p: (root / p).read_text() for p in {t.page for t in dt.TABLES}}

    with pytest.raises(dt.RegionError) as err:
        dt.write(root)
    assert table.page in str(err.value) and says in str(err.value), err.value
    assert {p: (root / p).read_text() for p in before} == before
    proc = check(root)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("doc_tables: docs/training.md") and says in lines[0], lines


def test_an_end_marker_without_its_region_is_an_error(tmp_path):
    root = copy_tree(tmp_path)
    page = root / "docs/decoding.md"
    page.write_text(page.read_text() + f"\n{dt.END}\n")
    with pytest.raises(dt.RegionError, match="closes no table"):
        dt.stale(root)


def test_help_explains_the_markers():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "<!-- table:" in proc.stdout and dt.END in proc.stdout and "--check" in proc.stdout


def test_every_region_of_a_page_is_rewritten_in_place(tmp_path):
    """All regions of both pages emptied at once: the rewrite, whose regions change length, restores each page
    byte for byte (a rewrite that shifts later regions' offsets would garble them)."""
    root = copy_tree(tmp_path)
    for t in dt.TABLES:
        lines, begin = region_lines(root, t)
        lines[begin + 1:lines.index(dt.END, begin)] = ["| stale |"]
        (root / t.page).write_text("\n".join(lines))
    assert len(dt.stale(root)) == len(dt.TABLES)
    assert len(dt.write(root)) == len(dt.TABLES)
    for page in {t.page for t in dt.TABLES}:
        assert (root / page).read_text() == (REPO / page).read_text(), page


def test_verdicts_follow_the_json(tmp_path):
    """Every target turned around in the JSON: each met / not met / yes / no in the tables turns with it."""
    root = copy_tree(tmp_path)
    shape = json.loads((root / "bench/results/true_shape.json").read_text())
    for t in shape["targets"].values():
        for key in ("met_launches", "met_overlapped", "met_cuda_graphs"):
            t[key] = None if t[key] is None else not t[key]
    (root / "bench/results/true_shape.json").write_text(json.dumps(shape))
    onpolicy = json.loads((root / "bench/results/onpolicy.json").read_text())
    for t in onpolicy["targets"].values():
        t["met"] = not t["met"]
    (root / "bench/results/onpolicy.json").write_text(json.dumps(onpolicy))
    dt.write(root)

    def region(name: str) -> str:
        t = next(t for t in dt.TABLES if t.name == name)
        text = (root / t.page).read_text()
        return text[text.index(t.begin()):text.index(dt.END, text.index(t.begin()))]

    def verdicts(text: str) -> list[bool]:
        return [m == "met" for m in re.findall(r"\*\*not met\*\*|\bmet\b", text)]

    for name in ("true_shape_targets", "true_shape_overhead"):
        want = [not v for v in verdicts(dt.expected(next(t for t in dt.TABLES if t.name == name), REPO))]
        assert verdicts(region(name)) == want and len(want) >= 4, name
    assert [ln.endswith("| yes |") for ln in region("onpolicy_final").splitlines() if ln.endswith(("| yes |",
            "| no |"))] == [t["met"] for t in onpolicy["targets"].values()]


# -- numbers in prose (FACTS) ---------------------------------------------------------------------------
def test_every_number_in_prose_matches_its_json():
    assert dt.stale_facts() == []
    pages = {f.page for f in dt.FACTS}
    assert {"README.md", "docs/decoding.md", "docs/training.md"} <= pages  # the README's 8B and CPU numbers too


def test_a_prose_number_one_digit_off_is_named_and_rewritten(tmp_path):
    root = copy_tree(tmp_path)
    readme = (root / "README.md").read_text()
    fact = next(f for f in dt.FACTS if f.name == "readme_decode_speed")
    m = fact.pattern().search(readme)
    wrong = m["eager"][:-1] + ("1" if m["eager"][-1] != "1" else "2")
    (root / "README.md").write_text(readme[: m.start("eager")] + wrong + readme[m.end("eager") :])
    msgs = dt.stale_facts(root)
    assert len(msgs) == 1 and "readme_decode_speed" in msgs[0] and f"eager is {wrong}" in msgs[0], msgs
    assert msgs[0].startswith(f"README.md:{readme.count(chr(10), 0, m.start('eager')) + 1}:")
    proc = check(root)
    assert proc.returncode == 1 and "readme_decode_speed" in proc.stderr, proc.stderr  # the command line too
    assert dt.write_facts(root) == ["README.md: fact readme_decode_speed"]
    assert (root / "README.md").read_text() == readme and dt.stale_facts(root) == []


def test_a_fact_whose_words_left_the_page_is_an_error(tmp_path):
    root = copy_tree(tmp_path)
    page = root / "docs/decoding.md"
    page.write_text(page.read_text().replace("CUDA-graph-tree check accepts", "CUDA-graph-tree check takes"))
    with pytest.raises(dt.RegionError, match="readiness_static"):
        dt.stale_facts(root)


def test_every_field_of_every_fact_one_digit_off_is_named(tmp_path):
    """Each number of each registered sentence, one digit off on a copy of its page, is the one message --check
    gives: the fact and the field (the README's on-policy arms and intervals, its seed spread and docs/gpu.md's
    compile times among them)."""
    root = copy_tree(tmp_path)
    assert {"readme_onpolicy_arms", "readme_onpolicy_targets", "readme_seed_variance", "gpu_compile_scope"} <= {
        f.name for f in dt.FACTS}
    planted = 0
    for fact in dt.FACTS:
        page = root / fact.page
        text = page.read_text()
        m = dt.fact_matches(fact, text)
        for field in m.groupdict():
            i = max(j for j in range(m.start(field), m.end(field)) if text[j].isdigit())
            wrong = text[:i] + ("1" if text[i] != "1" else "2") + text[i + 1 :]
            page.write_text(wrong)
            msgs = dt.stale_facts(root, [fact])
            assert len(msgs) == 1 and f"fact {fact.name}: {field} is " in msgs[0], (fact.name, field, msgs)
            planted += 1
        page.write_text(text)
    assert planted >= 60 and dt.stale_facts(root) == []
