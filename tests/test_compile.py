"""Compiled decoding (issue 21, item 2): every step kind is one fullgraph graph, a decode recompiles a bounded
number of times, compiled tokens / NFE equal eager ones, logits within 1e-5 relative, and a compile setting that
cannot work is a one-line error.

Inductor takes about a minute per graph on this CPU, so the graph-structure tests use dynamo's ``aot_eager``
backend (the same fullgraph trace, guards and functionalised in-place cache writes, without code generation)
and one test runs inductor for the numerics.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import tdlm
from tdlm.decoding import decode
from tdlm.decoding.loop import check_compile, compiled_steps
from tdlm.temporal.model import StepGroup
from tests.conftest import live_tdlm, sharp_backbone

PROMPTS = [[3, 4, 40, 41, 42, 43, 44], [3, 4, 60, 61]]  # left-padded batch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _key(results):
    return [(r.tokens, r.nfe, r.reveal_step) for r in results]


KINDS = [("tiny-llada", "threshold", None), ("tiny-dream", "tdlm", "last:2"), ("tiny-dream", "threshold", None)]


@pytest.mark.parametrize("name,policy,history", KINDS)
def test_every_step_kind_compiles_fullgraph_and_decodes_like_eager(name, policy, history):
    """Uncached, refresh, prefix window and dual window steps (batch 1, two blocks) of the backbone and of TDLM
    compile with fullgraph=True (a graph break is an error) and decode eager's tokens, NFE and reveal steps.
    LLaDA's TDLM steps are the 256-token test's; Dream's backbone runs the dual cache only (its prefix and
    uncached kinds run inside Dream's TDLM steps)."""
    bb = sharp_backbone(name)
    model = live_tdlm(bb, history=history) if policy == "tdlm" else bb
    caches = ["dual"] if name == "tiny-dream" and policy == "threshold" else ["none", "prefix", "dual"]
    for cache in caches:
        kw = dict(policy=policy, cache=cache, gen_length=16, block_size=8, threshold=0.6)
        assert _key(decode(model, [PROMPTS[0]], compile="eager", **kw)) == _key(decode(model, [PROMPTS[0]], **kw))
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert _graphs() >= len(caches)


def test_a_padded_batch_with_split_refreshes_compiles_and_decodes_like_eager():
    """Rows of a left-padded batch refresh at different evaluations (a refresh of some rows next to a window
    step of the others) and leave the batch apart (the batch size becomes dynamic): still fullgraph graphs,
    eager's results, and at most 2 graphs per kind (refresh, window, their row-split forms, the in-place
    refresh)."""
    bb = sharp_backbone("tiny-llada")
    model = live_tdlm(bb, history="last:2")
    kw = dict(policy="tdlm", cache="dual", gen_length=32, block_size=8, threshold=0.6)
    eager = decode(model, PROMPTS, **kw)
    assert len({r.nfe for r in eager}) == 2, "the rows should finish apart"
    t0 = time.perf_counter()
    compiled = decode(model, PROMPTS, compile="eager", **kw)
    wall = time.perf_counter() - t0
    assert _key(compiled) == _key(eager)
    assert counters["graph_break"] == {} and _graphs() <= 2 * 5
    # seconds exclude the evaluations that compiled a graph (most of this first decode's wall time)
    assert 0 < max(r.seconds for r in compiled) < wall / 2, ([r.seconds for r in compiled], wall)


@pytest.mark.parametrize("cache,bound", [("none", 1), ("prefix", 4), ("dual", 3)])
def test_a_256_token_decode_recompiles_a_fixed_number_of_times(cache, bound, monkeypatch):
    """Batch 1, 256 tokens in blocks of 32 (8 blocks): the graphs stay within the bound of decode's docstring
    (uncached 1; dual: refresh, window, in-place refresh = 3; prefix: + the window once more with a dynamic
    width = 4), not growing with steps, blocks or the history's storage buckets (8, 16, 32 ... slots: the slot
    count is marked dynamic, so every bucket runs the same graph); tokens equal eager's; a second decode compiles
    nothing."""
    from tdlm.temporal.history import TemporalCache

    bb = sharp_backbone("tiny-llada")
    model = live_tdlm(bb, history="full")
    kw = dict(policy="tdlm", cache=cache, gen_length=256, block_size=32, threshold=0.6)
    eager = decode(model, [[3, 4, 40, 41, 42]], **kw)
    assert eager[0].nfe > 256 // 32, "too few evaluations to show the bound"
    capacities, reserve = set(), TemporalCache.reserve

    def recording(self, evaluations):
        reserve(self, evaluations)
        capacities.add(self.capacity)

    monkeypatch.setattr(TemporalCache, "reserve", recording)
    assert _key(decode(model, [[3, 4, 40, 41, 42]], compile="eager", **kw)) == _key(eager)
    assert len(capacities) >= 2 and min(capacities) == 8, capacities  # the storage grew through buckets
    first = _graphs()
    assert 1 <= first <= bound, first
    decode(model, [[3, 4, 50, 51, 52]], compile="eager", **kw)
    assert _graphs() == first, "a second decode of the same shapes recompiled"


def test_inductor_step_matches_eager_logits_and_tokens():
    """One inductor graph (TDLM, uncached, batch 1): logits of four consecutive evaluations within 1e-5 relative
    of eager with the same preallocated history, then a whole decode with the same graph gives eager's tokens."""
    bb = tdlm.load_backbone("tiny-llada")
    model = live_tdlm(bb, history="full")
    P, G, bs = 5, 32, 8
    _, evaluate = compiled_steps("inductor", None)
    with torch.inference_mode():  # decode makes its tensors under inference mode too (a guard on it)
        x = torch.randint(8, bb.vocab_size, (1, P + G), generator=torch.Generator().manual_seed(0))
        x[:, P:] = bb.mask_token_id
        positions = (P + torch.arange(bs))[None]
        caches = [model.new_cache(1, length=G), model.new_cache(1, length=G)]
        for step in range(4):
            x[:, P + step] = 9  # reveal one position per evaluation, as decoding does
            outs = [model.forward_groups(P, c, [StepGroup(x, None, positions)], evaluate=e)[0]
                    for c, e in zip(caches, (None, evaluate), strict=True)]  # fmt: skip
            rel = ((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item()
            assert rel <= 1e-5, (step, rel)
        assert torch.equal(caches[0].count, caches[1].count)
    graphs = _graphs()
    kw = dict(policy="tdlm", gen_length=G, block_size=bs, threshold=0.6)
    prompt = x[0, :P].tolist()
    assert _key(decode(model, [prompt], compile=True, **kw)) == _key(decode(model, [prompt], **kw))
    assert _graphs() == graphs == 1, "decode did not reuse the graph of the same step kind"


def test_compile_settings_that_cannot_work_are_one_line_errors(monkeypatch):
    bb = tdlm.load_backbone("tiny-llada")
    with pytest.raises(tdlm.TDLMError, match=r"compile='fast' unknown; expected one of False, True, 'default'"):
        decode(bb, [[3, 4]], compile="fast", gen_length=8, block_size=8)
    with pytest.raises(tdlm.TDLMError, match=r"compile='reduce-overhead' captures CUDA graphs and needs a CUDA "
                                             r"device, not cpu; use compile=True"):  # fmt: skip
        decode(bb, [[3, 4]], compile="reduce-overhead", gen_length=8, block_size=8)
    monkeypatch.setattr(torch._dynamo, "list_backends", lambda exclude_tags=(): ["eager"])
    with pytest.raises(tdlm.TDLMError, match=r"compile=True: torch .* has no 'inductor' backend; use compile=False"):
        decode(bb, [[3, 4]], compile=True, gen_length=8, block_size=8)
    monkeypatch.undo()

    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    import torch._inductor.cpp_builder as cpp_builder

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(tdlm.TDLMError, match=r"compile=True: inductor on cpu needs a C\+\+ compiler .*compile=False"):
        decode(bb, [[3, 4]], compile=True, gen_length=8, block_size=8)
    assert check_compile(False, "cpu") is None and check_compile("false") is None
    latent = tdlm.TDLM(bb, tdlm.TemporalConfig(history="latent:2"))
    with pytest.raises(tdlm.TDLMError, match=r"does not cover history latent:2.*compile=False"):
        decode(latent, [[3, 4]], policy="tdlm", compile="aot_eager", gen_length=8, block_size=8)


def test_compile_is_not_part_of_the_decode_identity():
    cfg = tdlm.DecodeConfig(compile=True)
    assert "compile" not in cfg.validate().to_dict()
