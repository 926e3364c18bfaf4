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
``--model_args`` key and value of the ``tdlm`` model (policy, cache and history against their choices with "did
you mean", the decode settings as :class:`tdlm.DecodeConfig` checks them, the backbone found locally; ``backbone=``
is rewritten to ``pretrained=``, the key the harness names output folders after), ``--limit`` (a positive count, or
a fraction in (0, 1)), and every ``--tasks`` name against the names the shipped, included and lm-eval task files
declare (read as text in seconds; lm-eval's own index takes minutes), with the nearest names. ``--device`` is set
to the device the model really runs on (the harness's default ``cuda:0`` would otherwise be recorded for a CPU run).
"""

from __future__ import annotations

import difflib
import functools
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


_NAME = r"""["']?([^\s"'#,\[\]]+)["']?"""


@functools.lru_cache(maxsize=4)
def task_names(dirs: tuple[str, ...]) -> frozenset[str]:
    """Every task, group and tag name the YAML files under ``dirs`` declare, read as text.

    lm-eval's TaskManager parses all of its ~14,000 task files before it can say a name is unknown (53-444 s
    measured); the names are the ``task:`` / ``group:`` / ``tag:`` lines, which a line scan reads in seconds."""
    import re
    from pathlib import Path

    names: set[str] = set()
    for d in dirs:
        for f in Path(d).rglob("*"):
            # YAML under any name: included templates (_default_template_yaml, naijarc) carry tags that name groups
            if not f.is_file() or not (f.suffix in ("", ".yaml", ".yml") or f.name.endswith("yaml")):
                continue
            try:
                lines = f.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for i, line in enumerate(lines):
                m = re.match(r"^[\"']?(task|group|tag)[\"']?:\s*(.*?)\s*$", line)
                if not m:
                    continue
                key, rest = m.groups()
                rest = rest.split(" #", 1)[0].strip()
                if rest.startswith("["):  # tag: [a, b]
                    if key == "tag":
                        names |= {x.strip(" '\"") for x in rest.strip("[]").split(",") if x.strip()}
                elif rest:
                    one = re.fullmatch(_NAME, rest)
                    if one:
                        names.add(one.group(1))
                elif key == "tag":  # tag:\n  - a\n  - b
                    for nxt in lines[i + 1:]:
                        item = re.match(r"^\s*-\s*" + _NAME + r"\s*$", nxt)
                        if not item:
                            break
                        names.add(item.group(1))
    return frozenset(names)


def check_tasks(args: list[str]) -> None:
    """Every ``--tasks`` name must be a shipped task, one of lm-eval's, or a task file; else one line with the
    nearest names, before lm-eval indexes anything."""
    import os
    from pathlib import Path

    import lm_eval

    import tdlm.harness

    tasks = _value(args, "--tasks", "-t")
    if tasks is None:
        return
    inc = _value(args, "--include_path")
    ours = [tdlm.harness.TASKS_DIR, *([p for p in inc[2].split(os.pathsep) if p] if inc is not None else [])]
    wanted = [t.strip() for t in tasks[2].split(",") if t.strip()]
    unknown = [t for t in wanted if not Path(t).exists() and t not in task_names(tuple(ours))]
    if not unknown:  # the shipped / included tasks: a few files, no need to read lm-eval's
        return
    known = task_names(tuple(ours)) | task_names((str(Path(lm_eval.__file__).parent / "tasks"),))
    missing = [t for t in unknown if t not in known]
    if missing:
        raise TDLMError(_unknown_message(missing, known))


def _unknown_message(missing: list, known) -> str:
    parts = []
    for name in missing:
        near = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return (f"--tasks: unknown task {', '.join(parts)}; list them with `python -m tdlm.harness ls tasks` "
            f"(shipped: tdlm_gsm8k, tdlm_math500, tdlm_mbpp, tdlm_arith, tdlm_multi)")


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
        check_tasks(args)
        return args
    margs = _value(args, "--model_args", "--model-args")
    text = "" if margs is None else margs[2]
    parsed = simple_parse_args_string(text)
    cfg = parse_model_args(parsed)  # raises one line naming the key or the bad value
    from tdlm.models.loading import PRESETS, SHIPPED, load_backbone_meta

    shipped = cfg.pretrained in PRESETS or (cfg.pretrained in SHIPPED and (SHIPPED[cfg.pretrained] /
                                                                           "config.json").is_file())
    if not shipped:  # a config read, no weights: a missing backbone is named before lm-eval starts
        try:
            load_backbone_meta(cfg.pretrained)
        except TDLMError as e:
            raise TDLMError(f"--model_args pretrained={cfg.pretrained}: {e}") from None
    if "backbone" in parsed and margs is not None:  # the harness names the output folder after pretrained=
        text = ",".join(f"pretrained={v}" if k == "backbone" else f"{k}={v}"
                        for k, v in (item.split("=", 1) for item in text.split(",") if item))
        _set(args, margs, "--model_args", text)
    del cfg
    check_tasks(args)  # after the cheap checks: the task files take seconds to read
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
    return _unknown_message(missing if isinstance(missing, list) else [missing], known)


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
