"""The W&B sweep file of a sweep config, and the local runner that runs its grid without a W&B server.

The W&B file is a grid over one parameter, ``allocation``, whose command is this repository's trial entry point::

    program: launcher/sweep.py
    method: grid
    parameters: {allocation: {values: [dispersed:8, middle:16, dispersed:16, all]}}
    command: [${env}, ${interpreter}, ${program}, trial, --config, <sweep config>, ${args_no_hyphens}]

``wandb sweep FILE`` registers it; each ``wandb agent ID`` process then runs one trial per grid point
(``launcher/sweep.py trial --config C allocation=dispersed:8``). The local runner builds every grid point's command
from the same file with W&B's own command builder (``wandb.sdk.launch.sweeps.utils``, the code ``wandb agent`` runs)
and runs the trials one after another, so both ways execute identical commands; it ends with Table 4.

A sweep with ``seeds`` has a second parameter, ``seed: {values: [0, 1, 2]}``: the grid is allocation x seed (all
seeds of an allocation, then the next allocation) and each point runs ``trial ... allocation=SPEC seed=K``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tdlm.errors import TDLMError
from tdlm.sweep.config import SweepConfig, plan_all
from tdlm.sweep.trial import REPO

PROGRAM = "launcher/sweep.py"


def wandb_sweep_spec(cfg: SweepConfig, config_path: str, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The W&B sweep config (``wandb sweep`` input) whose grid is ``cfg.allocations`` (x ``cfg.seeds`` when the
    sweep has seeds); ``overrides`` (sweep config ``key=value``) are passed to every trial."""
    parameters: dict = {"allocation": {"values": list(cfg.allocations)}}
    if cfg.seeds is not None:
        parameters["seed"] = {"values": list(cfg.seeds)}
    return {
        "name": cfg.experiment,
        "description": f"TDLM layer-allocation sweep (Table 4 shape); settings in {config_path}",
        "project": cfg.project,
        "program": PROGRAM,
        "method": "grid",
        "metric": {"name": "accuracy", "goal": "maximize"},
        "parameters": parameters,
        "command": ["${env}", "${interpreter}", "${program}", "trial", "--config", config_path,
                    *[o for o in overrides if not o.startswith("allocations=")], "${args_no_hyphens}"],
    }


def wandb_sweep_yaml(cfg: SweepConfig, config_path: str, overrides: list[str] | tuple[str, ...] = ()) -> str:
    head = (f"# W&B sweep over the allocations of {config_path} (generated: python launcher/sweep.py wandb-file "
            f"--config {config_path})\n# wandb sweep <this file>  ->  wandb agent <entity>/{cfg.project}/<sweep id>"
            f"   (run both from the repository root)\n")  # fmt: skip
    return head + yaml.safe_dump(wandb_sweep_spec(cfg, config_path, overrides), sort_keys=False)


def grid(spec: dict, where: str) -> list[dict]:
    """The grid points of a W&B sweep config, in W&B's order (``value`` / ``values`` parameters, method grid)."""
    if spec.get("method") != "grid":
        raise TDLMError(f"{where}: method={spec.get('method')!r}; the local runner runs grid sweeps only")
    names, choices = [], []
    for name, p in (spec.get("parameters") or {}).items():
        if "values" in p:
            values = list(p["values"])
        elif "value" in p:
            values = [p["value"]]
        else:
            raise TDLMError(f"{where}: parameters.{name}: a grid needs 'value' or 'values'; got {sorted(p)}")
        names.append(name)
        choices.append(values)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*choices)]


def agent_command(spec: dict, point: dict) -> list[str]:
    """The command ``wandb agent`` runs for one grid point (its macro expansion, by W&B's own helpers)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

    template = create_sweep_command(list(spec.get("command") or []))
    macros = create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})
    macros |= {"interpreter": [sys.executable], "program": [str(REPO / spec["program"])], "env": ["/usr/bin/env"]}
    out: list[str] = []
    for chunk in map(str, template):
        out += macros.get(chunk[2:-1], []) if chunk.startswith("${") and chunk.endswith("}") else [chunk]
    return out


def run_sweep(cfg: SweepConfig, config_path: str, source: str, overrides: list[str] | tuple[str, ...] = ()) -> int:
    """Every trial (allocation, and seed when the sweep has seeds), in order, through the trial command; then
    Table 4. Returns 1 if any trial failed. A rerun resumes: finished training is a no-op, decoded samples are kept."""
    from tdlm.sweep.table import plot_sweep, write_table4

    plans = dict(zip(cfg.allocations, plan_all(cfg, source), strict=True))  # all checked before anything runs
    spec = wandb_sweep_spec(cfg, config_path, overrides)
    points = grid(spec, source)
    failed = []
    for i, point in enumerate(points, 1):
        p = plans[point["allocation"]]
        at = f", training seed {point['seed']}" if "seed" in point else ""
        print(f"\n=== [{i}/{len(points)}] allocation {p.spec}{at}: {len(p.layers)} layers, {p.parameters:,} parameters",
              flush=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_SWEEP") and k != "WANDB_RUN_ID"}
        rc = subprocess.call(agent_command(spec, point), env=env)
        if rc != 0:
            failed.append(f"{p.spec}{at} (exit {rc})")
    text, path = write_table4(cfg.output_dir)
    plots = plot_sweep(cfg.output_dir)
    print("\n" + text + f"\n(written to {path}; comparison plots: {', '.join(str(p) for p in plots) or 'none'})",
          flush=True)
    if failed:
        print(f"failed trials: {', '.join(failed)} (recorded in the table)", file=sys.stderr, flush=True)
        return 1
    return 0


def write_wandb_file(cfg: SweepConfig, config_path: str, dest: str | None,
                     overrides: list[str] | tuple[str, ...] = ()) -> str:
    text = wandb_sweep_yaml(cfg, config_path, overrides)
    if dest:
        Path(dest).write_text(text)
    return text
