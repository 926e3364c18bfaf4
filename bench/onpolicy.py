"""Do on-policy rounds make the adapter earn its place? Arms x training seeds on multi-v1 (issue 47).

Arms, each trained with training seeds 0, 1, 2 on the same round-0 teacher trajectories
(``configs/gen_tiny_multi.yaml``: 1,024 prompts, ``original``):

* ``off-policy``   - round 0 alone: ``configs/tiny_multi.yaml`` (make demo's recipe);
* ``more-data``    - ``ray_jobs/onpolicy.py`` with ``switch: start`` (s* = 0: every roll-out is the teacher's record on
  fresh prompts), the same rounds, mix and updates as the on-policy arm: a gain must not be just more data;
* ``on-policy``    - ``ray_jobs/onpolicy.py`` with the recipe chosen on validation (``--recipe``);
* ``current-only`` - the on-policy recipe with ``model.history=current`` from round 0 on (the same parameters, attending
  only to the current evaluation: whether history helps at all).

References: ``threshold`` and dInfer's ``credit`` at tau 0.9 (no training). Every arm decodes with ``tdlm`` at tau 0.95
(the demo's). ``--search`` first runs the recipe candidates on seed 0 and scores them on the *validation* split
(300 problems); ``--final`` evaluates the chosen recipe's arms on the 500 test problems with ``eval/run.py`` and writes
``bench/results/onpolicy.json``: per arm accuracy (mean +- sd over seeds) and NFE, the two-level bootstrap intervals
(problems once for both sides, each side's seeds on its own) and the ``targets`` object.

    python bench/onpolicy.py --search                 # the validation search (seed 0), ~25 min on 2 cores
    python bench/onpolicy.py --final --recipe B       # the 3-seed experiment on the test split, ~70 min

Every stage resumes (finished generation, training, jobs and evaluations are reused).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import exit_with, machine, run_logged, write_result  # noqa: E402

from tdlm.training.run_dir import free_port, training_resume_args  # noqa: E402

SEEDS = (0, 1, 2)
TAU = 0.95  # the demo's tau for TDLM
REF_TAU = 0.9
VALIDATION_PROBLEMS = 300
# Recipe candidates (validation only). Each job has 2 rounds, so versions 1 and 2 of each give the rounds axis.
CANDIDATES: dict[str, list[str]] = {
    "A": ["mix_lambda=0.5", "switch=uniform"],
    "B": ["mix_lambda=1.0", "switch=uniform"],
    "C": ["mix_lambda=0.5", "switch=frac:0.5:1"],
    # after the final run (not a candidate of it): A with the later rounds at a third of the recipe's learning rate
    "D": ["mix_lambda=0.5", "switch=uniform", "round_overrides=optim.warmup_steps=5 optim.lr=0.001"],
}
COMMON = ["rounds=2", "prompts_per_round=512", "mix_size=512", "updates_per_round=50"]


def env() -> dict:
    return os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MKL_CBWR": "AUTO,STRICT",
                         "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"), "RAY_USAGE_STATS_ENABLED": "0"}


def run(cmd: list, log: Path) -> float:
    return run_logged(cmd, log, env(), REPO, mode="a")


def teacher(out: Path) -> Path:
    d = out / "teacher"
    run([sys.executable, "ray_jobs/generate_trajectories.py", "--config", "configs/gen_tiny_multi.yaml", "--prompts",
         "data/multi_prompts.jsonl", "--output-dir", d], out / "logs" / "teacher.log")
    return d


def train_round0(out: Path, traj: Path, name: str, seed: int, extra: list[str]) -> Path:
    d = out / name / f"seed{seed}"
    if not (d / "adapter" / "adapter.safetensors").exists():
        deepspeed = str(Path(sys.executable).parent / "deepspeed")
        run([deepspeed, "--num_gpus", "2", "--master_port", free_port(), "launcher/train.py", "--ds",
             "ds_configs/zero3.json", "--config", "configs/tiny_multi.yaml", "--output-dir", d,
             *training_resume_args(d), f"data.trajectories={traj}", f"train.seed={seed}", *extra],
            out / "logs" / f"{name}-seed{seed}.log")
    return d / "adapter"


def job(out: Path, name: str, traj: Path, adapter0: Path, settings: list[str], train_overrides: list[str],
        seed: int) -> Path:
    d = out / "jobs" / name
    cmd = [sys.executable, "ray_jobs/onpolicy.py", "--config", "configs/onpolicy_tiny_multi.yaml", "--output-dir", d,
           "--round0-trajectories", traj, "--round0-adapter", adapter0, "--seed", seed, "--wandb-mode", "disabled"]
    for kv in [*COMMON, *settings]:
        k, v = kv.split("=", 1)
        cmd += [f"--{k.replace('_', '-')}", *v.split()]  # a list flag takes its items apart
    if train_overrides:
        cmd += ["--train-overrides", *train_overrides]
    run(cmd, out / "logs" / f"job-{name}.log")
    return d


def validation_accuracy(adapter: Path, n: int = VALIDATION_PROBLEMS) -> dict:
    """tdlm at TAU on the first n validation problems (never the test split), in this process."""
    import torch

    from tdlm.data.tokenizer import encode_prompts, load_tokenizer, stop_token_ids
    from tdlm.decoding import decode
    from tdlm.evaluation.scoring import score
    from tdlm.models.loading import load_backbone
    from tdlm.tasks.multi import load_split
    from tdlm.tasks.toydata import MULTI_GEN_LENGTH
    from tdlm.temporal.model import TDLM

    torch.set_num_threads(2)
    bb = load_backbone("tiny-multi", dtype="float32")
    tok = load_tokenizer("tiny-multi")
    model = TDLM.from_adapter(bb, adapter)
    task = load_split("validation", n)
    problems = list(task)
    ids = encode_prompts(tok, [p.prompt for p in problems])
    correct, nfe = [], []
    for i in range(0, len(ids), 50):
        res = decode(model, ids[i : i + 50], policy="tdlm", threshold=TAU, gen_length=MULTI_GEN_LENGTH,
                     block_size=MULTI_GEN_LENGTH, tokenizer=tok, stop_ids=stop_token_ids(tok, bb.eos_token_id))
        for p, r in zip(problems[i : i + 50], res, strict=True):
            correct.append(bool(score(p, r.text).correct))
            nfe.append(r.nfe)
    return {"accuracy": sum(correct) / len(correct), "nfe_mean": statistics.fmean(nfe), "n": len(correct)}


def search(out: Path, traj: Path) -> dict:
    """Candidates A-C on seed 0, both rounds each, scored on validation; plus the off-policy and more-data points."""
    off0 = train_round0(out, traj, "off", 0, [])
    rows = {"off-policy (round 0)": validation_accuracy(off0)}
    for name, settings in CANDIDATES.items():
        d = job(out, f"on-policy-{name}-seed0", traj, off0, settings, [], 0)
        for r in (1, 2):
            label = f"{name} round {r} ({', '.join(settings)})"
            rows[label] = validation_accuracy(d / "rounds" / f"{r:02d}" / "adapter")
    d = job(out, "more-data-lam0.5-seed0", traj, off0, ["mix_lambda=0.5", "switch=start"], [], 0)
    for r in (1, 2):
        rows[f"more-data round {r}"] = validation_accuracy(d / "rounds" / f"{r:02d}" / "adapter")
    for k, v in rows.items():
        print(f"| {k} | {100 * v['accuracy']:.1f}% | {v['nfe_mean']:.2f} |", flush=True)
    return rows


def final(out: Path, traj: Path, recipe: str, rounds: int) -> dict:
    """The four arms x SEEDS, then one evaluation of every adapter and both references on the 500 test problems."""
    from tdlm.onpolicy.verdict import markdown, verdict

    settings = CANDIDATES[recipe]
    lam = [kv for kv in settings if kv.startswith("mix_lambda=")]
    adapters: dict[str, Path] = {}
    for s in SEEDS:
        off = train_round0(out, traj, "off", s, [])
        cur0 = train_round0(out, traj, "current0", s, ["model.history=current"])
        v = f"{rounds:02d}"
        adapters[f"off-policy-s{s}"] = off
        # jobs are named by their settings, so the search's seed-0 jobs are the final's
        adapters[f"on-policy-s{s}"] = job(out, f"on-policy-{recipe}-seed{s}", traj, off, settings, [],
                                          s) / "rounds" / v / "adapter"
        lam_name = lam[0].split("=")[1] if lam else "0.5"
        adapters[f"more-data-s{s}"] = job(out, f"more-data-lam{lam_name}-seed{s}", traj, off, [*lam, "switch=start"],
                                          [], s) / "rounds" / v / "adapter"
        adapters[f"current-only-s{s}"] = job(out, f"current-only-{recipe}-seed{s}", traj, cur0, settings,
                                             ["model.history=current"], s) / "rounds" / v / "adapter"
    ev = out / f"eval-test-{recipe}{rounds}"
    run([sys.executable, "eval/run.py", "--backbone", "tiny-multi", "--adapter",
         *[f"{k}={v}" for k, v in adapters.items()], "--tasks", "multi", "--policies", "threshold", "credit", "tdlm",
         "--thresholds", REF_TAU, "--credit-thresholds", REF_TAU, "--tdlm-thresholds", TAU, "--dtype", "float32",
         "--gen-length", "56", "--block-size", "56", "--batch-size", "50", "--warmup", "0", "--workers", "2",
         "--output-dir", ev, "--group", "onpolicy-bench", "--wandb-mode", "disabled"], out / "logs" / f"{ev.name}.log")
    result = verdict(ev, list(SEEDS), TAU, REF_TAU)
    print(markdown(result), flush=True)
    per_job = {}
    for d in sorted((out / "jobs").glob("*")):
        if (d / "onpolicy.json").exists():
            per_job[d.name] = json.loads((d / "onpolicy.json").read_text())["rounds"]
    return result | {"recipe": {"name": recipe, "settings": [*COMMON, *settings], "rounds_used": rounds},
                     "adapters": {k: str(v) for k, v in adapters.items()}, "jobs": per_job, "eval_dir": str(ev)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--search", action="store_true", help="the validation search on seed 0")
    ap.add_argument("--final", action="store_true", help="the 3-seed experiment on the test split")
    ap.add_argument("--cost", action="store_true", help="the predicted cost of one LLaDA-8B round on 8 GPUs (from "
                    "bench/results/true_shape.json; tdlm.onpolicy.cost)")
    ap.add_argument("--table", action="store_true", help="print the search and final tables of --result as Markdown "
                    "(docs/training.md quotes them)")
    ap.add_argument("--round0", action="store_true", help="only the round-0 adapters of every seed (off-policy and "
                    "current-only), which every recipe shares")
    ap.add_argument("--recipe", choices=sorted(CANDIDATES), default="A", help="the on-policy recipe (from --search)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the chosen recipe (1 or 2, from --search)")
    ap.add_argument("--out", default=str(REPO / "runs" / "onpolicy_bench"))
    ap.add_argument("--result", default=str(REPO / "bench" / "results" / "onpolicy.json"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    t0 = time.time()
    result_path = Path(args.result)
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if args.table:
        from tdlm.onpolicy.verdict import markdown

        search_rows = result.get("search", {}).get("rows", {})
        print(f"| candidate (validation, seed 0, tdlm tau {TAU:g}) | accuracy | NFE |\n|---|---|---|")
        for name, r in search_rows.items():
            print(f"| {name} | {100 * r['accuracy']:.1f}% | {r['nfe_mean']:.2f} |")
        if "final" in result:
            print()
            print(markdown(result["final"] | {"targets": result["targets"]}))
        return 0
    if args.cost:
        from tdlm.onpolicy.cost import cost_table, round_cost

        result["cost_llada_8b"] = round_cost(json.loads((REPO / "bench" / "results" / "true_shape.json").read_text()))
        print(cost_table(result["cost_llada_8b"]))
        write_result(result_path, result)
        if not (args.round0 or args.search or args.final):
            return 0
    traj = teacher(out)
    if args.round0:
        for s in SEEDS:
            train_round0(out, traj, "off", s, [])
            train_round0(out, traj, "current0", s, ["model.history=current"])
    if args.search:
        result["search"] = {"split": f"multi-v1 validation, first {VALIDATION_PROBLEMS}", "tau": TAU, "seed": 0,
                            "common": COMMON, "candidates": CANDIDATES, "rows": search(out, traj),
                            "minutes": (time.time() - t0) / 60}
        result["machine"] = machine()
        write_result(result_path, result)
    if args.final:
        result["final"] = final(out, traj, args.recipe, args.rounds)
        result["machine"] = machine()
        result["targets"] = result["final"].pop("targets")
        result["minutes_final"] = (time.time() - t0) / 60
        write_result(result_path, result)
    return 0


if __name__ == "__main__":
    exit_with(main)
