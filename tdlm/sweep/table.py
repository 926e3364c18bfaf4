"""Table 4 of a sweep folder from its local JSON alone (``sweep.json``, ``trials/*/trial.json`` and the evaluation
summaries under ``eval/``): one row per allocation - temporal layers, trainable parameters, accuracy, NFE, seconds,
speedup over the original model - per task, tau and history, with the baselines beneath for reference. An allocation
whose training failed keeps its row, with the reason (the paper's "32, all: Training OOM").

A sweep with training seeds (``seeds: [0, 1, 2]``) reports each allocation as mean ± sd over its seeds (sample sd,
n - 1; n = the seeds evaluated) and, for every row, the accuracy difference from the *reference allocation* - the
sweep's first - with a two-level bootstrap interval over seeds and problems
(:func:`tdlm.evaluation.paired.compare_seeds`); a difference is marked as evidence only when its interval excludes
zero."""

from __future__ import annotations

import json
import os
import statistics
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

    def position(t: dict) -> tuple:  # the sweep's allocation order, then training seed; others after, by name
        s = t.get("allocation_slug") or t["slug"]
        return (order.index(s), "", -1 if t.get("seed") is None else t["seed"]) if s in order else (
            len(order), t["slug"], 0)  # fmt: skip

    ordered = sorted(trials.values(), key=position)
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


def is_seeded(sweep: dict) -> bool:
    """A sweep whose training seeds are an axis (``seeds: [...]``; its record lists the training seeds)."""
    return isinstance((sweep.get("seeds") or {}).get("train"), list)


def table4(path: str | os.PathLike) -> str:
    """The Markdown Table 4 of a sweep folder (mean ± sd over seeds for a sweep with training seeds)."""
    from tdlm.evaluation.report import method_label

    sweep, trials, runs = load_sweep(path)
    if is_seeded(sweep):
        return _table4_seeds(sweep, trials, runs)
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
            name = f"{method_label(r)} (reference)"
            rows.append(_row(name, "–", r))
        n = next((r["n"] for r in runs if r["task"] == task), None)
        out.append(f"### {TITLES.get(task, task)}, TDLM τ={tau:g}, history {hist or '?'}"
                   f"{'' if n is None else f' ({n} problems)'}\n\n"
                   "| Temporal layers | Parameters | Accuracy (%) | NFE | Avg. sec | Speedup | Δacc vs τ 0.9 (pp) "
                   "[95% CI] | McNemar p (b/c) | NFE ratio vs τ 0.9 [95% CI] |\n"
                   "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))  # fmt: skip
    return "\n\n".join(out) + "\n"


def _mean_sd(values: list[float], scale: float, digits: int) -> str:
    """``mean ± sd`` (sample sd, n - 1); ``mean ± –`` for one value."""
    m = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else None
    return f"{scale * m:.{digits}f} ± " + ("–" if sd is None else f"{scale * sd:.{digits}f}")


def _pp(v: float) -> str:
    return f"{100 * v:+.2f}".replace("-", "−")


def _table4_seeds(sweep: dict, trials: list[dict], runs: list[dict]) -> str:
    """Table 4 of a sweep with training seeds: one row per allocation over its seeds (module docstring)."""
    from tdlm.evaluation.paired import CONFIDENCE, RESAMPLES, SEED

    settings = sweep.get("settings") or {}
    ev = settings.get("eval") or {}
    seeds = sweep.get("seeds") or {}
    groups: dict[str, list[dict]] = {}  # allocation slug -> its trials, in seed order (load_sweep's order)
    for t in trials:
        groups.setdefault(t.get("allocation_slug") or t["slug"], []).append(t)
    keys: list[tuple] = []
    for r in runs:
        k = (r["task"], r.get("threshold"), r.get("history"))
        if r["policy"] == "tdlm" and k not in keys:
            keys.append(k)
    if not keys:
        keys = [(t, tau, None) for t in ev.get("tasks", []) for tau in ev.get("thresholds", [])]
    ref_slug = next(iter(groups), None)
    ref_name = label(groups[ref_slug][0]["allocation"], groups[ref_slug][0]["layers"]) if ref_slug else "–"
    pct = f"{100 * CONFIDENCE:g}%"
    out = [f"## Table 4: temporal-layer allocations ({sweep.get('experiment')}), mean ± sd over training seeds",
           f"Backbone `{sweep.get('backbone')}`; every allocation trained from `{settings.get('train_config')}` "
           f"{' '.join(settings.get('train_overrides') or [])} on the same trajectories "
           f"(manifest {str((sweep.get('trajectories') or {}).get('manifest', '?'))[:19]}…) once per training seed "
           f"({', '.join(map(str, seeds.get('train') or []))}; data seed {seeds.get('data')}); decoding "
           f"{ev.get('gen_length')} tokens in blocks of {ev.get('block_size')}, batch {ev.get('batch_size')}; "
           f"speedup = seconds of `original` / mean seconds of the row.",
           f"Each allocation: mean ± sd over its seeds (sample sd, n − 1; Seeds = n evaluated). Δacc = the row minus "
           f"the reference allocation `{ref_name}` (the sweep's first), with a {pct} two-level bootstrap interval: "
           f"training seeds resampled on each side independently, problems resampled once for both (paired); "
           f"{RESAMPLES} resamples, seed {SEED}. Evidence: yes only when the interval excludes 0."]  # fmt: skip
    section = _SeedSection(groups, runs, ref_slug, ref_name)
    for task, tau, hist in sorted(keys, key=lambda k: (k[0], k[1], str(k[2]))):
        rows, notes = section.rows(task, tau, hist)
        n = next((r["n"] for r in runs if r["task"] == task), None)
        out.append(f"### {TITLES.get(task, task)}, TDLM τ={tau:g}, history {hist or '?'}"
                   f"{'' if n is None else f' ({n} problems)'}\n\n"
                   f"| Temporal layers | Parameters | Seeds | Accuracy (%) | NFE | Avg. sec | Speedup | "
                   f"Δacc vs {ref_name} (pp) [{pct} CI] | Evidence |\n"
                   "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
                   + ("\n\n" if notes else "") + "\n".join(f"- ({i}) {text}" for i, text in enumerate(notes, 1)))
    return "\n\n".join(out) + "\n"


class _SeedSection:
    """The rows of one (task, tau, history) section of a seeded Table 4, and the notes beneath them."""

    def __init__(self, groups: dict[str, list[dict]], runs: list[dict], ref_slug: str | None, ref_name: str):
        self.groups, self.runs, self.ref_slug, self.ref_name = groups, runs, ref_slug, ref_name
        self.cache: dict[str, list[dict]] = {}  # run folder -> its scored samples (read once per table)
        self.notes: list[str] = []

    def note(self, text: str) -> str:
        self.notes.append(text)
        return f"({len(self.notes)})"

    def records(self, r: dict) -> list[dict]:
        from tdlm.evaluation.paired import samples_of

        key = str(r.get("run_dir") or r.get("summary_file"))
        if key not in self.cache:
            self.cache[key] = list(samples_of(r))
        return self.cache[key]

    def delta(self, side: list[dict], who: str, reference: list[dict]) -> list[str]:
        """Δacc [CI] of ``side`` (one run per seed) minus the reference allocation's seeds, and the evidence cell."""
        from tdlm.evaluation.paired import PairingError, compare_seeds

        if not reference:
            return ["–", "–"]
        try:
            res = compare_seeds([self.records(r) for r in side], [self.records(r) for r in reference],
                                run_label=who, reference_label=self.ref_name)  # fmt: skip
        except (PairingError, OSError) as e:
            return [f"– {self.note(str(e) if isinstance(e, PairingError) else f'{e.filename}: {e.strerror}')}", "–"]
        except TDLMError as e:  # a malformed samples.jsonl
            return [f"– {self.note(str(e))}", "–"]
        lo, hi = res.accuracy_diff_ci
        return [f"{_pp(res.accuracy_diff)} [{_pp(lo)}, {_pp(hi)}]", "yes" if res.evidence else "no"]

    def rows(self, task: str, tau: float, hist: str | None) -> tuple[list[str], list[str]]:
        from tdlm.evaluation.report import method_label

        self.notes = []
        tdlm = {r.get("adapter_label"): r for r in self.runs if r["policy"] == "tdlm" and r["task"] == task
                and r.get("threshold") == tau and (hist is None or r.get("history") == hist)}  # fmt: skip
        done = {s: [(t, tdlm[t["slug"]]) for t in g if t["slug"] in tdlm] for s, g in self.groups.items()}
        base = [r for r in self.runs if r["policy"] != "tdlm" and r["task"] == task]
        original = next((r for r in base if r["policy"] == "original"), None)
        reference = [r for _t, r in done.get(self.ref_slug, [])]
        rows = []
        for s, g in self.groups.items():
            name, params = label(g[0]["allocation"], g[0]["layers"]), f"{g[0]['temporal_parameters']:,}"
            rs = [r for _t, r in done[s]]
            count = f"{len(rs)}" if len(rs) == len(g) else f"{len(rs)} of {len(g)}"
            for t in g:
                if t["slug"] not in tdlm:
                    why = "not evaluated" if t.get("status") == "done" else f"{t.get('status')}: {t.get('error', '')}"
                    count += " " + self.note(f"{name}, seed {t.get('seed')}: {why}"[:200])
            if not rs:
                rows.append(f"| {name} | {params} | {count} | – | – | – | – | – | – |")
                continue
            sec = statistics.fmean(r["seconds_mean"] for r in rs)
            speedup = "–" if original is None or sec <= 0 else f"{original['seconds_mean'] / sec:.2f}×"
            cells = ["reference", "–"] if s == self.ref_slug else self.delta(rs, name, reference)
            rows.append(f"| {name} | {params} | {count} | {_mean_sd([r['accuracy'] for r in rs], 100, 2)} | "
                        f"{_mean_sd([r['nfe_mean'] for r in rs], 1, 2)} | "
                        f"{_mean_sd([r['seconds_mean'] for r in rs], 1, 3)} | {speedup} | {' | '.join(cells)} |")
        for r in sorted(base, key=lambda r: (r["policy"] != "original", r.get("threshold") or 0.0)):
            name = f"{method_label(r)} (reference)"
            rows.append(f"| {name} | – | – | {_pct(r['accuracy'])} | {r['nfe_mean']:.2f} | {r['seconds_mean']:.3f} | "
                        f"{_x(r.get('speedup_vs_original'))} | {' | '.join(self.delta([r], name, reference))} |")
        return rows, self.notes


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

    sweep, trials, runs = load_sweep(path)
    allocation_of = {t["slug"]: t.get("allocation_slug") or t["slug"] for t in trials}  # trial -> its allocation
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["gen_length"], r["block_size"]), []).append(r)
    multi = len({k[1:] for k in groups}) > 1
    out = []
    for (task, gen, block), group in groups.items():
        labels = {r.get("adapter_label") for r in group if r["policy"] == "tdlm"}
        n = len({allocation_of.get(x, x) for x in labels})
        per_seed = " (a line per training seed)" if is_seeded(sweep) else ""
        title = (f"{TITLES.get(task) or EVAL_TITLES.get(task, task)}: {n} allocation(s){per_seed} of sweep "
                 f"{sweep.get('experiment')} against the baselines ({sweep.get('backbone')}, N={gen}, block {block})")
        name = f"pareto_{task}" + (f"_N{gen}_b{block}" if multi else "") + ".png"
        out.append(plot_pareto(group, Path(path) / name, title))
    return out
