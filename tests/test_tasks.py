"""Task loading and prompt formats (tdlm.tasks): counts, ids, prompts, local/Hub source selection, bad files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tdlm.errors import TDLMError
from tdlm.tasks import PROMPT_VERSIONS, TASK_NAMES, base, gsm8k, load_task, math500, mbpp
from tdlm.tasks.base import default_data_dir

DATA = default_data_dir()
EXPECTED = {"gsm8k": 1319, "math500": 500, "mbpp": 257, "arith": 500, "multi": 500}

# Ratchet: sha256 over all prompts of a task. Changing a prompt without bumping its PROMPT_VERSION fails here;
# after a deliberate change, bump the version and record the new hash under the new key.
PROMPT_SHA256 = {
    "gsm8k-v1": "f74a8ba3aad70868d0575cc4408370414275d94b98e8ba8338a1c7fe5e75749e",
    "math500-v1": "91bd38f20c1b10e97ce637819fc726eae9c92c51070763079a14100117aa8bd8",
    "mbpp-v1": "69ed3044282be298415a7450b64630430dd09a9dcfdef887aa564c2b785e195e",
    "arith-v1": "339f22e8e27075518b4a243afc57e34fc4d9344f7c6e264082742db27e1125b1",
    "multi-v1": "aac45dbaf0ec480b27013301995c5846f5957a4f17eedd4549363622d902c50f",
}


@pytest.fixture(scope="module")
def tasks():
    return {name: load_task(name, data_dir=DATA) for name in TASK_NAMES}


def _prompt_hash(task) -> str:
    return hashlib.sha256("\n\x00".join(p.prompt for p in task).encode()).hexdigest()


def test_full_splits_load_with_stable_unique_ids(tasks):
    assert set(tasks) == set(EXPECTED)
    for name, task in tasks.items():
        assert len(task) == EXPECTED[name], name
        ids = [p.id for p in task]
        assert len(set(ids)) == len(ids), f"{name}: duplicate ids"
        assert all(i.startswith(f"{name}/") for i in ids)
        assert [p.index for p in task] == list(range(len(task)))
        assert all(p.task == name for p in task)
        assert task.prompt_version == PROMPT_VERSIONS[name]
        assert task.source.startswith("generated:" if name in ("arith", "multi") else f"local:{DATA}")
    assert tasks["gsm8k"][7].id == "gsm8k/0007"
    assert tasks["math500"][0].id == "math500/test/precalculus/807.json"
    assert tasks["mbpp"][0].id == "mbpp/11"
    assert tasks["mbpp"].metric == "pass@1" and tasks["gsm8k"].metric == "accuracy"


def test_prompt_hashes_are_pinned_to_versions(tasks):
    for task in tasks.values():
        assert _prompt_hash(task) == PROMPT_SHA256[task.prompt_version], (
            f"{task.name}: prompts changed; bump PROMPT_VERSION and pin the new hash"
        )


def test_math_prompts_and_golds(tasks):
    q = "Tom has 3 apples. How many?"
    assert gsm8k.build_prompt(q + "\n") == (
        "Tom has 3 apples. How many?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    for p in tasks["gsm8k"]:
        assert p.prompt == gsm8k.build_prompt(p.raw["question"])
        assert p.prompt.endswith("within \\boxed{}.")
        assert "," not in p.answer and float(p.answer) == float(p.raw["answer"].split("####")[-1].replace(",", ""))
    assert tasks["gsm8k"][0].answer == "18"
    for p in tasks["math500"]:
        assert p.prompt == f"{p.raw['problem'].strip()}\n{math500.INSTRUCTION}"
        assert p.answer == p.raw["answer"].strip() and p.answer
    with pytest.raises(TDLMError, match="####"):
        gsm8k.gold_answer("no marker here")
    assert gsm8k.gold_answer("blah\n#### 1,234") == "1234"


def test_mbpp_prompt_shows_first_test_and_asks_for_a_code_block(tasks):
    first = tasks["mbpp"][0]
    assert first.prompt == (
        "You are an expert Python programmer, and here is your task: Write a python function to remove first and "
        "last occurrence of a given character from the string.\nYour code should pass this test:\n\n"
        'assert remove_Occ("hello","l") == "heo"\n\n'
        "Answer with a single ```python code block that contains the complete solution."
    )
    for p in tasks["mbpp"]:
        assert p.tests == tuple(p.raw["test_list"]) and len(p.tests) >= 3
        assert p.tests[0] in p.prompt and all(t not in p.prompt for t in p.tests[1:])
        assert p.answer == p.raw["code"]
        assert p.test_imports == tuple(p.raw["test_imports"])
    assert sum(bool(p.test_imports) for p in tasks["mbpp"]) == 13


def test_limit_keeps_prefix_and_ids(tasks):
    small = load_task("math500", data_dir=DATA, limit=7)
    assert [p.id for p in small] == [p.id for p in tasks["math500"]][:7]
    assert len(load_task("mbpp", data_dir=DATA, limit=0)) == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(TDLMError, match="limit"):
            load_task("mbpp", data_dir=DATA, limit=bad)


def test_unknown_task_name():
    with pytest.raises(TDLMError, match="unknown name 'gsm9k'.*gsm8k"):
        load_task("gsm9k", data_dir=DATA)


def test_missing_file_names_file_and_count(tmp_path):
    with pytest.raises(TDLMError) as e:
        load_task("gsm8k", data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "gsm8k_test.jsonl") in msg and "1319" in msg and "\n" not in msg


def test_wrong_count_and_missing_field(tmp_path):
    lines = (DATA / "math500_test.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "math500_test.jsonl").write_text("".join(lines[:499]))
    with pytest.raises(TDLMError, match=r"math500_test.jsonl: 499 records, expected 500"):
        load_task("math500", data_dir=tmp_path)
    recs = [json.loads(x) for x in lines]
    del recs[3]["answer"]
    (tmp_path / "math500_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(TDLMError, match=r"record 3 lacks field\(s\) \['answer'\]"):
        load_task("math500", data_dir=tmp_path)
    (tmp_path / "math500_test.jsonl").write_text("{not json\n")
    with pytest.raises(TDLMError, match="not valid JSON Lines"):
        load_task("math500", data_dir=tmp_path)


def test_env_data_dir_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv(base.DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(TDLMError, match=str(tmp_path / "mbpp_sanitized_test.jsonl")):
        load_task("mbpp")
    monkeypatch.setenv(base.DATA_DIR_ENV, str(DATA))
    assert len(load_task("mbpp")) == 257


def _no_hub(*_a, **_k):
    raise AssertionError("the Hub must not be tried")


def test_offline_goes_straight_to_local(monkeypatch):
    monkeypatch.delenv(base.DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(base, "hub_reachable", _no_hub)
    monkeypatch.setattr(base, "load_hub", _no_hub)
    monkeypatch.setattr(base, "default_data_dir", lambda: DATA)
    assert load_task("gsm8k", limit=3).source.startswith("local:")


def test_hub_failure_falls_back_to_local(monkeypatch):
    monkeypatch.delenv(base.DATA_DIR_ENV, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(base, "hub_reachable", lambda: True)
    monkeypatch.setattr(base, "default_data_dir", lambda: DATA)

    def broken(spec):
        raise ConnectionError("simulated outage")

    monkeypatch.setattr(base, "load_hub", broken)
    assert load_task("mbpp").source.startswith("local:")

    fake = [json.loads(x) for x in (DATA / "mbpp_sanitized_test.jsonl").read_text().splitlines()]
    monkeypatch.setattr(base, "load_hub", lambda spec: (fake, "hub:google-research-datasets/mbpp/sanitized/test"))
    task = load_task("mbpp")
    assert task.source.startswith("hub:") and task[0].id == "mbpp/11"

    monkeypatch.setattr(base, "hub_reachable", lambda: False)
    monkeypatch.setattr(base, "load_hub", _no_hub)
    monkeypatch.setattr(base, "default_data_dir", lambda: Path("/nonexistent-tdlm-data"))
    with pytest.raises(TDLMError, match="TDLM_DATA_DIR"):
        load_task("mbpp")


def test_hub_probe_fails_fast(monkeypatch):
    import time

    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens, refused at once
    t0 = time.monotonic()
    assert base.hub_reachable(timeout_s=2.0) is False
    assert time.monotonic() - t0 < 2.5


def test_hub_specs_match_the_brief():
    assert (gsm8k.SPEC.hub_path, gsm8k.SPEC.hub_config, gsm8k.SPEC.hub_split) == ("openai/gsm8k", "main", "test")
    assert (math500.SPEC.hub_path, math500.SPEC.hub_split) == ("HuggingFaceH4/MATH-500", "test")
    assert (mbpp.SPEC.hub_path, mbpp.SPEC.hub_config) == ("google-research-datasets/mbpp", "sanitized")
