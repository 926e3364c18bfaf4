"""One blockwise decoding loop for teacher generation, evaluation and the demo (paper Section 2.4).

The canvas of each request is ``prompt + gen_length`` mask tokens; the response is split into blocks
of ``block_size`` and a row works on the first block that still has masks ("active block"). Each
denoiser evaluation is one NFE. The commit rule decides which masked positions of the active block
receive their greedy token:

* ``original``  - the single most confident position (LLaDA low-confidence remasking, temperature 0:
  one token per evaluation, so T = gen_length);
* ``threshold`` - Fast-dLLM / Eq. (6): every position with confidence > tau, else the most confident;
* ``tdlm``      - the threshold rule on a :class:`tdlm.TDLM` with its temporal cache (every masked
  response position accumulates history, also outside the active block; revealing a position
  invalidates its history; changing blocks resets nothing);
* ``entropy``   - d3LLM-style: every position whose predictive entropy < H, else the most confident;
* ``credit`` / ``soft`` - dInfer's training-free reuse of earlier evaluations with the threshold rule: credit
  added to the logits, or the previous predictions mixed into the masked inputs (:mod:`tdlm.decoding.reuse`).

Confidence is the softmax probability of the greedy token, computed in float64. Batches are
left-padded with an attention mask; every row commits its own positions and counts its own NFE, and
rows leave the batch when they finish, so a batched run equals per-sample runs. The LM head runs only
on the active block's positions (the only logits read).

Spatial KV cache (``cache``, :mod:`tdlm.models.kv_cache`; Fast-dLLM's ``generate_with_prefix_cache`` /
``generate_with_dual_cache`` at temperature 0). ``none`` evaluates the whole canvas every time. With
``prefix`` or ``dual`` the first evaluation of each block (per row) is a *refresh*: a full forward that
stores every position's keys/values at every layer and commits by the policy's rule like any other
evaluation (one NFE). Each later evaluation of the block computes only a window - ``prefix``: the block and
everything after it; ``dual``: the block alone - attending to the cached keys/values of the other positions
(Dream's window starts one position earlier: its block logits come from the hidden states to the left).
Rows of one batch at a refresh and at a window step run as two forwards of one evaluation
(:meth:`tdlm.TDLM.forward_groups`). Two deliberate differences from Fast-dLLM's code: the threshold rule
keeps this repository's strict ``>`` (Eq. 6; Fast-dLLM tests ``>=``), and a block that its refresh already
completes gets no further evaluation (Fast-dLLM runs one more cached forward there that commits nothing
and counts it). With ``policy="tdlm"`` a masked position gains a history entry from an evaluation only if
that evaluation computes it: every masked position at a refresh and at a ``prefix`` step, the active
block's positions at a ``dual`` step.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tdlm.decoding.reuse import REUSE_DEFAULTS, REUSE_POLICIES, check_reuse_fields, reuse_for, settings_of
from tdlm.decoding.static_plan import batch_bucket, prompt_bucket, static_canvas
from tdlm.errors import TDLMError
from tdlm.models.common import Backbone
from tdlm.models.kv_cache import CACHE_MODES, KVStep, SpatialKVCache, check_cache_mode
from tdlm.temporal.history import HistoryPolicy, column_bucket
from tdlm.temporal.model import TDLM, StepGroup

POLICIES = ("original", "threshold", "tdlm", "entropy", *REUSE_POLICIES)
STORAGE_PLANS = ("dynamic", "static")


@dataclass
class DecodeConfig:
    """Decoding settings (paper Section 3.1 defaults: 256 tokens, block 32, tau 0.9, H 0.5)."""

    policy: str = "threshold"  # original | threshold | tdlm | entropy | credit | soft
    gen_length: int = 256  # response tokens N
    block_size: int = 32
    threshold: float = 0.9  # tau of Eq. (6) for threshold / tdlm
    entropy_threshold: float = 0.5  # H for the entropy rule
    stop_at_eos: bool = False  # paper setting: no early stop
    cache: str = "none"  # spatial KV cache: none | prefix | dual (Fast-dLLM; tdlm/models/kv_cache.py)
    # torch.compile each step kind (fullgraph): False | True | "reduce-overhead" (+ CUDA graphs, CUDA only) |
    # "max-autotune" | "max-autotune-no-cudagraphs" | "eager" / "aot_eager" (dynamo's tracing-only backends)
    compile: bool | str = False
    # Where the state a step writes lives: "dynamic" (sized as the decode goes: history buckets, compaction,
    # finished rows leave the batch) | "static" (allocated once at its final size, fixed addresses reused across
    # decodes of a bucket: batch 1, 2, 4, 8, ... with padding rows, prompts padded to 32 tokens; rows stay in place
    # until the batch ends: what CUDA graphs need; tdlm/decoding/static_plan.py)
    storage: str = "dynamic"
    # dInfer's defaults (tdlm/decoding/reuse.py): credit adds alpha log(1 + C) to the logits, C a per-block decayed sum
    credit_alpha: float = REUSE_DEFAULTS["credit_alpha"]  # credit: weight alpha (0: threshold decoding)
    credit_decay: float = REUSE_DEFAULTS["credit_decay"]  # credit: decay beta of C per evaluation, in [0, 1]
    credit_gamma: float = REUSE_DEFAULTS["credit_gamma"]  # credit: C gains (top-1 probability) ** gamma
    soft_weight: float = REUSE_DEFAULTS["soft_weight"]  # soft: cap of the prediction embedding's weight (0: none)
    soft_weight_init: float = REUSE_DEFAULTS["soft_weight_init"]  # soft: its weight after the first evaluation
    soft_weight_growth: float = REUSE_DEFAULTS["soft_weight_growth"]  # soft: its growth per evaluation
    soft_threshold_decay: float = REUSE_DEFAULTS["soft_threshold_decay"]  # soft: tau_i = max(1 - i decay, tau); 0 off

    def validate(self) -> DecodeConfig:
        if self.policy not in POLICIES:
            raise TDLMError(f"decode policy {self.policy!r} unknown; expected one of {', '.join(POLICIES)}")
        check_cache_mode(self.cache)
        if self.storage not in STORAGE_PLANS:
            raise TDLMError(f"decode storage {self.storage!r} unknown; expected one of {', '.join(STORAGE_PLANS)}")
        mode = check_compile(self.compile)
        if mode is not None and mode[1] in _CUDA_GRAPH_MODES and self.cache != "none" and self.storage != "static":
            # The dynamic plan's first refresh creates the spatial KV cache inside the compiled step, so it is a
            # CUDA-graph output in the trees' pool; the next recorded call frees and reuses that memory, and the window
            # step would read K/V that another graph overwrote (torch's cudagraph_trees; read, not run on a GPU here).
            # The static plan allocates it before the first step, at a fixed address.
            raise TDLMError(f"compile={self.compile!r} captures CUDA graphs, which keep the spatial KV cache "
                            f"(cache={self.cache!r}) between steps only at a fixed address; use storage='static' "
                            f"with it, or compile=True")  # fmt: skip
        # written so that NaN fails too; every entry point (evaluation, harness, generation) then refuses the same
        if not (isinstance(self.threshold, (int, float)) and 0.0 <= self.threshold <= 1.0):
            raise TDLMError(f"decode threshold (tau of Eq. 6) must be a confidence in [0, 1]; got {self.threshold!r}")
        if not (isinstance(self.entropy_threshold, (int, float)) and self.entropy_threshold > 0.0):
            raise TDLMError(f"decode entropy_threshold (H) must be > 0; got {self.entropy_threshold!r}")
        check_reuse_fields(self)
        if self.gen_length < 1 or self.block_size < 1:
            raise TDLMError(f"gen_length and block_size must be >= 1; got {self.gen_length}, {self.block_size}")
        if self.gen_length % self.block_size:
            divisors = [d for d in range(1, self.gen_length + 1) if self.gen_length % d == 0]
            why = f" (cache {self.cache!r} refreshes at every block start)" if self.cache != "none" else ""
            raise TDLMError(
                f"gen_length={self.gen_length} must be a multiple of block_size={self.block_size}{why}; "
                f"allowed block sizes: {', '.join(map(str, divisors))}"
            )
        return self

    def check_history(self, history: HistoryPolicy | str) -> DecodeConfig:
        """What :meth:`validate` cannot see: the TDLM history ``history`` (a :class:`HistoryPolicy` or its text) this
        config would decode. :func:`decode` checks its model's; the evaluator and the harness check a history named in
        their settings or an adapter's file before anything is loaded."""
        policy = HistoryPolicy.parse(history)
        if self.storage == "static" and self.policy == "tdlm" and policy.recurrent:
            raise TDLMError(f"storage='static' does not cover history {policy}: its latents are replaced, not "
                            f"written in place, at each evaluation; use storage='dynamic'")  # fmt: skip
        return self

    def run_settings(self) -> dict:
        """The fields :meth:`to_dict` leaves out of a run's identity (``compile``, ``storage``): how the decode runs,
        not what it computes. A caller that sends :meth:`to_dict` to a worker must add these, or the worker decodes
        eager and dynamic."""
        return {"compile": self.compile, "storage": self.storage}

    def to_dict(self) -> dict:
        """The settings as a dict; ``cache`` only when one is used and the credit / soft fields only for their policy,
        so other settings read as before those existed (run identities and trajectory ``decode_settings`` written
        earlier still match); never ``compile`` or ``storage``."""
        d = dataclasses.asdict(self)
        if d["cache"] == "none":
            del d["cache"]
        for name in REUSE_DEFAULTS:
            if name not in settings_of(self.policy):
                del d[name]
        del d["compile"]  # how the same computation runs, not what it computes (tokens equal eager's)
        del d["storage"]  # likewise: where the state lives (tokens, NFE and reveal steps equal the dynamic plan's)
        return d


@dataclass
class DecodeResult:
    """One request's generation and its trajectory (Section 2.3)."""

    tokens: list[int]  # the gen_length response tokens y_p
    text: str  # decoded response, cut at the first stop token
    nfe: int  # denoiser evaluations of this request
    seconds: float  # wall seconds from the batch start to this request's end (device-synchronized)
    reveal_step: list[int]  # a_p in 1..T: the evaluation after which y_p was committed
    T: int  # trajectory length in evaluations (== nfe)
    prompt_ids: list[int] = field(default_factory=list)
    states: list[list[int]] | None = None  # evaluated response inputs, only with record_states=True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _select(conf: torch.Tensor, cand: torch.Tensor, rule: str, cfg: DecodeConfig, entropy: torch.Tensor | None,
            tau: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Positions to commit (b, bs) bool among candidates ``cand`` given float64 confidences (``tau``: per-row
    thresholds (b, 1) instead of ``cfg.threshold``)."""
    conf = conf.masked_fill(~cand, -1.0)
    top = torch.zeros_like(cand)
    top.scatter_(1, conf.argmax(1, keepdim=True), True)
    top &= cand
    if rule == "original":
        return top
    if rule == "entropy":
        sel = cand & (entropy < cfg.entropy_threshold)
    else:
        sel = cand & (conf > (cfg.threshold if tau is None else tau))
    none = ~sel.any(1, keepdim=True)
    return torch.where(none, top, sel)


def _rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t[rows]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as a device index tensor without a host synchronisation (pinned, non-blocking on CUDA)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _groups(
    kv_cache: SpatialKVCache | None,
    blk: list[int],
    kv_blk: list[int],
    block_start: torch.Tensor,
    host_starts: list[int],
    bs: int,
    L: int,
    shift: int,
) -> list[tuple[torch.Tensor | None, KVStep | None]]:
    """(rows, KV step) of the forwards of one evaluation: one without a cache; with one, the rows whose
    block starts (a refresh) and the rows inside a block (a window step), each group only if present.
    Decided on the host from the host mirror of each row's active block (``blk``, read back with the stop
    check) and of the block its KV cache holds (``kv_blk``, updated here): no device read."""
    if kv_cache is None:
        return [(None, None)]
    refresh = [i for i, (a, c) in enumerate(zip(blk, kv_blk, strict=True)) if a != c]
    for i in refresh:
        kv_blk[i] = blk[i]
    if len(refresh) == len(blk):
        return [(None, KVStep(kv_cache, True))]
    if not refresh:
        return [(None, KVStep.window(kv_cache, block_start, bs, L, shift, host_starts=host_starts))]
    fresh = set(refresh)
    stay = [i for i in range(len(blk)) if i not in fresh]
    r1, r0 = _index(refresh, block_start.device), _index(stay, block_start.device)
    window = KVStep.window(kv_cache, block_start[r0], bs, L, shift, r0, [host_starts[i] for i in stay])
    return [(r1, KVStep(kv_cache, True, rows=r1)), (r0, window)]


def _merge_logits(groups: list, outs: list[torch.Tensor], b: int) -> torch.Tensor:
    """(b, bs, V) block logits from each group's (b_g, bs, V) logits."""
    if len(groups) == 1:
        return outs[0]
    merged = outs[0].new_empty((b, *outs[0].shape[1:]))
    for (rows, _), out in zip(groups, outs, strict=True):
        merged[rows] = out
    return merged


# -- compilation -------------------------------------------------------------------------------------------
# compile= value -> (torch.compile backend, mode). "eager" / "aot_eager" are dynamo's debugging backends: the
# same fullgraph trace and guards without inductor code generation (cheap; the tests use them).
COMPILE_CHOICES: dict = {
    True: ("inductor", None),
    "default": ("inductor", None),
    "reduce-overhead": ("inductor", "reduce-overhead"),  # + CUDA graphs (CUDA only)
    "max-autotune": ("inductor", "max-autotune"),  # + CUDA graphs (CUDA only)
    "max-autotune-no-cudagraphs": ("inductor", "max-autotune-no-cudagraphs"),
    "eager": ("eager", None),
    "aot_eager": ("aot_eager", None),
}
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
_COMPILED: dict = {}
# Recompilations of one decode are bounded by the step kinds (see decode's docstring); this leaves room for a
# few models per process. Reaching it raises instead of falling back to eager.
RECOMPILE_LIMIT = 64


def triton_build_needs() -> str | None:
    """What triton's runtime lacks to build its launcher stub (a small C file that includes Python.h, compiled on
    the first kernel of a process; triton/runtime/build.py), or None. Its lookup: ``$CC``, else gcc, else clang on
    PATH. Without them the first compiled decode would fail deep inside triton, not with one line from tdlm."""
    import shutil
    import sysconfig

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if not cc or not shutil.which(cc):
        return "finds none ($CC unset or not found, no gcc or clang on PATH): install gcc or set CC"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        return (f"this Python's headers are missing ({header}): install the python3-dev (Debian) or python3-devel "
                f"package of this Python")
    return None


def check_compile(value, device: torch.device | str | None = None) -> tuple[str, str | None] | None:
    """The (backend, mode) of ``compile=value`` (None: eager), checked against this torch and ``device``.

    Every failure is one TDLMError line naming the setting and what to use instead; decoding never falls
    back to eager silently."""
    if isinstance(value, str) and value.strip().lower() in ("false", "off", "no", "none", ""):
        return None  # the spelling of a command-line flag
    if isinstance(value, str) and value.strip().lower() in ("true", "on", "yes"):
        value = True
    if value is False or value is None:
        return None
    key = value if value is True else str(value)
    if key not in COMPILE_CHOICES:
        choices = ", ".join(repr(c) for c in (False, *COMPILE_CHOICES))
        raise TDLMError(f"compile={value!r} unknown; expected one of {choices}")
    backend, mode = COMPILE_CHOICES[key]
    if device is None:
        return backend, mode
    device = torch.device(device)
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise TDLMError(f"compile={value!r}: torch {torch.__version__} has no {backend!r} backend; use compile=False "
                        f"or compile='aot_eager'")  # fmt: skip
    if mode in _CUDA_GRAPH_MODES and device.type != "cuda":
        raise TDLMError(f"compile={value!r} captures CUDA graphs and needs a CUDA device, not {device.type}; use "
                        f"compile=True (or 'max-autotune-no-cudagraphs') on {device.type}")  # fmt: skip
    if backend == "inductor":
        if device.type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                raise TDLMError(f"compile={value!r}: inductor needs triton for {device}, which this torch lacks; "
                                f"install triton or use compile=False")  # fmt: skip
            missing = triton_build_needs()
            if missing:
                raise TDLMError(f"compile={value!r}: triton builds its kernel launcher with a C compiler at the first "
                                f"kernel and {missing}; use compile=False until it is there")  # fmt: skip
        elif device.type == "cpu":
            try:
                from torch._inductor.cpp_builder import get_cpp_compiler

                get_cpp_compiler()
            except Exception as e:  # noqa: BLE001 - any failure means inductor cannot build CPU kernels here
                raise TDLMError(f"compile={value!r}: inductor on cpu needs a C++ compiler ({e}); install g++ or use "
                                f"compile=False") from None  # fmt: skip
        else:
            raise TDLMError(f"compile={value!r}: this tdlm compiles with inductor on cpu and cuda only, not "
                            f"{device.type}; use compile=False")  # fmt: skip
    return backend, mode


def _backbone_eval(backbone: Backbone, x, attention_mask, positions, kv, embeds=None):
    return backbone(x, attention_mask=attention_mask, select=positions, kv=kv, inputs_embeds=embeds)


def _evaluate_written_out(model: TDLM, prompt_len: int, cache, groups: list) -> list[torch.Tensor]:
    """:meth:`TDLM.evaluate_groups` with the temporal attention written out, which inductor fuses into one kernel
    (:func:`tdlm.temporal.attention.step_attention`)."""
    return TDLM.evaluate_groups(model, prompt_len, cache, groups, written_out=True)


def compiled_steps(backend: str, mode: str | None):
    """(backbone step, TDLM step) compiled with fullgraph=True, one pair per (backend, mode) per process.

    The backbone step is ``backbone(x, attention_mask, select=positions, kv)``; the TDLM step is
    :meth:`tdlm.TDLM.evaluate_groups`, with inductor in its written-out attention form. Dynamo caches graphs per
    step kind under guards on the structure of the arguments (refresh / window, rows split or not, padded or
    not) and on shapes; nothing in the arguments changes from one evaluation of a kind to the next."""
    key = (backend, mode)
    if key not in _COMPILED:
        kw = {"fullgraph": True, "backend": backend, **({"mode": mode} if mode else {})}
        step = _evaluate_written_out if backend == "inductor" else TDLM.evaluate_groups
        _COMPILED[key] = (torch.compile(_backbone_eval, **kw), torch.compile(step, **kw))
    return _COMPILED[key]


def window_front(blocks: Sequence[int], compacted_blocks: Sequence[int], compacted_masked: Sequence[int],
                 block_size: int, extra: int, length: int) -> int:
    """Host side: how many of the temporal history's first storage columns hold every masked position that the
    rows' next dual window steps compute (:meth:`tdlm.temporal.history.TemporalCache.set_front`), from what the
    host knows: each row's active block now (``blocks``), at its cache's last compaction (``compacted_blocks``)
    and the masked positions that block had then (``compacted_masked``).

    A row reveals only in its active block, so its masked positions are the active block's and every position
    after it, and the columns (in position order) a compaction keeps are exactly those. So a row still in the
    block it was in at the compaction has that block's masked positions in columns 0 .. n0 - 1; a row k0 < k
    blocks on holds n0 + (k - k0 - 1) x block_size columns of revealed positions before its block and the block
    after them. ``extra``: window positions past the block's end (Dream's window under prediction alignment, 1).
    Rounded up as storage widths are (:func:`column_bucket`, at most ``length``, the response's positions)."""
    most = 0
    for k, k0, n0 in zip(blocks, compacted_blocks, compacted_masked, strict=True):
        most = max(most, n0 if k == k0 else n0 + (k - k0) * block_size)
    return column_bucket(most + extra, length)


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@torch.inference_mode()
def decode(
    model: Backbone | TDLM,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig | None = None,
    *,
    tokenizer=None,
    stop_ids: set[int] | None = None,
    progress: bool = False,
    record_states: bool = False,
    canvas: Sequence[Sequence[int]] | None = None,
    **overrides,
) -> list[DecodeResult]:
    """Decode a batch of prompts (token-id lists); returns one :class:`DecodeResult` per prompt.

    ``overrides`` set :class:`DecodeConfig` fields (``policy=``, ``threshold=`` ...); unknown names
    are errors. ``policy="tdlm"`` needs a :class:`TDLM`; other policies run the plain backbone (a
    TDLM's own backbone if one is given).

    The step is static: within a block every evaluation has the same shapes (the LM head gathers the
    block's positions by index, the temporal history is stored in the attention's layout in buckets of 8, 16,
    32, ... slots up to gen_length, or k for ``last:k``, with the slot count marked dynamic for the compiler,
    and its validity is a mask; padding is an always-present mask, or None when no row is padded).
    The host reads the device once per evaluation: the stop check, which also brings back each
    row's next active block (the host decides refresh / window from it) and its masked count (progress).
    ``record_states=True`` adds a read of the states. With ``compile`` each step kind is one
    ``fullgraph=True`` graph: backbone / TDLM x {uncached, refresh, prefix window, dual window} x
    {unpadded, padded}, and a refresh of some rows next to a window step of the others (batches only).
    Per decode of one request batch a kind compiles at most twice more: once when its first call differs
    (the spatial KV cache's first refresh allocates its storage; a prefix window's width changes with the
    block, after which dynamo makes it dynamic) and once when rows leave the batch (the batch size becomes
    dynamic); the history's bucket changes compile nothing (its slot count is dynamic from the start). So batch
    1, 256 tokens in blocks of 32: at most 3 graphs uncached, 4 with a cache, whatever the number of steps, blocks
    or buckets. ``canvas`` continues partial responses: one list of ``gen_length`` token ids per prompt, the
    backbone's mask id where the decode is to fill in (at least one per row); its other tokens stay, with reveal step
    0, and NFE and reveal steps count from this decode (an on-policy roll-out, :mod:`tdlm.data.onpolicy`; the
    backbone's own policies only). ``seconds`` exclude compilation: the wall time of every evaluation
    during which a graph was compiled is subtracted (with ``reduce-overhead`` the CUDA graph recording of
    the first calls is not: decode once to warm up, then time).
    """
    try:
        cfg = dataclasses.replace(config or DecodeConfig(), **overrides).validate()
    except TypeError as e:
        raise TDLMError(f"decode: {e}") from e
    if cfg.policy == "tdlm":
        if not isinstance(model, TDLM):
            raise TDLMError("decode policy 'tdlm' needs a tdlm.TDLM model (backbone + temporal adapter)")
        backbone = model.backbone
    else:
        backbone = model.backbone if isinstance(model, TDLM) else model
    if cfg.cache != "none":
        if not getattr(backbone, "supports_kv_cache", False):
            raise TDLMError(f"cache={cfg.cache!r}: backbone {type(backbone).__name__} has no spatial KV cache path; "
                            f"allowed caches for it: none (with a cache: {', '.join(CACHE_MODES[1:])} on LLaDA, "
                            f"Dream)")  # fmt: skip
        if cfg.cache == "dual" and cfg.policy == "tdlm" and model.policy.recurrent:
            raise TDLMError(f"cache='dual' cannot serve history {model.policy} (its latents keep one progress count "
                            f"per request); allowed caches with it: none, prefix")  # fmt: skip
    device = next(backbone.parameters()).device
    spec = check_compile(cfg.compile, device)
    if cfg.policy == "tdlm":
        cfg.check_history(model.policy)
    if spec is not None and cfg.policy == "tdlm" and model.policy.recurrent:
        raise TDLMError(f"compile={cfg.compile!r} does not cover history {model.policy} (a recurrent latent "
                        f"memory); decode it with compile=False")  # fmt: skip
    if not prompts:
        return []
    bad = [i for i, p in enumerate(prompts) if len(p) == 0]
    if bad:
        raise TDLMError(f"decode: prompt(s) {bad} are empty; every request needs at least one prompt token")
    if canvas is not None:
        _check_canvas(canvas, len(prompts), cfg, backbone.mask_token_id)
    if spec is None:
        return _decode(model, backbone, prompts, cfg, device, None, tokenizer, stop_ids, progress, record_states,
                       canvas)
    steps = compiled_steps(*spec)
    limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit, suppress_errors=False):
        return _decode(model, backbone, prompts, cfg, device, steps, tokenizer, stop_ids, progress, record_states,
                       canvas, graphs=spec[1] in _CUDA_GRAPH_MODES)  # fmt: skip


def _check_canvas(canvas: Sequence[Sequence[int]], n: int, cfg: DecodeConfig, mask_id: int) -> None:
    """One line for a ``canvas`` that does not fit the request (before anything is evaluated)."""
    if cfg.policy == "tdlm":
        raise TDLMError("decode: canvas= continues a partial response with the backbone's own policies; policy "
                        "'tdlm' starts its temporal history at the first evaluation of a response")  # fmt: skip
    if len(canvas) != n:
        raise TDLMError(f"decode: canvas has {len(canvas)} rows for {n} prompts")
    for i, row in enumerate(canvas):
        if len(row) != cfg.gen_length:
            raise TDLMError(f"decode: canvas row {i} has {len(row)} tokens; gen_length is {cfg.gen_length}")
        if mask_id not in row:
            raise TDLMError(f"decode: canvas row {i} holds no mask token ({mask_id}): nothing to decode")


def _decode(model, backbone: Backbone, prompts, cfg: DecodeConfig, device: torch.device, steps, tokenizer,
            stop_ids, progress: bool, record_states: bool, canvas=None, graphs: bool = False) -> list[DecodeResult]:
    """The loop. ``graphs``: the compiled steps capture CUDA graphs (cudagraph trees), so each evaluation begins with
    ``torch.compiler.cudagraph_mark_step_begin()``. Without the mark, in inference every call of a compiled step
    starts a new generation of the trees, which frees the previous call's outputs: an evaluation that runs a refresh
    group and a window group as two calls would then read the first group's logits after the second call overwrote
    them (:func:`_merge_logits`). With it, the calls of one evaluation are one generation, and nothing of an earlier
    evaluation's outputs is read after the next mark (each evaluation's logits are consumed before it ends)."""
    backbone_step, evaluate = steps if steps is not None else (_backbone_eval, None)
    mask_id, G, bs = backbone.mask_token_id, cfg.gen_length, cfg.block_size
    stops = set(stop_ids) if stop_ids is not None else {backbone.eos_token_id}
    # The static plan keeps finished rows in the batch (masked: nothing left to commit, no NFE counted), so every
    # tensor a step reads keeps its shape, and decodes in buckets: padding rows up to a batch bucket (copies of the
    # first request whose response holds no mask: finished from the start) and prompts left-padded to a prompt
    # bucket, every buffer at the bucket's fixed address (tdlm/decoding/static_plan.py).
    static = cfg.storage == "static"
    n_req = len(prompts)
    B = batch_bucket(n_req) if static else n_req
    P = max(len(p) for p in prompts)
    if static:
        P = prompt_bucket(P)
    L = P + G
    held = static_canvas(backbone, B, L, G, cfg.cache) if static else None
    host_ids = torch.full((B, L), backbone.pad_token_id, dtype=torch.long)  # built on the host, one copy to device
    host_am = torch.zeros((B, L), dtype=torch.long)
    for i in range(B):
        p = prompts[i] if i < n_req else prompts[0]
        host_ids[i, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long)
        host_am[i, P - len(p) :] = 1
    host_ids[:n_req, P:] = mask_id  # padding rows: a response of pad tokens, nothing to decode
    if canvas is not None:  # partial responses: their revealed tokens stay (reveal step 0)
        host_ids[:n_req, P:] = torch.as_tensor([list(r) for r in canvas], dtype=torch.long)
    if held is None:
        ids, am = host_ids.to(device), host_am.to(device)
        reveal = torch.zeros((B, G), dtype=torch.long, device=device)
        nfe = torch.zeros(B, dtype=torch.long, device=device)
    else:
        ids, am, reveal, nfe = held.ids, held.attention_mask, held.reveal, held.nfe
        ids.copy_(host_ids)
        am.copy_(host_am)
        reveal.zero_()
        nfe.zero_()
    # known on the host: no device read. A mask only when a row is padded: attention with a mask runs slower kernels
    # (on a GPU SDPA's flash kernel takes none); the static plan then has an unpadded and a padded graph per kind
    padded = any(len(p) < P for p in prompts)
    seconds = [0.0] * B
    states: list[list[list[int]]] = [[] for _ in range(B)]
    active = torch.arange(B, device=device)
    rows_host = list(range(B))  # the active rows, host mirror of `active`
    last = G // bs - 1  # the last block (where the static plan keeps finished and padding rows)
    blk_host = [0 if i < n_req else last for i in range(B)]  # each active row's active block (the first, or done)
    kv_host = [-1] * B  # the block each active row's spatial KV cache holds
    left = [G if i < n_req else 0 for i in range(B)]  # masked response positions of each active row (progress)
    if canvas is not None:  # a partial response's first masked position gives its first active block
        for i, row in enumerate(canvas):
            blk_host[i] = list(row).index(mask_id) // bs
            left[i] = sum(t == mask_id for t in row)
    cache = model.new_cache(B, length=G, static=static) if cfg.policy == "tdlm" else None
    # per active row, for the history's front under the dual cache (window_front): its block at the last
    # compaction and that block's masked positions then (before any, storage column p holds position p)
    comp_blk, comp_in = [0] * B, [min(bs, G)] * B
    extra = getattr(model, "offset", 0)
    # A dual window step over a front of more columns than this gathers its positions' columns instead (rows far
    # past the last compaction); a bound of twice the window's own width, not tuned.
    front_most = 2 * column_bucket(bs + backbone.logit_shift, G)
    if held is not None:
        kv_cache = held.kv_cache
    else:
        kv_cache = SpatialKVCache(cfg.cache, B) if cfg.cache != "none" else None
    reuse = reuse_for(cfg, backbone, B, G, device)  # credit / soft state (tdlm/decoding/reuse.py), else None
    # A single row under the dual cache compacts only when it changes block, and a row reveals only in its active
    # block, so its history's columns always hold the positions from its active block's start in order: the rows
    # of h that a temporal layer reads, a slice of h (TemporalCache.claim_rows / set_front(aligned=True)): no gather
    # of h and no scatter-add of the correction per temporal layer. Several rows sit in different blocks.
    # (A static history never compacts: its column p holds position p for the whole decode.)
    in_order = cache is not None and cfg.cache == "dual" and B == 1 and not static
    if in_order:
        cache.claim_rows(cache.width == G)
    pos_block = torch.arange(G, device=device) // bs  # (G,)
    block_pos = torch.arange(bs, device=device)
    stop_t = torch.tensor(sorted(stops), device=device)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=B * G, desc=f"decode[{cfg.policy}]", unit="tok", leave=False)
    excluded = 0.0  # wall seconds of evaluations that compiled a graph
    finished: set[int] = set(range(n_req, B))  # rows done (the static plan keeps them in the batch)
    _sync(device)
    t0 = time.perf_counter()
    while rows_host:
        if graphs:  # one cudagraph-trees generation per evaluation (see above)
            torch.compiler.cudagraph_mark_step_begin()
        t_eval, n_graphs = time.perf_counter(), _graphs_compiled()
        x = ids if static else ids[active]  # (b, L); the static plan's is the canvas itself, at its fixed address
        b = len(rows_host)
        a_mask = (am if static else am[active]) if padded else None
        if record_states:
            for r, row in zip(rows_host, x[:, P:].tolist(), strict=True):
                if not (static and r in finished):
                    states[r].append(row)
        resp = x[:, P:]  # (b, G)
        masked = resp == mask_id
        blk = pos_block[masked.int().argmax(1)]  # the first masked position gives the active block (b,)
        if static:  # a finished row's block is the last one: its prefix window never starts left of a live row's
            blk = torch.where(masked.any(1), blk, last)
        start = blk * bs
        idx = start[:, None] + block_pos  # (b, bs) response positions of the block
        cand = masked.gather(1, idx)
        positions = P + idx  # (b, bs) canvas positions whose logits are read
        groups = _groups(kv_cache, blk_host, kv_host, P + start, [P + k * bs for k in blk_host], bs, L,
                         backbone.logit_shift)  # fmt: skip
        evals = nfe[active] if reuse is not None else None  # each row's evaluations before this one
        if cache is not None:
            if cfg.cache == "dual":
                front = window_front(blk_host, comp_blk, comp_in, bs, extra, G)
                if in_order:  # the block's columns are the window's rows from (logit shift - offset), in order
                    cache.set_front(min(front, bs + extra), aligned=True)
                elif static:  # the window's columns looked up: one shape whatever the block
                    cache.set_front(None)
                else:
                    cache.set_front(front if front <= front_most else None)
            elif cfg.cache == "prefix":  # a prefix window holds every masked position of its rows
                cache.set_front(cache.width)
            outs = model.forward_groups(P, cache, [
                StepGroup(_rows(x, r), _rows(a_mask, r), _rows(positions, r), step, r) for r, step in groups
            ], evaluate=evaluate)  # fmt: skip
        elif reuse is not None and reuse.feeds_inputs:
            outs = reuse.evaluate(backbone_step, backbone, x, a_mask, groups, P, start, bs, evals)
        else:
            outs = [backbone_step(backbone, _rows(x, r), _rows(a_mask, r), _rows(positions, r), step)
                    for r, step in groups]  # fmt: skip
        blk_logits = _merge_logits(groups, outs, b)  # (b, bs, V)
        if static:
            nfe += masked.any(1)  # a finished row that stays evaluates nothing of its own
        else:
            nfe[active] += 1
        logp = torch.log_softmax(blk_logits.double() if reuse is None else reuse.logits(blk_logits, cand, blk), -1)
        conf, x0 = logp.max(-1)
        conf = conf.exp()  # float64 probability of the greedy token
        entropy = -(logp.exp() * logp).sum(-1) if cfg.policy == "entropy" else None
        commit = _select(conf, cand, cfg.policy, cfg, entropy, None if reuse is None else reuse.threshold(evals))
        new_resp = resp.clone()
        new_resp.scatter_(1, idx, torch.where(commit, x0, resp.gather(1, idx)))
        rows_reveal = reveal.clone() if static else reveal[active]
        rows_reveal.scatter_(1, idx, torch.where(commit, nfe[active, None].expand_as(idx), rows_reveal.gather(1, idx)))
        still = new_resp == mask_id
        if cfg.stop_at_eos:
            # Done once a stop token is committed and everything before it is revealed: the rest is
            # filled with EOS without further evaluations (revealed at this step).
            is_stop = torch.isin(new_resp, stop_t) & ~still
            first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), torch.full_like(blk, G))
            before = torch.arange(G, device=device)[None] < first_stop[:, None]
            early = is_stop.any(1) & ~(still & before).any(1)
            fill = still & early[:, None]
            new_resp = torch.where(fill, torch.full_like(new_resp, backbone.eos_token_id), new_resp)
            rows_reveal = torch.where(fill, nfe[active, None].expand_as(rows_reveal), rows_reveal)
            still = new_resp == mask_id
        if static:  # in place, at the canvas's fixed addresses
            ids[:, P:].copy_(new_resp)
            reveal.copy_(rows_reveal)
        else:
            ids[active, P:] = new_resp
            reveal[active] = rows_reveal
        # The one host synchronisation of the evaluation: which rows are done, each row's next active block,
        # its masked count, and whether its logits were finite (a NaN greedy token would commit id 0 silently:
        # fp16 overflows the bf16-trained releases on a GPU).
        count = still.sum(1)
        next_blk = pos_block[still.int().argmax(1)]
        if static:
            next_blk = torch.where(count == 0, last, next_blk)
        done_l, next_l, left_l, nan_l = torch.stack([count == 0, next_blk, count, conf.isnan().any(1)]).tolist()
        if any(nan_l):
            raise TDLMError(f"decode: the backbone's logits are not finite (NaN) at evaluation {int(nfe.max())} of "
                            f"{sum(map(bool, nan_l))} row(s), dtype {next(backbone.parameters()).dtype}; float16 "
                            f"overflows bf16-trained LLaDA / Dream: use bfloat16 or float32")  # fmt: skip
        now = time.perf_counter()
        if _graphs_compiled() != n_graphs:
            excluded += now - t_eval
        if bar is not None:
            bar.update(sum(left) - sum(left_l))
        left, blk_host = left_l, next_l
        if static:  # rows stay in place; the batch ends when every row is done
            for r, d in zip(rows_host, done_l, strict=True):
                if d and r not in finished:
                    seconds[r] = now - t0 - excluded
                    finished.add(r)
            if kv_cache is not None:  # a finished row is never refreshed again: it rides the window steps
                kv_host = [last if i in finished and k >= 0 else k for i, k in enumerate(kv_host)]
            if len(finished) == B:
                rows_host = []
        elif any(done_l):
            for r, d in zip(rows_host, done_l, strict=True):
                if d:
                    seconds[r] = now - t0 - excluded
            keep = [i for i, d in enumerate(done_l) if not d]
            rows_host = [rows_host[i] for i in keep]
            blk_host, kv_host, left = [blk_host[i] for i in keep], [kv_host[i] for i in keep], [left[i] for i in keep]
            comp_blk, comp_in = [comp_blk[i] for i in keep], [comp_in[i] for i in keep]
            if rows_host:
                keep_t = _index(keep, device)
                active = active[keep_t]
                still = still[keep_t]
                if cache is not None:
                    cache.select(keep_t)
                if kv_cache is not None:
                    kv_cache.select(keep_t)
                if reuse is not None:
                    reuse.select(keep_t)
        # A dual window step reads only the front, so dropping columns inside a block would save only the next
        # refresh's work, for a copy of the whole storage (about 3% of an evaluation at the medium bench shape on
        # this CPU, docs/decoding.md): under the dual cache the loop compacts once a row has changed block.
        moved = cfg.cache != "dual" or any(k != k0 for k, k0 in zip(blk_host, comp_blk, strict=True))
        if cache is not None and rows_host and moved and cache.compact(still, max(left)):
            # the history of revealed positions is dead: fewer storage columns, each row's from its active block on
            comp_blk = list(blk_host)
            comp_in = [n - (G - (k + 1) * bs) for n, k in zip(left, blk_host, strict=True)]
            if in_order:  # kept: the positions from the new block's start, W of them unless rounded up
                cache.claim_rows(cache.width == left[0])
    if bar is not None:
        bar.close()
    results = []
    all_tokens, all_nfe, all_reveal = ids[:, P:].tolist(), nfe.tolist(), reveal.tolist()  # three reads in all
    for i, p in enumerate(prompts):  # (the static plan's padding rows are not requests)
        toks = all_tokens[i]
        cut = next((j for j, t in enumerate(toks) if t in stops), len(toks))
        text = tokenizer.decode(toks[:cut], skip_special_tokens=True) if tokenizer is not None else ""
        results.append(
            DecodeResult(
                tokens=toks,
                text=text,
                nfe=all_nfe[i],
                seconds=seconds[i],
                reveal_step=all_reveal[i],
                T=all_nfe[i],
                prompt_ids=[int(t) for t in p],
                states=states[i] if record_states else None,
            )
        )
    return results
