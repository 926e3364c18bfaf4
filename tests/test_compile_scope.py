"""Regional compilation (``DecodeConfig.compile_scope="block"``): the layer loop stays eager and the transformer block's
attention and feed-forward and the temporal layer's step are each compiled once and reused by every layer.

Checked here: block scope decodes eager's tokens, NFE and reveal steps (LLaDA and Dream, threshold and tdlm, no cache
and the dual cache, a left-padded batch whose rows refresh apart); its number of compiled graphs does not depend on the
number of layers; the CUDA-graph modes and unknown scopes are refused in one line at every entry point; and the setting
reaches the DecodeConfig an evaluation worker decodes with and the one a generation replica builds.

Dynamo's ``eager`` backend (the same fullgraph trace and guards without code generation, so the same kernels as eager
decoding, bit for bit) keeps these fast; one test runs ``aot_eager``, which functionalises the regions' in-place writes
into the spatial KV cache's tensors (the path inductor compiles).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tdlm.decoding import DecodeConfig, decode
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError
from tdlm.models.loading import PRESETS, random_backbone
from tdlm.temporal.model import TDLM, TemporalConfig
from tests.conftest import live_tdlm, sharp_backbone

PROMPTS = [[3, 4, 40, 41, 42, 43, 44], [3, 4, 60, 61]]  # left-padded batch


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread):
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _key(results):
    return [(r.tokens, r.nfe, r.reveal_step) for r in results]


CASES = [(name, policy, cache) for name in ("tiny-llada", "tiny-dream") for policy in ("threshold", "tdlm")
         for cache in ("none", "dual")]  # fmt: skip


@pytest.mark.parametrize("name,policy,cache", CASES)
def test_block_scope_decodes_eager_tokens_nfe_and_reveal_steps(name, policy, cache):
    """A padded batch of two rows, 4 blocks of 8, tau 0.95 (so blocks take several evaluations and, with the dual
    cache, window steps follow each refresh): block scope's results equal eager decoding's, every region traced
    fullgraph (a graph break would be an error); the backbone's layers ran the regions during the decode and run its
    own methods again afterwards."""
    bb = sharp_backbone(name)
    model = live_tdlm(bb, history="full" if name == "tiny-llada" else "last:2") if policy == "tdlm" else bb
    kw = dict(policy=policy, cache=cache, gen_length=32, block_size=8, threshold=0.95)
    eager = decode(model, PROMPTS, **kw)
    assert max(r.nfe for r in eager) > 32 // 8, "every block was finished by one evaluation: no window step"
    during = []  # the backbone's regions while the decode runs (on_result is called inside it)
    block = decode(model, PROMPTS, compile="eager", compile_scope="block",
                   on_result=lambda i, r: during.append(bb.block_regions), **kw)  # fmt: skip
    assert _key(block) == _key(eager)
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert _graphs() >= 2  # at least the attention and the feed-forward regions
    assert len(during) == 2 and all(r is not None and r.attend is not None for r in during), during
    assert bb.block_regions is None


def test_block_scope_under_aot_eager_keeps_the_spatial_kv_cache_it_writes():
    """aot_eager functionalises the regions' in-place writes into the layer's cache tensors (a refresh's copy, a
    window's scatter) and copies them back: a write that stayed inside the graph would leave the next window step
    reading stale keys, and the tokens would differ from eager's."""
    bb = sharp_backbone("tiny-llada")
    kw = dict(policy="threshold", cache="dual", gen_length=32, block_size=8, threshold=0.95)
    block = decode(bb, PROMPTS, compile="aot_eager", compile_scope="block", **kw)
    assert _key(block) == _key(decode(bb, PROMPTS, **kw))
    assert counters["graph_break"] == {}, dict(counters["graph_break"])


def _deep(n_layers: int) -> TDLM:
    """tiny-llada's shape at ``n_layers`` layers (seeded random weights), a temporal layer at every layer."""
    config = {**PRESETS["tiny-llada"]["config"], "n_layers": n_layers}
    config.pop("tdlm_temporal_default")
    bb = random_backbone("llada", config, seed=0, backbone_id=f"tiny-llada-{n_layers}")
    return TDLM(bb, TemporalConfig(layers="all", heads=2, head_dim=16, history="full")).eval()


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_block_scope_graph_count_does_not_grow_with_depth(cache):
    """The same decode (batch 1, tau 1: one token per evaluation, so both depths run the same step kinds in the same
    order) compiles the same number of graphs at 2 and at 4 layers, within a bound that is per region and step kind:
    attention, feed-forward and temporal step x (uncached or refresh, window) and the shape changes dynamo then
    makes dynamic. A region compiled per layer would double the count."""
    counts = []
    for n in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        results = decode(_deep(n), [PROMPTS[0]], policy="tdlm", cache=cache, gen_length=16, block_size=8,
                         threshold=1.0, compile="eager", compile_scope="block")  # fmt: skip
        assert results[0].nfe == 16
        assert counters["graph_break"] == {}, dict(counters["graph_break"])
        counts.append(_graphs())
    assert counts[0] == counts[1], f"graphs at 2 and 4 layers: {counts}"
    assert 3 <= counts[1] <= 12, counts


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_block_scope_refuses_cuda_graph_modes_in_one_line(mode):
    """CUDA graphs need the model scope: one line naming the fix, from DecodeConfig and from decode() before
    anything runs (on this CPU the device check would otherwise speak first)."""
    with pytest.raises(TDLMError) as e:
        DecodeConfig(compile=mode, compile_scope="block").validate()
    msg = str(e.value)
    assert "\n" not in msg and "compile_scope='model'" in msg and repr(mode) in msg, msg
    with pytest.raises(TDLMError, match="compile_scope='model'"):
        decode(sharp_backbone("tiny-llada"), [PROMPTS[0]], gen_length=8, block_size=8, compile=mode,
               compile_scope="block")  # fmt: skip
    DecodeConfig(compile=mode, compile_scope="model", storage="static").validate()  # the model scope takes them
    DecodeConfig(compile="max-autotune-no-cudagraphs", compile_scope="block").validate()


def test_an_unknown_scope_is_one_line_at_every_entry_point(tmp_path):
    """DecodeConfig, the evaluator, the generator and the harness refuse ``compile_scope='blocks'`` (and block with
    reduce-overhead) in one line naming the field; a bad compile= keeps its own line."""
    from tdlm.evaluation import EvalConfig
    from tdlm.generation import GenerationConfig
    from tdlm.harness.model import parse_model_args

    with pytest.raises(TDLMError, match=r"^decode compile_scope 'blocks' unknown; expected one of model, block; did "
                                        r"you mean 'block'\?$"):  # fmt: skip
        DecodeConfig(compile_scope="blocks").validate()
    with pytest.raises(TDLMError, match=r"^compile='nope' unknown"):
        DecodeConfig(compile="nope", compile_scope="block").validate()
    ev = dict(backbone="tiny-llada", output_dir=str(tmp_path / "ev"), tasks=["gsm8k"], policies=["threshold"])
    gen = dict(backbone="tiny-llada", prompts="data/multi_prompts.jsonl", output_dir=str(tmp_path / "gen"))
    for scope, compile_ in (("blocks", False), ("block", "reduce-overhead")):
        errors = []
        builds = ((EvalConfig, ev), (GenerationConfig, gen))
        for cls, base in builds:
            with pytest.raises(TDLMError) as e:
                cls(**base, decode=DecodeSettings(compile_scope=scope, compile=compile_)).validate()
            errors.append(str(e.value))
        with pytest.raises(TDLMError) as e:
            parse_model_args({"pretrained": "tiny-llada", "compile_scope": scope, "compile": compile_})
        errors.append(str(e.value))
        assert all("\n" not in m and "compile_scope" in m for m in errors), errors
        # one check (DecodeSettings.validate) and so one message, the harness's naming its --model_args
        first = "decode compile_scope 'blocks' unknown" if scope == "blocks" else "compile='reduce-overhead' captures"
        assert errors[0].startswith(first) and errors[1] == errors[0], errors
        assert errors[2] == f"--model_args: {errors[0]}", errors[2]


def test_compile_scope_reaches_the_config_an_evaluation_worker_decodes_with(tmp_path, monkeypatch):
    """``compile_scope`` travels outside DecodeConfig.to_dict (the run's identity) as ``compile`` and ``storage`` do:
    checked on the DecodeConfig the worker hands to decode, for every decode (warm-up included), and the worker's
    decodes run block scope for real (eager backend)."""
    import tdlm.evaluation.worker as worker_mod
    from tdlm.evaluation import EvalConfig
    from tdlm.evaluation.driver import plan_runs, run_in_process, shard_jobs
    from tdlm.tasks.base import default_data_dir

    if not (default_data_dir() / "gsm8k_test.jsonl").exists():
        pytest.skip(f"benchmarks not in {default_data_dir()}")
    seen, real = [], worker_mod.decode

    def spy(model, prompts, config, **kw):
        seen.append((config.compile_scope, config.compile))
        return real(model, prompts, config, **kw)

    monkeypatch.setattr(worker_mod, "decode", spy)
    section = DecodeSettings(gen_length=16, block_size=8, batch_size=2, compile="eager", compile_scope="block")
    cfg = EvalConfig(backbone="tiny-llada", output_dir=str(tmp_path), tasks=["gsm8k"], policies=["threshold"],
                     limit=2, workers=1, threads=1, warmup=1, score_workers=1, wandb_mode="disabled",
                     decode=section).validate()  # fmt: skip
    plans = plan_runs(cfg)
    assert "compile_scope" not in str(plans[0].identity)
    jobs, _ = shard_jobs(cfg, plans, 1)
    assert {j.settings.compile_scope for j in jobs} == {"block"}
    run_in_process(cfg, jobs)
    assert seen == [("block", "eager")] * 2  # the warm-up and the timed decode
    assert _graphs() >= 2  # the regions compiled inside the worker


def test_compile_scope_reaches_a_generation_replica_and_the_harness():
    """The replica decodes with the section the driver sends (tdlm.generation.driver.worker_spec); the manifest's
    identity leaves the scope out; the harness puts its model_args value into its section (every field, every
    driver: tests/test_decode_settings.py)."""
    from tdlm.generation import GenerationConfig
    from tdlm.generation.cli import parse_args
    from tdlm.generation.driver import worker_spec
    from tdlm.harness.model import parse_model_args

    cfg = GenerationConfig(backbone="tiny-llada", prompts="data/multi_prompts.jsonl", output_dir="unused",
                           decode=DecodeSettings(compile="eager", compile_scope="block")).validate()  # fmt: skip
    spec = worker_spec(cfg, gpu=False)
    assert spec.decode is cfg.decode and spec.decode.compile_scope == "block"
    assert "compile_scope" not in cfg.identity([], None, None)["decode"]
    assert cfg.run_settings()["compile_scope"] == "block"
    flags = parse_args(["--backbone", "tiny-llada", "--prompts", "p.jsonl", "--output-dir", "o", "--compile-scope",
                        "block"])  # fmt: skip
    assert flags.decode.compile_scope == "block"
    harness = parse_model_args({"pretrained": "tiny-llada", "compile": "eager", "compile_scope": "block"})
    assert harness.decode.compile_scope == "block"


def test_the_scope_is_not_part_of_a_decodes_identity():
    """Block scope decodes eager's tokens: a run decoded with either scope resumes the other's."""
    a, b = DecodeConfig(compile_scope="block").validate(), DecodeConfig().validate()
    assert a.to_dict() == b.to_dict() and "compile_scope" not in a.to_dict()
    assert a.run_settings()["compile_scope"] == "block" and b.run_settings()["compile_scope"] == "model"

