"""The output dir of a generation job: shards, ``manifest.json``, and what a resume may trust.

Layout::

    <output_dir>/
        manifest.json          settings, backbone id, per-shard sha256 / rows, counts, NFE statistics,
                               prompts (source, split, one hash per prompt) and contamination (overlap
                               with the evaluation problems; tdlm.data.contamination)
        shard-00000.parquet    prompts [0, S)        (tdlm.data.trajectories schema, one row per prompt)
        shard-00001.parquet    prompts [S, 2S)
        ...
        .lock                  held (flock) by the one driver writing this dir

Only the driver writes here. A shard is written to ``<name>.tmp-<pid>``, fsynced and renamed into place
(:func:`tdlm.data.trajectories.write_parquet`); the manifest is rewritten the same way after every shard.
So a killed job leaves whole shards only, at worst one more shard on disk than the manifest lists.

A full disk (ENOSPC / EDQUOT) while writing a shard or the manifest removes the temporary file at once and
raises one TDLMError naming the folder ("no space left"): the shard is not listed, the manifest on disk is the
previous one, and nothing is retried (no replica can fix a full disk). After space is freed, rerunning the same
command adopts a whole shard that was renamed before the manifest write failed and computes the rest.

What :meth:`ShardStore.open` does with what it finds (documented policy):

==========================================  =========================================================
found                                       action
==========================================  =========================================================
manifest with other identity settings       TDLMError naming every differing setting
shard listed in the manifest, bytes match   finished, skipped
shard listed, sha256 / size differ          TDLMError naming the file (changed after it was written;
                                            delete it to have it recomputed)
shard listed, file missing                  warning; recomputed
shard on disk, not listed, passes checks    adopted (written just before a kill; checks: readable,
                                            valid records, exactly this shard's prompt ids and texts,
                                            backbone id, decode settings)
shard on disk, not listed, fails a check    TDLMError naming the file and the check; never read
shard-N.parquet with N >= number of shards  TDLMError (not part of this job)
any other ``*.parquet``                     TDLMError (readers glob ``*.parquet`` and would load it)
stale ``*.tmp-*``                           warning; removed (the lock proves no writer is alive)
any other file or folder                    warning; left alone
shard files but no manifest.json            TDLMError (not a tdlm generation dir)
manifest without ``prompts`` /              added (older tdlm); a changed ``contamination`` report
``contamination`` (or with other ones)      (e.g. another ``allow_eval_prompts``) is replaced
==========================================  =========================================================
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
import os
import re
import statistics
from pathlib import Path

from tdlm.config import diff_settings
from tdlm.data.folder_lock import FolderLock
from tdlm.data.onpolicy import ROLLOUT_KEY
from tdlm.data.prompts import Prompt
from tdlm.data.trajectories import TrajectoryRecord, fsync_file, read_parquet, write_error, write_parquet
from tdlm.errors import TDLMError

log = logging.getLogger("tdlm.generation")

MANIFEST = "manifest.json"
LOCK = ".lock"
FORMAT, FORMAT_VERSION = "tdlm-trajectories", 1
SHARD_RE = re.compile(r"^shard-(\d{5,})\.parquet$")
TMP_RE = re.compile(r"\.tmp-\d+$")
ACTOR_IDENTITY = ("backbone", "adapter", "backbone_id")  # reported by the replicas


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def atomic_write_text(path: Path, text: str, kept: str | None = None) -> None:
    """Write ``text`` to ``<path>.tmp-<pid>``, fsync, rename: readers see the old or the new file, never half.

    A failed write (a full disk: ENOSPC / EDQUOT) removes the temporary file at once, so nothing half-written stays
    to fill the disk, and raises a one-line TDLMError naming the folder ("no space left"); ``kept`` says what stays
    valid (default: the previous ``path``, untouched).
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e, kept or f"{path.name} is unchanged") from None
        raise


def atomic_write_json(path: Path, obj: dict, kept: str | None = None) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n", kept)


class ShardStore:
    """Shard bookkeeping for one output dir; use as a context manager (holds the dir's lock)."""

    def __init__(self, root: str | os.PathLike, prompts: list[Prompt], shard_size: int, identity: dict,
                 provenance: dict | None = None) -> None:  # fmt: skip
        self.root = Path(root).expanduser()
        self.prompts = prompts
        self.shard_size = shard_size
        self.identity = dict(identity)
        # {"prompts": source/split/per-prompt hashes, "contamination": report} from
        # tdlm.data.contamination.check_teacher_prompts: top-level manifest keys, not settings (not compared on
        # resume: the prompts themselves are, via prompts_sha256)
        self.provenance = dict(provenance or {})
        self.num_shards = math.ceil(len(prompts) / shard_size)
        self.manifest: dict | None = None
        self.adopted = 0  # unlisted but verified shards taken over by open()
        self._actor_identity: dict | None = None
        self._lock: FolderLock | None = None

    # -- lock ----------------------------------------------------------------------------------
    def __enter__(self) -> ShardStore:
        if self.root.exists() and not self.root.is_dir():
            raise TDLMError(f"output dir {self.root} exists and is not a folder")
        # The same lock as the evaluator's: the holder is named to a second run, a dead holder's is taken over.
        self._lock = FolderLock(self.root, "generation run").acquire()
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- shards --------------------------------------------------------------------------------
    def shard_range(self, index: int) -> tuple[int, int]:
        """Prompts [start, end) of shard ``index``: fixed by shard_size alone, so reruns agree."""
        start = index * self.shard_size
        return start, min(start + self.shard_size, len(self.prompts))

    def shard_prompts(self, index: int) -> list[Prompt]:
        start, end = self.shard_range(index)
        return self.prompts[start:end]

    @property
    def finished(self) -> dict[str, dict]:
        return self.manifest["shards"] if self.manifest else {}

    def todo(self) -> list[int]:
        return [i for i in range(self.num_shards) if shard_name(i) not in self.finished]

    def finished_prompts(self) -> int:
        return sum(e["rows"] for e in self.finished.values())

    # -- opening / resuming --------------------------------------------------------------------
    def open(self) -> list[int]:
        """Check the dir against this job (policy table in the module docstring); shards left to do."""
        assert self._lock is not None, "use ShardStore as a context manager (it must hold the lock)"
        mpath = self.root / MANIFEST
        stale: dict = {}
        if mpath.exists():
            try:
                self.manifest = json.loads(mpath.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TDLMError(f"{mpath}: not valid JSON ({e}); restore it or use a new --output-dir") from e
            if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
                raise TDLMError(f"{mpath}: not a tdlm generation manifest (format != {FORMAT!r})")
            if self.manifest.get("format_version") != FORMAT_VERSION:
                raise TDLMError(
                    f"{mpath}: format_version={self.manifest.get('format_version')!r}; "
                    f"this tdlm writes {FORMAT_VERSION}"
                )
            self._check_settings(self.identity)
            stale = {k: v for k, v in self.provenance.items() if self.manifest.get(k) != v}
            self.manifest.update(stale)  # an older manifest gains them; a changed report is updated
        shard_files: dict[int, Path] = {}
        for entry in sorted(self.root.iterdir()):
            name = entry.name
            if name in (MANIFEST, LOCK):
                continue
            if TMP_RE.search(name) and entry.is_file():
                log.warning("%s: stale temporary file from an interrupted write; removing it", entry)
                entry.unlink()
                continue
            m = SHARD_RE.match(name)
            if m and entry.is_file():
                index = int(m.group(1))
                if index >= self.num_shards or name != shard_name(index):
                    raise TDLMError(
                        f"{entry}: not part of this job (it has {self.num_shards} shards, "
                        f"{shard_name(0)} .. {shard_name(self.num_shards - 1)}); move it away"
                    )
                shard_files[index] = entry
            elif name.endswith(".parquet"):
                raise TDLMError(
                    f"{entry}: foreign Parquet file in the output dir (readers load every *.parquet here); move it away"
                )
            else:
                kind = "folder" if entry.is_dir() else "file"
                log.warning("%s: unknown %s in the output dir; left alone", entry, kind)
        if self.manifest is None:
            if shard_files:
                first = shard_files[min(shard_files)]
                raise TDLMError(f"{first}: shard files but no {MANIFEST} in {self.root}; not a tdlm generation dir")
            return self.todo()
        listed = dict(self.manifest.get("shards", {}))
        for name, meta in listed.items():
            path = self.root / name
            if not path.exists():
                log.warning("%s: listed as finished in %s but missing; it will be recomputed", path, MANIFEST)
                del self.manifest["shards"][name]
                continue
            size = path.stat().st_size
            if size != meta["bytes"] or sha256_of(path) != meta["sha256"]:
                raise TDLMError(
                    f"{path}: contents differ from {MANIFEST} (sha256/size changed after it was written); "
                    f"delete the file to have it recomputed"
                )
        for index, path in sorted(shard_files.items()):
            if path.name in self.manifest["shards"]:
                continue
            records = self._verify_unlisted(index, path)
            self.manifest["shards"][path.name] = self._entry(index, path, records, None, {}, attempts=None)
            log.info("%s: complete shard written just before the last run stopped; verified and adopted", path)
            self.adopted += 1
        if stale or self.adopted or len(listed) != len(self.manifest["shards"]):
            self._write()
        return self.todo()

    def _check_settings(self, new: dict) -> None:
        old = self.manifest.get("settings", {})
        # Compare only what both sides know (the backbone fingerprint may be known only to the actors).
        common = {k: new[k] for k in new if k in old or k not in ACTOR_IDENTITY}
        diffs = diff_settings({k: old.get(k, "<unset>") for k in common}, common)
        if diffs:
            raise TDLMError(
                f"{self.root} was generated with other settings ({'; '.join(diffs)}); "
                f"rerun with the old settings or use a new --output-dir"
            )

    def _verify_unlisted(self, index: int, path: Path) -> list[TrajectoryRecord]:
        """A shard the manifest does not list: trust it only if it is exactly this job's shard."""
        records = read_parquet(path)  # raises TDLMError naming the file for unreadable / invalid rows
        expected = self.shard_prompts(index)
        settings = self.manifest["settings"]
        if [r.source_id for r in records] != [p.source_id for p in expected]:
            raise TDLMError(f"{path}: holds other prompts than shard {index} of this job (source_id mismatch)")
        for row, (r, p) in enumerate(zip(records, expected, strict=True)):
            if r.prompt_text != p.text:
                raise TDLMError(f"{path} row {row}: prompt_text differs from the prompt source")
            if r.backbone_id != settings.get("backbone_id"):
                raise TDLMError(f"{path} row {row}: backbone_id {r.backbone_id!r} != {settings.get('backbone_id')!r}")
            own = {k: v for k, v in r.decode_settings.items() if k != ROLLOUT_KEY}  # a roll-out's per-record s*
            if own != settings["decode"]:
                raise TDLMError(f"{path} row {row}: decode_settings differ from {MANIFEST}")
            rollout, got = settings.get("rollout"), r.decode_settings.get(ROLLOUT_KEY)
            if (rollout is None) != (got is None) or (rollout and any(
                    got.get(k) != rollout[k] for k in ("round", "adapter_version"))):  # fmt: skip
                raise TDLMError(f"{path} row {row}: roll-out provenance {got!r} differs from {MANIFEST}")
            if len(r.response_ids) != settings["decode"]["gen_length"]:
                raise TDLMError(f"{path} row {row}: response has {len(r.response_ids)} tokens, expected gen_length")
        return records

    def check_actor_identity(self, info: dict) -> None:
        """Every replica must load the same backbone/adapter as the others and as this dir was made with.

        The first call creates ``manifest.json`` for a new dir: from then on shards may be written.
        """
        mine = {k: info[k] for k in ACTOR_IDENTITY}
        where = f"actor pid {info.get('pid')}@{info.get('host')}"
        if self._actor_identity is not None:
            diffs = diff_settings(self._actor_identity, mine)
            if diffs:
                raise TDLMError(f"{where} loaded something else than the first replica ({'; '.join(diffs)}); "
                                f"the checkpoint differs between nodes")  # fmt: skip
            return
        for key in ("backbone", "adapter"):
            if key in self.identity and self.identity[key] != mine[key]:
                raise TDLMError(
                    f"{key} fingerprint on the driver ({self.identity[key]}) differs from the one {where} "
                    f"loaded ({mine[key]}); the checkpoint differs between nodes"
                )
        if self.manifest is not None:
            old = self.manifest["settings"]
            diffs = diff_settings({k: old.get(k, "<unset>") for k in ACTOR_IDENTITY}, mine)
            if diffs:
                raise TDLMError(
                    f"{self.root} was generated with other settings ({'; '.join(diffs)}); "
                    f"rerun with the old backbone/adapter or use a new --output-dir"
                )
        else:
            self.manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "status": "running",
                "created": _now(),
                "settings": {**self.identity, **mine},
                "backbone_id": mine["backbone_id"],
                "num_prompts": len(self.prompts),
                "shard_size": self.shard_size,
                "num_shards": self.num_shards,
                "counts": {},
                "nfe": None,
                **self.provenance,
                "shards": {},
                "runs": [],
            }
            self._write()
        self._actor_identity = mine

    # -- writing -------------------------------------------------------------------------------
    def _entry(self, index, path, records, seconds, worker, attempts) -> dict:
        start, end = self.shard_range(index)
        nfe = [r.T for r in records]
        return {
            "index": index,
            "prompts": [start, end],
            "rows": len(records),
            "bytes": path.stat().st_size,
            "sha256": sha256_of(path),
            "nfe_sum": sum(nfe),
            "nfe_min": min(nfe),
            "nfe_max": max(nfe),
            "seconds": seconds,
            "attempts": attempts,
            "worker": worker,
            "written": _now(),
        }

    def write_shard(self, index: int, records: list[TrajectoryRecord], seconds: float, worker: dict,
                    attempts: int, extra: dict | None = None) -> dict:  # fmt: skip
        """Write one shard atomically; returns its manifest entry (call :meth:`commit` to list it). ``extra``: what
        the worker measured beside the records (a roll-out's exposure-gap sums), kept in the entry."""
        assert self.manifest is not None, "check_actor_identity() creates the manifest before any shard"
        expected = [p.source_id for p in self.shard_prompts(index)]
        got = [r.source_id for r in records]
        if got != expected:  # a worker bug, never data to write
            raise TDLMError(f"shard {index}: worker returned prompts {got[:3]}... instead of {expected[:3]}...")
        path = write_parquet(records, self.root / shard_name(index))
        entry = self._entry(index, path, records, seconds, worker, attempts)
        if extra:
            entry["extra"] = extra
        return entry

    def commit(self, entry: dict) -> None:
        name = shard_name(entry["index"])
        if name in self.finished:  # exactly once: a shard is written by one attempt only
            raise TDLMError(f"{name} is already finished; refusing to list it twice")
        self.manifest["shards"][name] = entry
        self._write()

    def record_run(self, run: dict) -> None:
        self.manifest.setdefault("runs", []).append(run)
        self._write()

    def _write(self) -> None:
        m = self.manifest
        m["shards"] = dict(sorted(m["shards"].items()))
        m["counts"] = {
            "prompts": len(self.prompts),
            "shards": self.num_shards,
            "finished_shards": len(m["shards"]),
            "finished_prompts": self.finished_prompts(),
        }
        m["updated"] = _now()
        atomic_write_json(self.root / MANIFEST, m, kept=f"{MANIFEST} still lists only the shards finished "
                          f"before (a whole shard not listed yet is verified and adopted by the rerun)")  # fmt: skip

    # -- completion ----------------------------------------------------------------------------
    def finalize(self) -> dict:
        """Check every prompt appears exactly once, in shard order; NFE statistics; status complete."""
        import pyarrow.parquet as pq

        missing = self.todo()
        if missing:
            raise TDLMError(f"{self.root}: shards {missing[:10]} are not finished")
        ids: list[str] = []
        nfe: list[int] = []
        for i in range(self.num_shards):
            table = pq.read_table(str(self.root / shard_name(i)), columns=["source_id", "T"])
            ids.extend(table.column("source_id").to_pylist())
            nfe.extend(table.column("T").to_pylist())
        expected = [p.source_id for p in self.prompts]
        if ids != expected:
            dup = len(ids) - len(set(ids))
            raise TDLMError(f"{self.root}: shards hold {len(ids)} rows ({dup} duplicates) for {len(expected)} prompts")
        gen_length = self.manifest["settings"]["decode"]["gen_length"]
        stats = {
            "mean": statistics.fmean(nfe),
            "median": statistics.median(nfe),
            "min": min(nfe),
            "max": max(nfe),
            "tokens_per_nfe": gen_length * len(nfe) / sum(nfe),
        }
        if self.manifest.get("status") != "complete" or self.manifest.get("nfe") != stats:
            self.manifest["status"] = "complete"
            self.manifest["nfe"] = stats
            self.manifest["completed"] = _now()
            self._write()
        return stats


def write_manifest(root: str | os.PathLike, backbone_id: str, settings: dict) -> dict:
    """A complete ``manifest.json`` for shards written outside :class:`ShardStore` (the embedded default's
    in-process teacher, tests): every ``shard-*.parquet`` with its rows, size and sha256, status complete."""
    import pyarrow.parquet as pq

    root = Path(root)
    shards = {}
    for path in sorted(root.glob("shard-*.parquet")):
        rows = pq.ParquetFile(str(path)).metadata.num_rows
        shards[path.name] = {"rows": rows, "bytes": path.stat().st_size, "sha256": sha256_of(path)}
    if not shards:
        raise TDLMError(f"{root}: no shard-*.parquet to describe")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "status": "complete",
        "created": _now(),
        "completed": _now(),
        "settings": dict(settings),
        "backbone_id": backbone_id,
        "num_prompts": sum(e["rows"] for e in shards.values()),
        "num_shards": len(shards),
        "shards": shards,
        "runs": [],
    }
    atomic_write_json(root / MANIFEST, manifest)
    return manifest
