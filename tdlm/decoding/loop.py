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
* ``entropy``   - d3LLM-style: every position whose predictive entropy < H, else the most confident;
* ``credit`` / ``soft`` - dInfer's training-free reuse of earlier evaluations with the threshold rule: credit
  added to the logits, or the previous predictions mixed into the masked inputs (:mod:`tdlm.decoding.reuse`).

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

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tdlm.decoding.compiled import (
    RECOMPILE_LIMIT,
    backbone_eval,
    block_regions,
    compiled_steps,
    evaluate_written_out,
    graphs_compiled,
    regions_on,
)
from tdlm.decoding.config import (  # noqa: F401 - re-exported: the settings' historical home
    COMPILE_SCOPES,
    CUDA_GRAPH_MODES,
    POLICIES,
    STORAGE_PLANS,
    DecodeConfig,
    check_compile,
)
from tdlm.decoding.plans import DynamicRows, StaticSlots
from tdlm.decoding.static_plan import prompt_bucket
from tdlm.decoding.step_groups import index_tensor, merge_logits, rows_of, step_groups, window_front
from tdlm.errors import TDLMError
from tdlm.models.common import Backbone
from tdlm.models.kv_cache import CACHE_MODES
from tdlm.temporal.history import column_bucket
from tdlm.temporal.model import TDLM, StepGroup


@dataclass
class DecodeResult:
    """One request's generation and its trajectory (Section 2.3)."""

    tokens: list[int]  # the gen_length response tokens y_p
    text: str  # decoded response, cut at the first stop token
    nfe: int  # denoiser evaluations of this request
    seconds: float  # wall seconds from the request's admission to its end (device-synchronized)
    reveal_step: list[int]  # a_p in 1..T: the evaluation after which y_p was committed
    T: int  # trajectory length in evaluations (== nfe)
    prompt_ids: list[int] = field(default_factory=list)
    states: list[list[int]] | None = None  # evaluated response inputs, only with record_states=True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _select(conf: torch.Tensor, cand: torch.Tensor, rule: str, cfg: DecodeConfig, entropy: torch.Tensor | None,
            tau: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Positions to commit (b, bs) bool among candidates ``cand`` given float64 confidences (``tau``: per-row
    thresholds (b, 1) instead of ``cfg.threshold``)."""
    conf = conf.masked_fill(~cand, -1.0)
    top = torch.zeros_like(cand)
    top.scatter_(1, conf.argmax(1, keepdim=True), True)
    top &= cand
    if rule == "original":
        return top
    if rule == "entropy":
        sel = cand & (entropy < cfg.entropy_threshold)
    else:
        sel = cand & (conf > (cfg.threshold if tau is None else tau))
    none = ~sel.any(1, keepdim=True)
    return torch.where(none, top, sel)


@dataclass
class EngineStats:
    """Row-evaluations of a decode, summed over its evaluations: ``slots`` the rows the batch could hold (the batch
    size, or the static plan's bucket), ``rows`` the rows computed, ``useful`` those that still had a masked position.
    A fixed chunk shrinks (dynamic plan) or keeps its finished rows (static plan) until its slowest row ends; refill
    gives their slots to the next requests. ``admissions``: requests admitted after a group's first fill."""

    evaluations: int = 0
    slots: int = 0
    rows: int = 0
    useful: int = 0
    admissions: int = 0

    @property
    def occupancy(self) -> float:
        """Useful row-evaluations / the batch's slots over all evaluations."""
        return self.useful / self.slots if self.slots else 0.0


@dataclass
class _Row:
    """Host mirror of one batch row: its request (-1: a padding row of the static plan), slot, active block, the
    block its spatial KV cache holds (-1: none), masked count, block and masked count at its history's last
    compaction (:func:`window_front`), admission time, evaluations since admission, and whether it is done."""

    req: int
    slot: int
    blk: int
    kv: int = -1
    left: int = 0
    comp_blk: int = 0
    comp_in: int = 0
    start: float = 0.0
    evals: int = 0
    done: bool = False


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
    canvas: Sequence[Sequence[int]] | None = None,
    batch_size: int | None = None,
    on_result: Callable[[int, DecodeResult], None] | None = None,
    stats: EngineStats | None = None,
    **overrides,
) -> list[DecodeResult]:
    """Decode prompts (token-id lists); returns one :class:`DecodeResult` per prompt, in prompt order.

    ``batch_size`` None decodes every prompt in one batch. A ``batch_size`` below the number of prompts runs the
    engine with refill (continuous batching): the prompts are grouped by prompt bucket (32 tokens; ascending, each
    group its own canvas) and admitted in prompt order; a row that finishes frees its slot, and the next prompt is
    written into it between two evaluations (its first evaluation is a full refresh, which doubles as its prefill),
    so no evaluation waits for a chunk's slowest row. A request's tokens, NFE and reveal steps do not depend on the
    rows beside it (every row commits and counts its own), so they equal a per-prompt decode whatever the batch
    size or arrival order. ``on_result(i, result)`` is called as prompt i finishes (a worker appends its record
    then); ``stats`` (an :class:`EngineStats`) receives the row-evaluation counts.

    ``overrides`` set :class:`DecodeConfig` fields (``policy=``, ``threshold=`` ...); unknown names
    are errors. ``policy="tdlm"`` needs a :class:`TDLM`; other policies run the plain backbone (a
    TDLM's own backbone if one is given).

    The step is static: within a block every evaluation has the same shapes (the LM head gathers the
    block's positions by index, the temporal history is stored in the attention's layout in buckets of 8, 16,
    32, ... slots up to gen_length, or k for ``last:k``, with the slot count marked dynamic for the compiler,
    and its validity is a mask; padding is an always-present mask, or None when no row is padded).
    The host reads the device once per evaluation: the stop check, which also brings back each
    row's next active block (the host decides refresh / window from it) and its masked count (progress).
    ``record_states=True`` adds a read of the states. With ``compile`` each step kind is one
    ``fullgraph=True`` graph: backbone / TDLM x {uncached, refresh, prefix window, dual window} x
    {unpadded, padded}, and a refresh of some rows next to a window step of the others (batches only).
    Per decode of one request batch a kind compiles at most twice more: once when its first call differs
    (the spatial KV cache's first refresh allocates its storage; a prefix window's width changes with the
    block, after which dynamo makes it dynamic) and once when rows leave the batch (the batch size becomes
    dynamic); the history's bucket changes compile nothing (its slot count is dynamic from the start). So batch
    1, 256 tokens in blocks of 32: at most 3 graphs uncached, 4 with a cache, whatever the number of steps, blocks
    or buckets. With ``compile_scope="block"`` the loop and these steps run eagerly and the kinds above are guards of
    the compiled block regions instead (:func:`block_regions`): one graph per region and kind, shared by every layer.
    ``canvas`` continues partial responses: one list of ``gen_length`` token ids per prompt, the
    backbone's mask id where the decode is to fill in (at least one per row); its other tokens stay, with reveal
    step 0, and NFE and reveal steps count from this decode (an on-policy roll-out, :mod:`tdlm.data.onpolicy`; the
    backbone's own policies only). ``seconds`` run from the request's admission to its end and exclude compilation:
    the wall time of every evaluation during which a graph was compiled is subtracted (with ``reduce-overhead`` the
    CUDA graph recording of the first calls is not: decode once to warm up, then time).
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
    device = next(backbone.parameters()).device
    spec = check_compile(cfg.compile, device)
    if cfg.policy == "tdlm":
        cfg.check_history(model.policy)
    if spec is not None and cfg.policy == "tdlm" and model.policy.recurrent:
        raise TDLMError(f"compile={cfg.compile!r} does not cover history {model.policy} (a recurrent latent "
                        f"memory); decode it with compile=False")  # fmt: skip
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise TDLMError(f"decode: batch_size must be a positive integer or None; got {batch_size!r}")
    if not prompts:
        return []
    bad = [i for i, p in enumerate(prompts) if len(p) == 0]
    if bad:
        raise TDLMError(f"decode: prompt(s) {bad} are empty; every request needs at least one prompt token")
    if canvas is not None:
        _check_canvas(canvas, len(prompts), cfg, backbone.mask_token_id)
    n = len(prompts)
    if batch_size is None or batch_size >= n:
        groups = [list(range(n))]  # one batch, one canvas
    else:  # one canvas per prompt bucket, ascending; prompt order within each
        buckets: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            buckets.setdefault(prompt_bucket(len(p)), []).append(i)
        groups = [buckets[k] for k in sorted(buckets)]
    run = _Run(model, backbone, cfg, device, tokenizer, stop_ids, record_states, on_result,
               stats if stats is not None else EngineStats())  # fmt: skip
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n * cfg.gen_length, desc=f"decode[{cfg.policy}]", unit="tok", leave=False)
    results: list[DecodeResult | None] = [None] * n
    steps, graphs, patch, regions = None, False, contextlib.nullcontext(), None
    if spec is not None and cfg.compile_scope == "block":
        # the loop and the step functions stay eager; the backbone's layers run the compiled regions. Inductor's
        # temporal step takes the written-out attention, as the model scope's does (TDLM.evaluate_groups).
        regions = block_regions(*spec)
        steps = (backbone_eval, evaluate_written_out if spec[0] == "inductor" else None)
    elif spec is not None:
        steps, graphs = compiled_steps(*spec), spec[1] in CUDA_GRAPH_MODES
    if spec is not None:
        limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
        patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit,
                                           suppress_errors=False)  # fmt: skip
    with patch, regions_on(backbone, regions):
        for group in groups:
            capacity = len(group) if batch_size is None else min(batch_size, len(group))
            run.group([prompts[i] for i in group], None if canvas is None else [canvas[i] for i in group], group,
                      capacity, steps, graphs, bar, results)  # fmt: skip
    if bar is not None:
        bar.close()
    return results  # every entry set: each request finishes exactly once


def _check_canvas(canvas: Sequence[Sequence[int]], n: int, cfg: DecodeConfig, mask_id: int) -> None:
    """One line for a ``canvas`` that does not fit the request (before anything is evaluated)."""
    if cfg.policy == "tdlm":
        raise TDLMError("decode: canvas= continues a partial response with the backbone's own policies; policy "
                        "'tdlm' starts its temporal history at the first evaluation of a response")  # fmt: skip
    if len(canvas) != n:
        raise TDLMError(f"decode: canvas has {len(canvas)} rows for {n} prompts")
    for i, row in enumerate(canvas):
        if len(row) != cfg.gen_length:
            raise TDLMError(f"decode: canvas row {i} has {len(row)} tokens; gen_length is {cfg.gen_length}")
        if mask_id not in row:
            raise TDLMError(f"decode: canvas row {i} holds no mask token ({mask_id}): nothing to decode")




class _Run:
    """The engine's state across the prompt groups of one :func:`decode` call, and the loop of one group."""

    def __init__(self, model, backbone: Backbone, cfg: DecodeConfig, device: torch.device, tokenizer, stop_ids,
                 record_states: bool, on_result, stats: EngineStats) -> None:  # fmt: skip
        self.model, self.backbone, self.cfg, self.device = model, backbone, cfg, device
        self.tokenizer, self.record_states, self.on_result, self.stats = tokenizer, record_states, on_result, stats
        self.stops = set(stop_ids) if stop_ids is not None else {backbone.eos_token_id}

    def _result(self, prompt, tokens: list[int], nfe: int, reveal: list[int], seconds: float,
                states: list[list[int]] | None) -> DecodeResult:  # fmt: skip
        cut = next((j for j, t in enumerate(tokens) if t in self.stops), len(tokens))
        text = self.tokenizer.decode(tokens[:cut], skip_special_tokens=True) if self.tokenizer is not None else ""
        return DecodeResult(tokens=tokens, text=text, nfe=nfe, seconds=seconds, reveal_step=reveal, T=nfe,
                            prompt_ids=[int(t) for t in prompt], states=states)  # fmt: skip

    def group(self, prompts, canvas, index: list[int], capacity: int, steps, graphs: bool, bar,
              results: list) -> None:  # fmt: skip
        """Decode the prompts of one canvas (``index``: their indices in the call) in ``capacity`` rows with refill;
        ``graphs``: the compiled steps capture CUDA graphs (cudagraph trees), so each evaluation begins with
        ``torch.compiler.cudagraph_mark_step_begin()``. Without the mark, in inference every call of a compiled step
        starts a new generation of the trees, which frees the previous call's outputs: an evaluation that runs a
        refresh group and a window group as two calls would then read the first group's logits after the second
        call overwrote them (:func:`merge_logits`). With it, the calls of one evaluation are one generation, and
        nothing of an earlier evaluation's outputs is read after the next mark (each evaluation's logits are
        consumed before it ends)."""
        model, backbone, cfg, device = self.model, self.backbone, self.cfg, self.device
        backbone_step, evaluate = steps if steps is not None else (backbone_eval, None)
        mask_id, G, bs = backbone.mask_token_id, cfg.gen_length, cfg.block_size
        Plan = StaticSlots if cfg.storage == "static" else DynamicRows
        P, S = Plan.shape(max(len(p) for p in prompts), capacity)  # the static plan's: buckets (static_plan.py)
        L = P + G
        plan = Plan(model, backbone, cfg, S, L, device)
        # known on the host: no device read. A mask only when a row is padded: attention with a mask runs slower
        # kernels (on a GPU SDPA's flash kernel takes none); the static plan then has an unpadded and a padded graph
        padded = any(len(p) < P for p in prompts)
        last = G // bs - 1  # the last block (where the static plan keeps finished and padding rows)
        extra = getattr(model, "offset", 0)
        # A dual window step over a front of more columns than this gathers its positions' columns instead (rows far
        # past the last compaction); a bound of twice the window's own width, not tuned.
        front_most = 2 * column_bucket(bs + backbone.logit_shift, G)
        pos_block = torch.arange(G, device=device) // bs  # (G,)
        block_pos = torch.arange(bs, device=device)
        stop_t = torch.tensor(sorted(self.stops), device=device)
        states: dict[int, list[list[int]]] = {}
        queue = list(range(len(prompts)))  # admission order: prompt order
        queue.reverse()
        rows: list[_Row] = []
        fills: list[int] = []  # requests admitted by each fill
        clock = {"excluded": 0.0}  # wall seconds of evaluations that compiled a graph

        def canvas_rows(reqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            """Canvas rows built on the host (one copy to the device): the prompt left-padded to P, its response all
            masks or its partial canvas; a padding row (-1) is the first request's prompt with a response of pad
            tokens, nothing to decode."""
            host_ids = torch.full((len(reqs), L), backbone.pad_token_id, dtype=torch.long)
            host_am = torch.zeros((len(reqs), L), dtype=torch.long)
            for r, q in enumerate(reqs):
                p = prompts[q if q >= 0 else 0]
                host_ids[r, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long)
                host_am[r, P - len(p) :] = 1
                if q >= 0:
                    host_ids[r, P:] = mask_id if canvas is None else torch.as_tensor(list(canvas[q]), dtype=torch.long)
            return host_ids, host_am

        def new_row(q: int, slot: int, now: float) -> _Row:
            blk, left = (0, G) if q >= 0 else (last, 0)
            if q >= 0 and canvas is not None:  # a partial response's first masked position gives its first block
                blk, left = list(canvas[q]).index(mask_id) // bs, sum(t == mask_id for t in canvas[q])
            if q >= 0 and self.record_states:
                states[q] = []
            return _Row(q, slot, blk, left=left, comp_in=min(bs, G), start=now, done=q < 0)

        def admit(now: float) -> None:
            """Fill free slots from the queue, in order (the static plan's first fill adds padding rows, -1)."""
            if not queue or not plan.can_join(sum(not r.done for r in rows)):
                return
            free = plan.free(rows)
            if fills:  # a refill: as many free slots as requests are left
                free = free[: len(queue)]
            if not free:
                return
            reqs = [queue.pop() if queue else -1 for _ in free]  # the first fill pads the static plan's extra slots
            self.stats.admissions += len(reqs) if fills else 0
            fills.append(len(reqs))
            plan.admit(free, *canvas_rows(reqs))
            plan.place(rows, [new_row(q, s, now) for q, s in zip(reqs, free, strict=True)])

        def deliver(got: list[int], done: tuple) -> None:
            """Results of rows that finished: ``got`` their staged responses, reveal steps and NFE, row after row."""
            width = 2 * G + 1
            for k, (r, seconds) in enumerate(zip(done[0], done[1], strict=True)):
                row = got[k * width : (k + 1) * width]
                res = self._result(prompts[r.req], row[:G], row[-1], row[G:-1], seconds,
                                   states.pop(r.req, None) if self.record_states else None)  # fmt: skip
                results[index[r.req]] = res
                if self.on_result is not None:
                    self.on_result(index[r.req], res)

        pending = None  # (rows, seconds, staged device tensor) of the rows that finished at the last evaluation
        _sync(device)
        t0 = time.perf_counter()
        admit(0.0)
        while any(not r.done for r in rows):
            if graphs:  # one cudagraph-trees generation per evaluation (see above)
                torch.compiler.cudagraph_mark_step_begin()
            t_eval, n_graphs = time.perf_counter(), graphs_compiled()
            x = plan.view(plan.ids)  # (b, L); the static plan's is the canvas itself, at its fixed address
            b = len(rows)
            a_mask = plan.view(plan.am) if padded else None
            if self.record_states:
                for r, resp_row in zip(rows, x[:, P:].tolist(), strict=True):
                    if not r.done:
                        states[r.req].append(resp_row)
            resp = x[:, P:]  # (b, G)
            masked = resp == mask_id
            # the first masked position gives the active block; a finished row's is the last one (the static plan
            # keeps it: its prefix window never starts left of a live row's)
            blk = torch.where(masked.any(1), pos_block[masked.int().argmax(1)], last)  # (b,)
            start = blk * bs
            idx = start[:, None] + block_pos  # (b, bs) response positions of the block
            cand = masked.gather(1, idx)
            positions = P + idx  # (b, bs) canvas positions whose logits are read
            blk_host, kv_host = [r.blk for r in rows], [r.kv for r in rows]
            groups = step_groups(plan.kv_cache, blk_host, kv_host, P + start, [P + k * bs for k in blk_host], bs, L,
                             backbone.logit_shift)  # fmt: skip
            for r, k in zip(rows, kv_host, strict=True):
                r.kv = k
            reuse, cache = plan.reuse, plan.cache
            # each row's evaluations before this one (a copy: the static plan's view is the NFE it counts on)
            evals = plan.view(plan.nfe).clone() if reuse is not None else None
            if cache is not None:
                # The history's entries per position are at most the oldest live row's evaluations: with refill that is
                # what its slot buckets must hold (TemporalCache.reserve), not the evaluations since the batch began.
                cache.steps = max(r.evals for r in rows if not r.done)
                if cfg.cache == "dual":
                    front = window_front(blk_host, [r.comp_blk for r in rows], [r.comp_in for r in rows], bs, extra,
                                         G)  # fmt: skip
                    plan.set_dual_front(front, front_most, bs + extra)
                elif cfg.cache == "prefix":  # a prefix window holds every masked position of its rows
                    cache.set_front(cache.width)
                outs = model.forward_groups(P, cache, [
                    StepGroup(rows_of(x, r), rows_of(a_mask, r), rows_of(positions, r), step, r) for r, step in groups
                ], evaluate=evaluate)  # fmt: skip
            elif reuse is not None and reuse.feeds_inputs:
                outs = reuse.evaluate(backbone_step, backbone, x, a_mask, groups, P, start, bs, evals)
            else:
                outs = [backbone_step(backbone, rows_of(x, r), rows_of(a_mask, r), rows_of(positions, r), step)
                        for r, step in groups]  # fmt: skip
            blk_logits = merge_logits(groups, outs, b)  # (b, bs, V)
            plan.count(masked)
            nfe_rows = plan.view(plan.nfe)
            logp = torch.log_softmax(blk_logits.double() if reuse is None else reuse.logits(blk_logits, cand, blk), -1)
            entropy = -(logp.exp() * logp).sum(-1) if cfg.policy == "entropy" else None
            # The mask token is never a reveal: committing it would leave the position masked and count a step that
            # revealed nothing (a record no trajectory reader accepts). A trained backbone gives it no mass; tiny random
            # ones and soft / credit fusions can make it the greedy token. Its probability stays in the normaliser.
            logp[..., mask_id] = -torch.inf
            conf, x0 = logp.max(-1)
            conf = conf.exp()  # float64 probability of the greedy token
            commit = _select(conf, cand, cfg.policy, cfg, entropy, None if reuse is None else reuse.threshold(evals))
            new_resp = resp.clone()
            new_resp.scatter_(1, idx, torch.where(commit, x0, resp.gather(1, idx)))
            rows_reveal = plan.reveal_rows()
            rows_reveal.scatter_(1, idx, torch.where(commit, nfe_rows[:, None].expand_as(idx),
                                                     rows_reveal.gather(1, idx)))  # fmt: skip
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
                rows_reveal = torch.where(fill, nfe_rows[:, None].expand_as(rows_reveal), rows_reveal)
                still = new_resp == mask_id
            plan.write(new_resp, rows_reveal, P)
            # The one host synchronisation of the evaluation: which rows are done, each row's next active block,
            # its masked count, and whether its logits were finite (a NaN greedy token would commit id 0 silently:
            # fp16 overflows the bf16-trained releases on a GPU).
            count = still.sum(1)
            next_blk = torch.where(count == 0, last, pos_block[still.int().argmax(1)])
            head = torch.stack([count == 0, next_blk, count, conf.isnan().any(1)]).flatten()  # (4 b,)
            got = (head if pending is None else torch.cat([head, pending[2].flatten()])).tolist()
            done_l, next_l, left_l, nan_l = (got[k * b : (k + 1) * b] for k in range(4))
            if any(nan_l):
                raise TDLMError(f"decode: the backbone's logits are not finite (NaN) at evaluation "
                                f"{int(nfe_rows.max())} of {sum(map(bool, nan_l))} row(s), dtype "
                                f"{next(backbone.parameters()).dtype}; float16 overflows bf16-trained LLaDA / "
                                f"Dream: use bfloat16 or float32")  # fmt: skip
            now = time.perf_counter()
            if graphs_compiled() != n_graphs:
                clock["excluded"] += now - t_eval
            elapsed = now - t0 - clock["excluded"]
            self.stats.evaluations += 1
            self.stats.rows += b
            self.stats.slots += S
            self.stats.useful += sum(not r.done for r in rows)
            for r in rows:
                r.evals += not r.done
            if bar is not None:
                bar.update(sum(r.left for r in rows) - sum(left_l))
            if pending is not None:  # the rows that finished at the previous evaluation, read with this one's sync
                deliver(got[4 * b :], pending)
                pending = None
            finished = [i for i, (r, d) in enumerate(zip(rows, done_l, strict=True)) if d and not r.done]
            for r, k, n_left in zip(rows, next_l, left_l, strict=True):
                r.blk, r.left = k, n_left
            coming = 0
            if finished:
                # Their responses, reveal steps and NFE copied on the device now (the next admission may write their
                # slots), read back with the next evaluation's sync, or once after the last one.
                slots = index_tensor([rows[i].slot for i in finished], device)
                stage = torch.cat([plan.ids[slots, P:], plan.reveal[slots], plan.nfe[slots, None]], 1)
                pending = ([rows[i] for i in finished], [elapsed - rows[i].start for i in finished], stage)
                for i in finished:
                    rows[i].done = True
                    if rows[i].kv >= 0:  # a finished row that stays is never refreshed again: it rides the window
                        rows[i].kv = last  # steps (until a request is admitted into its slot)
                live = sum(not r.done for r in rows)
                # requests the admission below takes from the queue into the finished rows' slots (none into an
                # emptied batch: it starts every per-row state anew)
                coming = len(queue) if live and plan.can_join(live) else 0
                keep = plan.staying(rows, coming)  # the dynamic plan's finished rows leave unless refilled in place
                if len(keep) < len(rows):
                    plan.leave(keep)
                    rows[:] = [rows[i] for i in keep]
                    still = still[index_tensor(keep, device)] if keep else still[:0]
            # A dual window step reads only the front, so dropping columns inside a block would save only the next
            # refresh's work, for a copy of the whole storage (about 3% of an evaluation at the medium bench shape on
            # this CPU, docs/decoding.md): under the dual cache the loop compacts once a row has changed block. Nor
            # before a refill: the new requests need every column back (TemporalCache.reset_rows / extend would widen
            # the storage again at once, a second copy for nothing).
            moved = cfg.cache != "dual" or any(r.blk != r.comp_blk for r in rows)
            refill = bool(finished) and coming > 0
            if cache is not None and plan.cache is not None and rows and moved and not refill and \
                    plan.cache.compact(still, max(r.left for r in rows)):  # fmt: skip
                # the history of revealed positions is dead: fewer storage columns, each row's from its active block
                for r in rows:
                    r.comp_blk, r.comp_in = r.blk, r.left - (G - (r.blk + 1) * bs)
                plan.compacted([r.left for r in rows])
            admit(elapsed)
        if pending is not None:
            deliver(pending[2].flatten().tolist(), pending)
