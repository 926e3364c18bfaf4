"""Counting what a region of library code dispatches: bytes, FLOPs and kernels per op (:class:`Ledger`), aten ops by
name (:class:`OpCounter`) and the launches in inductor's generated code (:func:`kernels_in`).

All three watch torch's own dispatch, so they count the library's real code paths; under ``FakeTensorMode`` they run
at any shape without storage (:mod:`tdlm.profiling.true_shape` builds the 8B models that way). Used by
``bench/true_shape.py`` (the roofline per NFE, the true-shape checks) and ``bench/dispatch_count.py`` (ops and
kernels per NFE).
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

INT32_MAX = 2**31 - 1
# Ops that read only the rows they gather / write only the rows they scatter, not their whole input.
GATHERS = {"aten.embedding", "aten.index", "aten.gather", "aten.index_select"}
SCATTERS = {"aten.scatter", "aten.scatter_", "aten.index_put", "aten.index_put_", "aten.scatter_add_",
            "aten.scatter_add", "aten.copy_", "aten.slice_scatter", "aten.select_scatter"}  # fmt: skip
NOT_KERNELS = {"aten.detach", "prim.device", "aten._local_scalar_dense", "aten.lift_fresh", "aten.alias"}


@dataclasses.dataclass
class Limits:
    """What a tensor may be at true shape (the suite's checks): rows x V logits at most ``logit_rows`` x V
    (the LM head's block / the supervised rows), float64 at most that many elements, no offset past int32."""

    vocab: int
    logit_rows: int
    seq_lens: tuple[int, ...] = ()


def _unique_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches in ``t``: broadcast (stride 0) dims read once, at most the storage."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return min(n * t.element_size(), t.untyped_storage().nbytes())


_COMPOSITE: dict = {}


def _composite(func) -> bool:
    """An op with only a composite implementation (its parts are the kernels); ops with a backend kernel run it
    (silu_backward has both: a fused kernel on a device, a decomposition elsewhere)."""
    if func not in _COMPOSITE:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        _COMPOSITE[func] = has(func.name(), "CompositeImplicitAutograd") and not any(
            has(func.name(), k) for k in ("CPU", "CUDA", "Meta", "CompositeExplicitAutograd"))
    return _COMPOSITE[func]


def _max_offset(t: torch.Tensor) -> int:
    return t.storage_offset() + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)


class Ledger(TorchDispatchMode):
    """Per op: FLOPs (torch's flop formulas), bytes read and written, kernel or not; traffic on ``watch``ed storages
    (the temporal history) and on tensors copied from them; violations of :class:`Limits`.

    ``counts`` maps the numel of a boolean mask to its number of True entries (the supervised mask), so that
    ``nonzero``, a boolean index and a mask's sum get their real sizes."""

    def __init__(self, limits: Limits | None = None, counts: dict[int, int] | None = None,
                 known: dict | None = None) -> None:  # fmt: skip
        super().__init__()
        self.limits, self.counts = limits, counts or {}
        self.known = known if known is not None else {}
        self._keep: list = []
        self.ops: list[dict] = []
        self.violations: list[str] = []
        # Storages are named by their StorageImpl address (``_cdata``), kept alive by ``_hold`` so that no other
        # storage can take the address while the trace runs.
        self.watch: set[int] = set()  # the history's storages
        self.tainted: set[int] = set()  # storages copied whole from the history
        self._hold: list = []
        self.vocab_shapes: set[tuple[int, ...]] = set()  # shapes of the tensors with a vocabulary dim (the head's)
        # live=True: the tensors this region allocated that are alive, and what was alive at their peak (by op).
        self.live_on = False
        self.live: dict[int, tuple[int, str]] = {}
        self.live_bytes = self.live_peak = 0
        self.at_peak: dict[str, int] = {}

    def watch_tensors(self, tensors) -> int:
        """Watch the storages of ``tensors`` (the temporal history); returns their bytes."""
        self.watch, total = set(), 0
        for t in tensors:
            st = t.untyped_storage()
            if st._cdata not in self.watch:
                self._hold.append(st)
                self.watch.add(st._cdata)
                total += st.nbytes()
        return total

    def reset(self) -> None:
        self.ops, self.violations = [], []

    def _check(self, name: str, t: torch.Tensor) -> None:
        lim = self.limits
        if lim is None:
            return
        if t.numel() and _max_offset(t) > INT32_MAX:
            self.violations.append(f"{name}: {tuple(t.shape)} {t.dtype} reaches element {_max_offset(t):,} "
                                   f"(> int32)")  # fmt: skip
        if lim.vocab in t.shape:
            self.vocab_shapes.add(tuple(t.shape))
        if lim.vocab in t.shape and t.numel() > lim.logit_rows * lim.vocab:
            self.violations.append(f"{name}: {tuple(t.shape)} {t.dtype} holds vocabulary rows beyond the LM head's "
                                   f"{lim.logit_rows} x {lim.vocab}")  # fmt: skip
        if t.dtype == torch.float64 and t.numel() > lim.logit_rows * lim.vocab:
            self.violations.append(f"{name}: float64 {tuple(t.shape)} is larger than the head's logits")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if func is torch.ops.aten.nonzero.default and args[0].numel() in self.counts:
            x = args[0]
            out = torch.empty((self.counts[x.numel()], x.dim()), dtype=torch.long, device=x.device)
            self._record(name, args, kwargs, out, func)
            return out
        if func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            idx = []
            for i in args[1]:
                if i is not None and i.dtype == torch.bool:
                    nz = self.__torch_dispatch__(torch.ops.aten.nonzero.default, types, (i,))
                    idx += list(nz.unbind(1))
                else:
                    idx.append(i)
            return self.__torch_dispatch__(func, types, (args[0], idx))
        # Composite ops that reach the mode undecomposed (aten.linear under inference_mode): count their parts,
        # as FlopCounterMode does.
        if func.namespace == "aten" and func is not torch.ops.aten.index.Tensor and _composite(func):
            with self:  # the parts dispatch through this mode again
                return func.decompose(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in (torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList) and args[0].dtype == torch.bool \
                and args[0].numel() in self.counts and out.numel() == 1:  # fmt: skip
            self.known[id(out)] = self.counts[args[0].numel()]
            self._keep.append(out)  # its id stays its own while the trace lives
        self._record(name, args, kwargs, out, func)
        return out

    def _record(self, name, args, kwargs, out, func) -> None:
        flat_in = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        flat_out = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        in_st = {a.untyped_storage()._cdata for a in flat_in}
        inplace = name.endswith("_") or any(a.alias_info is not None and a.alias_info.is_write
                                            for a in func._schema.arguments)  # fmt: skip
        view = func.is_view or (not inplace and flat_out and all(o.untyped_storage()._cdata in in_st for o in flat_out))
        if name in NOT_KERNELS or view:
            return
        for o in flat_out:
            self._check(name, o)
        if self.live_on:
            self._track_live(name, flat_out, in_st)
        if name in GATHERS:
            idx = [a for a in flat_in[1:] if not a.is_floating_point()]
            read = sum(_unique_bytes(o) for o in flat_out) + sum(_unique_bytes(i) for i in idx)
            written = sum(_unique_bytes(o) for o in flat_out)
            srcs = flat_in[:1]
        elif name in SCATTERS:
            small = flat_in[1:]
            read = sum(_unique_bytes(a) for a in small)
            written = max([_unique_bytes(a) for a in small if a.is_floating_point() or a.dtype == torch.bool] or [0])
            srcs = small
        else:
            read = sum(_unique_bytes(a) for a in flat_in)
            written = sum(_unique_bytes(o) for o in flat_out if o.untyped_storage()._cdata not in in_st)
            if inplace:
                written += _unique_bytes(flat_in[0])
            srcs = flat_in
        flops = 0
        if func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        hist_read = sum(_unique_bytes(a) for a in srcs if a.untyped_storage()._cdata in self.watch)
        hist_written = 0
        if flat_out or inplace:
            targets = [flat_in[0]] if (inplace or name in SCATTERS) and flat_in else flat_out
            hist_written = sum(written for t in targets[:1] if t.untyped_storage()._cdata in self.watch)
        copy_read = sum(_unique_bytes(a) for a in srcs if a.untyped_storage()._cdata in self.tainted)
        copy_written = 0
        if hist_read and name not in GATHERS and flat_out:  # a whole-history pass that writes a copy of it
            for o in flat_out:
                if _unique_bytes(o) >= 0.5 * hist_read:
                    self._hold.append(o.untyped_storage())
                    self.tainted.add(o.untyped_storage()._cdata)
                    copy_written += _unique_bytes(o)
        vocab = self.limits is not None and any(o.dim() and o.shape[-1] == self.limits.vocab for o in flat_out)
        self.ops.append({"op": name, "flops": int(flops), "read": int(read), "written": int(written),
                         "out_vocab": vocab,
                         "pointwise": torch.Tag.pointwise in func.tags, "hist_read": int(hist_read),
                         "hist_written": int(hist_written), "copy_read": int(copy_read),
                         "copy_written": int(copy_written)})  # fmt: skip

    def _track_live(self, name: str, outs, in_st) -> None:
        for o in outs:
            st = o.untyped_storage()
            key = st._cdata
            if key in self.live or key in in_st:
                continue
            nb = st.nbytes()
            label = f"{name} {tuple(o.shape)} {str(o.dtype).removeprefix('torch.')}"
            self.live[key] = (nb, label)
            self.live_bytes += nb
            weakref.finalize(st, self._free, key)
        if self.live_bytes > self.live_peak:
            self.live_peak = self.live_bytes
            agg: dict[str, int] = {}
            for nb, label in self.live.values():
                agg[label] = agg.get(label, 0) + nb
            self.at_peak = dict(sorted(agg.items(), key=lambda kv: -kv[1])[:25])

    def _free(self, key: int) -> None:
        nb, _ = self.live.pop(key, (0, ""))
        self.live_bytes -= nb

    def totals(self) -> dict:
        keys = ("flops", "read", "written", "hist_read", "hist_written", "copy_read", "copy_written")
        out = {k: sum(o[k] for o in self.ops) for k in keys}
        out["kernels"] = len(self.ops)
        # A fusing compiler's count: every non-pointwise op, plus one kernel per run of consecutive pointwise ops.
        out["kernels_fused_est"] = sum(1 for i, o in enumerate(self.ops)
                                       if not o["pointwise"] or i == 0 or not self.ops[i - 1]["pointwise"])  # fmt: skip
        out["pointwise_bytes"] = sum(o["read"] + o["written"] for o in self.ops if o["pointwise"])
        by_op: dict[str, int] = {}
        for o in self.ops:
            if o["hist_read"] or o["hist_written"]:
                by_op[o["op"]] = by_op.get(o["op"], 0) + o["hist_read"] + o["hist_written"]
        out["history_traffic_by_op"] = by_op
        return out

    def roofline_ms(self, gpu: dict, fused: bool) -> float:
        t = 0.0
        for o in self.ops:
            by = 0 if fused and o["pointwise"] else o["read"] + o["written"]
            t += max(o["flops"] / gpu["flops"], by / gpu["bw"])
        return 1e3 * t

    def kernel_us(self, gpu: dict) -> list[float]:
        """The fused roofline as a sequence of kernels in dispatch order, µs each: the kernels of
        ``kernels_fused_est`` (a non-pointwise op, or a run of consecutive pointwise ops, whose bytes a compiler
        folds into a neighbour). Their sum is ``roofline_ms(gpu, fused=True)``; :func:`overlapped_ms` puts them
        on a timeline."""
        out: list[float] = []
        for i, o in enumerate(self.ops):
            t = 1e6 * max(o["flops"] / gpu["flops"], (0 if o["pointwise"] else o["read"] + o["written"]) / gpu["bw"])
            if o["pointwise"] and i > 0 and self.ops[i - 1]["pointwise"]:
                out[-1] += t
            else:
                out.append(t)
        return out


# -- op counts by name, and the launches of compiled code (bench/dispatch_count.py) ------------------------------
IGNORED = {"aten.detach.default"}  # autograd bookkeeping of no_grad parameters, not work


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name (overload included): every op that reaches the dispatcher below autograd, views
    included (each is a dispatch in eager), metadata queries (``prim.*``) and :data:`IGNORED` left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name not in IGNORED and not name.startswith("prim."):  # prim.device etc.: metadata queries
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


_CALL = re.compile(r"\b(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|torch\.ops\.aten\.\w+(?:\.\w+)?)\s*[\(\.]")


def kernels_in(code: str) -> Counter[str]:
    """Launches in the ``call()`` functions of inductor output code (one per compiled graph): generated fused
    kernels (counted as ``fused``), ``extern_kernels.*`` and aten fallbacks, each by name."""
    out: Counter[str] = Counter()
    lines = code.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)def call\(", line)
        if not m:
            continue
        indent = len(m.group(1))
        for body in lines[i + 1 :]:
            if body.strip() and len(body) - len(body.lstrip()) <= indent:
                break  # end of call()
            s = body.strip()
            if s.startswith(("#", "del ", "assert_")):
                continue
            for k in _CALL.finditer(s):
                kind = k.group(1)
                out["fused" if kind.startswith(("cpp_fused_", "triton_")) else kind] += 1
    return out
