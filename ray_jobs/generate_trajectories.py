"""Teacher trajectory generation on a Ray cluster: resumable, fault-tolerant (logic: tdlm/generation/).

Commands (from the repository root, venv active)::

    # local: starts a fresh Ray cluster on this machine (CPU replicas, or one per GPU); GSM8K *train*
    # (the default --prompt-split) from the Hub or the local HF cache
    python ray_jobs/generate_trajectories.py --backbone tiny-llada \\
        --prompts openai/gsm8k --prompt-config main --prompt-field question --num-prompts 64 \\
        --policy original --gen-length 32 --block-size 8 --shard-size 16 --batch-size 8 \\
        --output-dir runs/traj-tiny

    # a smoke test on the pinned GSM8K *test* copy: evaluation problems, so the flag is required
    # (trajectories from it must not train an adapter that is evaluated on GSM8K)
    python ray_jobs/generate_trajectories.py --backbone tiny-llada \\
        --prompts data/benchmarks/gsm8k_test.jsonl --allow-eval-prompts --num-prompts 64 \\
        --gen-length 32 --block-size 8 --shard-size 16 --output-dir runs/traj-smoke

    # a cluster: start the head (and workers with `ray start --address <head>:6379`), then submit.
    # Paths are read on the cluster: give an absolute --output-dir (the job runs in a temporary copy of
    # the working dir; a relative one is refused), and the checkpoint / adapter must exist on every
    # node. The entrypoint runs `python` from the head's PATH: it must be the environment with tdlm's
    # dependencies (on a venv-only machine write its absolute path, e.g. /work/main/.venv/bin/python).
    ray start --head --dashboard-host 0.0.0.0
    ray job submit --address http://<head>:8265 --working-dir . -- \\
        python ray_jobs/generate_trajectories.py --backbone /data/LLaDA-8B-Instruct \\
        --prompts openai/gsm8k --prompt-config main --prompt-split train --prompt-field question \\
        --policy threshold --tau 0.9 --gen-length 256 --block-size 32 \\
        --shard-size 256 --batch-size 16 --output-dir /data/traj/llada-gsm8k-train
    ray job logs --follow <submission id>      # progress lines: prompts done / total, traj/s, ETA

    # the paper recipes (3,500 GSM8K-train prompts, LLaDA-8B / Dream-7B): flags override the YAML
    python ray_jobs/generate_trajectories.py --config configs/gen_llada_8b.yaml --output-dir /data/traj/llada-8b

    # TDLM teacher (policy tdlm) with a trained adapter
    python ray_jobs/generate_trajectories.py --backbone tiny-llada --adapter runs/adapter \\
        --policy tdlm --prompts openai/gsm8k --prompt-config main --output-dir runs/traj-tdlm

Teacher prompts must not be evaluation problems: the default split is ``train``, and a source that
is (by name) or contains (by normalised-text hash) problems the evaluator scores - GSM8K test,
MATH-500, MBPP test, the arith held-out split - is refused unless ``--allow-eval-prompts`` is given
(tdlm/data/contamination.py). manifest.json records the prompt source, split, one hash per prompt and
the overlap found; the training preflight checks the same hashes.

Rerunning the same command resumes: finished shards are verified (sha256 in manifest.json) and
skipped; changed settings are refused. Without ``--address`` the script uses ``RAY_ADDRESS`` (set by
``ray job submit``), else starts a local cluster. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout run without the editable install

# The command line lives in the library (tdlm.generation.cli), so the console script tdlm-generate is the same.
from tdlm.generation.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
