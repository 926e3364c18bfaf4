"""On-policy rounds (issue 47): the s* invariants through the real roll-out replica, the hybrid record, the mix's
proportions, the staleness refusal, the current-only control ignoring its history, and the job's one-line refusals
before any work. The job's kill-and-resume in every phase is in tests/test_onpolicy_job.py (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import live_tdlm, sampled_states, sharp_backbone

import tdlm
from tdlm.data.onpolicy import (
    ROLLOUT_KEY,
    SwitchDistribution,
    check_staleness,
    hybrid_record,
    mix_counts,
    mix_records,
    switch_canvas,
)
from tdlm.data.trajectories import TrajectoryRecord, validate_record
from tdlm.decoding import decode
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError
from tdlm.generation.worker import ShardTask, ShardWorker, WorkerSpec
from tdlm.onpolicy.config import OnPolicyConfig

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["3+5-2+9 = ?", "7-4+8+1 = ?", "1+1+1+1 = ?", "9-8+7-6 = ?", "2+3 = ?"]


def _record(sid: str, tokens: list[int], reveal: list[int], T: int, version: int | None = None) -> TrajectoryRecord:
    settings = {} if version is None else {ROLLOUT_KEY: {"round": version + 1, "adapter_version": version}}
    return TrajectoryRecord(sid, [1, 2], tokens, reveal, T, decode_settings=settings)


# -- the switch distribution and the hybrid record ---------------------------------------------------------------
def test_switch_distribution_parse_and_draw():
    assert str(SwitchDistribution.parse("frac:0.25:0.75")) == "frac:0.25:0.75"
    for bad in ("gaussian", "frac:0.8:0.2", "frac:0.5", "frac:-1:1", "frac:a:b", "uniform:3"):
        with pytest.raises(TDLMError, match="s\\* distribution .* unknown"):
            SwitchDistribution.parse(bad)
    u = SwitchDistribution.parse("uniform")
    draws = [u.draw(7, 0, f"id{i}") for i in range(400)]
    assert set(draws) == set(range(8))  # every step 0..T, both ends included
    assert draws == [u.draw(7, 0, f"id{i}") for i in range(400)]  # a function of (seed, id): resumes draw the same
    assert draws != [u.draw(7, 1, f"id{i}") for i in range(400)]
    late = SwitchDistribution.parse("frac:0.5:1")
    assert all(4 <= late.draw(8, 3, f"x{i}") <= 8 for i in range(200))
    assert SwitchDistribution.parse("start").draw(9, 0, "a") == 0
    assert SwitchDistribution.parse("end").draw(9, 0, "a") == 9


def test_hybrid_record_by_hand():
    """Student: 6 tokens in T_S = 3 evaluations; teacher from s* = 2 reveals the rest one per step."""
    stu = _record("p", [11, 12, 13, 14, 15, 16], [1, 3, 2, 1, 3, 2], 3)
    assert switch_canvas(stu, 2, 0) == [11, 0, 13, 14, 0, 16]
    h = hybrid_record(stu, 2, [11, 21, 13, 14, 25, 16], [0, 2, 0, 0, 1, 0], 2, {"round": 1, "adapter_version": 0})
    assert h.response_ids == [11, 21, 13, 14, 25, 16]
    assert h.reveal_steps == [1, 4, 2, 1, 3, 2] and h.T == 4
    validate_record(h)  # every step 1..T reveals something
    assert h.decode_settings[ROLLOUT_KEY] == {"round": 1, "adapter_version": 0, "switch_step": 2, "student_T": 3}
    with pytest.raises(TDLMError, match="changed tokens the student had revealed"):
        hybrid_record(stu, 2, [99, 21, 13, 14, 25, 16], [0, 2, 0, 0, 1, 0], 2, {})
    with pytest.raises(TDLMError, match="no teacher roll-out"):
        hybrid_record(stu, 2, None, None, 0, {})
    with pytest.raises(TDLMError, match="outside 0..T=3"):
        switch_canvas(stu, 4, 0)


@pytest.fixture(scope="module")
def rollout_setup(tmp_path_factory):
    """The shipped tiny-multi backbone (several tokens per evaluation at tau 0.6) and a live adapter folder."""
    d = tmp_path_factory.mktemp("onpolicy")
    model = live_tdlm(tdlm.load_backbone("tiny-multi", dtype="float32"))
    model.save_adapter(d / "adapter")
    return d


def _replica(setup: Path, **rollout) -> ShardWorker:
    decode_cfg = DecodeSettings(policy="tdlm", threshold=0.6, gen_length=24, block_size=8, batch_size=2,
                                dtype="float32")  # fmt: skip
    ro = {"switch": "uniform", "teacher_policy": "original", "switch_seed": 3, "round": 1, "adapter_version": 0,
          "gap_prompts": 0} | rollout  # fmt: skip
    return ShardWorker(WorkerSpec("tiny-multi", decode_cfg, adapter=str(setup / "adapter"), rollout=ro))


def _plain(setup: Path, policy: str) -> list[TrajectoryRecord]:
    decode_cfg = DecodeSettings(policy=policy, threshold=0.6, gen_length=24, block_size=8, batch_size=2,
                                dtype="float32")  # fmt: skip
    # the replica's batches (2 rows, sorted by prompt length): the same computation on any CPU, no near-tie to cross
    w = ShardWorker(WorkerSpec("tiny-multi", decode_cfg,
                               adapter=str(setup / "adapter") if policy == "tdlm" else None))  # fmt: skip
    return w.run_shard(ShardTask(0, [f"p{i}" for i in range(len(PROMPTS))], PROMPTS)).records


def _shape(recs):
    return [(r.response_ids, r.reveal_steps, r.T) for r in recs]


def test_switch_start_is_exactly_the_teacher_and_end_the_student(rollout_setup):
    """The s* invariants through the real replica: s* = 0 gives exactly the teacher's record (the frozen backbone's
    `original` decode from scratch) and s* = T exactly the student's (policy tdlm)."""
    task = ShardTask(0, [f"p{i}" for i in range(len(PROMPTS))], PROMPTS)
    teacher, student = _plain(rollout_setup, "original"), _plain(rollout_setup, "tdlm")
    assert any(r.T < 24 for r in student)  # the student commits several tokens per evaluation: the two differ
    assert _shape(teacher) != _shape(student)
    start = _replica(rollout_setup, switch="start").run_shard(task)
    assert _shape(start.records) == _shape(teacher)
    end = _replica(rollout_setup, switch="end").run_shard(task)
    assert _shape(end.records) == _shape(student)
    assert [r.decode_settings[ROLLOUT_KEY]["switch_step"] for r in end.records] == [r.T for r in student]


def test_uniform_switch_keeps_the_student_prefix(rollout_setup):
    task = ShardTask(0, [f"p{i}" for i in range(len(PROMPTS))], PROMPTS)
    student = _plain(rollout_setup, "tdlm")
    res = _replica(rollout_setup, gap_prompts=2).run_shard(task)
    steps = [r.decode_settings[ROLLOUT_KEY]["switch_step"] for r in res.records]
    assert any(0 < s < r.T for s, r in zip(steps, student, strict=True))  # some switch strictly inside
    for h, s, stu in zip(res.records, steps, student, strict=True):
        validate_record(h)
        kept = [p for p, a in enumerate(stu.reveal_steps) if a <= s]
        assert [h.response_ids[p] for p in kept] == [stu.response_ids[p] for p in kept]
        assert [h.reveal_steps[p] for p in kept] == [stu.reveal_steps[p] for p in kept]
        assert all(a > s for p, a in enumerate(h.reveal_steps) if p not in kept)
        assert h.decode_settings[ROLLOUT_KEY]["adapter_version"] == 0
        assert h.decode_settings[ROLLOUT_KEY]["adapter_fingerprint"]
    gap = res.extra["gap"]
    assert gap["prompts"] == 2 and gap["student"][1] > 0 and gap["teacher"][1] > 0
    assert res.extra["student_nfe_sum"] == sum(r.T for r in student)


def test_decode_canvas_continues_a_partial_response():
    bb = sharp_backbone("tiny-llada")
    ids = [[5, 6, 7], [8, 9]]
    full = decode(bb, ids, policy="original", gen_length=16, block_size=8)
    m = bb.mask_token_id
    canvas = [[t if a <= 6 else m for t, a in zip(r.tokens, r.reveal_step, strict=True)] for r in full]
    cont = decode(bb, ids, policy="original", gen_length=16, block_size=8, canvas=canvas)
    for f, c in zip(full, cont, strict=True):  # one token per evaluation: the rest of the same greedy decode
        assert c.tokens == f.tokens and c.nfe == f.nfe - 6
        assert c.reveal_step == [max(0, a - 6) for a in f.reveal_step]
    with pytest.raises(TDLMError, match="holds no mask token"):
        decode(bb, ids, policy="original", gen_length=16, block_size=8, canvas=[full[0].tokens, canvas[1]])
    with pytest.raises(TDLMError, match="canvas row 1 has 3 tokens"):
        decode(bb, ids, policy="original", gen_length=16, block_size=8, canvas=[canvas[0], [m, m, m]])


# -- the mix and the staleness rule -------------------------------------------------------------------------------
@pytest.mark.parametrize("lam, size", [(0.25, 40), (0.5, 33), (0.6, 33), (1.0, 30), (0.0, 50)])
def test_mix_proportions(lam, size):
    current = [_record(f"c{i}", [1], [1], 1, version=4) for i in range(30)]
    replay = [_record(f"r{i}", [1], [1], 1) for i in range(50)]
    mix = mix_records(current, replay, lam, size, seed=7)
    n_cur, n_rep = mix_counts(lam, size)
    assert n_cur == round(lam * size) and n_cur + n_rep == size
    ids = [r.source_id for r in mix]
    assert len(ids) == size == len(set(ids))  # without replacement
    assert sum(i.startswith("c") for i in ids) == n_cur and sum(i.startswith("r") for i in ids) == n_rep
    assert ids == [r.source_id for r in mix_records(current, replay, lam, size, seed=7)]
    if 0 < n_cur < size:
        assert ids != [r.source_id for r in mix_records(current, replay, lam, size, seed=8)]


def test_mix_refuses_what_it_cannot_fill():
    current = [_record(f"c{i}", [1], [1], 1) for i in range(10)]
    with pytest.raises(TDLMError, match="needs 15 records of this round; it has 10"):
        mix_records(current, current, 0.75, 20, 0)
    with pytest.raises(TDLMError, match="needs 15 replayed records; the replay window holds 10"):
        mix_records(current, current, 0.25, 20, 0)
    with pytest.raises(TDLMError, match="lambda must be in \\[0, 1\\]"):
        mix_records(current, current, 1.5, 20, 0)


def test_staleness_refusal():
    recs = [_record("t", [1], [1], 1), _record("v2", [1], [1], 1, 2), _record("v1", [1], [1], 1, 1)]
    check_staleness(recs[:2], ["a", "b"], trainee_version=3, bound=1)  # teacher: no version; v2: 1 version old
    with pytest.raises(TDLMError, match="c: record 'v1' was rolled in with adapter version 1, 2 versions before "
                                        "version 3 .* staleness bound is 1"):
        check_staleness(recs, ["a", "b", "c"], trainee_version=3, bound=1)
    check_staleness(recs, ["a", "b", "c"], trainee_version=3, bound=2)


# -- current-only: the same parameters, no history ---------------------------------------------------------------
def test_current_only_ignores_its_history():
    """history=current: a state's output is the same whatever earlier states it is given (full differs)."""
    bb = tdlm.load_backbone("tiny-llada")
    P, N = 5, 12
    a = sampled_states(bb, P, N, seed=1, K=5)
    b = sampled_states(bb, P, N, seed=2, K=5)
    b[:, -1] = a[:, -1]  # the same current state after other histories
    for history, same in (("current", True), ("full", False)):
        model = live_tdlm(bb, history=history)
        model.load_state_dict(live_tdlm(bb, history="full").state_dict())  # the same parameters either way
        with torch.no_grad():
            la, lb = model(a, P)[:, -1], model(b, P)[:, -1]
        assert torch.equal(la, lb) is same, history
        if same:  # step-wise: a cache filled with another history changes nothing either
            ca, cb = model.new_cache(2), model.new_cache(2)
            with torch.no_grad():
                for i in range(4):
                    model.forward_step(a[:, i], P, ca)
                    model.forward_step(b[:, i], P, cb)
                sa, sb = model.forward_step(a[:, 4], P, ca), model.forward_step(b[:, 4], P, cb)
            assert torch.equal(sa, sb)
            torch.testing.assert_close(sa, la, rtol=1e-5, atol=1e-5)


# -- the job's refusals before any work ------------------------------------------------------------------------
def _cfg(tmp_path: Path, **kw) -> OnPolicyConfig:
    base = dict(train_config=str(REPO / "configs" / "tiny_multi.yaml"), output_dir=str(tmp_path / "job"),
                prompts=str(REPO / "data" / "multi_prompts_onpolicy.jsonl"), prompts_per_round=16, rounds=1,
                decode=DecodeSettings(policy="original", gen_length=56, block_size=56, batch_size=64))  # fmt: skip
    return OnPolicyConfig(**(base | kw))


@pytest.mark.parametrize("change, message", [
    ({"mix_lambda": 1.2}, "mix_lambda must be in \\[0, 1\\]; got 1.2"),
    ({"mix_lambda": -0.1}, "mix_lambda must be in \\[0, 1\\]"),
    ({"switch": "gaussian"}, "s\\* distribution 'gaussian' unknown"),
    ({"rounds": 0}, "rounds must be >= 1"),
    ({"replay_window": 2, "staleness": 1}, "replay_window=2 .* beyond staleness=1"),
    ({"decode": DecodeSettings(policy="tdlm", gen_length=56, block_size=56)}, "decode.policy must be the frozen"),
    ({"rollout_tau": [0.9, 0.95, 0.99]}, "rollout_tau must be one value or 1"),
])
def test_job_refuses_bad_settings_in_one_line(tmp_path, change, message):
    from tdlm.onpolicy.job import Job

    with pytest.raises(TDLMError, match=message) as e:
        Job(_cfg(tmp_path, **change))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "job").exists()  # nothing written


def test_job_refuses_an_adapter_of_another_backbone(tmp_path):
    from tdlm.onpolicy.job import Job

    other = tdlm.TDLM(tdlm.load_backbone("tiny-arith"), tdlm.TemporalConfig())
    other.save_adapter(tmp_path / "arith-adapter")
    with pytest.raises(TDLMError, match="round0_adapter: .* was trained on backbone 'tiny-arith', not the job's "
                                        "'tiny-multi'"):
        Job(_cfg(tmp_path, round0_adapter=str(tmp_path / "arith-adapter")))


@pytest.mark.parametrize("split", ["test", "validation"])
def test_job_refuses_prompts_of_an_evaluation_split(tmp_path, split):
    from tdlm.onpolicy.job import Job
    from tdlm.tasks.toydata import multi_split

    lines = (REPO / "data" / "multi_prompts_onpolicy.jsonl").read_text().splitlines()[:40]
    leak = multi_split(split, 3)[2].question
    lines.insert(7, json.dumps({"question": leak}))
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(TDLMError, match="multi held-out \\(test split\\) problems|are validation problems") as e:
        Job(_cfg(tmp_path, prompts=str(f)))
    assert "\n" not in str(e.value)


def test_job_refuses_changed_settings_of_finished_rounds(tmp_path):
    from tdlm.onpolicy.job import Job

    job = Job(_cfg(tmp_path))
    job.out.mkdir(parents=True)
    job._mark(0, "prompts", prompts=16)
    Job(_cfg(tmp_path, rounds=3, prompts_per_round=16))  # more rounds: nothing finished changes
    Job(_cfg(tmp_path, decode=DecodeSettings(policy="original", gen_length=56, block_size=56, batch_size=7),
             actors=1))  # run settings may change (the batch too)  # fmt: skip
    with pytest.raises(TDLMError, match="other settings \\(mix_lambda: 0.5 -> 0.3\\)"):
        Job(_cfg(tmp_path, mix_lambda=0.3))


def test_job_prompts_are_fresh_every_round(tmp_path):
    from tdlm.onpolicy.job import Job

    job = Job(_cfg(tmp_path, rounds=3))
    texts = [[row["question"] for row in rows] for rows in job.prompts]
    assert [len(t) for t in texts] == [16] * 4
    flat = [t for rows in texts for t in rows]
    assert len(flat) == len(set(flat))


def test_job_mix_refuses_a_stale_record_and_keeps_its_proportions(tmp_path):
    """The mix phase itself: lambda of this round, the rest from the teacher's and the replay window's records, and a
    record rolled in by an adapter older than the staleness bound allows is refused in one line, naming its file."""
    from tdlm.data.store import write_manifest
    from tdlm.data.trajectories import write_parquet
    from tdlm.onpolicy.job import Job, round_dir

    job = Job(_cfg(tmp_path, rounds=3, mix_lambda=0.25, mix_size=20, replay_window=1, staleness=1, shard_size=8))

    def records(r: int, n: int, version: int | None, forged: int | None = None) -> None:
        folder = job.records_of(r)
        recs = [_record(f"r{r}-{i}", [5, 6], [1, 2], 2, version if i != forged else 0) for i in range(n)]
        write_parquet(recs, folder / "shard-00000.parquet")
        write_manifest(folder, "", {})

    records(0, 30, None)
    records(1, 30, 0)
    records(2, 30, 1)
    records(3, 30, 2)
    counts = job.phase_mix(3)
    assert counts["current"] == 5 and counts["replay"] == 15 and counts["replay_rounds"] == [2]
    from tdlm.data.stream import shard_paths
    from tdlm.data.trajectories import read_parquet

    mixed = [r for p in shard_paths(round_dir(job.out, 3) / "mix") for r in read_parquet(p)]
    assert len(mixed) == 20 and sum(r.source_id.startswith("r3-") for r in mixed) == 5
    assert not any(r.source_id.startswith("r1-") for r in mixed)  # outside the replay window
    records(2, 30, 1, forged=4)  # one record of round 2 claims adapter version 0: 2 versions before version 2
    with pytest.raises(TDLMError, match="records/shard-00000.parquet row 4: record 'r2-4' was rolled in with adapter "
                                        "version 0, 2 versions before version 2"):
        job.phase_mix(3)


def test_round_cost_follows_its_inputs():
    """The 8B round-cost prediction: decode phases scale with prompts / GPUs, training with updates / MFU."""
    from tdlm.onpolicy.cost import round_cost

    shape = json.loads((REPO / "bench" / "results" / "true_shape.json").read_text())
    base = round_cost(shape)
    a = base["assumptions"]
    assert base["seconds"]["roll-in (student)"] == pytest.approx(1000 * 40.08 * a["ms_per_nfe_tdlm"] / 1e3 / 8)
    assert base["seconds"]["roll-out (teacher from s*)"] == pytest.approx(1000 * 128 * a["ms_per_nfe_backbone"] / 8e3)
    more = round_cost(shape, gpus=16, updates=300, mfu=0.2)
    assert more["seconds"]["roll-in (student)"] == pytest.approx(base["seconds"]["roll-in (student)"] / 2)
    assert more["seconds"]["training"] == pytest.approx(base["seconds"]["training"] * 4)
    assert sum(base["share"].values()) == pytest.approx(1.0)


def test_verdict_reads_one_evaluation_and_judges_each_target(tmp_path):
    """bench/results/onpolicy.json's targets from an evaluation folder: arms by adapter label, references by policy,
    two-level intervals, each target met or not."""
    from tdlm.onpolicy.verdict import ARMS, markdown, verdict

    rng = torch.Generator().manual_seed(0)
    n = 200
    runs = []

    def add(name: str, policy: str, tau: float, p: float, nfe: float, label: str | None = None) -> None:
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        correct = (torch.rand(n, generator=rng) < p).tolist()
        (d / "samples.jsonl").write_text("".join(json.dumps({"id": f"multi/{i:06d}", "correct": c, "nfe": nfe}) + "\n"
                                                 for i, c in enumerate(correct)))  # fmt: skip
        runs.append({"name": name, "task": "multi", "policy": policy, "threshold": tau, "adapter_label": label,
                     "accuracy": sum(correct) / n, "nfe_mean": nfe, "n": n, "run_dir": str(d)})  # fmt: skip

    add("threshold-tau0.9", "threshold", 0.9, 0.6, 30.0)
    add("credit-tau0.9", "credit", 0.9, 0.6, 24.0)
    quality = {"off-policy": 0.6, "more-data": 0.6, "on-policy": 0.95, "current-only": 0.3}
    for arm in ARMS:
        for s in (0, 1, 2):
            add(f"tdlm-{arm}-s{s}", "tdlm", 0.95, quality[arm], 20.0, f"{arm}-s{s}")
    (tmp_path / "summary.json").write_text(json.dumps({"runs": runs}))
    out = verdict(tmp_path, [0, 1, 2], 0.95, 0.9)
    t = out["targets"]
    assert t["on-policy beats the more-data control"]["met"] and t["full history beats current-only"]["met"]
    assert t["on-policy beats credit tau 0.9 at no more NFE"]["met"]  # 20 <= 24 NFE
    vs_threshold = t["on-policy vs threshold tau 0.9: lower bound >= -1 point at <= 0.8x its NFE"]
    assert vs_threshold["nfe_ratio"] == pytest.approx(20 / 30)
    lo, hi = out["differences"]["on-policy - current-only"]["interval"]
    assert 0 < lo < out["differences"]["on-policy - current-only"]["accuracy_diff"] < hi
    assert "| full history beats current-only |" in markdown(out)
    with pytest.raises(ValueError, match="0 runs of adapter 'off-policy-s3'"):
        verdict(tmp_path, [0, 1, 3], 0.95, 0.9)


def test_init_adapter_is_checked_and_loaded(tmp_path):
    """model.init_adapter: a folder of another layout is one line before any launch; a fitting one's temporal weights
    are what the run starts from (not W_O = 0)."""
    from tdlm.config import load_config
    from tdlm.models.loading import load_backbone_meta
    from tdlm.training.config import RunConfig
    from tdlm.training.loop import check_init_adapter, load_init_adapter, temporal_config

    bb = tdlm.load_backbone("tiny-multi", dtype="float32")
    run = load_config(RunConfig, str(REPO / "configs" / "tiny_multi.yaml"))
    resolved = temporal_config(run).resolved(load_backbone_meta("tiny-multi"))
    src = tdlm.TDLM(bb, temporal_config(run))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for mod in src.temporal.values():
            mod.o_proj.weight.copy_(torch.randn(mod.o_proj.weight.shape, generator=g))
    src.save_adapter(tmp_path / "fits")
    check_init_adapter(str(tmp_path / "fits"), resolved)
    fresh = tdlm.TDLM(bb, temporal_config(run))
    load_init_adapter(fresh, str(tmp_path / "fits"))
    for k, v in src.temporal.state_dict().items():
        assert torch.equal(fresh.temporal.state_dict()[k], v), k
    tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", heads=2, head_dim=32)).save_adapter(tmp_path / "other")
    with pytest.raises(TDLMError, match="model.init_adapter=.* does not fit this run's adapter: "
                                        "layers=\\[0, 1, 2, 3, 4, 5\\] \\(this run: \\[.*\\]\\)"):
        check_init_adapter(str(tmp_path / "other"), resolved)
    with pytest.raises(TDLMError, match="holds no adapter.safetensors"):
        check_init_adapter(str(tmp_path), resolved)


def test_cli_without_its_required_settings_is_one_line(capsys):
    from tdlm.onpolicy.cli import main

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --train-config, --prompts, --output-dir required")
