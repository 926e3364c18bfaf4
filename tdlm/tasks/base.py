"""Shared pieces of the evaluation tasks: the :class:`Problem` / :class:`Task` records and dataset loading.

Loading order (:func:`load_records`), chosen so that evaluation never hangs on a dead network:

1. ``data_dir`` argument, else the ``TDLM_DATA_DIR`` env var: read the local JSONL file only.
2. ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set, or a 3-second TCP probe of the Hub endpoint (or of the
   HTTPS proxy) fails: read the local JSONL file from the default directory (:func:`default_data_dir`: the copies
   shipped in ``data/benchmarks`` of the checkout, else ``../shared/benchmarks`` beside it, the layout the project
   was built in).
3. Otherwise ``datasets.load_dataset(<hub id>, <config>, split=<split>)``; any error falls back to step 2.

Every path checks the record count and the required fields, so a truncated or wrong file fails loudly with a
:class:`~tdlm.errors.TDLMError` naming the file and the expected count. Local files are read with
``datasets.load_dataset("json", data_files=...)`` into a throw-away cache directory and converted to plain
dicts, so nothing is written to ``~/.cache/huggingface``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from tdlm.errors import TDLMError

log = logging.getLogger(__name__)

DATA_DIR_ENV = "TDLM_DATA_DIR"
HUB_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Problem:
    """One evaluation problem.

    ``prompt`` is the user message text (no chat template applied). ``answer`` is the gold final answer for math
    tasks (GSM8K: the number after ``####`` without commas; MATH-500: the ``answer`` LaTeX) and the reference
    solution code for MBPP. ``tests`` / ``test_imports`` are MBPP's asserts and the imports they need.
    """

    task: str  # registry name, e.g. "gsm8k"; scoring dispatches on it
    id: str  # stable across runs and sources, e.g. "gsm8k/0007", "math500/test/algebra/1.json", "mbpp/11"
    index: int  # position in the full split (before `limit`)
    prompt: str
    answer: str
    tests: tuple[str, ...] = ()
    test_imports: tuple[str, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Task:
    """A loaded task: its problems plus what is needed to reproduce the prompts and the data."""

    name: str
    prompt_version: str  # bump whenever the prompt text changes, so results are never mixed across formats
    metric: Literal["accuracy", "pass@1"]
    problems: tuple[Problem, ...]
    source: str  # "hub:<id>/<config>/<split>" or "local:<path> sha256=<hex>"

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)

    def __getitem__(self, i: int) -> Problem:
        return self.problems[i]


@dataclass(frozen=True)
class DatasetSpec:
    """Where a task's records live and what a correct copy looks like."""

    hub_path: str
    hub_config: str | None
    hub_split: str
    local_file: str  # file name inside the data dir, as in data/benchmarks
    expected_count: int
    required_fields: tuple[str, ...]


_CHECKOUT = Path(__file__).resolve().parents[2]
SHIPPED_DATA_DIR = _CHECKOUT / "data" / "benchmarks"  # shipped in the repository (README there: sources, sha256)
SHARED_DATA_DIR = _CHECKOUT.parent / "shared" / "benchmarks"  # the pinned copies beside the checkout


def default_data_dir() -> Path:
    """The local benchmark folder used when neither ``data_dir`` nor ``$TDLM_DATA_DIR`` names one: the copies shipped
    in ``data/benchmarks`` when that folder exists, else ``../shared/benchmarks`` beside the checkout.

    The shipped copy comes first so that a clone works alone; the shared one stays as a fallback for an installed
    package (no ``data/`` beside it) run next to the shared layout. When neither exists the shipped path is returned,
    so the error of :func:`load_local` names where the files belong.
    """
    if SHIPPED_DATA_DIR.is_dir() or not SHARED_DATA_DIR.is_dir():
        return SHIPPED_DATA_DIR
    return SHARED_DATA_DIR


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def hub_offline() -> bool:
    """True when the user asked the HF libraries to stay offline."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE")


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """TCP-connect to the Hub endpoint (or the HTTPS proxy) with a short timeout.

    The HF clients retry for tens of seconds on a black-holed network; this probe bounds that to ``timeout_s``.
    """
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname
    if not host:
        return False
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _check_records(records: Sequence[Mapping[str, Any]], spec: DatasetSpec, where: str) -> None:
    if len(records) != spec.expected_count:
        raise TDLMError(f"{where}: {len(records)} records, expected {spec.expected_count}")
    for i, rec in enumerate(records):
        missing = [f for f in spec.required_fields if f not in rec or rec[f] is None]
        if missing:
            raise TDLMError(f"{where}: record {i} lacks field(s) {missing}, expected {list(spec.required_fields)}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_local(spec: DatasetSpec, data_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], str]:
    """Read ``data_dir/spec.local_file`` (JSON Lines) and check it; returns (records, source string)."""
    path = Path(data_dir).expanduser() / spec.local_file
    if not path.is_file():
        raise TDLMError(f"{path}: missing; expected a JSONL file with {spec.expected_count} records")
    import datasets  # lazy: ~1 s import, not needed by callers that only build prompts

    bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()  # a 0.05 s read needs no progress bar in every eval log
    try:
        with tempfile.TemporaryDirectory(prefix="tdlm-ds-") as cache:
            try:
                ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache)
            except Exception as e:  # pyarrow / json errors: report as bad input, one line
                raise TDLMError(f"{path}: not valid JSON Lines ({type(e).__name__}); expected {spec.local_file}") from e
            records = ds.to_list()  # plain dicts: the arrow files die with the temp cache
    finally:
        if bars_were_on:
            datasets.utils.logging.enable_progress_bar()
    _check_records(records, spec, str(path))
    return records, f"local:{path} sha256={_sha256(path)}"


def load_hub(spec: DatasetSpec) -> tuple[list[dict[str, Any]], str]:
    """Download the split from the Hugging Face Hub and check it; returns (records, source string)."""
    import datasets

    ds = datasets.load_dataset(spec.hub_path, spec.hub_config, split=spec.hub_split)
    records = ds.to_list()
    where = f"hub:{spec.hub_path}/{spec.hub_config}/{spec.hub_split}"
    _check_records(records, spec, where)
    return records, where


def load_records(spec: DatasetSpec, data_dir: str | os.PathLike[str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """Records of one split, from ``data_dir`` / ``$TDLM_DATA_DIR`` if given, else the Hub, else the default dir."""
    explicit = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or None
    if explicit is not None:
        return load_local(spec, explicit)
    if not hub_offline() and hub_reachable():
        try:
            return load_hub(spec)
        except TDLMError:
            raise  # a Hub copy with the wrong count is a real problem, not a network blip
        except Exception as e:  # network / auth / format errors: the pinned local copy is equivalent
            log.warning(
                "loading %s from the Hub failed (%s: %s); using local files", spec.hub_path, type(e).__name__, e
            )
    try:
        return load_local(spec, default_data_dir())
    except TDLMError as e:
        raise TDLMError(f"{e} (Hub not used or unreachable; set {DATA_DIR_ENV} or pass data_dir)") from None


def apply_limit(problems: list[Problem], limit: int | None) -> tuple[Problem, ...]:
    """First ``limit`` problems (all when None); the ids and indices stay those of the full split."""
    if limit is None:
        return tuple(problems)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise TDLMError(f"limit: got {limit!r}, expected a non-negative int or None")
    return tuple(problems[:limit])


def generated_task(name: str, prompt_version: str, metric: str, id_prefix: str,
                   rows: Sequence[tuple[str, str, dict[str, Any]]], source: str) -> Task:  # fmt: skip
    """A task whose problems are generated locally (``arith``, ``multi``): one (prompt, gold answer, raw record)
    per problem, ids ``<id_prefix>/<index:06d>``."""
    return Task(
        name=name,
        prompt_version=prompt_version,
        metric=metric,
        problems=tuple(Problem(task=name, id=f"{id_prefix}/{i:06d}", index=i, prompt=prompt, answer=answer, raw=raw)
                       for i, (prompt, answer, raw) in enumerate(rows)),  # fmt: skip
        source=source,
    )
