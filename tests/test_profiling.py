"""The library's instruments count what they claim (tdlm.profiling): bytes, FLOPs and kernels per op of the ledger on
small real tensors, worked out by hand; the op counter; the launches read off inductor's generated code."""

from __future__ import annotations

import pytest
import torch

from tdlm.profiling.ledger import Ledger, Limits, OpCounter, kernels_in
from tdlm.profiling.roofline import GPUS, overlapped_ms


def test_the_ledger_counts_each_ops_bytes_flops_and_kernels():
    a, b = torch.ones(4, 8), torch.ones(8, 16)  # float32
    x, bias = torch.ones(4, 8), torch.ones(8)
    table, ids = torch.ones(100, 8), torch.tensor([1, 2, 3, 4, 5])
    column = torch.ones(8, 100)[:, :1].expand(8, 16)  # strides (100, 0): 8 floats of a 800-float storage
    with Ledger() as led:
        torch.mm(a, b)
        x + bias.expand(4, 8)  # a stride-0 view: the kernel reads the 8 floats once, and the view is no kernel
        torch.nn.functional.embedding(ids, table)  # a gather reads the rows it returns, not the whole table
        torch.ones(8, 16) * column  # the broadcast column is read once per row, not once per output element
    mm, add, emb, ones, mul = led.ops
    assert (mm["op"], mm["flops"], mm["read"], mm["written"]) == ("aten.mm", 2 * 4 * 8 * 16, (32 + 128) * 4, 64 * 4)
    assert (add["op"], add["read"], add["written"], add["pointwise"]) == ("aten.add", (32 + 8) * 4, 32 * 4, True)
    assert (emb["op"], emb["read"], emb["written"]) == ("aten.embedding", 5 * 8 * 4 + 5 * 8, 5 * 8 * 4)
    assert (mul["op"], mul["read"], mul["written"]) == ("aten.mul", (128 + 8) * 4, 128 * 4)
    assert (ones["op"], ones["read"], ones["written"]) == ("aten.ones", 0, 128 * 4)  # a fill writes, reads nothing
    tot = led.totals()
    assert tot["kernels"] == 5 and tot["read"] == 640 + 160 + 200 + 544 and tot["written"] == 256 + 128 + 160 + 1024
    # the roofline of those ops on an H200: each op bound by its bytes (tiny FLOPs), fused drops the pointwise add
    h200 = GPUS["h200"]
    bound = sum((o["read"] + o["written"]) / h200["bw"] for o in led.ops)
    assert led.roofline_ms(h200, fused=False) * 1e-3 == pytest.approx(bound, rel=1e-12)
    assert len(led.kernel_us(h200)) == tot["kernels_fused_est"] == 5  # no two pointwise ops in a row here
    assert overlapped_ms(led.kernel_us(h200), 0.0) == pytest.approx(led.roofline_ms(h200, fused=True), rel=1e-12)


def test_the_ledger_watches_the_history_and_flags_vocabulary_wide_tensors():
    hist, q = torch.ones(2, 16), torch.ones(16, 3)
    with Ledger(Limits(vocab=50, logit_rows=2)) as led:
        assert led.watch_tensors([hist]) == 2 * 16 * 4
        hist @ q  # reads the watched storage whole
        torch.zeros(3, 50)  # three rows of a 50-wide vocabulary: beyond the head's two
    assert led.ops[0]["hist_read"] == 2 * 16 * 4 and led.totals()["hist_read"] == 128
    assert len(led.violations) == 1 and "vocabulary rows beyond" in led.violations[0]


def test_the_op_counter_counts_dispatches_by_name_views_included():
    x = torch.ones(4, 4)
    with OpCounter() as c:
        (x.t() + 1).sum()
    assert c.ops == {"aten.t.default": 1, "aten.add.Tensor": 1, "aten.sum.default": 1} and c.total == 3


def test_kernels_are_read_off_the_generated_call_functions():
    code = """
def call(args):
    buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
    cpp_fused_add_0(arg0_1, buf0)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    # cpp_fused_commented_out(buf1)
    del buf0
    buf2 = torch.ops.aten.nonzero.default(buf1)
    triton_poi_fused_mul_1.run(buf2, buf3)
    return (buf3, )

def not_call():
    cpp_fused_elsewhere_2(x)
"""
    assert kernels_in(code) == {"fused": 2, "extern_kernels.mm": 1, "torch.ops.aten.nonzero.default": 1}


def test_the_backbones_stated_costs_are_what_the_ledger_traces():
    """``Backbone.matmul_flops_per_token`` (from the config, as nanochat states its FLOPs) is the traced FLOPs of a
    forward's matrix products per position, exactly; ``kv_bytes_per_token`` is the static plan's KV cache per
    position (whose formula tests/test_true_shape.py holds to what a real static decode allocates)."""
    from tdlm.decoding.static_plan import kv_cache_bytes
    from tdlm.models.loading import load_backbone

    for name in ("tiny-llada", "tiny-dream"):
        bb = load_backbone(name).eval()
        ids = torch.randint(5, 50, (2, 12))
        with torch.no_grad(), Ledger() as led:
            bb(ids)
        traced = sum(o["flops"] for o in led.ops if "attention" not in o["op"])
        assert traced == 2 * 12 * bb.matmul_flops_per_token() > 0, name
        elem = next(bb.parameters()).element_size()
        assert 40 * bb.kv_bytes_per_token() == kv_cache_bytes(bb.num_layers, bb.kv_heads, bb.head_dim, 40, elem)
