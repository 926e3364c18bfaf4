"""How a still-masked position's prediction moves across denoising evaluations.

Issue 15's diagnostic: for every response position that stays masked through ``min_masked`` or more evaluations
(its reveal step a_p >= min_masked; evaluations 1..a_p all saw it masked, the a_p-th committed it), read the greedy
token (argmax) the model predicted there at each of those evaluations and compare it with the token finally
committed. A decoder whose positions settle early has argmax sequences that rarely change and earlier argmaxes that
usually equal the final token; a position torn between equally valid continuations changes its argmax as its
neighbours are committed.

:func:`replay_argmax` recomputes the argmax of every evaluation of one decoded request from the states that
:func:`tdlm.decoding.decode` records (``record_states=True``): the plain backbone evaluates the states as a batch;
a :class:`tdlm.TDLM` evaluates them in parallel mode (:meth:`tdlm.TDLM.forward_states`), which equals its step-wise
decoding (Prop. 2). The replay runs the request alone (no left padding), so a near-tie can in principle resolve
differently from a padded batched decode; :func:`change_statistics` therefore reports ``replay_agreement``, the
fraction of counted positions whose replayed argmax at the committing evaluation equals the committed token (1.0
when the replay is exact).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tdlm.errors import TDLMError
from tdlm.models.common import Backbone
from tdlm.temporal.model import TDLM

MAX_LAG = 8


@dataclass(frozen=True)
class RequestHistory:
    """One decoded request: the argmax at each evaluation, when each position was committed, and the final tokens."""

    argmax: list[list[int]]  # (T, G): greedy token at every response position, per evaluation
    reveal_step: list[int]  # (G,) a_p in 1..T
    tokens: list[int]  # (G,) committed tokens


@torch.inference_mode()
def replay_argmax(model: Backbone | TDLM, prompt_ids: Sequence[int], states: Sequence[Sequence[int]],
                  temporal: bool | None = None) -> list[list[int]]:  # fmt: skip
    """Argmax (T, G) of each evaluation of one request, from its recorded response states (T, G).

    ``temporal`` (default: whether ``model`` is a :class:`TDLM`) evaluates the states with the temporal path, as the
    ``tdlm`` policy decodes; otherwise the plain backbone (``original`` / ``threshold`` / ``entropy``).
    """
    if not states:
        raise TDLMError("replay_argmax: no states; decode with record_states=True")
    temporal = isinstance(model, TDLM) if temporal is None else temporal
    if temporal and not isinstance(model, TDLM):
        raise TDLMError("replay_argmax: temporal=True needs a tdlm.TDLM")
    backbone = model.backbone if isinstance(model, TDLM) else model
    device = next(backbone.parameters()).device
    P, G = len(prompt_ids), len(states[0])
    prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)
    resp = torch.as_tensor([list(s) for s in states], dtype=torch.long, device=device)  # (T, G)
    x = torch.cat([prompt.expand(resp.shape[0], P), resp], dim=1)  # (T, P + G)
    select = torch.zeros_like(x, dtype=torch.bool)
    select[:, P:] = True
    if temporal:
        logits = model.forward_states(x[None], P, select=select[None])  # (T * G, V)
    else:
        logits = backbone(x, select=select)
    return logits.view(resp.shape[0], G, -1).argmax(-1).tolist()


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def change_statistics(histories: Iterable[RequestHistory], min_masked: int = 3,
                      exclude_tokens: Sequence[int] = ()) -> dict:  # fmt: skip
    """Pooled statistics over the positions with a_p >= ``min_masked`` (final token not in ``exclude_tokens``).

    * ``changed``: fraction whose argmax was not the same at all of their a_p evaluations;
    * ``switches_per_position``: mean number of evaluations whose argmax differs from the previous one;
    * ``final_equals_earlier``: over all (position, earlier evaluation i < a_p) pairs, how often the argmax of
      evaluation i equals the committed token; ``final_equals_first``: the same for evaluation 1 only;
    * ``final_equals_lag``: {k: rate} for evaluation a_p - k (k = 1..MAX_LAG), over positions that have one;
    * ``replay_agreement``: argmax at evaluation a_p == committed token (see the module docstring);
    * ``mean_masked_evaluations``: mean a_p of the counted positions.
    """
    if min_masked < 2:
        raise TDLMError(f"min_masked must be >= 2 (an earlier evaluation is needed); got {min_masked}")
    excluded = set(exclude_tokens)
    n = changed = switches = agree_commit = pairs = pair_agree = first_agree = total_masked = 0
    lag_n = [0] * (MAX_LAG + 1)
    lag_agree = [0] * (MAX_LAG + 1)
    for h in histories:
        T = len(h.argmax)
        for p, (a, final) in enumerate(zip(h.reveal_step, h.tokens, strict=True)):
            if a < min_masked or final in excluded:
                continue
            if a > T:
                raise TDLMError(f"reveal step {a} of position {p} exceeds the {T} recorded evaluations")
            seq = [h.argmax[i][p] for i in range(a)]
            n += 1
            total_masked += a
            changed += len(set(seq)) > 1
            switches += sum(u != v for u, v in zip(seq, seq[1:], strict=False))
            agree_commit += seq[-1] == final
            pairs += a - 1
            pair_agree += sum(t == final for t in seq[:-1])
            first_agree += seq[0] == final
            for k in range(1, min(MAX_LAG, a - 1) + 1):
                lag_n[k] += 1
                lag_agree[k] += seq[a - 1 - k] == final
    return {
        "min_masked": min_masked,
        "positions": n,
        "mean_masked_evaluations": _rate(total_masked, n),
        "changed": _rate(changed, n),
        "switches_per_position": _rate(switches, n),
        "final_equals_earlier": _rate(pair_agree, pairs),
        "final_equals_first": _rate(first_agree, n),
        "final_equals_lag": {k: _rate(lag_agree[k], lag_n[k]) for k in range(1, MAX_LAG + 1) if lag_n[k]},
        "replay_agreement": _rate(agree_commit, n),
    }


def decode_histories(model: Backbone | TDLM, prompts: Sequence[Sequence[int]], policy: str, threshold: float,
                     gen_length: int, block_size: int, tokenizer=None, stop_ids=None, batch_size: int = 50,
                     progress: bool = False) -> tuple[list, list[RequestHistory]]:  # fmt: skip
    """Decode ``prompts`` (greedy, recording states) and replay each request's argmax history.

    Returns the :class:`tdlm.decoding.DecodeResult` list and one :class:`RequestHistory` per request, ready for
    :func:`change_statistics`. ``model`` is the plain backbone for ``original`` / ``threshold`` / ``entropy`` and a
    :class:`tdlm.TDLM` for ``tdlm``.
    """
    from tdlm.decoding import decode

    results: list = []
    for s in range(0, len(prompts), batch_size):
        results += decode(model, [list(p) for p in prompts[s : s + batch_size]], policy=policy, threshold=threshold,
                          gen_length=gen_length, block_size=block_size, tokenizer=tokenizer, stop_ids=stop_ids,
                          record_states=True, progress=progress)  # fmt: skip
    histories = [RequestHistory(replay_argmax(model, r.prompt_ids, r.states), r.reveal_step, r.tokens)
                 for r in results]  # fmt: skip
    return results, histories
