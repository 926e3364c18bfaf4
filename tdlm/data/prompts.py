"""Prompt sources for teacher generation and evaluation.

A source is either

* a local file: JSON Lines (``.jsonl`` / ``.json``, one object per line) or Parquet (``.parquet``),
  read directly (no ``datasets`` cache is written);
* a Hugging Face dataset name, loaded with ``datasets.load_dataset(name, config, split=split)``. Like
  every tdlm loader it works from the local cache when ``HF_DATASETS_OFFLINE=1``.

Every prompt gets a stable id ``"<source tag>:<row index>"``: the tag is the file name (not its
directory, so moving the data keeps the ids) or ``name[/config]/split`` for a dataset. Ids are what
trajectory records carry as ``source_id``, so a prompt can be traced back to its row.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tdlm.errors import TDLMError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Prompt:
    source_id: str  # "<source tag>:<row index>", stable across runs
    text: str


@dataclass(frozen=True)
class PromptSource:
    """Where prompts come from; ``limit`` keeps the first rows (None = all)."""

    source: str  # local .jsonl/.json/.parquet path, or a Hugging Face dataset name
    field: str = "question"  # column holding the prompt text
    config: str | None = None  # dataset config name (Hugging Face datasets only)
    split: str = "train"  # dataset split (Hugging Face datasets only); teacher prompts: a train split
    limit: int | None = None

    def is_local(self) -> bool:
        return Path(self.source).suffix.lower() in LOCAL_SUFFIXES or Path(self.source).is_file()

    def tag(self) -> str:
        if self.is_local():
            return Path(self.source).name
        return "/".join(p for p in (self.source, self.config, self.split) if p)


def _read_jsonl(path: Path, field: str) -> list:
    values = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TDLMError(f"{path} line {n}: invalid JSON ({e})") from e
            if not isinstance(row, dict):
                raise TDLMError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
            if field not in row:
                raise TDLMError(f"{path} line {n}: no field {field!r} (fields: {', '.join(sorted(row))})")
            values.append(row[field])
    return values


def _read_parquet(path: Path, field: str) -> list:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(str(path)).names
    except Exception as e:  # pyarrow raises several types for non-Parquet bytes
        raise TDLMError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from e
    if field not in names:
        raise TDLMError(f"{path}: no column {field!r} (columns: {', '.join(names)})")
    return pq.read_table(str(path), columns=[field]).column(field).to_pylist()


def _read_hf(src: PromptSource) -> list:
    import datasets

    try:
        ds = datasets.load_dataset(src.source, src.config, split=src.split)
    except Exception as e:  # datasets raises many types (missing config, offline, unknown split ...)
        raise TDLMError(
            f"dataset {src.source!r} (config={src.config!r}, split={src.split!r}) could not be loaded: "
            f"{type(e).__name__}: {e}"
        ) from e
    if src.field not in ds.column_names:
        raise TDLMError(f"dataset {src.tag()}: no field {src.field!r} (fields: {', '.join(ds.column_names)})")
    n = len(ds) if src.limit is None else min(src.limit, len(ds))
    return ds.select(range(n))[src.field]


def load_prompts(src: PromptSource) -> list[Prompt]:
    """The first ``src.limit`` prompts (all if None) with their stable ids."""
    if src.limit is not None and src.limit < 1:
        raise TDLMError(f"number of prompts must be >= 1; got {src.limit}")
    if src.is_local():
        path = Path(src.source).expanduser()
        if not path.is_file():
            raise TDLMError(f"{src.source}: prompt file not found")
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            values = _read_parquet(path, src.field)
        elif suffix in (".jsonl", ".json"):
            values = _read_jsonl(path, src.field)
        else:
            raise TDLMError(f"{path}: unknown prompt file type {suffix!r}; expected one of {', '.join(LOCAL_SUFFIXES)}")
    else:
        values = _read_hf(src)
    if src.limit is not None:
        if len(values) < src.limit:
            raise TDLMError(f"{src.tag()}: {src.limit} prompts requested but the source has only {len(values)}")
        values = values[: src.limit]
    if not values:
        raise TDLMError(f"{src.tag()}: no prompts")
    tag = src.tag()
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, str) or not v.strip():
            raise TDLMError(f"{tag} row {i}: field {src.field!r} must be a non-empty string; got {v!r:.60}")
        out.append(Prompt(f"{tag}:{i}", v))
    return out


def prompts_digest(prompts: list[Prompt]) -> str:
    """sha256 over (id, text) pairs: detects an edited prompt file between a run and its resume."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.source_id, p.text], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()
