"""Print the comparison tables of finished evaluations from their JSON summaries (no W&B server needed).

Commands (from the repository root, venv active)::

    # Table 1 over both backbones (each dir written by eval/run.py)
    python eval/compare.py runs/eval/llada-table1 runs/eval/dream-table1

    # also write the tables and the Pareto plots of the union of runs
    python eval/compare.py runs/eval/llada-sweep runs/eval/llada-table1 --markdown cmp.md --plots-dir cmp/

    # Table 4 of an allocation sweep (launcher/sweep.py): allocation, parameters, accuracy, NFE, seconds, speedup
    python eval/compare.py runs/sweeps/tiny-table4

Arguments are evaluation output dirs (their ``summary.json``; an unfinished dir is searched for
``runs/*/*/summary.json``), run dirs, summary files, or sweep folders (``sweep.json``: their Table 4 comes first,
and their evaluation dirs join the union). Speedups are recomputed over the union, so a
baseline from one dir serves runs from another with the same backbone, task, budget and block size.
Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tdlm.errors import TDLMError
from tdlm.evaluation.metrics import compute_speedups
from tdlm.evaluation.report import load_runs, render
from tdlm.sweep.table import is_sweep_dir, table4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render Table 1/2/4-shaped Markdown tables from evaluation summaries.")
    p.add_argument("paths", nargs="+", help="evaluation output dirs, run dirs, summary.json files or sweep folders")
    p.add_argument("--reference-tau", type=float, default=0.9,
                   help="tau of the threshold run used for the 'vs threshold' speedup (default: 0.9)")  # fmt: skip
    p.add_argument("--markdown", help="also write the tables to this file")
    p.add_argument("--plots-dir", help="also write pareto_<task>.png plots of all runs to this folder")
    args = p.parse_args(argv)
    try:
        sweeps = [path for path in args.paths if is_sweep_dir(path)]
        paths = [path for path in args.paths if path not in sweeps]
        for sweep in sweeps:  # a sweep's evaluations: eval/baselines and eval/<allocation>
            paths += [str(d) for d in sorted(Path(sweep).glob("eval/*")) if (d / "runs").is_dir()]
        runs = compute_speedups(load_runs(paths), args.reference_tau) if paths else []
        table = "".join(table4(sweep) + "\n" for sweep in sweeps) + render(runs)
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


if __name__ == "__main__":
    sys.exit(main())
