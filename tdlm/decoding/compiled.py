"""The decode loop's compiled steps (``compile`` / ``compile_scope``; the choices and their check are in
:mod:`tdlm.decoding.config`): the model scope's two fullgraph steps, the block scope's regions, and the counter the loop
reads to leave compiling evaluations out of a request's seconds. One set per (backend, mode) per process."""

from __future__ import annotations

import contextlib

import torch

from tdlm.models.common import Backbone, BlockRegions
from tdlm.models.kv_cache import LayerKV
from tdlm.temporal.attention import TemporalAttention
from tdlm.temporal.model import TDLM

_COMPILED: dict = {}
# Recompilations of one decode are bounded by the step kinds (see decode's docstring); this leaves room for a
# few models per process. Reaching it raises instead of falling back to eager.
RECOMPILE_LIMIT = 64


def backbone_eval(backbone: Backbone, x, attention_mask, positions, kv, embeds=None):
    return backbone(x, attention_mask=attention_mask, select=positions, kv=kv, inputs_embeds=embeds)


def evaluate_written_out(model: TDLM, prompt_len: int, cache, groups: list) -> list[torch.Tensor]:
    """:meth:`TDLM.evaluate_groups` with the temporal attention written out, which inductor fuses into one kernel
    (:func:`tdlm.temporal.attention.step_attention`)."""
    return TDLM.evaluate_groups(model, prompt_len, cache, groups, written_out=True)


def compiled_steps(backend: str, mode: str | None):
    """(backbone step, TDLM step) compiled with fullgraph=True, one pair per (backend, mode) per process.

    The backbone step is ``backbone(x, attention_mask, select=positions, kv)``; the TDLM step is
    :meth:`tdlm.TDLM.evaluate_groups`, with inductor in its written-out attention form. Dynamo caches graphs per
    step kind under guards on the structure of the arguments (refresh / window, rows split or not, padded or
    not) and on shapes; nothing in the arguments changes from one evaluation of a kind to the next."""
    key = (backend, mode)
    if key not in _COMPILED:
        kw = {"fullgraph": True, "backend": backend, **({"mode": mode} if mode else {})}
        step = evaluate_written_out if backend == "inductor" else TDLM.evaluate_groups
        _COMPILED[key] = (torch.compile(backbone_eval, **kw), torch.compile(step, **kw))
    return _COMPILED[key]


def _block_attend(block: torch.nn.Module, x: torch.Tensor, ctx, slot: LayerKV | None) -> torch.Tensor:
    return block.attend(x, ctx, slot)


def _block_feed_forward(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return block.feed_forward(h)


def _temporal_step(module: TemporalAttention, *args, **kw):
    return TemporalAttention.step(module, *args, **kw)


def block_regions(backend: str, mode: str | None) -> BlockRegions:
    """The regions of ``compile_scope="block"`` compiled with fullgraph=True, one set per (backend, mode) per process:
    a block's attention (its layer's spatial KV storage passed in as tensors, :class:`tdlm.models.kv_cache.LayerKV`),
    its feed-forward and the temporal layer's step (:meth:`tdlm.temporal.attention.TemporalAttention.step`).

    Each is one function whose module is an argument; parameters are graph inputs (dynamo always inlines built-in
    nn modules), so every layer's call hits the graph the first layer compiled, under guards on the step kind and
    shapes: the cold compile of a decode is that of one block, whatever the depth (``bench/compile_scope.py``). The
    loop, embedding, LM head and the temporal history's bookkeeping run eagerly between them."""
    key = ("block", backend, mode)
    if key not in _COMPILED:
        kw = {"fullgraph": True, "backend": backend, **({"mode": mode} if mode else {})}
        _COMPILED[key] = BlockRegions(attend=torch.compile(_block_attend, **kw),
                                      feed_forward=torch.compile(_block_feed_forward, **kw),
                                      temporal_step=torch.compile(_temporal_step, **kw))  # fmt: skip
    return _COMPILED[key]


@contextlib.contextmanager
def regions_on(backbone: Backbone, regions: BlockRegions | None):
    """``backbone`` runs ``regions`` in its layer loop (:meth:`Backbone.layer`) inside the block; what it ran before
    afterwards, also after an error (a later eager or model-scope decode of the same backbone must not run them)."""
    if regions is None:
        yield
        return
    before = backbone.block_regions
    backbone.block_regions = regions
    try:
        yield
    finally:
        backbone.block_regions = before


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
