"""Shape, dtype and index width at the true LLaDA-8B / Dream-7B shape, under FakeTensorMode (issue 27).

No compute: the parameters are fake bf16 tensors (``bench/true_shape.py``), so these run the library's real code
paths at the real widths, vocabulary, heads, L = 768, K = 8 and micro-batch 4 in seconds. Every op's outputs are
checked (:class:`true_shape.Ledger`): no tensor with a vocabulary dimension beyond the LM head's rows (the block's
b x 32 positions when decoding, the S supervised positions when training), no float64 tensor larger than those
logits, no element offset past int32. The depth is cut to three blocks (one below the temporal layer, the
temporal layer, one above it: every kind of block, each with the shapes of the real model);
``bench/true_shape.py`` runs the full depth with the same checks (``violations`` in its JSON).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import true_shape as ts  # noqa: E402

DEPTH = 3
LAYERS = "1"  # the middle block of three: one no-grad block below, one block with grad above
MODELS = ("llada-8b", "dream-7b")


@pytest.fixture(scope="module")
def fake_models():
    built = {}
    for name in MODELS:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        built[name] = (ts.fake_model(name, mode, LAYERS, depth=DEPTH).eval(), mode)
    return built


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_decode_evaluation_at_true_shape(fake_models, name, cache):
    model, mode = fake_models[name]
    out = ts.trace_decode_loop(model, mode, cache, batch=2)
    V = model.backbone.vocab_size
    assert out["head_outputs"] == (1 if cache == "none" else 2), out  # the refresh and a window step when cached
    assert out["violations"] == [], out["violations"]
    assert (2, 32, V) in out["vocab_shapes"], out["vocab_shapes"]  # the block's logits, nothing wider
    assert all(s[-1] == V for s in out["vocab_shapes"])


@pytest.mark.parametrize("name", MODELS)
def test_training_micro_step_at_true_shape(name):
    row = ts.trace_training(name, LAYERS, memory=False, depth=DEPTH, flops=False)
    V = 152064 if name == "dream-7b" else 126464
    assert row["shape"] == ts.TRAIN_SHAPE and row["checkpointing"]
    assert row["violations"] == [], row["violations"]
    assert row["vocab_shapes"] == [(row["supervised"], V)], row["vocab_shapes"]  # logits of S rows only
    assert 0 < row["supervised"] <= 4 * 256
