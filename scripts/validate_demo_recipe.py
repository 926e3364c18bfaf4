"""Compare tiny-arith adapters (the demo task until 2026-11-30) on a *validation* split, never the test split.

The tiny-arith recipe choices (teacher policy, block size) were made here, so the test split that the
arith demo reported stayed untouched. Validation problems are the ``prompts`` stream of
``tdlm.tasks.toydata`` after the first ``--skip`` (the teacher prompts), minus any question that also
appears among the teacher prompts; the test split is disjoint from that stream by construction.

Usage (adapters from ``deepspeed launcher/train.py ... --output-dir DIR``; LABEL=DIR/adapter)::

    python scripts/validate_demo_recipe.py original=runs/demo/train/adapter thr=runs/x/adapter \\
        --problems 300 --taus 0.5 0.7 0.9

Prints, per tau, the accuracy and mean NFE of the ``threshold`` baseline and of every adapter with the
``tdlm`` policy (block 40 unless ``--block-size``, 40 tokens, fp32, batch 16: decode() is exact in
batch, so the tokens equal batch-1 decoding), and writes the table as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("adapters", nargs="+", metavar="LABEL=DIR", help="adapter folders to compare")
    ap.add_argument("--problems", type=int, default=300)
    ap.add_argument("--skip", type=int, default=512, help="teacher prompts at the head of the stream")
    ap.add_argument("--taus", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=None, help="decoding block (default: the demo's)")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args()

    import torch
    from tqdm import tqdm

    from tdlm.data.tokenizer import encode_prompts, load_tokenizer, stop_token_ids
    from tdlm.decoding import decode
    from tdlm.demo import BACKBONE, DTYPE, GEN_LENGTH
    from tdlm.evaluation.scoring import score_math
    from tdlm.models.loading import load_backbone
    from tdlm.tasks.toydata import split
    from tdlm.temporal.model import TDLM

    torch.set_num_threads(1)
    block = args.block_size or GEN_LENGTH
    stream = split("prompts", args.skip + 4 * args.problems)
    seen = {p.question for p in stream[: args.skip]}
    val = [p for p in stream[args.skip :] if p.question not in seen][: args.problems]
    bb = load_backbone(BACKBONE, dtype=DTYPE)
    tok = load_tokenizer(BACKBONE)
    stop = stop_token_ids(tok, bb.eos_token_id)
    ids = encode_prompts(tok, [p.question for p in val])
    models = {"threshold": (bb, "threshold")}
    for spec in args.adapters:
        label, _, path = spec.partition("=")
        models[label] = (TDLM.from_adapter(bb, path), "tdlm")

    rows = []
    bar = tqdm(total=len(models) * len(args.taus) * len(val), desc="validate", unit="sample")
    for tau in args.taus:
        for label, (model, policy) in models.items():
            correct, nfe = 0, 0
            for s in range(0, len(val), args.batch_size):
                out = decode(model, ids[s : s + args.batch_size], policy=policy, threshold=tau,
                             gen_length=GEN_LENGTH, block_size=block, tokenizer=tok, stop_ids=stop)  # fmt: skip
                for r, p in zip(out, val[s : s + args.batch_size], strict=True):
                    correct += bool(score_math("arith", r.text, str(p.answer)).correct)
                    nfe += r.nfe
                bar.update(len(out))
            rows.append({"tau": tau, "model": label, "accuracy": 100 * correct / len(val), "nfe": nfe / len(val)})
    bar.close()

    print(f"\nvalidation: {len(val)} problems (prompts stream after {args.skip}), block {block}, fp32\n")
    print("| tau | model | accuracy | NFE |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['tau']:g} | {r['model']} | {r['accuracy']:.1f}% | {r['nfe']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"problems": len(val), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
