"""Teacher trajectories as training data (paper Section 2.3, Eqs. 3-5).

A trajectory is (prompt ids, final response tokens y_p, reveal steps a_p in 1..T, T). From it:

* :func:`state_at` reconstructs the input at any step s (Eq. 3): y_p where a_p <= s, mask otherwise;
* :func:`sample_steps` draws 0 = s_0 < s_1 < ... < s_{K-1} < s_K = T with K-1 distinct steps uniform
  from {1..T-1} (all of them when T - 1 < K - 1);
* :func:`target_mask` gives T_i = {p : a_p in (s_i, s_{i+1}]} (Eq. 4), supervised for 1 <= i < K;
* :func:`trajectory_loss` is Eq. (5): mean CE over every supervised token of every sampled input
  (S_0 only seeds history). It returns the sum and the token count separately so that gradient
  accumulation and data parallelism normalise by the *global* token count.

Records are stored in a versioned Parquet schema (:data:`SCHEMA_VERSION`), written and read with
``datasets`` / pyarrow, and checked by :func:`validate_record` which names file, row and field.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tdlm.errors import TDLMError

SCHEMA_VERSION = 1
IGNORE_INDEX = -100
COLUMNS = (
    "schema_version", "source_id", "prompt_text", "prompt_ids", "response_ids", "reveal_steps", "T",
    "backbone_id", "decode_settings",
)


@dataclass
class TrajectoryRecord:
    source_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    reveal_steps: list[int]
    T: int
    prompt_text: str = ""
    backbone_id: str = ""
    decode_settings: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_row(self) -> dict:
        row = {c: getattr(self, c) for c in COLUMNS}
        row["decode_settings"] = json.dumps(self.decode_settings, sort_keys=True)
        return row

    @classmethod
    def from_row(cls, row: dict) -> TrajectoryRecord:
        settings = row.get("decode_settings") or "{}"
        return cls(
            source_id=str(row["source_id"]),
            prompt_ids=[int(x) for x in row["prompt_ids"]],
            response_ids=[int(x) for x in row["response_ids"]],
            reveal_steps=[int(x) for x in row["reveal_steps"]],
            T=int(row["T"]),
            prompt_text=row.get("prompt_text") or "",
            backbone_id=row.get("backbone_id") or "",
            decode_settings=json.loads(settings) if isinstance(settings, str) else dict(settings),
            schema_version=int(row["schema_version"]),
        )

    @classmethod
    def from_decode(cls, result, source_id: str, prompt_text: str, backbone_id: str, settings: dict):
        return cls(
            source_id=source_id,
            prompt_ids=list(result.prompt_ids),
            response_ids=list(result.tokens),
            reveal_steps=list(result.reveal_step),
            T=int(result.T),
            prompt_text=prompt_text,
            backbone_id=backbone_id,
            decode_settings=dict(settings),
        )


# -- validation -------------------------------------------------------------------------------------
def validate_record(rec: TrajectoryRecord | dict, where: str = "record") -> TrajectoryRecord:
    """Reject inconsistent records with a message naming ``where`` (file + row) and the field."""
    if isinstance(rec, dict):
        missing = [c for c in COLUMNS if c not in rec]
        if missing:
            raise TDLMError(f"{where}: missing field(s) {missing}")
        if rec["schema_version"] != SCHEMA_VERSION:
            raise TDLMError(
                f"{where}: field schema_version={rec['schema_version']!r}; this tdlm reads version {SCHEMA_VERSION}"
            )
        try:
            rec = TrajectoryRecord.from_row(rec)
        except (TypeError, ValueError, KeyError) as e:
            raise TDLMError(f"{where}: malformed field ({e})") from e
    if rec.schema_version != SCHEMA_VERSION:
        raise TDLMError(f"{where}: field schema_version={rec.schema_version}; expected {SCHEMA_VERSION}")
    n, T = len(rec.response_ids), rec.T
    if len(rec.reveal_steps) != n:
        raise TDLMError(
            f"{where}: field reveal_steps has {len(rec.reveal_steps)} entries but response_ids has {n}"
        )
    if n == 0 or not rec.prompt_ids:
        raise TDLMError(f"{where}: field {'response_ids' if n == 0 else 'prompt_ids'} is empty")
    if T < 1 or T > n:
        raise TDLMError(f"{where}: field T={T} must be in 1..{n} (one or more reveals per step)")
    bad = [(p, a) for p, a in enumerate(rec.reveal_steps) if not 1 <= a <= T]
    if bad:
        p, a = bad[0]
        raise TDLMError(f"{where}: field reveal_steps[{p}]={a} outside 1..T={T}")
    seen = set(rec.reveal_steps)
    empty = [s for s in range(1, T + 1) if s not in seen]
    if empty:
        raise TDLMError(f"{where}: field reveal_steps: step {empty[0]} of 1..T={T} reveals nothing")
    return rec


# -- Eqs. 3-5 ---------------------------------------------------------------------------------------
def state_at(
    response_ids: torch.Tensor, reveal_steps: torch.Tensor, s: int | torch.Tensor, mask_id: int
) -> torch.Tensor:
    """Eq. (3): y_p where a_p <= s, else mask.

    response_ids, reveal_steps (N,); s an int -> (N,), or a 1-D tensor of K steps -> (K, N).
    """
    s = torch.as_tensor(s, device=reveal_steps.device)
    visible = reveal_steps[None] <= s[:, None] if s.dim() else reveal_steps <= s
    return torch.where(visible, response_ids, torch.full_like(response_ids, mask_id))


def sample_steps(T: int, K: int, generator: torch.Generator | None = None) -> list[int]:
    """[s_0=0, s_1, ..., s_{K'-1}, s_K'=T] with K'-1 distinct sorted steps from {1..T-1}.

    K' = min(K, T): when the trajectory has fewer than K-1 inner steps, all of them are used.
    """
    if T < 1 or K < 1:
        raise TDLMError(f"sample_steps needs T >= 1 and K >= 1; got T={T}, K={K}")
    inner = min(K - 1, T - 1)
    picks = (torch.randperm(T - 1, generator=generator)[:inner] + 1).sort().values.tolist() if inner else []
    return [0, *picks, T]


def target_mask(reveal_steps: torch.Tensor, steps: Sequence[int]) -> torch.Tensor:
    """(K, N) bool: row i marks T_i = {p : s_i < a_p <= s_{i+1}} (Eq. 4); row 0 is all False."""
    s = torch.as_tensor(steps, device=reveal_steps.device)
    lo, hi = s[:-1, None], s[1:, None]  # (K, 1)
    t = (reveal_steps[None] > lo) & (reveal_steps[None] <= hi)
    t[0] = False  # S_0 seeds history only (its temporal correction is zero)
    return t


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor  # (B, K, L) states S_0..S_{K-1}, left-padded prompts
    labels: torch.Tensor  # (B, K, L) y_p at supervised positions, IGNORE_INDEX elsewhere
    attention_mask: torch.Tensor  # (B, L)
    prompt_len: int
    num_targets: int

    def to(self, device) -> TrainingBatch:
        return TrainingBatch(self.input_ids.to(device), self.labels.to(device), self.attention_mask.to(device),
                             self.prompt_len, self.num_targets)


def build_batch(
    records: Sequence[TrajectoryRecord], K: int, mask_id: int, pad_id: int, generator: torch.Generator | None = None
) -> TrainingBatch:
    """Sample K states per trajectory and lay them out for :meth:`tdlm.TDLM.forward_states`.

    All records must share the response length N. A trajectory with fewer than K states (T < K) fills
    the remaining slots with its fully revealed response: such an input has no masked position, so it
    receives no correction, contributes no history (A_{p,i,j} needs m_{j,p}) and has no targets.
    """
    if not records:
        raise TDLMError("build_batch: no records")
    N = len(records[0].response_ids)
    if any(len(r.response_ids) != N for r in records):
        raise TDLMError("build_batch: all trajectories in a batch must have the same response length")
    P = max(len(r.prompt_ids) for r in records)
    L = P + N
    B = len(records)
    ids = torch.full((B, K, L), pad_id, dtype=torch.long)
    labels = torch.full((B, K, L), IGNORE_INDEX, dtype=torch.long)
    am = torch.zeros((B, L), dtype=torch.long)
    for b, r in enumerate(records):
        steps = sample_steps(r.T, K, generator)
        y = torch.tensor(r.response_ids)
        a = torch.tensor(r.reveal_steps)
        states = state_at(y, a, torch.tensor(steps[:-1]), mask_id)  # (K', N)
        tgt = target_mask(a, steps)  # (K', N)
        k = states.shape[0]
        if k < K:
            # Short trajectory: fill the remaining slots with fully revealed inputs (no masked
            # positions -> no temporal correction, no history contribution, no targets).
            states = torch.cat([states, y.expand(K - k, N)])
            tgt = torch.cat([tgt, torch.zeros(K - k, N, dtype=torch.bool)])
        ids[b, :, P - len(r.prompt_ids) : P] = torch.tensor(r.prompt_ids)
        ids[b, :, P:] = states
        labels[b, :, P:] = torch.where(tgt, y.expand_as(tgt), torch.full_like(tgt, IGNORE_INDEX, dtype=torch.long))
        am[b, P - len(r.prompt_ids) :] = 1
    return TrainingBatch(ids, labels, am, P, int((labels != IGNORE_INDEX).sum()))


def trajectory_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Eq. (5) pieces: (sum of CE over supervised tokens, number of supervised tokens).

    ``logits`` (..., V) with ``labels`` of the same leading shape: either every position (labels
    ``IGNORE_INDEX`` where unsupervised) or only the supervised ones ((S, V) with S labels).

    ``loss = sum / count`` is the mean over all supervised tokens of all sampled inputs; dividing by a
    global count (over accumulation steps and ranks) keeps every supervised token's weight equal.
    """
    flat_labels = labels.reshape(-1)
    sel = flat_labels != IGNORE_INDEX
    count = int(sel.sum())
    if count == 0:
        return logits.sum() * 0.0, 0
    flat = logits.reshape(-1, logits.shape[-1])
    # Logits computed only at the supervised positions ((S, V), S labels) need no gather copy.
    picked = flat if count == flat_labels.numel() else flat[sel]
    ce = F.cross_entropy(picked.float(), flat_labels[sel], reduction="sum")
    return ce, count


# -- full disks -------------------------------------------------------------------------------------
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC or EDQUOT, also when pyarrow reports it as a plain OSError whose message carries the strerror."""
    if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
        return True
    return isinstance(e, OSError) and any(os.strerror(n) in str(e) for n in DISK_FULL_ERRNOS)


def free_space(folder: str | os.PathLike) -> str:
    """Free space on the file system of ``folder``, for messages ("12.0 KiB free")."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return "free space unknown"
    n = float(st.f_bavail * st.f_frsize)
    if n < 1024:
        return f"{n:.0f} B free"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit} free"


def write_error(path: Path, e: OSError, kept: str) -> TDLMError:
    """The one-line error for a failed write of ``path``: a full disk names the folder and says "no space left";
    ``kept`` says what the failure left behind (a sentence fragment)."""
    if is_disk_full(e):
        return TDLMError(f"{path.parent}: no space left on the device writing {path.name} "
                         f"({free_space(path.parent)}); {kept}; free space and rerun the same command")  # fmt: skip
    return TDLMError(f"{path}: cannot write ({e.strerror or e}); {kept}")


def fsync_file(path: Path) -> None:
    """fsync a closed file. Network file systems (NFS, Lustre) may report ENOSPC / EDQUOT only at close or
    fsync; calling it before the rename keeps such a failure on the temporary name, never on the real one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- Parquet I/O ------------------------------------------------------------------------------------
def write_parquet(records: Iterable[TrajectoryRecord], path: str | os.PathLike) -> Path:
    """Write records atomically (temporary name, fsync, then rename) in the versioned schema.

    A failed write (a full disk: ENOSPC / EDQUOT) removes the temporary file, so no partial shard stays on disk
    to fill it further or to be mistaken for output, and raises a one-line TDLMError naming the folder ("no
    space left"); ``path`` itself is then untouched.
    """
    from datasets import Dataset

    path = Path(path)
    rows = [r.to_row() for r in records]
    if not rows:
        raise TDLMError(f"{path}: refusing to write an empty trajectory shard")
    for i, r in enumerate(rows):
        validate_record(r, f"{path} row {i}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        Dataset.from_list(rows).to_parquet(str(tmp))
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e, f"nothing of {path.name} was kept") from None
        raise
    return path


def read_parquet(path: str | os.PathLike, validate: bool = True) -> list[TrajectoryRecord]:
    """Read and validate one shard; a corrupt or foreign file raises TDLMError naming it."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        table = pq.read_table(str(path))
    except Exception as e:  # pyarrow raises several types for non-Parquet bytes
        raise TDLMError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from e
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise TDLMError(f"{path}: not a tdlm trajectory shard (missing columns {missing})")
    out = []
    for i, row in enumerate(table.to_pylist()):
        out.append(validate_record(row, f"{path} row {i}") if validate else TrajectoryRecord.from_row(row))
    return out


def load_trajectories(paths: Sequence[str | os.PathLike]):
    """All shards as one ``datasets.Dataset`` (validated row by row first)."""
    from datasets import Dataset

    rows = []
    for p in paths:
        rows.extend(r.to_row() for r in read_parquet(p))
    return Dataset.from_list(rows)
