"""dInfer's training-free baselines as decoding policies (tdlm/decoding/reuse.py): ``credit`` and ``soft``.

At zero weight each decodes exactly as ``threshold`` (tokens, NFE, reveal steps) on both backbones, every cache mode,
batch 1 and a padded batch, eager and compiled; with dInfer's weights each changes decoding, a batch still equals
per-request decoding, and the loop still reads the device once per evaluation. The definitions are checked against
the formulas written out here; the evaluator, the harness and the config checks accept the policies.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import tdlm
import tdlm.data.tokenizer  # tdlm is a lazy facade: the submodule is not imported by `import tdlm`
from tdlm.decoding import DecodeConfig, decode
from tdlm.decoding.reuse import Credit, Soft
from tests.conftest import sharp_backbone
from tests.test_host_sync import count_syncs

PROMPTS = [[3, 4, 40, 41, 42, 43, 44, 45, 46], [3, 4, 60, 61], [3, 4, 70, 71, 72, 73, 74]]  # left-padded batch
ZERO = {"credit": dict(credit_alpha=0.0), "soft": dict(soft_weight=0.0, soft_threshold_decay=0.0)}
pytestmark = pytest.mark.usefixtures("one_thread")


def _key(results):
    return [(r.tokens, r.nfe, r.reveal_step) for r in results]


@pytest.fixture(scope="module")
def backbones():
    return {name: sharp_backbone(name) for name in ("tiny-llada", "tiny-dream")}


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_zero_weights_are_threshold_and_dinfer_weights_are_not(backbones, name, cache):
    bb = backbones[name]
    kw = dict(gen_length=32, block_size=8, threshold=0.6, cache=cache)
    threshold = _key(decode(bb, PROMPTS, policy="threshold", **kw))
    changed = 0
    for policy, zero in ZERO.items():
        assert _key(decode(bb, PROMPTS, policy=policy, **zero, **kw)) == threshold, (policy, "batch")
        assert _key(decode(bb, PROMPTS[:1], policy=policy, **zero, **kw)) == threshold[:1], (policy, "batch 1")
        live = _key(decode(bb, PROMPTS, policy=policy, **kw))  # dInfer's default weights
        changed += live != threshold
        assert [_key(decode(bb, [p], policy=policy, **kw))[0] for p in PROMPTS] == live, (policy, "per request")
    assert changed == 2  # neither policy is a no-op with its weights on


def test_each_weight_alone_changes_decoding(backbones):
    """The soft mix without the threshold warm-up, the warm-up without the mix, and credit all move decoding."""
    bb = backbones["tiny-llada"]
    kw = dict(gen_length=32, block_size=8, threshold=0.6)
    threshold = _key(decode(bb, PROMPTS, policy="threshold", **kw))
    assert _key(decode(bb, PROMPTS, policy="soft", soft_threshold_decay=0.0, **kw)) != threshold  # the mix alone
    assert _key(decode(bb, PROMPTS, policy="soft", soft_weight=0.0, **kw)) != threshold  # the warm-up alone
    assert _key(decode(bb, PROMPTS, policy="credit", credit_alpha=0.2, **kw)) != threshold


def test_one_host_read_per_evaluation(backbones, monkeypatch):
    for policy in ZERO:
        for cache in ("none", "dual"):
            kw = dict(policy=policy, cache=cache, gen_length=16, block_size=8, threshold=0.6)
            syncs, res = count_syncs(monkeypatch, lambda: decode(backbones["tiny-dream"], PROMPTS[:2], **kw))  # noqa: B023
            assert syncs == max(r.nfe for r in res) + 1, (policy, cache)  # tests/test_host_sync.py says why


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name,cache,policies,n", [("tiny-llada", "dual", ("credit", "soft"), 2),
                                                   ("tiny-dream", "prefix", ("soft",), 1)])  # fmt: skip
def test_compiled_equals_eager_fullgraph(backbones, fresh_dynamo, name, cache, policies, n):
    """dynamo's ``eager`` backend: the fullgraph trace and guards of every step kind (a graph break is an error), cheap
    on this CPU (inductor runs below): refresh and window steps, at n = 2 a padded batch whose rows leave at different
    evaluations. Credit's step is threshold's (it changes only the logits after it), so Dream's prefix runs soft."""
    bb = backbones[name]
    kw = dict(gen_length=16, block_size=8, threshold=0.8, cache=cache)
    threshold = _key(decode(bb, PROMPTS[:n], policy="threshold", **kw))
    for policy in policies:
        assert _key(decode(bb, PROMPTS[:n], policy=policy, compile="eager", **ZERO[policy], **kw)) == threshold
        live = _key(decode(bb, PROMPTS[:n], policy=policy, **kw))
        assert _key(decode(bb, PROMPTS[:n], policy=policy, compile="eager", **kw)) == live != threshold, policy
    assert counters["graph_break"] == {}, dict(counters["graph_break"])


def test_inductor_soft_step_decodes_like_eager(backbones, fresh_dynamo):
    """compile=True (inductor) runs the soft step with its input embeddings: at zero weight threshold's tokens, NFE
    and reveal steps, with dInfer's weights eager's (one graph, reused: the weights stay outside it)."""
    bb = backbones["tiny-llada"]
    kw = dict(policy="soft", gen_length=8, block_size=8, threshold=0.6)
    threshold = _key(decode(bb, PROMPTS[:1], **{**kw, "policy": "threshold"}))
    assert _key(decode(bb, PROMPTS[:1], compile=True, **kw, **ZERO["soft"])) == threshold
    assert _key(decode(bb, PROMPTS[:1], compile=True, **kw)) == _key(decode(bb, PROMPTS[:1], **kw)) != threshold


# -- the definitions, against the formulas written out ---------------------------------------------------------
def test_credit_is_dinfers_decayed_top1_sum_reset_per_block():
    cfg = DecodeConfig(policy="credit", credit_alpha=0.7, credit_decay=0.8, credit_gamma=0.2)
    credit = Credit(cfg, 1, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    z = [torch.randn(1, 2, 5, generator=g) * 3 for _ in range(3)]
    cand = torch.tensor([[True, False]])  # position 1 is revealed: it gains no credit
    want = torch.zeros(1, 2, 5, dtype=torch.float64)
    for i, (zi, blk) in enumerate(zip(z, (0, 0, 1), strict=True)):
        fused = credit.logits(zi, cand, torch.tensor([blk]))
        p = torch.softmax(zi.double(), -1)
        want = want * (0.8 if i == 1 else 0.0)  # a new block (i = 0 and 2) starts from zero
        v = int(p[0, 0].argmax())
        want[0, 0, v] += p[0, 0, v] ** 0.2
        assert torch.allclose(fused, zi.double() + 0.7 * torch.log(want + 1), atol=1e-6), i


@pytest.mark.parametrize("name,cache", [("tiny-llada", "none"), ("tiny-dream", "prefix"), ("tiny-dream", "dual")])
def test_soft_feeds_dinfers_mixed_embeddings(backbones, monkeypatch, name, cache):
    """Each evaluation sees E[token] at revealed positions and, at a still-masked position p, E[mask] +
    min(0.15 + 0.02 i, 0.3) softmax(z_p) @ E with z_p the aligned logits of the evaluation i that last computed p
    (every position without a cache and at a refresh, from the block on in a prefix window, the block in a dual one);
    the first evaluation sees plain embeddings."""
    bb = backbones[name]
    E, P, G = bb.embedding_weight(), len(PROMPTS[0]), 16
    last: dict[int, tuple[int, torch.Tensor]] = {}  # response position -> (evaluation, logits)
    calls = []
    real = type(bb).forward

    def spy(self, input_ids, attention_mask=None, insert=None, select=None, kv=None, inputs_embeds=None):
        i = len(calls)
        want = E[input_ids[0]].clone()
        for p, (j, z) in last.items():
            if input_ids[0, P + p] == bb.mask_token_id:
                want[P + p] += min(0.15 + 0.02 * j, 0.3) * (torch.softmax(z.float(), -1) @ E)
        assert torch.allclose(inputs_embeds[0], want, atol=1e-5), i
        out = real(self, input_ids, attention_mask, insert, select, kv, inputs_embeds)
        for p, z in zip(select[0].tolist(), out[0], strict=True):
            last[p - P] = (i, z.clone())
        calls.append(sorted(p - P for p in select[0].tolist()))
        return out

    monkeypatch.setattr(type(bb), "forward", spy)
    decode(bb, PROMPTS[:1], policy="soft", gen_length=G, block_size=8, threshold=0.9, cache=cache)
    windows = [c for c in calls[1:] if len(c) < G]  # the predictions an evaluation computes
    assert len(calls) >= 4 and calls[0] == list(range(G))
    blocks = [list(range(8)), list(range(8, G))]
    if cache == "none":
        assert not windows
    elif cache == "dual":  # the block
        assert windows and all(c in blocks for c in windows)
    else:  # from the block to the end
        assert windows and all(c[0] % 8 == 0 and c == list(range(c[0], G)) for c in windows)


def test_soft_threshold_warm_up(backbones):
    bb = backbones["tiny-llada"]
    soft = Soft(DecodeConfig(policy="soft", threshold=0.9), bb, 1, 8, torch.device("cpu"))
    taus = soft.threshold(torch.arange(8)).flatten().tolist()
    assert taus == pytest.approx([1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.9, 0.9])
    off = Soft(DecodeConfig(policy="soft", soft_threshold_decay=0.0), bb, 1, 8, torch.device("cpu"))
    assert off.threshold(torch.arange(3)) is None


# -- configuration, evaluator, harness ----------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("credit_alpha", -0.1), ("credit_decay", 1.5), ("credit_gamma", math.nan),
                                         ("soft_weight", -1.0), ("soft_weight_growth", math.inf),
                                         ("soft_threshold_decay", 2.0)])  # fmt: skip
def test_bad_weights_are_one_line_errors(field, value):
    with pytest.raises(tdlm.TDLMError, match=rf"^decode {field} \(.*\) must be .*; got {value!r}$"):
        DecodeConfig(policy="credit", **{field: value}).validate()


def test_identity_keeps_only_the_policys_own_weights():
    assert DecodeConfig(policy="threshold").to_dict() == {"policy": "threshold", "gen_length": 256, "block_size": 32,
                                                          "threshold": 0.9, "entropy_threshold": 0.5,
                                                          "stop_at_eos": False}  # fmt: skip
    credit = DecodeConfig(policy="credit", credit_alpha=0.5).to_dict()
    assert credit["credit_alpha"] == 0.5 and "soft_weight" not in credit
    soft = DecodeConfig(policy="soft").to_dict()
    assert soft["soft_weight"] == 0.3 and soft["soft_threshold_decay"] == 0.02 and "credit_alpha" not in soft


def test_evaluator_runs_each_policy(tmp_path):
    from tdlm.decoding.config import DecodeSettings
    from tdlm.evaluation import EvalConfig, evaluate, expand
    from tdlm.evaluation.report import method_label

    section = DecodeSettings(gen_length=16, block_size=8, soft_weight=0.2, batch_size=2, dtype="float32")
    cfg = EvalConfig(backbone="tiny-arith", output_dir=str(tmp_path), tasks=["arith"], limit=3, workers=1, threads=1,
                     warmup=0, score_workers=1, wandb_mode="disabled", policies=["threshold", "credit", "soft"],
                     thresholds=[0.9, 0.7], credit_thresholds=[0.9], caches=["none", "dual"],
                     decode=section)  # fmt: skip
    names = [s.name for s in expand(cfg.validate())]
    assert names == ["threshold-tau0.9", "threshold-tau0.9-dual", "threshold-tau0.7", "threshold-tau0.7-dual",
                     "credit-tau0.9", "credit-tau0.9-dual", "soft-tau0.9", "soft-tau0.9-dual", "soft-tau0.7",
                     "soft-tau0.7-dual"]  # fmt: skip
    specs = {s.name: s for s in expand(cfg)}
    assert specs["soft-tau0.7"].settings(cfg).soft_weight == 0.2
    with pytest.raises(tdlm.TDLMError, match=r"^decode credit_decay .* must be in \[0, 1\]; got 2"):
        dataclasses.replace(cfg, decode=dataclasses.replace(section, credit_decay=2)).validate()
    small = dataclasses.replace(cfg, thresholds=[0.9], caches=["dual"])
    runs = {r["name"]: r for r in evaluate(small).runs}
    assert set(runs) == {"threshold-tau0.9-dual", "credit-tau0.9-dual", "soft-tau0.9-dual"}
    assert method_label(runs["credit-tau0.9-dual"]) == "dInfer credit τ=0.9 + dual cache"
    assert method_label(runs["soft-tau0.9-dual"]) == "dInfer soft iteration τ=0.9 + dual cache"
    assert all(r["n"] == 3 and r["paired"] for r in runs.values())
    # the evaluator's tokens are tdlm.decode's, batched as it batches them (2 + 1)
    from tdlm.evaluation.records import read_records

    bb = tdlm.load_backbone("tiny-arith", dtype="float32")
    tok = tdlm.data.tokenizer.load_tokenizer("tiny-arith")
    recs = sorted(read_records(tmp_path / "runs" / "arith" / "soft-tau0.9-dual" / "samples.jsonl"),
                  key=lambda r: r["index"])  # fmt: skip
    ids = tdlm.data.tokenizer.encode_prompts(tok, [r["prompt"] for r in recs])
    ref = decode(bb, ids, policy="soft", soft_weight=0.2, gen_length=16, block_size=8, cache="dual", tokenizer=tok,
                 stop_ids=tdlm.data.tokenizer.stop_token_ids(tok, bb.eos_token_id))  # fmt: skip
    assert [(r["generation"], r["nfe"]) for r in recs] == [(r.text, r.nfe) for r in ref]


def test_harness_accepts_each_policy():
    from lm_eval.api.instance import Instance

    from tdlm.harness import TDLMHarnessLM
    from tdlm.harness.model import parse_model_args

    cfg = parse_model_args({"pretrained": "tiny-arith", "policy": "credit", "credit_alpha": 0.5})
    assert cfg.decode.credit_alpha == 0.5 and cfg.decode.credit_decay == 0.8
    with pytest.raises(tdlm.TDLMError, match=r"^--model_args: decode soft_weight .* got -1"):
        parse_model_args({"pretrained": "tiny-arith", "policy": "soft", "soft_weight": -1})
    tok = tdlm.data.tokenizer.load_tokenizer("tiny-arith")
    bb = tdlm.load_backbone("tiny-arith", dtype="float32")
    for policy in ZERO:
        lm = TDLMHarnessLM(pretrained="tiny-arith", policy=policy, gen_length=40, block_size=40, dtype="float32",
                           batch_size=2)  # fmt: skip
        prompts = ["3+5-2=?", "7+1+4-6=?"]
        texts = lm.generate_until([Instance("generate_until", doc={}, arguments=(p, {"until": []}), idx=0,
                                            metadata=("probe", 0, 1)) for p in prompts])  # fmt: skip
        ids = tdlm.data.tokenizer.encode_prompts(tok, prompts)
        ref = tdlm.decode(bb, ids, policy=policy, gen_length=40, block_size=40, tokenizer=tok,
                          stop_ids=tdlm.data.tokenizer.stop_token_ids(tok, bb.eos_token_id))  # fmt: skip
        assert texts == [r.text for r in ref] and lm.get_model_info()["tdlm"]["policy"] == policy


def test_demo_pairs_tdlm_with_each_baseline(tmp_path):
    """The demo report's rows: TDLM tau 0.95 against credit and soft at tau 0.9, each baseline the reference."""
    import json

    from tdlm.demo import baseline_pairs

    correct = {"tdlm": [1, 1, 0, 1], "credit": [1, 0, 0, 1], "soft": [0, 0, 0, 1]}
    runs = []
    for name, policy, tau in (("tdlm-demo-tau0.95-full", "tdlm", 0.95), ("credit-tau0.9", "credit", 0.9),
                              ("soft-tau0.9", "soft", 0.9)):  # fmt: skip
        d = tmp_path / name
        d.mkdir()
        nfe = {"tdlm": 2, "credit": 4, "soft": 5}[policy]
        (d / "samples.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "correct": bool(c), "nfe": nfe,
                                                             "seconds": 0.1 * nfe}) + "\n"
                                                 for i, c in enumerate(correct[policy])))  # fmt: skip
        runs.append({"name": name, "policy": policy, "threshold": tau, "run_dir": str(d), "backbone": "b",
                     "task": "multi", "gen_length": 8, "block_size": 8, "adapter_label": "demo", "history": "full",
                     "n": 4})  # fmt: skip
    rows = [line for line in baseline_pairs(runs).splitlines() if line.startswith("| TDLM")]
    assert rows == ["| TDLM τ=0.95 [demo, full] | dInfer credit τ=0.9 | 4 | +25.00 [+0.00, +75.00] | 1.0000 (1/0) | "
                    "2.00× [2.00, 2.00] | 2.00× [2.00, 2.00] |",
                    "| TDLM τ=0.95 [demo, full] | dInfer soft iteration τ=0.9 | 4 | +50.00 [+0.00, +100.00] | 0.5000 "
                    "(2/0) | 2.50× [2.50, 2.50] | 2.50× [2.50, 2.50] |"]  # fmt: skip
