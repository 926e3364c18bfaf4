"""Per-sample result files: deterministic shards, append-per-sample JSONL, resume, merge, completeness.

A run's directory holds ``shards/shard-<w>-of-<W>.jsonl``: problem ``i`` (its index in the task split)
belongs to shard ``i % W``. The worker that owns a shard appends one JSON line per decoded sample and
flushes it, so a killed evaluation loses at most the sample in flight. Flushing (not ``fsync``) is
enough for a killed process; after a machine crash the last line may be cut, which is repaired:

* a record counts only once its line ends with ``\\n``; an unterminated tail is ignored by readers and
  cut off by :func:`repair` before a worker appends again;
* a malformed line *before* the last one is not a crash artefact and is an error naming file and line.

On restart the done ids are read from every shard file present (also ones written with another worker
count), and only the remaining problems are split over the current workers. :func:`merge` then checks
that every expected problem appears exactly once across all files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tdlm.errors import TDLMError

SHARD_DIR = "shards"


class IncompleteResults(TDLMError):
    """Missing or duplicate problem ids when merging a run's shards."""


def shard_of(index: int, num_shards: int) -> int:
    """Owner shard of the problem with split index ``index`` (round-robin: balanced for any limit)."""
    return index % num_shards


def shard_path(run_dir: str | os.PathLike, shard: int, num_shards: int) -> Path:
    return Path(run_dir) / SHARD_DIR / f"shard-{shard:03d}-of-{num_shards:03d}.jsonl"


def shard_files(run_dir: str | os.PathLike) -> list[Path]:
    d = Path(run_dir) / SHARD_DIR
    return sorted(d.glob("shard-*.jsonl")) if d.is_dir() else []


def repair(path: str | os.PathLike) -> int:
    """Cut an unterminated last line (a write interrupted by a crash); returns the bytes removed."""
    p = Path(path)
    if not p.exists():
        return 0
    size = p.stat().st_size
    if size == 0:
        return 0
    with p.open("rb+") as fh:
        # Scan back from the end for the last newline; tails are at most one record long.
        pos, chunk = size, 1 << 16
        while pos > 0:
            start = max(0, pos - chunk)
            fh.seek(start)
            data = fh.read(pos - start)
            nl = data.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        if keep < size:
            fh.truncate(keep)
    return size - keep


def read_records(path: str | os.PathLike) -> list[dict]:
    """Complete records of one JSONL file; an unterminated last line is ignored (see module docstring)."""
    p = Path(path)
    if not p.exists():
        return []
    data = p.read_bytes()
    end = data.rfind(b"\n") + 1  # bytes after the last newline are an interrupted write
    out = []
    for n, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise TDLMError(f"{p}:{n}: not a JSON record ({e.msg}); expected one sample per line") from None
        if not isinstance(rec, dict) or "id" not in rec:
            raise TDLMError(f"{p}:{n}: record without an 'id' field")
        out.append(rec)
    return out


class Appender:
    """Append records to a shard file, one flushed line each (single writer per file)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair(self.path)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        # One write call per line, flushed at once: a kill loses at most this line, never a neighbour.
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def done_ids(run_dir: str | os.PathLike) -> set[str]:
    """Ids with a complete record in any shard file of the run."""
    return {r["id"] for f in shard_files(run_dir) for r in read_records(f)}


def merge(run_dir: str | os.PathLike, expected: Iterable[str]) -> list[dict]:
    """All records of a run in ``expected`` order; IncompleteResults unless each id appears exactly once.

    Records of ids outside ``expected`` (a previous run with a larger ``--limit``) are left out.
    """
    expected = list(expected)
    want = set(expected)
    seen: dict[str, tuple[dict, Path]] = {}
    dups: list[str] = []
    within: set[str] = set()  # files holding an id twice themselves
    across: set[str] = set()  # files repeating an id of an earlier file
    for f in shard_files(run_dir):
        for rec in read_records(f):
            rid = rec["id"]
            if rid not in want:
                continue
            if rid in seen:
                first = seen[rid][1]
                if first == f:
                    dups.append(f"{rid} (twice in {f.name})")
                    within.add(f.name)
                else:
                    dups.append(f"{rid} ({first.name} and {f.name})")
                    across.add(f.name)
            else:
                seen[rid] = (rec, f)
    missing = [i for i in expected if i not in seen]
    if dups or missing:
        parts = []
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            parts.append(f"{len(missing)} missing: {', '.join(missing[:5])}{more}")
        if dups:
            more = f" (+{len(dups) - 3} more)" if len(dups) > 3 else ""
            parts.append(f"{len(dups)} duplicate: {'; '.join(dups[:3])}{more}")
        hints = []
        if within:  # one writer per file: a second process appended to it (two jobs on one output dir)
            hints.append(f"{', '.join(sorted(within))} repeats a sample: run one evaluation per output dir at a time; "
                         f"delete the repeated line, or the file and rerun to decode its samples again")
        if across:
            hints.append(f"remove the stray shard file {', '.join(sorted(across))} (its samples are in another "
                         f"shard already)")
        if missing and not dups:
            hints.append("rerun the same command to decode the missing samples")
        hint = "; ".join(hints)
        raise IncompleteResults(
            f"{run_dir}: results incomplete ({'; '.join(parts)}); expected each of {len(expected)} problems "
            f"exactly once ({hint})"
        )
    return [seen[i][0] for i in expected]
