"""Where a replica of a backbone goes in a process that Ray (or nothing) started: the generation and evaluation
workers place themselves with :func:`actor_device` (docs/gpu.md; tests/test_ray_gpu_placement.py)."""

from __future__ import annotations

import os
import sys

import torch

from tdlm.errors import TDLMError


def _ray_actor_gpu_ids() -> list[str] | None:
    """The GPU ids Ray gave this process's actor ([] for none), or None when this process is no Ray actor."""
    ray = sys.modules.get("ray")  # an actor process has imported ray; an in-process worker need not
    if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    return [str(i) for i in ray.get_gpu_ids()]


def actor_device(requested: str | None = None) -> str:
    """The device a replica (generation or evaluation worker) is placed on: ``requested`` if given, else what this
    process was given.

    In a Ray actor, what Ray gave the actor decides, not what the driver sees: an actor created with ``num_gpus=1``
    gets one GPU id, and Ray sets its CUDA_VISIBLE_DEVICES to that id alone, so its own GPU is ``cuda:0`` in here -
    not ``cuda:<actor index>`` nor ``cuda:<its physical id>``, which name another actor's GPU or no device at all.
    An actor given no GPU runs on the CPU even on a GPU node (``torch.cuda.is_available()`` can be true there, and
    every such actor would then share the node's first GPU). Outside Ray (an in-process worker): the first GPU torch
    sees, else the CPU.
    """
    if requested:
        return requested
    ids = _ray_actor_gpu_ids()
    if ids is None:
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if not ids:
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if ids[0] not in visible:  # e.g. RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the index would be a guess
        raise TDLMError(f"Ray gave this actor GPU {ids} but CUDA_VISIBLE_DEVICES is {','.join(visible)!r}; "
                        f"tdlm needs Ray to narrow it to the actor's GPUs")  # fmt: skip
    return f"cuda:{visible.index(ids[0])}"  # 0: Ray lists the actor's own GPUs only


def describe_placement(device: str | None) -> dict:
    """Where this process put (or tried to put) its replica, as the driver logs it and tests check it."""
    ids = _ray_actor_gpu_ids()
    return {"device": device, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ray_gpu_ids": ids, "pid": os.getpid()}  # fmt: skip
