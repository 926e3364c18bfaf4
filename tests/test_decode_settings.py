"""The one ``decode:`` section (tdlm.decoding.config.DecodeSettings) arrives whole in every worker.

Each driver (evaluation, generation, the lm-eval harness model, on-policy rounds) is given a section whose every field
differs from its default; what its worker receives, and what the worker then hands :func:`tdlm.decode` (the config
and the batch), loads (the weights' dtype) and restricts the adapter to (the history), is compared field by field
with what the test expects, built here and not by the code under test. The worker objects cross a pickle round trip
on their way, as Ray sends them to an actor, and run in this process (no Ray): the fast path of every driver.

Also: bad values are refused in one line naming the field, by each driver's one check; the flat keys of older
configs are refused in one line naming their place in the section; the generated flags land in the section.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tdlm
from tdlm.config import from_dict
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError

pytestmark = pytest.mark.usefixtures("one_thread")

# Every field away from its default (test_every_field_is_covered keeps it so when a field is added). The decode
# itself runs with compile off (see _Recorder): "eager" / "block" only have to arrive, not to trace.
SECTION = DecodeSettings(
    policy="tdlm", threshold=0.7, entropy_threshold=0.4, gen_length=16, block_size=8, stop_at_eos=True,
    cache="prefix", compile="eager", compile_scope="block", storage="static", credit_alpha=0.5, credit_decay=0.6,
    credit_gamma=0.3, soft_weight=0.25, soft_weight_init=0.1, soft_weight_growth=0.03, soft_threshold_decay=0.01,
    history="last:2", dtype="float32", batch_size=3,
)  # fmt: skip
SWEPT = ("policy", "threshold", "entropy_threshold", "cache", "history")  # an evaluation's grid decides these
BACKBONE = "tiny-arith"  # shipped in bfloat16: float32 weights show that decode.dtype arrived


def test_every_field_is_covered():
    default = DecodeSettings()
    same = [f.name for f in dataclasses.fields(DecodeSettings) if getattr(SECTION, f.name) == getattr(default, f.name)]
    assert not same, f"give these fields a non-default value in SECTION: {same}"
    assert SECTION.validate() is SECTION


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("adapter") / "ad"
    bb = tdlm.load_backbone(BACKBONE)
    tdlm.TDLM(bb, tdlm.TemporalConfig(layers="dispersed:2", heads=2, head_dim=8, history="full")).save_adapter(path)
    return str(path)


class _Recorder:
    """Stands in for :func:`tdlm.decode` inside a worker: keeps what the worker passed (the config object, its batch,
    the weights' dtype and the adapter's history), then decodes for real with compile off."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, []

    def __call__(self, model, prompts, config, **kw):
        backbone = model.backbone if isinstance(model, tdlm.TDLM) else model
        history = str(model.policy) if isinstance(model, tdlm.TDLM) else None
        self.calls.append(SimpleNamespace(config=config, batch_size=kw.get("batch_size"), history=history,
                                          dtype=next(backbone.parameters()).dtype))  # fmt: skip
        return self.real(model, prompts, dataclasses.replace(config, compile=False), **kw)


@pytest.fixture
def recorder(monkeypatch):
    import tdlm.decoding
    import tdlm.evaluation.worker
    import tdlm.generation.worker

    rec = _Recorder(tdlm.decoding.decode)
    for module in (tdlm.evaluation.worker, tdlm.generation.worker, tdlm.decoding):  # the harness imports it late
        monkeypatch.setattr(module, "decode", rec)
    return rec


def _arrived(call, expected: DecodeSettings) -> None:
    """Every field of ``expected`` reached the worker's decode: in the config object it passed, and the three that act
    around the call (batch, dtype, history) where they act."""
    assert isinstance(call.config, DecodeSettings)
    for f in dataclasses.fields(DecodeSettings):
        assert getattr(call.config, f.name) == getattr(expected, f.name), f.name
    assert call.batch_size == expected.batch_size
    assert call.dtype == getattr(torch, expected.dtype)
    assert call.history == (expected.history if expected.policy == "tdlm" else None)


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))  # what Ray does to an actor's constructor arguments and task arguments


# -- evaluation -----------------------------------------------------------------------------------------------------
def test_evaluation_sends_every_field_to_its_worker(tmp_path, adapter, recorder):
    from tdlm.evaluation.config import EvalConfig
    from tdlm.evaluation.driver import plan_runs, run_in_process, shard_jobs

    section = dataclasses.replace(SECTION, **{k: getattr(DecodeSettings, k) for k in SWEPT})
    cfg = EvalConfig(backbone=BACKBONE, output_dir=str(tmp_path), tasks=["arith"], limit=2, adapters=[adapter],
                     policies=["entropy", "tdlm"], thresholds=[SECTION.threshold],
                     entropy_thresholds=[SECTION.entropy_threshold], caches=[SECTION.cache],
                     histories=[SECTION.history], decode=section, workers=1, warmup=0, wandb_mode="disabled",
                     device="cpu").validate()  # fmt: skip
    jobs, _ = shard_jobs(cfg, plan_runs(cfg), 1)
    run_in_process(cfg, [_pickled(j) for j in jobs])
    # each run gets the section with its own point of the grid: tau for tdlm, H for entropy, both the cache
    expected = {
        "entropy": dataclasses.replace(SECTION, policy="entropy", threshold=DecodeSettings.threshold, history=None),
        "tdlm": dataclasses.replace(SECTION, entropy_threshold=DecodeSettings.entropy_threshold),
    }
    assert sorted({c.config.policy for c in recorder.calls}) == ["entropy", "tdlm"]
    for call in recorder.calls:
        _arrived(call, expected[call.config.policy])
    for f in dataclasses.fields(DecodeSettings):  # between them, the runs carried every value of the test's section
        assert getattr(SECTION, f.name) in {getattr(c.config, f.name) for c in recorder.calls}, f.name


# -- generation and on-policy -----------------------------------------------------------------------------------------
def _through_generation(cfg, tmp_path: Path) -> None:
    """The generation driver's replica spec, pickled, into a replica that decodes one shard."""
    from tdlm.generation.driver import worker_spec
    from tdlm.generation.worker import ShardTask, ShardWorker

    worker = ShardWorker(_pickled(worker_spec(cfg.validate(), gpu=False)))
    worker.info()  # re-raises a load error
    worker.run_shard(_pickled(ShardTask(0, ["a", "b"], ["3+5=", "2+2="])))


def _prompts(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": q}) + "\n" for q in ("3+5=", "2+2=")))
    return str(path)


def test_generation_sends_every_field_to_its_replicas(tmp_path, adapter, recorder):
    from tdlm.generation.config import GenerationConfig

    cfg = GenerationConfig(backbone=BACKBONE, prompts=_prompts(tmp_path), output_dir=str(tmp_path / "out"),
                           decode=SECTION, adapter=adapter)  # fmt: skip
    _through_generation(cfg, tmp_path)
    assert recorder.calls
    for call in recorder.calls:
        _arrived(call, SECTION)


def test_onpolicy_sends_every_field_to_its_replicas(tmp_path, adapter, recorder):
    from tdlm.onpolicy.config import OnPolicyConfig
    from tdlm.onpolicy.job import Job

    section = dataclasses.replace(SECTION, policy="entropy")  # the teacher's rule (never tdlm)
    cfg = OnPolicyConfig(train_config="unused.yaml", prompts=_prompts(tmp_path), output_dir=str(tmp_path / "job"),
                         decode=section, rollout_tau=[0.8], gap_prompts=0).validate()  # fmt: skip
    # Job.generation_config is the on-policy driver's step into generation; a whole Job would read a training recipe
    job = SimpleNamespace(cfg=cfg, backbone=BACKBONE, out=Path(cfg.output_dir), adapter_of=lambda r: Path(adapter))
    job.records_of = lambda r: Job.records_of(job, r)
    teacher = Job.generation_config(job, 0)
    assert teacher.decode == section
    _through_generation(dataclasses.replace(teacher, prompts=_prompts(tmp_path)), tmp_path)
    for call in recorder.calls:
        _arrived(call, section)
    recorder.calls.clear()
    roll = Job.generation_config(job, 1)
    student = dataclasses.replace(section, policy="tdlm", threshold=0.8)
    assert roll.decode == student and roll.teacher_policy == "entropy"
    _through_generation(dataclasses.replace(roll, prompts=_prompts(tmp_path)), tmp_path)
    by_policy = {c.config.policy: c for c in recorder.calls}
    assert sorted(by_policy) == ["entropy", "tdlm"]  # the roll-in, then the frozen backbone's roll-out
    _arrived(by_policy["tdlm"], student)
    _arrived(by_policy["entropy"], dataclasses.replace(student, policy="entropy"))


# -- the lm-eval harness model ------------------------------------------------------------------------------------
def test_harness_sends_every_field_to_decode(adapter, recorder):
    pytest.importorskip("lm_eval")
    from tdlm.harness.model import TDLMHarnessLM

    # lm-eval's --model_args are flat key=value pairs and its --batch_size an argument of its own
    args = {f.name: getattr(SECTION, f.name) for f in dataclasses.fields(DecodeSettings) if f.name != "batch_size"}
    lm = TDLMHarnessLM(batch_size=SECTION.batch_size, device="cpu", pretrained=BACKBONE, adapter=adapter, **args)
    req = SimpleNamespace(args=("3+5=", {"until": []}), task_name="t", doc={})
    lm.generate_until([req, req], disable_tqdm=True)
    assert recorder.calls
    for call in recorder.calls:
        _arrived(call, SECTION)


# -- one-line refusals ------------------------------------------------------------------------------------------------
BAD = [("storage", "statik"), ("compile_scope", "layer"), ("dtype", "fp8"), ("batch_size", 0),
       ("history", "lastt:2"), ("cache", "full"), ("gen_length", 10)]  # fmt: skip


def _drivers(tmp_path: Path):
    from tdlm.evaluation.config import EvalConfig
    from tdlm.generation.config import GenerationConfig
    from tdlm.harness.model import parse_model_args
    from tdlm.onpolicy.config import OnPolicyConfig

    prompts = _prompts(tmp_path)
    return {
        "evaluation": lambda d: EvalConfig("b", "o", decode=d).validate(),
        "generation": lambda d: GenerationConfig("b", prompts, "o", decode=d).validate(),
        "on-policy": lambda d: OnPolicyConfig("t.yaml", prompts, "o", decode=d).validate(),
        "harness": lambda d: parse_model_args({"pretrained": "b", **{k: getattr(d, k) for k in ("storage",
                                               "compile_scope", "dtype", "history", "cache", "gen_length")}},
                                              d.batch_size),  # fmt: skip
    }


@pytest.mark.parametrize(("name", "value"), BAD)
def test_a_bad_value_is_one_line_naming_its_field(tmp_path, name, value):
    for driver, check in _drivers(tmp_path).items():
        section = DecodeSettings(**{name: value}) if name != "gen_length" else DecodeSettings(gen_length=10)
        if driver in ("evaluation",) and name in SWEPT:
            continue  # the grid's lists carry these (test below)
        if driver == "on-policy":
            section = dataclasses.replace(section, policy="original")
        with pytest.raises(TDLMError) as e:
            check(section)
        msg = str(e.value)
        assert "\n" not in msg, (driver, msg)
        assert (name if name != "gen_length" else "block_size") in msg, (driver, msg)


def test_a_swept_field_in_an_evaluation_section_is_refused():
    from tdlm.evaluation.config import EvalConfig

    for name, lists in (("threshold", "thresholds"), ("cache", "caches"), ("history", "histories")):
        value = {"threshold": 0.5, "cache": "dual", "history": "full"}[name]
        with pytest.raises(TDLMError, match=f"decode.{name}=.*sweeps {name} through {lists}"):
            EvalConfig("b", "o", decode=DecodeSettings(**{name: value})).validate()


def test_flat_keys_of_older_configs_name_the_section():
    from tdlm.evaluation.config import EvalConfig
    from tdlm.generation.config import GenerationConfig
    from tdlm.onpolicy.config import OnPolicyConfig

    for cls, raw in ((EvalConfig, {"backbone": "b", "output_dir": "o", "storage": "static"}),
                     (GenerationConfig, {"backbone": "b", "prompts": "p", "output_dir": "o", "storage": "static"}),
                     (OnPolicyConfig, {"train_config": "t", "prompts": "p", "output_dir": "o", "storage": "static"})):
        with pytest.raises(TDLMError) as e:
            from_dict(cls, raw, "old.yaml")
        assert str(e.value) == ("old.yaml: storage: moved into the decode: section; write it as decode: "
                                "{storage: 'static'} (or the override decode.storage=...)")


def test_a_section_keeps_its_jobs_default_batch():
    from tdlm.generation.config import GenerationConfig

    cfg = from_dict(GenerationConfig, {"backbone": "b", "prompts": "p", "output_dir": "o",
                                       "decode": {"policy": "original"}})  # fmt: skip
    assert cfg.decode.batch_size == GenerationConfig("b", "p", "o").decode.batch_size == 1408


def test_flags_land_in_the_section(tmp_path):
    from tdlm.evaluation.config import parse_args as eval_args
    from tdlm.generation.cli import parse_args as gen_args
    from tdlm.onpolicy.cli import build_parser
    from tdlm.onpolicy.job import load_job_config

    flags = ["--storage", "static", "--compile-scope", "block", "--dtype", "float32", "--batch-size", "3",
             "--gen-length", "16", "--block-size", "8", "--stop-at-eos", "--credit-alpha", "0.5"]  # fmt: skip
    want = {"storage": "static", "compile_scope": "block", "dtype": "float32", "batch_size": 3, "gen_length": 16,
            "block_size": 8, "stop_at_eos": True, "credit_alpha": 0.5}  # fmt: skip
    e = eval_args(["--backbone", "b", "--output-dir", "o", *flags])
    g = gen_args(["--backbone", "b", "--prompts", "p", "--output-dir", "o", "--tau", "0.7", "--cache", "prefix",
                  "--history", "last:2", *flags])  # fmt: skip
    args = vars(build_parser().parse_args(["--teacher-policy", "entropy", "--tau", "0.7", *flags]))
    args.pop("config")
    o, _ = load_job_config(None, {**args, "train_config": "t", "prompts": "p", "output_dir": "o"})
    for cfg in (e, g, o):
        assert {k: getattr(cfg.decode, k) for k in want} == want
    assert (g.decode.threshold, g.decode.cache, g.decode.history) == (0.7, "prefix", "last:2")
    assert (o.decode.policy, o.decode.threshold) == ("entropy", 0.7)
