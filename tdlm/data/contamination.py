"""Keeping evaluation problems out of the teacher prompts (training data must not contain the test set).

Two checks, both refused unless explicitly allowed (``--allow-eval-prompts`` / ``allow_eval_prompts``):

* **by name**, before anything is loaded: a prompt source that *is* a split the evaluator scores
  (:data:`EVAL_SPLITS`: GSM8K test, MATH-500, MBPP test; by Hugging Face name + split, or by the file
  name of the pinned copies in ``data/benchmarks``) - :func:`check_prompt_source`;
* **by content**: every teacher prompt is hashed (:func:`prompt_hash`) and looked up in the hash sets
  of the evaluation problems of each task in :data:`tdlm.tasks.TASK_NAMES` (loaded with the task
  loaders, cached per process) - :func:`check_teacher_prompts` at generation time,
  :func:`check_trajectory_prompts` for a finished trajectory folder (the training preflight).

What is compared (the key). A prompt is compared as the text *before the chat template*, which is
what teacher generation stores (``TrajectoryRecord.prompt_text``, the prompt field of the source) and
what every backbone's template wraps. An evaluation problem contributes two keys: its bare question
(GSM8K ``question``, MATH-500 ``problem``, MBPP ``prompt``, arith ``question``) and the full user
message the evaluator sends (``Problem.prompt``: question + the task's instruction); a teacher prompt
matching either is an evaluation problem. The match is exact after normalisation, so a question
embedded in a longer prompt (few-shot context, an edited wording) is not detected.

Normalisation and hash (rule :data:`HASH_RULE`, id :data:`HASH_VERSION`)::

    key  = " ".join(unicodedata.normalize("NFC", text).split())   # NFC, whitespace runs -> one space, stripped
    hash = sha256(key.encode("utf-8")).hexdigest()[:16]           # 64 bits: collisions ~1e-10 at 1e5 x 1e4

Case and punctuation are kept (``3+5=?`` and ``3 + 5 = ?`` are different arithmetic prompts only
by spacing, and are the same key). The generation manifest stores one hash per prompt
(``manifest["prompts"]["hashes"]``, in prompt order) so the training preflight does not need the
prompt texts; for manifests written before that field existed (or folders without a manifest) the
hashes are recomputed from the shards' ``prompt_text`` column.

Where evaluation problems come from: ``data_dir`` / ``$TDLM_DATA_DIR`` if given, else the pinned
copies in ``data/benchmarks`` when present, else :func:`tdlm.tasks.base.load_records` (the Hub).
The copies are the same records as the Hub splits (record counts checked by the loaders), so this
order only avoids a Hub probe; the arith held-out split is generated (:mod:`tdlm.tasks.toydata`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tdlm.errors import TDLMError

log = logging.getLogger("tdlm.data.contamination")

HASH_VERSION = "tdlm-prompt-v1"
HASH_RULE = "sha256(NFC text, whitespace runs collapsed to one space, stripped) as UTF-8; first 16 hex digits"
HASH_HEX = 16
TRAINING_HINT = "generate from a train split or set data.allow_eval_prompts: true"
GENERATION_HINT = (
    "generate teacher prompts from a train split (the default: --prompt-split train) "
    "or pass --allow-eval-prompts (allow_eval_prompts=True) to use them anyway"
)


@dataclass(frozen=True)
class EvalSplit:
    """A split the evaluator scores, and the names under which it can be given as a prompt source."""

    task: str  # tdlm.tasks name
    description: str  # e.g. "gsm8k test problems"
    question_field: str  # the record field holding the bare question
    hub_names: tuple[str, ...] = ()  # Hugging Face dataset names (compared case-insensitively)
    hub_split: str = "test"
    local_files: tuple[str, ...] = ()  # file names of the pinned copies


EVAL_SPLITS: dict[str, EvalSplit] = {
    s.task: s
    for s in (
        EvalSplit("gsm8k", "gsm8k test problems", "question", ("openai/gsm8k", "gsm8k"), "test", ("gsm8k_test.jsonl",)),
        EvalSplit("math500", "math500 test problems", "problem", ("huggingfaceh4/math-500",), "test",
                  ("math500_test.jsonl",)),  # fmt: skip
        # any MBPP config: the sanitized test ids 11-510 are a subset of the full test split
        EvalSplit("mbpp", "mbpp test problems", "prompt", ("google-research-datasets/mbpp", "mbpp"), "test",
                  ("mbpp_sanitized_test.jsonl",)),  # fmt: skip
        EvalSplit("arith", "arith held-out (test split) problems", "question"),  # generated, see tdlm.tasks.toydata
        EvalSplit("multi", "multi held-out (test split) problems", "question"),  # generated, see tdlm.tasks.toydata
    )
}


# -- the key -------------------------------------------------------------------------------------
def normalise_prompt(text: str) -> str:
    """NFC, whitespace runs -> one space, stripped (the comparison key; module docstring)."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def prompt_hash(text: str) -> str:
    """The per-prompt hash stored in the generation manifest (:data:`HASH_RULE`)."""
    return hashlib.sha256(normalise_prompt(text).encode("utf-8")).hexdigest()[:HASH_HEX]


def prompt_hashes(texts: Iterable[str]) -> list[str]:
    return [prompt_hash(t) for t in texts]


# -- evaluation problems -------------------------------------------------------------------------
def _task_names(tasks: Sequence[str] | None) -> tuple[str, ...]:
    from tdlm.tasks import TASK_NAMES

    names = tuple(TASK_NAMES if tasks is None else tasks)
    unknown = [t for t in names if t not in TASK_NAMES]
    if unknown:
        raise TDLMError(f"contamination check: unknown task(s) {unknown}, expected some of {list(TASK_NAMES)}")
    return names


def _resolve_data_dir(task: str, data_dir: str | os.PathLike | None) -> str | None:
    """The folder the task loader should read, or None for its own order (Hub, then the default dir)."""
    from tdlm.tasks import base

    explicit = data_dir if data_dir is not None else os.environ.get(base.DATA_DIR_ENV) or None
    if explicit is not None:
        return str(Path(explicit).expanduser())
    local = EVAL_SPLITS[task].local_files
    default = base.default_data_dir()
    if local and (default / local[0]).is_file():
        return str(default)
    return None


@functools.cache
def _eval_hashes(task: str, data_dir: str | None) -> tuple[dict[str, str], str]:
    from tdlm.tasks import load_task

    loaded = load_task(task, data_dir=data_dir)
    field = EVAL_SPLITS[task].question_field
    out: dict[str, str] = {}
    for p in loaded:
        for text in (p.prompt, p.raw.get(field) if p.raw else None):
            if isinstance(text, str) and text.strip():
                out.setdefault(prompt_hash(text), p.id)
    return out, loaded.source


def eval_hashes(task: str, data_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """hash -> problem id for every evaluation problem of ``task`` (bare question and full prompt);
    cached per process. Raises TDLMError when the task's data cannot be loaded."""
    (task,) = _task_names([task])
    return _eval_hashes(task, _resolve_data_dir(task, data_dir))[0]


@dataclass
class Overlap:
    counts: dict[str, int]  # task -> teacher prompts that are its evaluation problems
    examples: dict[str, list[str]]  # task -> up to 3 problem ids
    unavailable: dict[str, str]  # task -> why its problems could not be loaded

    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self, n: int) -> str:
        parts = []
        for task, c in self.counts.items():
            if c:
                ex = ", ".join(self.examples[task])
                parts.append(f"{c} of {n} teacher prompts are {EVAL_SPLITS[task].description} "
                             f"(evaluation split; e.g. {ex})")  # fmt: skip
        return "; ".join(parts)


def find_overlap(hashes: Sequence[str], tasks: Sequence[str] | None = None,
                 data_dir: str | os.PathLike | None = None) -> Overlap:  # fmt: skip
    """Count the ``hashes`` (of teacher prompts) found among each task's evaluation problems."""
    res = Overlap({}, {}, {})
    for task in _task_names(tasks):
        try:
            table = eval_hashes(task, data_dir)
        except TDLMError as e:
            res.unavailable[task] = str(e)
            continue
        hits = [table[h] for h in hashes if h in table]
        res.counts[task] = len(hits)
        res.examples[task] = sorted(set(hits))[:3]
    return res


# -- sources by name -----------------------------------------------------------------------------
def eval_split_of(source: str, config: str | None = None, split: str | None = None) -> EvalSplit | None:
    """The evaluation split a prompt source *is*, by name: a pinned file name or a Hub name + split.

    A split expression (``test[:100]``, ``train+test``) counts if any of its parts is the split.
    """
    name = Path(str(source)).name
    for s in EVAL_SPLITS.values():
        if name in s.local_files:
            return s
    parts = {p.split("[")[0].strip().lower() for p in (split or "").split("+")}
    for s in EVAL_SPLITS.values():
        if str(source).strip().lower() in s.hub_names and s.hub_split in parts:
            return s
    return None


def eval_split_of_tag(tag: str) -> EvalSplit | None:
    """Same for a :meth:`tdlm.data.prompts.PromptSource.tag` (``file name`` or ``name[/config]/split``),
    the only record of the source in manifests written before ``manifest["prompts"]``."""
    hit = eval_split_of(tag)
    if hit is not None or "/" not in tag:
        return hit
    parts = tag.split("/")
    for name in ("/".join(parts[:-1]), "/".join(parts[:-2])):
        hit = eval_split_of(name, None, parts[-1]) if name else None
        if hit is not None:
            return hit
    return None


def _describe_source(source: str, config: str | None, split: str | None, local: bool) -> str:
    if local:
        return f"prompt file {source}"
    extra = "".join(f", {k} {v!r}" for k, v in (("config", config), ("split", split)) if v)
    return f"prompt source {source!r}{extra}"


def check_prompt_source(src, allow_eval_prompts: bool = False) -> EvalSplit | None:
    """Refuse a :class:`tdlm.data.prompts.PromptSource` that is an evaluation split (by name), unless allowed."""
    hit = eval_split_of(src.source, src.config, None if src.is_local() else src.split)
    if hit is not None and not allow_eval_prompts:
        where = _describe_source(src.source, src.config, src.split, src.is_local())
        raise TDLMError(f"{where} holds the {hit.description} that evaluation task {hit.task!r} scores; "
                        f"{GENERATION_HINT}")  # fmt: skip
    return hit


# -- generation ----------------------------------------------------------------------------------
def check_teacher_prompts(
    src, texts: Sequence[str], allow_eval_prompts: bool = False, tasks: Sequence[str] | None = None,
    data_dir: str | os.PathLike | None = None,
) -> dict:  # fmt: skip
    """Generation-time check of the loaded prompts of ``src``: by name, then by content.

    Returns ``{"prompts": manifest block, "contamination": report}`` for the manifest. Raises
    TDLMError on any overlap unless allowed. Tasks whose problems cannot be loaded are skipped with
    a warning (the training preflight checks again, and refuses then).
    """
    hit = check_prompt_source(src, allow_eval_prompts)
    hashes = prompt_hashes(texts)
    ov = find_overlap(hashes, tasks, data_dir)
    where = _describe_source(src.source, src.config, src.split, src.is_local())
    if ov.total() and not allow_eval_prompts:
        raise TDLMError(f"{where}: {ov.describe(len(hashes))}; {GENERATION_HINT}")
    for task, why in ov.unavailable.items():
        log.warning("contamination check: %s test problems not loaded, teacher prompts not compared with them (%s)",
                    task, why)  # fmt: skip
    if allow_eval_prompts and (hit is not None or ov.total()):
        log.warning("%s: teacher prompts include evaluation problems (allowed by allow_eval_prompts): %s", where,
                    ov.describe(len(hashes)) or hit.description)  # fmt: skip
    return {
        "prompts": {
            "source": src.source,
            "tag": src.tag(),
            "config": None if src.is_local() else src.config,
            "split": None if src.is_local() else src.split,  # a local file has no split
            "field": src.field,
            "count": len(hashes),
            "hash": HASH_VERSION,
            "hash_rule": HASH_RULE,
            "hashes": hashes,
        },
        "contamination": _report(hit, ov, allow_eval_prompts),
    }


def _report(hit: EvalSplit | None, ov: Overlap, allowed: bool) -> dict:
    return {
        "allow_eval_prompts": allowed,
        "eval_split": hit.task if hit is not None else None,
        "overlap": dict(ov.counts),
        "overlap_examples": {t: e for t, e in ov.examples.items() if e},
        "unavailable": dict(ov.unavailable),
    }


# -- training preflight --------------------------------------------------------------------------
def _read_manifest(root: Path) -> dict | None:
    path = root / "manifest.json"
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TDLMError(f"{path}: not valid JSON ({e})") from e
    return m if isinstance(m, dict) else None


def _hashes_from_shards(root: Path) -> tuple[list[str], int]:
    """(hashes of the shards' prompt_text, rows without one) in shard order."""
    import pyarrow.parquet as pq

    shards = sorted(root.glob("shard-*.parquet"))
    if not shards:
        raise TDLMError(f"{root} holds no shard-*.parquet files")
    hashes, missing = [], 0
    for path in shards:
        try:
            texts = pq.read_table(str(path), columns=["prompt_text"]).column("prompt_text").to_pylist()
        except Exception as e:  # pyarrow raises several types (not Parquet, no such column)
            raise TDLMError(f"{path}: cannot read column prompt_text ({type(e).__name__}: {e})") from e
        for t in texts:
            if isinstance(t, str) and t.strip():
                hashes.append(prompt_hash(t))
            else:
                missing += 1
    return hashes, missing


def check_trajectory_prompts(trajectory_dir: str | os.PathLike, allow_eval_prompts: bool = False,
                             tasks: Sequence[str] | None = None, data_dir: str | os.PathLike | None = None,
                             hint: str = TRAINING_HINT) -> dict:  # fmt: skip
    """Training preflight: are any teacher prompts of ``trajectory_dir`` evaluation problems?

    Prompt hashes come from ``manifest.json`` (``prompts.hashes``, written by tdlm generation) or,
    for older manifests and folders without one, from the shards' ``prompt_text``. They are compared
    with the evaluation problems of ``tasks`` (default: every task in :data:`tdlm.tasks.TASK_NAMES`).

    Raises TDLMError (one line: folder, count, task, ``hint``) when prompts overlap, when the manifest
    names an evaluation split as the source, when rows have no prompt text, or when a task's problems
    cannot be loaded - unless ``allow_eval_prompts``. Returns the report (for the training log)::

        {"trajectory_dir", "prompts", "hash_source": "manifest" | "shards", "source", "split",
         "eval_split", "tasks", "overlap": {task: n}, "overlap_examples", "unhashed", "unavailable",
         "allowed", "contaminated"}
    """
    root = Path(trajectory_dir).expanduser()
    if not root.is_dir():
        raise TDLMError(f"{root}: trajectory folder not found")
    names = _task_names(tasks)
    manifest = _read_manifest(root)
    block = (manifest or {}).get("prompts")
    source = split = None
    hit = None
    if isinstance(block, dict) and block.get("hash") == HASH_VERSION and isinstance(block.get("hashes"), list):
        hashes, unhashed, hash_source = [str(h) for h in block["hashes"]], 0, "manifest"
        source, split = block.get("tag") or block.get("source"), block.get("split")
        if block.get("source"):
            hit = eval_split_of(block["source"], block.get("config"), split)
    else:  # older manifest (or none): recompute from the stored prompt texts
        hashes, unhashed = _hashes_from_shards(root)
        hash_source = "shards"
    if hit is None and manifest is not None:
        tag = (manifest.get("settings") or {}).get("prompt_source")
        if isinstance(tag, str):
            source = source or tag
            hit = eval_split_of_tag(tag)
    ov = find_overlap(hashes, names, data_dir)
    n = len(hashes) + unhashed
    report = {
        "trajectory_dir": str(root),
        "prompts": n,
        "hash_source": hash_source,
        "source": source,
        "split": split,
        "tasks": list(names),
        **{k: v for k, v in _report(hit, ov, allow_eval_prompts).items() if k != "allow_eval_prompts"},
        "unhashed": unhashed,
        "allowed": allow_eval_prompts,
    }
    report["contaminated"] = bool(ov.total() or hit is not None)
    if allow_eval_prompts:
        if report["contaminated"]:
            log.warning("%s: teacher prompts include evaluation problems (allowed): %s", root,
                        ov.describe(n) or f"source is the {hit.description}")  # fmt: skip
        return report
    problems = []
    if ov.total():
        problems.append(ov.describe(n))
    if hit is not None and not ov.total():
        problems.append(f"the prompt source {source} is an evaluation split (it holds the {hit.description})")
    if unhashed:
        problems.append(f"{unhashed} of {n} rows have no prompt_text, so they cannot be compared with the "
                        f"evaluation problems")  # fmt: skip
    for task, why in ov.unavailable.items():
        problems.append(f"the {task} evaluation problems could not be loaded to compare with ({why}; set "
                        f"$TDLM_DATA_DIR to the benchmark folder or check fewer tasks)")  # fmt: skip
    if problems:
        raise TDLMError(f"{root}: {'; '.join(problems)}; {hint}")
    return report


__all__ = [
    "EVAL_SPLITS",
    "HASH_RULE",
    "HASH_VERSION",
    "EvalSplit",
    "check_prompt_source",
    "check_teacher_prompts",
    "check_trajectory_prompts",
    "eval_hashes",
    "eval_split_of",
    "find_overlap",
    "normalise_prompt",
    "prompt_hash",
]
