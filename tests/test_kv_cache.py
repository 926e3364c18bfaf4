"""Spatial KV cache (issue 12): Fast-dLLM's prefix and dual cache in ``tdlm.decode``, with TDLM's history.

The reference below is an independent, plainly written copy of the *algorithm* of Fast-dLLM's
``generate_with_prefix_cache`` / ``generate_with_dual_cache`` (NVlabs/Fast-dLLM ``llada/generate.py``,
temperature 0, batch 1, no padding), driving the backbone's weights through its own model call with
explicit past keys/values (``_fastdllm_call``: ``torch.cat(past, new)`` for prefix, replacement of the
window's entries for dual), not through ``tdlm.models.kv_cache``. Fast-dLLM behaviours it mirrors:

* every block starts with a full forward whose logits commit by the rule (one NFE) and whose keys/values
  become the cache (prefix: the positions before the window only);
* each further step of the block feeds ``x[s:]`` (prefix) or ``x[s:e]`` (dual) and commits inside the
  block; a block ends when it has no mask left; the NFE counter counts every forward;
* ``original`` = ``steps = gen_length``: one token per forward, the most confident masked position of
  the block (``get_num_transfer_tokens`` gives 1 per step); ``threshold`` = the most confident position
  plus every other one over tau (``get_transfer_index`` with ``threshold``).

Where it deliberately differs from Fast-dLLM's code (and ``tdlm.decode`` with it):

* the threshold test is ``conf > tau`` (this repository's Eq. 6), not Fast-dLLM's ``>=``;
* Fast-dLLM's loop runs one more cached forward after a refresh that already completed its block; it
  commits nothing. The reference runs and counts it as Fast-dLLM does and reports how many there were
  (``noop``); ``tdlm.decode`` does not run them, so its NFE is the reference's minus ``noop``;
* Dream: Fast-dLLM's ``dream/`` code feeds ``x[s:]`` and shifts logits inside the window (the block's
  first token then reads its own hidden state) and at each refresh commits the block's first position
  unconditionally. Here the window starts at s - 1 (Dream predicts token p from the hidden state at
  p - 1, as its uncached forward does) and the refresh commits by the rule, like LLaDA's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tdlm
from tdlm.decoding import DecodeConfig, decode
from tdlm.decoding.config import DecodeSettings
from tdlm.evaluation import EvalConfig, compute_speedups, expand, render
from tdlm.evaluation.plot import family
from tdlm.evaluation.report import method_label
from tdlm.generation import GenerationConfig
from tdlm.models.common import apply_rope, rope_cos_sin
from tdlm.models.kv_cache import KVStep, SpatialKVCache
from tests.conftest import EXACT_DTYPE, live_tdlm, sharp_backbone

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 4, 40, 41, 42, 43, 44, 45, 46], [3, 4, 60, 61], [3, 4, 70, 71, 72, 73, 74]]
KW = dict(gen_length=32, block_size=8)
TAU = 0.6


def _key(r):
    return (r.tokens, r.reveal_step, r.nfe)


# -- the reference: Fast-dLLM's cached generation, written out ------------------------------------------
def _attn_parts(bb, block):
    if bb.family == "llada":
        b = block
        return b.attn_norm, b.q_proj, b.k_proj, b.v_proj, b.attn_out, b.n_heads, b.n_kv_heads
    a = block.self_attn
    return block.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj, a.n_heads, a.n_kv


def _fastdllm_call(bb, x: torch.Tensor, first: int, past=None, mode: str | None = None):
    """Fast-dLLM's ``model(x, past_key_values=..., replace_position=...)`` for the tokens x (1, W) at canvas
    positions first..first+W-1: returns final hidden states (1, W, d) and each layer's rotated (K, V) it
    attended over. ``past``: prefix - K/V of positions 0..first-1 (concatenated before the new ones);
    dual - K/V of every position (the window's entries replaced by the new ones)."""
    W = x.shape[1]
    h = bb.embed(x)
    cos, sin = rope_cos_sin(torch.arange(first, first + W)[None], bb.head_dim, bb.rope_theta, h.dtype)
    present = []
    for i, block in enumerate(bb.blocks):
        norm, qp, kp, vp, op, nh, nkv = _attn_parts(bb, block)
        a = norm(h)
        q = apply_rope(qp(a).view(1, W, nh, -1).transpose(1, 2), cos, sin)
        k = apply_rope(kp(a).view(1, W, nkv, -1).transpose(1, 2), cos, sin)
        v = vp(a).view(1, W, nkv, -1).transpose(1, 2)
        if past is not None and mode == "prefix":
            k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
        elif past is not None:
            K, V = past[i][0].clone(), past[i][1].clone()
            K[:, :, first : first + W], V[:, :, first : first + W] = k, v
            k, v = K, V
        present.append((k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=nh != nkv)
        h = block.feed_forward(h + op(o.transpose(1, 2).reshape(1, W, -1)))
    return h, present


def _transfer(x: torch.Tensor, s: int, e: int, logits: torch.Tensor, rule: str, tau: float, mask_id: int) -> None:
    """get_transfer_index at temperature 0 on the block [s, e): top-1 always, others over tau (threshold)."""
    cand = x[0, s:e] == mask_id
    n = int(cand.sum())
    if n == 0:
        return
    p = torch.softmax(logits.double(), -1)
    conf, x0 = p.max(-1)
    conf = torch.where(cand, conf, torch.full_like(conf, -float("inf")))
    top = torch.topk(conf, n).indices
    commit = [int(top[0])] + ([int(j) for j in top[1:] if conf[j] > tau] if rule == "threshold" else [])
    for j in commit:
        x[0, s + j] = x0[j]


@torch.inference_mode()
def fastdllm_generate(bb, prompt, mode: str, rule: str, gen_length: int, block_size: int, tau: float = TAU):
    """Tokens, NFE (counted as Fast-dLLM counts them) and the number of no-op cached forwards."""
    mask_id, shift, P = bb.mask_token_id, bb.logit_shift, len(prompt)
    x = torch.tensor([list(prompt) + [mask_id] * gen_length])
    L = x.shape[1]
    nfe = noop = 0
    for b in range(gen_length // block_size):
        s, e = P + b * block_size, P + (b + 1) * block_size
        h, present = _fastdllm_call(bb, x, 0)  # refresh: the whole canvas
        _transfer(x, s, e, bb.project(h[0, s - shift : e - shift]), rule, tau, mask_id)
        nfe += 1
        lo = s - shift  # Dream: the window includes the hidden state left of the block
        past = [(k[:, :, :lo], v[:, :, :lo]) for k, v in present] if mode == "prefix" else present
        while True:
            nfe += 1
            noop += int(not bool((x[0, s:e] == mask_id).any()))
            hi = L if mode == "prefix" else e
            h, _ = _fastdllm_call(bb, x[:, lo:hi], lo, past, mode)
            _transfer(x, s, e, bb.project(h[0, :block_size]), rule, tau, mask_id)
            if not bool((x[0, s:e] == mask_id).any()):
                break
    return x[0, P:].tolist(), nfe, noop


# -- 1. tokens and NFE equal Fast-dLLM's (batch 1 and a left-padded batch) -----------------------------------
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_tokens_and_nfe_equal_fastdllm_reference(name, mode):
    """Three numerically different paths (Fast-dLLM's loop below, tdlm's batch 1, tdlm's left-padded batch) must make
    the same decisions: in float64 (tests/conftest.py: EXACT_DTYPE), since in float32 a confidence tie on this toy
    decided differently under another CPU kernel path (ATEN_CPU_CAPABILITY=default, batch vs batch 1)."""
    bb = sharp_backbone(name, dtype=EXACT_DTYPE)
    multi_step = 0
    for rule in ("original", "threshold"):
        batched = decode(bb, PROMPTS, policy=rule, threshold=TAU, cache=mode, **KW)
        for prompt, got in zip(PROMPTS, batched, strict=True):
            tokens, nfe, noop = fastdllm_generate(bb, prompt, mode, rule, **KW)
            single = decode(bb, [prompt], policy=rule, threshold=TAU, cache=mode, **KW)[0]
            assert single.tokens == tokens and single.nfe == nfe - noop, (rule, prompt)
            assert _key(got) == _key(single)  # batch > 1 (left-padded, rows in different blocks) = batch 1
            if rule == "original":
                assert noop == 0 and nfe == 32
            multi_step += nfe - noop > 4  # some block took cached window steps under the threshold rule
    assert multi_step > 3
    assert len({r.nfe for r in batched}) > 1  # the rows desynchronised: refreshes and windows in one evaluation
    uncached = decode(bb, PROMPTS, policy="threshold", threshold=TAU, **KW)
    assert [r.tokens for r in uncached] != [r.tokens for r in batched]  # the cache is in use: it approximates


# -- 2. TDLM with a cache: Prop. 1, batching, the history rule ----------------------------------------------
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_prop1_zero_adapter_with_cache_equals_threshold_with_cache(name, mode):
    bb = sharp_backbone(name)
    for history in ("full", "latent:2") if mode == "prefix" else ("full",):
        model = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history=history))
        thr = decode(bb, PROMPTS, policy="threshold", threshold=TAU, cache=mode, **KW)
        tdl = decode(model, PROMPTS, policy="tdlm", threshold=TAU, cache=mode, **KW)
        assert [_key(r) for r in thr] == [_key(r) for r in tdl]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_live_tdlm_with_cache_batched_equals_per_sample(name, mode):
    bb = sharp_backbone(name, dtype=EXACT_DTYPE)  # batched vs per-sample decisions: float64 (tests/conftest.py)
    for history in ("full", "last:2") + (("latent:2",) if mode == "prefix" else ()):
        model = live_tdlm(bb, history)
        opts = dict(policy="tdlm", threshold=TAU, cache=mode, **KW)
        batched = decode(model, PROMPTS, **opts)
        single = [decode(model, [p], **opts)[0] for p in PROMPTS]
        assert [_key(r) for r in batched] == [_key(r) for r in single], history
        base = decode(bb, PROMPTS, policy="threshold", threshold=TAU, cache=mode, **KW)
        assert [_key(r) for r in base] != [_key(r) for r in batched]  # the live adapter acts under the cache


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_history_entries_only_for_computed_masked_positions(name, mode):
    """Refresh: an entry for every masked position; window step: for the masked positions it computes
    (prefix: all of them, as they all lie at or after the block; dual: the block's, and under Dream's
    prediction alignment also the token right of the block, whose hidden state e - 1 the window computes)."""
    bb = tdlm.load_backbone(name)
    model = live_tdlm(bb)
    P, N, bs = 5, 16, 4
    x = torch.randint(8, bb.vocab_size, (2, P + N), generator=torch.Generator().manual_seed(0))
    x[:, P:] = bb.mask_token_id
    x[0, P : P + 6] = 9  # row 0: block 1 active (positions 4..7), two of them revealed
    x[1, P : P + 1] = 9  # row 1: block 0 active
    kv = SpatialKVCache(mode, 2)
    cache = model.new_cache(2)
    sel = torch.zeros_like(x, dtype=torch.bool)
    sel[0, P + 4 : P + 8] = sel[1, P : P + 4] = True
    with torch.inference_mode():
        model.forward_step(x, P, cache, select=sel, kv=KVStep(kv, True))
        start = torch.tensor([P + 4, P])
        model.forward_step(x, P, cache, select=sel, kv=KVStep.window(kv, start, bs, P + N, bb.logit_shift))
    masked = x[:, P:] == bb.mask_token_id
    valid = cache.entry_validity()[:, :2]  # (B, steps, N)
    assert torch.equal(valid[:, 0], masked)
    in_block = torch.zeros_like(masked)
    in_block[0, 4 : 8 + model.offset] = in_block[1, 0 : 4 + model.offset] = True
    assert torch.equal(valid[:, 1], masked if mode == "prefix" else masked & in_block)


def test_window_step_equals_full_forward_on_an_unchanged_canvas():
    """Right after a refresh the cache holds exactly the canvas's keys/values, so a window step on the same
    canvas gives the full forward's block logits (padded batch, both backbones, both modes, groups of rows)."""
    for name in ("tiny-llada", "tiny-dream"):
        bb = tdlm.load_backbone(name)
        ids = torch.randint(8, bb.vocab_size, (3, 7 + 16), generator=torch.Generator().manual_seed(0))
        ids[:, 7:] = bb.mask_token_id
        ids[:, 7:10] = 9
        am = torch.ones_like(ids)
        am[1, :3] = am[2, :1] = 0
        ids[am == 0] = bb.pad_token_id
        starts = torch.tensor([7 + 0, 7 + 8, 7 + 4])
        sel = torch.zeros_like(ids, dtype=torch.bool)
        for r, s in enumerate(starts.tolist()):
            sel[r, s : s + 4] = True
        with torch.inference_mode():
            full = bb(ids, attention_mask=am, select=sel)
            for mode in ("prefix", "dual"):
                kv = SpatialKVCache(mode, 3)
                assert torch.equal(bb(ids, attention_mask=am, select=sel, kv=KVStep(kv, True)), full)
                win = bb(ids, attention_mask=am, select=sel, kv=KVStep.window(kv, starts, 4, 23, bb.logit_shift))
                torch.testing.assert_close(win, full, rtol=1e-4, atol=1e-4)
                rows = torch.tensor([2, 0])  # a group of rows, as in a batch split into refresh and window rows
                part = bb(ids[rows], attention_mask=am[rows], select=sel[rows],
                          kv=KVStep.window(kv, starts[rows], 4, 23, bb.logit_shift, rows))  # fmt: skip
                torch.testing.assert_close(part, full.view(3, 4, -1)[rows].reshape(8, -1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_window_step_over_rows_in_different_blocks_equals_per_row_steps(mode):
    """After the canvas changed since the refresh, a batched window step over rows in different blocks (prefix:
    one shared window; dual: per-row windows) gives each row's own batch-1 window step: a row never reads
    another row's block start, and keeps its cached keys/values left of its own window."""
    for name in ("tiny-llada", "tiny-dream"):
        bb = tdlm.load_backbone(name)
        P, N, bs = 7, 16, 4
        ids = torch.randint(8, bb.vocab_size, (3, P + N), generator=torch.Generator().manual_seed(1))
        ids[:, P:] = bb.mask_token_id
        starts = torch.tensor([0, 8, 4])  # response offsets of each row's active block
        for r, s in enumerate(starts.tolist()):
            ids[r, P : P + s] = 9  # everything before the block is revealed
        am = torch.ones_like(ids)
        am[1, :3] = 0
        ids[am == 0] = bb.pad_token_id
        later = ids.clone()
        for r, s in enumerate(starts.tolist()):
            later[r, P + s : P + s + 2] = 11  # two tokens of the block committed since the refresh
        sel = torch.zeros_like(ids, dtype=torch.bool)
        for r, s in enumerate(starts.tolist()):
            sel[r, P + s : P + s + bs] = True
        with torch.inference_mode():
            kv = SpatialKVCache(mode, 3)
            bb(ids, attention_mask=am, select=sel, kv=KVStep(kv, True))
            got = bb(later, attention_mask=am, select=sel,
                     kv=KVStep.window(kv, P + starts, bs, P + N, bb.logit_shift)).view(3, bs, -1)  # fmt: skip
            for r in range(3):
                row = slice(r, r + 1)
                kv1 = SpatialKVCache(mode, 1)
                bb(ids[row], attention_mask=am[row], select=sel[row], kv=KVStep(kv1, True))
                want = bb(later[row], attention_mask=am[row], select=sel[row],
                          kv=KVStep.window(kv1, P + starts[row], bs, P + N, bb.logit_shift))  # fmt: skip
                torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
            full = bb(later, attention_mask=am, select=sel).view(3, bs, -1)
            assert not torch.allclose(got, full, rtol=1e-3, atol=1e-3)  # the cached entries are stale: it is a cache


# -- 3. the LM head runs only on the read positions ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
def test_lm_head_runs_only_on_the_active_block(mode, monkeypatch):
    for name in ("tiny-llada", "tiny-dream"):
        bb = sharp_backbone(name)
        rows_seen = []

        def counted(h, project=bb.project, seen=rows_seen):
            seen.append(h.shape[:-1])
            return project(h)

        monkeypatch.setattr(bb, "project", counted)
        res = decode(bb, PROMPTS, policy="threshold", threshold=TAU, cache=mode, **KW)
        assert rows_seen and all(len(s) == 2 and s[1] == 8 for s in rows_seen)  # (b_g, block) rows only
        assert sum(s[0] * s[1] for s in rows_seen) == 8 * sum(r.nfe for r in res)


# -- 4. bad input -----------------------------------------------------------------------------------------------
def test_bad_cache_settings_are_one_line_errors(tmp_path):
    bb = tdlm.load_backbone("tiny-llada")
    cases = [
        (dict(cache="triple"), r"cache 'triple' unknown; expected one of none, prefix, dual"),
        (dict(cache="dual", gen_length=30, block_size=8),
         r"gen_length=30 must be a multiple of block_size=8 \(cache 'dual' .*\); allowed block sizes: 1, 2, 3, 5"),
    ]  # fmt: skip
    for kw, msg in cases:
        section = DecodeSettings(gen_length=kw.get("gen_length", 256), block_size=kw.get("block_size", 32))
        evalkw = dict(caches=[kw["cache"]], decode=section)
        for check, args in ((decode, (bb, PROMPTS)), (lambda **k: DecodeConfig(**k).validate(), ()),
                            (lambda **k: GenerationConfig("tiny-llada", "p.jsonl", "o",
                                                          decode=DecodeSettings(**k)).validate(), ()),
                            (lambda: EvalConfig("tiny-llada", "o", **evalkw).validate(), None)):  # noqa: B023
            with pytest.raises(tdlm.TDLMError, match=msg) as e:
                check() if args is None else check(*args, **kw)
            assert "\n" not in str(e.value)

    class NoCache(type(bb)):
        supports_kv_cache = False

    plain = NoCache(bb.cfg)
    plain.load_state_dict(bb.state_dict())  # the preset's weights (a fresh init could decode the mask token forever)
    with pytest.raises(tdlm.TDLMError, match=r"cache='prefix': backbone NoCache has no spatial KV cache path; "
                                             r"allowed caches for it: none"):  # fmt: skip
        decode(plain, PROMPTS, cache="prefix", **KW)
    decode(plain, PROMPTS[:1], cache="none", **KW)  # no cache: fine
    latent = tdlm.TDLM(bb, tdlm.TemporalConfig(layers="all", history="latent:2"))
    with pytest.raises(tdlm.TDLMError, match=r"cache='dual' cannot serve history latent:2.*allowed caches with it"):
        decode(latent, PROMPTS, policy="tdlm", cache="dual", **KW)
    kv = SpatialKVCache("dual", 1)
    with pytest.raises(tdlm.TDLMError, match="no entries for layer 0; a block starts with a refresh"):
        bb(torch.full((1, 12), 5), kv=KVStep.window(kv, torch.tensor([4]), 4, 12, 0))
    bb(torch.full((1, 12), 5), kv=KVStep(kv, True))
    with pytest.raises(tdlm.TDLMError, match="window step needs select"):
        bb(torch.full((1, 12), 5), kv=KVStep.window(kv, torch.tensor([4]), 4, 12, 0))
    with pytest.raises(tdlm.TDLMError, match="cache_policies: policy 'fast' unknown"):
        EvalConfig("tiny-llada", "o", caches=["dual"], cache_policies=["fast"]).validate()


# -- 5. evaluation: cached variants are rows and Pareto points ------------------------------------------------
def test_cached_runs_are_rows_labelled_with_their_cache(tmp_path):
    model = tdlm.TDLM(tdlm.load_backbone("tiny-llada"), tdlm.TemporalConfig(layers="all", heads=2, head_dim=8))
    adapter = str(model.save_adapter(tmp_path / "a"))
    from tdlm.config import load_config

    cfg = load_config(EvalConfig, Path(__file__).resolve().parents[1] / "configs" / "eval_llada_table1.yaml")
    cfg = dataclasses.replace(cfg, backbone="tiny-llada", adapters=[adapter], tasks=["gsm8k"]).validate()
    runs = expand(cfg)
    assert [r.name for r in runs] == ["original", "threshold-tau0.9", "threshold-tau0.9-dual", "entropy-H0.5",
                                      "credit-tau0.9", "soft-tau0.9",
                                      "tdlm-a-tau0.9-full", "tdlm-a-tau0.9-full-dual"]  # fmt: skip
    assert [r.settings(cfg).cache for r in runs] == ["none", "none", "dual", "none", "none", "none", "none",
                                                     "dual"]  # fmt: skip
    assert "cache" not in runs[1].settings(cfg).to_dict()  # uncached identities read as before the field
    rows = [dict(r.to_dict(), accuracy=0.5, nfe_mean=float(10 + i), seconds_mean=1.0 / (i + 1), n=1,
                 backbone="b", gen_length=256, block_size=32) for i, r in enumerate(runs)]  # fmt: skip
    compute_speedups(rows)
    labels = [method_label(r) for r in rows]
    assert labels[2] == "Fast-dLLM τ=0.9 + dual cache" and labels[7] == "TDLM τ=0.9 [a, full] + dual cache"
    assert rows[7]["nfe_ratio_vs_threshold"] == pytest.approx(12 / 17)  # vs Fast-dLLM with the same cache
    assert rows[6]["nfe_ratio_vs_threshold"] == pytest.approx(11 / 16)  # vs the uncached threshold
    assert rows[2]["nfe_ratio_vs_original"] == pytest.approx(10 / 12)  # original is always the uncached one
    table = render(rows).split("## All runs")[0]
    assert all(f"| {label} |" in table for label in labels)
    assert len({family(r) for r in rows}) == 8  # one Pareto line per method and cache


# -- 5. last:k is per position in every cache mode (issue 21, item 6) ---------------------------------------------
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_last_k_keeps_k_usable_entries_per_position_with_and_without_the_dual_cache(name, k, monkeypatch):
    """What the first evaluation of block b >= k reads: every masked position holds exactly k usable entries,
    with cache none and with the dual cache. Under the dual cache a window step does not compute the positions
    outside the block; they keep their own k most recent evaluations (a ring per position: the refreshes of
    the blocks before), so the restriction of Table 2 means the same thing in both modes. A ring shared by all
    positions leaves them 0 entries at the refresh after a dual window step (the issue's 0 against 8)."""
    from tdlm.temporal.history import TemporalCache

    bb = sharp_backbone(name)
    model = live_tdlm(bb, history=f"last:{k}")
    G, bs = 32, 8
    counts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    commit = TemporalCache.commit

    def recording(self, masked, written=None, slot=None):
        commit(self, masked, written, slot)
        # commit sees the storage columns' m_{i,p}; by position again after a compaction dropped revealed ones
        counts[mode].append((self.by_position(masked)[0].clone(), self.valid_entries()[0].clone()))

    monkeypatch.setattr(TemporalCache, "commit", recording)
    for mode in ("none", "dual"):
        counts[mode] = []
        decode(model, [PROMPTS[0]], policy="tdlm", threshold=0.95, cache=mode, gen_length=G, block_size=bs)
    for mode, steps in counts.items():
        checked, prev_block = 0, 0
        for (_, usable), (masked, _) in zip(steps, steps[1:], strict=False):  # state read by the next evaluation
            block = int(masked.int().argmax()) // bs
            if block != prev_block and block >= k:  # a block's first evaluation (the refresh under dual)
                assert torch.equal(usable[masked], torch.full_like(usable[masked], k)), (mode, block, usable)
                checked += 1
            prev_block = block
        assert checked >= 2, (mode, checked)


# -- 6. storage columns: revealed positions leave the history (issue 26) ----------------------------------------
@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
def test_dropping_revealed_positions_from_the_history_changes_no_token(mode, monkeypatch):
    """Between evaluations the loop drops the storage columns of revealed positions (TemporalCache.compact): a
    revealed position is never masked again, so Eq. 2 never corrects it and its entries are never read. The
    decode with compaction equals the decode without it, token for token and NFE for NFE, with every spatial
    cache (the window steps find their positions' columns), and the storage did shrink."""
    from tdlm.temporal.history import TemporalCache

    model = live_tdlm(sharp_backbone("tiny-llada"), history="full")
    kw = {"policy": "tdlm", "threshold": 0.9, "cache": mode, "gen_length": 32, "block_size": 8}
    widths: list[int] = []
    compact = TemporalCache.compact

    def recording(self, still, most):
        done = compact(self, still, most)
        if done:
            widths.append(self.width)
        return done

    monkeypatch.setattr(TemporalCache, "compact", recording)
    with torch.no_grad():
        on = decode(model, PROMPTS, **kw)
    monkeypatch.setattr(TemporalCache, "compact", lambda self, still, most: False)
    with torch.no_grad():
        off = decode(model, PROMPTS, **kw)
    assert widths and widths == sorted(widths, reverse=True) and widths[-1] < 32, widths
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert [r.nfe for r in on] == [r.nfe for r in off] and [r.reveal_step for r in on] == [r.reveal_step for r in off]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_window_steps_over_the_history_front_equal_the_gathered_columns(name, mode, monkeypatch):
    """A window step attends over a narrow view of the history's first columns (TemporalCache.set_front, from the
    loop's blocks: window_front) instead of gathering its positions' columns. Every evaluation's logits equal those
    of the decode that gathers (fp32, 1e-5), and so do tokens, NFE and reveal steps, with rows in different blocks
    and rows that changed block since the last compaction; Dream's window reaches one position past its block."""
    from tdlm.temporal.history import TemporalCache

    model = live_tdlm(sharp_backbone(name), history="full")
    kw = {"policy": "tdlm", "threshold": 0.9, "cache": mode, "gen_length": 32, "block_size": 8}
    forward_groups = tdlm.TDLM.forward_groups
    runs: dict[str, list] = {"front": [], "gather": []}
    fronts: list[int] = []

    def recording(key):
        def run(self, prompt_len, cache, groups, evaluate=None):
            if cache.front is not None and any(g.kv is not None and not g.kv.refresh for g in groups):
                fronts.append(cache.front.shape[1])
            outs = forward_groups(self, prompt_len, cache, groups, evaluate)
            runs[key].append([o.clone() for o in outs])
            return outs
        return run

    monkeypatch.setattr(tdlm.TDLM, "forward_groups", recording("front"))
    with torch.no_grad():
        on = decode(model, PROMPTS, **kw)
    monkeypatch.setattr(TemporalCache, "set_front", lambda self, columns, aligned=False: setattr(self, "front", None))
    monkeypatch.setattr(tdlm.TDLM, "forward_groups", recording("gather"))
    with torch.no_grad():
        off = decode(model, PROMPTS, **kw)
    assert len(fronts) >= 3 and (mode == "prefix" or min(fronts) < 32), fronts
    _same_decode(on, off, runs["front"], runs["gather"])


def _same_decode(on, off, logits_on: list, logits_off: list) -> None:
    """Two decodes of the same requests agree: tokens, NFE and reveal steps, and every evaluation's logits (fp32,
    1e-5)."""
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert [r.nfe for r in on] == [r.nfe for r in off] and [r.reveal_step for r in on] == [r.reveal_step for r in off]
    assert len(logits_on) == len(logits_off)
    for a, b in zip(logits_on, logits_off, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,alignment", [("tiny-llada", "prediction"), ("tiny-dream", "prediction"),
                                            ("tiny-dream", "position")])  # fmt: skip
def test_a_single_row_under_the_dual_cache_reads_its_history_rows_as_a_slice(name, alignment, monkeypatch):
    """One row under the dual cache: its history's columns are its rows from the active block's start, in order
    (the loop's promise: TemporalCache.claim_rows, set_front(aligned=True)), so every temporal layer reads a slice
    of h and corrects it in place, with no gather and no scatter-add (correct_at is never called). Every
    evaluation's logits equal those of the decode that gathers and scatters (fp32, 1e-5), and so do tokens, NFE
    and reveal steps: over block changes (3 blocks), the refresh after each, the window steps, with Dream's
    window one row longer and, under position alignment, shifted by one row."""
    from tdlm.temporal.attention import TemporalAttention
    from tdlm.temporal.history import TemporalCache

    model = live_tdlm(sharp_backbone(name), history="full")
    model.config.alignment = alignment
    model.offset = model.backbone.logit_shift if alignment == "prediction" else 0
    kw = {"policy": "tdlm", "threshold": 0.9, "cache": "dual", "gen_length": 24, "block_size": 8}
    forward_groups, correct_at = tdlm.TDLM.forward_groups, TemporalAttention.correct_at
    runs: dict[str, list] = {"slice": [], "gather": []}
    scattered = {"slice": 0, "gather": 0}

    def recording(key):
        def run(self, prompt_len, cache, groups, evaluate=None):
            outs = forward_groups(self, prompt_len, cache, groups, evaluate)
            runs[key].append([o.clone() for o in outs])
            return outs

        def scatter(self, *a, **k):
            scattered[key] += 1
            return correct_at(self, *a, **k)
        monkeypatch.setattr(tdlm.TDLM, "forward_groups", run)
        monkeypatch.setattr(TemporalAttention, "correct_at", scatter)

    recording("slice")
    with torch.no_grad():
        on = decode(model, [PROMPTS[0]], **kw)
    set_front = TemporalCache.set_front
    monkeypatch.setattr(TemporalCache, "claim_rows", lambda self, suffix: None)  # no promise: gather and scatter
    monkeypatch.setattr(TemporalCache, "set_front", lambda self, columns, aligned=False: set_front(self, columns))
    recording("gather")
    with torch.no_grad():
        off = decode(model, [PROMPTS[0]], **kw)
    assert on[0].nfe > 3 * 2, "too few evaluations: the test needs window steps in every block"
    assert scattered["slice"] == 0 and scattered["gather"] > 0, scattered
    _same_decode(on, off, runs["slice"], runs["gather"])
