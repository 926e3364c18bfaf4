"""Paired comparison of two runs on the same problems: accuracy difference, exact McNemar test, NFE and seconds
ratios, each with a paired-bootstrap interval over problems.

Two runs are paired **by sample id**, never by position (shard files and ``samples.jsonl`` of different runs need not
list the problems in the same order), and only when they decoded the same problems: the same task, the same split
(``task_source``) and the same set of ids. :func:`pair` refuses anything else with one line; a caller that wants
the intersection of two id sets (a ``--limit 100`` run against a full reference) passes ``allow_subset=True`` and the
result records how many problems were left out (``unpaired_run`` / ``unpaired_reference``). The tables
(:mod:`tdlm.evaluation.report`) stay strict, so a row's paired numbers are always over the row's own problems.

Statistics of a run R against a reference F, over the n paired problems (:func:`compare`):

* ``accuracy_diff`` = acc(R) - acc(F), with a percentile interval from the paired bootstrap;
* ``mcnemar_p``: the exact two-sided McNemar test, a binomial test of the discordant problems
  (b = only R right, c = only F right) against Binomial(b + c, 1/2): p = min(1, 2 P(X <= min(b, c)));
* ``nfe_ratio`` / ``seconds_ratio`` = mean(F) / mean(R), the convention of
  :func:`tdlm.evaluation.metrics.ratio` (> 1: the run needs fewer NFE / seconds), each with a paired-bootstrap
  interval of the ratio of the resampled means.

The bootstrap draws problems with replacement, the same draw for all three statistics (so they stay paired with
each other too), :data:`RESAMPLES` times from a generator seeded with :data:`SEED`; both are recorded in every
result. The problems are put in id order before drawing, so the numbers do not depend on the order of either
run's records. Samples of one batch share its wall time, so the seconds interval is optimistic (the same caveat as
``seconds_se`` in :mod:`tdlm.evaluation.metrics`).

Two *allocations*, each trained with several seeds and decoded on the same problems (a sweep with ``seeds``), are
compared by :func:`compare_seeds` / :func:`two_level_bootstrap`: the difference of the seed-averaged accuracies with
a two-level percentile bootstrap interval (each side's seeds resampled on its own, the problems resampled once for
both), marked as evidence only when the interval excludes zero. With one seed per side it is :func:`compare`'s
accuracy interval exactly.

:func:`attach_paired` fills ``run["paired"]`` of every run dict against a reference run chosen by name (the run
folder name, :attr:`tdlm.evaluation.config.RunSpec.name`; default :data:`DEFAULT_REFERENCE`) within each group of
:func:`tdlm.evaluation.metrics.comparison_key` (same backbone, task, budget and block size).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tdlm.errors import TDLMError
from tdlm.evaluation.metrics import comparison_key

SEED = 0  # bootstrap generator seed (numpy default_rng); recorded in every result
RESAMPLES = 2000  # bootstrap resamples; recorded in every result
CONFIDENCE = 0.95  # two-sided percentile interval
DEFAULT_REFERENCE = "threshold-tau0.9"  # Fast-dLLM's threshold rule at its released tau (metrics' reference_tau)
SAMPLES_FILE = "samples.jsonl"  # a run folder's scored samples (tdlm.evaluation.driver.SAMPLES)


class PairingError(TDLMError):
    """Two runs that cannot be paired (other task or split, other ids, a repeated id, a record without a field)."""


@dataclass(frozen=True)
class PairedResult:
    """A run against a reference on ``n`` shared problems (module docstring for the definitions)."""

    n: int
    accuracy_diff: float
    accuracy_diff_ci: tuple[float, float]
    run_only_correct: int  # McNemar's b
    reference_only_correct: int  # McNemar's c
    mcnemar_p: float
    nfe_ratio: float | None
    nfe_ratio_ci: tuple[float, float] | None
    seconds_ratio: float | None
    seconds_ratio_ci: tuple[float, float] | None
    seed: int = SEED
    resamples: int = RESAMPLES
    confidence: float = CONFIDENCE
    unpaired_run: int = 0  # ids only in the run (left out; only with allow_subset)
    unpaired_reference: int = 0  # ids only in the reference

    def to_dict(self) -> dict:
        """JSON-ready: intervals as [low, high] lists, plus how they were computed."""
        d = asdict(self)
        for k in ("accuracy_diff_ci", "nfe_ratio_ci", "seconds_ratio_ci"):
            d[k] = None if d[k] is None else [float(v) for v in d[k]]
        d["interval"] = "percentile paired bootstrap over problems"
        d["mcnemar"] = "exact two-sided binomial test of the discordant problems"
        return d


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value of ``b`` and ``c`` discordant pairs: min(1, 2 P(X <= min(b, c))) with
    X ~ Binomial(b + c, 1/2); 1.0 when there is no discordant pair.

    Written here rather than taken from ``scipy.stats.binomtest``: scipy is not a dependency of tdlm, and with
    p = 1/2 the test is a sum of binomial coefficients, exact in integers (``math.comb``) up to the final division.
    """
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0; got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)  # int / int: Python rounds the exact quotient once, even for n in the thousands


def _by_id(records: Sequence[dict], who: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for rec in records:
        rid = rec.get("id")
        if rid is None:
            raise PairingError(f"{who}: a sample record without an 'id'; cannot pair by problem")
        if rid in out:
            raise PairingError(f"{who}: sample id {rid!r} appears twice; cannot pair by problem")
        out[rid] = rec
    return out


def _examples(ids: set[str]) -> str:
    first = sorted(ids)[:3]
    return ", ".join(first) + (f" (+{len(ids) - 3} more)" if len(ids) > 3 else "")


Pairs = list[tuple[dict, dict]]  # (run record, reference record) per shared problem


def pair(run: Sequence[dict], reference: Sequence[dict], *, allow_subset: bool = False,
         run_label: str = "run", reference_label: str = "reference") -> tuple[Pairs, int, int]:  # fmt: skip
    """``(pairs in id order, ids only in run, ids only in reference)``: the two runs' records matched by ``id``.

    Different id sets are refused (PairingError, one line) unless ``allow_subset``; then the intersection is paired
    and the counts left out are returned. No shared id at all is refused either way.
    """
    a, b = _by_id(run, run_label), _by_id(reference, reference_label)
    only_a, only_b = set(a) - set(b), set(b) - set(a)
    shared = sorted(set(a) & set(b))
    if not shared:
        raise PairingError(f"{run_label} and {reference_label} share no sample id "
                           f"({len(a)} and {len(b)} samples); not the same problems")  # fmt: skip
    if (only_a or only_b) and not allow_subset:
        parts = [f"{len(x)} only in {who} ({_examples(x)})" for x, who in ((only_a, run_label), (only_b,
                 reference_label)) if x]  # fmt: skip
        raise PairingError(f"{run_label} and {reference_label} decoded different problems: {'; '.join(parts)}; "
                           f"{len(shared)} shared")  # fmt: skip
    return [(a[i], b[i]) for i in shared], len(only_a), len(only_b)


def _column(pairs: Pairs, side: int, key: str) -> np.ndarray | None:
    """``key`` of one side as floats; None when any record lacks it (e.g. summaries without seconds)."""
    vals = [p[side].get(key) for p in pairs]
    if any(v is None for v in vals):
        return None
    return np.asarray(vals, dtype=np.float64)


def _interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2
    lo, hi = np.quantile(values, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def _ratio(ref: np.ndarray | None, run: np.ndarray | None, idx: np.ndarray,
           confidence: float) -> tuple[float | None, tuple[float, float] | None]:  # fmt: skip
    """mean(ref) / mean(run) and its interval over the resamples ``idx``; (None, None) when a mean can be <= 0."""
    if ref is None or run is None or run.mean() <= 0 or ref.mean() < 0:
        return None, None
    num, den = ref[idx].mean(axis=1), run[idx].mean(axis=1)
    if (den <= 0).any():  # a resample of all-zero seconds: the ratio is undefined, so is its interval
        return float(ref.mean() / run.mean()), None
    return float(ref.mean() / run.mean()), _interval(num / den, confidence)


def compare(run: Sequence[dict], reference: Sequence[dict], *, allow_subset: bool = False, seed: int = SEED,
            resamples: int = RESAMPLES, confidence: float = CONFIDENCE, run_label: str = "run",
            reference_label: str = "reference") -> PairedResult:  # fmt: skip
    """Paired statistics of ``run`` against ``reference`` (scored sample records: ``id``, ``correct``, ``nfe``,
    ``seconds``); see the module docstring. Deterministic: the same records give the same result."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1; got {resamples}")
    pairs, only_run, only_ref = pair(run, reference, allow_subset=allow_subset, run_label=run_label,
                                     reference_label=reference_label)  # fmt: skip
    for side, who in ((0, run_label), (1, reference_label)):
        missing = next((p[side]["id"] for p in pairs if "correct" not in p[side]), None)
        if missing is not None:
            raise PairingError(f"{who}: sample {missing!r} has no 'correct' field (not scored yet)")
    run_c = np.asarray([bool(p[0]["correct"]) for p in pairs], dtype=np.float64)
    ref_c = np.asarray([bool(p[1]["correct"]) for p in pairs], dtype=np.float64)
    n = len(pairs)
    # One draw of problem indices for every statistic: a (resamples, n) matrix, a few MB for GSM8K's 1,319.
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    diff = run_c - ref_c
    nfe_ratio, nfe_ci = _ratio(_column(pairs, 1, "nfe"), _column(pairs, 0, "nfe"), idx, confidence)
    sec_ratio, sec_ci = _ratio(_column(pairs, 1, "seconds"), _column(pairs, 0, "seconds"), idx, confidence)
    return PairedResult(
        n=n, accuracy_diff=float(diff.mean()), accuracy_diff_ci=_interval(diff[idx].mean(axis=1), confidence),
        run_only_correct=int((diff > 0).sum()), reference_only_correct=int((diff < 0).sum()),
        mcnemar_p=mcnemar_exact(int((diff > 0).sum()), int((diff < 0).sum())),
        nfe_ratio=nfe_ratio, nfe_ratio_ci=nfe_ci, seconds_ratio=sec_ratio, seconds_ratio_ci=sec_ci,
        seed=seed, resamples=resamples, confidence=confidence, unpaired_run=only_run, unpaired_reference=only_ref,
    )  # fmt: skip


# -- several training seeds per side: the two-level bootstrap ---------------------------------------------------
SEEDS_INTERVAL = ("percentile two-level bootstrap: training seeds resampled on each side independently, then "
                  "problems resampled once for both sides (paired)")  # fmt: skip


@dataclass(frozen=True)
class SeedPairedResult:
    """Two allocations, each trained with several seeds and decoded on the same ``n`` problems
    (:func:`two_level_bootstrap` for the definition). ``evidence``: the interval excludes zero."""

    n: int
    run_seeds: int
    reference_seeds: int
    accuracy_diff: float  # mean over the run's seeds and problems minus the reference's
    accuracy_diff_ci: tuple[float, float]
    evidence: bool
    seed: int = SEED
    resamples: int = RESAMPLES
    confidence: float = CONFIDENCE

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accuracy_diff_ci"] = [float(v) for v in self.accuracy_diff_ci]
        d["interval"] = SEEDS_INTERVAL
        d["evidence_rule"] = f"the {100 * self.confidence:g}% interval excludes 0"
        return d


def two_level_bootstrap(run: np.ndarray, reference: np.ndarray, *, seed: int = SEED, resamples: int = RESAMPLES,
                        confidence: float = CONFIDENCE) -> tuple[float, tuple[float, float]]:  # fmt: skip
    """Accuracy difference of two allocations with a two-level percentile bootstrap interval.

    ``run`` (S_r x n) and ``reference`` (S_f x n) hold 0/1 correctness, one row per training seed, one column per
    problem, the columns of both in the same problem order. The difference is mean(run) - mean(reference), each
    the mean over its seeds of the seed's accuracy. Each of ``resamples`` draws:

    1. problems: n indices with replacement, **one draw for both sides** (the problems are shared, so the comparison
       stays paired by problem, as :func:`compare`);
    2. seeds: S_r indices into the run's seeds and S_f into the reference's, with replacement, **each side on its
       own**: seed k of one allocation and seed k of another are separate trainings (other parameters, other
       shapes) with nothing in common but the number, so pairing them by number would be arbitrary. A consequence:
       an allocation compared with itself gets a zero difference but an interval as wide as its seed-to-seed
       spread, which is what a second, independent set of trainings of it could show;
    3. the difference of the two means over the drawn seeds and problems.

    The interval is the (1 - confidence)/2 and (1 + confidence)/2 quantiles of those differences. The generator is
    ``numpy.random.default_rng(seed)``, the problem indices drawn first with the same call as :func:`compare`, so with
    one seed on each side the result equals :func:`compare`'s ``accuracy_diff`` and ``accuracy_diff_ci`` exactly
    (the paired bootstrap over problems), bit for bit.
    """
    a, b = np.asarray(run, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or 0 in (*a.shape, *b.shape):
        raise ValueError(f"expected (seeds, problems) arrays with the same problems; got {a.shape} and {b.shape}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1; got {resamples}")
    n = a.shape[1]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))  # 1: problems, shared by both sides (compare()'s draw)
    rows = np.arange(resamples)[:, None]

    def seed_means(m: np.ndarray) -> np.ndarray:
        """(resamples, n): each problem's correctness averaged over a resample of the seeds (2), as counts of the
        drawn seeds times the rows, divided once (exact: identical seeds give their own row back)."""
        k = m.shape[0]
        counts = np.zeros((resamples, k))
        np.add.at(counts, (rows, rng.integers(0, k, size=(resamples, k))), 1.0)
        return (counts @ m) / k

    per_problem = seed_means(a) - seed_means(b)
    diffs = np.take_along_axis(per_problem, idx, axis=1).mean(axis=1)  # 3
    point = float((a.mean(axis=0) - b.mean(axis=0)).mean())
    return point, _interval(diffs, confidence)


def _seed_matrix(seeds: Sequence[Sequence[dict]], who: str, ids: list[str] | None) -> tuple[np.ndarray, list[str]]:
    """(seeds x problems) correctness of one side, columns in id order; every seed must have decoded ``ids``
    (the first seed's ids when None)."""
    if not seeds:
        raise PairingError(f"{who}: no seed with per-sample records")
    rows = []
    for k, records in enumerate(seeds):
        label = f"{who} (seed run {k + 1} of {len(seeds)})"
        by_id = _by_id(records, label)
        if ids is None:
            ids = sorted(by_id)
        if set(by_id) != set(ids):  # pair() names the ids found on one side only
            pair(records, [{"id": i} for i in ids], run_label=label, reference_label="the first seed run")
            raise PairingError(f"{label} decoded other problems than the first seed run")
        missing = next((i for i in ids if "correct" not in by_id[i]), None)
        if missing is not None:
            raise PairingError(f"{label}: sample {missing!r} has no 'correct' field (not scored yet)")
        rows.append([bool(by_id[i]["correct"]) for i in ids])
    return np.asarray(rows, dtype=np.float64), ids


def compare_seeds(run: Sequence[Sequence[dict]], reference: Sequence[Sequence[dict]], *, seed: int = SEED,
                  resamples: int = RESAMPLES, confidence: float = CONFIDENCE, run_label: str = "run",
                  reference_label: str = "reference") -> SeedPairedResult:  # fmt: skip
    """:func:`two_level_bootstrap` of scored sample records: ``run`` and ``reference`` are lists with one list of
    records (``id``, ``correct``) per training seed. Every seed of both sides must have decoded the same problems
    (PairingError, one line, otherwise); records are matched by id, never by position."""
    a, ids = _seed_matrix(run, run_label, None)
    b, _ = _seed_matrix(reference, reference_label, ids)
    point, ci = two_level_bootstrap(a, b, seed=seed, resamples=resamples, confidence=confidence)
    return SeedPairedResult(n=len(ids), run_seeds=a.shape[0], reference_seeds=b.shape[0], accuracy_diff=point,
                            accuracy_diff_ci=ci, evidence=bool(ci[0] > 0 or ci[1] < 0), seed=seed,
                            resamples=resamples, confidence=confidence)  # fmt: skip


def samples_of(run: dict) -> Sequence[dict]:
    """A run dict's scored per-sample records (its ``samples.jsonl``); PairingError when there are none."""
    return _samples_of(run, None)


# -- run dicts (summaries) ------------------------------------------------------------------------------------
def run_name(run: dict) -> str:
    """A run's folder name (``threshold-tau0.9``, ``tdlm-d16-tau0.9-full-dual``): its summary's ``name``, or the
    name :class:`~tdlm.evaluation.config.RunSpec` gives its fields (summaries built by hand, tests)."""
    if run.get("name"):
        return str(run["name"])
    from tdlm.evaluation.config import RunSpec

    return RunSpec(task=run["task"], policy=run["policy"], threshold=run.get("threshold"),
                   entropy_threshold=run.get("entropy_threshold"), adapter_label=run.get("adapter_label"),
                   history=run.get("history"), cache=run.get("cache") or "none").name  # fmt: skip


def samples_path(run: dict) -> Path | None:
    """The run's ``samples.jsonl``: in its ``run_dir``, else next to the summary it was read from
    (``summary_file``, set by :func:`tdlm.evaluation.report.load_runs`; an output dir copied off the cluster keeps
    the cluster's absolute run_dir). None when neither exists."""
    candidates = []
    if run.get("run_dir"):
        candidates.append(Path(run["run_dir"]) / SAMPLES_FILE)
    if run.get("summary_file"):
        f = Path(run["summary_file"])
        candidates += [f.parent / SAMPLES_FILE, f.parent / "runs" / run["task"] / run_name(run) / SAMPLES_FILE]
    return next((p for p in candidates if p.is_file()), None)


def _split(run: dict) -> str | None:
    """The data a run read, comparable across machines: the sha256 of a local file, the Hub id/config/split."""
    src = run.get("task_source")
    if not src:
        return None
    return src.split("sha256=", 1)[1] if "sha256=" in src else src


def _samples_of(run: dict, samples: Mapping[str, Sequence[dict]] | None) -> Sequence[dict]:
    if samples is not None and run.get("run_dir") in samples:
        return samples[run["run_dir"]]
    path = samples_path(run)
    if path is None:
        where = run.get("run_dir") or run.get("summary_file") or "its summary"
        raise PairingError(f"no per-sample records ({SAMPLES_FILE}) for {run_name(run)} at {where}")
    from tdlm.evaluation.records import read_records

    return read_records(path)


def _group_label(run: dict) -> str:
    backbone, task, gen, block = comparison_key(run)
    return f"{task}, {backbone}, N={gen}, block {block}"


def paired_against(runs: Sequence[dict], reference: str = DEFAULT_REFERENCE,
                   samples: Mapping[str, Sequence[dict]] | None = None) -> list[dict]:  # fmt: skip
    """One dict per run, in ``runs`` order: the paired comparison with the run named ``reference`` of its group
    (module docstring). Each holds ``reference`` (the name) and either the statistics
    (:meth:`PairedResult.to_dict` plus ``reference_run_dir``), ``is_reference: True``, or ``skipped``: one line
    saying why there are no numbers (no reference run in the group, two candidates, other problems, no samples).

    ``samples`` maps run_dir to scored records (the driver has them in memory); other runs' records are read from
    their ``samples.jsonl`` (:func:`samples_path`).
    """
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(comparison_key(r), []).append(i)
    out: list[dict] = [{} for _ in runs]
    for members in groups.values():
        refs = [i for i in members if run_name(runs[i]) == reference]
        label = _group_label(runs[members[0]])
        for i in members:
            r = runs[i]
            entry: dict = {"reference": reference}
            if not refs:
                entry["skipped"] = f"no {reference} run for {label}"
            elif len(refs) > 1:
                dirs = ", ".join(str(runs[j].get("run_dir")) for j in refs)
                entry["skipped"] = f"{len(refs)} runs named {reference} for {label} ({dirs}); pass one folder"
            elif i == refs[0]:
                entry["is_reference"] = True
            else:
                ref = runs[refs[0]]
                try:
                    if _split(r) != _split(ref):
                        raise PairingError(f"other data: {r.get('task_source')} vs the reference's "
                                           f"{ref.get('task_source')}")  # fmt: skip
                    res = compare(_samples_of(r, samples), _samples_of(ref, samples), run_label=run_name(r),
                                  reference_label=reference)  # fmt: skip
                    entry.update(res.to_dict(), reference_run_dir=ref.get("run_dir"))
                except (PairingError, OSError) as e:  # one row without numbers, not a failed table
                    entry["skipped"] = str(e) if isinstance(e, PairingError) else f"{e.filename}: {e.strerror}"
                except TDLMError as e:  # a malformed samples.jsonl (records.read_records)
                    entry["skipped"] = str(e)
            out[i] = entry
    return out


def attach_paired(runs: list[dict], reference: str = DEFAULT_REFERENCE,
                  samples: Mapping[str, Sequence[dict]] | None = None) -> list[dict]:  # fmt: skip
    """Set ``run["paired"]`` of every run dict (:func:`paired_against`) in place, as
    :func:`tdlm.evaluation.metrics.compute_speedups` does for the speedups; returns ``runs``."""
    for r, p in zip(runs, paired_against(runs, reference, samples), strict=True):
        r["paired"] = p
    return runs


def settings(reference: str = DEFAULT_REFERENCE) -> dict:
    """What a job's summary records about its paired comparisons."""
    return {"reference": reference, "seed": SEED, "resamples": RESAMPLES, "confidence": CONFIDENCE,
            "interval": "percentile paired bootstrap over problems",
            "mcnemar": "exact two-sided binomial test of the discordant problems",
            "ratios": "reference mean / run mean (> 1: the run needs fewer)"}  # fmt: skip


def wandb_metrics(run: dict) -> dict[str, float]:
    """Flat numeric fields of ``run["paired"]`` for a W&B summary (``paired/accuracy_diff``, ``.../low``, ...)."""
    p = run.get("paired") or {}
    out: dict[str, float] = {}
    if "n" not in p:
        return out
    for key in ("accuracy_diff", "mcnemar_p", "nfe_ratio", "seconds_ratio", "n", "run_only_correct",
                "reference_only_correct", "seed", "resamples"):  # fmt: skip
        if p.get(key) is not None:
            out[f"paired/{key}"] = p[key]
    for key in ("accuracy_diff_ci", "nfe_ratio_ci", "seconds_ratio_ci"):
        if p.get(key) is not None:
            out[f"paired/{key}_low"], out[f"paired/{key}_high"] = p[key]
    return out


__all__ = ["CONFIDENCE", "DEFAULT_REFERENCE", "RESAMPLES", "SEED", "SEEDS_INTERVAL", "PairedResult", "PairingError",
           "SeedPairedResult", "attach_paired", "compare", "compare_seeds", "mcnemar_exact", "pair", "paired_against",
           "run_name", "samples_of", "samples_path", "settings", "two_level_bootstrap", "wandb_metrics"]  # fmt: skip
