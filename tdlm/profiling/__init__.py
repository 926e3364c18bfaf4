"""Instruments that measure the library's own code without running it at scale: what an op reads, writes and
launches, traced at the release models' true shape under ``FakeTensorMode``, and priced on a GPU.

Modules, lowest first:

* :mod:`tdlm.profiling.ledger`: the counters. :class:`~tdlm.profiling.ledger.Ledger` (a ``TorchDispatchMode``:
  bytes, FLOPs and kernels per op, the temporal history's traffic, the true-shape checks),
  :class:`~tdlm.profiling.ledger.OpCounter` (aten ops by name) and
  :func:`~tdlm.profiling.ledger.kernels_in` (launches in inductor's generated code).
* :mod:`tdlm.profiling.tracing`: a region traced with the ledger, torch's FlopCounterMode and MemTracker, host reads
  answered and the GPU's attention kernel swapped in.
* :mod:`tdlm.profiling.roofline`: the GPU cost model (roofline per GPU, launches added or overlapped).
* :mod:`tdlm.profiling.true_shape`: the 8B models built fake, their training micro-step and decode steps traced.
* :mod:`tdlm.profiling.static_memory`: the static storage plan's bytes per row and bucket table.
* :mod:`tdlm.profiling.predictions`: ms per NFE predicted for the roofline table and the GPU check's settings.

The memory planner's own meter (``PeakMeter``, ``tensor_bytes``) stays in :mod:`tdlm.training.planner.measure`, where
the planner measures real steps; this package is the trace-and-price side. ``bench/true_shape.py`` and
``bench/dispatch_count.py`` are its drivers.
"""
