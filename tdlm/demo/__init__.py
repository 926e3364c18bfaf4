"""The whole pipeline end to end on a CPU: ``make demo`` (``python -m tdlm.demo``).

The demo runs on the ``multi-v1`` task (:mod:`tdlm.tasks.toydata`: arithmetic chains whose responses have hundreds of
equally valid surface forms) with the shipped ``tiny-multi`` backbone, where parallel decoding has something to
win: ``threshold`` needs tens of evaluations per request at tau 0.9 and loses accuracy as tau falls. Stages, each
through the real entry point a cluster user runs:

1. prompts: ``runs/demo/prompts.jsonl`` from the multi-v1 *prompts* split (disjoint from validation and test);
2. teacher trajectories: ``ray_jobs/generate_trajectories.py --config configs/gen_tiny_multi.yaml`` on a local
   Ray cluster with 2 actors;
3. training: ``deepspeed --num_gpus 2 launcher/train.py --ds ds_configs/zero3.json --config
   configs/tiny_multi.yaml`` (2 CPU ranks, ZeRO-3, activation checkpointing);
4. evaluation: ``eval/run.py`` on the held-out *test* split for ``original``, ``threshold`` and ``tdlm``, each
   policy over a tau sweep (greedy; batched, which leaves tokens and per-request NFE as at batch 1), and dInfer's
   training-free ``credit`` and ``soft`` (:mod:`tdlm.decoding.reuse`, dInfer's default weights) at tau 0.9;
5. diagnostic: for positions that stay masked three or more evaluations, how often the finally committed token
   equals each earlier evaluation's argmax (:mod:`tdlm.decoding.prediction_history`), backbone and TDLM at tau 0.9;
6. report: ``runs/demo/report.md`` with both frontiers (accuracy +- standard error vs mean NFE, and seconds per
   sample), every run paired with threshold tau 0.9 and TDLM tau 0.95 with each training-free baseline on the same
   problems, the Pareto plot, the diagnostic, and the target's outcome (TDLM within 1 point of the threshold
   baseline's accuracy at <= 0.8x its NFE and <= 0.85x its seconds at some tau, with the training-seed spread
   of ``bench/results/seed_variance.json``).

The recipe (teacher policy, K, updates, lr, layers, history, tau grid) was chosen on the *validation* split
(``scripts/validate_multi_backbone.py``); the test split is read only here. ``DEMO_FAST=1`` runs the same
stages with fewer prompts, steps and test problems (the test suite).

Rerunning resumes: a stage that finished with the same command and inputs is not launched again
(:func:`tdlm.demo.plan.stage_reusable`); one that did not finish resumes: generation skips finished shards, training
continues its run folder with ``--resume`` (a run killed before its first checkpoint is moved aside and restarted),
evaluation skips finished shards), the diagnostic is reused when ``diagnostic.json`` was computed for the same adapter
and plan, and the report is rewritten from the stage outputs. ``TDLM_DEMO_INTERRUPT=<stage>`` (generation, training,
evaluation, diagnostic, report) stops the demo right after that stage, as an interruption would (exit 130); the test
suite uses it to interrupt every stage and resume.

The *embedded default* of a training launch without flags (tiny-arith, generated trajectories) lives in
:mod:`tdlm.data.toy_trajectories`; sweeps and benchmarks build on it.

Modules: :mod:`tdlm.demo.plan` (settings, prompts, the stage runner and its stamps), :mod:`tdlm.demo.run` (the
stages in order, the report and the command line), :mod:`tdlm.demo.diagnostic`, :mod:`tdlm.demo.findings` (the
report's verdict and tables). This face re-exports the names other code imports from ``tdlm.demo``.
"""

from tdlm.data.toy_trajectories import BACKBONE, DTYPE, GEN_LENGTH, ensure_toy_trajectories
from tdlm.demo.diagnostic import cached_diagnostic, diagnostic_summary, diagnostic_table, run_diagnostic
from tdlm.demo.findings import (
    ACCURACY_SLACK,
    BASELINE_TAU,
    NFE_TARGET,
    REUSE_BASELINES,
    SECONDS_TARGET,
    SEED_VARIANCE,
    TDLM_PAIRED_TAU,
    _card_accuracy,
    _reproduction,
    baseline_pairs,
    evidence,
    frontier_table,
    judge,
    seed_spread,
    standard_error,
)
from tdlm.demo.plan import (
    DEMO_BACKBONE,
    DEMO_COMPILE,
    DEMO_GEN_CONFIG,
    DEMO_TASK,
    DEMO_TRAIN_CONFIG,
    REPO,
    DemoPlan,
    demo_stamp,
    run_stage,
    set_aside_other_demo,
    stage_reusable,
    write_prompts,
)
from tdlm.demo.run import STAGES, build_parser, interrupt_after, main
from tdlm.tasks.toydata import MULTI_GEN_LENGTH, MULTI_TEST_SIZE
from tdlm.training.run_dir import free_port, training_resume_args

__all__ = [
    "ACCURACY_SLACK", "BACKBONE", "BASELINE_TAU", "DEMO_BACKBONE", "DEMO_COMPILE", "DEMO_GEN_CONFIG", "DEMO_TASK",
    "DEMO_TRAIN_CONFIG", "DTYPE", "GEN_LENGTH", "MULTI_GEN_LENGTH", "MULTI_TEST_SIZE", "NFE_TARGET", "REPO",
    "REUSE_BASELINES", "SECONDS_TARGET", "SEED_VARIANCE", "STAGES", "TDLM_PAIRED_TAU", "DemoPlan", "_card_accuracy",
    "_reproduction", "baseline_pairs", "build_parser", "cached_diagnostic", "demo_stamp", "diagnostic_summary",
    "diagnostic_table", "ensure_toy_trajectories", "evidence", "free_port", "frontier_table", "interrupt_after",
    "judge", "main", "run_diagnostic", "run_stage", "seed_spread", "set_aside_other_demo", "stage_reusable",
    "standard_error", "training_resume_args", "write_prompts",
]  # fmt: skip
