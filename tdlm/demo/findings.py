"""The demo's findings: the target's verdict (unpaired and by paired intervals), the frontier table, TDLM against
the training-free baselines, and the backbone card's reproduction. Pure functions of the evaluation's summary runs;
:mod:`tdlm.demo` (the package's ``__init__``) runs the stages and writes the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASELINE_TAU = 0.9  # the reference point: threshold at tau 0.9
REUSE_BASELINES = ("credit", "soft")  # dInfer's training-free baselines, decoded at BASELINE_TAU
TDLM_PAIRED_TAU = 0.95  # the TDLM setting paired with each of them
NFE_TARGET, SECONDS_TARGET, ACCURACY_SLACK = 0.8, 0.85, 0.01  # <= 0.8x NFE, <= 0.85x seconds, within 1 point
SEED_VARIANCE = REPO / "bench" / "results" / "seed_variance.json"


def seed_spread(path: Path = SEED_VARIANCE) -> dict[float, dict]:
    """Training-seed spread of TDLM's accuracy per tau (``bench/seed_variance.py``), {} when not measured."""
    try:
        spread = json.loads(path.read_text())["spread"]
        return {float(t): {"sd": v["accuracy_sd_over_seeds"], "range": v["accuracy_range"], "seeds": v.get("n")}
                for t, v in spread.items()}  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def judge(runs: list[dict], seeds: dict[float, dict] | None = None) -> tuple[str, dict]:
    """Does TDLM reach the threshold baseline's accuracy (+-1 pt) with <= 0.8x its NFE and <= 0.85x its seconds at
    some tau? Also says whether the NFE half alone holds, and the training-seed spread at the best setting."""
    base = next((r for r in runs if r["policy"] == "threshold" and r["threshold"] == 0.9), None)
    tdlm = [r for r in runs if r["policy"] == "tdlm"]
    if base is None or not tdlm:
        return "no comparison possible (missing threshold tau=0.9 or tdlm runs)", {}
    seeds = seed_spread() if seeds is None else seeds

    def sec(r: dict) -> float | None:
        return r.get("seconds_mean")

    def sec_ratio(r: dict) -> float | None:
        return sec(r) / sec(base) if sec(r) is not None and sec(base) else None

    accurate = [r for r in tdlm if r["accuracy"] >= base["accuracy"] - ACCURACY_SLACK]
    nfe_hits = [r for r in accurate if r["nfe_mean"] <= NFE_TARGET * base["nfe_mean"]]
    hits = [r for r in nfe_hits if sec_ratio(r) is not None and sec_ratio(r) <= SECONDS_TARGET]
    under = [r for r in tdlm if r["nfe_mean"] <= NFE_TARGET * base["nfe_mean"]]
    best = max(under or tdlm, key=lambda r: (r["accuracy"], -r["nfe_mean"]))
    facts = {"baseline": {"tau": 0.9, "accuracy": base["accuracy"], "nfe": base["nfe_mean"], "seconds": sec(base),
                          "seconds_se": base.get("seconds_se")},
             "tdlm": [{"tau": r["threshold"], "accuracy": r["accuracy"], "nfe": r["nfe_mean"], "seconds": sec(r),
                       "seconds_se": r.get("seconds_se"), "seconds_ratio": sec_ratio(r)} for r in tdlm],
             "target_met": bool(hits), "nfe_target_met": bool(nfe_hits),
             "targets": {"nfe_ratio_max": NFE_TARGET, "seconds_ratio_max": SECONDS_TARGET,
                         "accuracy_slack": ACCURACY_SLACK}}  # fmt: skip

    def describe(r: dict) -> str:
        q = sec_ratio(r)
        secs = "" if q is None else f", {sec(r):.3f} s per sample ({q:.2f}x its seconds)"
        return (f"tau={r['threshold']:g}: {100 * r['accuracy']:.1f}% with {r['nfe_mean']:.2f} NFE "
                f"({r['nfe_mean'] / base['nfe_mean']:.2f}x its NFE){secs}")

    ref = (f"the threshold baseline (tau=0.9) at {100 * base['accuracy']:.1f}% with {base['nfe_mean']:.2f} NFE"
           + ("" if sec(base) is None else f" and {sec(base):.3f} s per sample"))
    if hits:
        h = min(hits, key=lambda r: sec(r))
        text = f"Target met: TDLM at {describe(h)}, against {ref}."
    else:
        why = ("no TDLM setting reached its accuracy within 1 point at <= 0.8x its NFE" if not nfe_hits else
               "the NFE half holds (" + "; ".join(describe(r) for r in nfe_hits) + ") but not <= 0.85x its seconds")
        text = f"Target NOT met against {ref}: {why}. Best TDLM at <= 0.8x NFE: {describe(best)}."
    spread = seeds.get(float(best["threshold"]))
    if spread:
        lo, hi = spread["range"]
        text += (f" Training-seed spread at tau {best['threshold']:g} (bench/results/seed_variance.json, 3 seeds, "
                 f"200 problems): sd {100 * spread['sd']:.1f} points, range {100 * lo:.1f}-{100 * hi:.1f}%.")
        facts["seed_spread_at_best"] = {"tau": best["threshold"], **spread}
    return text, facts


def _half(lo: float, hi: float, bound: float, above: bool) -> str:
    """Whether a 95% interval [lo, hi] supports a target bound (the whole interval on the target's side), refutes it
    (the whole interval on the other side), or leaves it undecided."""
    inside, outside = (lo >= bound, hi < bound) if above else (hi <= bound, lo > bound)
    return "supported" if inside else "refuted" if outside else "undecided"


def evidence(runs: list[dict], tau: float = TDLM_PAIRED_TAU) -> tuple[str, dict]:
    """The target's three halves for TDLM at ``tau`` against threshold tau 0.9, judged by their paired intervals
    (``run["paired"]``, :mod:`tdlm.evaluation.paired`): accuracy within ACCURACY_SLACK (Δacc's interval above
    -1 point), <= NFE_TARGET x its NFE (the NFE ratio reference / run above 1 / NFE_TARGET), <= SECONDS_TARGET x its
    seconds (likewise). Plus TDLM against each training-free baseline: better, worse or undecided by Δacc's interval.
    ("", {}) when the runs carry no paired numbers."""
    from tdlm.evaluation.paired import paired_against, run_name
    from tdlm.evaluation.report import method_label

    tdlm = next((r for r in runs if r["policy"] == "tdlm" and r.get("threshold") == tau), None)
    p = (tdlm or {}).get("paired") or {}
    if tdlm is None or p.get("accuracy_diff_ci") is None or p.get("nfe_ratio_ci") is None:
        return "", {}
    d_lo, d_hi = (100 * v for v in p["accuracy_diff_ci"])
    halves = {"accuracy": _half(d_lo, d_hi, -100 * ACCURACY_SLACK, above=True),
              "nfe": _half(*p["nfe_ratio_ci"], 1 / NFE_TARGET, above=True)}
    parts = [f"accuracy {100 * p['accuracy_diff']:+.1f} points [{d_lo:+.1f}, {d_hi:+.1f}], so 'within "
             f"{100 * ACCURACY_SLACK:g} point' is {halves['accuracy']}",
             f"{p['nfe_ratio']:.2f}x fewer NFE [{p['nfe_ratio_ci'][0]:.2f}, {p['nfe_ratio_ci'][1]:.2f}] against the "
             f"{1 / NFE_TARGET:.2f}x that <= {NFE_TARGET:g}x its NFE needs: {halves['nfe']}"]
    if p.get("seconds_ratio_ci") is not None:
        halves["seconds"] = _half(*p["seconds_ratio_ci"], 1 / SECONDS_TARGET, above=True)
        parts.append(f"{p['seconds_ratio']:.2f}x fewer seconds [{p['seconds_ratio_ci'][0]:.2f}, "
                     f"{p['seconds_ratio_ci'][1]:.2f}] against the {1 / SECONDS_TARGET:.2f}x that <= "
                     f"{SECONDS_TARGET:g}x its seconds needs: {halves['seconds']} (an optimistic interval: the "
                     f"samples of a batch share its wall time)")
    text = (f"Evidence (paired on the same {p['n']} problems, 95% bootstrap intervals): TDLM at tau {tau:g} against "
            f"threshold tau {BASELINE_TAU:g}: " + "; ".join(parts) + ".")
    facts: dict = {"tau": tau, "halves": halves, "against_baselines": {}}
    verdicts = []
    for b in (r for r in runs if r["policy"] in REUSE_BASELINES and r.get("threshold") == BASELINE_TAU):
        q = paired_against([tdlm, b], run_name(b))[0]
        if q.get("accuracy_diff_ci") is None:
            continue
        lo, hi = (100 * v for v in q["accuracy_diff_ci"])
        call = "more accurate than" if lo > 0 else "less accurate than" if hi < 0 else "as accurate, within noise, as"
        verdicts.append(f"{call} {method_label(b)} ({100 * q['accuracy_diff']:+.1f} points [{lo:+.1f}, "
                        f"{hi:+.1f}], {q['nfe_ratio']:.2f}x fewer NFE)")
        facts["against_baselines"][b["policy"]] = {"accuracy": call, "accuracy_diff_ci": q["accuracy_diff_ci"],
                                                   "nfe_ratio": q["nfe_ratio"]}  # fmt: skip
    if verdicts:
        text += f" Against the training-free baselines, TDLM at tau {tau:g} is " + "; ".join(verdicts) + "."
    return text, facts


def _card_accuracy(card: dict) -> str:
    """The backbone card's `original` accuracies: held-out test numbers where recorded, else validation ones."""
    for key, size, split in (("test_accuracy_original", "test_size", "held-out test"),
                             ("validation_accuracy_original", "validation_size", "validation")):
        accs = card.get(key) or {}
        if accs:
            parts = [f"{100 * a:.1f}% with {k.replace('block', 'block ')}" for k, a in accs.items()]
            return ", ".join(parts) + f" ({card.get(size, '?')} {split} problems)"
    return "not recorded"


def _reproduction(runs: list[dict], card: dict, block_size: int) -> str:
    """The shipped backbone's model-card accuracy, re-measured by the evaluator when it saw the whole split."""
    orig = next((r for r in runs if r["policy"] == "original"), None)
    want = (card.get("test_accuracy_original") or {}).get(f"block{block_size}")
    if orig is None or want is None or orig["n"] != card.get("test_size"):
        return ""
    same = abs(orig["accuracy"] - want) < 1e-9
    return (f"\nReproduction: `original` decoding of all {orig['n']} held-out problems gives "
            f"{100 * orig['accuracy']:.1f}%; the model card states {100 * want:.1f}% "
            f"({'identical' if same else 'DIFFERENT'}).\n")


def standard_error(accuracy: float, n: int) -> float:
    """Binomial standard error of an accuracy measured on ``n`` problems."""
    return math.sqrt(accuracy * (1.0 - accuracy) / n) if n else float("nan")


def frontier_table(runs: list[dict]) -> str:
    """Markdown: every run as (method, tau, accuracy +- SE, mean NFE, x threshold-0.9 NFE, seconds per sample +- se,
    x threshold-0.9 seconds), by method then tau."""
    base = next((r for r in runs if r["policy"] == "threshold" and r["threshold"] == BASELINE_TAU), None)
    order = {"original": 0, "threshold": 1, "credit": 2, "soft": 3, "tdlm": 4}
    rows = sorted(runs, key=lambda r: (order.get(r["policy"], 9), -(r.get("threshold") or 1.0)))
    lines = ["| method | tau | accuracy | NFE (mean) | NFE / threshold-0.9 NFE | seconds / sample (± se) | "
             "seconds / threshold-0.9 seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = "-" if r["policy"] == "original" else f"{r['threshold']:g}"
        ratio = f"{r['nfe_mean'] / base['nfe_mean']:.2f}x" if base else "-"
        secs, sratio = "-", "-"
        if r.get("seconds_mean") is not None:
            secs = f"{r['seconds_mean']:.3f}" + (f" ± {r['seconds_se']:.3f}" if r.get("seconds_se") is not None else "")
            if base and base.get("seconds_mean"):
                sratio = f"{r['seconds_mean'] / base['seconds_mean']:.2f}x"
        lines.append(f"| {r['policy']} | {tau} | {100 * r['accuracy']:.1f} ± "
                     f"{100 * standard_error(r['accuracy'], r['n']):.1f}% | {r['nfe_mean']:.2f} | {ratio} | "
                     f"{secs} | {sratio} |")
    return "\n".join(lines)


def baseline_pairs(runs: list[dict], tau: float = TDLM_PAIRED_TAU) -> str:
    """Markdown: TDLM at ``tau`` (fast mode, without one: its largest tau) against each training-free baseline
    (credit, soft at BASELINE_TAU), paired on the same problems (:func:`tdlm.evaluation.paired.paired_against`, with
    each baseline as the reference)."""
    from tdlm.evaluation.paired import paired_against, run_name
    from tdlm.evaluation.report import method_label, paired_cells

    tdlms = sorted((r for r in runs if r["policy"] == "tdlm"), key=lambda r: (r.get("threshold") == tau,
                                                                             r.get("threshold") or 0.0))  # fmt: skip
    tdlm = tdlms[-1] if tdlms else None
    bases = [r for r in runs if r["policy"] in REUSE_BASELINES and r.get("threshold") == BASELINE_TAU]
    if tdlm is None or not bases:
        return f"No TDLM tau {tau:g} run or no training-free baseline at tau {BASELINE_TAU:g}: nothing to pair."
    lines = ["| run | reference | n | Δacc (pp) [95% CI] | McNemar p (b/c) | NFE ratio [95% CI] | s ratio [95% CI] |",
             "|---|---|---|---|---|---|---|"]
    for b in bases:
        p = paired_against([tdlm, b], run_name(b))[0]
        cells = [p["skipped"], "–", "–", "–"] if "skipped" in p else paired_cells(p)
        lines.append(f"| {method_label(tdlm)} | {method_label(b)} | {p.get('n', '–')} | {' | '.join(cells)} |")
    return ("Δacc = TDLM − baseline accuracy; ratios = baseline mean ÷ TDLM mean (> 1: TDLM needs fewer NFE / "
            "seconds); intervals and test as in the table above.\n\n" + "\n".join(lines))
