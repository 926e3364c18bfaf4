"""On-policy rounds for the temporal adapter (logic: tdlm/onpolicy/; docs/training.md#on-policy-rounds).

    # the tiny recipe on this machine: round 0 = teacher trajectories + training, then 2 on-policy rounds
    python ray_jobs/onpolicy.py --config configs/onpolicy_tiny_multi.yaml
    # LLaDA-8B on an 8-GPU node (rollouts and training take turns on the GPUs)
    python ray_jobs/onpolicy.py --config configs/onpolicy_llada_8b.yaml

Rerunning the same command resumes the round and phase it stopped in; errors print one line and exit with status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout run without the editable install

from tdlm.onpolicy.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
