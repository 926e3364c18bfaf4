"""Tracing library code at a shape no machine here could run: values the host reads from fake tensors
(:class:`HostSide`), the GPU's attention kernel in place of the CPU's (:func:`gpu_sdpa`), torch's MemTracker made to
skip frozen parameters (:func:`mem_tracker`), and :func:`tracing`, which puts them and a :class:`Ledger` over one
region.

Fake tensors live on the CPU device here (a fake CUDA tensor cannot even be indexed without CUDA), where SDPA would
pick the CPU kernel; the kernel an H100/H200 picks for bf16 is swapped in, so the traced bytes and FLOPs are the
GPU's. The aten ops, their meta shapes and backward formulas are torch's own.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from tdlm.profiling.ledger import Ledger, Limits


# -- what the host would read, and the GPU's attention kernel ----------------------------------------------
class HostRead(Exception):
    """A traced evaluation reached a host read whose value a fake tensor does not have."""


class HostSide(TorchFunctionMode):
    """Values the host reads from fake tensors, and SDPA routed to the GPU kernel (module docstring).

    ``known`` maps id(tensor) -> value for the scalars :class:`Ledger` can name (a supervised mask's sum);
    any other host read raises :class:`HostRead` (``on_read`` may answer instead)."""

    READS = (torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.tolist, torch.Tensor.__index__)  # fmt: skip

    def __init__(self, known: dict, on_read=None) -> None:
        super().__init__()
        self.known, self.on_read = known, on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS:
            t = args[0]
            if id(t) in self.known:
                v = self.known[id(t)]
                return bool(v) if func is torch.Tensor.__bool__ else v
            if self.on_read is not None:
                return self.on_read(func, t)
            raise HostRead(f"{func.__name__} of a {tuple(t.shape)} {t.dtype} tensor")
        return func(*args, **kwargs)


def gpu_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The kernel PyTorch's SDPA picks on an H100/H200 for bf16: flash without a mask (grouped-query heads
    included), memory-efficient attention with one (a boolean mask as its additive 0 / -inf bias)."""
    if attn_mask is None:
        # flash reads grouped K/V heads (enable_gqa) in place
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                  scale=scale)[0]  # fmt: skip
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    bias = attn_mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, grad, dropout_p, is_causal,
                                                                  scale=scale)[0]  # fmt: skip


# -- the region's instruments together ------------------------------------------------------------------------
@contextlib.contextmanager
def _patched(obj, name: str, value):
    """``obj.name`` set to ``value`` for the block, restored after."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class _NoHook:
    """The handle MemTracker keeps for a frozen parameter's gradient hooks: nothing to remove."""

    def remove(self) -> None:
        pass


def mem_tracker():
    """torch's MemTracker, made to skip the gradient hooks of frozen parameters: it hooks every parameter of a
    module it enters, and ``register_hook`` raises on a tensor that needs no gradient (the frozen backbone)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenAwareMemTracker()


@contextlib.contextmanager
def tracing(limits: Limits | None = None, counts: dict[int, int] | None = None, on_read=None, memory: bool = True,
            track=(), flops: bool = True):  # fmt: skip
    """FlopCounterMode, MemTracker and a :class:`Ledger` over one region, host reads answered by :class:`HostSide`.

    Yields (ledger, flop counter, mem tracker or None); the caller's FakeTensorMode must be active."""
    known: dict = {}
    ledger = Ledger(limits, counts, known)
    counter = FlopCounterMode(display=False) if flops else None
    mt = mem_tracker() if memory else None
    if mt is not None and track:
        mt.track_external(*track)
    with contextlib.ExitStack() as stack:
        if mt is not None:
            stack.enter_context(mt)
        if counter is not None:
            stack.enter_context(counter)
        stack.enter_context(ledger)
        stack.enter_context(HostSide(known, on_read))
        # A module attribute, not a TorchFunctionMode: checkpointing recomputes blocks during backward, where the
        # function-mode stack is not active, and a recomputation must save what the forward saved.
        stack.enter_context(_patched(F, "scaled_dot_product_attention", gpu_sdpa))
        yield ledger, counter, mt


def peak_by_category(mt) -> dict:
    """MemTracker's peak snapshot summed over devices: {category: bytes, 'Total': bytes}."""
    snap = mt.get_tracker_snapshot("peak")
    out: dict[str, int] = {}
    for dev in snap.values():
        for k, v in dev.items():
            key = k.value if hasattr(k, "value") else str(k)
            out[key] = out.get(key, 0) + int(v)
    return out


def cache_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from a cache object (dataclass fields, dicts, lists): whatever layout it uses."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple):
        items = list(obj)
    else:
        return []
    return [t for it in items for t in cache_tensors(it, seen)]
