"""No contamination: teacher prompts default to train splits, evaluation splits are refused without the
flag, the manifest records source / split / per-prompt hashes, and the training preflight
(:func:`tdlm.data.contamination.check_trajectory_prompts`) finds evaluation problems among teacher prompts.

All without Ray: folders are built with the driver's own first step (``prepare``) and a replica run in
process, or written directly with :func:`tdlm.data.trajectories.write_parquet`.
"""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest

from tdlm.data.contamination import (
    HASH_VERSION,
    check_trajectory_prompts,
    eval_hashes,
    prompt_hash,
)
from tdlm.data.prompts import PromptSource
from tdlm.data.trajectories import TrajectoryRecord, write_parquet
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError
from tdlm.generation import MANIFEST, GenerationConfig, ShardTask, ShardWorker, WorkerSpec
from tdlm.generation.driver import prepare
from tdlm.tasks.base import default_data_dir
from tdlm.tasks.toydata import TEST_SIZE, split

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "ray_jobs" / "generate_trajectories.py"
BENCH = default_data_dir()
needs_data = pytest.mark.skipif(not (BENCH / "gsm8k_test.jsonl").exists(), reason=f"benchmarks not in {BENCH}")

pytestmark = pytest.mark.usefixtures("one_thread")


def gsm8k_test_questions(n: int, start: int = 0) -> list[str]:
    lines = (BENCH / "gsm8k_test.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["question"] for line in lines[start : start + n]]


def clean_questions(n: int) -> list[str]:
    return [f"Tom has {i} apples and buys {i + 3} more. How many apples does Tom have now?" for i in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "question") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def cfg_for(out: Path, prompts: str, **kw) -> GenerationConfig:
    base = dict(backbone="tiny-llada", prompts=prompts, output_dir=str(out), shard_size=4,
                decode=DecodeSettings(policy="original", gen_length=8, block_size=8, batch_size=4))  # fmt: skip
    base.update(kw)
    return GenerationConfig(**base)


def build(cfg: GenerationConfig) -> Path:
    """A finished generation dir without Ray: the driver's step 1 (checks + manifest provenance), then
    the replica class in process, shard by shard."""
    worker = ShardWorker(WorkerSpec(cfg.backbone, cfg.decode, chat=cfg.chat))
    with prepare(cfg) as store:
        todo = store.open()
        store.check_actor_identity(worker.info())
        for i in todo:
            ps = store.shard_prompts(i)
            r = worker.run_shard(ShardTask(i, [p.source_id for p in ps], [p.text for p in ps]))
            store.commit(store.write_shard(i, r.records, r.seconds, r.worker, 1))
        store.finalize()
    return Path(cfg.output_dir)


def write_folder(root: Path, texts: list[str]) -> Path:
    """A trajectory folder without a manifest (like ``tdlm.demo.ensure_toy_trajectories``): dummy tokens,
    real prompt texts."""
    recs = [TrajectoryRecord(f"p:{i}", [5, 6], [7, 8], [1, 2], 2, prompt_text=t, backbone_id="x")
            for i, t in enumerate(texts)]  # fmt: skip
    write_parquet(recs[: len(recs) // 2], root / "shard-00000.parquet")
    write_parquet(recs[len(recs) // 2 :], root / "shard-00001.parquet")
    return root


# -- the key ----------------------------------------------------------------------------------------
def test_prompt_hash_normalises_whitespace_and_unicode_only():
    assert prompt_hash("  Tom has\n 3\tapples. ") == prompt_hash("Tom has 3 apples.")
    assert prompt_hash("caf\u00e9") == prompt_hash("cafe\u0301")  # NFC
    assert prompt_hash("Tom has 3 apples.") != prompt_hash("tom has 3 apples.")  # case is kept
    assert len(prompt_hash("x")) == 16


@needs_data
def test_eval_keys_cover_bare_question_and_full_prompt():
    from tdlm.tasks import load_task

    table = eval_hashes("gsm8k")
    p = load_task("gsm8k", data_dir=BENCH, limit=1)[0]
    assert table[prompt_hash(p.raw["question"])] == table[prompt_hash(p.prompt)] == "gsm8k/0000"
    assert prompt_hash(clean_questions(1)[0]) not in table
    assert len(eval_hashes("arith")) == TEST_SIZE


# -- defaults ---------------------------------------------------------------------------------------
def test_default_split_is_a_train_split(capsys):
    assert GenerationConfig.prompt_split == "train" and PromptSource("x").split == "train"
    from tdlm.generation.cli import parse_args as parse  # what ray_jobs/generate_trajectories.py runs
    cfg = parse(["--backbone", "tiny-llada", "--prompts", "openai/gsm8k", "--output-dir", "o"])
    assert cfg.prompt_split == "train" and cfg.allow_eval_prompts is False
    cfg.validate()  # GSM8K train: not an evaluation split
    with pytest.raises(SystemExit):
        parse(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--allow-eval-prompts" in help_text and "The default, 'train', keeps teacher prompts out" in help_text


def test_demo_teacher_prompts_are_disjoint_from_the_held_out_split(tmp_path):
    """The embedded default's teacher prompts (tdlm.demo: the arith 'prompts' split) pass the check."""
    from tdlm.demo import write_prompts

    write_prompts(tmp_path / "prompts.jsonl", 512)
    store = prepare(cfg_for(tmp_path / "out", str(tmp_path / "prompts.jsonl"), num_prompts=512, shard_size=64))
    assert store.provenance["contamination"]["overlap"]["arith"] == 0
    assert store.provenance["contamination"]["eval_split"] is None


def test_multi_demo_teacher_prompts_are_disjoint_from_the_held_out_split(tmp_path):
    """make demo's teacher prompts (the multi-v1 'prompts' split) pass the check against the multi test split."""
    from tdlm.demo import write_prompts

    write_prompts(tmp_path / "prompts.jsonl", 512, "multi")
    first = json.loads((tmp_path / "prompts.jsonl").read_text().splitlines()[0])
    assert first["question"].endswith(" = ?")  # the multi form, not arith's "3+5=?"
    store = prepare(cfg_for(tmp_path / "out", str(tmp_path / "prompts.jsonl"), num_prompts=512, shard_size=64))
    assert store.provenance["contamination"]["overlap"]["multi"] == 0
    assert store.provenance["contamination"]["eval_split"] is None


# -- refusal at generation --------------------------------------------------------------------------
HUB_EVAL = [
    ("openai/gsm8k", "main", "test", "gsm8k"),
    ("gsm8k", "main", "test[:100]", "gsm8k"),
    ("HuggingFaceH4/MATH-500", None, "test", "math500"),
    ("google-research-datasets/mbpp", "sanitized", "test", "mbpp"),
    ("mbpp", "full", "train+test", "mbpp"),
]


@pytest.mark.parametrize("source, config, split_, task", HUB_EVAL, ids=[h[0] + "/" + h[2] for h in HUB_EVAL])
def test_hub_eval_split_refused_without_flag(tmp_path, source, config, split_, task):
    cfg = cfg_for(tmp_path, source, prompt_config=config, prompt_split=split_)
    with pytest.raises(TDLMError) as e:
        cfg.validate()
    msg = str(e.value)
    assert source in msg and split_ in msg and f"evaluation task {task!r}" in msg
    assert "--allow-eval-prompts" in msg and "\n" not in msg
    cfg_for(tmp_path, source, prompt_config=config, prompt_split=split_, allow_eval_prompts=True).validate()
    cfg_for(tmp_path, source, prompt_config=config, prompt_split="train").validate()


LOCAL_EVAL = [("gsm8k_test.jsonl", "question", "gsm8k"), ("math500_test.jsonl", "problem", "math500"),
              ("mbpp_sanitized_test.jsonl", "prompt", "mbpp")]  # fmt: skip


@needs_data
@pytest.mark.parametrize("name, field, task", LOCAL_EVAL, ids=[x[2] for x in LOCAL_EVAL])
def test_pinned_eval_file_refused_without_flag(tmp_path, name, field, task):
    path = str(BENCH / name)
    with pytest.raises(TDLMError, match=rf"prompt file {path} holds the {task} test problems .*--allow-eval-prompts"):
        prepare(cfg_for(tmp_path / "out", path, prompt_field=field, num_prompts=4))
    store = prepare(cfg_for(tmp_path / "out", path, prompt_field=field, num_prompts=4, allow_eval_prompts=True))
    report = store.provenance["contamination"]
    assert report["eval_split"] == task and report["overlap"][task] == 4 and report["allow_eval_prompts"] is True


@needs_data
def test_copied_eval_questions_refused_by_content(tmp_path, capsys):
    """Evaluation questions under another file name (whitespace changed) are found by hash; the CLI
    prints one line naming the count, the task and the flag."""
    texts = clean_questions(3) + ["  " + q.replace(" ", "\n", 2) for q in gsm8k_test_questions(2, start=10)]
    prompts = write_jsonl(tmp_path / "my_prompts.jsonl", texts)
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main(["--backbone", "tiny-llada", "--prompts", str(prompts), "--gen-length", "8", "--block-size", "8",
                 "--output-dir", str(tmp_path / "out")]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: prompt file {prompts}: 2 of 5 teacher prompts are gsm8k test problems")
    assert "gsm8k/0010" in err and "--allow-eval-prompts" in err and "\n" not in err
    assert not (tmp_path / "out").exists()  # refused before the output dir is touched


def test_arith_held_out_split_refused_by_content(tmp_path):
    held_out = [p.question for p in split("test", 6)]
    prompts = write_jsonl(tmp_path / "arith.jsonl", [p.question for p in split("prompts", 4)] + held_out)
    with pytest.raises(TDLMError, match=r"6 of 10 teacher prompts are arith held-out \(test split\) problems"):
        prepare(cfg_for(tmp_path / "out", str(prompts)))
    store = prepare(cfg_for(tmp_path / "out", str(prompts), allow_eval_prompts=True))
    assert store.provenance["contamination"]["overlap"]["arith"] == 6


# -- manifest ---------------------------------------------------------------------------------------
@needs_data  # the check compares with the evaluation splits, read from the benchmark copies
def test_manifest_records_source_split_and_hashes(tmp_path, monkeypatch):
    """A Hugging Face-style source (a local dataset folder, loaded by datasets) with the default split."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    texts = [q[:40] for q in clean_questions(5)]
    write_jsonl(tmp_path / "ds" / "train.jsonl", texts)
    out = build(cfg_for(tmp_path / "traj", str(tmp_path / "ds")))
    m = json.loads((out / MANIFEST).read_text())
    p = m["prompts"]
    assert (p["source"], p["split"], p["field"], p["count"]) == (str(tmp_path / "ds"), "train", "question", 5)
    assert p["hash"] == HASH_VERSION and p["hashes"] == [prompt_hash(t) for t in texts]
    assert m["contamination"]["eval_split"] is None and m["contamination"]["allow_eval_prompts"] is False
    assert "arith" in m["contamination"]["overlap"] and not any(m["contamination"]["overlap"].values())
    report = check_trajectory_prompts(out)
    assert report["hash_source"] == "manifest" and report["split"] == "train" and not report["contaminated"]


# -- training preflight -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def contaminated_dir(tmp_path_factory) -> Path:
    """Generated (with the flag) from 5 clean prompts and 3 real GSM8K test questions."""
    if not (BENCH / "gsm8k_test.jsonl").exists():
        pytest.skip(f"benchmarks not in {BENCH}")
    root = tmp_path_factory.mktemp("contaminated")
    texts = [q[:40] for q in clean_questions(5)] + gsm8k_test_questions(3, start=100)
    prompts = write_jsonl(root / "teacher.jsonl", texts)
    return build(cfg_for(root / "traj", str(prompts), allow_eval_prompts=True))


def test_preflight_detects_gsm8k_test_overlap(contaminated_dir):
    m = json.loads((contaminated_dir / MANIFEST).read_text())
    assert m["contamination"]["overlap"]["gsm8k"] == 3  # recorded at generation (allowed)
    with pytest.raises(TDLMError) as e:
        check_trajectory_prompts(contaminated_dir)
    msg = str(e.value)
    assert msg.startswith(f"{contaminated_dir}: 3 of 8 teacher prompts are gsm8k test problems (evaluation split")
    assert "gsm8k/0100" in msg and msg.endswith("set data.allow_eval_prompts: true") and "\n" not in msg
    report = check_trajectory_prompts(contaminated_dir, allow_eval_prompts=True)
    assert report["overlap"]["gsm8k"] == 3 and report["contaminated"] and report["hash_source"] == "manifest"
    assert report["prompts"] == 8 and report["allowed"] is True
    check_trajectory_prompts(contaminated_dir, tasks=["math500", "mbpp", "arith"])  # other tasks: clean


def test_preflight_reads_old_manifest_without_hashes(contaminated_dir, tmp_path):
    """A manifest from before ``prompts`` / ``contamination`` existed: hashes recomputed from the shards."""
    old = tmp_path / "traj"
    shutil.copytree(contaminated_dir, old)
    m = json.loads((old / MANIFEST).read_text())
    del m["prompts"], m["contamination"]
    (old / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(TDLMError, match=r"3 of 8 teacher prompts are gsm8k test problems"):
        check_trajectory_prompts(old)
    report = check_trajectory_prompts(old, allow_eval_prompts=True)
    assert report["hash_source"] == "shards" and report["overlap"]["gsm8k"] == 3
    (old / MANIFEST).unlink()  # no manifest at all (tdlm.demo.ensure_toy_trajectories writes none)
    assert check_trajectory_prompts(old, allow_eval_prompts=True)["overlap"]["gsm8k"] == 3


def test_preflight_uses_old_manifest_source_name(tmp_path):
    """An old manifest whose source tag is an evaluation split is refused even if no text matches."""
    root = write_folder(tmp_path / "traj", [q[:40] for q in clean_questions(4)])
    (root / MANIFEST).write_text(json.dumps({"settings": {"prompt_source": "openai/gsm8k/main/test"}}))
    with pytest.raises(TDLMError, match=r"prompt source openai/gsm8k/main/test is an evaluation split"):
        check_trajectory_prompts(root)
    assert check_trajectory_prompts(root, allow_eval_prompts=True)["eval_split"] == "gsm8k"


def test_preflight_passes_on_the_embedded_default(tmp_path):
    """The folder training generates on first use (no manifest; arith 'prompts' split) is clean."""
    from tdlm.data.toy_trajectories import ensure_toy_trajectories

    ensure_toy_trajectories(tmp_path / "traj", "tiny-arith", n=8)
    report = check_trajectory_prompts(tmp_path / "traj", tasks=["arith"])
    assert report == {**report, "prompts": 8, "hash_source": "shards", "overlap": {"arith": 0},
                      "contaminated": False, "unhashed": 0}  # fmt: skip


def test_preflight_refuses_arith_held_out_and_unchecked_rows(tmp_path):
    root = write_folder(tmp_path / "traj", [p.question for p in split("prompts", 3)] + [split("test", 1)[0].question])
    with pytest.raises(TDLMError, match=r"1 of 4 teacher prompts are arith held-out \(test split\) problems"):
        check_trajectory_prompts(root, tasks=["arith"])
    blank = write_folder(tmp_path / "blank", [p.question for p in split("prompts", 3)] + [""])
    with pytest.raises(TDLMError, match=r"1 of 4 rows have no prompt_text"):
        check_trajectory_prompts(blank, tasks=["arith"])
    assert check_trajectory_prompts(blank, tasks=["arith"], allow_eval_prompts=True)["unhashed"] == 1


def test_preflight_refuses_when_eval_problems_cannot_be_loaded(tmp_path):
    root = write_folder(tmp_path / "traj", [q[:40] for q in clean_questions(4)])
    with pytest.raises(TDLMError, match=r"the gsm8k evaluation problems could not be loaded .*gsm8k_test\.jsonl"):
        check_trajectory_prompts(root, tasks=["gsm8k"], data_dir=tmp_path / "empty")
    report = check_trajectory_prompts(root, tasks=["gsm8k"], data_dir=tmp_path / "empty", allow_eval_prompts=True)
    assert "gsm8k" in report["unavailable"]
    with pytest.raises(TDLMError, match="unknown task"):
        check_trajectory_prompts(root, tasks=["gsm8k-train"])
