"""Experiment tracking: W&B runs (online, offline or disabled) with the local ``metrics.jsonl`` as the record that
survives a crash, run tags, adapter artifacts. Used by training, evaluation and sweeps (:mod:`tdlm.tracking.runs`)."""

from tdlm.tracking.runs import (
    ADAPTER_ARTIFACT_TYPE,
    RUN_RECORD,
    NullTracker,
    Tracker,
    adapter_artifact_name,
    experiment_group,
    grid_tags,
    previous_run_id,
    read_metrics,
    run_tags,
    start_detached_service,
    tag,
    wandb_mode,
)

__all__ = ["ADAPTER_ARTIFACT_TYPE", "RUN_RECORD", "NullTracker", "Tracker", "adapter_artifact_name",
           "experiment_group", "grid_tags", "previous_run_id", "read_metrics", "run_tags",
           "start_detached_service", "tag", "wandb_mode"]
