"""lm-evaluation-harness: the registered ``tdlm`` model on the shipped tiny-arith backbone with a TDLM adapter, and
the shipped offline task files. The harness's numbers must be tdlm's own: the same generations, scores and NFE as
``tdlm.decode`` on the same prompts."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import tdlm
import tdlm.hub
from tdlm.evaluation.scoring import score
from tdlm.tasks import load_task
from tests.conftest import randomize_temporal

REPO = Path(__file__).resolve().parents[1]
ARGS = "pretrained=tiny-arith,policy=tdlm,threshold=0.9,gen_length=40,block_size=40,dtype=float32"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    bb = tdlm.load_backbone("tiny-arith", dtype="float32")
    model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="dispersed:3", heads=2, head_dim=32))
    randomize_temporal(model, seed=5)  # a nonzero adapter: tdlm decoding differs from threshold
    return tdlm.hub.save_pretrained(model, tmp_path_factory.mktemp("adapter") / "ad")


def _reference(adapter: Path, n: int) -> tuple[list, list]:
    """tdlm's own decoding of the first n held-out problems, through the chat template, one request at a time."""
    bb = tdlm.load_backbone("tiny-arith", dtype="float32")
    model = tdlm.TDLM.from_pretrained(bb, adapter)
    tok = tdlm.data.tokenizer.load_tokenizer("tiny-arith")
    problems = list(load_task("arith", limit=n))
    ids = tdlm.data.tokenizer.encode_prompts(tok, [p.prompt for p in problems])
    res = [tdlm.decode(model, [i], policy="tdlm", threshold=0.9, gen_length=40, block_size=40, tokenizer=tok,
                       stop_ids=tdlm.data.tokenizer.stop_token_ids(tok, bb.eos_token_id))[0] for i in ids]
    return problems, res


def test_harness_serves_generate_until_through_tdlm_decode(adapter, one_thread):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import tdlm.harness

    n = 7
    out = lm_eval.simple_evaluate(model="tdlm", model_args=f"{ARGS},adapter={adapter}", tasks=["tdlm_arith"],
                                  limit=n, batch_size=3, log_samples=True,
                                  task_manager=TaskManager(include_path=tdlm.harness.TASKS_DIR))
    problems, ref = _reference(adapter, n)
    samples = sorted(out["samples"]["tdlm_arith"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == [r.text for r in ref]  # batched (3) == per request
    correct = [score(p, r.text).correct for p, r in zip(problems, ref, strict=True)]
    assert out["results"]["tdlm_arith"]["acc,none"] == pytest.approx(sum(correct) / n)
    stats = out["config"]["tdlm"]["decode_stats"]["tdlm_arith"]
    assert stats["requests"] == n
    assert stats["nfe_mean"] == pytest.approx(sum(r.nfe for r in ref) / n)
    assert out["config"]["tdlm"]["policy"] == "tdlm" and out["config"]["tdlm"]["adapter"] == str(adapter)
    # NFE is a metric of the task: its mean equals tdlm's own count, with a standard error, per request
    nfe = [r.nfe for r in ref]
    assert out["results"]["tdlm_arith"]["nfe,none"] == pytest.approx(sum(nfe) / n)
    assert out["results"]["tdlm_arith"]["nfe_stderr,none"] == pytest.approx(statistics.stdev(nfe) / n ** 0.5)
    assert [s["nfe"] for s in samples] == nfe
    assert out["config"]["tdlm"]["device"] == "cpu"


def test_chat_template_stop_sequences_and_refusals(adapter, one_thread):
    from lm_eval.api.instance import Instance

    from tdlm.harness import TDLMHarnessLM

    lm = TDLMHarnessLM(pretrained="tiny-arith", adapter=str(adapter), gen_length=40, block_size=40, dtype="float32",
                       batch_size=2)
    problems, ref = _reference(adapter, 2)

    def req(ctx: str, **kw) -> Instance:
        return Instance("generate_until", doc={}, arguments=(ctx, {"until": [], **kw}), idx=0,
                        metadata=("probe", 0, 1))

    # chat=true (default): a raw context goes through the template as one user message
    assert lm.generate_until([req(p.prompt) for p in problems]) == [r.text for r in ref]
    # --apply_chat_template: the harness renders the conversation; the rendered text is not templated twice
    lm2 = TDLMHarnessLM(backbone="tiny-arith", adapter=str(adapter), gen_length=40, block_size=40, dtype="float32")
    rendered = lm2.apply_chat_template([{"role": "user", "content": problems[0].prompt}])
    assert rendered.startswith("<|bos|><|user|>") and rendered.endswith("<|assistant|>")
    assert lm2.generate_until([req(rendered)]) == [ref[0].text]
    # stop sequences cut the text at the first of them
    assert "=" in ref[0].text
    assert lm.generate_until([req(problems[0].prompt, until=["=", "zzz"])]) == [ref[0].text.split("=", 1)[0]]
    with pytest.raises(tdlm.TDLMError, match="decodes greedily"):
        lm.generate_until([req("1+1=?", do_sample=True, temperature=0.7)])
    with pytest.raises(tdlm.TDLMError, match="generate_until tasks only"):
        lm.loglikelihood([Instance("loglikelihood", doc={}, arguments=("1+1=", "2"), idx=0)])
    with pytest.raises(tdlm.TDLMError, match=r"--model_args: unknown key 'layers'"):
        TDLMHarnessLM(backbone="tiny-arith", layers="all")
    with pytest.raises(tdlm.TDLMError, match="policy=tdlm needs adapter="):
        TDLMHarnessLM(backbone="tiny-arith", policy="tdlm")
    with pytest.raises(tdlm.TDLMError, match="no 'auto'"):
        TDLMHarnessLM(backbone="tiny-arith", batch_size="auto")


def test_storage_reaches_the_decode_and_an_adapters_latent_history_is_refused_before_loading(adapter, one_thread,
                                                                                                 monkeypatch, tmp_path):
    """``storage=`` reaches the DecodeConfig every decode call gets (static decodes dynamic's tokens); with
    ``history`` unset, static against an adapter trained with latent:M is refused from its config file before the
    backbone is loaded."""
    from lm_eval.api.instance import Instance

    import tdlm.decoding
    import tdlm.models.loading
    from tdlm.harness import TDLMHarnessLM
    from tdlm.temporal.adapter_files import ADAPTER_CONFIG

    problems, ref = _reference(adapter, 2)
    seen, real = [], tdlm.decoding.decode

    def spy(model, prompts, config, **kw):
        seen.append((config.storage, config.compile, len(prompts)))
        return real(model, prompts, config, **kw)

    monkeypatch.setattr(tdlm.decoding, "decode", spy)
    lm = TDLMHarnessLM(pretrained="tiny-arith", adapter=str(adapter), gen_length=40, block_size=40, dtype="float32",
                       storage="static", batch_size=2)
    reqs = [Instance("generate_until", doc={}, arguments=(p.prompt, {"until": []}), idx=0, metadata=("probe", 0, 1))
            for p in problems]  # fmt: skip
    assert lm.generate_until(reqs) == [r.text for r in ref] and seen == [("static", False, 2)]

    lat = tmp_path / "lat"
    lat.mkdir()
    (lat / ADAPTER_CONFIG).write_text(json.dumps({"history": "latent:2"}))

    def loaded(*a, **k):
        raise AssertionError("the backbone was loaded")

    monkeypatch.setattr(tdlm.models.loading, "load_backbone", loaded)
    with pytest.raises(tdlm.TDLMError, match=rf"^--model_args adapter={lat}: decode.history: storage='static' does not "
                                             r"cover history latent:2: .*use storage='dynamic'$"):  # fmt: skip
        TDLMHarnessLM(pretrained="tiny-arith", adapter=str(lat), storage="static")
    with pytest.raises(AssertionError, match="the backbone was loaded"):  # dynamic: on to the loading
        TDLMHarnessLM(pretrained="tiny-arith", adapter=str(lat))


def test_shipped_tasks_read_the_local_benchmark_copies(monkeypatch):
    from tdlm.harness.tasks import utils

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TDLM_DATA_DIR", raising=False)
    sizes = {"gsm8k": 1319, "math500": 500, "mbpp": 257, "arith": 500, "multi": 500}
    for name, n in sizes.items():
        ds = getattr(utils, name)(backbone="ignored", version=1.0)["test"]  # the harness passes metadata along
        assert len(ds) == n, name
        assert ds[0]["prompt"] == load_task(name)[0].prompt
    doc = utils.gsm8k()["test"][0]
    assert utils.process_results(doc, [f"... so the answer is \\boxed{{{doc['answer']}}}"]) == {"acc": 1.0}
    assert utils.process_results(doc, ["\\boxed{-1}"]) == {"acc": 0.0}
    for path in sorted((REPO / "tdlm" / "harness" / "tasks").glob("*.yaml")):
        text = path.read_text()
        assert "custom_dataset: !function utils." in text and "dataset_path" not in text, path.name


@pytest.mark.slow
def test_python_m_tdlm_harness_cli(adapter, tmp_path):
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ARGS.replace("pretrained=", "backbone=")  # the alias: still a folder named after the backbone
    proc = subprocess.run([sys.executable, "-m", "tdlm.harness", "--model", "tdlm", "--model_args",
                           f"{args},adapter={adapter}", "--tasks", "tdlm_arith", "--limit", "4", "--batch_size", "2",
                           "--output_path", str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (result,) = list((tmp_path / "out").glob("*/results_*.json"))
    assert result.parent.name == "tiny-arith"
    data = json.loads(result.read_text())
    assert data["results"]["tdlm_arith"]["sample_len"] == 4
    assert data["results"]["tdlm_arith"]["nfe,none"] > 0 and "nfe_stderr,none" in data["results"]["tdlm_arith"]
    assert data["config"]["device"] == "cpu" and data["config"]["tdlm"]["device"] == "cpu"
    assert any("|nfe" in line.replace(" ", "") for line in proc.stdout.splitlines()), proc.stdout[-2000:]
    assert data["config"]["tdlm"]["decode_stats"]["tdlm_arith"]["requests"] == 4
    assert "mean NFE" in proc.stderr + proc.stdout


@pytest.mark.parametrize("argv,pattern", [
    (["--model_args", "pretrained=tiny-arith,threshlod=0.9"], r"unknown key 'threshlod'; did you mean 'threshold'\?"),
    # the decode section's one check (DecodeSettings.validate), named after --model_args
    (["--model_args", "pretrained=tiny-arith,threshold=1.5"],
     r"--model_args: decode threshold .* must be a confidence in \[0, 1\]; got 1.5$"),
    (["--model_args", "pretrained=tiny-arith,entropy_threshold=0"],
     r"--model_args: decode entropy_threshold \(H\) must be > 0; got 0(\.0)?$"),
    (["--model_args", "pretrained=tiny-arith,gen_length=0"], r"--model_args: gen_length and block_size must be >= 1"),
    (["--model_args", "policy=threshold"], r"pretrained=<backbone> is required"),
    (["--model_args", "pretrained=tiny-arith,backbone=tiny-arith"], r"give the backbone once"),
    (["--model_args", "pretrained=tiny-arith", "--limit", "-3"], r"--limit -3: expected a positive number"),
    (["--model_args", "pretrained=tiny-arith", "--limit=2.5"], r"--limit 2.5: expected a positive number"),
    (["--model_args", "pretrained=tiny-arith", "--limit", "many"], r"--limit 'many': expected a positive number"),
    # issue 30: these passed the pre-check and failed inside lm-eval (policy) or only at decode time
    (["--model_args", "pretrained=tiny-arith,policy=treshold"],
     r"--model_args: decode policy 'treshold' unknown; expected one of original, threshold, tdlm, entropy, credit, "
     r"soft; did you mean 'threshold'\?$"),
    (["--model_args", "pretrained=tiny-arith,cache=dul"],
     r"--model_args: decode cache 'dul' unknown; expected one of none, prefix, dual; did you mean 'dual'\?$"),
    (["--model_args", "pretrained=tiny-arith,policy=tdlm"], r"policy=tdlm needs adapter="),
    (["--model_args", "pretrained=tiny-arith,adapter=x,policy=original"], r"adapter= is used by policy=tdlm only"),
    (["--model_args", "pretrained=tiny-arith,history=last:0"],
     r"--model_args: decode.history: history policy 'last:0' not understood; expected 'full', 'current', 'last:k'"),
    (["--model_args", "pretrained=tiny-arith,gen_length=40,block_size=16"], r"^error: --model_args: .*block_size"),
    (["--model_args", "pretrained=tiny-arith,compile=fast"], r"^error: --model_args: .*compile"),
    (["--model_args", "pretrained=tiny-arith,storage=statc"],
     r"^error: --model_args: decode storage 'statc' unknown; expected one of dynamic, static; did you mean "
     r"'static'\?$"),
    (["--model_args", "pretrained=tiny-arith,compile=reduce-overhead,cache=dual"],
     r"^error: --model_args: compile='reduce-overhead' captures CUDA graphs, .*use storage='static' with it, or "
     r"compile=True$"),
    (["--model_args", "pretrained=tiny-arith,adapter=x,history=latent:2,storage=static"],
     r"^error: --model_args: decode.history: storage='static' does not cover history latent:2: .*use "
     r"storage='dynamic'$"),
    (["--model_args", "pretrained=no-such-backbone"], r"pretrained=no-such-backbone: unknown backbone"),
])
def test_cli_mistakes_are_one_line(argv, pattern, capsys, monkeypatch):
    import lm_eval.__main__

    from tdlm.harness.__main__ import main

    def started(*a, **k):
        raise AssertionError("lm-eval started before the command line was checked")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", started)

    rc = main(["--model", "tdlm", "--tasks", "tdlm_arith", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert __import__("re").search(pattern, lines[0]), lines[0]


def test_cli_unknown_task_is_one_line_with_nearest_before_lm_eval_indexes(capsys, monkeypatch):
    """Issue 30: an unknown task was reported after lm-eval had indexed its ~14,000 task files (53-444 s)."""
    import lm_eval.__main__
    import lm_eval.tasks

    from tdlm.harness.__main__ import main

    def indexed(*a, **k):
        raise AssertionError("lm-eval indexed its tasks (or started) before --tasks was checked")

    monkeypatch.setattr(lm_eval.tasks.TaskManager, "__init__", indexed)
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", indexed)
    for tasks, want in (("tdlm_arihm", "unknown task 'tdlm_arihm' (did you mean 'tdlm_arith'?)"),
                        ("tdlm_arith,gsm8k_cot_zeroshott", "unknown task 'gsm8k_cot_zeroshott' (did you mean "
                                                           "'gsm8k_cot_zeroshot'?)")):  # fmt: skip
        rc = main(["--model", "tdlm", "--model_args", "pretrained=tiny-arith", "--tasks", tasks, "--limit", "2"])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: --tasks: "), err[-2000:]
        assert want in lines[0], lines[0]


def test_task_names_are_read_from_the_task_files():
    """The line scan finds the shipped tasks and tags, lm-eval's tasks, groups and list-valued tags (the full list
    was compared with lm-eval's TaskManager by hand: see the issue 30 report)."""
    from pathlib import Path

    import lm_eval

    import tdlm.harness
    from tdlm.harness.__main__ import task_names

    shipped = task_names((tdlm.harness.TASKS_DIR,))
    assert {"tdlm_gsm8k", "tdlm_math500", "tdlm_mbpp", "tdlm_arith", "tdlm_multi", "tdlm_table1",
            "tdlm_tiny"} <= shipped
    known = task_names((str(Path(lm_eval.__file__).parent / "tasks"),))
    assert {"gsm8k", "gsm8k_cot_zeroshot", "mmlu", "hellaswag", "bbh_cot_fewshot_boolean_expressions"} <= known
    assert len(known) > 5000


def test_cli_rewrites_the_alias_and_records_the_real_device():
    from tdlm.harness.__main__ import prepare

    out = prepare(["--model", "tdlm", "--model_args", "backbone=tiny-arith,threshold=0.8", "--device", "cuda:0"])
    assert out[out.index("--model_args") + 1] == "pretrained=tiny-arith,threshold=0.8"
    assert out[out.index("--device") + 1] == ("cuda:0" if __import__("torch").cuda.is_available() else "cpu")
    out = prepare(["--model=tdlm", "--model_args=pretrained=tiny-arith"])
    assert out[-2:] == ["--device", "cuda" if __import__("torch").cuda.is_available() else "cpu"]
