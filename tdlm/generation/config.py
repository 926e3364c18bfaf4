"""The one config schema of a generation job, and the settings that define its output.

Settings split in two:

* *identity* settings decide what the shards contain (backbone, adapter, prompts, decode rule,
  shard size ...). They are written into ``manifest.json``; resuming an output dir with any of them
  changed is refused, because the shards would mix two datasets;
* *run* settings only decide how fast it goes (batch size, actors, retries, address, logging). They
  may change between a run and its resume and are recorded per run. Batch size is a run setting
  because :func:`tdlm.decode` gives the same tokens batched or per sample (tested in
  ``tests/test_decoding.py`` and ``tests/test_generation.py``).

The decode settings are one ``decode:`` section (:class:`tdlm.decoding.config.DecodeSettings`): policy, tau, gen
length, block, cache, history, compile, storage, dtype, batch. Its decode identity (``DecodeSettings.to_dict``) and
dtype are identity settings; its compile, compile scope, storage and batch are run settings (tokens equal). The
replicas receive that section as the same object (:func:`tdlm.generation.driver.worker_spec`).

``allow_eval_prompts`` is neither: it only permits evaluation problems among the prompts (refused by
default, :mod:`tdlm.data.contamination`); what was found is written to ``manifest["contamination"]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tdlm.data.contamination import check_prompt_source
from tdlm.data.prompts import Prompt, PromptSource, prompts_digest
from tdlm.data.trajectories import SCHEMA_VERSION
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError


@dataclass
class GenerationConfig:
    """A teacher-trajectory generation job (``ray_jobs/generate_trajectories.py`` sets every field)."""

    backbone: str  # preset name (tiny-llada) or checkpoint folder, readable on every node
    prompts: str  # local .jsonl/.json/.parquet file or Hugging Face dataset name
    output_dir: str  # shards + manifest.json; absolute path under `ray job submit`
    prompt_field: str = "question"  # field / column holding the prompt text
    prompt_config: str | None = None  # Hugging Face dataset config
    # Hugging Face dataset split (ignored for local files). The default, 'train', keeps teacher prompts out of the
    # splits the evaluator scores
    prompt_split: str = "train"
    num_prompts: int | None = None  # first N prompts of the source; None = all
    chat: bool = True  # wrap prompts in the tokenizer's chat template
    # Generate from problems the evaluator scores (GSM8K test, MATH-500, MBPP test, arith held-out)?
    # Refused unless set (tdlm.data.contamination); the manifest records what was found either way.
    allow_eval_prompts: bool = False
    # The decode settings (tdlm.decoding.config.DecodeSettings). batch_size: prompts the engine keeps in flight in an
    # actor (at most a shard's); the default is the largest backbone batch one H200 (141 GB, 2 GiB reserve) holds
    # with its replica at prompt 256 + 256 tokens, rounded down to a multiple of 64: 1,409 for Dream-7B, 1,684 for
    # LLaDA-8B (bench/results/true_shape.json, decode_memory.*.generation). policy 'tdlm' with history 'full' keeps
    # ~1 GiB of history per row at 8B: lower it there.
    decode: DecodeSettings = field(default_factory=lambda: DecodeSettings(batch_size=1408))
    adapter: str | None = None  # TDLM adapter folder, needed by (and only by) policy 'tdlm'
    allow_other_backbone: bool = False  # attach an adapter trained on another backbone (tdlm.TDLM.from_adapter)
    shard_size: int = 256  # prompts per shard: shard i holds prompts [i*S, (i+1)*S)
    # On-policy roll-outs (tdlm.data.onpolicy; ray_jobs/onpolicy.py sets these). With a switch distribution, each
    # prompt is rolled in with policy tdlm (--adapter), the frozen backbone finishes it from the student's canvas at a
    # step s* drawn from it (uniform | frac:A:B | start | end), and the shard holds the hybrid records. None: plain
    switch: str | None = None
    teacher_policy: str = "original"  # roll-out: the frozen backbone's commit rule (adapter off)
    switch_seed: int = 0  # roll-out: s* of a prompt is a function of (switch_seed, its source id)
    round: int | None = None  # roll-out: the on-policy round, recorded in every record
    adapter_version: int | None = None  # roll-out: the adapter's version, recorded in every record with its fingerprint
    # roll-out: per shard, the first N prompts also get the teacher's decode from scratch, and the adapter's Eq. 5 loss
    # on the student's and on the teacher's records of them is recorded (the exposure gap)
    gap_prompts: int = 0
    # run settings (may change on resume)
    actors: int | None = None  # None = one per GPU, or one per cpus_per_actor CPUs without GPUs
    cpus_per_actor: int = 1  # CPU actors: torch threads per replica
    address: str | None = None  # Ray cluster address; None = RAY_ADDRESS, else a fresh local cluster
    max_restarts: int = 2  # Ray restarts of a dead actor ...
    max_task_retries: int = 2  # ... and retries of the shard it was decoding
    max_shard_attempts: int = 3  # driver-level attempts of one shard after Ray's own retries failed
    log_interval: float = 30.0  # seconds between plain progress lines (for `ray job logs`)
    # seconds without an answer from the Ray head (GCS port) before the job stops with one line (finished shards stay
    # on disk; the same command resumes on a running cluster); Ray's raylets give up on a lost head after 60 s
    head_timeout_s: float = 30.0

    def prompt_source(self) -> PromptSource:
        return PromptSource(self.prompts, self.prompt_field, self.prompt_config, self.prompt_split, self.num_prompts)

    def validate(self) -> GenerationConfig:
        """Reject incompatible options before any file is touched or any actor started."""
        # Narrower than the decode's own ranges: a tau of 0 (or H = inf) commits every token at once, NFE 1 per block,
        # which is no teacher trajectory (a manifest once recorded tau -0.1).
        tau, h = self.decode.threshold, self.decode.entropy_threshold
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not 0 < tau <= 1:
            raise TDLMError(f"decode.threshold (--tau) must be in (0, 1] for teacher trajectories; got {tau!r}")
        if isinstance(h, bool) or not isinstance(h, int | float) or not 0 < h < float("inf"):
            raise TDLMError(f"decode.entropy_threshold (--entropy-threshold, H) must be a positive number; got {h!r}")
        self.decode.validate()
        policy = self.decode.policy
        if policy == "tdlm" and not self.adapter:
            raise TDLMError("policy 'tdlm' needs --adapter DIR (a folder written by TDLM.save_adapter)")
        if self.adapter and policy != "tdlm":
            raise TDLMError(f"--adapter is only used by policy 'tdlm'; got policy {policy!r}")
        for name in ("shard_size", "cpus_per_actor", "max_shard_attempts"):
            if getattr(self, name) < 1:
                raise TDLMError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.actors is not None and self.actors < 1:
            raise TDLMError(f"actors must be >= 1; got {self.actors}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise TDLMError(f"num_prompts must be >= 1; got {self.num_prompts}")
        if self.max_restarts < 0 or self.max_task_retries < 0:
            raise TDLMError("max_restarts and max_task_retries must be >= 0")
        if self.log_interval <= 0:
            raise TDLMError(f"log_interval must be > 0; got {self.log_interval}")
        if self.head_timeout_s <= 0:
            raise TDLMError(f"head_timeout_s must be > 0; got {self.head_timeout_s}")
        if self.switch is not None:
            from tdlm.data.onpolicy import SwitchDistribution
            from tdlm.decoding import POLICIES

            SwitchDistribution.parse(self.switch, "switch (--switch)")
            if policy != "tdlm":
                raise TDLMError(f"--switch rolls in the student: it needs policy 'tdlm' and --adapter; got policy "
                                f"{policy!r}")  # fmt: skip
            teachers = [p for p in POLICIES if p != "tdlm"]
            if self.teacher_policy not in teachers:
                raise TDLMError(f"teacher_policy (--teacher-policy) must be one of {', '.join(teachers)}; got "
                                f"{self.teacher_policy!r}")  # fmt: skip
            if self.gap_prompts < 0:
                raise TDLMError(f"gap_prompts must be >= 0; got {self.gap_prompts}")
        elif self.gap_prompts:
            raise TDLMError("gap_prompts is measured on roll-outs; it needs --switch")
        check_prompt_source(self.prompt_source(), self.allow_eval_prompts)  # by name; by content: the driver
        return self

    def rollout(self) -> dict | None:
        """The roll-out settings (identity: they decide the records), or None for plain decoding."""
        if self.switch is None:
            return None
        return {"switch": self.switch, "teacher_policy": self.teacher_policy, "switch_seed": self.switch_seed,
                "round": self.round, "adapter_version": self.adapter_version, "gap_prompts": self.gap_prompts}

    def identity(self, prompts: list[Prompt], backbone: str | None, adapter: str | None) -> dict:
        """Settings that define the shards' content (compared on resume); see the module docstring.

        ``backbone`` / ``adapter`` are content fingerprints (:func:`tdlm.generation.worker.fingerprints`),
        not paths, so a moved checkpoint or a different working dir under ``ray job submit`` is the
        same job. ``None`` means the driver cannot see the files; the actors' fingerprints are then the
        only ones checked (:meth:`ShardStore.check_actor_identity`).
        """
        out = {
            "schema_version": SCHEMA_VERSION,
            "prompt_source": self.prompt_source().tag(),
            "prompt_field": self.prompt_field,
            "num_prompts": len(prompts),
            "prompts_sha256": prompts_digest(prompts),
            "chat": self.chat,
            "decode": self.decode.to_dict(),
            "dtype": self.decode.dtype,
            "shard_size": self.shard_size,
        }
        if self.decode.history is not None:  # only when set: manifests written before it existed still match
            out["history"] = self.decode.history
        if self.switch is not None:
            out["rollout"] = self.rollout()
        if backbone is not None:
            out["backbone"] = backbone
        if adapter is not None or not self.adapter:
            out["adapter"] = adapter
        return out

    def run_settings(self) -> dict:
        names = ("backbone", "adapter", "prompts", "actors", "cpus_per_actor", "address", "max_restarts",
                 "max_task_retries", "max_shard_attempts", "head_timeout_s", "allow_eval_prompts",
                 "allow_other_backbone")  # fmt: skip
        d = self.decode
        return {**{n: getattr(self, n) for n in names}, "batch_size": d.batch_size, "compile": d.compile,
                "compile_scope": d.compile_scope, "storage": d.storage}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
