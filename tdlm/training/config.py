"""Run configuration of ``launcher/train.py`` (YAML in ``configs/`` only sets these values)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    backbone: str = "tiny-arith"  # preset / shipped name or checkpoint folder (default: the embedded default)
    layers: str | list[int] | None = None  # temporal allocation; None = backbone default (paper 3.1)
    heads: int | None = None
    head_dim: int | None = None
    history: str = "full"  # full / last:k / current (one parallel pass) or latent:M (states in order)
    perceiver_heads: int | None = None  # latent:M only: Perceiver heads (None = heads)
    perceiver_head_dim: int | None = None  # latent:M only: Perceiver head width (None = head_dim)
    # Backbones with a logit shift (Dream): correct the hidden state that predicts a masked token
    # ("prediction") or the one at its own position ("input"); recorded in the adapter. No effect on LLaDA.
    alignment: str = "prediction"
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU; or float32 / bfloat16
    # Start from this adapter folder's weights instead of W_O = 0 (an on-policy round continues its round's adapter);
    # its layers, heads, head_dim and alignment must be this run's. None: a fresh adapter
    init_adapter: str | None = None


@dataclass
class DataConfig:
    trajectories: str = "runs/tiny/trajectories"  # folder of shard-*.parquet (+ manifest.json)
    states: int = 8  # K sampled inputs per trajectory (Section 2.3)
    seed: int = 0  # data order and state sampling
    allow_foreign_backbone: bool = False  # accept shards whose backbone_id differs from the backbone
    # Train on teacher prompts that are evaluation problems (GSM8K test, MATH-500, MBPP test, arith
    # held-out)? Refused by the preflight unless set (tdlm.data.contamination); the overlap is logged either way.
    allow_eval_prompts: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at max_steps
    grad_clip: float = 1.0


@dataclass
class TrainLoopConfig:
    micro_batch_size: int = 4  # trajectories per rank per micro-step
    grad_accum: int = 1
    max_steps: int = 750  # optimizer updates (paper: 750)
    save_every: int = 250  # checkpoint interval in updates (0 = only at the end)
    # ... and in minutes of training (0 = off), so a hard crash loses at most this much; whichever comes first
    save_every_minutes: float = 30.0
    keep_last: int = 2  # checkpoints kept (older ones deleted once the new one verified; 0 = keep all)
    log_every: int = 1
    # How long a collective waits, from the first update on, for a rank that stopped answering before this rank gives
    # up (the process-group timeout; start-up waits use max(this, 600 s)). A dead peer whose connection closes is
    # noticed at once; this bounds a hung or unreachable one. torch's default is 30 minutes; 10 minutes is ample
    # for rank 0 to checksum an 8B run's checkpoint while the others wait.
    dist_timeout_s: float = 600.0
    seed: int = 0
    zero_stage: int | None = None  # None = take the DS config's stage; a number must agree with it
    activation_checkpointing: bool | None = None  # None = on iff the DS config has activation_checkpointing
    verify_frozen: bool = False  # fingerprint the backbone before/after training (summary.checks)
    verify_export: bool = False  # compare engine logits with the exported adapter (summary.checks)


@dataclass
class WandbConfig:
    project: str = "tdlm"
    group: str | None = None  # the experiment / comparison; default: output folder name (a sweep sets its experiment)
    name: str | None = None
    tags: list[str] = field(default_factory=list)  # extra tags; backbone:, layers:, history: are always added
    mode: str | None = None  # None = WANDB_MODE, else offline when no API key is configured
    # values logged with every point of the run (an on-policy round sets onpolicy/round and onpolicy/adapter_version)
    constants: dict = field(default_factory=dict)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    output_dir: str = "runs/train"
