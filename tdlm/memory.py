"""Memory planner for TDLM training: predicted peak memory per GPU, component by component.

Commands (repository root, venv active)::

    python -m tdlm.memory --backbone llada-8b --layers all --states 8 --seq-len 512 --zero 3 --world-size 1 \\
        --checkpointing off
    python -m tdlm.memory --backbone dream-7b --zero 3 --world-size 8 --checkpointing on --micro-batch 4
    python -m tdlm.memory --backbone path/to/LLaDA-8B-Instruct --layers dispersed:16 --json   # reads config.json
    python -m tdlm.memory --table --states 8 --seq-len 512      # the README table (1 and 8 GPUs, ckpt on/off)
    python -m tdlm.memory --measure --backbone tiny-llada --states 8 --seq-len 128 --zero 0   # CPU: real steps

Python::

    from tdlm.memory import plan, measure_peak
    p = plan("llada-8b", layers="all", states=8, seq_len=512, zero=3, world_size=1, checkpointing=False)
    p.total, p.fits, print(p.report())

What is modelled. One training micro-step of the recipe :func:`train_step` (the one ``bench/gpu_train_probe.py``
and :func:`measure_peak` run): ``logits = TDLM.forward_states(ids (B, K, L))`` -> ``trajectory_loss`` (Eq. 5) ->
``backward`` -> AdamW on the temporal parameters. The caller holds ``logits`` until backward ends. Sizes are read
from the model itself (style point 9): the backbone and the TDLM adapter are built on the ``meta`` device, so
parameter counts, the largest ZeRO-3 fetch unit and persistent parameters come from ``named_parameters``, and
block widths from the block modules. Notation: B micro-batch per GPU, K sampled states, L = prompt + response
tokens, N response tokens, S supervised tokens (<= B N: each response token is a target of at most one state),
T = B K L spatial tokens, T_N = B K N temporal tokens, d hidden, F SwiGLU width, V logits width, M x d_h
temporal heads (d_t = M d_h), L_t temporal layers, l0 the lowest temporal layer, n backbone layers, e the bytes
of the compute dtype (2 bf16, 4 fp32), W ranks, P_f / P_t frozen / temporal parameter counts.

Static terms (bytes per GPU)
  * frozen params     e (P_f,persist + P_f,rest / W) at ZeRO-3, else e P_f. DeepSpeed keeps parameters with
                      <= ``stage3_param_persistence_threshold`` elements (default 1e5) whole on every rank.
  * ZeRO-3 gathered   e min(P_rest, max(max_live, U) + prefetch): parameters all-gathered for compute, bounded
                      by ``stage3_max_live_parameters`` (1e9; with the default reuse distance 1e9 the head and the
                      last blocks stay gathered between forward and backward) plus the prefetch bucket (5e7);
                      U = the largest fetch unit (module with direct parameters: the LM head or embedding, V d).
                      At W = 1 DeepSpeed still gathers into separate buffers, so the term applies there too.
  * temporal params   e P_t (partitioned like frozen ones at ZeRO-3).
  * gradients         stage 0: e P_t; stage 1: g P_t; stages 2-3: g P_t / W (g = grad_accum_dtype size, DeepSpeed
                      default = model dtype); 0 at ZeRO-3 with optimizer offload (the partition lives on the CPU).
  * optimizer states  stage 0 (plain torch / DeepSpeed without ZeRO): AdamW moments in the parameter dtype, 2 e P_t.
                      stages >= 1: (4 [fp32 master, absent when e = 4] + 8 [fp32 m, v]) P_t / W; 0 if offloaded.
  * ZeRO buffers      the contiguous-gradient IPG bucket: ``reduce_bucket_size`` (5e8) x g at stage 3,
                      x 4 at stage 1 (fp32 staging), x g at stage 2, doubled by ``overlap_comm`` at stages 1-2.

Activations (saved for backward; per token, from the code paths of ``tdlm/models`` and ``tdlm/model.py``)
  * block, attention  4 d + 4 (RMSNorm input in fp32 + rsqrt) + e (2 q_dim + 2 kv_dim) (q, k after RoPE, v, SDPA
                      output) + 4 H (log-sum-exp). Frozen linears save no inputs (only weights, which need no grad).
                      Fused SDPA (flash / memory-efficient) is assumed: no L x L matrix.
  * block, FFN        4 d + 4 + 3 F e (gate pre-activation, SiLU output, up projection).
  * block             attention + FFN for layers l0 < i < n; the lowest temporal layer's input has no grad
                      (layers below run under no_grad), so it saves only its FFN and temporal terms.
  * temporal layer    per temporal token: 3 d e (each of the W_Q/W_K/W_V linears saves its own contiguous copy of
                      the response slice h[:, P:]) + 2 d_t e (query and output-projection inputs) + 2 d_h e (RoPE
                      cos/sin of q and k); history (the K/V of the K states): 2 d_t e; per (b, p) position:
                      4 M K (K + 1) (sink softmax, fp32) + e M K^2 (its cast, bf16 only) + K^2 (mask).
  * RoPE tables       2 d_head e per token (cos, sin of the forward context).
  * checkpointing on  only each checkpointed block's input, d e per token for layers l0..n-1 (non-reentrant
                      torch.utils.checkpoint), plus one block recomputed during backward.
  * head              4 d + 4 per token (final RMSNorm input in fp32).
  * logits            T V e, (B, K, L, V) in the model dtype, held by the caller through backward; the model
                      computes logits at every position although only S rows carry a loss.
  * loss forward      S V e (gathered rows) + S V 4 (their fp32 copy, bf16 only) + S V 4 (log-softmax, saved).
  * loss backward     3 S V 4 (log-softmax output, its grad, the fp32 input grad).
  * head backward     c T V e + S V e + T d e: the full-size logits gradient (c = 1; Dream's logit shift makes
                      c = 3: the shifted grad and one zero-padded grad per slice) plus the gathered rows' grad.
  * block backward    3 F e + 2 d e per token: grad of the FFN product, SiLU output and up projection are alive
                      together, plus the residual-stream grads.

Peak. total = static + max over phases of the activation-side terms:
  loss forward  A + head + logits + loss forward
  loss backward A + head + logits + loss backward
  head backward A + head + logits + head backward
  block backward (no checkpointing) A + logits + block backward
  block backward (checkpointing)    X + logits + one recomputed layer (block + temporal) + block backward
  optimizer step                   + 2 x the local fp32 (ZeRO) or param-dtype (stage 0) temporal parameters
A = saved activations of all layers, X = checkpointed block inputs. "fits" means total + reserve (CUDA context,
NCCL, allocator fragmentation; 2 GiB by default) <= --gpu-mem. All sizes are GiB (2^30 bytes).

References: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (2020) for
the 2 + 2 + 12 bytes/parameter split; Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022) for per-layer activation accounting; Chen et al., "Training Deep Nets with Sublinear Memory Cost"
(2016) for checkpointing; DeepSpeed 0.19 ``runtime/zero/config.py`` / ``stage3.py`` for the buffer defaults.

Validation: ``tests/test_memory.py`` compares the per-component formulas with a saved-tensor tally, and ``plan``
with the measured peak of real CPU training steps (:func:`measure_peak`); ``bench/gpu_train_probe.py`` does the
same with ``torch.cuda.max_memory_allocated`` at LLaDA-8B size on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tdlm.errors import TDLMError
from tdlm.models.common import Backbone
from tdlm.models.dream import DreamConfig
from tdlm.models.llada import LLaDAConfig
from tdlm.models.loading import PRESETS, _family_of, build_backbone

GiB = 1024**3
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
RELEASES = {"llada-8b": ("llada", LLaDAConfig), "dream-7b": ("dream", DreamConfig)}
# Full-size logits gradients alive at once in the head backward (see the module docstring).
HEAD_GRAD_COPIES = {"llada": 1, "dream": 3}
# Full-size logits alive at once in the head forward (Dream: unshifted + shifted).
HEAD_FWD_COPIES = {"llada": 1, "dream": 2}


# -- backbones ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackboneSpec:
    """A backbone named by release, preset or checkpoint folder: family + release-style config dict."""

    name: str
    family: str
    config_json: str  # json.dumps(config, sort_keys=True): hashable, for caching

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)


def resolve_backbone(spec: str | os.PathLike | LLaDAConfig | DreamConfig | BackboneSpec) -> BackboneSpec:
    """'llada-8b' / 'dream-7b' (release configs), a preset, a folder (or its config.json), or a config object."""
    if isinstance(spec, BackboneSpec):
        return spec
    if isinstance(spec, LLaDAConfig | DreamConfig):
        family = "llada" if isinstance(spec, LLaDAConfig) else "dream"
        return BackboneSpec(f"{family}(custom)", family, json.dumps(spec.to_dict(), sort_keys=True))
    name = str(spec)
    if name.lower() in RELEASES:
        family, cls = RELEASES[name.lower()]
        return BackboneSpec(name.lower(), family, json.dumps(cls().to_dict(), sort_keys=True))
    if name in PRESETS:
        p = PRESETS[name]
        return BackboneSpec(name, p["family"], json.dumps(p["config"], sort_keys=True))
    path = Path(name).expanduser()
    cfg_path = path / "config.json" if path.is_dir() else path
    if path.exists() and cfg_path.name == "config.json" and cfg_path.is_file():
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise TDLMError(f"{cfg_path}: invalid JSON: {e}") from e
        return BackboneSpec(str(path), _family_of(raw, str(cfg_path)), json.dumps(raw, sort_keys=True))
    if path.is_dir():
        raise TDLMError(f"{path}: no config.json (expected a LLaDA or Dream checkpoint folder)")
    known = ", ".join([*RELEASES, *PRESETS])
    raise TDLMError(f"unknown backbone {name!r}: expected one of {known}, or a checkpoint folder with config.json")


@dataclass(frozen=True)
class BackboneCosts:
    """Per-token activation costs of one backbone's blocks (bytes), widths read from its modules.

    ``e`` is the byte size of the compute dtype; see the module docstring for the derivations.
    """

    family: str
    hidden: int  # d
    num_layers: int  # n
    heads: int  # H (spatial)
    head_dim: int  # spatial head width
    q_dim: int  # H * head_dim
    kv_dim: int  # H_kv * head_dim
    ffn: int  # F, SwiGLU inner width
    vocab: int  # V, logits width

    @classmethod
    def of(cls, backbone: Backbone) -> BackboneCosts:
        block = backbone.blocks[0]
        mods = dict(block.named_modules())

        def width(*names: str) -> int:
            for key, mod in mods.items():
                if key.rsplit(".", 1)[-1] in names and isinstance(mod, nn.Linear):
                    return mod.out_features
            raise TDLMError(f"{backbone.family}: block has none of the modules {names}; cannot size activations")

        q_dim = width("q_proj")
        return cls(
            family=backbone.family,
            hidden=backbone.hidden_size,
            num_layers=backbone.num_layers,
            heads=q_dim // backbone.head_dim,
            head_dim=backbone.head_dim,
            q_dim=q_dim,
            kv_dim=width("k_proj"),
            ffn=width("ff_proj", "gate_proj"),
            vocab=backbone.vocab_size,
        )

    def attention_saved(self, e: int) -> int:
        """4 d + 4 + e (2 q_dim + 2 kv_dim) + 4 H: norm input (fp32), rsqrt, q, k, v, SDPA out, log-sum-exp."""
        return 4 * self.hidden + 4 + e * (2 * self.q_dim + 2 * self.kv_dim) + 4 * self.heads

    def ffn_saved(self, e: int) -> int:
        """4 d + 4 + 3 F e: norm input (fp32), rsqrt, gate pre-activation, SiLU output, up projection."""
        return 4 * self.hidden + 4 + 3 * self.ffn * e

    def block_saved(self, e: int) -> int:
        return self.attention_saved(e) + self.ffn_saved(e)

    def rope_tables(self, e: int) -> int:
        """cos + sin of the forward context, 2 d_head e."""
        return 2 * self.head_dim * e

    def head_saved(self) -> int:
        """Final RMSNorm input in fp32 + rsqrt, 4 d + 4 (the frozen LM head saves no input)."""
        return 4 * self.hidden + 4

    def checkpoint_saved(self, e: int) -> int:
        """A checkpointed block keeps only its input, d e."""
        return self.hidden * e

    def backward_working(self, e: int) -> int:
        """3 F e + 2 d e: FFN-product, SiLU and up-projection grads together, plus residual-stream grads."""
        return 3 * self.ffn * e + 2 * self.hidden * e

    @property
    def head_grad_copies(self) -> int:
        return HEAD_GRAD_COPIES.get(self.family, 1)

    @property
    def head_fwd_copies(self) -> int:
        return HEAD_FWD_COPIES.get(self.family, 1)


@dataclass(frozen=True)
class TemporalCosts:
    """Per-layer activation costs of the temporal modules in the parallel training forward."""

    layers: tuple[int, ...]
    hidden: int  # d
    heads: int  # M
    head_dim: int  # d_h

    @property
    def width(self) -> int:
        return self.heads * self.head_dim  # d_t

    def saved_per_token(self, e: int) -> int:
        """d e + 2 d_t e + 2 d_h e per temporal token (T_N = B K N), history excluded.

        One contiguous copy of the response slice of h is shared by W_Q, W_K and W_V.
        """
        return 1 * self.hidden * e + 2 * self.width * e + 2 * self.head_dim * e

    def history_per_token(self, e: int) -> int:
        """The keys and values of every state, 2 d_t e per temporal token."""
        return 2 * self.width * e

    def saved_per_position(self, K: int, e: int) -> int:
        """Per (b, p): sink softmax 4 M K (K+1), its cast e M K^2 (bf16 only) and the history mask K^2."""
        cast = self.heads * K * K * e if e != 4 else 0
        return 4 * self.heads * K * (K + 1) + cast + K * K


@dataclass(frozen=True)
class Inventory:
    """What the meta-built TDLM reports about itself: costs, temporal layout and its parameters."""

    backbone: BackboneCosts
    temporal: TemporalCosts
    params: tuple[tuple[int, bool], ...]  # (numel, trainable) per parameter
    units: tuple[int, ...]  # numel of each module's direct parameters (ZeRO-3 fetch units)
    temporal_numel: int  # TDLM.num_temporal_parameters()

    def numel(self, trainable: bool, persistent: bool | None = None, threshold: int = 0) -> int:
        return sum(
            n for n, t in self.params if t == trainable and (persistent is None or (n <= threshold) == persistent)
        )


@functools.lru_cache(maxsize=64)
def _inventory(spec: BackboneSpec, layers: str | None, heads: int | None, head_dim: int | None) -> Inventory:
    from tdlm.model import TDLM, TemporalConfig

    with torch.device("meta"):
        backbone = build_backbone(spec.family, spec.config, spec.name)
        backbone.backbone_id = spec.name
        lay = None if layers is None else (json.loads(layers) if layers.startswith("[") else layers)
        model = TDLM(backbone, TemporalConfig(layers=lay, heads=heads, head_dim=head_dim))
    if getattr(model, "num_latents", 0):
        raise TDLMError("history 'latent:M' is not modelled by the memory planner")
    units = tuple(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return Inventory(
        backbone=BackboneCosts.of(backbone),
        temporal=TemporalCosts(tuple(model.layer_ids), backbone.hidden_size, model.config.heads, model.config.head_dim),
        params=tuple((p.numel(), p.requires_grad) for p in model.parameters()),
        units=units,
        temporal_numel=model.num_temporal_parameters(),
    )


def inventory(
    backbone, layers: str | Sequence[int] | None = None, heads: int | None = None, head_dim: int | None = None
) -> Inventory:
    """Costs and parameters of ``backbone`` with temporal modules at ``layers`` (built on meta, cached)."""
    key = None if layers is None else (layers if isinstance(layers, str) else json.dumps([int(i) for i in layers]))
    return _inventory(resolve_backbone(backbone), key, heads, head_dim)


# -- the plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DSKnobs:
    """DeepSpeed ZeRO settings that size buffers (DeepSpeed 0.19 defaults)."""

    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size
    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold
    overlap_comm: bool = False  # stages 1-2 (double IPG bucket when true)


COMPONENTS = (
    ("frozen_params", "frozen backbone params"),
    ("zero3_gathered", "ZeRO-3 gathered params (live + prefetch)"),
    ("temporal_params", "temporal params"),
    ("grads", "gradients (temporal)"),
    ("optimizer_states", "optimizer states (AdamW)"),
    ("zero_buffers", "ZeRO buffers (IPG gradient bucket)"),
    ("backbone_activations", "activations: backbone (saved)"),
    ("temporal_activations", "activations: temporal attention"),
    ("temporal_history", "temporal history (K/V of the K states)"),
    ("logits", "logits (B, K, L, V)"),
    ("working", "loss / backward working set"),
)


@dataclass
class MemoryPlan:
    """Predicted peak memory per GPU (bytes) of one TDLM training micro-step, by component."""

    frozen_params: int
    zero3_gathered: int
    temporal_params: int
    grads: int
    optimizer_states: int
    zero_buffers: int
    backbone_activations: int
    temporal_activations: int
    temporal_history: int
    logits: int
    working: int
    peak_phase: str
    phases: dict[str, int]  # total at each phase
    gpu_mem: int
    reserve: int
    setup: dict = field(default_factory=dict)

    @property
    def static(self) -> int:
        return sum(getattr(self, k) for k, _ in COMPONENTS[:6])

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k, _ in COMPONENTS)

    @property
    def fits(self) -> bool:
        return self.total + self.reserve <= self.gpu_mem

    @property
    def verdict(self) -> str:
        return "fits" if self.fits else "does not fit"

    def gib(self, name: str = "total") -> float:
        return getattr(self, name) / GiB

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k, _ in COMPONENTS}
        out.update(
            total=self.total,
            static=self.static,
            peak_phase=self.peak_phase,
            phases=dict(self.phases),
            gpu_mem=self.gpu_mem,
            reserve=self.reserve,
            fits=self.fits,
            setup=dict(self.setup),
        )
        return out

    def report(self) -> str:
        s = self.setup
        lines = [
            f"TDLM training memory plan: {s['backbone']}, {s['num_temporal_layers']} temporal layers "
            f"({s['layers_spec']}: lowest {s['lowest_layer']}), {s['heads']} heads x {s['head_dim']}, "
            f"{s['temporal_params']:,} trainable params",
            f"shape: micro-batch B={s['micro_batch']}, K={s['states']} states, L={s['seq_len']} tokens "
            f"(response N={s['response_len']}), S={s['supervised']} supervised -> T=B*K*L={s['tokens']:,} "
            f"tokens through the backbone, V={s['vocab']:,}",
            f"engine: ZeRO-{s['zero']}, world size {s['world_size']}, {s['dtype']} (grads {s['grad_dtype']}), "
            f"optimizer offload {s['offload']}, activation checkpointing {'on' if s['checkpointing'] else 'off'}",
            "",
            f"{'component':44s} {'GiB':>8s}",
        ]
        for key, label in COMPONENTS:
            lines.append(f"{label:44s} {getattr(self, key) / GiB:8.2f}")
        lines += [
            "-" * 53,
            f"{'total (peak at: ' + self.peak_phase + ')':44s} {self.total / GiB:8.2f}",
            f"{'+ reserve (CUDA context, NCCL, fragmentation)':44s} {self.reserve / GiB:8.2f}",
            f"{'GPU memory':44s} {self.gpu_mem / GiB:8.2f}",
            f"verdict: {self.verdict} ({(self.total + self.reserve) / GiB:.1f} of {self.gpu_mem / GiB:.0f} GiB)",
        ]
        return "\n".join(lines)


def plan(
    backbone: str | os.PathLike | LLaDAConfig | DreamConfig | BackboneSpec = "llada-8b",
    layers: str | Sequence[int] | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    *,
    states: int = 8,
    seq_len: int = 512,
    response_len: int | None = None,
    supervised: int | None = None,
    micro_batch: int = 1,
    dtype: str = "bf16",
    checkpointing: bool = False,
    zero: int = 3,
    world_size: int = 1,
    offload: str = "none",
    grad_dtype: str | None = None,
    gpu_mem_gb: float = 96.0,
    reserve_gb: float = 2.0,
    knobs: DSKnobs = DSKnobs(),
) -> MemoryPlan:
    """Predict the peak memory per GPU of one training micro-step (formulas: module docstring).

    ``layers``/``heads``/``head_dim`` default to the backbone's paper allocation; ``response_len`` to L // 2;
    ``supervised`` to B N (its upper bound). ``zero`` 0 means no ZeRO (plain PyTorch AdamW, states in the
    parameter dtype), as in :func:`measure_peak` and ``bench/gpu_train_probe.py``.
    """
    if dtype not in DTYPE_BYTES:
        raise TDLMError(f"dtype must be one of {sorted(DTYPE_BYTES)}; got {dtype!r}")
    grad_dtype = grad_dtype or dtype
    if grad_dtype not in DTYPE_BYTES:
        raise TDLMError(f"grad_dtype must be one of {sorted(DTYPE_BYTES)}; got {grad_dtype!r}")
    if zero not in (0, 1, 2, 3):
        raise TDLMError(f"zero stage must be 0, 1, 2 or 3; got {zero!r}")
    if offload not in ("none", "optimizer"):
        raise TDLMError(f"offload must be 'none' or 'optimizer'; got {offload!r}")
    N = seq_len // 2 if response_len is None else response_len
    if min(states, seq_len, micro_batch, world_size) < 1 or not 1 <= N <= seq_len:
        raise TDLMError(
            f"need states, seq_len, micro_batch, world_size >= 1 and 1 <= response_len <= seq_len; got K={states}, "
            f"L={seq_len}, B={micro_batch}, W={world_size}, N={N}"
        )
    S = micro_batch * N if supervised is None else supervised
    inv = inventory(backbone, layers, heads, head_dim)
    bc, tc = inv.backbone, inv.temporal
    e, g = DTYPE_BYTES[dtype], DTYPE_BYTES[grad_dtype]
    W = world_size if zero >= 1 else 1
    B, K, L = micro_batch, states, seq_len
    T, TN, V, n, l0, Lt = B * K * L, B * K * N, bc.vocab, bc.num_layers, tc.layers[0], len(tc.layers)
    offloaded = offload == "optimizer" and zero >= 1

    # 1. static terms
    thr = knobs.param_persistence_threshold
    P_t = inv.temporal_numel
    if zero == 3:
        frozen = e * (inv.numel(False, True, thr) + math.ceil(inv.numel(False, False, thr) / W))
        temporal = e * (inv.numel(True, True, thr) + math.ceil(inv.numel(True, False, thr) / W))
        rest = inv.numel(False, False, thr) + inv.numel(True, False, thr)
        unit = max(inv.units)
        gathered = e * min(rest, max(knobs.max_live_parameters, unit) + knobs.prefetch_bucket_size)
    else:
        frozen, temporal, gathered = e * inv.numel(False), e * P_t, 0
    P_local = math.ceil(P_t / W)
    grads = {0: e * P_t, 1: g * P_t, 2: g * P_local, 3: 0 if offloaded else g * P_local}[zero]
    if zero == 0:
        optim = 2 * e * P_t
    else:
        optim = 0 if offloaded else ((4 if e != 4 else 0) + 8) * P_local
    bucket = {0: 0, 1: 4, 2: g, 3: g}[zero] * knobs.reduce_bucket_size
    if zero in (1, 2) and knobs.overlap_comm:
        bucket *= 2
    static = dict(
        frozen_params=frozen,
        zero3_gathered=gathered,
        temporal_params=temporal,
        grads=grads,
        optimizer_states=optim,
        zero_buffers=bucket,
    )

    # 2. activations saved by the forward
    rope = T * bc.rope_tables(e)
    t_saved = Lt * (TN * tc.saved_per_token(e) + B * N * tc.saved_per_position(K, e))
    t_hist = Lt * TN * tc.history_per_token(e)
    layer_t = TN * tc.saved_per_token(e) + B * N * tc.saved_per_position(K, e)  # one temporal layer
    layer_h = TN * tc.history_per_token(e)
    if checkpointing:
        saved = rope + (n - l0) * T * bc.checkpoint_saved(e)
        a_t, a_h = 0, 0
    else:
        saved = rope + T * bc.ffn_saved(e) + (n - l0 - 1) * T * bc.block_saved(e)
        a_t, a_h = t_saved, t_hist
    head = T * bc.head_saved()
    logits = T * V * e
    fp32_copy = S * V * 4 if e != 4 else 0

    # 3. phases: (backbone activations, temporal, history, logits, working)
    phases: dict[str, tuple[int, int, int, int, int]] = {
        "loss forward": (saved + head, a_t, a_h, logits, S * V * e + fp32_copy + S * V * 4),
        "loss backward": (saved + head, a_t, a_h, logits, 3 * S * V * 4),
        "head backward": (
            saved + head,
            a_t,
            a_h,
            logits,
            bc.head_grad_copies * T * V * e + S * V * e + T * bc.hidden * e,
        ),
    }
    if bc.head_fwd_copies > 1:
        phases["head forward"] = (saved + head, a_t, a_h, bc.head_fwd_copies * logits, 0)
    if checkpointing:
        phases["block backward (recompute)"] = (
            saved + T * bc.block_saved(e),
            layer_t,
            layer_h,
            logits,
            T * bc.backward_working(e),
        )
    else:
        phases["block backward"] = (saved, a_t, a_h, logits, T * bc.backward_working(e))
    step_es = e if zero == 0 else 4
    phases["optimizer step"] = (0, 0, 0, 0, 2 * step_es * (P_t if zero == 0 else P_local))
    totals = {k: sum(static.values()) + sum(v) for k, v in phases.items()}
    peak = max(totals, key=totals.__getitem__)
    act = dict(
        zip(
            ("backbone_activations", "temporal_activations", "temporal_history", "logits", "working"),
            phases[peak],
            strict=True,
        )
    )
    setup = dict(
        backbone=resolve_backbone(backbone).name,
        family=bc.family,
        layers=list(tc.layers),
        layers_spec=layers if isinstance(layers, str) else ("default" if layers is None else "list"),
        num_temporal_layers=Lt,
        lowest_layer=l0,
        heads=tc.heads,
        head_dim=tc.head_dim,
        temporal_params=P_t,
        frozen_params=inv.numel(False),
        micro_batch=B,
        states=K,
        seq_len=L,
        response_len=N,
        supervised=S,
        tokens=T,
        vocab=V,
        dtype=dtype,
        grad_dtype=grad_dtype,
        zero=zero,
        world_size=world_size,
        offload=offload,
        checkpointing=checkpointing,
    )
    return MemoryPlan(
        **static,
        **act,
        peak_phase=peak,
        phases=totals,
        gpu_mem=int(gpu_mem_gb * GiB),
        reserve=int(reserve_gb * GiB),
        setup=setup,
    )


def max_micro_batch(limit: int = 4096, **kw) -> int:
    """Largest micro-batch B for which ``plan(**kw, micro_batch=B)`` fits (0 if even B = 1 does not)."""
    if not plan(**kw, micro_batch=1).fits:
        return 0
    lo, hi = 1, 2
    while hi <= limit and plan(**kw, micro_batch=hi).fits:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # total is monotone in B
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(**kw, micro_batch=mid).fits else (lo, mid)
    return lo


TABLE_ALLOCATIONS = (("dispersed:8", "8, dispersed"), ("dispersed:16", "16, dispersed"), ("all", "32, all"))


def readme_table(backbone="llada-8b", worlds: Sequence[int] = (1, 8), allocations=TABLE_ALLOCATIONS, **kw) -> str:
    """Markdown table: allocation x checkpointing -> total per GPU, verdict and largest micro-batch per world size."""
    head = ["temporal layers", "checkpointing"]
    for w in worlds:
        head += [f"{w} GPU{'s' if w > 1 else ''}: GiB/GPU", "verdict", "max B"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec, label in allocations:
        for ckpt in (False, True):
            cells = [label, "on" if ckpt else "off"]
            for w in worlds:
                p = plan(backbone, spec, checkpointing=ckpt, world_size=w, **kw)
                mb = max_micro_batch(
                    backbone=backbone,
                    layers=spec,
                    checkpointing=ckpt,
                    world_size=w,
                    **{k: v for k, v in kw.items() if k != "micro_batch"},
                )
                cells += [f"{p.total / GiB:.1f}", "fits" if p.fits else "**OOM**", str(mb)]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# -- measurement ----------------------------------------------------------------------------------
class PeakMeter:
    """Peak tensor memory inside a ``with`` block, in bytes above the level at entry (``peak_delta``).

    CUDA: ``torch.cuda.max_memory_allocated`` (``peak`` is then absolute). CPU: the allocation events of
    ``torch.profiler`` with ``profile_memory=True``; each carries the allocator's running total, so the maximum
    of that total over the block is the exact peak of live CPU tensor bytes (no RSS or malloc noise).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_delta = 0
        self.peak: int | None = None

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_delta = self.peak - self._start
            return
        self._prof.__exit__(*exc)
        from torch._C._profiler import _EventType

        allocs = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            ev = stack.pop()
            if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu":
                allocs.append((ev.start_time_ns, ev.extra_fields.alloc_size, ev.extra_fields.total_allocated))
            stack.extend(ev.children)
        if allocs:
            allocs.sort()
            base = allocs[0][2] - allocs[0][1]  # allocator total just before the first event
            self.peak_delta = max(t for _, _, t in allocs) - base
        del self._prof


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages of the tensors in modules, optimizers, tensors and dataclasses given."""
    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for o in objs:
        if isinstance(o, nn.Module):
            for t in [*o.parameters(), *o.buffers()]:
                add(t)
        elif isinstance(o, torch.optim.Optimizer):
            for state in o.state.values():
                for t in state.values():
                    add(t)
        elif dataclasses.is_dataclass(o):
            for f in dataclasses.fields(o):
                add(getattr(o, f.name))
        else:
            add(o)
    return sum(seen.values())


def init_random_(backbone: Backbone, seed: int = 0) -> Backbone:
    """Seeded random weights in place (normal(0, 0.02); RMSNorm weights 1), on the parameters' device."""
    g = torch.Generator(device=next(backbone.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if name.endswith("norm.weight") or ".ln_f." in name or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return backbone


def random_batch(backbone: Backbone, micro_batch: int, states: int, seq_len: int, response_len: int, seed: int = 0):
    """A :class:`tdlm.trajectories.TrainingBatch` of random teacher trajectories, one token revealed per step."""
    from tdlm.trajectories import TrajectoryRecord, build_batch

    g = torch.Generator().manual_seed(seed)
    P, N = seq_len - response_len, response_len
    if P < 1:
        raise TDLMError(f"need a prompt: seq_len={seq_len} must exceed response_len={response_len}")
    special = {backbone.mask_token_id, backbone.pad_token_id, backbone.eos_token_id}
    lo = max(special) + 1 if max(special) < 16 else 0  # toy vocabularies keep specials at the bottom

    def tokens(k: int) -> list[int]:
        ids = torch.randint(lo, backbone.vocab_size, (k,), generator=g)
        ids[torch.isin(ids, torch.tensor(sorted(special)))] = lo + 3
        return ids.tolist()

    records = [
        TrajectoryRecord(
            source_id=f"r{b}",
            prompt_ids=tokens(P),
            response_ids=tokens(N),
            reveal_steps=(torch.randperm(N, generator=g) + 1).tolist(),
            T=N,
        )
        for b in range(micro_batch)
    ]
    return build_batch(records, states, backbone.mask_token_id, backbone.pad_token_id, generator=g)


def train_step(model, batch, optimizer: torch.optim.Optimizer) -> float:
    """One micro-step of Eq. (5): forward over K states, CE over supervised tokens, backward, AdamW, zero_grad.

    ``logits`` stays referenced until backward ends, as in a plain training loop (the planner assumes this).
    """
    logits = model.forward_states(batch.input_ids, batch.prompt_len, batch.attention_mask)  # (B, K, L, V)
    from tdlm.trajectories import trajectory_loss

    ce_sum, count = trajectory_loss(logits, batch.labels)
    loss = ce_sum / max(count, 1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@dataclass
class Measurement:
    """Measured peak of real training steps (single process, no ZeRO) next to the plan's prediction."""

    peak: int  # bytes: live tensors before the steps + peak allocated during them
    baseline: int  # bytes of parameters, optimizer states and batch before the measured steps
    rss_delta: int  # ru_maxrss growth during the steps (informational; allocator-dependent)
    step_seconds: float
    predicted: dict  # MemoryPlan.to_dict()
    setup: dict

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.peak / self.predicted["total"]


def _current_rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_here(
    spec: BackboneSpec,
    layers,
    heads,
    head_dim,
    states,
    seq_len,
    response_len,
    micro_batch,
    dtype,
    checkpointing,
    steps,
    seed,
) -> Measurement:
    """Run ``steps`` real training steps in this process on the CPU and measure their peak."""
    from tdlm.model import TDLM, TemporalConfig

    N = seq_len // 2 if response_len is None else response_len
    backbone = init_random_(build_backbone(spec.family, spec.config, spec.name), seed).to(DTYPES[dtype]).freeze()
    backbone.backbone_id = spec.name
    model = TDLM(backbone, TemporalConfig(layers=layers, heads=heads, head_dim=head_dim))
    model.activation_checkpointing = checkpointing
    model.train()
    batch = random_batch(backbone, micro_batch, states, seq_len, N, seed)
    opt = torch.optim.AdamW(model.temporal.parameters(), lr=1e-4)
    train_step(model, batch, opt)  # warm-up: creates the AdamW states
    gc.collect()
    baseline = tensor_bytes(model, opt, batch)
    rss0 = _current_rss()
    t0 = time.perf_counter()
    with PeakMeter("cpu") as meter:
        for _ in range(steps):
            train_step(model, batch, opt)
    dt = (time.perf_counter() - t0) / steps
    rss_delta = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
    predicted = plan(
        spec,
        model.layer_ids,
        model.config.heads,
        model.config.head_dim,
        states=states,
        seq_len=seq_len,
        response_len=N,
        supervised=batch.num_targets,
        micro_batch=micro_batch,
        dtype=dtype,
        checkpointing=checkpointing,
        zero=0,
        world_size=1,
    )
    return Measurement(
        peak=baseline + meter.peak_delta,
        baseline=baseline,
        rss_delta=rss_delta,
        step_seconds=dt,
        predicted=predicted.to_dict(),
        setup=predicted.setup,
    )


def measure_peak(
    backbone: str | os.PathLike | LLaDAConfig | DreamConfig = "tiny-llada",
    layers: str | Sequence[int] | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    *,
    states: int = 8,
    seq_len: int = 128,
    response_len: int | None = None,
    micro_batch: int = 1,
    dtype: str = "fp32",
    checkpointing: bool = False,
    steps: int = 2,
    threads: int = 1,
    seed: int = 0,
    timeout: float = 600.0,
) -> Measurement:
    """Measure the CPU peak of real training steps in a fresh subprocess (``python -m tdlm.memory --measure``).

    A fresh process keeps the profiler's allocation counter and the heap clean. Config objects are written to a
    temporary folder as ``config.json``; weights are random (nothing is downloaded or loaded). One intra-op thread
    by default: on a shared 2-core machine OpenMP barriers made 2-thread steps 20-50x slower, and the thread count
    does not change tensor memory.
    """
    with tempfile.TemporaryDirectory(prefix="tdlm-mem-") as tmp:
        if isinstance(backbone, LLaDAConfig | DreamConfig):
            (Path(tmp) / "config.json").write_text(json.dumps(backbone.to_dict()))
            backbone = tmp
        lay = None if layers is None else (layers if isinstance(layers, str) else ",".join(str(i) for i in layers))
        cmd = [
            sys.executable,
            "-m",
            "tdlm.memory",
            "--measure",
            "--json",
            "--backbone",
            str(backbone),
            "--states",
            str(states),
            "--seq-len",
            str(seq_len),
            "--micro-batch",
            str(micro_batch),
            "--dtype",
            dtype,
            "--checkpointing",
            "on" if checkpointing else "off",
            "--zero",
            "0",
            "--steps",
            str(steps),
            "--seed",
            str(seed),
            "--threads",
            str(threads),
        ]
        for flag, val in (
            ("--layers", lay),
            ("--heads", heads),
            ("--head-dim", head_dim),
            ("--response-len", response_len),
        ):
            if val is not None:
                cmd += [flag, str(val)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Measurement(**out)


# -- command line ---------------------------------------------------------------------------------
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except None/False ones and where the help text already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False) or "default" in text:
            return text
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tdlm.memory",
        description="Predict the peak GPU memory per rank of TDLM training (frozen backbone + temporal adapters, "
        "DeepSpeed ZeRO), broken down by component; formulas in the tdlm.memory docstring. Sizes in GiB.",
        formatter_class=_HelpFormatter,
    )
    ap.add_argument(
        "--backbone",
        default="llada-8b",
        help="'llada-8b' or 'dream-7b' (release configs), a preset (" + ", ".join(PRESETS) + "), or a "
        "checkpoint folder / its config.json (only the config is read)",
    )
    ap.add_argument(
        "--layers",
        default=None,
        help="temporal layers: 'all', 'dispersed:N', 'middle:N' or 'i,j,...' (default: the backbone's "
        "paper allocation, LLaDA dispersed:16, Dream middle:14)",
    )
    ap.add_argument("--heads", type=int, default=None, help="temporal heads M (default: backbone's, 4)")
    ap.add_argument("--head-dim", type=int, default=None, help="temporal head width d_h (LLaDA 64, Dream 84)")
    ap.add_argument("--states", type=int, default=8, help="K sampled states per trajectory (forward_states)")
    ap.add_argument("--seq-len", type=int, default=512, help="L = prompt + response tokens per state")
    ap.add_argument("--response-len", type=int, default=None, help="N response tokens (default L // 2)")
    ap.add_argument("--supervised", type=int, default=None, help="S supervised tokens per micro-batch (default B*N)")
    ap.add_argument("--micro-batch", type=int, default=1, help="B trajectories per GPU per micro-step")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="model / compute dtype")
    ap.add_argument(
        "--grad-dtype",
        choices=sorted(DTYPE_BYTES),
        default=None,
        help="DeepSpeed grad_accum_dtype (default: the model dtype, as DeepSpeed does)",
    )
    ap.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=3,
        help="ZeRO stage; 0 = no ZeRO (plain PyTorch AdamW, states in the parameter dtype)",
    )
    ap.add_argument("--world-size", type=int, default=1, help="W data-parallel ranks (ZeRO partitions over W)")
    ap.add_argument(
        "--checkpointing",
        choices=("on", "off"),
        default="off",
        help="activation checkpointing of each block from the lowest temporal layer up",
    )
    ap.add_argument(
        "--offload",
        choices=("none", "optimizer"),
        default="none",
        help="DeepSpeed offload_optimizer to CPU (fp32 master, moments and ZeRO-3 grad partition)",
    )
    ap.add_argument("--gpu-mem", type=float, default=96.0, help="GPU memory in GiB to check against")
    ap.add_argument("--reserve", type=float, default=2.0, help="GiB kept for CUDA context, NCCL, fragmentation")
    ap.add_argument(
        "--reduce-bucket-size",
        type=int,
        default=DSKnobs.reduce_bucket_size,
        help="DeepSpeed reduce_bucket_size (elements)",
    )
    ap.add_argument(
        "--prefetch-bucket-size",
        type=int,
        default=DSKnobs.prefetch_bucket_size,
        help="stage3_prefetch_bucket_size (elements)",
    )
    ap.add_argument(
        "--max-live-parameters",
        type=int,
        default=DSKnobs.max_live_parameters,
        help="stage3_max_live_parameters (elements)",
    )
    ap.add_argument(
        "--param-persistence-threshold",
        type=int,
        default=DSKnobs.param_persistence_threshold,
        help="stage3_param_persistence_threshold (elements)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument(
        "--table",
        action="store_true",
        help="print the README table: dispersed:8 / dispersed:16 / all x checkpointing off/on on 1 and "
        "8 GPUs of --gpu-mem (other flags set the shapes and engine)",
    )
    ap.add_argument(
        "--measure",
        action="store_true",
        help="run real training steps on the CPU (single process, no ZeRO: use --zero 0) and print "
        "the measured peak next to the prediction",
    )
    ap.add_argument("--steps", type=int, default=2, help="--measure: measured steps (after one warm-up step)")
    ap.add_argument("--seed", type=int, default=0, help="--measure: seed of weights and trajectories")
    ap.add_argument("--threads", type=int, default=1, help="--measure: torch intra-op threads")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = resolve_backbone(args.backbone)
        layers = args.layers
        common = dict(
            states=args.states,
            seq_len=args.seq_len,
            response_len=args.response_len,
            micro_batch=args.micro_batch,
            dtype=args.dtype,
            checkpointing=args.checkpointing == "on",
        )
        if args.measure:
            if args.zero != 0 or args.world_size != 1:
                raise TDLMError("--measure runs one process without ZeRO: pass --zero 0 --world-size 1")
            torch.set_num_threads(args.threads)
            m = _measure_here(spec, layers, args.heads, args.head_dim, steps=args.steps, seed=args.seed, **common)
            if args.json:
                print(json.dumps(dataclasses.asdict(m)))
            else:
                print(
                    f"measured peak {m.peak / 2**20:.1f} MiB, predicted {m.predicted['total'] / 2**20:.1f} MiB "
                    f"(ratio {m.ratio:.3f}; predicted peak at {m.predicted['peak_phase']}); "
                    f"baseline {m.baseline / 2**20:.1f} MiB, RSS growth {m.rss_delta / 2**20:.1f} MiB, "
                    f"{m.step_seconds:.2f} s/step"
                )
            return 0
        knobs = DSKnobs(
            args.reduce_bucket_size,
            args.prefetch_bucket_size,
            args.max_live_parameters,
            args.param_persistence_threshold,
        )
        engine = dict(
            supervised=args.supervised,
            grad_dtype=args.grad_dtype,
            zero=args.zero,
            offload=args.offload,
            gpu_mem_gb=args.gpu_mem,
            reserve_gb=args.reserve,
            knobs=knobs,
        )
        if args.table:
            kw = {**common, **engine}
            kw.pop("checkpointing")
            print(readme_table(spec, **kw))
            return 0
        p = plan(spec, layers, args.heads, args.head_dim, world_size=args.world_size, **common, **engine)
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_dict()) if args.json else p.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
