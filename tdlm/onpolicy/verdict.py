"""The on-policy verdict: arms x training seeds against each other and against training-free references, with
two-level bootstrap intervals (:func:`tdlm.evaluation.paired.compare_seeds`: problems drawn once for both sides,
each side's seeds on its own), and the issue's targets, each with its interval and whether it is met.

Input: one evaluation folder (``eval/run.py``) holding every arm's adapters as ``<arm>-s<seed>`` labels at one tau and
the references (``threshold`` and ``credit`` at tau 0.9), decoded on the same problems.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tdlm.evaluation.paired import compare_seeds, samples_of

ARMS = ("off-policy", "more-data", "on-policy", "current-only")
NFE_RATIO = 0.8  # on-policy against threshold: at <= 0.8x its NFE ...
ACC_FLOOR = -0.01  # ... with the accuracy interval's lower bound at or above -1 point
SEED_SD = 0.015  # training-seed sd of accuracy at the demo's tau: at most 1.5 points


def load_runs(eval_dir: str | Path) -> list[dict]:
    summary = json.loads((Path(eval_dir) / "summary.json").read_text())
    runs = summary["runs"]
    for r in runs:
        r.setdefault("summary_file", str(Path(eval_dir) / "summary.json"))
    return runs


def _arm_runs(runs: list[dict], arm: str, seeds: list[int], tau: float) -> list[dict]:
    out = []
    for s in seeds:
        label = f"{arm}-s{s}"
        got = [r for r in runs if r["policy"] == "tdlm" and r.get("adapter_label") == label
               and abs(r["threshold"] - tau) < 1e-9]  # fmt: skip
        if len(got) != 1:
            raise ValueError(f"evaluation: {len(got)} runs of adapter {label!r} at tau {tau}")
        out.append(got[0])
    return out


def _ref(runs: list[dict], policy: str, tau: float) -> dict:
    got = [r for r in runs if r["policy"] == policy and abs(r["threshold"] - tau) < 1e-9]
    if len(got) != 1:
        raise ValueError(f"evaluation: {len(got)} {policy} runs at tau {tau}")
    return got[0]


def arm_row(arm_runs: list[dict]) -> dict:
    acc = [r["accuracy"] for r in arm_runs]
    nfe = [r["nfe_mean"] for r in arm_runs]
    return {"accuracy_per_seed": acc, "accuracy_mean": statistics.fmean(acc),
            "accuracy_sd_over_seeds": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "nfe_per_seed": nfe, "nfe_mean": statistics.fmean(nfe), "n": arm_runs[0]["n"]}  # fmt: skip


def diff(run: list[dict], ref: list[dict], run_label: str, ref_label: str) -> dict:
    res = compare_seeds([samples_of(r) for r in run], [samples_of(r) for r in ref], run_label=run_label,
                        reference_label=ref_label)  # fmt: skip
    return {"accuracy_diff": res.accuracy_diff, "interval": list(res.accuracy_diff_ci), "evidence": res.evidence,
            "n": res.n, "run_seeds": res.run_seeds, "reference_seeds": res.reference_seeds}  # fmt: skip


def verdict(eval_dir: str | Path, seeds: list[int], tau: float, ref_tau: float) -> dict:
    """Arms, pairwise differences and the targets from one evaluation folder."""
    runs = load_runs(eval_dir)
    arms = {a: _arm_runs(runs, a, seeds, tau) for a in ARMS}
    thr, cred = _ref(runs, "threshold", ref_tau), _ref(runs, "credit", ref_tau)
    table = {a: arm_row(rs) for a, rs in arms.items()}
    table[f"threshold tau {ref_tau:g}"] = arm_row([thr])
    table[f"credit tau {ref_tau:g}"] = arm_row([cred])
    on = arms["on-policy"]
    diffs = {
        "on-policy - credit": diff(on, [cred], "on-policy", "credit"),
        "on-policy - threshold": diff(on, [thr], "on-policy", "threshold"),
        "on-policy - more-data": diff(on, arms["more-data"], "on-policy", "more-data"),
        "on-policy - off-policy": diff(on, arms["off-policy"], "on-policy", "off-policy"),
        "on-policy - current-only": diff(on, arms["current-only"], "on-policy", "current-only"),
        "more-data - off-policy": diff(arms["more-data"], arms["off-policy"], "more-data", "off-policy"),
        "off-policy - credit": diff(arms["off-policy"], [cred], "off-policy", "credit"),
    }
    on_nfe = table["on-policy"]["nfe_mean"]
    nfe_vs_thr = on_nfe / thr["nfe_mean"]
    nfe_vs_cred = on_nfe / cred["nfe_mean"]
    d_cred, d_more, d_cur, d_thr = (diffs[k] for k in ("on-policy - credit", "on-policy - more-data",
                                                       "on-policy - current-only", "on-policy - threshold"))
    sd = table["on-policy"]["accuracy_sd_over_seeds"]
    targets = {
        "on-policy beats credit tau 0.9 at no more NFE": {
            "interval": d_cred["interval"], "nfe_ratio": nfe_vs_cred,
            "met": bool(d_cred["interval"][0] > 0 and nfe_vs_cred <= 1.0)},
        "on-policy beats the more-data control": {"interval": d_more["interval"],
                                                  "met": bool(d_more["interval"][0] > 0)},
        "full history beats current-only": {"interval": d_cur["interval"], "met": bool(d_cur["interval"][0] > 0)},
        "on-policy vs threshold tau 0.9: lower bound >= -1 point at <= 0.8x its NFE": {
            "interval": d_thr["interval"], "nfe_ratio": nfe_vs_thr,
            "met": bool(d_thr["interval"][0] >= ACC_FLOOR and nfe_vs_thr <= NFE_RATIO)},
        "training-seed sd at the demo's tau <= 1.5 points": {
            "sd": sd, "per_seed": table["on-policy"]["accuracy_per_seed"], "met": bool(sd <= SEED_SD)},
    }
    return {"tau": tau, "reference_tau": ref_tau, "seeds": seeds, "arms": table, "differences": diffs,
            "targets": targets}  # fmt: skip


def markdown(result: dict) -> str:
    """The arms table and the targets as Markdown (docs/training.md is generated from bench/results/onpolicy.json)."""
    lines = [f"| arm (tdlm tau {result['tau']:g}) | accuracy, mean ± sd over seeds | per seed | NFE |",
             "|---|---|---|---|"]
    for name, r in result["arms"].items():
        per = " / ".join(f"{100 * a:.1f}" for a in r["accuracy_per_seed"])
        mean, sd = 100 * r["accuracy_mean"], 100 * r["accuracy_sd_over_seeds"]
        lines.append(f"| {name} | {mean:.1f}% ± {sd:.1f} | {per} | {r['nfe_mean']:.2f} |")
    lines += ["", "| difference (points) | point | 95% two-level interval |", "|---|---|---|"]
    for name, d in result["differences"].items():
        lo, hi = d["interval"]
        lines.append(f"| {name} | {100 * d['accuracy_diff']:+.1f} | [{100 * lo:+.1f}, {100 * hi:+.1f}] |")
    lines += ["", "| target | interval / value | met |", "|---|---|---|"]
    for name, t in result["targets"].items():
        if "interval" in t:
            lo, hi = t["interval"]
            val = f"[{100 * lo:+.1f}, {100 * hi:+.1f}] points"
            if "nfe_ratio" in t:
                val += f", NFE ratio {t['nfe_ratio']:.2f}"
        else:
            val = f"sd {100 * t['sd']:.1f} points"
        lines.append(f"| {name} | {val} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)
