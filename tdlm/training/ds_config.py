"""DeepSpeed JSON resolution: ``"auto"`` values come from the run config, contradictions are errors.

The files in ``ds_configs/`` hold what is DeepSpeed's business (ZeRO stage, offload, bf16, buckets,
activation checkpointing). Batch sizes, learning rate and clipping live in the run config; a DS file
may leave them ``"auto"`` or repeat them, but a number that disagrees is refused, so the two files
cannot silently train different recipes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tdlm.errors import TDLMError
from tdlm.training.config import RunConfig


def load_ds_json(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise TDLMError(f"--ds {p}: DeepSpeed config not found")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise TDLMError(f"--ds {p}: invalid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise TDLMError(f"--ds {p}: expected a JSON object")
    return raw


def _agree(cfg: dict, key: str, value, where: str, run_field: str) -> None:
    have = cfg.get(key, "auto")
    if have != "auto" and have != value:
        raise TDLMError(f"{where}: {key}={have} contradicts the run config ({run_field} gives {value})")
    cfg[key] = value


def resolve_ds_config(raw: dict, run: RunConfig, world_size: int, on_gpu: bool, where: str = "ds config") -> dict:
    """Fill ``auto`` fields and check the DS JSON against the run config."""
    cfg = copy.deepcopy(raw)
    for section in ("zero_optimization", "optimizer", "bf16", "fp16", "activation_checkpointing"):
        if section in cfg and not isinstance(cfg[section], dict):
            raise TDLMError(f"{where}: {section} must be an object; got {cfg[section]!r}")
    zero = cfg.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise TDLMError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3; got {stage!r}")
    for key, value in zero.items():
        if key.endswith(("_size", "_threshold", "_parameters", "_distance")) and value != "auto" and (
                isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
            raise TDLMError(f"{where}: zero_optimization.{key} must be a non-negative number; got {value!r}")
    for key in ("offload_optimizer", "offload_param"):
        if key in zero and not isinstance(zero[key], dict):
            raise TDLMError(f"{where}: zero_optimization.{key} must be an object; got {zero[key]!r}")
    if run.train.zero_stage is not None and run.train.zero_stage != stage:
        raise TDLMError(f"{where}: zero_optimization.stage={stage} contradicts train.zero_stage={run.train.zero_stage}")
    mb, accum = run.train.micro_batch_size, run.train.grad_accum
    _agree(cfg, "train_micro_batch_size_per_gpu", mb, where, "train.micro_batch_size")
    _agree(cfg, "gradient_accumulation_steps", accum, where, "train.grad_accum")
    _agree(cfg, "train_batch_size", mb * accum * world_size, where,
           f"micro_batch_size x grad_accum x world_size = {mb} x {accum} x {world_size}")
    _agree(cfg, "gradient_clipping", run.optim.grad_clip, where, "optim.grad_clip")
    if "scheduler" in cfg:
        raise TDLMError(f"{where}: remove the 'scheduler' section; the LR schedule is set by optim.* in the run config")
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = opt.setdefault("params", {})
    if not isinstance(params, dict):
        raise TDLMError(f"{where}: optimizer.params must be an object; got {params!r}")
    for key, value in (("lr", run.optim.lr), ("weight_decay", run.optim.weight_decay),
                       ("betas", [run.optim.beta1, run.optim.beta2]), ("eps", run.optim.eps)):
        have = params.get(key, "auto")
        if have != "auto" and have != value:
            raise TDLMError(f"{where}: optimizer.params.{key}={have} contradicts the run config ({value})")
        params[key] = value
    if not on_gpu:
        # The fused CUDA Adam cannot run here and its CPU JIT build costs a minute: use torch's AdamW.
        params["torch_adam"] = True
    bf16 = cfg.setdefault("bf16", {"enabled": "auto"})
    if bf16.get("enabled", "auto") not in ("auto", True, False):
        raise TDLMError(f"{where}: bf16.enabled must be true, false or \"auto\"; got {bf16.get('enabled')!r}")
    want_bf16 = run.model.dtype == "bfloat16" or (run.model.dtype == "auto" and on_gpu)
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = want_bf16
    elif bool(bf16["enabled"]) != want_bf16 and run.model.dtype != "auto":
        raise TDLMError(f"{where}: bf16.enabled={bf16['enabled']} contradicts model.dtype={run.model.dtype}")
    if cfg.get("fp16", {}).get("enabled") is True and not on_gpu:
        raise TDLMError(f"{where}: fp16 is not supported on CPU; use bf16 or fp32")
    cfg.setdefault("steps_per_print", 10**9)  # progress is ours; keep DeepSpeed's own log quiet
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def uses_activation_checkpointing(ds_cfg: dict, run: RunConfig) -> bool:
    if run.train.activation_checkpointing is not None:
        return run.train.activation_checkpointing
    return "activation_checkpointing" in ds_cfg
