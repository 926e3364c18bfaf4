"""On-policy training records: the switch step s*, the hybrid record, the round's training mix and the staleness rule.

The paper trains on sparse teacher trajectories (K = 8 states of a teacher that reveals one token per evaluation),
while at inference the adapter sees its own histories: every evaluation of a student that commits several tokens
per evaluation (its Discussion). DAgger-style roll-in / roll-out trains on the states the student itself visits:

* **roll in** - the student (the backbone with its adapter, policy ``tdlm`` at tau) decodes a fresh prompt and
  records its trajectory (y^S, a^S, T_S);
* **switch** - a step s* in 0..T_S is drawn per trajectory (:class:`SwitchDistribution`);
* **roll out** - from the student's canvas at s* (Eq. 3: y^S where a^S <= s*, mask elsewhere), the frozen backbone
  with its adapter switched off (the teacher's policy) finishes the response in T' more evaluations;
* **the hybrid record** (:func:`hybrid_record`) keeps the student's tokens and reveal steps up to s* and the
  teacher's after (a_p = s* + the teacher's step), with T = s* + T'. It is an ordinary trajectory record, so Eq. 5's
  loss and the state sampling are unchanged. s* = 0 gives exactly the teacher's record, s* = T_S the student's.

Every rolled-in record names its round and the version and fingerprint of the adapter it was rolled in with, in
``decode_settings["rollout"]`` (the schema is unchanged). Training round r mixes a fraction lambda of round r's
records with a replay of earlier rounds' and the teacher's (:func:`mix_records`); a record rolled in with an adapter
more than ``staleness`` versions older than the one being trained is refused (:func:`check_staleness`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from tdlm.data.trajectories import TrajectoryRecord
from tdlm.errors import TDLMError

ROLLOUT_KEY = "rollout"  # decode_settings[ROLLOUT_KEY]: round, adapter_version, adapter_fingerprint, switch_step, ...
SWITCH_KINDS = ("uniform", "frac:A:B", "start", "end")


@dataclass(frozen=True)
class SwitchDistribution:
    """Where the teacher takes over: ``uniform`` (s* uniform on 0..T_S), ``frac:A:B`` (s* = round(u T_S), u uniform
    on [A, B], 0 <= A <= B <= 1), ``start`` (s* = 0: the teacher's record) or ``end`` (s* = T_S: the student's)."""

    kind: str
    lo: float = 0.0
    hi: float = 1.0

    @classmethod
    def parse(cls, spec: str, where: str = "switch") -> SwitchDistribution:
        s = str(spec).strip()
        if s in ("uniform", "start", "end"):
            return cls(s)
        if s.startswith("frac:"):
            parts = s.split(":")
            try:
                lo, hi = float(parts[1]), float(parts[2])
                if len(parts) != 3:
                    raise ValueError
            except (IndexError, ValueError):
                lo = hi = float("nan")
            if 0.0 <= lo <= hi <= 1.0:
                return cls("frac", lo, hi)
        raise TDLMError(f"{where}: s* distribution {spec!r} unknown; expected one of {', '.join(SWITCH_KINDS)} "
                        f"(frac:A:B with 0 <= A <= B <= 1, e.g. frac:0.25:0.75)")  # fmt: skip

    def __str__(self) -> str:
        return f"frac:{self.lo:g}:{self.hi:g}" if self.kind == "frac" else self.kind

    def draw(self, T: int, seed: int, source_id: str) -> int:
        """s* for a student trajectory of T evaluations; a function of (seed, source_id) only, so a redone shard and a
        resumed job draw the same step."""
        if self.kind == "start":
            return 0
        if self.kind == "end":
            return T
        h = hashlib.sha256(f"{seed}\0{source_id}".encode()).digest()
        rng = random.Random(int.from_bytes(h[:8], "little"))
        if self.kind == "uniform":
            return rng.randint(0, T)
        return min(T, max(0, round(rng.uniform(self.lo, self.hi) * T)))


def switch_canvas(student: TrajectoryRecord, s: int, mask_id: int) -> list[int]:
    """Eq. 3 at s*: the student's tokens revealed by step s, ``mask_id`` elsewhere."""
    if not 0 <= s <= student.T:
        raise TDLMError(f"switch step s*={s} outside 0..T={student.T} of {student.source_id!r}")
    return [y if a <= s else mask_id for y, a in zip(student.response_ids, student.reveal_steps, strict=True)]


def hybrid_record(student: TrajectoryRecord, s: int, teacher_tokens: Sequence[int] | None,
                  teacher_reveal: Sequence[int] | None, teacher_T: int, provenance: dict) -> TrajectoryRecord:
    """The student's tokens and reveal steps up to ``s`` and the teacher's after: a_p = s + the teacher's step of p.

    ``teacher_*`` is the frozen backbone's decode from :func:`switch_canvas` (reveal step 0 at the positions it was
    given); None when s = T_S (nothing left to decode). ``provenance`` (round, adapter version, fingerprint ...) is
    stored with s* in ``decode_settings["rollout"]``."""
    keep = [a <= s for a in student.reveal_steps]
    if teacher_tokens is None:
        if not all(keep):
            raise TDLMError(f"{student.source_id!r}: s*={s} leaves positions masked but no teacher roll-out was given")
        tokens, reveal, T = list(student.response_ids), list(student.reveal_steps), s
    else:
        if len(teacher_tokens) != len(student.response_ids) or teacher_reveal is None:
            raise TDLMError(f"{student.source_id!r}: the roll-out has {len(teacher_tokens)} tokens, the student "
                            f"{len(student.response_ids)}")  # fmt: skip
        given = [y for y, k in zip(student.response_ids, keep, strict=True) if k]
        kept = [t for t, k in zip(teacher_tokens, keep, strict=True) if k]
        if kept != given:
            raise TDLMError(f"{student.source_id!r}: the roll-out changed tokens the student had revealed by s*={s}")
        tokens = list(teacher_tokens)
        reveal = [a if k else s + r for a, r, k in zip(student.reveal_steps, teacher_reveal, keep, strict=True)]
        T = s + int(teacher_T)
    settings = dict(student.decode_settings)
    settings[ROLLOUT_KEY] = {**provenance, "switch_step": s, "student_T": student.T}
    return TrajectoryRecord(source_id=student.source_id, prompt_ids=list(student.prompt_ids), response_ids=tokens,
                            reveal_steps=reveal, T=T, prompt_text=student.prompt_text, backbone_id=student.backbone_id,
                            decode_settings=settings)  # fmt: skip


def adapter_version(record: TrajectoryRecord) -> int | None:
    """The adapter version a record was rolled in with; None for a teacher record."""
    info = record.decode_settings.get(ROLLOUT_KEY)
    return None if not info else info.get("adapter_version")


def check_staleness(records: Sequence[TrajectoryRecord], where: Sequence[str], trainee_version: int,
                    bound: int) -> None:
    """Refuse a record rolled in with an adapter more than ``bound`` versions older than ``trainee_version`` (the
    adapter the mix will update); teacher records have no version and are never stale."""
    for rec, loc in zip(records, where, strict=True):
        v = adapter_version(rec)
        if v is not None and trainee_version - int(v) > bound:
            raise TDLMError(f"{loc}: record {rec.source_id!r} was rolled in with adapter version {v}, "
                            f"{trainee_version - int(v)} versions before version {trainee_version} that this mix "
                            f"trains; the staleness bound is {bound}")  # fmt: skip


def mix_counts(lam: float, size: int) -> tuple[int, int]:
    """(records of this round, replayed records) of a mix of ``size`` with fraction ``lam`` from this round."""
    current = round(lam * size)
    return current, size - current


def mix_records(current: Sequence[TrajectoryRecord], replay: Sequence[TrajectoryRecord], lam: float, size: int,
                seed: int, where: str = "mix") -> list[TrajectoryRecord]:
    """A training mix of ``size`` records: round(lam * size) drawn without replacement from ``current`` (this round's
    records) and the rest from ``replay`` (earlier rounds' and the teacher's), in a seeded order."""
    if not 0.0 <= lam <= 1.0:
        raise TDLMError(f"{where}: lambda must be in [0, 1]; got {lam!r}")
    n_cur, n_rep = mix_counts(lam, size)
    if n_cur > len(current):
        raise TDLMError(f"{where}: lambda={lam} x {size} needs {n_cur} records of this round; it has {len(current)}")
    if n_rep > len(replay):
        raise TDLMError(f"{where}: (1 - lambda={lam}) x {size} needs {n_rep} replayed records; the replay window "
                        f"holds {len(replay)}")  # fmt: skip
    rng = random.Random(seed)
    picked = rng.sample(list(current), n_cur) + rng.sample(list(replay), n_rep)
    rng.shuffle(picked)
    return picked
