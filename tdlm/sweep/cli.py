"""Layer-allocation sweeps (Table 4): train and evaluate a list of allocations on the same trajectories and seeds.

Locally, no W&B server needed (each allocation: DeepSpeed training -> evaluation -> model card; then Table 4):
    python launcher/sweep.py run --config configs/sweep_tiny.yaml                 # the embedded tiny-arith default
    python launcher/sweep.py run --config configs/sweep_llada_table4.yaml         # the paper's Table 4 (GPU node)
With W&B sweeps (from the repository root; the agents may run on several nodes sharing output_dir):
    python launcher/sweep.py wandb-file --config configs/sweep_llada_table4.yaml -o sweep.yaml
    wandb sweep sweep.yaml                   # prints the sweep id
    wandb agent <entity>/<project>/<sweep id>  # runs: launcher/sweep.py trial --config ... allocation=dispersed:8
One allocation by hand (what an agent runs; a sweep with seeds also takes seed=K):
    python launcher/sweep.py trial --config configs/sweep_tiny.yaml allocation=middle:3
    python launcher/sweep.py trial --config configs/sweep_tiny_seeds.yaml allocation=all seed=1
Training seeds as an axis (each allocation once per seed; Table 4 as mean ± sd over seeds, differences with a
two-level bootstrap over seeds and problems):
    python launcher/sweep.py run --config configs/sweep_tiny_seeds.yaml
Table 4 again from the folder's JSON:
    python eval/compare.py runs/sweeps/tiny-table4

Training, evaluation and the trial runs log to one W&B project (`project`), group = `experiment`, tagged with the
backbone, allocation and history; each adapter is logged as an artifact and each evaluation records the training run
it evaluates. Overrides are `key=value` fields of the sweep config (`eval.limit=50`, `allocations=[all]`).
Errors print one line and exit with status 2; a failed trial (e.g. out of memory) exits 1 and keeps its row.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tdlm.config import SuggestingParser

PROG = "python launcher/sweep.py"  # also the console script tdlm-sweep


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = SuggestingParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (("run", "every allocation of the sweep, one after another, then Table 4 (offline is fine)"),
                       ("trial", "one allocation: allocation=SPEC (what `wandb agent` runs)"),
                       ("wandb-file", "print (or write with -o) the W&B sweep file for `wandb sweep`")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--config", required=True,
                       help="sweep config YAML (configs/sweep_tiny.yaml, configs/sweep_llada_table4.yaml); fields of "
                            "tdlm.sweep.config.SweepConfig")
        if name == "wandb-file":
            p.add_argument("-o", "--output", help="write the file here (default: print it)")
        p.add_argument("overrides", nargs="*",
                       help="key=value overrides of the sweep config (eval.limit=50); for trial: allocation=SPEC "
                            "(and seed=K in a sweep with seeds)")
    return ap


def check_checkout() -> None:
    """Trials run the training launcher of a tdlm checkout (``launcher/train.py``, which ``deepspeed`` needs as a
    file); the console script of a non-editable install has none: say so in one line before anything starts."""
    from tdlm.errors import TDLMError
    from tdlm.sweep.trial import REPO

    if not (REPO / "launcher" / "train.py").is_file():
        raise TDLMError(f"no launcher/train.py in {REPO}: sweeps train through the launcher of a tdlm checkout; run "
                        f"them from a clone with an editable install (make venv)")


def main(argv: list[str] | None = None) -> int:
    from tdlm.errors import TDLMError
    from tdlm.sweep.config import load_sweep_config
    from tdlm.sweep.runner import run_sweep, write_wandb_file
    from tdlm.sweep.trial import run_trial

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("WANDB_SILENT", "true")
    args = build_parser().parse_args(argv)
    try:
        overrides = list(args.overrides)
        allocation = seed = None
        if args.cmd == "trial":
            picked = [o for o in overrides if o.startswith("allocation=")]
            if len(picked) != 1:
                raise TDLMError("trial: give exactly one allocation=SPEC (e.g. allocation=dispersed:8)")
            overrides.remove(picked[0])
            allocation = picked[0].split("=", 1)[1]
            seeds = [o for o in overrides if o.startswith("seed=")]
            if len(seeds) > 1:
                raise TDLMError(f"trial: give at most one seed=K; got {seeds}")
            if seeds:
                overrides.remove(seeds[0])
                try:
                    seed = int(seeds[0].split("=", 1)[1])
                except ValueError:
                    raise TDLMError(f"trial: {seeds[0]}: expected an integer training seed") from None
        cfg = load_sweep_config(args.config, overrides)
        if args.cmd != "wandb-file":
            check_checkout()
        if args.cmd == "wandb-file":
            text = write_wandb_file(cfg, args.config, args.output, overrides)
            if not args.output:
                print(text, end="")
            return 0
        if args.cmd == "trial":
            return run_trial(cfg, allocation, args.config, where=f"allocation={allocation}", seed=seed)
        return run_sweep(cfg, args.config, args.config, overrides)
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


def compare_main(argv: list[str] | None = None) -> int:
    """``eval/compare.py`` / ``tdlm-compare``: Table 1/2/4-shaped tables (and plots) from evaluation summaries and
    sweep folders; see eval/compare.py's docstring for the commands."""
    from pathlib import Path

    from tdlm.errors import TDLMError
    from tdlm.evaluation.metrics import compute_speedups
    from tdlm.evaluation.report import load_runs, render
    from tdlm.sweep.table import is_sweep_dir, table4

    p = SuggestingParser(description="Render Table 1/2/4-shaped Markdown tables from evaluation summaries.")
    p.add_argument("paths", nargs="+", help="evaluation output dirs, run dirs, summary.json files or sweep folders")
    p.add_argument("--reference-tau", type=float, default=0.9,
                   help="tau of the threshold run used for the 'vs threshold' speedup (default: 0.9)")  # fmt: skip
    p.add_argument("--reference", metavar="RUN",
                   help="run name (its folder under runs/<task>/, e.g. threshold-tau0.9, original, "
                        "tdlm-LABEL-tau0.9-full) every run is compared with on the same problems: accuracy difference "
                        "with a paired-bootstrap interval, exact McNemar p, NFE and seconds ratios "
                        "(default: threshold-tau<--reference-tau>)")  # fmt: skip
    p.add_argument("--markdown", help="also write the tables to this file")
    p.add_argument("--plots-dir", help="also write pareto_<task>.png plots of all runs to this folder")
    args = p.parse_args(argv)
    try:
        sweeps = [path for path in args.paths if is_sweep_dir(path)]
        paths = [path for path in args.paths if path not in sweeps]
        for sweep in sweeps:  # a sweep's evaluations: eval/baselines and eval/<allocation>
            paths += [str(d) for d in sorted(Path(sweep).glob("eval/*")) if (d / "runs").is_dir()]
        runs = compute_speedups(load_runs(paths), args.reference_tau) if paths else []
        reference = args.reference or f"threshold-tau{args.reference_tau:g}"
        table = "".join(table4(sweep) + "\n" for sweep in sweeps) + render(runs, reference)
        if args.markdown:
            Path(args.markdown).write_text(table)
        if args.plots_dir:
            from tdlm.evaluation.plot import plot_all

            plot_all(runs, args.plots_dir)
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table, end="")
    return 0
