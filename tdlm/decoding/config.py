"""Decoding settings (:class:`DecodeConfig`, one line per bad value), the one ``decode:`` section of every job config
(:class:`DecodeSettings` and its flags, :func:`decode_flags`) and the check of a ``compile=`` value against this torch
and a device (:func:`check_compile`): what every entry point validates before anything is loaded."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tdlm.config import Flag
from tdlm.decoding.reuse import REUSE_DEFAULTS, REUSE_POLICIES, check_reuse_fields, settings_of
from tdlm.errors import TDLMError
from tdlm.models.kv_cache import CACHE_MODES
from tdlm.temporal.history import HistoryPolicy

POLICIES = ("original", "threshold", "tdlm", "entropy", *REUSE_POLICIES)
STORAGE_PLANS = ("dynamic", "static")
# What one torch.compile call covers (DecodeConfig.compile_scope): a whole step kind, or one repeated block.
COMPILE_SCOPES = ("model", "block")


@dataclass
class DecodeConfig:
    """Decoding settings (paper Section 3.1 defaults: 256 tokens, block 32, tau 0.9, H 0.5)."""

    policy: str = "threshold"  # original | threshold | tdlm | entropy | credit | soft
    gen_length: int = 256  # response tokens N
    block_size: int = 32  # semi-autoregressive block: the canvas is decoded block by block, left to right
    threshold: float = 0.9  # tau of Eq. (6) for threshold / tdlm
    entropy_threshold: float = 0.5  # H for the entropy rule
    stop_at_eos: bool = False  # paper setting: no early stop
    cache: str = "none"  # spatial KV cache: none | prefix | dual (Fast-dLLM; tdlm/models/kv_cache.py)
    # torch.compile each step kind (fullgraph): False | True | "reduce-overhead" (+ CUDA graphs, CUDA only) |
    # "max-autotune" | "max-autotune-no-cudagraphs" | "eager" / "aot_eager" (dynamo's tracing-only backends)
    compile: bool | str = False
    # What one compiled graph covers, with compile: "model" (each step kind whole: the backbone's forward and TDLM's
    # evaluation, fullgraph; dynamo traces every layer, so a cold compile grows with depth) | "block" (the layer loop
    # stays eager; the transformer block's attention and feed-forward and the temporal layer's step are each compiled
    # once and reused by every layer, tdlm.decoding.compiled.block_regions). "block" takes no CUDA-graph mode.
    compile_scope: str = "model"
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
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("cache", self.cache, CACHE_MODES)
        _check_choice("storage", self.storage, STORAGE_PLANS)
        mode = check_compile(self.compile)
        check_compile_scope(self.compile_scope, self.compile)
        if mode is not None and mode[1] in CUDA_GRAPH_MODES and self.cache != "none" and self.storage != "static":
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
        """The fields :meth:`to_dict` leaves out of a run's identity (``compile``, ``compile_scope``, ``storage``): how
        the decode runs, not what it computes. A caller that sends :meth:`to_dict` to a worker must add these, or the
        worker decodes eager and dynamic."""
        return {"compile": self.compile, "compile_scope": self.compile_scope, "storage": self.storage}

    def to_dict(self) -> dict:
        """The settings as a dict; ``cache`` only when one is used and the credit / soft fields only for their policy,
        so other settings read as before those existed (run identities and trajectory ``decode_settings`` written
        earlier still match); never ``compile``, ``compile_scope`` or ``storage``."""
        d = dataclasses.asdict(self)
        if d["cache"] == "none":
            del d["cache"]
        for name in REUSE_DEFAULTS:
            if name not in settings_of(self.policy):
                del d[name]
        del d["compile"]  # how the same computation runs, not what it computes (tokens equal eager's)
        del d["compile_scope"]  # likewise (block scope decodes eager's tokens with the tracing-only backends)
        del d["storage"]  # likewise: where the state lives (tokens, NFE and reveal steps equal the dynamic plan's)
        return d


def _check_choice(name: str, value, allowed: tuple) -> None:
    """One line for a value outside ``allowed``, with the nearest allowed one (a typo in a YAML key or a flag)."""
    if isinstance(value, str) and value in allowed:
        return
    near = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise TDLMError(f"decode {name} {value!r} unknown; expected one of {', '.join(allowed)}{hint}")


# Weights' dtypes a replica may load in (DecodeSettings.dtype); None keeps the checkpoint's torch_dtype.
DTYPES = ("float32", "bfloat16", "float16")
# DecodeSettings fields that an evaluation sweeps through lists of its own (EvalConfig.policies, thresholds ...).
SWEPT = {"policy": "policies", "threshold": "thresholds", "entropy_threshold": "entropy_thresholds",
         "cache": "caches", "history": "histories"}  # fmt: skip


@dataclass
class DecodeSettings(DecodeConfig):
    """The one ``decode:`` section of the evaluation, generation, harness and on-policy configs.

    It is :class:`DecodeConfig` (what one :func:`tdlm.decode` call computes, so every field there is declared once,
    there) plus the three settings a job needs around the call: the TDLM ``history`` the adapter decodes with, the
    ``dtype`` a replica loads the weights in and the engine's ``batch_size``. A job validates it once
    (:meth:`validate`, one line per bad value, naming ``decode.<field>``) before anything is loaded, and hands this same
    object to its workers, in process or through Ray's pickling: no dict in between, so no field can be dropped on
    the way (tests/test_decode_settings.py sends every field through each driver).

    What stays outside it: an evaluation is a grid of decodes, so the fields it sweeps (``SWEPT``: policy, tau, H,
    cache, history) are its lists (``policies``, ``thresholds`` ...) and must keep their defaults here; each run's
    settings are this section with the run's point written in (:meth:`tdlm.evaluation.config.RunSpec.settings`). An
    on-policy job's roll-in is policy tdlm at its per-round ``rollout_tau`` list; its section is the teacher's decode.
    A job's own default batch (generation 1408, evaluation 1, on-policy 64) is its section's default, which a YAML
    section that sets other keys keeps (:func:`tdlm.config.from_dict` fills a section from its default object).
    """

    history: str | None = None  # TDLM history restriction (full | current | last:k | latent:M); None = the adapter's
    dtype: str | None = None  # weights' dtype: float32 | bfloat16 | float16; None = the checkpoint's torch_dtype
    batch_size: int = 1  # rows the decode engine keeps in flight (a finished row takes the next prompt)

    def validate(self) -> DecodeSettings:
        """Every check of :meth:`DecodeConfig.validate` and of the three fields added here; one TDLMError line."""
        super().validate()
        # float64 too, as load_backbone takes it: tests compare two decode paths exactly in it (no flag offers it)
        if self.dtype is not None and self.dtype not in (*DTYPES, "float64"):
            raise TDLMError(f"decode.dtype {self.dtype!r} unknown; expected one of {', '.join(DTYPES)} (or null: the "
                            f"checkpoint's)")  # fmt: skip
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise TDLMError(f"decode.batch_size must be an integer >= 1; got {self.batch_size!r}")
        if self.history is not None:
            try:
                self.check_history(self.history)
            except TDLMError as e:
                raise TDLMError(f"decode.history: {e}") from None
        return self

    def to_dict(self) -> dict:
        """:meth:`DecodeConfig.to_dict` (a run's decode identity): ``history``, ``dtype`` and ``batch_size`` are
        recorded beside it by each job, under the names its files always had."""
        d = super().to_dict()
        for name in ("history", "dtype", "batch_size"):
            del d[name]
        return d

    def decode_config(self) -> DecodeConfig:
        """The plain :class:`DecodeConfig` of these settings (what :func:`tdlm.decode` computes)."""
        return DecodeConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DecodeConfig)})


# The argparse choices of the section's flags, here beside the fields: a job's CLI names none of them.
_CHOICES = {"policy": POLICIES, "cache": CACHE_MODES, "storage": STORAGE_PLANS, "compile_scope": COMPILE_SCOPES,
            "dtype": DTYPES}  # fmt: skip


def decode_flags(group: str, **fields: Flag) -> dict[str, Flag]:
    """The flags of a job's ``decode`` section (:func:`tdlm.config.add_dataclass_flags` keys ``decode.<field>``):
    every field in ``group``, with its choices; ``fields`` changes one field's (another name or group, a narrower
    choice, or ``Flag(skip=True)``)."""
    out = {}
    for f in dataclasses.fields(DecodeSettings):
        flag = fields.get(f.name, Flag())
        out[f"decode.{f.name}"] = dataclasses.replace(flag, group=flag.group or group,
                                                      choices=flag.choices or _CHOICES.get(f.name))  # fmt: skip
    return out


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
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")

def check_compile_scope(scope, compile_value) -> str:
    """``scope`` (DecodeConfig.compile_scope) checked alone and beside ``compile=compile_value``; one TDLMError line
    each.

    "block" refuses the CUDA-graph modes. Under it the layer loop runs eagerly between compiled regions, and every
    layer calls the same region's graph with its own weights: cudagraph trees treat parameters as static inputs, so
    each layer's call would be recorded as a graph of its own (a StaticInputIdxMismatch re-records,
    torch/_inductor/cudagraph_trees.py), 32 recordings per region and step kind at 8B, with the eager code between
    them mutating the regions' outputs in place (TDLM's correction). None of that has been recorded or replayed on
    a GPU here, and the CUDA graphs' gain, no host work between kernels, is what the eager loop between regions
    gives back; the model scope keeps them."""
    _check_choice("compile_scope", scope, COMPILE_SCOPES)
    try:
        mode = check_compile(compile_value)
    except TDLMError:
        return scope  # a bad compile= is compile's own line (check_compile), not the scope's
    if scope == "block" and mode is not None and mode[1] in CUDA_GRAPH_MODES:
        raise TDLMError(f"compile={compile_value!r} captures CUDA graphs of a whole step, which "
                        f"compile_scope='block' does not give (each layer would record the shared block's graph "
                        f"anew); use compile_scope='model' with it, or compile=True with "
                        f"compile_scope='block'")  # fmt: skip
    return scope


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
    if mode in CUDA_GRAPH_MODES and device.type != "cuda":
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

