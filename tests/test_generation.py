"""Teacher trajectory generation on Ray: equality with tdlm.decode, fault tolerance, resume, job submit.

Fast tests (no Ray) cover prompts, the replica class, and the output-dir policy (changed settings,
corrupt / foreign / stale files, adoption). Tests marked ``slow`` start Ray: one in-process cluster
for the module (settings from shared/notes/ray-wandb-datasets-on-cpu.md), subprocess drivers for the
kill/resume test, and a ``ray start --head --block`` head for ``ray job submit``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

import tdlm
from tdlm.data.prompts import PromptSource, load_prompts
from tdlm.data.store import sha256_of, shard_name
from tdlm.data.tokenizer import encode_prompts, load_tokenizer
from tdlm.data.trajectories import read_parquet
from tdlm.decoding import decode
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError
from tdlm.generation import MANIFEST, GenerationConfig, ShardStore, ShardTask, ShardWorker, WorkerSpec, generate
from tdlm.generation.driver import prepare
from tdlm.generation.worker import (
    BARRIER_ENV,
    CRASH_ENV,
    KILL_ENV,
    FaultInjection,
)
from tdlm.tasks.base import default_data_dir
from tests.conftest import EXACT_DTYPE

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "ray_jobs" / "generate_trajectories.py"
GSM8K = default_data_dir() / "gsm8k_test.jsonl"
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
N_PROMPTS, SHARD = 8, 3  # 3 shards: [0, 3), [3, 6), [6, 8)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    """The first 12 GSM8K test questions cut to 30..78 characters (the toy tokenizer is per character,
    so whole questions would make every forward ~5x longer); synthetic questions if GSM8K is absent.
    The lengths differ, so batches need left padding."""
    if GSM8K.exists():
        questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:12]]
    else:
        questions = [f"Tom has {i} apples and buys {i + 3} more. How many apples does Tom have now?" for i in range(12)]
    path = tmp_path_factory.mktemp("prompts") / "gsm8k_short.jsonl"
    path.write_text("".join(json.dumps({"question": q[: 30 + 12 * (i % 5)]}) + "\n" for i, q in enumerate(questions)))
    return path


def make_cfg(out: Path, prompts: Path, **kw) -> GenerationConfig:
    base = dict(backbone="tiny-llada", prompts=str(prompts), output_dir=str(out), prompt_field="question",
                num_prompts=N_PROMPTS, policy="threshold", gen_length=16, block_size=8, shard_size=SHARD,
                batch_size=2, actors=2, log_interval=1.0)  # fmt: skip
    base.update(kw)
    section = {k: base.pop(k) for k in [f.name for f in fields(DecodeSettings)] if k in base}  # the decode: section
    return GenerationConfig(**base, decode=DecodeSettings(**section))


def with_decode(cfg: GenerationConfig, **kw) -> GenerationConfig:
    return replace(cfg, decode=replace(cfg.decode, **kw))


def build_serial(cfg: GenerationConfig) -> None:
    """A finished output dir without Ray: the same store (driver step 1: prepare) + replica code, one
    shard after another."""
    worker = ShardWorker(WorkerSpec(cfg.backbone, cfg.decode))
    with prepare(cfg) as store:
        todo = store.open()
        store.check_actor_identity(worker.info())
        for i in todo:
            ps = store.shard_prompts(i)
            r = worker.run_shard(ShardTask(i, [p.source_id for p in ps], [p.text for p in ps]))
            store.commit(store.write_shard(i, r.records, r.seconds, r.worker, 1))
        store.finalize()


def read_all(out: Path) -> list:
    manifest = json.loads((out / MANIFEST).read_text())
    return [r for i in range(manifest["num_shards"]) for r in read_parquet(out / shard_name(i))]


def reference(cfg: GenerationConfig, model=None) -> list:
    """Single-process tdlm.decode of all prompts in one batch (other batch composition than the replicas)."""
    texts = [p.text for p in load_prompts(cfg.prompt_source())]
    tok = load_tokenizer(cfg.backbone)
    model = model or tdlm.load_backbone(cfg.backbone)
    return decode(model, encode_prompts(tok, texts), cfg.decode.decode_config(), tokenizer=tok)


def assert_same(records: list, ref: list) -> None:
    assert [r.prompt_ids for r in records] == [x.prompt_ids for x in ref]
    assert [r.response_ids for r in records] == [x.tokens for x in ref]
    assert [r.reveal_steps for r in records] == [x.reveal_step for x in ref]
    assert [r.T for r in records] == [x.T for x in ref]


# -- fast: prompts, config, replica --------------------------------------------------------------
def test_prompt_sources(prompt_file, tmp_path):
    ps = load_prompts(PromptSource(str(prompt_file), "question", limit=5))
    assert [p.source_id for p in ps] == [f"{prompt_file.name}:{i}" for i in range(5)]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": [p.text for p in ps]}), tmp_path / "p.parquet")
    assert [p.text for p in load_prompts(PromptSource(str(tmp_path / "p.parquet"), "q"))] == [p.text for p in ps]
    with pytest.raises(TDLMError, match="no field 'prompt'"):
        load_prompts(PromptSource(str(prompt_file), "prompt"))
    with pytest.raises(TDLMError, match="no column 'question'"):
        load_prompts(PromptSource(str(tmp_path / "p.parquet"), "question"))
    with pytest.raises(TDLMError, match="only 5"):
        load_prompts(PromptSource(str(tmp_path / "p.parquet"), "q", limit=6))


def test_prompt_source_through_datasets(prompt_file, tmp_path, monkeypatch):
    """Non-file sources go through datasets.load_dataset (here a local folder with a test split)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    (tmp_path / "ds").mkdir()
    shutil.copy(prompt_file, tmp_path / "ds" / "test.jsonl")
    ps = load_prompts(PromptSource(str(tmp_path / "ds"), "question", split="test", limit=3))
    assert [p.text for p in ps] == [p.text for p in load_prompts(PromptSource(str(prompt_file), "question", limit=3))]
    assert ps[0].source_id == f"{tmp_path / 'ds'}/test:0"


def test_config_validation(tmp_path, prompt_file):
    with pytest.raises(TDLMError, match="needs --adapter"):
        make_cfg(tmp_path, prompt_file, policy="tdlm").validate()
    with pytest.raises(TDLMError, match="only used by policy 'tdlm'"):
        make_cfg(tmp_path, prompt_file, adapter=str(tmp_path)).validate()
    with pytest.raises(TDLMError, match="multiple of block_size"):
        make_cfg(tmp_path, prompt_file, gen_length=12).validate()
    with pytest.raises(TDLMError, match="shard_size must be >= 1"):
        make_cfg(tmp_path, prompt_file, shard_size=0).validate()
    for tau in (-0.1, 0.0, 1.5, float("nan")):
        with pytest.raises(TDLMError, match=r"^decode.threshold \(--tau\) must be in \(0, 1\]"):
            make_cfg(tmp_path, prompt_file, threshold=tau).validate()
    make_cfg(tmp_path, prompt_file, threshold=1.0).validate()
    for h in (0.0, -1.0, float("inf")):
        with pytest.raises(TDLMError, match=r"^decode.entropy_threshold \(--entropy-threshold, H\) must be a positive"):
            make_cfg(tmp_path, prompt_file, policy="entropy", entropy_threshold=h).validate()


def test_storage_and_compile_reach_the_replicas_decode_config(tmp_path, prompt_file):
    """The replicas once got DecodeConfig.to_dict(), the manifest's identity, which leaves out compile and storage: both
    were dropped on the way and every replica decoded eager and dynamic. Checked on the settings a replica holds from
    the spec the driver sends (tdlm.generation.driver.worker_spec; every field: tests/test_decode_settings.py)."""
    from tdlm.generation.driver import worker_spec

    cfg = make_cfg(tmp_path / "out", prompt_file, storage="static", compile="eager").validate()
    spec = worker_spec(cfg, gpu=False)
    assert "storage" not in cfg.identity([], None, None)["decode"] and cfg.run_settings()["storage"] == "static"
    worker = ShardWorker(replace(spec, device="cpu"))
    worker.info()  # re-raises a load error
    assert (worker.config.storage, worker.config.compile) == ("static", "eager")
    worker.config = replace(worker.config, compile=False)  # eager here (seconds): static decodes dynamic's tokens
    ps = load_prompts(cfg.prompt_source())
    res = worker.run_shard(ShardTask(0, [p.source_id for p in ps], [p.text for p in ps]))
    assert_same(res.records, reference(with_decode(cfg, storage="dynamic", compile=False)))


def test_storage_is_checked_before_anything_starts(tmp_path, prompt_file):
    from tdlm.generation.cli import parse_args
    from tdlm.generation.driver import check_models_and_hub
    from tdlm.temporal.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    with pytest.raises(TDLMError, match=r"^decode storage 'statc' unknown; expected one of dynamic, static; did you "
                                        r"mean 'static'\?$"):  # fmt: skip
        make_cfg(tmp_path, prompt_file, storage="statc").validate()
    with pytest.raises(TDLMError, match=r"^compile='reduce-overhead' captures CUDA graphs, .*"
                                        r"cache='prefix'.*; use storage='static' with it, or compile=True$"):
        make_cfg(tmp_path, prompt_file, compile="reduce-overhead", cache="prefix").validate()
    make_cfg(tmp_path, prompt_file, storage="static", cache="prefix").validate()
    lat = tmp_path / "lat"  # an adapter trained with latent:2 (its config is read; no weight is)
    lat.mkdir()
    (lat / ADAPTER_CONFIG).write_text(json.dumps({"history": "latent:2"}))
    (lat / ADAPTER_WEIGHTS).write_bytes(b"")
    cfg = make_cfg(tmp_path, prompt_file, policy="tdlm", adapter=str(lat), storage="static").validate()
    with pytest.raises(TDLMError, match=rf"^--adapter {lat}: decode.history: storage='static' does not cover "
                                        r"history latent:2: .*use storage='dynamic'$"):  # fmt: skip
        check_models_and_hub(cfg)
    check_models_and_hub(with_decode(cfg, storage="dynamic"))
    argv = ["--backbone", "b", "--prompts", "p", "--output-dir", "o"]
    assert parse_args([*argv, "--storage", "static"]).decode.storage == "static"
    assert parse_args(argv).decode.storage == "dynamic"


@pytest.fixture
def no_hub(monkeypatch):
    """The Hub unreachable (HF_ENDPOINT on a closed local port), and whatever hub_offline() switches restored."""
    import datasets.config
    import huggingface_hub.constants

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: a connect is refused at once
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", datasets.config.HF_DATASETS_OFFLINE)
    yield
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


@pytest.mark.parametrize("argv, named", [
    (["--tau", "-0.1"], "decode.threshold (--tau) must be in (0, 1] for teacher trajectories; got -0.1"),
    (["--policy", "entropy", "--entropy-threshold", "0"], "entropy_threshold (--entropy-threshold, H) must be"),
    (["--backbone", "no-such-backbone"], "unknown backbone 'no-such-backbone'"),
    (["--backbone", "GSAI-ML/LLaDA-8B-Instruct", "--prompts", "openai/gsm8k"],
     "unknown backbone 'GSAI-ML/LLaDA-8B-Instruct'"),  # no Hub: the missing backbone is named, not the dataset
    (["--prompts", "tdlm-test/no-such-dataset"], "the Hugging Face Hub cannot be reached"),
], ids=["tau", "H", "backbone", "hub-backbone", "hub-prompts"])
def test_cli_checks_input_before_anything_starts(tmp_path, prompt_file, capsys, no_hub, argv, named):
    """Each fault: one line naming it, exit status 2, within seconds, no Ray, no output folder (not even .lock),
    no Hub retry lines."""
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "traj"
    base = {"--backbone": "tiny-llada", "--prompts": str(prompt_file), "--num-prompts": str(N_PROMPTS),
            "--gen-length": "16", "--block-size": "8", "--output-dir": str(out)}
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    args = [x for k, v in (base | flags).items() for x in (k, v)]
    t0 = time.monotonic()
    assert main(args) == 2
    elapsed = time.monotonic() - t0
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and named in err and "\n" not in err, err
    assert "Retrying" not in captured.out + captured.err and not out.exists()
    assert elapsed < 20, elapsed  # one TCP connect at most (measured: well under a second each)
    import ray

    assert not ray.is_initialized()


def test_replica_reports_progress_per_batch(prompt_file, monkeypatch):
    """progress() says how far run_shard is, prompt by prompt as the engine finishes them (the driver polls it from a
    second actor thread)."""
    import tdlm.generation.worker as worker_mod

    seen = []
    worker = ShardWorker(WorkerSpec("tiny-llada", DecodeSettings(gen_length=16, block_size=8, batch_size=3)))
    real = worker_mod.decode

    def spy(*a, on_result, **kw):
        seen.append(worker.progress())

        def finished(i, r):
            on_result(i, r)
            seen.append(worker.progress())

        return real(*a, on_result=finished, **kw)

    monkeypatch.setattr(worker_mod, "decode", spy)
    ps = load_prompts(PromptSource(str(prompt_file), "question", limit=N_PROMPTS))
    assert worker.progress() is None
    worker.run_shard(ShardTask(5, [p.source_id for p in ps], [p.text for p in ps]))
    assert seen == [(5, k) for k in range(N_PROMPTS + 1)] and worker.progress() is None


def test_progress_line_counts_prompts_of_running_shards():
    from tdlm.generation.driver import Progress

    p = Progress(total=256, done=0, interval=1e9)
    p.start()
    assert p.line().startswith("progress 0/256 prompts (0.0%) | - traj/s | ETA ?")
    p.partial({0: 16, 1: 32})  # two shards in flight, 3 and 2 decode batches done
    assert p.line().startswith("progress 48/256 prompts (18.8%)") and "ETA ?" not in p.line()
    p.add(48, shard=1)  # shard 1 written (48 prompts): its partial count is replaced by the real one
    assert p.line().startswith("progress 64/256 prompts (25.0%)")


def test_replica_with_adapter_equals_decode(tmp_path, prompt_file):
    """Policy tdlm through a saved adapter (random W_O so it acts): replica == tdlm.decode, both in float64 (the
    replica's batches of 2 and the reference's batch of 5 are numerically different paths; tests/conftest.py says
    why float64)."""
    bb = tdlm.load_backbone("tiny-llada", dtype=EXACT_DTYPE)
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in model.temporal.values():
            mod.o_proj.weight.copy_(torch.randn(mod.o_proj.weight.shape, generator=g) * 0.5)
    model.save_adapter(tmp_path / "adapter")
    cfg = make_cfg(tmp_path / "out", prompt_file, policy="tdlm", adapter=str(tmp_path / "adapter"), num_prompts=5)
    spec = WorkerSpec("tiny-llada", replace(cfg.decode, batch_size=2, dtype="float64"), adapter=cfg.adapter)
    ps = load_prompts(cfg.prompt_source())
    worker = ShardWorker(spec)
    res = worker.run_shard(ShardTask(0, [p.source_id for p in ps], [p.text for p in ps]))
    assert next(worker.backbone.parameters()).dtype == EXACT_DTYPE
    exact = tdlm.TDLM.from_adapter(tdlm.load_backbone("tiny-llada", dtype=EXACT_DTYPE), cfg.adapter)
    assert_same(res.records, reference(cfg, exact))
    assert res.records[0].decode_settings["policy"] == "tdlm"


def test_replica_reports_load_errors_cleanly():
    worker = ShardWorker(WorkerSpec("no-such-backbone", DecodeSettings(gen_length=16, block_size=8)))
    with pytest.raises(TDLMError, match="unknown backbone 'no-such-backbone'"):
        worker.info()


# -- fast: output dir policy (f: changed settings, e: corrupt / foreign / stale files) ------------
@pytest.fixture(scope="module")
def finished_dir(tmp_path_factory, prompt_file) -> Path:
    out = tmp_path_factory.mktemp("finished") / "traj"
    build_serial(make_cfg(out, prompt_file))
    return out


@pytest.fixture
def out_copy(finished_dir, tmp_path) -> Path:
    dst = tmp_path / "traj"
    shutil.copytree(finished_dir, dst)
    return dst


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(gen_length=32), "decode.gen_length: 16 -> 32"),
        (dict(policy="original"), "decode.policy: 'threshold' -> 'original'"),
        (dict(backbone="tiny-dream"), "backbone: 'preset:tiny-llada' -> 'preset:tiny-dream'"),
        (dict(num_prompts=9), "num_prompts: 8 -> 9"),
        (dict(shard_size=4), "shard_size: 3 -> 4"),
        (dict(chat=False), "chat: True -> False"),
    ],
)
def test_changed_settings_refused(out_copy, prompt_file, change, named):
    with pytest.raises(TDLMError, match="generated with other settings") as e:
        generate(make_cfg(out_copy, prompt_file, **change))
    assert named in str(e.value)


def test_changed_prompt_text_refused(out_copy, prompt_file, tmp_path):
    edited = tmp_path / prompt_file.name  # same file name, one question edited
    lines = prompt_file.read_text().splitlines()[:N_PROMPTS]
    lines[2] = json.dumps({"question": "edited"})
    edited.write_text("\n".join(lines) + "\n")
    with pytest.raises(TDLMError, match="prompts_sha256"):
        generate(make_cfg(out_copy, edited))


def test_cli_prints_one_line_error(out_copy, prompt_file, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    argv = ["--backbone", "tiny-llada", "--prompts", str(prompt_file), "--num-prompts", str(N_PROMPTS),
            "--gen-length", "32", "--block-size", "8", "--shard-size", str(SHARD), "--output-dir", str(out_copy)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "decode.gen_length: 16 -> 32" in err and "\n" not in err


def test_storage_and_compile_are_not_the_manifests_identity(out_copy, prompt_file, caplog):
    """A dynamic, eager run's folder is the same job with storage static (and compiled): nothing refused, nothing
    to do."""
    with caplog.at_level(logging.INFO, logger="tdlm.generation"):
        summary = generate(make_cfg(out_copy, prompt_file, storage="static", compile="eager"))
    assert summary.skipped_shards == 3 and summary.computed_shards == [] and "nothing to do" in caplog.text


def test_rerun_of_finished_dir_does_nothing(out_copy, prompt_file, caplog):
    before = {p.name: p.stat().st_mtime_ns for p in out_copy.iterdir() if p.name != ".lock"}
    (out_copy / "shard-00001.parquet.tmp-4242").write_bytes(b"half a shard")  # a write killed mid-way
    (out_copy / "notes.txt").write_text("mine")
    with caplog.at_level(logging.INFO, logger="tdlm.generation"):
        summary = generate(make_cfg(out_copy, prompt_file))  # returns before Ray is needed
    assert summary.computed_shards == [] and summary.skipped_shards == 3
    assert not (out_copy / "shard-00001.parquet.tmp-4242").exists()
    assert "stale temporary file" in caplog.text and "notes.txt: unknown file" in caplog.text
    assert {p.name: p.stat().st_mtime_ns for p in out_copy.iterdir() if p.name not in (".lock", "notes.txt")} == before


@pytest.mark.parametrize(
    "damage, message",
    [
        ("listed_junk", r"shard-00001\.parquet: contents differ from manifest\.json"),
        ("unlisted_junk", r"shard-00002\.parquet: not a readable Parquet file"),
        ("unlisted_foreign", r"shard-00002\.parquet: holds other prompts than shard 2"),
        ("out_of_range", r"shard-00099\.parquet: not part of this job"),
        ("foreign_parquet", r"foo\.parquet: foreign Parquet file"),
        ("no_manifest", r"shard-00000\.parquet: shard files but no manifest\.json"),
        ("bad_manifest", r"manifest\.json: not valid JSON"),
    ],
)
def test_corrupt_or_foreign_files_are_errors(out_copy, prompt_file, damage, message):
    m = json.loads((out_copy / MANIFEST).read_text())
    if damage == "listed_junk":
        (out_copy / "shard-00001.parquet").write_bytes(b"PAR1 not really")
    elif damage in ("unlisted_junk", "unlisted_foreign"):
        del m["shards"]["shard-00002.parquet"]
        (out_copy / MANIFEST).write_text(json.dumps(m))
        if damage == "unlisted_junk":
            (out_copy / "shard-00002.parquet").write_bytes(b"garbage")
        else:  # a valid trajectory shard, but of other prompts
            shutil.copy(out_copy / "shard-00000.parquet", out_copy / "shard-00002.parquet")
    elif damage == "out_of_range":
        shutil.copy(out_copy / "shard-00000.parquet", out_copy / "shard-00099.parquet")
    elif damage == "foreign_parquet":
        shutil.copy(out_copy / "shard-00000.parquet", out_copy / "foo.parquet")
    elif damage == "no_manifest":
        (out_copy / MANIFEST).unlink()
    elif damage == "bad_manifest":
        (out_copy / MANIFEST).write_text("{ truncated")
    with pytest.raises(TDLMError, match=message):
        generate(make_cfg(out_copy, prompt_file))


def test_open_adopts_unlisted_complete_shard_and_recomputes_missing(out_copy, prompt_file, caplog):
    """A kill between the shard rename and the manifest update leaves a whole unlisted shard: verified
    and adopted. A listed shard that was deleted is recomputed."""
    m = json.loads((out_copy / MANIFEST).read_text())
    del m["shards"]["shard-00001.parquet"]
    (out_copy / MANIFEST).write_text(json.dumps(m))
    (out_copy / "shard-00002.parquet").unlink()
    cfg = make_cfg(out_copy, prompt_file)
    prompts = load_prompts(cfg.prompt_source())
    with caplog.at_level(logging.INFO, logger="tdlm.generation"):
        with ShardStore(out_copy, prompts, SHARD, cfg.identity(prompts, "preset:tiny-llada", None)) as store:
            assert store.open() == [2]
            assert store.adopted == 1
    assert "verified and adopted" in caplog.text and "shard-00002.parquet: listed as finished" in caplog.text
    listed = json.loads((out_copy / MANIFEST).read_text())["shards"]
    assert sorted(listed) == ["shard-00000.parquet", "shard-00001.parquet"]
    assert listed["shard-00001.parquet"]["sha256"] == sha256_of(out_copy / "shard-00001.parquet")


def test_second_writer_is_locked_out(out_copy, prompt_file):
    cfg = make_cfg(out_copy, prompt_file)
    prompts = load_prompts(cfg.prompt_source())
    with ShardStore(out_copy, prompts, SHARD, {}):
        with pytest.raises(TDLMError, match="another generation run"):
            generate(cfg)


# -- slow: Ray ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_env():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in RAY_ENV.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def ray_cluster(ray_env):
    """In-process 2-CPU cluster; generate() reuses it (ray.is_initialized) and kills its replicas."""
    import ray

    temp = f"/tmp/ray_tdlm_gen_{os.getpid()}"  # short: AF_UNIX paths are limited to 107 bytes
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
             _temp_dir=temp, logging_level=logging.WARNING)  # fmt: skip
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def assert_complete(out: Path, cfg: GenerationConfig) -> list:
    m = json.loads((out / MANIFEST).read_text())
    assert m["status"] == "complete" and m["counts"]["finished_prompts"] == N_PROMPTS
    for name, entry in m["shards"].items():
        assert sha256_of(out / name) == entry["sha256"]
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    records = read_all(out)
    ids = [p.source_id for p in load_prompts(cfg.prompt_source())]
    assert [r.source_id for r in records] == ids  # every prompt exactly once, shard i = [i*S, (i+1)*S)
    return records


def test_shard_barrier_holds_until_enough_replicas(tmp_path, monkeypatch):
    """The test-only barrier that makes the two-replica test deterministic really waits."""
    import threading

    monkeypatch.setenv(BARRIER_ENV, "2")
    faults = FaultInjection.from_env(str(tmp_path))
    assert faults is not None and faults.barrier == 2
    worker = ShardWorker.__new__(ShardWorker)  # the barrier needs only the spec, not a loaded model
    worker.spec = WorkerSpec(backbone="tiny-llada", decode=DecodeSettings(), faults=faults)
    t = threading.Thread(target=worker._maybe_wait_at_barrier)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # one replica at the barrier: still waiting
    (Path(faults.barrier_dir) / "another-replica").touch()
    t.join(10)
    assert not t.is_alive()


@pytest.mark.slow
def test_two_actors_equal_single_process_decode(ray_cluster, tmp_path, prompt_file, monkeypatch):  # (a)
    # On a loaded machine one replica can finish every shard before the other is up; the barrier
    # makes both hold a shard, so the comparison below really covers two processes.
    monkeypatch.setenv(BARRIER_ENV, "2")
    cfg = make_cfg(tmp_path / "traj", prompt_file, actors=None)  # default: one replica per CPU of the cluster
    summary = generate(cfg)
    assert sorted(summary.computed_shards) == [0, 1, 2]
    records = assert_complete(tmp_path / "traj", cfg)
    ref = reference(cfg)
    assert_same(records, ref)
    m = json.loads((tmp_path / "traj" / MANIFEST).read_text())
    nfe = [x.nfe for x in ref]
    assert m["nfe"]["mean"] == pytest.approx(sum(nfe) / len(nfe)) and m["nfe"]["max"] == max(nfe)
    assert m["runs"][-1]["replicas"] == 2 and len({e["worker"]["pid"] for e in m["shards"].values()}) == 2
    assert records[0].backbone_id == "tiny-llada" and records[0].decode_settings == cfg.decode.to_dict()


@pytest.mark.slow
def test_progress_moves_per_decode_batch(ray_cluster, tmp_path, prompt_file, caplog):
    """One shard of 8 prompts, decoded one prompt per batch: the progress lines count prompts inside the running
    shard (they once stayed at 0 until the whole shard was written)."""
    import re

    cfg = make_cfg(tmp_path / "traj", prompt_file, shard_size=N_PROMPTS, batch_size=1, actors=1, gen_length=64,
                   log_interval=0.2)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="tdlm.generation"):
        generate(cfg)
    counts = {int(m.group(1)) for m in re.finditer(rf"progress (\d+)/{N_PROMPTS} prompts", caplog.text)}
    assert counts & set(range(1, N_PROMPTS)), sorted(counts)
    assert_complete(tmp_path / "traj", cfg)


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [2, 0], ids=["ray-restart", "driver-redo"])
def test_replica_killed_mid_shard(ray_cluster, tmp_path, prompt_file, monkeypatch, max_restarts):  # (b)
    """The replica decoding shard 1 hard-exits on its first attempt. With Ray restarts the restarted
    actor retries it; with none, the driver replaces the actor and redoes the shard."""
    monkeypatch.setenv(CRASH_ENV, "1")
    cfg = make_cfg(tmp_path / "traj", prompt_file, max_restarts=max_restarts, max_task_retries=max_restarts)
    summary = generate(cfg)
    assert_complete(tmp_path / "traj", cfg)
    m = json.loads((tmp_path / "traj" / MANIFEST).read_text())
    run = m["runs"][-1]
    started = [p["pid"] for p in run["replica_processes"]]
    if max_restarts:  # Ray restarted the actor in a new process and retried: the driver saw nothing
        assert run["failures"] == [] and m["shards"]["shard-00001.parquet"]["attempts"] == 1
        assert len(started) == 2 and m["shards"]["shard-00001.parquet"]["worker"]["pid"] not in started
    else:
        assert [f["shard"] for f in run["failures"]] == [1] and run["replica_replacements"] == 1
        # the redo runs on whichever replica is idle first: the survivor or the replacement
        assert m["shards"]["shard-00001.parquet"]["worker"]["pid"] in started
        assert m["shards"]["shard-00001.parquet"]["attempts"] == 2 and summary.redone_shards == 1


def _script(args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_killed_job_resumes_only_missing_shards(ray_cluster, tmp_path, prompt_file):  # (c)
    """SIGKILL of the driver right after the 2nd shard file lands (before the manifest lists it), then
    the same command again: shards 0-1 are kept (1 adopted), only shard 2 is computed."""
    out = tmp_path / "traj"
    args = ["--backbone", "tiny-llada", "--prompts", str(prompt_file), "--num-prompts", str(N_PROMPTS),
            "--policy", "threshold", "--gen-length", "16", "--block-size", "8", "--shard-size", str(SHARD),
            "--batch-size", "2", "--actors", "1", "--output-dir", str(out), "--address", ray_cluster,
            "--log-interval", "1"]  # fmt: skip
    env = {**os.environ, **RAY_ENV, KILL_ENV: "2"}
    killed = _script(args, env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert sorted(p.name for p in out.iterdir()) == [".lock", MANIFEST, "shard-00000.parquet", "shard-00001.parquet"]
    assert list(json.loads((out / MANIFEST).read_text())["shards"]) == ["shard-00000.parquet"]
    mtimes = {n: (out / n).stat().st_mtime_ns for n in ("shard-00000.parquet", "shard-00001.parquet")}
    env.pop(KILL_ENV)
    rerun = _script(args, env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "shard-00001.parquet: complete shard written just before the last run stopped" in rerun.stdout
    assert "2 finished, 1 to do" in rerun.stdout and "1 shards computed" in rerun.stdout
    assert {n: (out / n).stat().st_mtime_ns for n in mtimes} == mtimes
    cfg = make_cfg(out, prompt_file)
    assert_same(assert_complete(out, cfg), reference(cfg))
    m = json.loads((out / MANIFEST).read_text())
    assert m["runs"][-1]["computed_shards"] == [2] and m["runs"][-1]["adopted_shards"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(ray_env, tmp_path_factory):
    """`ray start --head --block` on loopback with free ports; SIGTERM to that one PID at the end."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    temp = f"/tmp/ray_tdlm_head_{os.getpid()}"
    ports = {f: _free_port() for f in ("--port", "--dashboard-port", "--ray-client-server-port",
                                       "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                                       "--runtime-env-agent-port", "--metrics-export-port")}  # fmt: skip
    cmd = [ray_bin, "start", "--head", "--block", "--num-cpus", "2", "--include-dashboard=true",
           "--dashboard-host", "127.0.0.1", "--temp-dir", temp, *[x for kv in ports.items() for x in map(str, kv)]]
    env = {**os.environ, **RAY_ENV, "RAY_TMPDIR": temp}  # keeps its ray_current_cluster file out of /tmp/ray
    log_file = (tmp_path_factory.mktemp("head") / "head.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{ports['--dashboard-port']}"
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/api/version", timeout=2) as r:
                    if r.status == 200:
                        break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray head did not come up: {Path(log_file.name).read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, env
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_job_submit_end_to_end(ray_head, tmp_path, prompt_file):  # (d)
    url, env = ray_head
    out = tmp_path / "traj"  # absolute: the job runs in a copy of the working dir
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", url, "--working-dir", str(REPO),
           "--", sys.executable, "ray_jobs/generate_trajectories.py", "--backbone", "tiny-llada",
           "--prompts", str(prompt_file), "--num-prompts", str(N_PROMPTS), "--policy", "threshold",
           "--gen-length", "16", "--block-size", "8", "--shard-size", str(SHARD), "--batch-size", "2",
           "--actors", "1", "--output-dir", str(out), "--log-interval", "1"]  # fmt: skip
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in text, text[-4000:]
    assert f"progress {N_PROMPTS}/{N_PROMPTS} prompts (100.0%)" in text
    cfg = make_cfg(out, prompt_file)
    assert_same(assert_complete(out, cfg), reference(cfg))
    run = json.loads((out / MANIFEST).read_text())["runs"][-1]
    assert run["replicas"] == 1 and run["ray_address"].startswith("127.0.0.1:")
