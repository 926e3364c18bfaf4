"""Table 4 of a sweep folder from its local JSON alone (``sweep.json``, ``trials/*/trial.json`` and the evaluation
summaries under ``eval/``): one row per allocation - temporal layers, trainable parameters, accuracy, NFE, seconds,
speedup over the original model - per task, tau and history, with the baselines beneath for reference. An allocation
whose training failed keeps its row, with the reason (the paper's "32, all: Training OOM")."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tdlm.errors import TDLMError
from tdlm.sweep.config import SWEEP_RECORD, TRIAL_RECORD, label, slug

TITLES = {"gsm8k": "GSM8K", "math500": "MATH-500", "mbpp": "MBPP", "arith": "Arith"}


def is_sweep_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / SWEEP_RECORD).is_file()


def load_sweep(path: str | os.PathLike) -> tuple[dict, list[dict], list[dict]]:
    """(sweep record, trial records in the sweep's allocation order, evaluation runs with speedups)."""
    from tdlm.evaluation import compute_speedups, load_runs
    from tdlm.evaluation.paired import DEFAULT_REFERENCE, attach_paired

    d = Path(path)
    if not is_sweep_dir(d):
        raise TDLMError(f"{d}: no {SWEEP_RECORD} (expected a sweep output_dir written by launcher/sweep.py)")
    sweep = json.loads((d / SWEEP_RECORD).read_text())
    trials = {}
    for f in sorted((d / "trials").glob(f"*/{TRIAL_RECORD}")):
        try:
            t = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise TDLMError(f"{f}: invalid JSON: {e}") from e
        trials[t["slug"]] = t
    order = [slug(a) for a in sweep.get("allocations", [])]
    ordered = [trials[s] for s in order if s in trials] + [t for s, t in trials.items() if s not in order]
    eval_dirs = [p for p in sorted((d / "eval").glob("*")) if (p / "runs").is_dir()]
    tau = ((sweep.get("settings") or {}).get("eval") or {}).get("thresholds", [0.9])[0]
    runs = compute_speedups(load_runs(eval_dirs), tau) if eval_dirs else []
    # Each allocation is evaluated in its own folder and the baselines in eval/baselines: pair across them, on the
    # same problems, against Fast-dLLM's threshold rule at 0.9 (tdlm.evaluation.paired).
    attach_paired(runs, DEFAULT_REFERENCE)
    return sweep, ordered, runs


def _pct(v):
    return "–" if v is None else f"{100 * v:.2f}"


def _x(v):
    return "–" if v is None else f"{v:.2f}×"


def _row(name: str, params: str, r: dict | None, note: str = "") -> str:
    if r is None:
        return f"| {name} | {params} | {note or 'not evaluated'} | – | – | – | – | – | – |"
    from tdlm.evaluation.report import paired_cells

    delta, mcnemar, nfe_ratio, _ = paired_cells(r.get("paired") or {})
    return (f"| {name} | {params} | {_pct(r['accuracy'])} | {r['nfe_mean']:.2f} | {r['seconds_mean']:.3f} | "
            f"{_x(r.get('speedup_vs_original'))} | {delta} | {mcnemar} | {nfe_ratio} |")


def table4(path: str | os.PathLike) -> str:
    """The Markdown Table 4 of a sweep folder."""
    sweep, trials, runs = load_sweep(path)
    settings = sweep.get("settings") or {}
    ev = settings.get("eval") or {}
    by_label: dict[tuple, dict] = {}
    keys: list[tuple] = []
    for r in runs:
        if r["policy"] == "tdlm":
            k = (r["task"], r["threshold"], r.get("history"))
            by_label[(*k, r.get("adapter_label"))] = r
            if k not in keys:
                keys.append(k)
    if not keys:  # nothing evaluated yet: one table of the trials' status per task
        keys = [(t, tau, None) for t in ev.get("tasks", []) for tau in ev.get("thresholds", [])]
    out = [f"## Table 4: temporal-layer allocations ({sweep.get('experiment')})",
           f"Backbone `{sweep.get('backbone')}`; every allocation trained from `{settings.get('train_config')}` "
           f"{' '.join(settings.get('train_overrides') or [])} on the same trajectories "
           f"(manifest {str((sweep.get('trajectories') or {}).get('manifest', '?'))[:19]}…) and seeds "
           f"(train {sweep.get('seeds', {}).get('train')}, data {sweep.get('seeds', {}).get('data')}); decoding "
           f"{ev.get('gen_length')} tokens in blocks of {ev.get('block_size')}, batch {ev.get('batch_size')}; "
           f"speedup = seconds of `original` / seconds of the row."]  # fmt: skip
    for task, tau, hist in sorted(keys, key=lambda k: (k[0], k[1], str(k[2]))):
        rows = []
        for t in trials:
            name = label(t["allocation"], t["layers"])
            params = f"{t['temporal_parameters']:,}"
            r = by_label.get((task, tau, hist, t["slug"])) if hist else next(
                (v for (tk, ta, _h, s), v in by_label.items() if (tk, ta, s) == (task, tau, t["slug"])), None)
            note = "" if t.get("status") == "done" else f"{t.get('status')}: {t.get('error', '')}"[:160]
            rows.append(_row(name, params, r, note))
        base = [r for r in runs if r["policy"] != "tdlm" and r["task"] == task]
        for r in sorted(base, key=lambda r: (r["policy"] != "original", r.get("threshold") or 0.0)):
            name = "Original (reference)" if r["policy"] == "original" else (
                f"Fast-dLLM τ={r['threshold']:g} (reference)" if r["policy"] == "threshold"
                else f"Entropy H={r['entropy_threshold']:g} (reference)")  # fmt: skip
            rows.append(_row(name, "–", r))
        n = next((r["n"] for r in runs if r["task"] == task), None)
        out.append(f"### {TITLES.get(task, task)}, TDLM τ={tau:g}, history {hist or '?'}"
                   f"{'' if n is None else f' ({n} problems)'}\n\n"
                   "| Temporal layers | Parameters | Accuracy (%) | NFE | Avg. sec | Speedup | Δacc vs τ 0.9 (pp) "
                   "[95% CI] | McNemar p (b/c) | NFE ratio vs τ 0.9 [95% CI] |\n"
                   "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))  # fmt: skip
    return "\n\n".join(out) + "\n"


def write_table4(path: str | os.PathLike) -> tuple[str, Path]:
    text = table4(path)
    dest = Path(path) / "table4.md"
    dest.write_text(text)
    return text, dest


def plot_sweep(path: str | os.PathLike) -> list[Path]:
    """``<sweep>/pareto_<task>.png``: every allocation's TDLM frontier (one line per allocation, a point per tau)
    against the baselines, from the folder's evaluations (each trial's own ``eval/<slug>/pareto_*.png`` holds only
    its adapter). Returns the written paths (none before anything was evaluated)."""
    from tdlm.evaluation.plot import plot_pareto
    from tdlm.evaluation.report import TASK_TITLES as EVAL_TITLES

    sweep, _trials, runs = load_sweep(path)
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["gen_length"], r["block_size"]), []).append(r)
    multi = len({k[1:] for k in groups}) > 1
    out = []
    for (task, gen, block), group in groups.items():
        n = len({r.get("adapter_label") for r in group if r["policy"] == "tdlm"})
        title = (f"{TITLES.get(task) or EVAL_TITLES.get(task, task)}: {n} allocation(s) of sweep "
                 f"{sweep.get('experiment')} against the baselines ({sweep.get('backbone')}, N={gen}, block {block})")
        name = f"pareto_{task}" + (f"_N{gen}_b{block}" if multi else "") + ".png"
        out.append(plot_pareto(group, Path(path) / name, title))
    return out
