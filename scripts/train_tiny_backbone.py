"""Train the embedded default backbone: a tiny LLaDA-architecture masked-diffusion model on the
arithmetic-chain task of ``tdlm.tasks.toydata`` (CPU, minutes to an hour; seed fixed).

    python scripts/train_tiny_backbone.py                       # writes tdlm/assets/tiny-arith/
    python scripts/train_tiny_backbone.py --steps 200 --out /tmp/x   # a quick smoke run
    # tiny-multi: the multi-v1 task (many surface forms per problem), fine-tuned from tiny-arith
    OMP_NUM_THREADS=1 python scripts/train_tiny_backbone.py --task multi --init tiny-arith --threads 1 \
        --steps 3600 --lr 1e-3 --warmup 100 --eval-every 400   # writes tdlm/assets/tiny-multi/ (59 min)

Tasks: ``arith`` (``arith-v1``: one surface form; accuracy on the held-out test split, as shipped) and ``multi``
(``multi-v1``: every training example gets a freshly drawn surface form; accuracy on the *validation* split only,
the test split is left to ``make demo``). ``--init`` starts from a shipped backbone / checkpoint folder of the same
shape instead of random weights.

Objective (LLaDA SFT): for each sample draw t ~ U(0, 1), mask every response token independently with
probability p = (1 - eps) t + eps, never mask the prompt, and minimise
sum_{masked} CE / p / |response| (an upper bound on the response NLL). The response is the worked
solution, ``<|eot|>``, then ``<|eos|>`` padding up to the generation length, as in LLaDA's SFT data.

The folder written is a release-format checkpoint (config.json, safetensors, tokenizer files with the
chat template) plus a model card with the training curve and held-out accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tdlm.data.tokenizer import build_toy_tokenizer, encode_prompts  # noqa: E402
from tdlm.decoding import decode  # noqa: E402
from tdlm.models.llada import LLaDA, LLaDAConfig  # noqa: E402
from tdlm.models.loading import init_weights, save_backbone  # noqa: E402
from tdlm.tasks.toydata import (  # noqa: E402
    ARITH_TRAIN_DRAWS,
    MULTI_GEN_LENGTH,
    MULTI_TASK_VERSION,
    MULTI_VALIDATION_SIZE,
    TASK_VERSION,
    multi_split,
    split,
)

GEN_LENGTH = 40  # arith-v1: longest solution is 33 characters + <|eot|>
TASKS = {  # task -> (task version, response length, asset name, evaluation split)
    "arith": (TASK_VERSION, GEN_LENGTH, "tiny-arith", "test"),
    "multi": (MULTI_TASK_VERSION, MULTI_GEN_LENGTH, "tiny-multi", "validation"),
}
MODEL = dict(d_model=128, n_layers=6, n_heads=4, n_kv_heads=4, mlp_hidden_size=384, vocab_size=128,
             embedding_size=128, rope_theta=10000.0, rms_norm_eps=1e-5, max_sequence_length=256,
             mask_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16",
             tdlm_temporal_default={"layers": "dispersed:3", "heads": 2, "head_dim": 32})


def encode_batch(tok, problems, gen_length: int, solutions=None):
    """Prompt + response ids; ``solutions`` (one per problem) replace the problems' reference solutions."""
    solutions = [p.solution for p in problems] if solutions is None else solutions
    prompts = encode_prompts(tok, [p.question for p in problems])
    eot = tok.convert_tokens_to_ids("<|eot|>")
    P = max(len(p) for p in prompts)
    ids = torch.full((len(problems), P + gen_length), tok.pad_token_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, (p, sol) in enumerate(zip(prompts, solutions, strict=True)):
        resp = tok(sol, add_special_tokens=False)["input_ids"] + [eot]
        resp = resp + [tok.eos_token_id] * (gen_length - len(resp))
        assert len(resp) == gen_length, sol
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:] = torch.tensor(resp)
        am[i, P - len(p):] = 1
    return ids, am, P


def accuracy(model, tok, problems, gen_length: int, block: int) -> float:
    prompts = encode_prompts(tok, [p.question for p in problems])
    res = decode(model, prompts, policy="original", gen_length=gen_length, block_size=block, tokenizer=tok,
                 stop_ids={tok.eos_token_id, tok.convert_tokens_to_ids("<|eot|>")})
    return sum(r.text.strip().endswith(f"\\boxed{{{p.answer}}}") for r, p in zip(res, problems, strict=True)) / len(
        problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="arith")
    ap.add_argument("--out", default=None, help="default: tdlm/assets/tiny-<task>")
    ap.add_argument("--init", default=None,
                    help="start from this backbone (shipped name or checkpoint folder) instead of random weights")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                    help="bf16 autocast (faster only on CPUs with AVX512-BF16/AMX; 5x slower without)")
    args = ap.parse_args()
    task_version, gen_length, asset_name, eval_split = TASKS[args.task]
    out = Path(args.out or f"tdlm/assets/{asset_name}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = build_toy_tokenizer()
    model = LLaDA(LLaDAConfig.from_dict(MODEL))
    init_weights(model, args.seed)
    init = None
    if args.init:
        from tdlm.models.loading import load_backbone

        src = load_backbone(args.init, dtype=torch.float32)
        model.load_state_dict(src.state_dict())  # strict: same shape as MODEL or an error
        init = {"backbone": args.init, "backbone_id": src.backbone_id, "weight_fingerprint": src.weight_fingerprint}
        del src
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def lr_at(s: int) -> float:
        if s < args.warmup:
            return (s + 1) / args.warmup
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / max(1, args.steps - args.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    if args.task == "arith":
        train = split("train", ARITH_TRAIN_DRAWS, args.seed)
        test = split("test", 500, args.seed)
    else:
        train = multi_split("train", ARITH_TRAIN_DRAWS, args.seed)
        test = multi_split("validation", MULTI_VALIDATION_SIZE, args.seed)  # never the held-out test split
    rng = random.Random(args.seed)
    style_rng = random.Random(args.seed * 1000 + 7)  # multi: the surface form of every training example
    g = torch.Generator().manual_seed(args.seed)
    eps = 1e-3
    curve = []
    t0 = time.time()
    ema = None
    for step in range(args.steps):
        batch = [train[rng.randrange(len(train))] for _ in range(args.batch_size)]
        sols = [p.sample_solution(style_rng) for p in batch] if args.task == "multi" else None
        ids, am, P = encode_batch(tok, batch, gen_length, sols)
        t = torch.rand(len(batch), 1, generator=g)
        p_mask = (1 - eps) * t + eps
        masked = torch.zeros_like(ids, dtype=torch.bool)
        masked[:, P:] = torch.rand(len(batch), gen_length, generator=g) < p_mask
        noisy = torch.where(masked, torch.full_like(ids, MODEL["mask_token_id"]), ids)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(noisy, attention_mask=am)
        ce = F.cross_entropy(logits.float()[masked], ids[masked], reduction="none")
        weights = (1.0 / p_mask).expand_as(masked)[masked]
        loss = (ce * weights).sum() / (len(batch) * gen_length)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}/{args.steps} loss {ema:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            acc = accuracy(model, tok, test[: args.eval_size], gen_length, gen_length)
            model.train()
            curve.append({"step": step + 1, "loss_ema": round(ema, 4), f"acc@{args.eval_size}": acc,
                          "minutes": round((time.time() - t0) / 60, 1)})
            print(json.dumps(curve[-1]), flush=True)
    minutes = (time.time() - t0) / 60
    model.eval()
    # Ship bf16 weights (half the bytes); accuracy below is measured on exactly what is shipped.
    model = model.to(torch.bfloat16)
    save_backbone(model, out, max_shard_bytes=50 * 2**20, name=asset_name)
    tok.save_pretrained(str(out))
    shipped = LLaDA(LLaDAConfig.from_dict(MODEL))
    shipped.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    shipped.eval()
    accs = {}
    for block in (gen_length, 8):
        accs[block] = accuracy(shipped, tok, test, gen_length, block)
    meta = {"task": task_version, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "seed": args.seed, "minutes": round(minutes, 1), "gen_length": gen_length, "curve": curve,
            f"{eval_split}_accuracy_original": {f"block{b}": a for b, a in accs.items()},
            f"{eval_split}_size": len(test),
            "parameters": sum(p.numel() for p in shipped.parameters())}
    if args.task == "multi":
        meta.update({"init": init, "warmup": args.warmup, "threads": args.threads, "bf16_autocast": args.bf16,
                     "eval_split": eval_split, "curve_problems": args.eval_size,
                     "weights_bytes": sum((out / f).stat().st_size for f in _shards(out))})
        (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
        (out / "README.md").write_text(multi_card(meta, MODEL))
        print(json.dumps(meta[f"{eval_split}_accuracy_original"]), flush=True)
        return
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    rows = "\n".join(f"| {c['step']} | {c['loss_ema']} | {100 * c[f'acc@{args.eval_size}']:.0f}% | {c['minutes']} |"
                     for c in curve)
    (out / "README.md").write_text(f"""# tiny-arith: the embedded default backbone

A LLaDA-architecture masked-diffusion model ({meta['parameters']:,} parameters: d=128, 6 layers, 4 heads,
SwiGLU 384, character vocabulary of 128) trained from scratch on CPU by
`python scripts/train_tiny_backbone.py` (seed {args.seed}, {args.steps} steps of {args.batch_size}
problems, AdamW lr {args.lr}, bf16 autocast, {minutes:.0f} minutes on 2 cores). Weights are stored in bf16.

Task `{TASK_VERSION}` (`tdlm/tasks/toydata.py`): `3+5-2+9=?` -> `3+5=8 8-2=6 6+9=15 \\boxed{{15}}`,
response length {GEN_LENGTH} (solution, `<|eot|>`, EOS padding). Held-out test split: {len(test)} problems
never seen in training.

## Held-out accuracy, `original` decoding (one token per step, greedy)
| block size | accuracy |
|---|---|
| {GEN_LENGTH} | {100 * accs[GEN_LENGTH]:.1f}% |
| 8 | {100 * accs[8]:.1f}% |

## Training curve (accuracy on the first {args.eval_size} test problems, block {GEN_LENGTH})
| step | loss (EMA) | accuracy | minutes |
|---|---|---|---|
{rows}
""")
    print(json.dumps(meta["test_accuracy_original"]), flush=True)


def _shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def multi_card(meta: dict, model: dict) -> str:
    """The model card of the ``multi`` backbone, every number read from ``meta`` (its training.json)."""
    n, curve_n = meta["validation_size"], meta["curve_problems"]
    acc = meta["validation_accuracy_original"]
    gen = meta["gen_length"]
    init = meta["init"]
    start = (f"fine-tuned from `{init['backbone']}` (weights {init['weight_fingerprint'][:19]}...)" if init
             else "trained from scratch")
    rows = "\n".join(f"| {c['step']} | {c['loss_ema']} | {100 * c[f'acc@{curve_n}']:.0f}% | {c['minutes']} |"
                     for c in meta["curve"])
    return f"""# tiny-multi: a tiny backbone for a task with many equally valid answers

A LLaDA-architecture masked-diffusion model ({meta['parameters']:,} parameters: d={model['d_model']},
{model['n_layers']} layers, {model['n_heads']} heads, SwiGLU {model['mlp_hidden_size']}, character vocabulary of
{model['vocab_size']}), {start} on CPU by
`python scripts/train_tiny_backbone.py --task multi` (seed {meta['seed']}, {meta['steps']} steps of
{meta['batch_size']} problems, AdamW lr {meta['lr']} with {meta['warmup']} warm-up steps and cosine decay,
fp32, {meta['threads']} torch thread(s), {meta['minutes']} minutes of training). Weights are stored in bf16
({meta['weights_bytes']:,} bytes).

Task `{meta['task']}` (`tdlm/tasks/toydata.py`): the question `3+5-2+9 = ?`; every training example is written in a
freshly drawn surface form (compact or spaced steps, operands of a `+` in either order, result first or last,
three separators, three lead-ins to the box), e.g. `3+5=8 8-2=6 6+9=15 \\boxed{{15}}` or
`8 = 5 + 3; 6 = 8 - 2; 15 = 9 + 6, so \\boxed{{15}}`; scored by the boxed result. Response length {gen}
(solution, `<|eot|>`, EOS padding). Validation and test chains come from a pool that neither this model's nor
`tiny-arith`'s training stream ever drew; the numbers below are on the **validation** split ({n} problems),
never on the held-out test split.

## Validation accuracy, `original` decoding (one token per step, greedy)
| block size | accuracy |
|---|---|
| {gen} | {100 * acc[f'block{gen}']:.1f}% |
| 8 | {100 * acc['block8']:.1f}% |

## Training curve (accuracy on the first {curve_n} validation problems, block {gen})
| step | loss (EMA) | accuracy | minutes |
|---|---|---|---|
{rows}
"""


if __name__ == "__main__":
    main()
