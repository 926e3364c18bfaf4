"""Sharded evaluation of backbones and TDLM adapters on GSM8K, MATH-500 and MBPP (paper Section 3).

Accuracy / pass@1, mean NFE, mean generation seconds and speedups over the original model and over
threshold (Fast-dLLM) decoding, per run of a grid of (task, policy, tau / H, adapter, history); the
paper's Table 1 / 2 / 4 shaped Markdown tables and the Figure 1 Pareto plot. Entry points:
``eval/run.py`` (decode + score + report) and ``eval/compare.py`` (tables from saved summaries).

Modules: :mod:`~tdlm.evaluation.config` (schema + grid), :mod:`~tdlm.evaluation.records` (shard files,
resume, completeness), :mod:`~tdlm.evaluation.worker` (a backbone replica), :mod:`~tdlm.evaluation.driver`
(the job; its Ray actors run on :class:`tdlm.data.ray_pool.ActorPool`), :mod:`~tdlm.evaluation.summaries` (per-run
summaries and W&B runs), :mod:`~tdlm.evaluation.metrics`, :mod:`~tdlm.evaluation.report`, :mod:`~tdlm.evaluation.plot`.
"""

from tdlm.evaluation.config import EvalConfig, RunSpec, expand
from tdlm.evaluation.driver import EvalResult, evaluate
from tdlm.evaluation.metrics import aggregate, compute_speedups
from tdlm.evaluation.plot import pareto_front, plot_all, plot_pareto
from tdlm.evaluation.records import IncompleteResults, merge
from tdlm.evaluation.report import load_runs, render

__all__ = [
    "EvalConfig",
    "EvalResult",
    "IncompleteResults",
    "RunSpec",
    "aggregate",
    "compute_speedups",
    "evaluate",
    "expand",
    "load_runs",
    "merge",
    "pareto_front",
    "plot_all",
    "plot_pareto",
    "render",
]
