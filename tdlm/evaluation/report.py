"""Markdown tables from run summaries, shaped like the paper's tables.

* :func:`main_table` - Table 1: rows = methods, per task the score, mean NFE, mean seconds and the
  speedup over the original model (one table per backbone / budget);
* :func:`history_table` - Table 2: one adapter and tau, rows = inference-time history restrictions;
* :func:`allocation_table` - Table 4: rows = adapters (temporal-layer allocations) at one tau / history;
* :func:`detail_table` - every run with both speedups and NFE ratios (the sweep behind Figure 1);
* :func:`paired_table` - every run against a reference run on the same problems (:mod:`tdlm.evaluation.paired`):
  accuracy difference with its paired-bootstrap interval, exact McNemar p, NFE and seconds ratios with intervals.

Everything reads plain run dicts (``runs/<task>/<run>/summary.json``), so ``eval/compare.py`` renders the
same tables from files without W&B; the paired table also reads each run's ``samples.jsonl``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tdlm.errors import TDLMError
from tdlm.evaluation.config import RUN_ORDER as POLICY_ORDER  # the paper's row order
from tdlm.evaluation.paired import CONFIDENCE, DEFAULT_REFERENCE, RESAMPLES, SEED, paired_against, run_name
from tdlm.tasks import TASK_NAMES

REUSE_LABELS = {"credit": "dInfer credit", "soft": "dInfer soft iteration"}  # tdlm/decoding/reuse.py
TASK_TITLES = {"gsm8k": "GSM8K", "math500": "MATH-500", "mbpp": "MBPP", "arith": "Arith"}


CACHE_ORDER = ("none", "prefix", "dual")


def cache_of(run: dict) -> str:
    """A run's spatial KV cache (summaries written before the cache existed: none)."""
    return run.get("cache") or "none"


def cache_suffix(run: dict) -> str:
    """`` + dual cache`` for a cached run, empty otherwise (every label of a cached variant carries it)."""
    c = cache_of(run)
    return "" if c == "none" else f" + {c} cache"


def method_label(run: dict) -> str:
    p = run["policy"]
    if p == "original":
        label = "Original"
    elif p == "threshold":
        label = f"Fast-dLLM τ={run['threshold']:g}"
    elif p == "entropy":
        label = f"Entropy H={run['entropy_threshold']:g}"
    elif p in REUSE_LABELS:
        label = f"{REUSE_LABELS[p]} τ={run['threshold']:g}"
    else:
        label = f"TDLM τ={run['threshold']:g} [{run.get('adapter_label')}, {run.get('history')}]"
    return label + cache_suffix(run)


def method_key(run: dict) -> tuple:
    return (run["policy"], run.get("threshold"), run.get("entropy_threshold"), run.get("adapter_label"),
            run.get("history"), cache_of(run))  # fmt: skip


def _history_rank(h: str | None) -> tuple:
    h = h or ""
    if h == "current":
        return (0, 0)
    m = re.fullmatch(r"last:(\d+)", h)
    if m:
        return (1, int(m.group(1)))
    if h == "full":
        return (2, 0)
    return (3, h)


def sort_key(run: dict) -> tuple:
    p = run["policy"]
    c = cache_of(run)
    return (POLICY_ORDER.index(p) if p in POLICY_ORDER else 9, run.get("adapter_label") or "",
            run.get("threshold") or 0.0, run.get("entropy_threshold") or 0.0,
            _history_rank(run.get("history")), CACHE_ORDER.index(c) if c in CACHE_ORDER else 9)  # fmt: skip


def _f(v: float | None, digits: int) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.2f}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _setting_groups(runs: Sequence[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r.get("backbone_id") or r["backbone"], r["gen_length"], r["block_size"]), []).append(r)
    return groups


def _title(key: tuple) -> str:
    backbone, gen, block = key
    return f"{backbone} (N={gen}, block {block})"


def _tasks(runs: Sequence[dict]) -> list[str]:
    present = {r["task"] for r in runs}
    return [t for t in TASK_NAMES if t in present] + sorted(present - set(TASK_NAMES))


def main_table(runs: Sequence[dict]) -> str:
    """Table 1: rows = methods, per task Acc (%) / NFE / Sec / Speedup over original."""
    out = []
    for key, group in _setting_groups(runs).items():
        tasks = _tasks(group)
        header = ["Method"]
        for t in tasks:
            title = TASK_TITLES.get(t, t)
            header += [f"{title} Acc", f"{title} NFE", f"{title} Sec", f"{title} Speedup"]
        rows: dict[tuple, dict[str, dict]] = {}
        for r in sorted(group, key=sort_key):
            rows.setdefault(method_key(r), {})[r["task"]] = r
        body = []
        for cells in rows.values():
            first = next(iter(cells.values()))
            line = [method_label(first)]
            for t in tasks:
                r = cells.get(t)
                line += (["–"] * 4 if r is None else
                         [_pct(r["accuracy"]), _f(r["nfe_mean"], 2), _f(r["seconds_mean"], 3),
                          _x(r.get("speedup_vs_original"))])  # fmt: skip
            body.append(line)
        out.append(f"### {_title(key)}\n\n{_table(header, body)}")
    return "\n\n".join(out)


def history_table(runs: Sequence[dict]) -> str:
    """Table 2: the history restriction of one adapter (rows current, last:k ..., full)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["policy"] == "tdlm":
            k = (r.get("backbone_id") or r["backbone"], r["task"], r["gen_length"], r["block_size"],
                 r.get("adapter_label"), r["threshold"], cache_of(r))  # fmt: skip
            groups.setdefault(k, []).append(r)
    out = []
    for (backbone, task, gen, block, label, tau, cache), group in groups.items():
        if len({r.get("history") for r in group}) < 2:
            continue
        group = sorted(group, key=lambda r: _history_rank(r.get("history")))
        body = [[r.get("history") or "?", _pct(r["accuracy"]), _f(r["nfe_mean"], 2), _f(r["seconds_mean"], 3),
                 _x(r.get("speedup_vs_original"))] for r in group]  # fmt: skip
        out.append(f"### History restriction: {TASK_TITLES.get(task, task)}, adapter {label}, τ={tau:g}"
                   f"{cache_suffix({'cache': cache})} ({backbone}, N={gen}, block {block})\n\n"
                   + _table(["History", "Acc (%)", "NFE", "Avg. sec", "Speedup"], body))  # fmt: skip
    return "\n\n".join(out)


def allocation_label(run: dict) -> str:
    alloc = run.get("allocation") or {}
    layers = alloc.get("layers")
    if not layers:
        return "?"
    return f"{len(layers)} of {alloc.get('num_layers', '?')}: {','.join(map(str, layers))}"


def allocation_table(runs: Sequence[dict]) -> str:
    """Table 4: adapters with different temporal-layer allocations at the same tau and history."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["policy"] == "tdlm":
            k = (r.get("backbone_id") or r["backbone"], r["task"], r["gen_length"], r["block_size"],
                 r["threshold"], r.get("history"), cache_of(r))  # fmt: skip
            groups.setdefault(k, []).append(r)
    out = []
    for (backbone, task, gen, block, tau, hist, cache), group in groups.items():
        if len({r.get("adapter_label") for r in group}) < 2:
            continue
        group = sorted(group, key=lambda r: str(r.get("adapter_label")))
        body = [[str(r.get("adapter_label")), allocation_label(r), _pct(r["accuracy"]), _f(r["nfe_mean"], 2),
                 _f(r["seconds_mean"], 3)] for r in group]  # fmt: skip
        out.append(f"### Temporal-layer allocations: {TASK_TITLES.get(task, task)}, τ={tau:g}, history {hist}"
                   f"{cache_suffix({'cache': cache})} ({backbone}, N={gen}, block {block})\n\n"
                   + _table(["Adapter", "Temporal layers", "Acc (%)", "NFE", "Avg. sec"], body))  # fmt: skip
    return "\n\n".join(out)


def _sec(r: dict) -> str:
    """Mean seconds per sample with its standard error (summaries written before the spread: the mean alone)."""
    se = r.get("seconds_se")
    if se is None or r["seconds_mean"] is None:
        return _f(r["seconds_mean"], 3)
    return f"{r['seconds_mean']:.3f} ± {se:.3f}"


def detail_table(runs: Sequence[dict]) -> str:
    """Every run: score, NFE, seconds, speedup and NFE ratio over original and over threshold."""
    header = ["Backbone", "Task", "Method", "n", "Acc (%)", "NFE", "Avg. sec ± se", "× orig", "NFE ÷ orig",
              "× thr", "NFE ÷ thr", "thr τ"]  # fmt: skip
    body = []
    for r in sorted(runs, key=lambda r: (str(r.get("backbone_id") or r["backbone"]), _tasks([r])[0], sort_key(r))):
        tau = r.get("threshold_baseline_tau")
        body.append([str(r.get("backbone_id") or r["backbone"]), TASK_TITLES.get(r["task"], r["task"]),
                     method_label(r), str(r["n"]), _pct(r["accuracy"]), _f(r["nfe_mean"], 2),
                     _sec(r), _x(r.get("speedup_vs_original")), _x(r.get("nfe_ratio_vs_original")),
                     _x(r.get("speedup_vs_threshold")), _x(r.get("nfe_ratio_vs_threshold")),
                     "–" if tau is None else f"{tau:g}"])  # fmt: skip
    return _table(header, body)


def _signed_pp(v: float) -> str:
    return f"{100 * v:+.2f}".replace("-", "−")  # a typographic minus lines up with "+"


def _p(p: float) -> str:
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def _ratio_ci(v: float | None, ci: Sequence[float] | None) -> str:
    if v is None:
        return "–"
    return f"{v:.2f}×" + ("" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]")


def paired_cells(p: dict) -> list[str]:
    """A paired comparison's table cells: Δacc [CI], McNemar p (b/c), NFE ratio [CI], seconds ratio [CI]; dashes
    for the reference itself or a comparison that was skipped."""
    if p.get("is_reference") or "n" not in p:
        return ["reference" if p.get("is_reference") else "–", "–", "–", "–"]
    lo, hi = p["accuracy_diff_ci"]
    return [f"{_signed_pp(p['accuracy_diff'])} [{_signed_pp(lo)}, {_signed_pp(hi)}]",
            f"{_p(p['mcnemar_p'])} ({p['run_only_correct']}/{p['reference_only_correct']})",
            _ratio_ci(p["nfe_ratio"], p["nfe_ratio_ci"]), _ratio_ci(p["seconds_ratio"], p["seconds_ratio_ci"])]


def paired_table(runs: Sequence[dict], reference: str = DEFAULT_REFERENCE,
                 samples: Mapping[str, Sequence[dict]] | None = None) -> str:  # fmt: skip
    """Every run against the run named ``reference`` of its backbone, task, budget and block size, paired by sample
    id (:func:`tdlm.evaluation.paired.paired_against`): one row per run, the reason beneath when a row has no
    numbers. ``samples`` (run_dir -> scored records) spares reading ``samples.jsonl`` files."""
    paired = paired_against(runs, reference, samples)
    pct = f"{100 * CONFIDENCE:g}%"
    header = ["Backbone", "Task", "Method", "n", f"Δacc (pp) [{pct} CI]", "McNemar p (b/c)",
              f"NFE ratio [{pct} CI]", f"s ratio [{pct} CI]"]  # fmt: skip
    body: list[list[str]] = []
    notes: dict[str, int] = {}  # reason -> its number (a group without a reference: one note for all its rows)
    refs = 0
    order = sorted(range(len(runs)), key=lambda i: (str(runs[i].get("backbone_id") or runs[i]["backbone"]),
                                                    _tasks([runs[i]])[0], sort_key(runs[i])))  # fmt: skip
    for i in order:
        r, p = runs[i], paired[i]
        head = [str(r.get("backbone_id") or r["backbone"]), TASK_TITLES.get(r["task"], r["task"]), method_label(r)]
        if p.get("is_reference"):
            refs += 1
            body.append([*head, str(r["n"]), "reference", "–", "–", "–"])
        elif "skipped" in p:
            k = notes.setdefault(p["skipped"], len(notes) + 1)
            body.append([*head, str(r["n"]), f"– ({k})", "–", "–", "–"])
        else:
            body.append([*head, str(p["n"]), *paired_cells(p)])
    # A group with two runs of the reference's name has no reference row but is no absent reference: its rows and
    # the footnote naming both folders are the refusal, and "not found" would hide the duplicate.
    if not refs and not any(run_name(r) == reference for r in runs):
        return f"No reference run `{reference}` found: no paired comparison (choose one with `--reference NAME`)."
    lead = (f"Against `{reference}` of the same backbone, task, budget and block size, on the same problems "
            f"(paired by sample id). Δacc = run − reference accuracy in points; b / c = problems only the run / "
            f"only the reference solved; McNemar p: exact two-sided binomial test of b against b + c; ratios = "
            f"reference mean ÷ run mean (> 1: the run needs fewer NFE / seconds). Intervals: {pct} percentile "
            f"paired bootstrap over problems, {RESAMPLES} resamples, seed {SEED}; samples of one batch share "
            f"its wall time, so the seconds interval is optimistic.")  # fmt: skip
    text = lead + "\n\n" + _table(header, body)
    if notes:
        text += "\n\n" + "\n".join(f"- ({k}) {note}" for note, k in notes.items())
    return text


def render(runs: Sequence[dict], reference: str = DEFAULT_REFERENCE,
           samples: Mapping[str, Sequence[dict]] | None = None) -> str:  # fmt: skip
    """All applicable tables as one Markdown document; ``reference`` / ``samples``: :func:`paired_table`."""
    if not runs:
        return "(no runs)\n"
    parts = ["## Main comparison (Table 1)", main_table(runs)]
    parts += ["## Paired comparison on the same problems", paired_table(runs, reference, samples)]
    hist = history_table(runs)
    if hist:
        parts += ["## History restriction (Table 2)", hist]
    alloc = allocation_table(runs)
    if alloc:
        parts += ["## Temporal-layer allocation (Table 4)", alloc]
    parts += ["## All runs", detail_table(runs)]
    return "\n\n".join(parts) + "\n"


def load_runs(paths: Sequence[str | os.PathLike]) -> list[dict]:
    """Run summaries from evaluation output dirs, run dirs, or summary files.

    An output dir contributes every ``runs/<task>/<run>/summary.json`` it holds (also runs of earlier
    invocations with other sweeps, and a partly finished evaluation); a dir without ``runs/`` its own
    ``summary.json``. Duplicates (the same run dir twice) are dropped. Each run gets ``summary_file``, the
    file it was read from (where :func:`tdlm.evaluation.paired.samples_path` looks for its samples).
    """
    runs: list[dict] = []
    seen: set[str] = set()
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            files = [p]
        elif p.is_dir() and (p / "runs").is_dir():
            files = sorted(p.glob("runs/*/*/summary.json"))
        elif (p / "summary.json").is_file():
            files = [p / "summary.json"]
        else:
            raise TDLMError(f"{p}: not found (expected an evaluation output dir or a summary.json)")
        if not files:
            raise TDLMError(f"{p}: no runs/*/*/summary.json yet (has the evaluation finished a run?)")
        for f in files:
            try:
                data = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise TDLMError(f"{f}: invalid JSON: {e}") from e
            items = data.get("runs") if isinstance(data, dict) and "runs" in data else [data]
            for r in items:
                if not isinstance(r, dict) or "policy" not in r or "task" not in r:
                    raise TDLMError(f"{f}: not an evaluation summary (a run needs 'policy' and 'task')")
                key = r.get("run_dir") or json.dumps(r, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    # where it was read: the paired table finds samples.jsonl there when run_dir is another
                    # machine's path (an output dir copied off the cluster)
                    r["summary_file"] = str(f.resolve())
                    runs.append(r)
    return runs
