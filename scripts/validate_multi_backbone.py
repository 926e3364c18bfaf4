"""Does the ``multi-v1`` backbone give parallel decoding something to win?  Checked on the *validation* split only.

Decodes the ``multi-v1`` validation problems (``tdlm.tasks.multi.load_split("validation")``; the held-out test split
is never read here) with ``original`` and with ``threshold`` over a tau sweep, and with each ``--adapter`` (policy
``tdlm``) over the same sweep, one block spanning the whole response (the demo's regime), greedy, fp32, and prints
(the recipe search of ``make demo`` was run with it: bench/results/multi_recipe_search.json):

1. the trade-off table: accuracy (Math-Verify on the boxed result) with its standard error, the share of responses
   that are a correct worked solution (three true steps in order and the right box, styles may mix:
   ``MultiProblem.is_worked_solution``) and that are exactly one of the problem's valid surface forms, mean /
   median / 90th-percentile NFE and tokens committed per evaluation;
2. how predictions move across evaluations (:mod:`tdlm.decoding.prediction_history`): for the positions that stay masked
   ``--min-masked`` or more evaluations, the fraction whose argmax changed, the switches per position, and how
   often the token finally committed equals the argmax of earlier evaluations (all earlier ones, the first one, and
   by lag), over all such positions and over content positions only (final token not end-of-text / EOS).

Writes everything as JSON (``--out``). Usage::

    OMP_NUM_THREADS=1 python scripts/validate_multi_backbone.py                      # tiny-multi, 300 problems
    python scripts/validate_multi_backbone.py --problems 20 --taus 0.9 --out /tmp/x.json   # a smoke run
    python scripts/validate_multi_backbone.py --no-original --no-threshold --no-diagnostic \\
        --adapter e=runs/multi/train_e/adapter --taus 0.99 0.95 0.9 --out runs/multi/val_e.json  # a recipe candidate
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="tiny-multi")
    ap.add_argument("--problems", type=int, default=None, help="first N validation problems (default: all)")
    ap.add_argument("--taus", type=float, nargs="+", default=[0.9, 0.7, 0.5, 0.3])
    ap.add_argument("--adapter", action="append", default=[], metavar="LABEL=DIR",
                    help="also decode with this TDLM adapter (policy tdlm) at every --taus; repeatable")
    ap.add_argument("--history", default=None,
                    help="decode the adapters with this history (full, last:k, current; default: their own)")
    ap.add_argument("--no-original", action="store_true", help="skip the original-policy row")
    ap.add_argument("--no-threshold", action="store_true", help="skip the threshold-policy rows")
    ap.add_argument("--no-diagnostic", action="store_true",
                    help="skip the prediction-change replay (one extra evaluation pass per row)")
    ap.add_argument("--block-size", type=int, default=None, help="default: the whole response (one block)")
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--min-masked", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench/results/multi_backbone_validation.json"))
    args = ap.parse_args()

    import torch

    from tdlm.data.tokenizer import encode_prompts, load_tokenizer, stop_token_ids
    from tdlm.decoding import decode
    from tdlm.decoding.prediction_history import RequestHistory, change_statistics, replay_argmax
    from tdlm.evaluation.scoring import score_math
    from tdlm.models.loading import load_backbone
    from tdlm.tasks.multi import load_split
    from tdlm.tasks.toydata import MULTI_GEN_LENGTH, MultiProblem

    torch.set_num_threads(args.threads)
    t_start = time.time()
    task = load_split("validation", args.problems)
    gen = MULTI_GEN_LENGTH
    block = args.block_size or gen
    bb = load_backbone(args.backbone, dtype=torch.float32)
    tok = load_tokenizer(args.backbone)
    stop = stop_token_ids(tok, bb.eos_token_id)
    excluded = sorted(stop | {bb.pad_token_id})
    prompts = encode_prompts(tok, [p.prompt for p in task])
    probs = [MultiProblem(p.id, p.prompt, tuple(p.raw["nums"]), tuple(p.raw["ops"]), int(p.answer), "") for p in task]
    forms = [set(p.surface_forms()) for p in probs]

    from tdlm.temporal.model import TDLM

    settings: list[tuple[str, str, float | None, object]] = []
    if not args.no_original:
        settings.append(("original", "original", None, bb))
    if not args.no_threshold:
        settings += [(f"threshold tau={tau:g}", "threshold", tau, bb) for tau in args.taus]
    for spec in args.adapter:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            ap.error(f"--adapter {spec!r}: expected LABEL=DIR")
        model = TDLM.from_adapter(bb, path, history=args.history)
        hist = f" history={args.history}" if args.history else ""
        settings += [(f"tdlm[{label}]{hist} tau={tau:g}", "tdlm", tau, model) for tau in args.taus]
    rows = []
    for method, policy, tau, model in settings:
        t0 = time.time()
        results = []
        for s in range(0, len(prompts), args.batch_size):
            results += decode(model, prompts[s : s + args.batch_size], policy=policy, threshold=tau or 0.9,
                              gen_length=gen, block_size=block, tokenizer=tok, stop_ids=stop,
                              record_states=not args.no_diagnostic)
        decode_s = time.time() - t0
        correct = [bool(score_math("multi", r.text, p.answer).correct) for r, p in zip(results, task, strict=True)]
        valid = [r.text.strip() in f for r, f in zip(results, forms, strict=True)]
        worked = [p.is_worked_solution(r.text) for r, p in zip(results, probs, strict=True)]
        nfe = [r.nfe for r in results]
        histories = [] if args.no_diagnostic else [
            RequestHistory(replay_argmax(model, r.prompt_ids, r.states), r.reveal_step, r.tokens) for r in results]
        n = len(results)
        acc = sum(correct) / n
        row = {
            "method": method,
            "policy": policy,
            "tau": tau,
            "problems": n,
            "accuracy": acc,
            "accuracy_se": math.sqrt(acc * (1 - acc) / n),
            "worked_solution": sum(worked) / n,
            "valid_form": sum(valid) / n,
            "nfe_mean": statistics.fmean(nfe),
            "nfe_median": statistics.median(nfe),
            "nfe_p90": sorted(nfe)[min(n - 1, math.ceil(0.9 * n) - 1)],
            "tokens_per_evaluation": gen / statistics.fmean(nfe),
            "decode_seconds": round(decode_s, 1),
            "changes_all": change_statistics(histories, args.min_masked),
            "changes_content": change_statistics(histories, args.min_masked, exclude_tokens=excluded),
            "examples": [{"id": p.id, "prompt": p.prompt, "response": r.text, "correct": c, "nfe": r.nfe}
                         for p, r, c in list(zip(task, results, correct, strict=True))[:5]],
        }
        rows.append(row)
        print(f"{row['method']}: accuracy {100 * acc:.1f}% nfe {row['nfe_mean']:.2f} ({decode_s:.0f} s)", flush=True)

    print(f"\nmulti-v1 validation split: {len(task)} problems, backbone {args.backbone} "
          f"({bb.weight_fingerprint[:19]}...), {gen} tokens, block {block}, greedy, fp32\n")
    print("| method | accuracy | worked solution | exact valid form | NFE mean | NFE median | NFE p90 | "
          "tokens / evaluation |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {100 * r['accuracy']:.1f} ± {100 * r['accuracy_se']:.1f}% | "
              f"{100 * r['worked_solution']:.1f}% | {100 * r['valid_form']:.1f}% | {r['nfe_mean']:.2f} | "
              f"{r['nfe_median']:g} | {r['nfe_p90']} | "
              f"{r['tokens_per_evaluation']:.2f} |")
    for key, title in (("changes_content", "content positions (final token not end-of-text / EOS)"),
                       ("changes_all", "all response positions")):
        print(f"\nPositions masked for >= {args.min_masked} evaluations, {title}:\n")
        print("| method | positions | mean evaluations masked | argmax changed | switches / position | "
              "final = earlier argmax | final = first argmax | final = argmax at a_p-1 / -2 / -3 | replay agreement |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            c = r[key]
            if not c["positions"]:
                print(f"| {r['method']} | 0 | | | | | | | |")
                continue
            lags = " / ".join(f"{100 * c['final_equals_lag'][k]:.1f}" if k in c["final_equals_lag"] else "-"
                              for k in (1, 2, 3))  # fmt: skip
            print(f"| {r['method']} | {c['positions']} | {c['mean_masked_evaluations']:.1f} | "
                  f"{100 * c['changed']:.1f}% | {c['switches_per_position']:.2f} | "
                  f"{100 * c['final_equals_earlier']:.1f}% | {100 * c['final_equals_first']:.1f}% | {lags}% | "
                  f"{100 * c['replay_agreement']:.1f}% |")

    out = {
        "script": "scripts/validate_multi_backbone.py",
        "date": time.strftime("%Y-%m-%d"),
        "split": "multi-v1 validation",
        "source": task.source,
        "backbone": args.backbone,
        "backbone_fingerprint": bb.weight_fingerprint,
        "gen_length": gen,
        "block_size": block,
        "min_masked": args.min_masked,
        "dtype": "float32",
        "threads": args.threads,
        "wall_seconds": round(time.time() - t_start, 1),
        "rows": rows,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
