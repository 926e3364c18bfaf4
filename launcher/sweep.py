"""Layer-allocation sweeps (Table 4): ``python launcher/sweep.py run|trial|wandb-file --config ...`` (also the console
script ``tdlm-sweep``). The command line and its help live in :mod:`tdlm.sweep.cli`; W&B sweep files run this file
(``program: launcher/sweep.py``), so it stays."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tdlm.sweep.cli import main  # noqa: E402 - after the path: a checkout run without the editable install

if __name__ == "__main__":
    sys.exit(main())
