"""The evaluation job's one config schema and the grid of runs it expands to.

An evaluation is one backbone x a grid of *runs*: every (task, policy, tau / H, adapter, history)
point. ``original`` has no knob; ``threshold`` sweeps ``thresholds`` (Fast-dLLM, Eq. 6); ``entropy``
sweeps ``entropy_thresholds`` (the d3LLM rule); dInfer's training-free ``credit`` and ``soft`` sweep
``credit_thresholds`` / ``soft_thresholds`` (default ``thresholds``) with one setting of their weights
(:mod:`tdlm.decoding.reuse`); ``tdlm`` sweeps adapters x ``tdlm_thresholds`` x
``histories`` (Table 2 restricts the history of a fixed adapter at inference, Table 4 compares adapters
trained with different layer allocations). Defaults are the paper's (Section 3.1): 256 tokens, block
32, tau 0.9, H 0.5, batch size 1 for the latency measurement. ``caches`` adds the spatial KV cache as one
more axis (``none``, Fast-dLLM's ``prefix`` / ``dual``; :mod:`tdlm.models.kv_cache`) for the policies in
``cache_policies``: each cached variant is its own run, row and Pareto point, labelled with its cache.

Settings split in two, as in :mod:`tdlm.generation.config`:

* *identity* settings (:meth:`EvalConfig.identity`) decide what a run's per-sample results mean
  (backbone, adapter, decode rule, prompts, dtype, and batch size because it changes the measured seconds).
  They are written to each run's ``run.json``; resuming with any of them changed is refused. The device is not
  among them (the driver cannot know which GPU a Ray actor gets): each sample records its worker's device, and
  the summary lists the devices, so a run resumed on another device kind shows it (docs/gpu.md);
* *run* settings (workers, threads, W&B, scoring workers) may change between a run and its resume.

The decode settings are one ``decode:`` section (:class:`tdlm.decoding.config.DecodeSettings`: gen length, block,
stop at EOS, compile, compile scope, storage, dtype, batch, the credit / soft weights), shared by every run. The
fields the grid sweeps (policy, tau, H, cache, history) are its lists instead and keep their defaults in the section;
each run's settings are the section with the run's point written in (:meth:`RunSpec.settings`), and that object is
what the worker decodes with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from tdlm.config import Flag, SuggestingParser, add_dataclass_flags, from_dict, load_yaml, nest_flags
from tdlm.decoding import CACHE_MODES, POLICIES
from tdlm.decoding.config import SWEPT, DecodeSettings, decode_flags
from tdlm.errors import TDLMError
from tdlm.models.loading import backbone_fingerprint  # noqa: F401  (re-exported)
from tdlm.tasks import TASK_NAMES
from tdlm.temporal.adapter_files import adapter_fingerprint  # noqa: F401  (re-exported)
from tdlm.temporal.history import HistoryPolicy

RUN_ORDER = ("original", "threshold", "entropy", "credit", "soft", "tdlm")  # the paper's Table 1 order, + dInfer's


@dataclass
class EvalConfig:
    """One evaluation job (``eval/run.py`` sets every field; YAML files in ``configs/eval_*.yaml``)."""

    backbone: str  # preset (tiny-llada, tiny-dream), shipped backbone (tiny-arith, tiny-multi) or checkpoint folder
    output_dir: str  # runs/<task>/<run>/..., summary.json, table.md, pareto_*.png
    tasks: list[str] = field(default_factory=lambda: ["gsm8k"])  # benchmarks (gsm8k, math500, mbpp, arith, multi)
    policies: list[str] | None = None  # commit rules; None: original + threshold (+ tdlm when adapters are given)
    adapters: list[str] = field(default_factory=list)  # "DIR" or "LABEL=DIR" (TDLM.save_adapter folders)
    thresholds: list[float] = field(default_factory=lambda: [DecodeSettings.threshold])  # tau of threshold
    tdlm_thresholds: list[float] | None = None  # tau of tdlm; None = thresholds (Dream: TDLM 0.95)
    entropy_thresholds: list[float] = field(default_factory=lambda: [DecodeSettings.entropy_threshold])  # H of entropy
    credit_thresholds: list[float] | None = None  # tau of credit (dInfer's credit decoding); None = thresholds
    soft_thresholds: list[float] | None = None  # tau of soft (dInfer's soft iteration); None = thresholds
    histories: list[str] | None = None  # tdlm history restriction; None = each adapter's trained one
    caches: list[str] = field(default_factory=lambda: ["none"])  # spatial KV caches: none | prefix | dual
    cache_policies: list[str] | None = None  # policies run with each of `caches`; None = all (others: none)
    # the decode settings every run shares (tdlm.decoding.config.DecodeSettings; batch 1: the paper's latency); its
    # policy, threshold, entropy_threshold, cache and history are swept by the lists above and stay unset here.
    # compile: the warm-up decodes compile, so timed seconds exclude compilation; compile and storage are not part of
    # a run's identity (tokens equal), so either resumes the other's runs
    decode: DecodeSettings = field(default_factory=lambda: DecodeSettings(batch_size=1))
    limit: int | None = None  # first N problems of each task
    data_dir: str | None = None  # benchmark JSONL dir; None = $TDLM_DATA_DIR, the Hub, data/benchmarks
    chat: bool = True  # prompts through the backbone's chat template
    device: str | None = None  # in-process worker device; None = cuda if available else cpu
    warmup: int = 1  # untimed decodes per worker and run before the timed ones
    # batches of decode.batch_size per worker job. The decode engine refills a finished row's slot with the job's
    # next problem, so a job of several batches waits for one slowest row instead of one per batch; jobs are timed
    # interleaved in rounds (shard_jobs), so fewer rounds leave a change of machine load on fewer runs at once
    job_batches: int = 1
    # run settings (may change on resume)
    workers: int | None = None  # shards / Ray actors; None = one per visible GPU (min 1); 1 = in-process, no Ray
    threads: int | None = None  # torch threads per CPU worker (Ray CPU actors reserve this many CPUs)
    ray_address: str | None = None  # None = RAY_ADDRESS, else a fresh local cluster
    max_restarts: int = 2  # Ray restarts of a dead actor ...
    max_task_retries: int = 2  # ... and retries of the shard it held
    max_shard_attempts: int = 3  # driver-level attempts per shard after Ray's retries
    # seconds without an answer from the Ray head (GCS port) before the job stops with one line (finished samples stay
    # on disk; the same command resumes on a running cluster); Ray's raylets give up on a lost head after 60 s
    head_timeout_s: float = 30.0
    group: str | None = None  # W&B group (the comparison); None = output dir name
    allow_other_backbone: bool = False  # attach adapters trained on another backbone (TDLM.from_adapter)
    project: str = "tdlm"  # the training runs' project, so an evaluation sits beside the run that trained its adapter
    tags: list[str] = field(default_factory=list)  # extra W&B tags (backbone, allocation, history are added)
    wandb_mode: str | None = None  # online | offline | disabled; None = WANDB_MODE, key -> online, else offline
    score_workers: int = 2  # Math-Verify processes / sandbox threads
    code_timeout_s: float = 30.0  # sandbox wall clock per MBPP program (generous: shared machines are loaded)
    code_cpu_s: int = 11  # sandbox CPU seconds per MBPP program (the real compute budget)
    # MBPP scoring fails closed: it refuses to start when the sandbox lacks a guarantee (no user namespaces, no
    # cgroup / seccomp ...); True scores anyway and records the weakened guarantees in every sample row
    allow_weak_sandbox: bool = False
    reference_tau: float = DecodeSettings.threshold  # threshold baseline of the "vs threshold" speedup
    # the run every other is compared with on the same problems (paired accuracy difference, McNemar, NFE and
    # seconds ratios; tdlm.evaluation.paired), by its run name; None: threshold-tau<reference_tau>
    reference: str | None = None

    # -- checks --------------------------------------------------------------------------------
    def reference_run(self) -> str:
        """The run name of the paired comparisons' reference."""
        return self.reference or f"threshold-tau{self.reference_tau:g}"

    def resolved_policies(self) -> list[str]:
        if self.policies is not None:
            return list(self.policies)
        return ["original", "threshold"] + (["tdlm"] if self.adapters else [])

    def validate(self) -> EvalConfig:
        """Reject bad or incompatible options before anything is loaded or written."""
        if not self.tasks:
            raise TDLMError("tasks: expected at least one of " + ", ".join(TASK_NAMES))
        for t in self.tasks:
            if t not in TASK_NAMES:
                raise TDLMError(f"task {t!r} unknown; expected one of {', '.join(TASK_NAMES)}")
        pols = self.resolved_policies()
        if not pols:
            raise TDLMError("policies: expected at least one of " + ", ".join(POLICIES))
        for p in pols:
            if p not in POLICIES:
                raise TDLMError(f"policy {p!r} unknown; expected one of {', '.join(POLICIES)}")
        if not self.caches:
            raise TDLMError("caches: expected at least one of " + ", ".join(CACHE_MODES))
        for c in self.caches:
            if c not in CACHE_MODES:
                raise TDLMError(f"cache {c!r} unknown; expected one of {', '.join(CACHE_MODES)}")
        for p in self.cache_policies or []:
            if p not in POLICIES:
                raise TDLMError(f"cache_policies: policy {p!r} unknown; expected one of {', '.join(POLICIES)}")
        for name in ("tasks", "policies", "adapters", "thresholds", "tdlm_thresholds", "entropy_thresholds",
                     "credit_thresholds", "soft_thresholds", "histories", "caches", "cache_policies"):  # fmt: skip
            vals = getattr(self, name)
            if vals is not None and len(set(map(str, vals))) != len(vals):
                raise TDLMError(f"{name}: duplicate values in {vals}")
        if "tdlm" in pols and not self.adapters:
            raise TDLMError("policy 'tdlm' needs --adapter DIR (a folder written by TDLM.save_adapter)")
        if self.adapters and "tdlm" not in pols:
            raise TDLMError(f"--adapter is only used by policy 'tdlm'; policies are {pols}")
        for name in ("thresholds", "tdlm_thresholds", "credit_thresholds", "soft_thresholds"):
            for tau in getattr(self, name) or []:
                if not 0.0 <= tau <= 1.0:
                    raise TDLMError(f"{name}: threshold tau={tau} must be in [0, 1]")
            if getattr(self, name) is not None and not getattr(self, name):
                raise TDLMError(f"{name}: expected at least one tau in [0, 1] (or unset)")
        for h in self.entropy_thresholds:
            if h < 0:
                raise TDLMError(f"entropy threshold H={h} must be >= 0")
        for h in self.histories or []:
            HistoryPolicy.parse(h)
        if self.histories is not None and not self.histories:
            raise TDLMError("histories: expected at least one (full, last:k, current) or None")
        self._check_decode(pols)
        for name in ("score_workers", "max_shard_attempts", "code_cpu_s", "job_batches"):
            if getattr(self, name) < 1:
                raise TDLMError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("workers", "threads", "limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise TDLMError(f"{name} must be >= 1 (or unset); got {v}")
        if self.warmup < 0 or self.max_restarts < 0 or self.max_task_retries < 0:
            raise TDLMError("warmup, max_restarts and max_task_retries must be >= 0")
        if not self.head_timeout_s > 0:
            raise TDLMError(f"head_timeout_s must be > 0; got {self.head_timeout_s}")
        if self.code_timeout_s <= 0:
            raise TDLMError(f"code_timeout_s must be > 0; got {self.code_timeout_s}")
        self.adapter_dirs()  # labels well-formed and unique
        return self

    def _check_decode(self, pols: list[str]) -> None:
        """The ``decode:`` section by its one check (:meth:`DecodeSettings.validate`) at every point of the grid known
        before an adapter is read: each policy with each of its caches and each history named in ``histories`` (an
        adapter's own history is checked by :func:`expand`). A swept field set in the section is refused: the grid's
        list decides it, and a value there would silently lose."""
        for name, lists in SWEPT.items():
            if getattr(self.decode, name) != getattr(DecodeSettings, name):
                raise TDLMError(f"decode.{name}={getattr(self.decode, name)!r}: an evaluation sweeps {name} through "
                                f"{lists} (--{lists.replace('_', '-')}); set it there, not in the decode section")
        for policy in pols:
            for cache in self.caches_for(policy):
                for history in (self.histories or [None]) if policy == "tdlm" else [None]:
                    replace(self.decode, policy=policy, cache=cache, history=history).validate()

    def adapter_dirs(self) -> dict[str, str]:
        """``label -> folder`` of ``adapters`` ("DIR" is labelled by its folder name, "LABEL=DIR" by LABEL)."""
        out: dict[str, str] = {}
        for item in self.adapters:
            label, sep, path = item.partition("=")
            if not sep:
                label, path = Path(item.rstrip("/")).name, item
            if not label or not path:
                raise TDLMError(f"adapter {item!r}: expected DIR or LABEL=DIR")
            if label in out:
                raise TDLMError(f"adapter label {label!r} used twice; name them with LABEL=DIR")
            out[label] = path
        return out

    def caches_for(self, policy: str) -> list[str]:
        """The spatial KV caches ``policy`` runs with (``none`` only when it is not in ``cache_policies``)."""
        if self.cache_policies is None or policy in self.cache_policies:
            return list(self.caches)
        return ["none"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunSpec:
    """One point of the grid: what is decoded for one task."""

    task: str
    policy: str
    threshold: float | None = None  # tau (threshold, credit, soft, tdlm)
    entropy_threshold: float | None = None  # H (entropy)
    adapter_label: str | None = None
    adapter: str | None = None  # folder
    history: str | None = None  # tdlm only: resolved history restriction
    cache: str = "none"  # spatial KV cache (none | prefix | dual)

    @property
    def name(self) -> str:
        """Directory / W&B name, unique within a task: ``tdlm-<label>-tau0.9-last3`` (``-dual`` with a cache)."""
        suffix = "" if self.cache == "none" else f"-{self.cache}"
        if self.policy == "original":
            return "original" + suffix
        if self.policy in ("threshold", "credit", "soft"):
            return f"{self.policy}-tau{self.threshold:g}{suffix}"
        if self.policy == "entropy":
            return f"entropy-H{self.entropy_threshold:g}{suffix}"
        hist = (self.history or "").replace(":", "")
        return f"tdlm-{_slug(self.adapter_label or 'adapter')}-tau{self.threshold:g}-{hist}{suffix}"

    def settings(self, cfg: EvalConfig) -> DecodeSettings:
        """The run's decode settings: ``cfg.decode`` with this point of the grid written in (checked once, by
        :meth:`EvalConfig.validate` and :func:`expand`); the worker decodes with this object."""
        kw: dict = {"policy": self.policy, "cache": self.cache, "history": self.history}
        if self.threshold is not None:
            kw["threshold"] = self.threshold
        if self.entropy_threshold is not None:
            kw["entropy_threshold"] = self.entropy_threshold
        return replace(cfg.decode, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def read_adapter_config(directory: str) -> dict:
    """The adapter's ``tdlm_adapter.json`` (history and layers for naming and the allocation table)."""
    from tdlm.temporal.adapter_files import ADAPTER_WEIGHTS, adapter_config_path

    d = Path(directory)
    cfg_path = adapter_config_path(d)  # older folders: adapter_config.json
    if not (d / ADAPTER_WEIGHTS).exists():
        raise TDLMError(f"{d}: missing {ADAPTER_WEIGHTS} (expected a folder written by TDLM.save_adapter)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise TDLMError(f"{cfg_path}: invalid JSON: {e}") from e






def expand(cfg: EvalConfig) -> list[RunSpec]:
    """The grid of runs in a stable order: task, then the policies in RUN_ORDER, then knobs."""
    runs: list[RunSpec] = []
    pols = cfg.resolved_policies()
    adapters = cfg.adapter_dirs()
    trained = {label: read_adapter_config(path).get("history", "full") for label, path in adapters.items()}
    for task in cfg.tasks:
        for policy in [p for p in RUN_ORDER if p in pols]:
            caches = cfg.caches_for(policy)
            if policy == "original":
                runs += [RunSpec(task, policy, cache=c) for c in caches]
            elif policy == "threshold":
                runs += [RunSpec(task, policy, threshold=t, cache=c) for t in cfg.thresholds for c in caches]
            elif policy in ("credit", "soft"):
                taus = getattr(cfg, f"{policy}_thresholds") or cfg.thresholds
                runs += [RunSpec(task, policy, threshold=t, cache=c) for t in taus for c in caches]
            elif policy == "entropy":
                runs += [RunSpec(task, policy, entropy_threshold=h, cache=c) for h in cfg.entropy_thresholds
                         for c in caches]  # fmt: skip
            else:
                for label, path in adapters.items():
                    for tau in cfg.tdlm_thresholds or cfg.thresholds:
                        for hist in cfg.histories or [trained[label]]:
                            history = HistoryPolicy.parse(hist)
                            for c in caches:
                                if c == "dual" and history.recurrent:
                                    raise TDLMError(f"adapter {label}: cache 'dual' cannot serve history {history} "
                                                    f"(allowed caches with it: none, prefix)")  # fmt: skip
                                try:
                                    replace(cfg.decode, policy=policy, cache=c, history=str(history)).validate()
                                except TDLMError as e:
                                    raise TDLMError(f"adapter {label}: {e}") from None
                                runs.append(RunSpec(task, policy, threshold=tau, adapter_label=label, adapter=path,
                                                    history=str(history), cache=c))  # fmt: skip
    names = [(r.task, r.name) for r in runs]
    if len(set(names)) != len(names):
        raise TDLMError(f"two runs share a name in {names}; give adapters distinct labels (LABEL=DIR)")
    return runs


# -- the command line: eval/run.py and the console script tdlm-eval ----------------------------------------------
# How the EvalConfig fields appear on the command line; the help of every flag is the field's own comment above, so
# a field added to EvalConfig gets a flag without an edit here (tests/test_first_contact.py pins field <-> flag).
# Only names, choices and groups that the fields cannot say themselves are listed.
MODEL, TASKS, GRID, RUN, SCORING, OUTPUT = ("model", "tasks", "decoding grid", "measurement and workers", "scoring",
                                            "output and tracking")
FLAGS: dict[str, Flag] = {
    "backbone": Flag(group=MODEL), "adapters": Flag(name="--adapter", metavar="[LABEL=]DIR", extend=True, group=MODEL),
    "allow_other_backbone": Flag(group=MODEL),
    "device": Flag(group=MODEL),
    "tasks": Flag(choices=TASK_NAMES, group=TASKS), "limit": Flag(group=TASKS), "data_dir": Flag(group=TASKS),
    "chat": Flag(name="--no-chat", negate=True, group=TASKS),
    "policies": Flag(choices=POLICIES, group=GRID), "thresholds": Flag(group=GRID),
    "tdlm_thresholds": Flag(group=GRID), "entropy_thresholds": Flag(group=GRID),
    "histories": Flag(name="--history", group=GRID), "caches": Flag(name="--cache", choices=CACHE_MODES, group=GRID),
    "cache_policies": Flag(choices=POLICIES, group=GRID),
    **{k: Flag(group=GRID) for k in ("credit_thresholds", "soft_thresholds")},
    # the decode section (DecodeSettings): one flag per field it does not leave to the grid's lists
    **decode_flags(GRID, dtype=Flag(group=MODEL), batch_size=Flag(group=RUN), **dict.fromkeys(SWEPT, Flag(skip=True))),
    **{k: Flag(group=RUN) for k in ("warmup", "job_batches", "workers", "threads", "ray_address", "max_restarts",
                                    "max_task_retries", "max_shard_attempts", "head_timeout_s")},
    **{k: Flag(group=SCORING) for k in ("score_workers", "code_timeout_s", "code_cpu_s", "allow_weak_sandbox")},
    **{k: Flag(group=OUTPUT) for k in ("output_dir", "group", "project", "tags", "reference_tau",
                                    "reference")},
    "wandb_mode": Flag(choices=("online", "offline", "disabled"), group=OUTPUT),
}


def build_parser() -> argparse.ArgumentParser:
    # Every flag defaults to None so that a --config file's values survive unless the flag is given;
    # the real defaults live in EvalConfig and are shown in the help.
    p = SuggestingParser(
        description="Decode every problem of the chosen tasks once per run of the grid (policy x tau x adapter "
        "x history), score it, and write per-sample JSONL, summary.json, table.md and Pareto plots.",
    )
    p.add_argument("--config", help="YAML file of EvalConfig fields (configs/eval_*.yaml); flags override it")
    add_dataclass_flags(p, EvalConfig, FLAGS, dict.fromkeys((MODEL, TASKS, GRID, RUN, SCORING, OUTPUT)))
    return p


def parse_args(argv: list[str] | None = None) -> EvalConfig:
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config")
    raw = nest_flags(load_yaml(path), args)
    for name in ("backbone", "output_dir"):
        if not raw.get(name):
            raise TDLMError(f"--{name.replace('_', '-')} is required (or set {name} in --config)")
    return from_dict(EvalConfig, raw, str(path) if path else "arguments")
