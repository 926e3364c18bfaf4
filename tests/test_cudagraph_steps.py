"""One cudagraph-trees generation per evaluation (issue 48): no compiled step's output is read after a later call has
started a new generation.

CUDA graphs cannot run here, so a stand-in for the compiled steps enforces the rule of torch's cudagraph trees
(torch/_inductor/cudagraph_trees.py: ``get_curr_generation``, ``can_start_new_generation``) on this CPU: once
``torch.compiler.cudagraph_mark_step_begin()`` has been called, the generation is the count of those calls; before,
in inference (no backward pending), every call of a compiled step starts a new one. A call in a new generation frees
the outputs of the earlier ones for reuse, which the stand-in models by filling them with NaN. An evaluation whose
rows split into a refresh group and a window group calls the compiled backbone step twice and then merges both
outputs (``loop.merge_logits``): without the loop's per-evaluation mark the first group's logits are NaN by then.
"""

from __future__ import annotations

import pytest
import torch

from tdlm.decoding import config, decode, loop
from tdlm.errors import TDLMError
from tdlm.temporal.model import TDLM
from tests.conftest import EXACT_DTYPE, live_tdlm, sharp_backbone

# three requests (bucket 4: one padding row) whose rows change block and finish at different evaluations
PROMPTS = [[3, 5, 50, 51], [3, 4, 70, 71, 72, 73, 74, 75, 76], [3, 9, 60, 61, 62]]
KW = dict(gen_length=16, block_size=8, threshold=0.9, storage="static")


class GraphTreesStandIn:
    """Compiled steps that obey cudagraph trees' output lifetime (module docstring)."""

    def __init__(self) -> None:
        self.marks = 0  # torch.compiler.cudagraph_mark_step_begin() calls
        self.calls = 0
        self.live: list[tuple[int, torch.Tensor]] = []  # (generation, output) not yet freed
        self.poisoned = 0  # outputs freed by a later generation
        self.shared = 0  # calls that ran in the generation of the call before them

    def mark_step_begin(self) -> None:
        self.marks += 1

    def _generation(self) -> int:
        return self.marks if self.marks else self.calls

    def wrap(self, fn):
        def step(*args, **kwargs):
            self.calls += 1
            gen = self._generation()
            self.shared += bool(self.live) and all(g == gen for g, _ in self.live)
            for g, t in self.live:
                if g != gen:
                    t.fill_(float("nan"))
                    self.poisoned += 1
            self.live = [(g, t) for g, t in self.live if g == gen]
            out = fn(*args, **kwargs)
            for t in out if isinstance(out, (list, tuple)) else [out]:
                self.live.append((gen, t))
            return out

        return step


@pytest.fixture
def stand_in(monkeypatch) -> GraphTreesStandIn:
    """``compile="reduce-overhead"`` decodes through the stand-in's steps on this CPU."""
    s = GraphTreesStandIn()

    def check_compile(value, device=None):
        return None if value in (False, None) else ("stand-in", "reduce-overhead")

    monkeypatch.setattr(loop, "check_compile", check_compile)
    monkeypatch.setattr(config, "check_compile", check_compile)  # DecodeConfig.validate's
    monkeypatch.setattr(loop, "compiled_steps", lambda backend, mode: (s.wrap(loop.backbone_eval),
                                                                        s.wrap(TDLM.evaluate_groups)))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", s.mark_step_begin)
    return s


def _key(results):
    return [(r.tokens, r.nfe, r.reveal_step) for r in results]


def test_the_stand_in_frees_an_earlier_generations_outputs():
    """Without a mark every call is a generation (the first output is NaN after the second call); after a mark, the
    calls until the next mark share one."""
    s = GraphTreesStandIn()
    step = s.wrap(lambda x: x * 2)
    a, b = step(torch.ones(2)), step(torch.ones(2))
    assert a.isnan().all() and not b.isnan().any() and s.poisoned == 1
    s.mark_step_begin()
    c, d = step(torch.ones(2)), step(torch.ones(2))
    assert not c.isnan().any() and not d.isnan().any() and s.shared == 1
    s.mark_step_begin()
    step(torch.ones(2))
    assert c.isnan().all() and d.isnan().all()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_a_split_evaluation_reads_no_output_freed_by_a_later_call(stand_in, name, cache):
    """Under the stand-in, a padded bucket whose rows change block apart (so evaluations run a refresh group and a
    window group as two calls) decodes eager's tokens, NFE and reveal steps, for the threshold and credit policies
    (the backbone step) and tdlm (one TDLM step per evaluation); some evaluations did split, and earlier evaluations'
    outputs were freed (the rule fired)."""
    bb = sharp_backbone(name, dtype=EXACT_DTYPE)
    for policy, target in (("threshold", bb), ("credit", bb), ("tdlm", live_tdlm(bb))):
        eager = decode(target, PROMPTS, policy=policy, cache=cache, **KW)
        shared = stand_in.shared
        graphs = decode(target, PROMPTS, policy=policy, cache=cache, compile="reduce-overhead", **KW)
        assert _key(graphs) == _key(eager), policy
        if policy != "tdlm":
            assert stand_in.shared > shared, f"{policy}: no evaluation split its rows into two calls"
    assert stand_in.poisoned > 0 and stand_in.marks > 0


def test_without_the_mark_the_first_groups_logits_are_freed(stand_in, monkeypatch):
    """The stand-in catches the crash the mark prevents: with the mark removed, the split evaluation's merged logits
    hold the freed (NaN) output, and the loop's finiteness check refuses it."""
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    with pytest.raises(TDLMError, match="not finite"):
        decode(sharp_backbone("tiny-llada"), PROMPTS, policy="threshold", cache="dual", compile="reduce-overhead",
               **KW)  # fmt: skip
