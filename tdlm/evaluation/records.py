"""Per-sample result files: deterministic shards, append-per-sample JSONL, resume, merge, completeness.

A run's directory holds ``shards/shard-<w>-of-<W>.jsonl``: problem ``i`` (its index in the task split)
belongs to shard ``i % W``. The worker that owns a shard appends one JSON line per decoded sample and
flushes it, so a killed evaluation loses at most the sample in flight. Flushing (not ``fsync``) is
enough for a killed process; after a machine crash the last line may be cut, which is repaired:

* a record counts only once its line ends with ``\\n``; an unterminated tail is ignored by readers and
  cut off by :func:`repair` before a worker appends again;
* a malformed line *before* the last one is not a crash artefact and is an error naming file and line.

A full disk (ENOSPC / EDQUOT) can cut a line too: the write of a line that crosses the last free block comes back
short, and the next write fails. :class:`Appender` then cuts its own partial line at once (the file ends with the
previous record's newline again, and the space is given back) and raises one TDLMError naming the run folder and
"no space left"; every record before it is kept and counts as done, the failed one does not. A rerun after space is
freed decodes only what is missing.

On restart the done ids are read from every shard file present (also ones written with another worker
count), and only the remaining problems are split over the current workers. :func:`merge` then checks
that every expected problem appears exactly once across all files.
"""

from __future__ import annotations

import errno
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


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _free(folder: Path) -> str:
    try:
        st = os.statvfs(folder)
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize / 1024:.1f} KiB free"


class Appender:
    """Append records to a shard file, one line each, written straight to the file (single writer per file).

    Unbuffered on purpose: a Python file object keeps the bytes a failed flush did not write and tries them again
    at the next write or at close, so after a full disk a later flush could finish a cut line behind the reader's
    back, or close() could raise again over the first error. Here each line is ``os.write`` calls on an
    ``O_APPEND`` descriptor, and a failure cuts the partial line before it raises (module docstring).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        # One write call per line (more only after a short write): a kill loses at most this line, never a
        # neighbour, and no byte of it waits in a buffer.
        assert self._fd is not None, "Appender is closed"
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        start = os.fstat(self._fd).st_size
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as e:
            cut = self._cut(start, done)
            raise self._error(record, e, cut) from None

    def _cut(self, start: int, done: int) -> bool:
        """Remove this call's partial line (only if no other process appended meanwhile); True if the file now
        ends where it did before the call."""
        try:
            size = os.fstat(self._fd).st_size
            if size == start + done:
                if done:
                    os.ftruncate(self._fd, start)  # shrinking needs no free block
                return True
        except OSError:
            pass
        return False  # left for repair() when the file is opened again

    def _error(self, record: dict, e: OSError, cut: bool) -> TDLMError:
        run_dir = self.path.parent.parent if self.path.parent.name == SHARD_DIR else self.path.parent
        where = f"{self.path.parent.name}/{self.path.name}"
        tail = ("its partial line was cut" if cut else "its partial line is cut when the file is opened again")
        what = f"sample {record.get('id')!r} is not recorded ({tail}), the samples before it are kept"
        if e.errno in DISK_FULL_ERRNOS:
            return TDLMError(f"{run_dir}: no space left on the device appending to {where} ({_free(self.path.parent)})"
                             f"; {what}; free space and rerun the same command to decode the rest")  # fmt: skip
        return TDLMError(f"{self.path}: cannot append a sample ({e.strerror or e}); {what}")

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)  # network file systems may report a full disk or quota only here
            except OSError as e:
                raise TDLMError(f"{self.path}: closing failed ({e.strerror or e}); its last samples may not have "
                                f"reached the disk: rerun the same command (a cut line is repaired)") from None

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the error in flight is the one to report
            try:
                self.close()
            except TDLMError:
                pass


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
