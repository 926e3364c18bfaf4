"""Memory planner for TDLM training: predicted peak memory per GPU, component by component.

Commands (repository root, venv active)::

    python -m tdlm.training.planner --backbone llada-8b --layers all --states 8 --seq-len 768 --response-len 256 \\
        --micro-batch 4 --world-size 8 --ds ds_configs/zero3.json        # stage, knobs, checkpointing from the DS JSON
    python -m tdlm.training.planner --backbone dream-7b --zero 3 --world-size 8 --checkpointing on --micro-batch 4
    python -m tdlm.training.planner --backbone path/to/LLaDA-8B-Instruct --layers dispersed:16 --json  # config.json
    python -m tdlm.training.planner --table --states 8 --seq-len 512  # docs/training.md table
    python -m tdlm.training.planner --measure --backbone tiny-llada --states 8 --seq-len 128 --zero 0  # CPU steps

Python::

    from tdlm.training.planner import plan, measure_peak
    p = plan("llada-8b", layers="all", states=8, seq_len=512, zero=3, world_size=1, checkpointing=False)
    p.total, p.fits, print(p.report())

What is modelled. One training micro-step of the recipe :func:`train_step` (the one ``bench/gpu_train_probe.py``
and :func:`measure_peak` run): ``logits = TDLM.forward_states(ids (B, K, L), select=supervised)`` (the LM head runs
only at the S supervised positions, :func:`tdlm.training.loop.supervised_ce`) -> ``trajectory_loss`` (Eq. 5) ->
``backward`` -> AdamW on the temporal parameters. ``head="full"`` models the former recipe instead (logits of all
T positions, held by the caller until backward ends), for comparison. Sizes are read
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

Activations (saved for backward; per token, from the code paths of ``tdlm/models`` and ``tdlm/temporal/model.py``)
  * block, attention  4 d + 4 (RMSNorm input in fp32 + rsqrt) + e (2 q_dim + 2 q_dim) (q, k after RoPE, v, SDPA
                      output) + 4 H (log-sum-exp). Frozen linears save no inputs (only weights, which need no grad).
                      Fused SDPA (flash / memory-efficient) is assumed: no L x L matrix.
  * block, FFN        4 d + 4 + 3 F e (gate pre-activation, SiLU output, up projection).
  * block             attention + FFN for layers l0 < i < n; the lowest temporal layer's input has no grad
                      (layers below run under no_grad), so it saves only its FFN and temporal terms.
  * temporal layer    per temporal token: d e (the response slice of h, input of the fused QKV matmul) + 4 d_t
                      (the rotated query, fp32 in SDPA's math kernel, which an additive sink mask selects on CPU)
                      + d_t e (z, input of W_O); per (b, p) position: history 2 (K + 1) d_t 4 (keys / values of the K
                      states and the sink, fp32) + 4 M K (K + 1) (attention weights); per (b, k) state 6 d_h e (RoPE
                      cos / sin of q, k, v).
  * RoPE tables       2 d_head e per token (cos, sin of the forward context).
  * checkpointing on  only each checkpointed block's input, d e per token for layers l0..n-1 (non-reentrant
                      torch.utils.checkpoint), plus one block recomputed during backward.
  * head              S (4 d + 20): final RMSNorm input in fp32 + rsqrt of the S gathered rows, their int64 indices
                      (+ 8 with a logit shift);
                      Dream's shift only moves the gather by one position).
  * logits            S V e, (S, V) in the model dtype, alive during the loss forward only (the loss saves its
                      log-softmax, not its input).
  * loss forward      S V 4 (fp32 copy, bf16 only) + S V 4 (log-softmax, saved).
  * loss backward     3 S V 4 (log-softmax output, its grad, the fp32 input grad).
  * head backward     S V e + S d e + T d e: the logits' grad, the gathered rows' grad and the zero-filled
                      (T, d) grad the gather scatters it into.
  ``head="full"`` (former recipe): head T (4 d + 4); logits T V e held through backward; loss forward adds S V e
  (gathered rows); head backward c T V e + S V e + T d e (c = 1; 3 for Dream's shift: the shifted grad and one
  zero-padded grad per slice) and Dream's forward holds 2 T V e (unshifted + shifted).
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

import dataclasses
import functools
import json
import math
import os
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
# head="full" only: full-size logits gradients alive at once in the head backward (module docstring).
HEAD_GRAD_COPIES = {"llada": 1, "dream": 3}
# head="full" only: full-size logits alive at once in the head forward (Dream: unshifted + shifted).
HEAD_FWD_COPIES = {"llada": 1, "dream": 2}
HEADS = ("supervised", "full")


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
    logit_shift: int = 0  # Dream 1: the gather reads h at p - 1
    rope_fp32: bool = False  # the rotary tables are fp32 whatever the compute dtype (LLaDA's rope_full_precision)

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
            logit_shift=backbone.logit_shift,
            rope_fp32=bool(getattr(backbone, "rope_full_precision", False)),
        )

    def attention_saved(self, e: int) -> int:
        """4 d + 4 + e (2 q_dim + 2 kv_dim) + 4 H: norm input (fp32), rsqrt, q, k, v, SDPA out, log-sum-exp.

        Training batches always carry a padding mask, and grouped-query attention with a mask repeats the K/V heads
        (``tdlm.models.common``: SDPA's fused kernels do not take a mask together with ``enable_gqa``), so SDPA saves
        K and V at the query width: kv_dim counts as q_dim here."""
        return 4 * self.hidden + 4 + e * (2 * self.q_dim + 2 * self.q_dim) + 4 * self.heads

    def ffn_saved(self, e: int) -> int:
        """4 d + 4 + 3 F e: norm input (fp32), rsqrt, gate pre-activation, SiLU output, up projection."""
        return 4 * self.hidden + 4 + 3 * self.ffn * e

    def block_saved(self, e: int) -> int:
        return self.attention_saved(e) + self.ffn_saved(e)

    def rope_tables(self, e: int) -> int:
        """cos + sin of the forward context, 2 d_head e (e = 4 when the tables are fp32: LLaDA in bf16)."""
        return 2 * self.head_dim * (4 if self.rope_fp32 else e)

    def head_saved(self, gathered: bool = False) -> int:
        """Final RMSNorm input in fp32 + rsqrt, 4 d + 4 (the frozen LM head saves no input); a gathered
        (supervised-only) head adds its int64 indices: (row, position) pairs, 16, plus the shifted positions, 8."""
        return 4 * self.hidden + 4 + ((16 + 8 * (self.logit_shift > 0)) if gathered else 0)

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
        """d e + 4 d_t + d_t e per temporal token (T_N = B K N), history excluded: the response slice of h (input of
        the one fused QKV matmul), the rotated query in fp32 (CPU's SDPA with an additive mask runs its math kernel in
        fp32) and the attention output z (input of W_O)."""
        return self.hidden * e + 4 * self.width + self.width * e

    def history_per_position(self, K: int, e: int) -> int:
        """The keys and values of the K states plus the sink's zero key / value, fp32 in the attention kernel:
        2 (K + 1) d_t 4 per (b, p) position."""
        return 2 * (K + 1) * self.width * 4

    def saved_per_position(self, K: int, e: int) -> int:
        """Per (b, p): the attention weights over the sink and the K states, 4 M K (K + 1) (fp32)."""
        return 4 * self.heads * K * (K + 1)

    def tables_per_state(self, e: int) -> int:
        """Per (b, k) state: the RoPE cos / sin tables of its q, k, v rows, 2 x 3 d_h e."""
        return 2 * 3 * self.head_dim * e


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
    from tdlm.temporal.model import TDLM, TemporalConfig

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

    # DS JSON key of each field (zero_optimization section)
    KEYS = {
        "reduce_bucket_size": "reduce_bucket_size",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "max_live_parameters": "stage3_max_live_parameters",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "overlap_comm": "overlap_comm",
    }

    @classmethod
    def from_ds_config(cls, ds: dict, where: str = "ds config", hidden_size: int | None = None) -> DSKnobs:
        """The knobs a DS JSON sets; missing keys keep DeepSpeed's defaults.

        ``"auto"`` resolves as the HF integration does from the model width d (reduce d^2, prefetch
        0.9 d^2, persistence 10 d); without ``hidden_size`` it is an error.
        """
        zero = ds.get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise TDLMError(f"{where}: zero_optimization must be an object; got {zero!r}")
        auto = {"reduce_bucket_size": 1.0, "prefetch_bucket_size": 0.9, "param_persistence_threshold": 10.0}
        values: dict = {}
        for field_name, key in cls.KEYS.items():
            if key not in zero:
                continue
            v = zero[key]
            if v == "auto" and field_name in auto:
                if hidden_size is None:
                    raise TDLMError(f"{where}: zero_optimization.{key}='auto' needs the backbone's hidden size")
                d = hidden_size
                v = int(auto[field_name] * d * (d if field_name != "param_persistence_threshold" else 1))
            if field_name == "overlap_comm":
                if not isinstance(v, bool):
                    raise TDLMError(f"{where}: zero_optimization.{key} must be true or false; got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise TDLMError(f"{where}: zero_optimization.{key} must be a non-negative number; got {v!r}")
            values[field_name] = v if field_name == "overlap_comm" else int(v)
        return cls(**values)


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
    ("logits", "logits ((S, V); (B, K, L, V) with head=full)"),
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
            f"optimizer offload {s['offload']}, activation checkpointing {'on' if s['checkpointing'] else 'off'}, "
            f"LM head on {'the S supervised positions' if s['head'] == 'supervised' else 'all T positions'}",
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
    head: str = "supervised",
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
    if head not in HEADS:
        raise TDLMError(f"head must be one of {', '.join(HEADS)}; got {head!r}")
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
    t_saved = Lt * (TN * tc.saved_per_token(e) + B * N * tc.saved_per_position(K, e) + B * K * tc.tables_per_state(e))
    t_hist = Lt * B * N * tc.history_per_position(K, e)
    layer_t = TN * tc.saved_per_token(e) + B * N * tc.saved_per_position(K, e) + B * K * tc.tables_per_state(e)
    layer_h = B * N * tc.history_per_position(K, e)  # one temporal layer
    if checkpointing:
        saved = rope + (n - l0) * T * bc.checkpoint_saved(e)
        a_t, a_h = 0, 0
    else:
        saved = rope + T * bc.ffn_saved(e) + (n - l0 - 1) * T * bc.block_saved(e)
        a_t, a_h = t_saved, t_hist
    fp32_copy = S * V * 4 if e != 4 else 0
    d_grads = S * bc.hidden * e + T * bc.hidden * e  # gathered rows' grad + the (T, d) grad it scatters into

    # 3. phases: (backbone activations, temporal, history, logits, working)
    phases: dict[str, tuple[int, int, int, int, int]]
    if head == "supervised":
        h_saved, logits = S * bc.head_saved(gathered=True), S * V * e
        phases = {
            "loss forward": (saved + h_saved, a_t, a_h, logits, fp32_copy + S * V * 4),
            "loss backward": (saved + h_saved, a_t, a_h, 0, 3 * S * V * 4),
            "head backward": (saved + h_saved, a_t, a_h, 0, S * V * e + d_grads),
        }
    else:
        h_saved, logits = T * bc.head_saved(), T * V * e
        phases = {
            "loss forward": (saved + h_saved, a_t, a_h, logits, S * V * e + fp32_copy + S * V * 4),
            "loss backward": (saved + h_saved, a_t, a_h, logits, 3 * S * V * 4),
            "head backward": (saved + h_saved, a_t, a_h, logits,
                              bc.head_grad_copies * T * V * e + S * V * e + T * bc.hidden * e),
        }
        if bc.head_fwd_copies > 1:
            phases["head forward"] = (saved + h_saved, a_t, a_h, bc.head_fwd_copies * logits, 0)
    logits_held = logits if head == "full" else 0
    if checkpointing:
        phases["block backward (recompute)"] = (
            saved + T * bc.block_saved(e),
            layer_t,
            layer_h,
            logits_held,
            T * bc.backward_working(e),
        )
    else:
        phases["block backward"] = (saved, a_t, a_h, logits_held, T * bc.backward_working(e))
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
        head=head,
        knobs=dataclasses.asdict(knobs),
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
