"""The CUDA-graph readiness probe (tdlm.profiling.cuda_graphs, driven by bench/cuda_graph_readiness.py) reads what
CUDA-graph trees check (mutated inputs, static or not) correctly."""

from __future__ import annotations

import torch

from tdlm.profiling import cuda_graphs as cgr


class _Ring(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("store", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        self.store.index_put_((slot,), x)  # a buffer: a static input, which CUDA graphs may mutate
        return self.store.sum(0)


def test_a_graph_mutating_a_plain_input_is_not_captured_and_one_mutating_a_buffer_is():
    ring, plain = _Ring(), torch.zeros(4, 8)

    def into_plain(x, slot):
        plain.index_put_((slot,), x)  # a plain tensor: what the decode step's caches are
        return plain.sum(0)

    x, slot = torch.ones(1, 8), torch.tensor([2])
    buffered = cgr.probe(lambda: torch.compile(ring)(x, slot))
    loose = cgr.probe(lambda: torch.compile(into_plain)(x, slot))
    assert len(buffered) == len(loose) == 1
    assert buffered[0]["captured"] and [m["static"] for m in buffered[0]["mutated"]] == [True]
    assert not loose[0]["captured"] and [m["static"] for m in loose[0]["mutated"]] == [False]
    assert loose[0]["mutated"][0]["what"] == "float32 4x8"
