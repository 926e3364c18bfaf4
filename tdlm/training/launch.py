"""The command line of ``launcher/train.py``: arguments -> (run config, DS JSON) -> :func:`tdlm.training.train`.

Kept here rather than in the launcher so tests can resolve the README's commands to the recipe they run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tdlm.config import apply_overrides, check_override_keys, from_dict, load_yaml
from tdlm.errors import TDLMError
from tdlm.training.config import RunConfig
from tdlm.training.ds_config import load_ds_json


@dataclass
class Launch:
    run: RunConfig
    ds_raw: dict
    ds_path: str
    source: str  # the run config file (or "defaults"), named in error messages
    resume: bool
    allow_recipe_change: bool = False


def parser(description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ds", required=True,
                    help="DeepSpeed JSON (ds_configs/zero3.json, zero2.json, zero3_offload.json)")
    ap.add_argument("--config", default=None,
                    help="run config YAML (configs/llada_8b.yaml, configs/dream_7b.yaml, configs/tiny.yaml); "
                         "fields of tdlm.training.config; default: the embedded tiny-arith default")
    ap.add_argument("--output-dir", default=None,
                    help="run folder (checkpoints/, adapter/, metrics.jsonl, summary.json)")
    ap.add_argument("--max-steps", type=int, default=None, help="optimizer updates (sets train.max_steps)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --output-dir from its newest verified checkpoint (a finished run: "
                         "nothing to do); the recipe must be unchanged")
    ap.add_argument("--allow-recipe-change", action="store_true",
                    help="with --resume: accept a changed recipe (lr, batch sizes, seed, model, data...); the old "
                         "run_config.json is kept as run_config.step-N.json")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*",
                    help="section.key=value overrides of the run config (model.layers=all, train.max_steps=100)")
    return ap


def parse_launch(argv: list[str] | None = None, description: str | None = None) -> Launch:
    """Resolve a launcher command line; raises TDLMError on bad files or fields (nothing is started)."""
    args = parser(description).parse_args(argv)
    raw = load_yaml(args.config)
    extra = list(args.overrides)
    if args.output_dir:
        extra.append(f"output_dir={args.output_dir}")
    if args.max_steps is not None:
        extra.append(f"train.max_steps={args.max_steps}")
    source = args.config or "defaults"
    # A typo on the command line is blamed on the command line (with the nearest key), not on the YAML file.
    check_override_keys(RunConfig, list(args.overrides))
    overridden = apply_overrides(raw, extra)
    try:
        run = from_dict(RunConfig, overridden, source)
    except TDLMError as e:
        bad = [o for o in extra if _touches(str(e), o)]
        if bad:
            raise TDLMError(f"override {bad[0]!r}: {str(e).split(': ', 1)[-1]}") from None
        raise
    if args.allow_recipe_change and not args.resume:
        raise TDLMError("--allow-recipe-change applies to --resume only")
    return Launch(run=run, ds_raw=load_ds_json(args.ds), ds_path=args.ds, source=source, resume=args.resume,
                  allow_recipe_change=args.allow_recipe_change)


def _touches(message: str, override: str) -> bool:
    """Does a from_dict error message (``source.section.key: ...``) concern the field ``override`` sets?"""
    key = override.split("=", 1)[0].strip()
    return f".{key}:" in message or f".{key}[" in message or message.split(": ", 1)[0].endswith(key)


def preflight_before_work(launch: Launch) -> None:
    """Validate everything that needs no trajectories (run config fields, DS JSON, backbone, allocation)
    before the embedded default's teacher trajectories are generated or a process group starts."""
    import os

    import torch

    from tdlm.training.loop import preflight_config

    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    preflight_config(launch.run, launch.ds_raw, int(os.environ.get("WORLD_SIZE", "1")), on_gpu, launch.source,
                     launch.ds_path)
