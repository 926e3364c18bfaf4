"""The static storage plan of the temporal history (issue 41, ``storage="static"``, cache ``none``; the spatial KV
cache's and the buckets' tests: tests/test_static_buffers.py).

Every tensor of the history that a TDLM step writes (entries, validity, counts, columns) stays at one address for
the whole decode and across decodes of the same batch size, which is what inductor's CUDA-graph trees need to
replay a step that mutates it; and the static plan decodes what the dynamic one does: tokens, NFE and reveal steps
equal, logits within EXACT_TOL in float64.
"""

from __future__ import annotations

import pytest
import torch

from tdlm.decoding import decode, loop
from tdlm.decoding.loop import POLICIES, DecodeConfig
from tdlm.errors import TDLMError
from tdlm.temporal.model import TDLM
from tests.conftest import EXACT_DTYPE, EXACT_TOL, live_tdlm, sharp_backbone

# two left-padded batches of the same size (one bucket), different prompts and prompt lengths
PROMPTS_A = [[3, 5, 50, 51], [3, 4, 70, 71, 72, 73, 74, 75, 76]]
PROMPTS_B = [[3, 4, 40], [7, 8, 9, 10, 11]]
KW = dict(gen_length=16, block_size=8, threshold=0.9)
BACKBONES = ("tiny-llada", "tiny-dream")


@pytest.fixture(scope="module")
def backbones():
    return {name: sharp_backbone(name) for name in BACKBONES}


@pytest.fixture(scope="module")
def exact_backbones():
    """The backbones in float64, for the comparisons of the two plans' decisions (tests/conftest.py: EXACT_DTYPE)."""
    return {name: sharp_backbone(name, dtype=EXACT_DTYPE) for name in BACKBONES}


def _pointers(cache) -> dict[str, int]:
    out = {name: getattr(cache, name).data_ptr() for name in ("count", "valid", "cols")}
    out.update({f"layer {layer}": lh.kv.data_ptr() for layer, lh in cache.layers.items()})
    return out


def _record(monkeypatch) -> list[dict]:
    """Per evaluation of a TDLM decode: the history's data pointers before and after it, and its logits."""
    seen: list[dict] = []
    orig = TDLM.forward_groups

    def run(self, prompt_len, cache, groups, evaluate=None):
        before = _pointers(cache) if cache.layers else {}
        out = orig(self, prompt_len, cache, groups, evaluate)
        seen.append({"before": before, "after": _pointers(cache), "logits": [o.clone() for o in out]})
        return out

    monkeypatch.setattr(TDLM, "forward_groups", run)
    return seen


def _key(results):
    return [(r.tokens, r.nfe, r.reveal_step) for r in results]


@pytest.mark.parametrize("history", ["full", "last:2"])
@pytest.mark.parametrize("name", BACKBONES)
def test_the_history_stays_at_fixed_addresses_through_two_decodes_of_one_bucket(backbones, name, history,
                                                                                 monkeypatch):  # fmt: skip
    model = live_tdlm(backbones[name], history=history)
    seen = _record(monkeypatch)
    first = decode(model, PROMPTS_A, policy="tdlm", storage="static", **KW)
    n_first = len(seen)
    second = decode(model, PROMPTS_B, policy="tdlm", storage="static", **KW)
    assert n_first > 4 and len(seen) > n_first + 2  # several evaluations in each decode
    assert {r.nfe for r in first} != {1} and first[0].tokens != second[0].tokens  # two different decodes
    addresses = {k: {s[when][k] for s in seen for when in ("before", "after")} for k in seen[0]["after"]}
    moved = {k: len(v) for k, v in addresses.items() if len(v) != 1}
    assert not moved, f"history tensors that moved (distinct addresses): {moved}"
    assert len(model.static_histories.held) == 1  # one history for the bucket, reused
    (held,) = model.static_histories.held.values()  # its memory: the final bucket's, stated by the model
    assert held.nbytes() == model.temporal_cache_bytes(len(PROMPTS_A), KW["gen_length"], KW["gen_length"])
    # The recording sees a move when there is one: the dynamic plan grows its buckets and compacts its columns.
    seen.clear()
    decode(model, PROMPTS_A, policy="tdlm", **KW)
    assert any(len({s["after"][k] for s in seen}) > 1 for k in seen[0]["after"])


@pytest.mark.parametrize("history", ["full", "last:2"])
@pytest.mark.parametrize("name", BACKBONES)
def test_the_static_plan_decodes_what_the_dynamic_one_does(exact_backbones, name, history, monkeypatch):
    """Tokens, NFE and reveal steps equal for a padded batch whose rows finish at different evaluations (the
    static plan keeps a finished row in the batch, masked) and for one row; the TDLM logits of every row still
    decoding within EXACT_TOL (float64: tests/conftest.py says why)."""
    bb = exact_backbones[name]
    model = live_tdlm(bb, history=history)
    uneven = 0  # batches whose rows finished at different evaluations
    for policy, target in (("threshold", bb), ("tdlm", model)):
        for prompts in (PROMPTS_A, PROMPTS_B[1:]):
            seen = _record(monkeypatch)
            dynamic = decode(target, prompts, policy=policy, **KW)
            dyn_logits = [s["logits"][0] for s in seen]
            seen.clear()
            static = decode(target, prompts, policy=policy, storage="static", **KW)
            assert _key(static) == _key(dynamic), (policy, len(prompts))
            uneven += len({r.nfe for r in dynamic}) > 1
            assert [r.seconds > 0 for r in static] == [True] * len(prompts)
            if policy == "threshold":
                continue
            nfe = [r.nfe for r in dynamic]
            assert len(seen) == len(dyn_logits) == max(nfe)
            for i, (s, d) in enumerate(zip(seen, dyn_logits, strict=True)):
                live = [r for r in range(len(prompts)) if nfe[r] > i]  # the rows the dynamic plan still holds
                torch.testing.assert_close(s["logits"][0][live], d, rtol=EXACT_TOL, atol=EXACT_TOL)
    assert uneven == 2  # both batches (threshold, tdlm) kept a finished row while the other decoded


def test_storage_is_checked_in_one_line_and_is_not_part_of_the_decode_identity(backbones):
    with pytest.raises(TDLMError, match=r"^decode storage 'fixed' unknown; expected one of dynamic, static$"):
        DecodeConfig(storage="fixed").validate()
    DecodeConfig(storage="static", cache="dual", compile="reduce-overhead").validate()
    with pytest.raises(TDLMError, match=r"use storage='static' with it, or compile=True$"):
        DecodeConfig(storage="dynamic", cache="dual", compile="reduce-overhead").validate()
    assert "storage" not in DecodeConfig(storage="static").validate().to_dict()
    assert DecodeConfig(storage="static").to_dict() == DecodeConfig().to_dict()
    model = live_tdlm(backbones["tiny-llada"], history="latent:2")
    with pytest.raises(TDLMError, match=r"storage='static' does not cover history latent:2"):
        decode(model, PROMPTS_A, policy="tdlm", storage="static", **KW)


def test_a_compiled_static_decode_compiles_once_and_a_second_decode_of_the_bucket_compiles_nothing(backbones):
    """Dynamo's ``aot_eager`` (the fullgraph trace and guards of ``compile=True`` without code generation): the
    static plan's first decode compiles the uncached TDLM step, a second decode of the same batch size (other
    prompts of the same length) reuses it, and both decode eager's tokens, NFE and reveal steps."""
    from torch._dynamo.utils import counters

    model = live_tdlm(backbones["tiny-llada"], history="full")
    prompts = [[[3, 4, 40, 41, 42]], [[3, 9, 60, 61, 62]]]
    torch._dynamo.reset()
    counters.clear()
    try:
        graphs = []
        for p in prompts:
            compiled = decode(model, p, policy="tdlm", storage="static", compile="aot_eager", **KW)
            graphs.append(counters["stats"]["unique_graphs"])
            assert _key(compiled) == _key(decode(model, p, policy="tdlm", **KW))
        assert graphs == [1, 1], graphs  # one uncached step graph for the bucket, none more
        assert counters["graph_break"] == {}, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()


# every policy but tdlm, on a left-padded batch of three; the stop token (stop_at_eos) makes "original", which
# otherwise evaluates gen_length times in every row, finish its rows at different evaluations too
BASELINES = tuple(p for p in POLICIES if p != "tdlm")
PROMPTS_C = [[3, 4, 40, 41, 42, 43, 44, 45, 46], [3, 4, 60, 61], [3, 4, 70, 71, 72, 73, 74]]
STOP = {"tiny-llada": [91], "tiny-dream": [23]}


def _record_select(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per evaluation: the confidences and candidates the commit rule sees (after credit's fusion or soft's mixed
    inputs), i.e. what every row's reuse state has made of its logits."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    orig = loop._select

    def run(conf, cand, *args, **kwargs):
        seen.append((conf.clone(), cand.clone()))
        return orig(conf, cand, *args, **kwargs)

    monkeypatch.setattr(loop, "_select", run)
    return seen


@pytest.mark.parametrize("policy", BASELINES)
@pytest.mark.parametrize("name", BACKBONES)
def test_every_baseline_policy_decodes_under_the_static_plan_what_it_does_under_the_dynamic_one(
        exact_backbones, name, policy, monkeypatch):  # fmt: skip
    """Tokens, NFE and reveal steps equal (float64: tests/conftest.py says why), with and without a stop token, on a
    padded batch whose rows finish at different evaluations; at every evaluation the rows still decoding see the
    dynamic plan's confidences (credit's matrices and soft's mixed embeddings of a row are neither changed by a
    finished row kept in the batch nor read by it), and a finished row has no candidate left, so it commits nothing."""
    assert set(BASELINES) == {"original", "threshold", "entropy", "credit", "soft"}
    uneven = 0
    for stop in (None, STOP[name]):
        kw = dict(KW, threshold=0.6, policy=policy, stop_at_eos=stop is not None, stop_ids=stop)
        seen = _record_select(monkeypatch)
        dynamic = decode(exact_backbones[name], PROMPTS_C, **kw)
        dyn = list(seen)
        seen.clear()
        static = decode(exact_backbones[name], PROMPTS_C, storage="static", **kw)
        assert _key(static) == _key(dynamic), stop
        nfe = [r.nfe for r in dynamic]
        uneven += len(set(nfe)) > 1
        assert len(seen) == len(dyn) == max(nfe)
        for i, ((conf, cand), (d_conf, d_cand)) in enumerate(zip(seen, dyn, strict=True)):
            live = [r for r in range(len(PROMPTS_C)) if nfe[r] > i]  # the rows the dynamic plan still holds
            gone = [r for r in range(len(PROMPTS_C)) if nfe[r] <= i]
            assert torch.equal(cand[live], d_cand) and not cand[gone].any(), i
            torch.testing.assert_close(conf[live], d_conf, rtol=EXACT_TOL, atol=EXACT_TOL)  # batch size: not bitwise
    assert uneven >= 1, "no batch kept a finished row while another decoded"


def test_a_compiled_multi_block_static_decode_compiles_one_graph_whatever_its_blocks_and_steps(backbones):
    """Batch 1, 32 tokens in 4 blocks of 8 (about 25 evaluations), history ``full`` under ``aot_eager``: the static
    plan's uncached TDLM step is one graph for every block and step (the history never changes size, so no bucket
    or block recompiles), and a second decode of other prompts compiles nothing, also of other lengths in the same
    prompt bucket (prompts are left-padded to a multiple of 32 tokens, so the canvas keeps its shape). A prompt of
    the next bucket changes the canvas (``input_ids`` is (1, P + G)): one recompile."""
    from torch._dynamo.utils import counters

    model = live_tdlm(backbones["tiny-llada"], history="full")
    kw = dict(KW, gen_length=32, block_size=8)
    prompts = [[[3, 4, 40, 41, 42]], [[3, 9, 60, 61, 62]], [[3, 9, 60, 61, 62, 7]], [[3, 9, 60, 61, 62, 7, 8] * 5]]
    torch._dynamo.reset()
    counters.clear()
    try:
        graphs, nfe = [], []
        for p in prompts:
            compiled = decode(model, p, policy="tdlm", storage="static", compile="aot_eager", **kw)
            graphs.append(counters["stats"]["unique_graphs"])
            nfe.append(compiled[0].nfe)
            assert _key(compiled) == _key(decode(model, p, policy="tdlm", **kw))
        assert min(nfe[:3]) > 2 * kw["gen_length"] // kw["block_size"], nfe  # several steps in each of the 4 blocks
        assert graphs == [1, 1, 1, 2], graphs
        assert counters["graph_break"] == {}, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
