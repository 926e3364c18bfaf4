"""Guards exercised exactly at their edge.

* Commit rule (Eq. 6): a confidence *equal* to tau does not clear the threshold (the paper's ">"); the
  at-least-one fallback commits exactly the most confident candidate when nothing clears it (without it a
  block never finishes and decoding loops forever).
* Trajectory shard store: a listed shard whose bytes changed at the *same size* is refused (the sha256, not
  only the size, is checked); a shard is committed at most once; records out of prompt order are refused
  when written, when adopted and when the job is finalized; a prompt present twice fails finalization.
* Math-Verify's argument order: ``verify(gold, pred)`` is asymmetric (an inequality gold accepts the
  equivalent interval, an interval gold does not accept the inequality); checked through the scoring function.
* Sandbox wall clock: a sample that *sleeps* (no CPU) under a generous CPU limit is stopped by the wall clock.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tdlm.data.prompts import Prompt
from tdlm.data.store import MANIFEST, ShardStore, sha256_of, shard_name
from tdlm.data.trajectories import TrajectoryRecord, write_parquet
from tdlm.decoding.loop import DecodeConfig, _select
from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import SandboxLimits, run_python
from tdlm.evaluation.scoring import score
from tdlm.tasks.base import Problem


# ------------------------------------------------------------------------------------------ commit rule
def _sel(conf, rule="threshold", cand=None, **cfg):
    conf = torch.tensor(conf, dtype=torch.float64)
    cand = torch.ones_like(conf, dtype=torch.bool) if cand is None else torch.tensor(cand)
    entropy = conf if rule == "entropy" else None  # the entropy rule reads the entropies passed here
    return _select(conf, cand, rule, DecodeConfig(policy=rule, **cfg), entropy).tolist()


@pytest.mark.parametrize("rule", ["threshold", "tdlm"])
@pytest.mark.parametrize("tau", [0.9, 0.5])
def test_confidence_equal_to_tau_is_not_committed(rule, tau):
    # Eq. 6 commits p with c_p > tau. Row 0: one position above tau, two exactly at tau. Row 1: all at tau,
    # so none clears it and only the fallback (the first most confident) is committed.
    up = tau + (1 - tau) / 2
    got = _sel([[tau, up, tau, 0.1], [tau, tau, tau, tau]], rule, threshold=tau)
    assert got == [[False, True, False, False], [True, False, False, False]]


def test_entropy_equal_to_h_is_not_committed():
    got = _sel([[0.5, 0.25, 0.5, 0.75]], "entropy", entropy_threshold=0.5)  # entropy < H commits
    assert got == [[False, True, False, False]]


def test_fallback_commits_exactly_the_most_confident_candidate():
    # Nothing clears tau in either row: exactly one position each, the most confident *candidate*
    # (row 1's most confident position overall is not a candidate: already revealed / outside the block).
    got = _sel([[0.2, 0.6, 0.4, 0.1], [0.99, 0.3, 0.5, 0.2]], cand=[[True] * 4, [False, True, True, True]])
    assert got == [[False, True, False, False], [False, False, True, False]]
    # with tau >= 1 every evaluation commits exactly one token (the `original` rule)
    got = _sel([[0.999, 0.3], [1.0, 0.2]], threshold=1.0)
    assert got == [[True, False], [True, False]]
    assert _sel([[0.2, 0.6, 0.4]], "original") == [[False, True, False]]
    # the entropy rule has the same fallback (here the entropies double as confidences: the first is highest)
    assert _sel([[0.9, 0.7, 0.8]], "entropy", entropy_threshold=0.5) == [[True, False, False]]


# ------------------------------------------------------------------------------------------ shard store
DECODE = {"policy": "threshold", "gen_length": 4, "block_size": 4, "threshold": 0.9}
ACTOR = {"backbone": "sha256:toy", "adapter": None, "backbone_id": "tiny-llada", "pid": 1, "host": "test"}
SIZE = 2  # prompts per shard: 5 prompts -> shards [0, 2), [2, 4), [4, 5)


def _prompts(n: int = 5) -> list[Prompt]:
    return [Prompt(f"toy:{i}", f"question {i}") for i in range(n)]


def _record(p: Prompt, token: int = 5) -> TrajectoryRecord:
    return TrajectoryRecord(p.source_id, [3, 4], [token, 6, 7, 8], [1, 2, 3, 4], 4, p.text, "tiny-llada", dict(DECODE))


def _store(root: Path, prompts: list[Prompt]) -> ShardStore:
    return ShardStore(root, prompts, SIZE, {"decode": DECODE})


@pytest.fixture
def finished(tmp_path) -> tuple[Path, list[Prompt]]:
    """A complete output dir written through the store's own API (no decoding)."""
    root, prompts = tmp_path / "traj", _prompts()
    with _store(root, prompts) as store:
        assert store.open() == [0, 1, 2]
        store.check_actor_identity(ACTOR)
        for i in store.todo():
            store.commit(store.write_shard(i, [_record(p) for p in store.shard_prompts(i)], 0.0, {}, 1))
        store.finalize()
    return root, prompts


def _relist(root: Path, name: str) -> None:
    """Make the manifest vouch for the file as it is now (a writer that listed a bad shard)."""
    m = json.loads((root / MANIFEST).read_text())
    m["shards"][name].update(bytes=(root / name).stat().st_size, sha256=sha256_of(root / name))
    (root / MANIFEST).write_text(json.dumps(m))


def test_finished_dir_reopens_clean(finished):
    root, prompts = finished
    with _store(root, prompts) as store:
        assert store.open() == []
        assert store.finalize()["mean"] == 4


def test_same_size_byte_flip_in_a_listed_shard_is_refused(finished):
    root, prompts = finished
    path = root / shard_name(1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert path.stat().st_size == json.loads((root / MANIFEST).read_text())["shards"][path.name]["bytes"]
    with _store(root, prompts) as store, pytest.raises(TDLMError, match=r"shard-00001\.parquet: contents differ"):
        store.open()


def test_a_shard_is_committed_at_most_once(tmp_path):
    prompts = _prompts()
    with _store(tmp_path / "traj", prompts) as store:
        store.open()
        store.check_actor_identity(ACTOR)
        entry = store.write_shard(0, [_record(p) for p in store.shard_prompts(0)], 0.0, {}, 1)
        store.commit(entry)
        again = store.write_shard(0, [_record(p) for p in store.shard_prompts(0)], 0.0, {}, 2)  # a redo
        with pytest.raises(TDLMError, match=r"shard-00000\.parquet is already finished; refusing to list it twice"):
            store.commit(again)
        assert store.finished_prompts() == 2


def test_records_out_of_order_are_refused_when_written(tmp_path):
    prompts = _prompts()
    with _store(tmp_path / "traj", prompts) as store:
        store.open()
        store.check_actor_identity(ACTOR)
        swapped = [_record(p) for p in reversed(store.shard_prompts(1))]
        with pytest.raises(TDLMError, match=r"shard 1: worker returned prompts \['toy:3', 'toy:2'\]"):
            store.write_shard(1, swapped, 0.0, {}, 1)
        assert not (tmp_path / "traj" / shard_name(1)).exists()


def test_unlisted_shard_with_records_out_of_order_is_not_adopted(finished):
    root, prompts = finished
    m = json.loads((root / MANIFEST).read_text())
    del m["shards"][shard_name(1)]  # as if killed between the shard's rename and the manifest update
    (root / MANIFEST).write_text(json.dumps(m))
    write_parquet([_record(p) for p in reversed(prompts[2:4])], root / shard_name(1))
    with _store(root, prompts) as store, pytest.raises(TDLMError, match=r"shard-00001\.parquet: holds other prompts"):
        store.open()


def test_finalize_refuses_rows_out_of_order(finished):
    root, prompts = finished
    write_parquet([_record(p) for p in reversed(prompts[0:2])], root / shard_name(0))
    _relist(root, shard_name(0))
    with _store(root, prompts) as store:
        assert store.open() == []  # the manifest vouches for the bytes; only finalize looks at the rows
        with pytest.raises(TDLMError, match=r"shards hold 5 rows \(0 duplicates\) for 5 prompts"):
            store.finalize()


def test_finalize_refuses_a_prompt_present_twice(finished):
    root, prompts = finished
    write_parquet([_record(prompts[0]), _record(prompts[1]), _record(prompts[1], token=9)], root / shard_name(0))
    _relist(root, shard_name(0))
    with _store(root, prompts) as store:
        assert store.open() == []
        with pytest.raises(TDLMError, match=r"shards hold 6 rows \(1 duplicates\) for 5 prompts"):
            store.finalize()


# ------------------------------------------------------------------------------------------ Math-Verify
def _math500(answer: str) -> Problem:
    return Problem(task="math500", id="math500/test/toy.json", index=0, prompt="Solve.", answer=answer)


def test_math_verify_gets_gold_first():
    # Math-Verify is asymmetric: gold "x < 2" accepts the interval (-oo, 2); gold (-oo, 2) rejects "x < 2".
    # Every pair the other tests use verifies both ways round, so only a pair like this pins the order.
    fits = score(_math500("x < 2"), "So the solution set is \\boxed{(-\\infty, 2)}.")
    assert (fits.correct, fits.status) == (True, "correct")
    swapped = score(_math500("(-\\infty, 2)"), "So the solution set is \\boxed{x < 2}.")
    assert (swapped.correct, swapped.status) == (False, "wrong")
    closed = score(_math500("1 \\le x \\le 3"), "\\boxed{[1, 3]}")
    assert closed.correct
    assert not score(_math500("[1, 3]"), "\\boxed{1 \\le x \\le 3}").correct


# ------------------------------------------------------------------------------------------ sandbox
def test_wall_clock_stops_a_sleeping_sample():
    # The sample uses no CPU, and the CPU limit (60 s) is far away: only the wall clock can end it in time.
    limits = SandboxLimits(timeout_s=1.5, cpu_s=60)
    t0 = time.monotonic()
    r = run_python("import time\nprint('asleep', flush=True)\ntime.sleep(30)\nprint('woke')\n", limits)
    wall = time.monotonic() - t0
    assert r.status == "timeout" and not r.passed, r
    assert r.stdout == "asleep\n", r
    assert 1.5 <= r.seconds < 8 and wall < 10, (r.seconds, wall)
    # the same limits let a short sleeper finish: the limit is the wall clock, not a fixed kill
    ok = run_python("import time\ntime.sleep(0.2)\nprint('done')\n", replace(limits, timeout_s=20.0))
    assert ok.status == "passed" and ok.stdout == "done\n", ok
