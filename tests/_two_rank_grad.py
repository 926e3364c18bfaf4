"""Rank body of tests/test_loss_normalisation.py: two DeepSpeed ranks run ``tdlm.training.train_step`` and
record, at step 1, the temporal weights, this rank's micro-batches and the full (all-reduced) gradient the
engine is about to apply. The test recomputes Eq. 5 in one process over the union of both ranks' batches.

    deepspeed --num_gpus 2 tests/_two_rank_grad.py --ds DS.json --out DIR section.key=value ...

Step 0 runs first, unrecorded: W_O starts at zero, so only after one update do W_Q, W_K, W_V and the sink
receive gradients. Gradients are read with ``deepspeed.utils.safe_get_full_grad`` just before the engine's
optimizer step at the accumulation boundary (after reduction across ranks and micro-batches, before
clipping and the update).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    from tdlm.config import apply_overrides, from_dict, load_yaml
    from tdlm.training import RunConfig, setup, train_step

    run = from_dict(RunConfig, apply_overrides(load_yaml(REPO / "configs" / "tiny.yaml"), args.overrides), "test")
    sess = setup(run, json.loads(Path(args.ds).read_text()))
    params = dict(sess.model.temporal.named_parameters())
    train_step(sess, 0)

    weights = {}
    for name, p in params.items():  # collective under ZeRO-3: every rank gathers every tensor
        with deepspeed.zero.GatheredParameters([p]):
            weights[name] = p.detach().float().cpu().clone()
    grads: dict[str, torch.Tensor] = {}
    engine_step = sess.engine.step

    def step(*a, **kw):
        if sess.engine.is_gradient_accumulation_boundary():
            for name, p in params.items():  # collective under ZeRO-3
                grads[name] = safe_get_full_grad(p).detach().float().cpu().clone()
        return engine_step(*a, **kw)

    sess.engine.step = step
    batches = sess.stream.step_batches(1, run.train.grad_accum)
    metrics = train_step(sess, 1)
    assert grads, "no accumulation boundary seen in train_step"
    torch.save(
        {
            "rank": sess.rank,
            "world": sess.world,
            "weights": weights,
            "grads": grads,
            "batches": [(b.input_ids, b.labels, b.attention_mask, b.prompt_len) for b in batches],
            "local_tokens": sum(b.num_targets for b in batches),
            "metrics": metrics,
            "layers": sess.model.layer_ids,
            "heads": sess.model.config.heads,
            "head_dim": sess.model.config.head_dim,
        },
        Path(args.out) / f"rank{sess.rank}.pt",
    )
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # gloo's worker thread can abort a normal interpreter shutdown (shared notes)
