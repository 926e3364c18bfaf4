"""The evaluation command line's entry point (``eval/run.py``, console script ``tdlm-eval``): the flags and their
parsing are :func:`tdlm.evaluation.config.build_parser` / :func:`~tdlm.evaluation.config.parse_args` (generated from
EvalConfig); this module only runs the job, so that config.py needs no import of the driver above it."""

from __future__ import annotations

import logging
import os
import sys

from tdlm.errors import TDLMError
from tdlm.evaluation.config import parse_args
from tdlm.evaluation.driver import evaluate, head_lost


def main(argv: list[str] | None = None) -> int:
    """``eval/run.py`` / ``tdlm-eval``: evaluate, print the tables; errors are one line and exit status 2.

    After a lost Ray head the one-line error is printed and the process leaves with ``os._exit``: Ray's own teardown
    on a dead head exits from C++ with its own message or waits for the dead GCS."""
    code = _run(argv)
    if head_lost():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(argv: list[str] | None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    # One W&B run per grid point: its console summary block per run would drown the progress output.
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        result = evaluate(parse_args(argv))
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.table)
    print(f"{result.computed} samples decoded, {result.skipped} resumed; results in {result.output_dir} "
          f"(summary.json, table.md, {', '.join(p.rsplit('/', 1)[-1] for p in result.plots)})")  # fmt: skip
    return 0
