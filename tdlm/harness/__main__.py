"""``python -m tdlm.harness ...``: lm-evaluation-harness's CLI (``lm-eval run`` arguments) with the ``tdlm`` model
registered and ``--include_path`` defaulting to the shipped offline tasks (tdlm/harness/tasks).

    python -m tdlm.harness --model tdlm \\
        --model_args pretrained=tiny-arith,policy=threshold,gen_length=40,block_size=40 \\
        --tasks tdlm_arith --limit 20 --output_path runs/lm-eval-tiny
    python -m tdlm.harness ls tasks          # lm-eval's other subcommands work as usual

Why not ``lm_eval --model tdlm``: lm-eval 0.4.13 looks the model name up in its own registry before it reads any
``--include_path`` file and has no plugin (entry-point) group for models, so only a process that has imported
``tdlm.harness`` knows ``tdlm``; this wrapper is lm-eval's own CLI in such a process.

Before lm-eval starts, the command line is checked so that a mistake is one line, not a traceback: every
``--model_args`` key and value of the ``tdlm`` model (``backbone=`` is rewritten to ``pretrained=``, the key the
harness names output folders after), ``--limit`` (a positive count, or a fraction in (0, 1)), and, when lm-eval
reports unknown tasks, the nearest task names. ``--device`` is set to the device the model really runs on (the
harness's default ``cuda:0`` would otherwise be recorded for a CPU run).
"""

from __future__ import annotations

import difflib
import sys

from tdlm.errors import TDLMError


def _value(args: list[str], *names: str) -> tuple[int, bool, str] | None:
    """(index, written as ``--flag=value``, value) of the last ``--flag value`` / ``--flag=value`` among ``names``."""
    found = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = (i + 1, False, args[i + 1])
            elif a.startswith(n + "="):
                found = (i, True, a.split("=", 1)[1])
    return found


def _set(args: list[str], at: tuple[int, bool, str], flag: str, value: str) -> None:
    i, joined, _ = at
    args[i] = f"{flag}={value}" if joined else value


def check_limit(text: str) -> float:
    try:
        limit = float(text)
    except ValueError:
        raise TDLMError(f"--limit {text!r}: expected a positive number of examples per task (e.g. 20) or a "
                        f"fraction in (0, 1)") from None
    if not limit > 0 or (limit >= 1 and limit != int(limit)):
        raise TDLMError(f"--limit {text}: expected a positive number of examples per task (e.g. 20) or a fraction "
                        f"in (0, 1)")
    return limit


def prepare(args: list[str]) -> list[str]:
    """Check and normalise an ``lm-eval run`` command line for the ``tdlm`` model (see the module docstring)."""
    import torch
    from lm_eval.utils import simple_parse_args_string

    from tdlm.harness.model import parse_model_args

    args = list(args)
    limit = _value(args, "--limit", "-L")
    if limit is not None:
        check_limit(limit[2])
    model = _value(args, "--model")
    if model is None or model[2] != "tdlm":
        return args
    margs = _value(args, "--model_args", "--model-args")
    text = "" if margs is None else margs[2]
    parsed = simple_parse_args_string(text)
    cfg = parse_model_args(parsed)  # raises one line naming the key
    if "backbone" in parsed and margs is not None:  # the harness names the output folder after pretrained=
        text = ",".join(f"pretrained={v}" if k == "backbone" else f"{k}={v}"
                        for k, v in (item.split("=", 1) for item in text.split(",") if item))
        _set(args, margs, "--model_args", text)
    del cfg
    device = _value(args, "--device")
    cuda = torch.cuda.is_available()
    if device is None:
        args += ["--device", "cuda" if cuda else "cpu"]
    elif device[2].startswith("cuda") and not cuda:
        print(f"warning: --device {device[2]}: no CUDA device here; decoding on the CPU",
              file=sys.stderr, flush=True)
        _set(args, device, "--device", "cpu")
    return args


def _unknown_tasks(message: str, include_path: str) -> str:
    """One line for lm-eval's "Tasks not found: [...]", with the nearest known task for each."""
    import ast

    from lm_eval.tasks import TaskManager

    listed = message.split(":", 1)[1].strip()
    try:
        missing = ast.literal_eval(listed)  # "['a', 'b']" in some lm-eval versions
    except (ValueError, SyntaxError):
        missing = [m.strip() for m in listed.split(",") if m.strip()]  # "a, b" in 0.4.13
    known = TaskManager(include_path=include_path).all_tasks
    parts = []
    for name in missing if isinstance(missing, list) else [missing]:
        near = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return (f"--tasks: unknown task {', '.join(parts)}; list them with `python -m tdlm.harness ls tasks` "
            f"(shipped: tdlm_gsm8k, tdlm_math500, tdlm_mbpp, tdlm_arith, tdlm_multi)")


def main(argv: list[str] | None = None) -> int:
    from lm_eval.__main__ import cli_evaluate

    import tdlm.harness  # registers the "tdlm" model

    args = list(sys.argv[1:] if argv is None else argv)
    subcommand = bool(args) and args[0] in ("ls", "validate", "-h", "--help")
    if not subcommand and "--include_path" not in args:
        args += ["--include_path", tdlm.harness.TASKS_DIR]
    try:
        if not subcommand:
            args = prepare(args)
        sys.argv = ["lm-eval", *args]
        cli_evaluate()
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except ValueError as e:
        if str(e).startswith("Tasks not found"):
            inc = _value(args, "--include_path")
            print(f"error: {_unknown_tasks(str(e), inc[2] if inc else tdlm.harness.TASKS_DIR)}", file=sys.stderr,
                  flush=True)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
