"""Trajectory data: Eq. 3-5, step sampling, the Parquet schema and its validator."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdlm
from tdlm.data.trajectories import (
    IGNORE_INDEX,
    TrajectoryRecord,
    build_batch,
    read_parquet,
    sample_steps,
    state_at,
    target_mask,
    trajectory_loss,
    validate_record,
    write_parquet,
)
from tests.conftest import random_trajectory


@settings(max_examples=200, deadline=None)
@given(T=st.integers(1, 300), K=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_sample_steps_properties(T, K, seed):
    s = sample_steps(T, K, torch.Generator().manual_seed(seed))
    assert s[0] == 0 and s[-1] == T
    inner = s[1:-1]
    assert inner == sorted(set(inner)) and all(1 <= x <= T - 1 for x in inner)
    assert len(inner) == min(K - 1, T - 1)


def test_sample_steps_is_uniform_over_inner_steps():
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(10)
    for _ in range(4000):
        for x in sample_steps(11, 4, g)[1:-1]:
            counts[x - 1] += 1
    freq = counts / counts.sum()
    assert (freq - 0.1).abs().max() < 0.02


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(2, 8))
def test_targets_are_masked_in_si_and_revealed_in_next(seed, K):
    g = torch.Generator().manual_seed(seed)
    tokens, a, T = random_trajectory(g, 3, 20, 100, 2)
    y = tokens[3:]
    steps = sample_steps(T, K, g)
    tgt = target_mask(a, steps)
    assert not tgt[0].any()
    for i in range(1, len(steps) - 1):
        si, snext = state_at(y, a, steps[i], 2), state_at(y, a, steps[i + 1], 2)
        assert torch.equal(tgt[i], (si == 2) & (snext != 2))
    # every position revealed after s_1 is supervised exactly once
    assert torch.equal(tgt.sum(0), (a > steps[1]).long())


def _records(n=3, N=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tokens, a, T = random_trajectory(g, 4 + i, N, 128, 2)
        out.append(TrajectoryRecord(f"src-{i}", tokens[: 4 + i].tolist(), tokens[4 + i :].tolist(), a.tolist(), T,
                                    prompt_text=f"p{i}", backbone_id="tiny-llada",
                                    decode_settings={"policy": "threshold", "threshold": 0.9}))
    return out


def test_loss_equals_brute_force():
    bb = tdlm.load_backbone("tiny-llada")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all"))
    with torch.no_grad():
        for m in model.temporal.values():
            m.o_proj.weight.normal_(0, 0.3)
    recs = _records()
    batch = build_batch(recs, K=4, mask_id=2, pad_id=0, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.forward_states(batch.input_ids, batch.prompt_len, attention_mask=batch.attention_mask)
    total, count = trajectory_loss(logits, batch.labels)
    # brute force: per trajectory, evaluate states sequentially (no padding) and sum CE per token
    ce_sum, n = 0.0, 0
    for b, r in enumerate(recs):
        P0 = batch.prompt_len - len(r.prompt_ids)
        cache = model.new_cache(1)
        for i in range(4):
            x = batch.input_ids[b, i, P0:][None]
            with torch.no_grad():
                out = model.forward_step(x, len(r.prompt_ids), cache)[0]
            for p in range(len(r.response_ids)):
                lab = int(batch.labels[b, i, batch.prompt_len + p])
                if lab != IGNORE_INDEX:
                    row = out[len(r.prompt_ids) + p]
                    ce_sum += float(torch.logsumexp(row, 0) - row[lab])
                    n += 1
    assert count == n == batch.num_targets > 0
    assert abs(total.item() - ce_sum) / ce_sum < 1e-5


def test_short_trajectories_fill_with_revealed_states():
    rec = TrajectoryRecord("s", [3, 4], [10, 11, 12], [1, 2, 2], 2)
    batch = build_batch([rec], K=5, mask_id=2, pad_id=0)
    assert batch.input_ids.shape == (1, 5, 5)
    assert batch.input_ids[0, 0, 2:].tolist() == [2, 2, 2]  # S_0
    assert batch.input_ids[0, 1, 2:].tolist() == [10, 2, 2]  # S_1
    assert (batch.input_ids[0, 2:, 2:] == torch.tensor([10, 11, 12])).all()
    assert batch.num_targets == 2  # T_1 = {1, 2}


def test_parquet_round_trip_and_validation(tmp_path):
    recs = _records()
    path = write_parquet(recs, tmp_path / "shard-00000.parquet")
    assert not list(tmp_path.glob("*.tmp-*"))
    back = read_parquet(path)
    assert [r.to_row() for r in back] == [r.to_row() for r in recs]
    ds = tdlm.data.trajectories.load_trajectories([path])
    assert ds.num_rows == 3 and ds[0]["decode_settings"]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda r: r.update(reveal_steps=[0] + r["reveal_steps"][1:]), r"reveal_steps\[0\]=0 outside"),
        (lambda r: r.update(reveal_steps=r["reveal_steps"][:-1]), "reveal_steps has 15 entries"),
        (lambda r: r.update(T=r["T"] + 1), "reveals nothing"),
        (lambda r: r.update(schema_version=99), "schema_version=99"),
    ],
)
def test_validator_names_file_row_field(tmp_path, mutate, message):
    rows = [r.to_row() for r in _records()]
    mutate(rows[2])
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    with pytest.raises(tdlm.TDLMError, match=f"bad.parquet row 2: .*{message}"):
        read_parquet(path)


def test_foreign_files_are_reported(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(tdlm.TDLMError, match="not a readable Parquet file"):
        read_parquet(junk)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), str(other))
    with pytest.raises(tdlm.TDLMError, match="not a tdlm trajectory shard"):
        read_parquet(other)
    with pytest.raises(tdlm.TDLMError, match="T=0"):
        validate_record(TrajectoryRecord("x", [1], [5], [1], 0))


def test_shard_write_on_a_full_disk_leaves_nothing_and_is_one_line(tmp_path):
    """A real ENOSPC without mounting anything: the temporary name is a symlink to /dev/full, whose every write
    fails with ENOSPC. The error is one line naming the folder, the temporary file is removed, the shard never
    appears (tests/test_full_disk.py does the same on a small tmpfs, with partial writes, through the CLI)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    path = tmp_path / "shard-00000.parquet"
    tmp = tmp_path / f"{path.name}.tmp-{os.getpid()}"
    tmp.symlink_to("/dev/full")
    with pytest.raises(tdlm.TDLMError) as e:
        write_parquet(_records(), path)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path}: no space left on the device writing {path.name}") and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []
