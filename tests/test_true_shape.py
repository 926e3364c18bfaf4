"""Shape, dtype and index width at the true LLaDA-8B / Dream-7B shape, under FakeTensorMode (issue 27).

No compute: the parameters are fake bf16 tensors (:mod:`tdlm.profiling.true_shape`), so these run the library's
real code paths at the real widths, vocabulary, heads, L = 768, K = 8 and micro-batch 4 in seconds. Every op's
outputs are checked (:class:`tdlm.profiling.ledger.Ledger`): no tensor with a vocabulary dimension beyond the LM
head's rows (the block's b x 32 positions when decoding, the S supervised positions when training), no float64
tensor larger than those logits, no element offset past int32. The depth is cut to three blocks (one below the
temporal layer, the temporal layer, one above it: every kind of block, each with the shapes of the real model);
``bench/true_shape.py`` runs the full depth with the same checks (``violations`` in its JSON).
"""

from __future__ import annotations

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

from tdlm.profiling import predictions, roofline, static_memory
from tdlm.profiling import true_shape as ts

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


def test_overlapped_launches_hide_behind_long_kernels_and_add_up_behind_short_ones():
    """The launch models of the prediction (tdlm.profiling.roofline): asynchronous issue costs only the first launch
    when every kernel outlasts a launch, every launch when none does, and nothing with CUDA graphs."""
    long, short = [10.0] * 100, [1.0] * 100  # µs per kernel; 100 launches of 5 µs each = 500 µs of host time
    assert roofline.overlapped_ms(long, host_us=500) == pytest.approx((5 + 1000) * 1e-3)  # first issue + roofline
    assert roofline.overlapped_ms(short, host_us=500) == pytest.approx((500 + 1) * 1e-3)  # launches + last kernel
    assert roofline.overlapped_ms(short, host_us=0) == pytest.approx(sum(short) * 1e-3)  # CUDA graphs: the roofline
    mixed = [30.0, 0.1, 0.1, 0.1, 30.0, 0.2, 0.2] * 20
    t = roofline.overlapped_ms(mixed, host_us=5 * len(mixed))
    assert sum(mixed) * 1e-3 < t < (sum(mixed) + 5 * len(mixed)) * 1e-3  # between CUDA graphs and launches added


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_the_timeline_kernels_are_the_fused_roofline(fake_models, cache):
    """The kernels put on the timeline are the fused roofline's ops, grouped as ``kernels_fused_est`` counts them."""
    model, mode = fake_models["llada-8b"]
    r = ts.trace_decode(model, mode, "tdlm", cache, 0, 1, 0)
    for kind in ("eval", "window") if cache != "none" else ("eval",):
        step = r[kind]
        for gpu in roofline.GPUS:
            us = step["_kernel_us"][gpu]
            assert len(us) == step["kernels_fused_est"]
            assert sum(us) * 1e-3 == pytest.approx(step["roofline_ms"][gpu]["fused"], rel=1e-9)
            ms = roofline.step_ms(step, gpu, kernels=len(us), launch_us=5.0)
            assert ms["graphs"] <= ms["overlap"] <= ms["launch"]
    assert "_kernel_us" not in str(roofline.strip_timelines(r))


def test_the_static_plan_history_is_the_stated_formula_at_true_shape():
    """The static storage plan's history (``tdlm.profiling.static_memory.static_history``) as ``TDLM.static_histories``
    allocates it, fake tensors at the true widths: the bytes ``TDLM.temporal_cache_bytes(1, G, G)`` states per row,
    times the batch; ``last:32`` holds 32 of ``full``'s 256 slots (+ the sink)."""
    out = static_memory.static_history("llada-8b", DEPTH)
    full, last = out["rows"]
    assert (full["history"], last["history"]) == ("full", "last:32")
    for r in out["rows"]:
        assert r["formula_matches"] and r["allocated_bytes"]["8"] == 8 * r["per_row_bytes"] > 0, r
    assert full["d_t"] == 256 and full["dtype"] == "torch.bfloat16" and full["gen"] == 256
    per_slot = full["temporal_layers"] * 256 * 2 * full["d_t"] * 2  # layers x positions x (key, value) x d_t x bf16
    assert full["per_row_bytes"] - last["per_row_bytes"] == (256 - 32) * (per_slot + 256)  # + a validity byte each


def test_the_static_plan_memory_per_row_and_its_buckets_at_true_shape():
    """The static plan's whole memory per row (``static_history``'s ``plan``): the history, the spatial KV cache of
    every layer at the decode's canvas (prompt 256, a prompt bucket, + 256) in bf16, the canvas; the bucket table
    holds the weights, every bucket decoded up to B (2B - 1 rows), the transient activations and the reserve."""
    out = static_memory.static_history("llada-8b", DEPTH)
    assert out["canvas_len"] == 512 and out["prompt_bucketed"] == 256 and out["element_size"] == 2
    full, last = out["plan"]["full"], out["plan"]["last:32"]
    kv = 2 * DEPTH * 32 * 512 * 128 * 2  # keys and values x layers x kv heads x L x head_dim x bf16
    assert full["dual"]["kv_cache"] == last["dual"]["kv_cache"] == kv and full["none"]["kv_cache"] == 0
    assert full["dual"]["canvas"] == 2 * 512 * 8 + 256 * 8 + 8
    assert full["dual"]["history"] == out["rows"][0]["per_row_bytes"]
    assert full["dual"]["total"] == full["dual"]["history"] + kv + full["dual"]["canvas"]
    tr = {"per_row_bytes": 1e6, "fixed_bytes": 0.0}
    mem = static_memory.static_memory_table(out, 141e9, tr)
    r8 = next(r for r in mem["rows"] if r["history"] == "full" and r["bucket"] == 8)
    assert r8["held_cumulative_bytes"] == 15 * full["dual"]["total"] and r8["held_bytes"] == 8 * full["dual"]["total"]
    assert r8["total_bytes"] == out["weight_bytes"] + 15 * full["dual"]["total"] + 8e6 + static_memory.MEM_RESERVE
    for hist in ("full", "last:32"):
        big = mem["largest_bucket"][hist]
        fits = {r["bucket"]: r["fits"] for r in mem["rows"] if r["history"] == hist}
        assert fits[big] and not fits.get(2 * big, False) and big <= mem["largest_bucket_alone"][hist]
    assert mem["batch8_dual_fits"] is True


def test_the_static_plan_formula_is_what_a_static_decode_holds():
    """``static_bytes(backbone)`` + the model's static histories after decodes of buckets 4 and 1 with
    storage="static", cache="dual" (tiny LLaDA and Dream, real tensors): exactly 5 rows of ``static_plan_row``."""
    for history in ("full", "last:4"):
        out = static_memory.static_plan_check(history)
        assert out["matches"] and {r["model"] for r in out["rows"]} == {"tiny-llada", "tiny-dream"}, out
        for r in out["rows"]:
            assert r["rows_held"] == 5 and r["held_bytes"] == 5 * r["per_row"]["total"] > 0, r
            assert r["per_row"]["kv_cache"] > 0 and r["per_row"]["history"] > 0


def test_reduce_overhead_predictions_pair_with_the_gpu_check_settings():
    """Per gpu_check row (one per GPU) and policy: reduce-overhead is the CUDA-graphs prediction (launches ~0),
    compile=True on the same static plan (compiled-static) the launches added / overlapped, named as
    bench/gpu_check.py names the settings; static / dynamic its own ratio."""
    ms = {"eager": 14.0, "compiled": 8.0, "compiled_overlapped": 5.6, "cuda_graphs": 5.5, "compiled-static": 8.4}
    rows = [{"model": "llada-8b", "gpu": g, "batch": b, "cache": c, "threshold_ms_per_nfe": dict(ms),
             "tdlm_ms_per_nfe": dict(ms)} for b in (1, 8) for c in ("none", "dual") for g in ("h200", "h100")]
    section = {"gpus": ["h200", "h100"], "rows": rows}
    out = predictions.reduce_overhead_predictions(section, 5.0)
    assert len(out["rows"]) == 16 and out["launch_us"] == 5.0 and out["gpus"] == ["h100", "h200"]
    names = {(r["setting"], r["versus"], r["static_versus"], r["policy"], r["gpu"]) for r in out["rows"]}
    assert names == {(f"llada-8b/b{b}/{c}/reduce-overhead", f"llada-8b/b{b}/{c}/compiled-static",
                      f"llada-8b/b{b}/{c}/compiled", p, g)
                     for b in (1, 8) for c in ("none", "dual") for p in ("threshold", "tdlm") for g in ("h200", "h100")}
    for r in out["rows"]:
        assert r["reduce_overhead_ms_per_nfe"] == 5.5 and r["compile_true_ms_per_nfe"] == 8.4
        assert r["ratio_added"] == pytest.approx(5.5 / 8.4) and r["ratio_overlapped"] == pytest.approx(5.5 / 5.6)
        assert r["static_over_dynamic"] == pytest.approx(8.4 / 8.0)
    assert all(row["tdlm_ms_per_nfe"]["reduce-overhead"] == 5.5 for row in section["rows"])  # the key compare reads
