"""Host synchronisations of the decode loop (issue 21, item 3): at most one per evaluation in steady state.

A sync is counted wherever the host reads the device: at the dispatcher (``aten._local_scalar_dense`` - every
``item()``, ``int(t)``, ``bool(t)`` - and ``aten.nonzero``, whose output shape is data) and, because ``tolist()``
and ``bool()`` on a CPU tensor do not always go through the dispatcher, at the Python methods
``Tensor.item/tolist/__bool__/__int__/__float__/nonzero`` (a read inside one of those is counted once). The loop
reads the device once per evaluation (the stop check, which also brings back each row's next block and the tokens,
NFE and reveal steps of the rows that finished at the evaluation before) and once after the last one (those of the
rows that finished at it), so a decode of I loop iterations counts exactly I + 1.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tdlm
from tdlm.decoding import decode
from tests.conftest import live_tdlm, sharp_backbone

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default}
METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero")
PROMPTS = [[3, 4, 40, 41, 42, 43, 44], [3, 4, 60, 61]]  # padded batch: rows finish at different evaluations


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS and self.depth == 0:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_syncs(monkeypatch, fn):
    counter = SyncCounter()

    def wrap(name):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, **kw):
            if counter.depth == 0:
                counter.count += 1
            counter.depth += 1
            try:
                return orig(self, *a, **kw)
            finally:
                counter.depth -= 1

        return counted

    for name in METHODS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name))
    with counter:
        out = fn()
    monkeypatch.undo()
    return counter.count, out


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("policy", ["original", "threshold", "entropy", "tdlm"])
def test_one_host_sync_per_evaluation(policy, cache, monkeypatch):
    for name in ("tiny-llada", "tiny-dream"):
        bb = sharp_backbone(name)
        model = live_tdlm(bb, history="last:2") if policy == "tdlm" else bb
        kw = dict(policy=policy, cache=cache, gen_length=32, block_size=8, threshold=0.6, entropy_threshold=1.0)
        syncs, res = count_syncs(monkeypatch, lambda: decode(model, PROMPTS, **kw))  # noqa: B023
        iterations = max(r.nfe for r in res)
        assert syncs == iterations + 1, (name, syncs, iterations)


def test_counter_sees_a_planted_sync(monkeypatch):
    """The counter is not blind: a padding check ``bool(mask.all())`` per forward adds one sync per forward."""
    bb = tdlm.load_backbone("tiny-llada")
    base, res = count_syncs(monkeypatch, lambda: decode(bb, PROMPTS, gen_length=16, block_size=8))
    prepare = type(bb).prepare

    def checking(self, input_ids, attention_mask=None, kv=None):
        if attention_mask is not None:
            bool(attention_mask.all())
        return prepare(self, input_ids, attention_mask, kv)

    monkeypatch.setattr(type(bb), "prepare", checking)
    planted, _ = count_syncs(monkeypatch, lambda: decode(bb, PROMPTS, gen_length=16, block_size=8))
    assert planted == base + max(r.nfe for r in res)
