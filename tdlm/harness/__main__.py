"""``python -m tdlm.harness ...``: lm-evaluation-harness's CLI (``lm-eval run`` arguments) with the ``tdlm`` model
registered and ``--include_path`` defaulting to the shipped offline tasks (tdlm/harness/tasks).

    python -m tdlm.harness --model tdlm --model_args backbone=tiny-arith,policy=threshold,gen_length=40,block_size=40 \\
        --tasks tdlm_arith --limit 20 --output_path runs/lm-eval-tiny
    python -m tdlm.harness ls tasks          # lm-eval's other subcommands work as usual
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    import tdlm.harness  # registers the "tdlm" model

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in ("ls", "validate", "-h", "--help") and "--include_path" not in args:
        args += ["--include_path", tdlm.harness.TASKS_DIR]
    sys.argv = ["lm-eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
