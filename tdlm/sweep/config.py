"""The allocation sweep's config (``configs/sweep_*.yaml`` only set these fields) and the per-allocation plan.

A sweep trains one adapter per layer allocation from the *same* run config (``train_config`` + ``train_overrides``,
so the same trajectories, seeds and recipe; only ``model.layers`` differs) and evaluates each on the same problems.
Every allocation is validated against the backbone on the meta device before anything runs.

With ``seeds: [0, 1, 2]`` every allocation is trained once per training seed (``train.seed``; the trajectories, their
order and the sampled states - ``data.seed`` - stay the sweep's): each (allocation, seed) is a *trial* named
``<allocation slug>-seed<k>`` (:func:`trial_slug`), and the W&B runs of one allocation's seeds share a group
(:func:`wandb_group`). Without ``seeds`` (the default, ``null``) there is one trial per allocation at the run config's
``train.seed``, named by the allocation alone, as before seeds were an axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tdlm.config import apply_overrides, check_override_keys, from_dict, load_yaml, to_dict
from tdlm.errors import TDLMError
from tdlm.training.config import RunConfig

SWEEP_RECORD = "sweep.json"  # in output_dir: the sweep's settings, trajectories and seeds (tdlm.sweep.trial)
TRIAL_RECORD = "trial.json"  # in output_dir/trials/<slug>/

# Table 4 of the paper (LLaDA-8B, 32 layers): 8 dispersed, 16 middle, 16 dispersed (main), 32 all.
TABLE4 = ["dispersed:8", "middle:16", "dispersed:16", "all"]


@dataclass
class SweepEvalConfig:
    """What every allocation is evaluated on (fields of :class:`tdlm.evaluation.EvalConfig`)."""

    tasks: list[str] = field(default_factory=lambda: ["gsm8k"])
    limit: int | None = None  # first N problems of each task (None = all)
    thresholds: list[float] = field(default_factory=lambda: [0.9])  # tau of tdlm and of the threshold baseline
    baselines: list[str] = field(default_factory=lambda: ["original", "threshold"])  # decoded once per sweep
    gen_length: int = 256
    block_size: int = 32
    batch_size: int = 1
    dtype: str | None = None  # None = the checkpoint's torch_dtype
    data_dir: str | None = None  # benchmark JSONL dir (None = $TDLM_DATA_DIR, the Hub, data/benchmarks)
    workers: int | None = None  # None = one per visible GPU (at least 1; 1 = in-process)
    threads: int | None = None


@dataclass
class SweepConfig:
    experiment: str = "table4"  # W&B group of every run (training, evaluation, trials) and the sweep's name
    train_config: str = "configs/llada_8b.yaml"  # the run config every allocation starts from
    ds: str = "ds_configs/zero3.json"
    allocations: list[str] = field(default_factory=lambda: list(TABLE4))  # model.layers of each trial
    train_overrides: list[str] = field(default_factory=list)  # section.key=value for every allocation
    # The command before launcher/train.py: ["deepspeed"] (all local GPUs), ["deepspeed", "--num_gpus", "2"],
    # ["deepspeed", "--hostfile", "hostfile"], ["torchrun", "--nproc_per_node", "8"].
    launcher: list[str] = field(default_factory=lambda: ["deepspeed"])
    output_dir: str = "runs/sweeps/table4"
    project: str = "tdlm"  # W&B project of training and evaluation alike
    wandb_mode: str | None = None  # online | offline | disabled; None = WANDB_MODE, else online with a key
    eval: SweepEvalConfig = field(default_factory=SweepEvalConfig)
    # Training seeds (train.seed): each allocation is trained once per seed on the same trajectories; trials are
    # named <slug>-seed<k> and Table 4 reports mean ± sd over seeds. None = one trial per allocation at the run
    # config's train.seed, named <slug> (the layout of sweeps before seeds were an axis).
    seeds: list[int] | None = None


@dataclass
class AllocationPlan:
    spec: str  # as written in the sweep config (model.layers)
    slug: str  # folder / W&B name: dispersed-8, middle-16, all, layers-1-3-5
    layers: list[int]  # resolved zero-based indices
    num_layers: int  # of the backbone
    parameters: int  # trainable temporal parameters of the adapter
    run: RunConfig  # the run config of this trial (before output_dir / wandb are set)
    seed: int | None = None  # the trial's training seed when the sweep has seeds (run.train.seed is set to it)
    experiment: str = ""  # the sweep's experiment (W&B group of a sweep without seeds)

    @property
    def trial(self) -> str:
        """The trial's name: its folders (train/, eval/, trials/), W&B run names and evaluation adapter label."""
        return trial_slug(self.slug, self.seed)

    @property
    def group(self) -> str:
        """The W&B group of the trial's training, evaluation and trial runs."""
        return wandb_group(self.experiment, self.slug, self.seed)


def trial_slug(allocation_slug: str, seed: int | None) -> str:
    """``dispersed-8`` (a sweep without seeds) or ``dispersed-8-seed1``."""
    return allocation_slug if seed is None else f"{allocation_slug}-seed{seed}"


def wandb_group(experiment: str, allocation_slug: str, seed: int | None) -> str:
    """The W&B group of a trial's runs: the experiment for a sweep without seeds; with seeds, one group per
    allocation (``<experiment>-<slug>``), so W&B's UI averages an allocation's seeds (mean and spread per group)."""
    return experiment if seed is None else f"{experiment}-{allocation_slug}"


def slug(spec: str) -> str:
    s = spec.strip().lower()
    if re.fullmatch(r"[\d,\s]+", s):
        return "layers-" + "-".join(x for x in re.split(r"[,\s]+", s) if x)
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-")


def label(spec: str, layers: list[int]) -> str:
    """Table 4's row label: ``16, dispersed (1, 3, ..., 31)``."""
    idx = ", ".join(map(str, layers)) if len(layers) <= 12 else f"{layers[0]}, {layers[1]}, ..., {layers[-1]}"
    s = spec.strip().lower()
    if ":" in s:
        kind, n = s.split(":", 1)
        return f"{n}, {kind} ({idx})"
    if s == "all":
        return f"{len(layers)}, all ({idx})"
    return f"{len(layers)} ({idx})"


def load_sweep_config(path: str | Path | None, overrides: list[str] | None = None) -> SweepConfig:
    """The sweep file + ``key=value`` overrides; a mistake in an override is blamed on the override (``override
    'eval.limt=50': unknown key 'eval.limt'; did you mean 'eval.limit'?``), one in the file on ``file: key``."""
    source = str(path) if path else "sweep config"
    overrides = list(overrides or [])
    check_override_keys(SweepConfig, overrides)
    raw = apply_overrides(load_yaml(path), overrides)
    cfg = from_dict(SweepConfig, raw, source)
    validate(cfg, source, getattr(raw, "origins", {}))
    return cfg


def validate(cfg: SweepConfig, source: str, origins: dict[str, str] | None = None) -> None:
    """Every field's value; ``origins`` (``key`` -> override label) names the override that set a bad one."""
    from tdlm.decoding import POLICIES
    from tdlm.tasks import TASK_NAMES

    def bad(name: str, want: str, got) -> TDLMError:
        parts = name.split(".")
        who = next((origins[".".join(parts[:n])] for n in range(len(parts), 0, -1)
                    if ".".join(parts[:n]) in (origins or {})), None)  # fmt: skip
        return TDLMError(f"{who}: {name} must be {want}; got {got!r}" if who else
                         f"{source}: {name} must be {want}; got {got!r}")

    if not cfg.experiment or not re.fullmatch(r"[A-Za-z0-9._-]+", cfg.experiment):
        raise bad("experiment", "a name of letters, digits, '.', '_' or '-'", cfg.experiment)
    if not cfg.allocations:
        raise bad("allocations", "a non-empty list (e.g. [dispersed:8, middle:16, dispersed:16, all])",
                  cfg.allocations)
    slugs = [slug(a) for a in cfg.allocations]
    if len(set(slugs)) != len(slugs):
        raise bad("allocations", "distinct allocations", cfg.allocations)
    if not cfg.launcher:
        raise bad("launcher", "a command such as [deepspeed] or [deepspeed, --num_gpus, 2]", cfg.launcher)
    if cfg.seeds is not None and (not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds)
                                  or any(k < 0 for k in cfg.seeds)):  # fmt: skip
        raise bad("seeds", "a non-empty list of distinct integers >= 0 (e.g. [0, 1, 2]) or null", cfg.seeds)
    if cfg.wandb_mode not in (None, "online", "offline", "disabled"):
        raise bad("wandb_mode", "online, offline, disabled or null", cfg.wandb_mode)
    for item in cfg.train_overrides:
        key = item.split("=", 1)[0].strip()
        if "=" not in item:
            raise bad("train_overrides", "section.key=value items", item)
        if key in ("model.layers", "output_dir") or key.startswith("wandb."):
            raise bad("train_overrides", f"free of {key} (the sweep sets it per allocation)", item)
        if key == "train.seed" and cfg.seeds is not None:
            raise bad("train_overrides", "free of train.seed when seeds are given (the sweep sets it per trial)", item)
    e = cfg.eval
    for t in e.tasks:
        if t not in TASK_NAMES:
            raise bad("eval.tasks", f"a list of {', '.join(TASK_NAMES)}", e.tasks)
    for p in e.baselines:
        if p not in POLICIES or p == "tdlm":
            raise bad("eval.baselines", f"a list of {', '.join(p for p in POLICIES if p != 'tdlm')}", e.baselines)
    if not e.thresholds or any(not 0.0 <= t <= 1.0 for t in e.thresholds):
        raise bad("eval.thresholds", "a non-empty list of taus in [0, 1]", e.thresholds)
    for name in ("train_config", "ds"):
        if not Path(getattr(cfg, name)).exists():
            raise bad(name, "an existing file", getattr(cfg, name))
    # Each train_overrides item against the run config now, not when the first trial starts; an item given on the
    # command line (train_overrides=[...]) is blamed on that override.
    given = (origins or {}).get("train_overrides")
    base_run(cfg, source, f"{given}: item" if given else None)


def base_run(cfg: SweepConfig, source: str, where: str | None = None) -> RunConfig:
    """The trial run config without the allocation (train_config + train_overrides); a bad item of
    train_overrides is named as ``<where> 'key=value'`` (default ``<sweep file>: train_overrides``)."""
    raw = apply_overrides(load_yaml(cfg.train_config), cfg.train_overrides, where or f"{source}: train_overrides")
    return from_dict(RunConfig, raw, cfg.train_config)


def plan(cfg: SweepConfig, spec: str, source: str, where: str | None = None,
         seed: int | None = None) -> AllocationPlan:  # fmt: skip
    """Resolve one allocation on the backbone's meta copy: indices and parameter count, or one line naming where
    the allocation was written (``where``; default ``<sweep file>: allocations: 'SPEC'``). ``seed``: the trial's
    training seed (a sweep with ``seeds``), set as the run's ``train.seed``."""
    import torch

    from tdlm.models.loading import load_backbone_meta
    from tdlm.temporal.model import TDLM
    from tdlm.training import temporal_config, validate_run

    raw = to_dict(base_run(cfg, source))
    raw["model"]["layers"] = str(spec)  # as text: "3" is one explicit layer, not a number
    if seed is not None:
        raw["train"]["seed"] = int(seed)
    run = from_dict(RunConfig, raw, cfg.train_config)
    validate_run(run, cfg.train_config)
    try:
        meta = load_backbone_meta(run.model.backbone)
        with torch.device("meta"):
            model = TDLM(meta, temporal_config(run))
    except TDLMError as e:
        raise TDLMError(f"{where or f'{source}: allocations: {spec!r}'} on {run.model.backbone}: {e}") from e
    return AllocationPlan(spec=spec, slug=slug(spec), layers=list(model.layer_ids), num_layers=meta.num_layers,
                          parameters=model.num_temporal_parameters(), run=run, seed=seed,
                          experiment=cfg.experiment)  # fmt: skip


def plan_all(cfg: SweepConfig, source: str) -> list[AllocationPlan]:
    return [plan(cfg, spec, source) for spec in cfg.allocations]
