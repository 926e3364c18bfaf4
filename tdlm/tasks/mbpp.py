"""MBPP sanitized, test split (257 hand-verified Python problems, task ids 11-510), zero-shot for Instruct models.

Data: ``google-research-datasets/mbpp`` config ``sanitized`` split ``test`` on the Hub, or
``mbpp_sanitized_test.jsonl`` (``google-research`` ``mbpp/sanitized-mbpp.json`` filtered to ids 11-510).
Fields ``task_id``, ``prompt``, ``code``, ``test_imports``, ``test_list``. Austin et al. 2021, "Program Synthesis
with Large Language Models", arXiv:2108.07732.

Prompt ``mbpp-v1`` (user message, no chat template). As in the original MBPP prompt, the first assert is shown, so
the model learns the function name and signature; all asserts are run when scoring::

    You are an expert Python programmer, and here is your task: {prompt}
    Your code should pass this test:

    {test_list[0]}

    Answer with a single ```python code block that contains the complete solution.

Scoring (:func:`tdlm.evaluation.scoring.score_code`) runs ``test_imports`` + extracted code in
:mod:`tdlm.evaluation.sandbox`; the sample only evaluates the calls into its code that the asserts of ``test_list``
make, and the evaluator's own process evaluates each assert (parsed with :mod:`ast`) with the values it sent back.
pass@1 means every assert held and the program exited 0 (an early ``sys.exit(0)`` / ``os._exit(0)`` sends no values,
so it fails, as in the anchors' harnesses). All 257 canonical solutions pass this way (tests/test_sandbox_hostile.py).
"""

from __future__ import annotations

import os
from typing import Any

from tdlm.tasks.base import DatasetSpec, Problem, Task, apply_limit, load_records

NAME = "mbpp"
PROMPT_VERSION = "mbpp-v1"
METRIC = "pass@1"
SPEC = DatasetSpec(
    hub_path="google-research-datasets/mbpp",
    hub_config="sanitized",
    hub_split="test",
    local_file="mbpp_sanitized_test.jsonl",
    expected_count=257,
    required_fields=("task_id", "prompt", "code", "test_imports", "test_list"),
)


def build_prompt(text: str, example_test: str) -> str:
    """The ``mbpp-v1`` user message: task text, one example assert, and the answer-format instruction."""
    return (
        f"You are an expert Python programmer, and here is your task: {text.strip()}\n"
        f"Your code should pass this test:\n\n{example_test.strip()}\n\n"
        "Answer with a single ```python code block that contains the complete solution."
    )


def to_problem(index: int, record: dict[str, Any]) -> Problem:
    """A :class:`Problem` from one raw record; ``answer`` holds the reference solution, ``tests`` the asserts."""
    tests = tuple(record["test_list"])
    return Problem(
        task=NAME,
        id=f"{NAME}/{record['task_id']}",
        index=index,
        prompt=build_prompt(record["prompt"], tests[0]),
        answer=record["code"],
        tests=tests,
        test_imports=tuple(record["test_imports"] or ()),
        raw=record,
    )


def load(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Task:
    """Load the MBPP sanitized test split (see :func:`tdlm.tasks.base.load_records` for the source order)."""
    records, source = load_records(SPEC, data_dir)
    problems = [to_problem(i, r) for i, r in enumerate(records)]
    return Task(NAME, PROMPT_VERSION, METRIC, apply_limit(problems, limit), source)
