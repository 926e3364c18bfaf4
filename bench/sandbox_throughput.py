"""MBPP scoring throughput: samples/s of the 257 canonical MBPP solutions through ``Scorer`` with 2 workers, and
the trusted side's worst case: CPU seconds of the verdict for the costliest values that fit its budgets.

Commands (from the repository root, venv active)::

    python bench/sandbox_throughput.py                      # this checkout -> bench/results/sandbox_throughput.json
    python bench/sandbox_throughput.py --against REF        # also older code (a revision or a folder), side by side
    python bench/sandbox_throughput.py --quick              # 40 problems, one round, prints only

What is measured. Each canonical solution (``Problem.answer``, in a ```` ```python ```` fence) is scored by
:meth:`tdlm.evaluation.scoring.Scorer.score_many` with ``Scorer(2)`` and 2 threads, the evaluator's code limits
(``SandboxLimits(timeout_s=30, cpu_s=11)``, the defaults of ``EvalConfig``); samples/s = problems / wall seconds.
Every implementation runs in a fresh subprocess (two ``tdlm`` packages cannot share one interpreter), after one
untimed warm-up of 4 problems (the sandbox's one-time probes). With ``--against REF`` (every bench's flag for older
code, ``benchlib.add_against``: a git revision, its ``tdlm/`` exported, or a folder holding an older checkout) the
two implementations, ``before`` and ``after``, alternate
for ``--rounds`` rounds and the medians are compared, so machine load hits both alike. The pass count is reported
too: every canonical solution must pass.

Worst case (this checkout only): :func:`tdlm.evaluation.sandbox.verdict.judge` - the trusted child that decodes a
sample's values and evaluates its asserts - on crafted values that fit the values cap (4 MiB) and the decoder's
budgets: hash-colliding ints (``hash(k * (2**61 - 1)) == 0``) as a list under the MBPP shape
``set(f(x)) == set(...)``, forged directly as a set and as dict keys; the element budget of small ints; ints at
the digit budget; the nesting budget. CPU seconds are the child's own (``wait4``), 3 repeats, the maximum kept.

Targets (issue 28): after / before <= 1.2 (slowdown against the sandbox before the trusted child); the worst case
<= 2 CPU-s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "sandbox_throughput.json"
DATA = REPO.parent / "shared" / "benchmarks"
TARGET_SLOWDOWN = 1.2
TARGET_WORST_CPU_S = 2.0


def _worst_case() -> dict:
    """The trusted side's CPU seconds on the costliest values that fit its budgets (see the module docstring)."""
    from tdlm.evaluation.sandbox import SandboxLimits, split_asserts
    from tdlm.evaluation.sandbox.trusted import BUDGETS
    from tdlm.evaluation.sandbox.verdict import judge

    cap = SandboxLimits().value_bytes
    m = (1 << 61) - 1
    budget = BUDGETS["elements"] - 8

    def line(tag: str, items: list[str]) -> bytes:
        return ('[0,"ok",["' + tag + '",[' + ",".join(items) + "]]]").encode()

    def upto(make, tag: str, nodes: int = 1) -> bytes:  # as many items as fit the cap and the element budget
        items: list[str] = []
        size = 32
        for k in range(1, budget // nodes):
            item = make(k)
            if size + len(item) + 1 > cap:
                break
            items.append(item)
            size += len(item) + 1
        return line(tag, items)

    digits = "f" * BUDGETS["int_hex_digits"]
    nest = BUDGETS["depth"] - 1
    cases = {
        "colliding ints, list, set(f(x)) == set(...)": (
            "assert set(f(1)) == set((1,))", upto(lambda k: '["i","' + f"{k * m:x}" + '"]', "l")),
        "colliding ints, forged set": ("assert f(1) == {1}", upto(lambda k: '["i","' + f"{k * m:x}" + '"]', "s")),
        "colliding ints, forged dict keys": (
            "assert f(1) == {1: 2}", upto(lambda k: '["t",[["i","' + f"{k * m:x}" + '"],null]]', "d", 3)),
        "element budget of small ints, set(f(x))": (
            "assert set(f(1)) == set((2,))", upto(lambda k: '["i","1"]', "l")),
        "ints at the digit budget, sorted(f(x))": (
            "assert sorted(f(1)) == [1]", upto(lambda k: '["i","' + digits + '"]', "l")),
        "nesting budget, wide": ("assert f(1) == [1]", b'[0,"ok",' + b'["l",[' * nest +
                                 b",".join([b'["i","1"]'] * 100_000) + b"]]" * nest + b"]"),
    }  # fmt: skip
    out = {}
    for name, (test, data) in cases.items():
        assert len(data) <= cap, (name, len(data))
        splits = split_asserts([test], [], {"f"})
        cpu = [judge(splits, data, [], cap).cpu_s for _ in range(3)]
        v = judge(splits, data, [], cap)
        out[name] = {"bytes": len(data), "cpu_s_max": max(cpu + [v.cpu_s]), "cpu_s": cpu, "detail": v.detail}
    return out


def _worker(impl: str, limit: int | None) -> dict:
    """One timed pass in this process over the canonical solutions, with ``tdlm`` imported from ``impl``."""
    sys.path.insert(0, impl)
    from tdlm.evaluation.sandbox import SandboxLimits
    from tdlm.evaluation.scoring import Scorer
    from tdlm.tasks import mbpp

    problems = mbpp.load(DATA, limit=limit).problems
    completions = [f"```python\n{p.answer}\n```" for p in problems]
    limits = SandboxLimits(timeout_s=30.0, cpu_s=11)
    with Scorer(2, sandbox=limits) as scorer:
        scorer.score_many(problems[:4], completions[:4], threads=2)  # warm-up: interpreter probes
        t0 = time.perf_counter()
        scores = scorer.score_many(problems, completions, threads=2)
        seconds = time.perf_counter() - t0
    failed = [p.id for p, s in zip(problems, scores, strict=True) if not s.correct]
    extra = {}
    sb = scores[0].sandbox
    for key in ("backend", "mechanism"):
        if sb is not None and hasattr(sb, key):
            extra[key] = getattr(sb, key)
    return {"impl": impl, "n": len(problems), "seconds": seconds, "samples_per_s": len(problems) / seconds,
            "passed": len(problems) - len(failed), "failed": failed, **extra}  # fmt: skip


def _run(impl: str, limit: int | None, worst: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, *(["--limit", str(limit)] if limit else []),
           *(["--worst"] if worst else [])]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise SystemExit(f"bench worker for {impl} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _portable(value):
    """The result with the implementations' folders named relative to the repository root, or as a copy elsewhere
    (the results JSON is committed: no machine's absolute paths)."""
    sys.path.insert(0, str(REPO / "bench"))
    from benchlib import repo_relative

    return repo_relative(value, lambda p: f"a copy of the tree outside the repository ({Path(p).name})")


def main() -> None:
    from benchlib import add_against, older_tree  # bench/ is sys.path[0] when run as a script

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_against(ap, "its sandbox timed side by side (before / after)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, help="first N problems only")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help=f"result JSON (default {RESULTS.relative_to(REPO)}, not written with --quick)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worst", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.worst:
            sys.path.insert(0, args.worker)
            print(json.dumps(_worst_case()))
        else:
            print(json.dumps(_worker(args.worker, args.limit)))
        return
    limit, rounds = (40, 1) if args.quick else (args.limit, args.rounds)
    impls = {"after": str(REPO)} | ({"before": str(older_tree(args.against))} if args.against else {})
    runs: dict[str, list[dict]] = {k: [] for k in impls}
    load = [os.getloadavg()[0]]
    for _ in range(rounds):
        for name in sorted(impls, reverse=True):  # before first in each round
            runs[name].append(_run(impls[name], limit))
            print(f"{name}: {runs[name][-1]['samples_per_s']:.2f} samples/s, {runs[name][-1]['passed']}/"
                  f"{runs[name][-1]['n']} passed", flush=True)  # fmt: skip
    load.append(os.getloadavg()[0])
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                    "load_average_before_after": load, "rounds": rounds, "workers": 2}  # fmt: skip
    print("\n| impl | median samples/s | rounds | passed |\n|---|---|---|---|")
    for name, rs in runs.items():
        med = statistics.median(r["samples_per_s"] for r in rs)
        result[name] = {"median_samples_per_s": med, "runs": rs}
        each = ", ".join(f"{r['samples_per_s']:.2f}" for r in rs)
        print(f"| {name} | {med:.2f} | {each} | {rs[-1]['passed']}/{rs[-1]['n']} |")
    if "before" in runs:
        slow = result["before"]["median_samples_per_s"] / result["after"]["median_samples_per_s"]
        result["slowdown_after_vs_before"] = slow
        result["target_met"] = slow <= TARGET_SLOWDOWN
        print(f"\nslowdown after/before: {slow:.2f}x (target <= {TARGET_SLOWDOWN}x: "
              f"{'met' if slow <= TARGET_SLOWDOWN else 'NOT met'})")  # fmt: skip
    worst = _run(impls["after"], None, worst=True)
    top = max(w["cpu_s_max"] for w in worst.values())
    result["trusted_worst_case"] = {"cases": worst, "cpu_s_max": top, "target_cpu_s": TARGET_WORST_CPU_S,
                                    "target_met": top <= TARGET_WORST_CPU_S}  # fmt: skip
    print("\n| trusted side, worst value | bytes | CPU-s (max of 4) | verdict |\n|---|---|---|---|")
    for name, w in worst.items():
        print(f"| {name} | {w['bytes']:,} | {w['cpu_s_max']:.2f} | {w['detail'][:60]} |")
    print(f"\nworst case {top:.2f} CPU-s (target <= {TARGET_WORST_CPU_S}: "
          f"{'met' if top <= TARGET_WORST_CPU_S else 'NOT met'})")
    if args.out or not args.quick:
        path = Path(args.out) if args.out else RESULTS
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_portable(result), indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
