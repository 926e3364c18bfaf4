"""One blockwise decoding loop for teacher generation, evaluation and the demo (paper Section 2.4).

The canvas of each request is ``prompt + gen_length`` mask tokens; the response is split into blocks
of ``block_size`` and a row works on the first block that still has masks ("active block"). Each
denoiser evaluation is one NFE. The commit rule decides which masked positions of the active block
receive their greedy token:

* ``original``  - the single most confident position (LLaDA low-confidence remasking, temperature 0:
  one token per evaluation, so T = gen_length);
* ``threshold`` - Fast-dLLM / Eq. (6): every position with confidence > tau, else the most confident;
* ``tdlm``      - the threshold rule on a :class:`tdlm.TDLM` with its temporal cache (every masked
  response position accumulates history, also outside the active block; revealing a position
  invalidates its history; changing blocks resets nothing);
* ``entropy``   - d3LLM-style: every position whose predictive entropy < H, else the most confident.

Confidence is the softmax probability of the greedy token, computed in float64. Batches are
left-padded with an attention mask; every row commits its own positions and counts its own NFE, and
rows leave the batch when they finish, so a batched run equals per-sample runs. The LM head runs only
on the active block's positions (the only logits read).

Spatial KV cache (``cache``, :mod:`tdlm.models.kv_cache`; Fast-dLLM's ``generate_with_prefix_cache`` /
``generate_with_dual_cache`` at temperature 0). ``none`` evaluates the whole canvas every time. With
``prefix`` or ``dual`` the first evaluation of each block (per row) is a *refresh*: a full forward that
stores every position's keys/values at every layer and commits by the policy's rule like any other
evaluation (one NFE). Each later evaluation of the block computes only a window - ``prefix``: the block and
everything after it; ``dual``: the block alone - attending to the cached keys/values of the other positions
(Dream's window starts one position earlier: its block logits come from the hidden states to the left).
Rows of one batch at a refresh and at a window step run as two forwards of one evaluation
(:meth:`tdlm.TDLM.forward_groups`). Two deliberate differences from Fast-dLLM's code: the threshold rule
keeps this repository's strict ``>`` (Eq. 6; Fast-dLLM tests ``>=``), and a block that its refresh already
completes gets no further evaluation (Fast-dLLM runs one more cached forward there that commits nothing
and counts it). With ``policy="tdlm"`` a masked position gains a history entry from an evaluation only if
that evaluation computes it: every masked position at a refresh and at a ``prefix`` step, the active
block's positions at a ``dual`` step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tdlm.errors import TDLMError
from tdlm.models.common import Backbone
from tdlm.models.kv_cache import CACHE_MODES, KVStep, SpatialKVCache, check_cache_mode
from tdlm.temporal.model import TDLM, StepGroup

POLICIES = ("original", "threshold", "tdlm", "entropy")


@dataclass
class DecodeConfig:
    """Decoding settings (paper Section 3.1 defaults: 256 tokens, block 32, tau 0.9, H 0.5)."""

    policy: str = "threshold"  # original | threshold | tdlm | entropy
    gen_length: int = 256  # response tokens N
    block_size: int = 32
    threshold: float = 0.9  # tau of Eq. (6) for threshold / tdlm
    entropy_threshold: float = 0.5  # H for the entropy rule
    stop_at_eos: bool = False  # paper setting: no early stop
    cache: str = "none"  # spatial KV cache: none | prefix | dual (Fast-dLLM; tdlm/models/kv_cache.py)

    def validate(self) -> DecodeConfig:
        if self.policy not in POLICIES:
            raise TDLMError(f"decode policy {self.policy!r} unknown; expected one of {', '.join(POLICIES)}")
        check_cache_mode(self.cache)
        if self.gen_length < 1 or self.block_size < 1:
            raise TDLMError(f"gen_length and block_size must be >= 1; got {self.gen_length}, {self.block_size}")
        if self.gen_length % self.block_size:
            divisors = [d for d in range(1, self.gen_length + 1) if self.gen_length % d == 0]
            why = f" (cache {self.cache!r} refreshes at every block start)" if self.cache != "none" else ""
            raise TDLMError(
                f"gen_length={self.gen_length} must be a multiple of block_size={self.block_size}{why}; "
                f"allowed block sizes: {', '.join(map(str, divisors))}"
            )
        return self

    def to_dict(self) -> dict:
        """The settings as a dict; ``cache`` only when one is used, so uncached settings read as before it existed
        (run identities and trajectory ``decode_settings`` written earlier still match)."""
        d = dataclasses.asdict(self)
        if d["cache"] == "none":
            del d["cache"]
        return d


@dataclass
class DecodeResult:
    """One request's generation and its trajectory (Section 2.3)."""

    tokens: list[int]  # the gen_length response tokens y_p
    text: str  # decoded response, cut at the first stop token
    nfe: int  # denoiser evaluations of this request
    seconds: float  # wall seconds from the batch start to this request's end (device-synchronized)
    reveal_step: list[int]  # a_p in 1..T: the evaluation after which y_p was committed
    T: int  # trajectory length in evaluations (== nfe)
    prompt_ids: list[int] = field(default_factory=list)
    states: list[list[int]] | None = None  # evaluated response inputs, only with record_states=True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _select(
    conf: torch.Tensor, cand: torch.Tensor, rule: str, cfg: DecodeConfig, entropy: torch.Tensor | None
) -> torch.Tensor:
    """Positions to commit (b, bs) bool among candidates ``cand`` given float64 confidences."""
    conf = conf.masked_fill(~cand, -1.0)
    top = torch.zeros_like(cand)
    top.scatter_(1, conf.argmax(1, keepdim=True), True)
    top &= cand
    if rule == "original":
        return top
    if rule == "entropy":
        sel = cand & (entropy < cfg.entropy_threshold)
    else:
        sel = cand & (conf > cfg.threshold)
    none = ~sel.any(1, keepdim=True)
    return torch.where(none, top, sel)


def _rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t[rows]


def _groups(
    kv_cache: SpatialKVCache | None,
    kv_block: torch.Tensor,
    active: torch.Tensor,
    blk: torch.Tensor,
    block_start: torch.Tensor,
    bs: int,
    L: int,
    shift: int,
) -> list[tuple[torch.Tensor | None, KVStep | None]]:
    """(rows, KV step) of the forwards of one evaluation: one without a cache; with one, the rows whose
    block starts (a refresh) and the rows inside a block (a window step), each group only if present."""
    if kv_cache is None:
        return [(None, None)]
    refresh = kv_block[active] != blk
    kv_block[active] = blk
    if bool(refresh.all()):
        return [(None, KVStep(kv_cache, True))]
    if not bool(refresh.any()):
        return [(None, KVStep.window(kv_cache, block_start, bs, L, shift))]
    r1, r0 = refresh.nonzero().flatten(), (~refresh).nonzero().flatten()
    return [(r1, KVStep(kv_cache, True, rows=r1)), (r0, KVStep.window(kv_cache, block_start[r0], bs, L, shift, r0))]


def _merge_logits(groups: list, outs: list[torch.Tensor], b: int, bs: int) -> torch.Tensor:
    """(b, bs, V) block logits from each group's selected (S_g, V) logits (each row selects its bs block positions)."""
    if len(groups) == 1:
        return outs[0].view(b, bs, -1)
    merged = outs[0].new_empty((b, bs, outs[0].shape[-1]))
    for (rows, _), out in zip(groups, outs, strict=True):
        merged[rows] = out.view(rows.numel(), bs, -1)
    return merged


@torch.inference_mode()
def decode(
    model: Backbone | TDLM,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig | None = None,
    *,
    tokenizer=None,
    stop_ids: set[int] | None = None,
    progress: bool = False,
    record_states: bool = False,
    **overrides,
) -> list[DecodeResult]:
    """Decode a batch of prompts (token-id lists); returns one :class:`DecodeResult` per prompt.

    ``overrides`` set :class:`DecodeConfig` fields (``policy=``, ``threshold=`` ...); unknown names
    are errors. ``policy="tdlm"`` needs a :class:`TDLM`; other policies run the plain backbone (a
    TDLM's own backbone if one is given).
    """
    try:
        cfg = dataclasses.replace(config or DecodeConfig(), **overrides).validate()
    except TypeError as e:
        raise TDLMError(f"decode: {e}") from e
    if cfg.policy == "tdlm":
        if not isinstance(model, TDLM):
            raise TDLMError("decode policy 'tdlm' needs a tdlm.TDLM model (backbone + temporal adapter)")
        backbone = model.backbone
    else:
        backbone = model.backbone if isinstance(model, TDLM) else model
    if cfg.cache != "none":
        if not getattr(backbone, "supports_kv_cache", False):
            raise TDLMError(f"cache={cfg.cache!r}: backbone {type(backbone).__name__} has no spatial KV cache path; "
                            f"allowed caches for it: none (with a cache: {', '.join(CACHE_MODES[1:])} on LLaDA, "
                            f"Dream)")  # fmt: skip
        if cfg.cache == "dual" and cfg.policy == "tdlm" and model.policy.recurrent:
            raise TDLMError(f"cache='dual' cannot serve history {model.policy} (its latents keep one progress count "
                            f"per request); allowed caches with it: none, prefix")  # fmt: skip
    if not prompts:
        return []
    bad = [i for i, p in enumerate(prompts) if len(p) == 0]
    if bad:
        raise TDLMError(f"decode: prompt(s) {bad} are empty; every request needs at least one prompt token")
    device = next(backbone.parameters()).device
    mask_id, G, bs = backbone.mask_token_id, cfg.gen_length, cfg.block_size
    stops = set(stop_ids) if stop_ids is not None else {backbone.eos_token_id}
    B = len(prompts)
    P = max(len(p) for p in prompts)
    L = P + G
    ids = torch.full((B, L), backbone.pad_token_id, dtype=torch.long, device=device)
    am = torch.zeros((B, L), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        am[i, P - len(p) :] = 1
    ids[:, P:] = mask_id
    padded = bool((am == 0).any())
    reveal = torch.zeros((B, G), dtype=torch.long, device=device)
    nfe = torch.zeros(B, dtype=torch.long, device=device)
    seconds = [0.0] * B
    states: list[list[list[int]]] = [[] for _ in range(B)]
    active = torch.arange(B, device=device)
    cache = model.new_cache(B) if cfg.policy == "tdlm" else None
    kv_cache = SpatialKVCache(cfg.cache, B) if cfg.cache != "none" else None
    kv_block = torch.full((B,), -1, dtype=torch.long, device=device)  # the block each row's KV cache holds
    pos_block = torch.arange(G, device=device) // bs  # (G,)
    stop_t = torch.tensor(sorted(stops), device=device)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=B * G, desc=f"decode[{cfg.policy}]", unit="tok", leave=False)
    _sync(device)
    t0 = time.perf_counter()
    while active.numel():
        x = ids[active]  # (b, L)
        a_mask = am[active] if padded else None
        if record_states:
            for r, row in zip(active.tolist(), x[:, P:].tolist(), strict=True):
                states[r].append(row)
        resp = x[:, P:]  # (b, G)
        masked = resp == mask_id
        blk = masked.int().argmax(1)  # first masked position ...
        blk = pos_block[blk]  # ... gives the active block (b,)
        start = blk * bs
        idx = start[:, None] + torch.arange(bs, device=device)  # (b, bs) response positions of the block
        cand = masked.gather(1, idx)
        select = torch.zeros_like(x, dtype=torch.bool).scatter_(1, P + idx, True)  # the logits read
        groups = _groups(kv_cache, kv_block, active, blk, P + start, bs, L, backbone.logit_shift)
        if cache is not None:
            outs = model.forward_groups(P, cache, [
                StepGroup(_rows(x, r), _rows(a_mask, r), _rows(select, r), step, r) for r, step in groups
            ])  # fmt: skip
        else:
            outs = [backbone(_rows(x, r), attention_mask=_rows(a_mask, r), select=_rows(select, r), kv=step)
                    for r, step in groups]  # fmt: skip
        blk_logits = _merge_logits(groups, outs, x.shape[0], bs)  # (b, bs, V)
        nfe[active] += 1
        logp = torch.log_softmax(blk_logits.double(), dim=-1)
        conf, x0 = logp.max(-1)
        conf = conf.exp()  # float64 probability of the greedy token
        entropy = -(logp.exp() * logp).sum(-1) if cfg.policy == "entropy" else None
        commit = _select(conf, cand, cfg.policy, cfg, entropy)  # (b, bs)
        new_resp = resp.clone()
        new_resp.scatter_(1, idx, torch.where(commit, x0, resp.gather(1, idx)))
        rows_reveal = reveal[active]
        rows_reveal.scatter_(1, idx, torch.where(commit, nfe[active, None].expand_as(idx), rows_reveal.gather(1, idx)))
        still = new_resp == mask_id
        if cfg.stop_at_eos:
            # Done once a stop token is committed and everything before it is revealed: the rest is
            # filled with EOS without further evaluations (revealed at this step).
            is_stop = torch.isin(new_resp, stop_t) & ~still
            first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), torch.full_like(blk, G))
            before = torch.arange(G, device=device)[None] < first_stop[:, None]
            early = is_stop.any(1) & ~(still & before).any(1)
            fill = still & early[:, None]
            new_resp = torch.where(fill, torch.full_like(new_resp, backbone.eos_token_id), new_resp)
            rows_reveal = torch.where(fill, nfe[active, None].expand_as(rows_reveal), rows_reveal)
            still = new_resp == mask_id
        ids[active, P:] = new_resp
        reveal[active] = rows_reveal
        if bar is not None:
            bar.update(int((masked.sum() - still.sum()).item()))
        done = ~still.any(1)
        if bool(done.any()):
            _sync(device)
            now = time.perf_counter() - t0
            for r in active[done].tolist():
                seconds[r] = now
            keep = (~done).nonzero().flatten()
            active = active[keep]
            if cache is not None and active.numel():
                cache.select(keep)
            if kv_cache is not None and active.numel():
                kv_cache.select(keep)
    if bar is not None:
        bar.close()
    results = []
    for i, p in enumerate(prompts):
        toks = ids[i, P:].tolist()
        cut = next((j for j, t in enumerate(toks) if t in stops), len(toks))
        text = tokenizer.decode(toks[:cut], skip_special_tokens=True) if tokenizer is not None else ""
        results.append(
            DecodeResult(
                tokens=toks,
                text=text,
                nfe=int(nfe[i]),
                seconds=seconds[i],
                reveal_step=reveal[i].tolist(),
                T=int(nfe[i]),
                prompt_ids=[int(t) for t in p],
                states=states[i] if record_states else None,
            )
        )
    return results
