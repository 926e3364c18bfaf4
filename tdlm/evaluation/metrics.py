"""Run metrics and speedups (paper Section 3.1: "Speedup is measured against the original model of the
same backbone on the same task").

* accuracy / pass@1: correct / n from one greedy generation per problem (unparsed counts as wrong);
* mean NFE and mean generation seconds per sample (warm-up excluded by the workers), with the seconds' spread
  (sd, se = sd / sqrt(n), 10th / 90th percentiles); the evaluator times method rows interleaved, batch by batch
  in a rotated order (:func:`tdlm.evaluation.driver.shard_jobs`), so machine load lands on every row alike;
* ``speedup_vs_X = mean seconds of X / mean seconds of the run`` and ``nfe_ratio_vs_X = mean NFE of X /
  mean NFE of the run`` (both > 1 when the run is faster / uses fewer evaluations), where X is

  - ``original``: the run with policy original, without a spatial KV cache, on the same backbone, task,
    gen length and block size;
  - ``threshold``: the threshold (Fast-dLLM) run at ``reference_tau`` (0.9, the released setting the
    paper compares with) on the same key; if that tau was not run, the threshold run with the run's own
    tau. Its tau is recorded as ``threshold_baseline_tau``. A run with a spatial KV cache is compared with
    the threshold run with the same cache when there is one (TDLM + dual cache vs Fast-dLLM + dual
    cache), else with the uncached one.

A baseline run twice in one key (two folders combined, each with ``threshold-tau0.9``) is no baseline: the ratios
against it are None rather than against whichever came first (the paired rows refuse the same group in a footnote,
:func:`tdlm.evaluation.paired.paired_against`).

Speedups are recomputed from the per-run summaries whenever runs are combined (``eval/compare.py``),
so runs from different output dirs compare as long as they share the key.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence

SPEEDUP_FIELDS = ("speedup_vs_original", "nfe_ratio_vs_original", "speedup_vs_threshold",
                  "nfe_ratio_vs_threshold", "threshold_baseline_tau")  # fmt: skip


def aggregate(samples: Sequence[dict]) -> dict:
    """Accuracy, NFE and seconds statistics of one run's scored samples."""
    n = len(samples)
    if n == 0:
        return {"n": 0, "correct": 0, "accuracy": None, "nfe_mean": None, "seconds_mean": None,
                "seconds_median": None, "seconds_total": 0.0, "status_counts": {}}  # fmt: skip
    correct = sum(bool(s["correct"]) for s in samples)
    secs = [float(s["seconds"]) for s in samples]
    nfes = [float(s["nfe"]) for s in samples]
    return {
        "n": n,
        "correct": correct,
        "accuracy": correct / n,
        "nfe_mean": statistics.fmean(nfes),
        "nfe_median": statistics.median(nfes),
        "seconds_mean": statistics.fmean(secs),
        "seconds_median": statistics.median(secs),
        # spread of the per-sample seconds (samples of one batch share its wall time, so se is optimistic)
        "seconds_sd": statistics.stdev(secs) if n > 1 else 0.0,
        "seconds_se": statistics.stdev(secs) / math.sqrt(n) if n > 1 else 0.0,
        "seconds_p10": _quantile(secs, 0.1),
        "seconds_p90": _quantile(secs, 0.9),
        "seconds_total": math.fsum(secs),
        "status_counts": dict(sorted(Counter(s.get("status", "?") for s in samples).items())),
    }


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of ``xs`` (linear interpolation between order statistics)."""
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def ratio(baseline: float | None, value: float | None) -> float | None:
    """``baseline / value`` (how many times smaller ``value`` is); None when undefined."""
    if baseline is None or value is None or value <= 0:
        return None
    return baseline / value


def _cache(run: dict) -> str:
    return run.get("cache") or "none"


def comparison_key(run: dict) -> tuple:
    """Runs comparable for speedups: same backbone, task, budget and block size."""
    return (run.get("backbone_id") or run.get("backbone"), run["task"], run["gen_length"], run["block_size"])


def compute_speedups(runs: list[dict], reference_tau: float = 0.9) -> list[dict]:
    """Fill :data:`SPEEDUP_FIELDS` of every run dict in place (see module docstring); returns ``runs``."""
    by_key: dict[tuple, list[dict]] = {}
    for r in runs:
        by_key.setdefault(comparison_key(r), []).append(r)
    for group in by_key.values():
        originals = [r for r in group if r["policy"] == "original" and _cache(r) == "none"]
        original = originals[0] if len(originals) == 1 else None  # two: which one is the baseline is unknown
        seen: dict[tuple, list[dict]] = {}
        for r in group:
            if r["policy"] == "threshold":
                seen.setdefault((float(r["threshold"]), _cache(r)), []).append(r)
        for r in group:
            base = None
            taus = [float(reference_tau)] + ([float(r["threshold"])] if r.get("threshold") is not None else [])
            # the first baseline that was run, in order of preference; one run twice ends the search with none
            found = next((seen[k] for cache in dict.fromkeys((_cache(r), "none")) for tau in taus
                          if (k := (tau, cache)) in seen), [])  # fmt: skip
            base = found[0] if len(found) == 1 else None
            r["speedup_vs_original"] = ratio(original and original["seconds_mean"], r["seconds_mean"])
            r["nfe_ratio_vs_original"] = ratio(original and original["nfe_mean"], r["nfe_mean"])
            r["speedup_vs_threshold"] = ratio(base and base["seconds_mean"], r["seconds_mean"])
            r["nfe_ratio_vs_threshold"] = ratio(base and base["nfe_mean"], r["nfe_mean"])
            r["threshold_baseline_tau"] = None if base is None else float(base["threshold"])
    return runs
