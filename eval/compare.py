"""Print the comparison tables of finished evaluations from their JSON summaries (no W&B server needed).

Commands (from the repository root, venv active)::

    # Table 1 over both backbones (each dir written by eval/run.py)
    python eval/compare.py runs/eval/llada-table1 runs/eval/dream-table1

    # also write the tables and the Pareto plots of the union of runs
    python eval/compare.py runs/eval/llada-sweep runs/eval/llada-table1 --markdown cmp.md --plots-dir cmp/

    # Table 4 of an allocation sweep (launcher/sweep.py): allocation, parameters, accuracy, NFE, seconds, speedup
    python eval/compare.py runs/sweeps/tiny-table4

    # the paired comparison against another reference run than threshold-tau0.9 (a run folder's name)
    python eval/compare.py runs/eval/llada-table1 --reference original

Arguments are evaluation output dirs (their ``summary.json``; an unfinished dir is searched for
``runs/*/*/summary.json``), run dirs, summary files, or sweep folders (``sweep.json``: their Table 4 comes first,
and their evaluation dirs join the union). Speedups are recomputed over the union, so a
baseline from one dir serves runs from another with the same backbone, task, budget and block size.
So do the paired comparisons (tdlm.evaluation.paired): every run against the reference run of its backbone, task,
budget and block size (``--reference``, default the threshold run at ``--reference-tau``), paired by sample id
from the runs' ``samples.jsonl``: accuracy difference with a 95% paired-bootstrap interval, exact McNemar p, NFE
and seconds ratios with intervals (2000 resamples, seed 0, both printed with the table). Runs that did not decode
the same problems (other ids, other data) get no numbers, and the table says why.
Errors print one line and exit with status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout run without the editable install

# The command line lives in the library (tdlm.sweep.cli: it reads sweep folders too), as the console script
# tdlm-compare.
from tdlm.sweep.cli import compare_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
