"""Datasets and scoring of the shipped lm-evaluation-harness tasks (``tdlm_gsm8k``, ``tdlm_math500``, ``tdlm_mbpp``,
``tdlm_arith``, ``tdlm_multi``): the problems come from :func:`tdlm.tasks.load_task`, so the harness reads the same
local benchmark copies (``data_dir`` from ``--metadata '{"data_dir": ...}'``, else ``$TDLM_DATA_DIR``, else
``data/benchmarks``; never the network) with the same prompts (``gsm8k-v1`` ...) and record-count checks as
``eval/run.py``, and a completion is scored by :func:`tdlm.evaluation.scoring.score` (Math-Verify gold first; MBPP
in the sandbox), so a number from the harness and one from ``eval/run.py`` mean the same thing. MBPP fails closed
here as everywhere: on a machine where the sandbox lacks a guarantee, the first code sample raises the sandbox's
one-line refusal (what the kernel refused, how to get it) and no sample runs; the harness has no weak mode."""

from __future__ import annotations

import os

import datasets


def _dataset(task: str, data_dir: str | None) -> datasets.DatasetDict:
    from tdlm.tasks import load_task

    if data_dir is None and not os.environ.get("TDLM_DATA_DIR"):
        from tdlm.tasks.base import default_data_dir

        data_dir = str(default_data_dir())  # the pinned local copies: the harness never downloads them
    t = load_task(task, data_dir if task not in ("arith", "multi") else None)
    rows = [{"task": p.task, "id": p.id, "index": p.index, "prompt": p.prompt, "answer": p.answer,
             "tests": list(p.tests), "test_imports": list(p.test_imports)} for p in t.problems]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


# custom_dataset callables: the harness passes the task metadata (and the model args) as keyword arguments.
def gsm8k(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    return _dataset("gsm8k", data_dir)


def math500(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    return _dataset("math500", data_dir)


def mbpp(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    return _dataset("mbpp", data_dir)


def arith(**_) -> datasets.DatasetDict:
    return _dataset("arith", None)


def multi(**_) -> datasets.DatasetDict:
    return _dataset("multi", None)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """``acc`` = 1.0 if the completion is correct (math: Math-Verify; code: every assert passes in the sandbox);
    ``nfe`` = the request's denoiser evaluations when the tdlm model generated it. Code raises
    :class:`tdlm.errors.TDLMError` (one line, nothing run) where the sandbox lacks a guarantee: fail closed."""
    from tdlm.evaluation.scoring import score
    from tdlm.tasks import Problem

    problem = Problem(task=doc["task"], id=doc["id"], index=int(doc["index"]), prompt=doc["prompt"],
                      answer=doc["answer"], tests=tuple(doc.get("tests") or ()),
                      test_imports=tuple(doc.get("test_imports") or ()))
    out = {"acc": float(score(problem, results[0]).correct)}
    # The tdlm model left this request's denoiser evaluations under (task, id): NFE is a metric beside acc, so the
    # harness reports its mean and standard error. Another model (e.g. hf) leaves none: no nfe, acc as usual.
    from tdlm.harness.model import NFE_BY_DOC

    nfe = NFE_BY_DOC.get((str(doc["task"]), str(doc["id"])))
    if nfe is not None:
        out["nfe"] = float(nfe)
    return out
