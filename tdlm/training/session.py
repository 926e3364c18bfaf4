"""What one rank of a training launch holds while it runs (built by :func:`tdlm.training.loop.setup`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tdlm.data.stream import TrajectoryStream
from tdlm.temporal.model import TDLM
from tdlm.tracking import NullTracker
from tdlm.training.config import RunConfig
from tdlm.training.run_dir import RollCall, RunLock


@dataclass
class Session:
    run: RunConfig
    ds_config: dict
    engine: object
    model: TDLM
    stream: TrajectoryStream
    device: torch.device
    rank: int
    world: int
    tracker: NullTracker
    start_step: int = 0
    lock: RunLock | None = None
    allow_recipe_change: bool = False
    # Counted before deepspeed.initialize: under ZeRO-3 a partitioned parameter's numel() is 0 afterwards (the W&B
    # config once recorded temporal_parameters 0 for a 98,307-parameter adapter).
    temporal_parameters: int = 0
    saved_step: int | None = None  # the newest checkpoint on disk (no second save of the same step)
    saved_at: float = 0.0  # time.monotonic() of that save (train.save_every_minutes)
    roll: RollCall | None = None  # who is who, to name a lost rank (run_dir.RollCall)
    step: int = 0  # updates done so far in this launch's loop (named when a peer is lost)
