"""DeepSpeed JSON resolution: ``"auto"`` values come from the run config, contradictions are errors.

The files in ``ds_configs/`` hold what is DeepSpeed's business (ZeRO stage, offload, bf16, buckets,
activation checkpointing). Batch sizes, learning rate and clipping live in the run config; a DS file
may leave them ``"auto"`` or repeat them, but a number that disagrees is refused, so the two files
cannot silently train different recipes.

DeepSpeed itself checks the result: :func:`check_with_deepspeed` runs the resolved JSON through
``deepspeed.runtime.config.DeepSpeedConfig`` (the model ``deepspeed.initialize`` builds) before any
process group exists. Its pydantic sections forbid unknown keys, but it ignores unknown *top-level*
keys (``"zero_optimisation"`` would silently train at ZeRO stage 0), so the top-level keys it reads are
recorded while it parses, and any other key is an error with the nearest valid spelling.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

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


def _not_auto_typo(where: str, key: str, have: Any) -> None:
    """A string other than "auto" where a value belongs is a typo, not a contradiction ("atuo")."""
    if isinstance(have, str) and have != "auto":
        hint = ' (did you mean "auto"?)' if difflib.get_close_matches(have.lower(), ["auto"], cutoff=0.5) else ""
        raise TDLMError(f'{where}: {key} must be a value or "auto"; got {have!r}{hint}')


def _agree(cfg: dict, key: str, value, where: str, run_field: str) -> None:
    have = cfg.get(key, "auto")
    _not_auto_typo(where, key, have)
    if have != "auto" and have != value:
        raise TDLMError(f"{where}: {key}={have} contradicts the run config ({run_field} gives {value})")
    cfg[key] = value


def resolve_ds_config(raw: dict, run: RunConfig, world_size: int, on_gpu: bool, where: str = "ds config") -> dict:
    """Fill ``auto`` fields and check the DS JSON against the run config."""
    check_top_level_keys(raw, where)
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
        _not_auto_typo(where, f"optimizer.params.{key}", have)
        if have != "auto" and have != value:
            raise TDLMError(f"{where}: optimizer.params.{key}={have} contradicts the run config ({value})")
        params[key] = value
    # torch's AdamW unless the DS JSON asks for DeepSpeed's FusedAdam ("torch_adam": false, GPU only). FusedAdam is
    # JIT-built with nvcc at the first launch on every fresh node: it needs a CUDA toolkit whose major version matches
    # torch's, and ninja, and every rank waits on the build lock meanwhile. The optimizer steps a few tens of millions
    # of adapter parameters per rank, where fusing buys nothing measurable. On the CPU the fused op cannot run at all.
    # An offloaded optimizer keeps DeepSpeedCPUAdam (torch_adam would replace it), whose build is announced.
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if not on_gpu or ("torch_adam" not in params and str(offload).lower() not in ("cpu", "nvme")):
        params["torch_adam"] = True
    bf16 = cfg.setdefault("bf16", {"enabled": "auto"})
    if bf16.get("enabled", "auto") not in ("auto", True, False):
        hint = (' (did you mean "auto"?)' if isinstance(bf16.get("enabled"), str)
                and difflib.get_close_matches(bf16["enabled"].lower(), ["auto"], cutoff=0.5) else "")
        raise TDLMError(f"{where}: bf16.enabled must be true, false or \"auto\"; got {bf16.get('enabled')!r}{hint}")
    want_bf16 = run.model.dtype == "bfloat16" or (run.model.dtype == "auto" and on_gpu)
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = want_bf16
    elif bool(bf16["enabled"]) != want_bf16 and run.model.dtype != "auto":
        raise TDLMError(f"{where}: bf16.enabled={bf16['enabled']} contradicts model.dtype={run.model.dtype}")
    if cfg.get("fp16", {}).get("enabled") is True:
        # On a GPU DeepSpeed would cast every parameter, the frozen bf16 backbone too, to fp16 (range 65504), and a
        # ZeRO-3 load refuses it with a less clear message; on the CPU DeepSpeed has no fp16 at all.
        raise TDLMError(f"{where}: fp16.enabled=true is not supported (the LLaDA / Dream releases are bf16, and fp16 "
                        f"overflows them); use bf16 or fp32")
    cfg.setdefault("steps_per_print", 10**9)  # progress is ours; keep DeepSpeed's own log quiet
    cfg.setdefault("wall_clock_breakdown", False)
    check_with_deepspeed(cfg, where)
    return cfg


def uses_activation_checkpointing(ds_cfg: dict, run: RunConfig) -> bool:
    if run.train.activation_checkpointing is not None:
        return run.train.activation_checkpointing
    return "activation_checkpointing" in ds_cfg


# -- DeepSpeed's own validation -------------------------------------------------------------------------
class _Recording(dict):
    """A dict that notes every top-level key DeepSpeed's parser asks for (``get``, ``[]``, ``in``, ``keys()``)."""

    def __init__(self, data: dict, seen: set[str], order: list[str]) -> None:
        super().__init__(data)
        self.seen, self.order = seen, order

    def _note(self, key: Any) -> None:
        if isinstance(key, str):
            self.seen.add(key)
            self.order.append(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self._note(key)
        return super().__contains__(key)

    def keys(self):  # ``KEY in param_dict.keys()`` is how several DeepSpeed sections test presence
        outer = self

        class _Keys:
            def __contains__(self, key) -> bool:
                return outer.__contains__(key)

            def __iter__(self):
                return iter(dict.keys(outer))

            def __len__(self) -> int:
                return dict.__len__(outer)

        return _Keys()

    def __copy__(self):
        return _Recording(dict(self), self.seen, self.order)


def _minimal_valid() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9}


def _parse(cfg: dict, seen: set[str], order: list[str]) -> None:
    """Run DeepSpeedConfig on ``cfg``, noting the keys it reads (and in which order) in ``seen``/``order``.
    Needs no process group: without one DeepSpeed takes world size 1, so the batch product is left for it
    to derive."""
    import logging

    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    data = {k: v for k, v in cfg.items() if k != "train_batch_size"}  # checked by _agree against world size
    level = logger.level
    logger.setLevel(logging.ERROR)  # its "Config mesh_device None world_size = 1" info line is not ours
    try:
        DeepSpeedConfig(_Recording(data, seen, order))
    finally:
        logger.setLevel(level)


@functools.lru_cache(maxsize=1)
def deepspeed_top_level_keys() -> frozenset[str]:
    """The top-level keys the installed DeepSpeed's config parser reads (recorded, not a copied list)."""
    seen: set[str] = set()
    _parse(_minimal_valid(), seen, [])
    # Read by DeepSpeed outside DeepSpeedConfig (the engine / launcher), or only when a section is present.
    seen |= {"scheduler", "train_batch_size", "sequence_parallel_size", "autotuning", "flops_profiler", "aio",
             "zero_optimization", "optimizer", "bf16", "fp16", "activation_checkpointing"}
    return frozenset(seen)


def _nearest(key: str, allowed: set[str] | frozenset[str]) -> str:
    near = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(sorted(allowed))}"


def check_top_level_keys(raw: dict, where: str) -> None:
    """An unknown top-level key is ignored by DeepSpeed (the engine runs without it): refuse it here."""
    known = deepspeed_top_level_keys()
    for key in raw:
        if key not in known:
            raise TDLMError(f"{where}: unknown DeepSpeed key {key!r}{_nearest(key, known)}")
    # activation_checkpointing is parsed by a plain-dict reader (not pydantic): compare with its defaults table.
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT

    section = raw.get("activation_checkpointing")
    if isinstance(section, dict):
        for key in section:
            if key not in ACT_CHKPT_DEFAULT:
                raise TDLMError(f"{where}: unknown DeepSpeed key 'activation_checkpointing.{key}'"
                                f"{_nearest(key, set(ACT_CHKPT_DEFAULT))}")


def _model_fields(model: Any) -> dict[str, Any]:
    return getattr(model, "model_fields", {})


def _field_names(model: Any) -> set[str]:
    names: set[str] = set()
    for name, f in _model_fields(model).items():
        names.add(name)
        if f.alias:
            names.add(f.alias)
    return names


def _submodel(model: Any, key: Any) -> Any:
    """The pydantic model behind field ``key`` of ``model`` (through Optional/Union), or None."""
    import typing

    from pydantic import BaseModel

    for name, f in _model_fields(model).items():
        if key in (name, f.alias):
            candidates = [f.annotation, *typing.get_args(f.annotation)]
            for c in candidates:
                if isinstance(c, type) and issubclass(c, BaseModel):
                    return c
    return None


def _find_model(title: str) -> Any:
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    stack = [DeepSpeedConfigModel]
    while stack:
        cls = stack.pop()
        if cls.__name__ == title:
            return cls
        stack.extend(cls.__subclasses__())
    return None


def check_with_deepspeed(cfg: dict, where: str) -> None:
    """Validate a resolved DS JSON with DeepSpeed's own config model; any complaint is one line naming the
    file and the key (with the nearest valid key for a typo), raised before a process group starts."""
    from pydantic import ValidationError

    order: list[str] = []
    try:
        _parse(cfg, set(), order)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        # The section being read when the model refused: the last top-level section DeepSpeed asked for.
        section = next((k for k in reversed(order) if isinstance(cfg.get(k), dict)), None)
        path = ".".join([*([section] if section else []), *loc])
        if err.get("type") == "extra_forbidden":
            model = _find_model(e.title)
            for part in loc[:-1]:
                model = _submodel(model, part) if model is not None else None
            allowed = _field_names(model) if model is not None else set()
            hint = _nearest(loc[-1], allowed) if allowed else ""
            raise TDLMError(f"{where}: unknown DeepSpeed key {path!r}{hint}") from None
        got = err.get("input")
        raise TDLMError(f"{where}: {path}: {err.get('msg')}; got {got!r} (DeepSpeed {e.title})") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TDLMError(f"{where}: DeepSpeed rejects the config: {first}") from None



# -- JIT-compiled DeepSpeed ops: never a silent build, never a silent wait on a stale lock ------------------
SHM_OP = "deepspeed_shm_comm"
# Measured on the 2-core machines (shared notes): g++ time of a first build.
_BUILD_TIME = {SHM_OP: "0.5-4 min", "cpu_adam": "about 35 s", "fused_adam": "about 1 min"}
_WHY = {SHM_OP: "TDLM_CPU_SHM_COMM=1 asks for DeepSpeed's shared-memory CPU all-reduce",
        "cpu_adam": "zero_optimization.offload_optimizer runs DeepSpeedCPUAdam",
        "fused_adam": "optimizer AdamW uses DeepSpeed's FusedAdam"}


def jit_ops_needed(ds_cfg: dict, on_gpu: bool) -> list[str]:
    """DeepSpeed ops this launch would JIT-build (before checking whether a build is cached)."""
    ops = []
    if not on_gpu and os.environ.get("TDLM_CPU_SHM_COMM", "0") == "1":
        ops.append(SHM_OP)
    opt = ds_cfg.get("optimizer", {})
    adam = str(opt.get("type", "")).lower() in ("adam", "adamw")
    offload = ds_cfg.get("zero_optimization", {}).get("offload_optimizer", {}) or {}
    if adam and str(offload.get("device", "none")).lower() in ("cpu", "nvme"):
        ops.append("cpu_adam")
    elif adam and on_gpu and not opt.get("params", {}).get("torch_adam", False):
        ops.append("fused_adam")
    return ops


def _build_dir(op: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op, verbose=False))


def _someone_builds_in(folder: Path) -> int | None:
    """pid of a live process working in ``folder`` (ninja and the compilers run there), else None."""
    target = str(folder.resolve())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "cwd") == target:
                return int(proc.name)
        except OSError:
            continue
    return None


def check_jit_op(op: str, rank: int = 0) -> None:
    """Say before a JIT build starts (what, why, how long), and refuse to wait on a stale lock.

    torch's extension loader waits, without output and without a time limit, while ``<build dir>/lock``
    exists; an interrupted build leaves it behind, so every later launch would hang.
    """
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(op, False):
        return  # precompiled at install time
    folder = _build_dir(op)
    lock = folder / "lock"
    if lock.exists():
        pid = _someone_builds_in(folder)
        if pid is None:
            raise TDLMError(f"{lock}: a stale lock left by an interrupted build of DeepSpeed's {op} op (no process is "
                            f"building in {folder}); remove it (rm {lock}) and launch again")
        if rank == 0:
            print(f"note: waiting for process {pid}, which is building DeepSpeed's {op} op in {folder}",
                  file=sys.stderr, flush=True)
        return
    if rank == 0:
        # Even with a built .so in the folder ninja may rebuild (a copied or raced cache did, measured): always say so.
        state = "its cached build there may be reused" if any(folder.glob(f"{op}*.so")) else "nothing is cached yet"
        print(f"note: DeepSpeed will now JIT-compile its {op} op ({_WHY.get(op, 'needed by this config')}); a build "
              f"takes {_BUILD_TIME.get(op, 'a few minutes')} and goes to {folder} ({state})", file=sys.stderr,
              flush=True)


def prepare_jit_ops(ds_cfg: dict, on_gpu: bool, rank: int = 0) -> list[str]:
    """Before ``deepspeed.init_distributed``: choose the CPU comm path and announce/check each JIT build.

    On CPU DeepSpeed's TorchBackend builds ``deepspeed_shm_comm`` when the process group starts, but the op
    only serves ``inference_all_reduce`` (tensor-parallel inference kernels); training's gradient reductions
    go through ``torch.distributed.all_reduce`` (gloo) either way. So by default it is marked incompatible
    (``deepspeed.ops.__compatible_ops__`` is DeepSpeed's own probe cache, kept in the module so edits to it
    persist) and no build happens; ``TDLM_CPU_SHM_COMM=1`` keeps DeepSpeed's behaviour. Returns the ops that
    may be built.
    """
    if not on_gpu and os.environ.get("TDLM_CPU_SHM_COMM", "0") != "1":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__[SHM_OP] = False
    ops = jit_ops_needed(ds_cfg, on_gpu)
    for op in ops:
        check_jit_op(op, rank)
    return ops
