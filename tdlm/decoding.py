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
rows leave the batch when they finish, so a batched run equals per-sample runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tdlm.errors import TDLMError
from tdlm.model import TDLM
from tdlm.models.common import Backbone

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

    def validate(self) -> DecodeConfig:
        if self.policy not in POLICIES:
            raise TDLMError(f"decode policy {self.policy!r} unknown; expected one of {', '.join(POLICIES)}")
        if self.gen_length < 1 or self.block_size < 1:
            raise TDLMError(f"gen_length and block_size must be >= 1; got {self.gen_length}, {self.block_size}")
        if self.gen_length % self.block_size:
            raise TDLMError(
                f"gen_length={self.gen_length} must be a multiple of block_size={self.block_size}"
            )
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        if cache is not None:
            logits = model.forward_step(x, P, cache, attention_mask=a_mask)
        else:
            logits = backbone(x, attention_mask=a_mask)
        nfe[active] += 1
        resp = x[:, P:]  # (b, G)
        masked = resp == mask_id
        blk = masked.int().argmax(1)  # first masked position ...
        blk = pos_block[blk]  # ... gives the active block (b,)
        start = blk * bs
        idx = start[:, None] + torch.arange(bs, device=device)  # (b, bs) response positions of the block
        cand = masked.gather(1, idx)
        blk_logits = logits[:, P:].gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))  # (b, bs, V)
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
