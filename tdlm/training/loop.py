"""Training the temporal modules with DeepSpeed (paper Section 2.3 objective, Eq. 5).

The recipe, as numbered steps (each a function below):

1. ``setup``: distributed init, resolve the DS JSON against the run config, load the frozen backbone
   (partitioned at load under ``deepspeed.zero.Init`` for ZeRO-3), attach the temporal modules, build
   the per-rank trajectory stream and a DeepSpeed engine that owns only the temporal parameters.
2. ``train_step``: the step's micro-batches are built first so the *global* supervised-token count
   is known (all-reduced); each micro-batch runs the parallel forward over its K sampled states, the
   LM head only at its supervised positions, and backpropagates ``sum CE / (global_tokens / (world * accum))``.
   DeepSpeed's own 1/accum and 1/world averaging then leaves exactly Eq. 5: the mean CE over every
   supervised token of the step.
3. logging (rank 0): loss, supervised tokens/s, step time, peak memory, LR -> progress bar,
   ``metrics.jsonl`` and W&B; checkpoints every ``save_every`` steps and at the end.
4. ``export_adapter``: gathers the fp32 master weights of the temporal modules and writes
   ``adapter.safetensors`` + ``adapter_config.json`` (usable with ``TDLM.from_adapter``, no DeepSpeed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import time
from pathlib import Path

import torch

from tdlm.config import to_dict
from tdlm.data.contamination import check_trajectory_prompts
from tdlm.data.stream import TrajectoryStream, shard_paths, verify_manifest
from tdlm.data.trajectories import IGNORE_INDEX, trajectory_loss
from tdlm.errors import TDLMError
from tdlm.temporal.model import TDLM, TemporalConfig
from tdlm.tracking import (
    NullTracker,
    Tracker,
    experiment_group,
    previous_run_id,
    run_tags,
    start_detached_service,
    wandb_mode,
)
from tdlm.training.checkpoint import load_checkpoint, save_checkpoint, stop_at_boundary
from tdlm.training.config import RunConfig
from tdlm.training.distributed import (
    START_TIMEOUT_S,
    agree_to_stop,
    broadcast_launch_id,
    is_peer_failure,
    peer_lost,
    set_collective_timeout,
    start_process_group,
)
from tdlm.training.ds_config import prepare_jit_ops, resolve_ds_config, uses_activation_checkpointing
from tdlm.training.run_dir import (
    CHECKPOINT_DIR,
    ROLL,
    STOP,
    RollCall,
    RunAborted,
    RunLock,
    Stopped,
    check_run_dir,
    finished_step,
    keep_old_config,
    launcher_ancestors,
    signal_name,
    stop_verb,
)
from tdlm.training.session import Session


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def peak_memory_mb(device: torch.device) -> float:
    """This rank's peak: memory *reserved* by the CUDA caching allocator (what an OOM is decided on), or
    the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def supervised_ce(model, batch) -> torch.Tensor:
    """Sum of Eq. 5's cross-entropy over the batch's supervised tokens; the LM head runs only there."""
    select = batch.labels != IGNORE_INDEX  # (B, K, L)
    logits = model(batch.input_ids, batch.prompt_len, attention_mask=batch.attention_mask, select=select)
    ce_sum, _ = trajectory_loss(logits, batch.labels[select])  # logits (S, V)
    return ce_sum



def _dtype(run: RunConfig, on_gpu: bool) -> torch.dtype:
    if run.model.dtype == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[run.model.dtype]


def validate_run(run: RunConfig, source: str = "run config") -> None:
    """Every field's range, before anything runs (no backbone, no cluster, no trajectories needed)."""
    from tdlm.temporal.history import HistoryPolicy
    from tdlm.temporal.model import ALIGNMENTS

    def bad(field: str, want: str, got) -> TDLMError:
        return TDLMError(f"{source}: {field} must be {want}; got {got!r}")

    m, d, o, t = run.model, run.data, run.optim, run.train
    if m.dtype not in ("auto", "float32", "bfloat16"):
        raise bad("model.dtype", "auto, float32 or bfloat16", m.dtype)
    if m.alignment not in ALIGNMENTS:
        raise bad("model.alignment", " or ".join(ALIGNMENTS), m.alignment)
    for name in ("heads", "head_dim", "perceiver_heads", "perceiver_head_dim"):
        v = getattr(m, name)
        if v is not None and v < 1:
            raise bad(f"model.{name}", ">= 1 (or null for the backbone's default)", v)
    try:
        HistoryPolicy.parse(m.history)
    except TDLMError as e:
        raise TDLMError(f"{source}: model.history: {e}") from e
    if d.states < 1:
        raise bad("data.states", ">= 1", d.states)
    checks = [
        ("optim.lr", o.lr, o.lr > 0, "> 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("optim.beta1", o.beta1, 0 <= o.beta1 < 1, "in [0, 1)"),
        ("optim.beta2", o.beta2, 0 <= o.beta2 < 1, "in [0, 1)"),
        ("optim.eps", o.eps, o.eps > 0, "> 0"),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
        ("optim.min_lr_ratio", o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
        ("optim.grad_clip", o.grad_clip, o.grad_clip >= 0, ">= 0 (0 = no clipping)"),
        ("train.micro_batch_size", t.micro_batch_size, t.micro_batch_size >= 1, ">= 1"),
        ("train.grad_accum", t.grad_accum, t.grad_accum >= 1, ">= 1"),
        ("train.max_steps", t.max_steps, t.max_steps >= 1, ">= 1"),
        ("train.save_every", t.save_every, t.save_every >= 0, ">= 0 (0 = only at the end)"),
        ("train.save_every_minutes", t.save_every_minutes, t.save_every_minutes >= 0, ">= 0 (0 = off)"),
        ("train.keep_last", t.keep_last, t.keep_last >= 0, ">= 0 (0 = keep every checkpoint)"),
        ("train.log_every", t.log_every, t.log_every >= 1, ">= 1"),
        ("train.dist_timeout_s", t.dist_timeout_s, t.dist_timeout_s > 0, "> 0 (seconds)"),
    ]
    for field, value, ok, want in checks:
        if not ok or (isinstance(value, float) and value != value):
            raise bad(field, want, value)
    if t.zero_stage is not None and t.zero_stage not in (0, 1, 2, 3):
        raise bad("train.zero_stage", "0, 1, 2, 3 or null", t.zero_stage)
    if run.wandb.mode not in (None, "online", "offline", "disabled"):
        raise bad("wandb.mode", "online, offline, disabled or null", run.wandb.mode)
    if not run.output_dir:
        raise bad("output_dir", "a folder", run.output_dir)


def preflight_config(run: RunConfig, ds_raw: dict, world_size: int, on_gpu: bool, source: str = "run config",
                     ds_source: str = "ds config") -> dict:
    """The checks that need neither trajectories nor a process group: fields, DS JSON, backbone, layers."""
    from tdlm.models.loading import load_backbone_meta

    validate_run(run, source)
    ds_cfg = resolve_ds_config(ds_raw, run, world_size, on_gpu, where=ds_source)
    m = run.model
    try:
        meta = load_backbone_meta(m.backbone)
    except TDLMError as e:
        raise TDLMError(f"{source}: model.backbone={m.backbone!r}: {e}") from e
    try:
        resolved = temporal_config(run).resolved(meta)
    except TDLMError as e:
        raise TDLMError(
            f"{source}: model.layers={m.layers!r}, model.heads={m.heads!r}, model.head_dim={m.head_dim!r} do not fit "
            f"{meta.family} with {meta.num_layers} layers of width {meta.hidden_size}: {e}"
        ) from e
    if m.init_adapter:
        check_init_adapter(m.init_adapter, resolved, source)
    return ds_cfg


INIT_FIELDS = ("layers", "heads", "head_dim", "alignment")


def check_init_adapter(directory: str, resolved: TemporalConfig, source: str = "run config") -> None:
    """model.init_adapter names an adapter folder whose temporal layout is this run's (one line otherwise)."""
    from tdlm.temporal.adapter_files import ADAPTER_WEIGHTS, adapter_config_path, read_config

    d = Path(directory)
    if not (d / ADAPTER_WEIGHTS).is_file():
        raise TDLMError(f"{source}: model.init_adapter={directory!r} holds no {ADAPTER_WEIGHTS} (an adapter folder "
                        f"written by a training run)")  # fmt: skip
    raw = read_config(adapter_config_path(d))
    have = {"layers": list(raw.get("layers") or []), "heads": raw.get("heads"), "head_dim": raw.get("head_dim"),
            "alignment": raw.get("alignment", "input")}  # fmt: skip
    want = {"layers": list(resolved.layers), "heads": resolved.heads, "head_dim": resolved.head_dim,
            "alignment": resolved.alignment}  # fmt: skip
    differ = [f"{k}={have[k]!r} (this run: {want[k]!r})" for k in INIT_FIELDS if have[k] != want[k]]
    if differ:
        raise TDLMError(f"{source}: model.init_adapter={directory!r} does not fit this run's adapter: "
                        f"{'; '.join(differ)}")  # fmt: skip


def load_init_adapter(model: TDLM, directory: str) -> None:
    """Load model.init_adapter's temporal weights into ``model`` before DeepSpeed partitions them (every rank; the
    backbone it was trained on is checked when the backbone is not partitioned)."""
    from tdlm.temporal import adapter_files

    files = adapter_files.read_adapter(model.backbone, directory, history=str(model.policy))
    adapter_files.load_adapter_weights(model, files)


def preflight(run: RunConfig, ds_raw: dict, world_size: int, on_gpu: bool, source: str = "run config",
              ds_source: str = "ds config", check_prompts: bool = True) -> dict:
    """Every check that can fail on user input, before any process group or weight exists.

    :func:`preflight_config` (fields, the DS JSON against the run config, the backbone and layer allocation
    on the meta device), then the trajectories: a complete generation manifest whose shard checksums
    match, every shard valid for the backbone, and no teacher prompt that is an evaluation problem
    unless ``data.allow_eval_prompts``.
    """
    from tdlm.models.loading import load_backbone_meta

    ds_cfg = preflight_config(run, ds_raw, world_size, on_gpu, source, ds_source)
    meta = load_backbone_meta(run.model.backbone)
    shard_paths(run.data.trajectories)
    verify_manifest(run.data.trajectories)
    TrajectoryStream(run.data.trajectories, meta, run.data.states, run.train.micro_batch_size, world_size, 0,
                     run.data.seed, run.data.allow_foreign_backbone)
    if check_prompts:
        check_trajectory_prompts(run.data.trajectories, run.data.allow_eval_prompts)
    return ds_cfg


PROMPTS_CHECKED = "prompts_checked.json"  # in the run folder: the trajectories whose prompts passed the check


def check_prompts_once(run: RunConfig, rank: int) -> bool:
    """The evaluation-overlap check of the teacher prompts, by rank 0 only, and once per set of trajectories in a
    run folder: a resume of the same trajectories (the same manifest, whose shard checksums every launch verifies)
    does not redo it. Building the evaluation hashes took 27 s per rank per launch for the toy tasks on a loaded
    2-core machine, with the same answer every time. Returns whether it ran. Other ranks skip it: rank 0's error
    ends the launch (the launcher stops the other ranks)."""
    import hashlib

    if rank != 0:
        return False
    record = Path(run.output_dir) / PROMPTS_CHECKED
    key = {"manifest_sha256": hashlib.sha256((Path(run.data.trajectories) / "manifest.json").read_bytes()).hexdigest(),
           "allow_eval_prompts": run.data.allow_eval_prompts}
    try:
        if json.loads(record.read_text()) == key:
            return False
    except (OSError, json.JSONDecodeError):
        pass
    check_trajectory_prompts(run.data.trajectories, run.data.allow_eval_prompts)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(key) + "\n")
    except OSError:  # only a cache: a torn record does not parse, and the next launch checks again
        pass
    return True


def temporal_config(run: RunConfig) -> TemporalConfig:
    """The adapter the run trains (``model.*`` of the run config)."""
    m = run.model
    return TemporalConfig(layers=m.layers, heads=m.heads, head_dim=m.head_dim, history=m.history,
                          perceiver_heads=m.perceiver_heads, perceiver_head_dim=m.perceiver_head_dim,
                          alignment=m.alignment)


def frozen_fingerprint(model: TDLM) -> str:
    """sha256 over the backbone's weights (gathered one at a time under ZeRO-3; collective)."""
    import hashlib

    import deepspeed

    h = hashlib.sha256()
    for name, p in model.backbone.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def setup(run: RunConfig, ds_raw: dict, resume: bool = False, source: str = "run config",
          ds_source: str = "ds config", allow_recipe_change: bool = False, lock: RunLock | None = None) -> Session:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from tdlm.models.loading import load_backbone, load_backbone_partitioned

    acc = get_accelerator()
    on_gpu = acc.device_name() == "cuda"
    # Rank 0 holds the run folder for the whole run: a second launch on it fails here, at once.
    if lock is None and int(os.environ.get("RANK", "0")) == 0:
        lock = RunLock(run.output_dir)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    check_run_dir(run, resume, allow_recipe_change, world_env)
    service = None  # rank 0 under a launcher: W&B's service outside the rank's process tree (start_detached_service)
    if int(os.environ.get("RANK", "0")) == 0 and launcher_ancestors() and wandb_mode(run.wandb.mode) != "disabled":
        service = start_detached_service()  # starts now, in the background; used once the W&B run opens
    ds_pre = preflight(run, ds_raw, world_env, on_gpu, source, ds_source, check_prompts=False)
    check_prompts_once(run, int(os.environ.get("RANK", "0")))
    # No silent JIT build at process-group start, no endless wait on a stale build lock (ds_config.py).
    prepare_jit_ops(ds_pre, on_gpu, int(os.environ.get("RANK", "0")))
    if STOP.requested:  # no process group yet to agree in, and nothing to save: each rank stops on its own
        raise Stopped(f"{stop_verb(STOP.signum)} ({signal_name(STOP.signum)}) before the first update; nothing "
                      f"saved; " + ("resume with --resume" if resume else "run the same command again"), None)
    # Start-up (imports, rank 0's prompt check, loading) differs between ranks by minutes on a loaded node: the
    # short train.dist_timeout_s applies from the first update on (set_collective_timeout), not to these waits.
    # Each rank is bound to its own GPU before its first collective (tdlm.training.distributed).
    rank, world, device = start_process_group(acc, max(run.train.dist_timeout_s, START_TIMEOUT_S))
    # Who is who, so that a rank left alone after a collective failed can name the one that is gone (RollCall);
    # rank 0 first clears the records of earlier launches.
    if rank == 0:
        shutil.rmtree(Path(run.output_dir) / ROLL, ignore_errors=True)
    roll = RollCall(run.output_dir, broadcast_launch_id(device), rank, world)
    torch.manual_seed(run.train.seed)
    ds_cfg = resolve_ds_config(ds_raw, run, world, on_gpu, where=ds_source)
    dtype = _dtype(run, on_gpu)
    stage = int(ds_cfg["zero_optimization"].get("stage", 0))
    if stage == 3:
        backbone = load_backbone_partitioned(run.model.backbone, ds_cfg, dtype=dtype)
    else:
        backbone = load_backbone(run.model.backbone, dtype=dtype, device=device)
    model = TDLM(backbone, temporal_config(run))
    if run.model.init_adapter and not resume:  # a resume restores its checkpoint's weights instead
        load_init_adapter(model, run.model.init_adapter)
    # Adapters attached after a partitioned load are not cast by the engine: match the backbone now.
    model.temporal.to(device=device, dtype=dtype)
    model.activation_checkpointing = uses_activation_checkpointing(ds_cfg, run)
    stream = TrajectoryStream(run.data.trajectories, backbone, run.data.states, run.train.micro_batch_size,
                              world, rank, run.data.seed, run.data.allow_foreign_backbone)
    params = [p for p in model.parameters() if p.requires_grad]
    n_temporal = model.num_temporal_parameters()  # before ZeRO-3 partitions them (numel() 0 afterwards)
    o = run.optim
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=params, config=ds_cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_lambda(s, o.warmup_steps, run.train.max_steps, o.min_lr_ratio)),
    )
    if stage == 3:
        # Some temporal parameters (the sink logit, latent slots) are read directly rather than
        # through a submodule call, so ZeRO-3's per-module hooks would never gather them: declare
        # them used by the root forward.
        for p in model.temporal.parameters():
            deepspeed.zero.register_external_parameter(model, p)
    out = Path(run.output_dir)
    tracker: NullTracker = NullTracker()
    sess = Session(run, ds_cfg, engine, model, stream, device, rank, world, tracker, lock=lock,
                   allow_recipe_change=allow_recipe_change, temporal_parameters=n_temporal, roll=roll)
    if resume:
        sess.start_step = load_checkpoint(sess)
        sess.saved_step = sess.start_step
    sess.saved_at = time.monotonic()
    STOP.immediate = False  # from here on a stop waits for the first update boundary and checkpoints there
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if resume and allow_recipe_change and (out / "run_config.json").exists():
            keep_old_config(out, sess.start_step)
        if not resume or not (out / "run_config.json").exists():
            (out / "run_config.json").write_text(json.dumps(to_dict(run), indent=2) + "\n")
        (out / "ds_config.json").write_text(json.dumps(ds_cfg, indent=2) + "\n")
        config = to_dict(run) | {"resolved": {"layers": model.layer_ids, "heads": model.config.heads,
                                              "head_dim": model.config.head_dim, "world_size": world,
                                              "zero_stage": stage, "dtype": str(dtype),
                                              "activation_checkpointing": model.activation_checkpointing,
                                              "temporal_parameters": n_temporal}}
        tags = run_tags(backbone.backbone_id or run.model.backbone, run.model.layers or model.layer_ids,
                        str(model.policy), run.wandb.tags)
        recipe = {k: v for k, v in to_dict(run).items() if k not in ("output_dir", "wandb")}
        group = experiment_group(run.wandb.group, source, recipe)  # not the folder name: "train" is everyone's
        # A resume continues the interrupted W&B run (same id, resume="allow") rather than opening a second one.
        previous = previous_run_id(out) if resume else None
        sess.tracker = Tracker(out, run.wandb.project, group, run.wandb.name, config,
                               run.wandb.mode, tags=tags, resume_id=previous, service=service)
        if resume:
            sess.tracker.truncate(sess.start_step)
            wb = f"; W&B run {previous}" if previous else ""
            print(f"resuming from step {sess.start_step} ({out / CHECKPOINT_DIR / f'step-{sess.start_step}'}{wb})",
                  flush=True)
    return sess


# -- the step --------------------------------------------------------------------------------------
def train_step(sess: Session, step: int) -> dict:
    import torch.distributed as dist

    engine = sess.engine
    accum = sess.run.train.grad_accum
    batches = [b.to(sess.device) for b in sess.stream.step_batches(step, accum)]
    counts = torch.tensor([float(sum(b.num_targets for b in batches))], device=sess.device)
    dist.all_reduce(counts)
    global_tokens = float(counts.item())
    norm = max(global_tokens, 1.0) / (sess.world * accum)
    lrs = engine.get_lr()
    lr = lrs[0] if lrs else float("nan")  # the rate this step's update uses (the scheduler moves after it)
    t0 = time.perf_counter()
    ce_total = torch.zeros((), device=sess.device, dtype=torch.float64)
    for b in batches:
        ce_sum = supervised_ce(engine, b)
        engine.backward(ce_sum / norm)
        engine.step()
        ce_total += ce_sum.detach().double()
    dist.all_reduce(ce_total)
    if sess.device.type == "cuda":
        torch.cuda.synchronize(sess.device)
    dt = time.perf_counter() - t0
    # The largest rank decides an OOM: log the maximum over ranks, not rank 0's own.
    peak = torch.tensor([peak_memory_mb(sess.device)], device=sess.device, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "loss": float(ce_total.item()) / max(global_tokens, 1.0),
        "supervised_tokens": int(global_tokens),
        "tokens_per_s": global_tokens / dt,
        "step_time_s": dt,
        "lr": lr,
        "peak_mem_mb": float(peak.item()),
    }


def export_adapter(sess: Session, directory: str | Path) -> Path | None:
    """fp32 master weights of the temporal modules -> adapter folder (collective; rank 0 writes)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from tdlm.temporal.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    state = {}
    for name, p in sess.model.temporal.named_parameters():
        full = safe_get_full_fp32_param(p)  # collective under ZeRO-3
        if full is None:  # stage 0: the module weight is the master
            full = p.detach().float()
        state[f"temporal.{name}"] = full.detach().cpu().float().contiguous()
    if sess.rank != 0:
        return None
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = sess.model.adapter_config() | {"training": training_record(sess)}
    (out / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def training_record(sess: Session) -> dict:
    """What the adapter records about the run that trained it: the recipe, the teacher trajectories, the run folder
    and its W&B run (so an evaluation, a model card or a Hub reader can name it)."""
    run, t, o = sess.run, sess.run.train, sess.run.optim
    teacher = {}
    manifest = Path(run.data.trajectories) / "manifest.json"
    if manifest.exists():
        settings = json.loads(manifest.read_text()).get("settings") or {}
        teacher = {k: settings[k] for k in ("decode", "prompts", "dtype") if k in settings}
    wandb_run = {k: sess.tracker.record.get(k) for k in ("id", "project", "group", "name", "url")
                 } if getattr(sess.tracker, "record", None) else None  # fmt: skip
    return {
        "steps": t.max_steps,
        "trajectories": len(sess.stream),
        "allocation": run.model.layers,
        "recipe": {"states": run.data.states, "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum,
                   "world_size": sess.world, "global_batch": t.micro_batch_size * t.grad_accum * sess.world,
                   "lr": o.lr, "weight_decay": o.weight_decay, "betas": [o.beta1, o.beta2],
                   "warmup_steps": o.warmup_steps, "min_lr_ratio": o.min_lr_ratio, "grad_clip": o.grad_clip,
                   "seed": t.seed, "data_seed": run.data.seed},
        "teacher": teacher,
        "run_dir": str(Path(run.output_dir).resolve()),
        "wandb": wandb_run,
    }


def verify_export(sess: Session, adapter_dir: Path) -> float | None:
    """Max |logit difference| between the engine and ``TDLM.from_adapter`` on a probe batch.

    All ranks run the engine forward (collective under ZeRO-3); rank 0 loads the exported adapter
    onto a fresh, non-distributed copy of the backbone and compares.
    """
    from tdlm.models.loading import load_backbone

    probe = sess.stream.micro_batch(0).to(sess.device)
    select = probe.labels != IGNORE_INDEX  # full-vocabulary logits of every position would not fit at 8B
    sess.engine.eval()
    with torch.no_grad():
        ref = sess.engine(probe.input_ids, probe.prompt_len, attention_mask=probe.attention_mask, select=select)
    sess.engine.train()
    if sess.rank != 0:
        return None
    bb = load_backbone(sess.run.model.backbone, dtype=ref.dtype, device=sess.device)
    fresh = TDLM.from_adapter(bb, adapter_dir, history=sess.run.model.history)
    fresh.temporal.to(ref.dtype)
    with torch.no_grad():
        out = fresh.forward_states(probe.input_ids, probe.prompt_len, attention_mask=probe.attention_mask,
                                   select=select)
    return float((out.float() - ref.float()).abs().max())


def _updates(sess: Session, progress: bool) -> tuple[dict, int, dict, Path]:
    """Every collective part of a run after setup: the updates with their checkpoints, the final checkpoint, the
    export and its checks. Returns (last metrics, supervised tokens, checks, adapter folder)."""
    run = sess.run
    total = run.train.max_steps
    fingerprint = frozen_fingerprint(sess.model) if run.train.verify_frozen else None
    bar = None
    if sess.rank == 0 and progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=sess.start_step, desc="train", unit="step", dynamic_ncols=True)
    last: dict = {}
    tokens_seen = 0
    set_collective_timeout(run.train.dist_timeout_s)
    try:
        for step in range(sess.start_step, total):
            sess.step = step
            signum, timed = agree_to_stop(sess)  # the update boundary: every rank takes the same decision here
            if signum:
                stop_at_boundary(sess, step, signum, bar)
            if timed and sess.saved_step != step:
                save_checkpoint(sess, step)
            metrics = train_step(sess, step)
            tokens_seen += metrics["supervised_tokens"]
            last = metrics
            done = sess.step = step + 1
            if done % run.train.log_every == 0 or done == total:
                sess.tracker.log({**metrics, **run.wandb.constants}, done)
            if bar is not None:
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                bar.update(1)
            if run.train.save_every and done % run.train.save_every == 0 and done != total:
                save_checkpoint(sess, done)
    finally:
        if bar is not None:
            bar.close()
    save_checkpoint(sess, total)
    adapter_dir = Path(run.output_dir) / "adapter"
    export_adapter(sess, adapter_dir)
    checks: dict = {}
    if fingerprint is not None:
        checks["frozen_backbone_unchanged"] = frozen_fingerprint(sess.model) == fingerprint
    if run.train.verify_export:
        checks["export_max_abs_diff"] = verify_export(sess, adapter_dir)
    return last, tokens_seen, checks, adapter_dir


def train(run: RunConfig, ds_raw: dict, resume: bool = False, progress: bool = True,
          source: str = "run config", ds_source: str = "ds config", allow_recipe_change: bool = False) -> dict:
    """Run the whole job; returns the summary (rank 0; other ranks return an empty dict).

    Resuming a finished run changes nothing and returns its summary.
    """
    world_env, rank_env = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    lock = RunLock(run.output_dir) if rank_env == 0 else None  # first: nothing may race a live run
    if resume and check_run_dir(run, resume, allow_recipe_change, world_env) == "finished":
        out = Path(run.output_dir)
        if rank_env == 0:
            print(f"{out}: this run finished at step {finished_step(out)} (summary.json); nothing to resume",
                  flush=True)
            lock.release()
        return json.loads((out / "summary.json").read_text()) if rank_env == 0 else {}
    sess = setup(run, ds_raw, resume, source, ds_source, allow_recipe_change, lock)
    t_start = time.perf_counter()
    try:
        last, tokens_seen, checks, adapter_dir = _updates(sess, progress)
    except (Stopped, RunAborted):
        raise
    except Exception as e:
        if not is_peer_failure(e):
            raise
        raise peer_lost(sess, e) from None
    total = run.train.max_steps
    summary: dict = {}
    if sess.rank == 0:
        sess.roll.close()
        summary = {
            "checks": checks,
            "steps": total,
            "resumed_from": sess.start_step,
            "final_loss": last.get("loss"),
            "supervised_tokens": tokens_seen,
            "wall_s": time.perf_counter() - t_start,
            "peak_mem_mb": last.get("peak_mem_mb"),
            "temporal_parameters": sess.temporal_parameters,
            "layers": sess.model.layer_ids,
            "world_size": sess.world,
            "zero_stage": int(sess.ds_config["zero_optimization"].get("stage", 0)),
            "adapter": str(adapter_dir),
            "config": dataclasses.asdict(run),
        }
        artifact = sess.tracker.log_adapter(adapter_dir, metadata={
            "layers": sess.model.layer_ids, "temporal_parameters": sess.temporal_parameters,
            "history": str(sess.model.policy), "backbone": sess.model.backbone.backbone_id, "steps": total})
        if artifact:
            summary["adapter_artifact"] = artifact
        sess.tracker.finish(summary)
    return summary
