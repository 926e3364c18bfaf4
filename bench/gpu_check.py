"""The GPU check: run once whenever a GPU is lent (``bash bench/gpu_check.sh``; stages, order and budgets here).

Commands (repository root; gpu_check.sh sets PYTHONPATH, installs the carried wheels and tees a log to $OUT)::

    bash bench/gpu_check.sh                  # one H100/H200: every stage, at most 7 minutes (420 s), JSON to $OUT
    bash bench/gpu_check.sh --quick          # the subset below, at most 4 minutes (240 s)
    bash bench/gpu_check.sh --dry-run        # any CPU: every stage at toy size (the test suite runs it)
    bash bench/gpu_check.sh --stages nfe --nfe-settings llada-8b/b3/dual/reduce-overhead/4L/diverge/tdlm
                                             # an opt-in setting alone (the rows that diverge: about 4 minutes)
    python bench/gpu_check.py --deadline-s 300 --stage-deadline-s train=60,deepspeed=80 --setting-cap-s 120

**Always returns what it measured.** The parent process never imports torch; each stage runs in a child process
(its own process group) that the parent kills at the stage's deadline, because nothing inside one process can
stop a CUDA kernel or an inductor compile that runs on for minutes. The child writes ``<out>/gpu_<stage>.json``
after every setting (temporary file + ``os.replace``, so a kill never leaves half a file), and inside a decode
setting after each policy. When a child ends, is killed, or crashes, the parent reads that file, marks the
setting that was running (``deadline``: the stage's deadline; ``cap``: the setting ran past ``--setting-cap-s``;
``crashed``: the child died) and the ones not reached (``not run``), and writes the stage's final status: ``ok``,
``deadline`` (stopped; what finished is kept), ``failed`` (a setting failed or a loss was not finite) or
``skipped`` (the reason given). After a cap, a crash or a CUDA error (which poisons its process, not the next
one) a new child runs the remaining settings. A file whose status is still ``running`` is what a run stopped from
outside (the device's 10-minute limit) left: every finished setting is in it. Exit status 1 when a stage failed; a
deadline alone is not a failure (the order puts what it cuts last).

**Budgets** (``--deadline-s``, from gpu_check.sh's start, wheel install included; ``--stage-deadline-s``):

==========  ========  ========  ==================================================================
stage       default   --quick   settings, in order (cheapest and most telling first)
==========  ========  ========  ==================================================================
train       75 s      40 s      all, dispersed:16 (--quick: all)
deepspeed   90 s      60 s      one ZeRO-3 run on one rank (its JSON after the plan and after each step)
nfe         the rest  the rest  the default set of gpu_check_plan.nfe_settings (--quick: its compiled / memory)
(reserve)   10 s      10 s      the kill, predicted_vs_measured.json
overall     420 s     240 s     7 / 4 minutes: the 15 device-minutes of a session leave room for a rerun
==========  ========  ========  ==================================================================

A stage's budget is a cap: what it leaves flows to the next, and no stage runs past the overall deadline. The
training stages go first because they are bounded (a few steps each), so the decode stage, whose compiled
settings cost minutes, cannot starve them; its own settings run most telling first, so what a deadline cuts is
the least telling.

**What each stage measures** (``train``, ``deepspeed``, ``nfe`` and its launch profile): ``bench/gpu_check_stages.py``,
the child that :func:`run_stage` starts as ``python bench/gpu_check_stages.py STAGE --items JSON --json PATH``.

**Measured beside predicted** (``bench/gpu_check_compare.py``, ``<out>/predicted_vs_measured.json`` and the printed
table): the memory, planner and kernel-count predictions hold on any GPU; the GPU's name picks the time rows
(``gpu_check_common.gpu_kind``, ``select_predictions``): an H200 is held to the H200 rows of
``bench/results/true_shape.json``, a GH200 to the GH200 rows, an H100 SXM to the H100 rows, any other GPU to none.
What the parent, the stage child and the comparison share (the stage JSONs' reader and writer, the stage order, the
prediction rows) is in ``bench/gpu_check_common.py``, a leaf: neither this module nor the comparison imports the
other back.

**Test hooks** (the test suite plants faults with them; never set on a real run): ``TDLM_GPU_CHECK_HOOKS`` is a
``;``-separated list of ``sleep:STAGE:SETTING=SECONDS`` (a setting that hangs; ``SETTING@tdlm``: its tdlm policy,
after threshold finished), ``raise:STAGE[:SETTING]`` (a failing setting), ``cudaerror:STAGE:SETTING`` (a failing
setting whose error poisons the process) and ``nan:STAGE`` (NaN in the backbone's embedding: every loss is NaN).

**CUDA graphs** (``compile="reduce-overhead"``, ``gpu_check_plan.compile_kw``): the default run times LLaDA's batch 1
uncached, tdlm policy, under ``compile="reduce-overhead"`` with ``storage="static"`` (setting
``llada-8b/b1/none/reduce-overhead/4L/tdlm``) beside the same setting under ``compile=True`` with ``storage="static"``
(``.../compiled-static/4L/tdlm``); ``--all-settings`` adds the threshold policy, batch 8 and the dual cache. Both
modes run at the model scope (block scope refuses CUDA graphs, and a ratio stays within one scope) and at 4 of LLaDA's
32 layers at the true width (the depth option: a 32-layer model-scope compile would not fit the budget,
``gpu_check_plan.nfe_plan``), their ms/NFE extrapolated per layer to 32 and said so in the printed row; each after an
untimed decode that compiles and records its graphs. ``compile=True`` settings on the dynamic plan (``.../compiled``)
compile by block (``compile_scope="block"``, regional compilation). bench/true_shape.py predicted them before any GPU
run (``reduce_overhead`` in true_shape.json: the fused roofline, launches about 0, against the compile=True rows'
launches at 5 µs each); the comparison prints each measured reduce-overhead ms/NFE beside its prediction, the measured
reduce-overhead / compiled-static ratio (CUDA graphs alone) beside the predicted one, and compiled-static / compiled
(the static plan alone, predicted 1: modelled by the dynamic trace) where both ran at one scope and depth.

**The default set and the planned order** (``gpu_check_plan``: the settings, their keywords, the budgets and the
check's own cold-compile prediction, printed at the start of a run): the default run's decode settings are the
ones that prediction fits inside 420 s; the run prints the ones it leaves out, which ``--all-settings`` runs after
them and ``--nfe-settings`` names one by one.

``--dry-run`` runs every stage at toy size on the CPU (compile with dynamo's eager backend; a reduce-overhead
setting runs the static plan under that backend; its toy numbers are printed beside the H200 rows only to exercise
that code path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from gpu_check_common import STAGE_ORDER, read_json, write_json
from gpu_check_compare import beside_predicted
from gpu_check_plan import (
    DEADLINE_S,
    RESERVE_S,
    STAGE_CAP_S,
    find_setting,
    left_out,
    nfe_plan,
    nfe_settings,
    stage_items,
)

MIN_STAGE_S = 5.0  # a stage with less than this left is not started (a child needs seconds to import torch)
HOOKS_ENV = "TDLM_GPU_CHECK_HOOKS"
T0_ENV = "GPU_CHECK_T0"  # gpu_check.sh's start (date +%s.%N), exported before its wheel install
CHILD = Path(__file__).resolve().with_name("gpu_check_stages.py")  # one stage in one process (its docstring)


def run_start(environ: Mapping[str, str] | None = None) -> float:
    """When the run began, the origin of ``--deadline-s``: ``$GPU_CHECK_T0``, which gpu_check.sh exports first, so
    the budget covers the wheel install and this interpreter's start (seconds the device tool counts too); the
    current time only when run without the wrapper."""
    value = (os.environ if environ is None else environ).get(T0_ENV)
    if not value:
        return time.time()
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"error: ${T0_ENV}={value!r} is not a Unix time (gpu_check.sh sets it)") from None


def stage_deadline(now: float, t0: float, deadline_s: float, cap_s: float | None) -> float:
    """Absolute time at which a stage starting ``now`` is stopped: its cap, and never past the overall deadline
    less the reserve the end of the run needs."""
    end = t0 + deadline_s - RESERVE_S
    return min(end, now + cap_s) if cap_s else end


# -- test hooks ----------------------------------------------------------------------------------------------
def hooks() -> list[tuple[str, str, str | None, float | None]]:
    """(kind, stage, setting, value) from $TDLM_GPU_CHECK_HOOKS (module docstring); empty on real runs."""
    out = []
    for spec in filter(None, (s.strip() for s in os.environ.get(HOOKS_ENV, "").split(";"))):
        spec, _, value = spec.partition("=")
        kind, stage, *rest = spec.split(":", 2)
        out.append((kind, stage, rest[0] if rest else None, float(value) if value else None))
    return out


def hook(kind: str, stage: str, setting: str | None = None) -> tuple | None:
    return next((h for h in hooks() if h[:2] == (kind, stage) and h[2] in (None, setting)), None)


# -- the parent: each stage in a child it can kill -------------------------------------------------------------
class Interrupted(Exception):
    """SIGTERM / SIGINT reached the parent: stop the child, keep what it wrote."""


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own group: inductor's compile workers go with it
    proc.wait()


def run_stage(stage: str, items: list[str], path: Path, until: float, args, cap_s: float) -> dict:
    """Run ``items`` of ``stage`` in child processes until done or ``until`` (absolute); returns the stage JSON."""
    t_start = time.time()
    pending, state, children = list(items), {}, []
    interrupted, error = None, None
    while pending:
        if time.time() >= until:
            break
        cmd = [sys.executable, str(CHILD), stage, "--items", json.dumps(pending), "--json", str(path)]
        cmd += ["--dry-run"] if args.dry_run else []
        proc = subprocess.Popen(cmd, process_group=0)
        t_child, reason = time.time(), None
        try:
            while proc.poll() is None:
                now = time.time()
                if now >= until:
                    reason = "deadline"
                    break
                running = read_json(path).get("running") if cap_s else None
                if running and now - running["since"] > cap_s:
                    reason = "cap"
                    break
                time.sleep(0.2)
        except Interrupted as e:
            reason, interrupted = "interrupted", e
        finally:
            if proc.poll() is None:  # whatever stopped the wait, no child outlives it
                _kill(proc)
        for tmp in path.parent.glob(f".{path.name}.*.tmp"):  # a write the kill cut short ($OUT returns 8 files)
            tmp.unlink(missing_ok=True)
        doc = read_json(path)
        children.append({"pid": proc.pid, "rc": proc.returncode, "seconds": time.time() - t_child,
                         "stopped": reason})  # fmt: skip
        for row in doc.get("rows", []):
            state.setdefault(row["item"], row.get("status", "ok"))
        running = doc.get("running")
        if running and running["item"] not in state:
            why = {"deadline": f"stopped at the stage's deadline ({until - t_start:.0f} s)",
                   "cap": f"stopped at the setting cap ({cap_s:.0f} s)", "interrupted": "the run was interrupted",
                   None: f"the child process died (exit {proc.returncode})"}[reason]  # fmt: skip
            row = {**running.get("partial", {}), "item": running["item"], "status": reason or "crashed",
                   "error": why, "seconds": time.time() - running["since"]}  # fmt: skip
            doc.setdefault("rows", []).append(row)
            state[running["item"]] = row["status"]
        restart = doc.pop("restart", False)
        doc["running"] = None
        write_json(path, doc)
        pending = [i for i in pending if i not in state]
        if proc.returncode != 0 and not reason and not running and not restart and doc.get("status") != "failed":
            error = f"the child process exited {proc.returncode} outside a setting"
        # A new child only goes on after a setting it had to give up (cap, crash, a CUDA error); one that declares
        # the stage skipped or failed in its setup would do so again.
        setup_said_no = doc.get("status") in ("skipped", "failed")
        if reason in ("deadline", "interrupted") or not (running or restart) or setup_said_no:
            break
    doc = read_json(path) or {"stage": stage, "rows": []}
    if error:
        doc.setdefault("error", error)
    for item in pending:
        state.setdefault(item, "not run")
    bad = {k: v for k, v in state.items() if v not in ("ok", "deadline", "cap", "not run", "interrupted")}
    cut = [k for k, v in state.items() if v in ("deadline", "cap", "not run", "interrupted")]
    if doc.get("status") not in ("skipped", "failed"):
        doc["status"] = "failed" if bad or doc.get("error") else ("deadline" if cut else "ok")
    if bad and "error" not in doc:
        doc["error"] = f"{len(bad)} settings did not finish cleanly: {bad}"
    doc.update(stage=stage, items={i: state.get(i, "not run") for i in items}, deadline_hit=bool(cut),
               budget_s=until - t_start, seconds=time.time() - t_start, children=children, running=None)  # fmt: skip
    write_json(path, doc)
    if interrupted:
        raise interrupted
    return doc


def _parse_caps(text: str) -> dict[str, float]:
    caps = {}
    for part in filter(None, text.split(",")):
        name, _, sec = part.partition("=")
        if name not in STAGE_ORDER or not sec:
            raise SystemExit(f"error: --stage-deadline-s takes STAGE=SECONDS with STAGE in {', '.join(STAGE_ORDER)}")
        caps[name] = float(sec)
    return caps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results",
                    help="folder for gpu_<stage>.json (default: $OUT, else bench/results)")
    ap.add_argument("--dry-run", action="store_true", help="toy size on the CPU: checks every stage's code path")
    ap.add_argument("--quick", action="store_true", help="the subset: at most 240 s (module docstring)")
    ap.add_argument("--stages", default=",".join(STAGE_ORDER), help="comma list, run in this order")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="overall wall limit from gpu_check.sh's start ($GPU_CHECK_T0); default 420, --quick 240")
    ap.add_argument("--stage-deadline-s", default="", metavar="STAGE=S,...",
                    help="per-stage caps (defaults: module docstring); a stage never runs past --deadline-s")
    ap.add_argument("--setting-cap-s", type=float, default=0.0,
                    help="stop one setting after this long and go on with the next in a new child (0: off)")
    ap.add_argument("--nfe-settings", default="",
                    help="comma list of nfe setting names to run, any of --all-settings' (default: the default set)")
    ap.add_argument("--all-settings", action="store_true",
                    help="the opt-in decode settings too, after the default set (nfe_settings; pass a --deadline-s "
                         "that fits them: the printed plan predicts each)")  # fmt: skip
    args = ap.parse_args(argv)
    t0 = run_start()
    mode = "dry" if args.dry_run else ("quick" if args.quick else "full")
    deadline_s = args.deadline_s or DEADLINE_S[mode]
    caps = STAGE_CAP_S[mode] | _parse_caps(args.stage_deadline_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_dryrun" if args.dry_run else ""
    stages = args.stages.split(",")
    unknown = [s for s in stages if s not in STAGE_ORDER]
    if unknown:
        print(f"error: unknown stage(s) {unknown}; expected {', '.join(STAGE_ORDER)}", file=sys.stderr)
        return 2
    plan_items = {s: stage_items(s, args.dry_run, args.quick, args.all_settings) for s in stages}
    if args.nfe_settings and "nfe" in plan_items:
        wanted = args.nfe_settings.split(",")
        known = [s["name"] for s in nfe_settings(args.dry_run, every=True)]
        if set(wanted) - set(known):
            print(f"error: unknown nfe settings {sorted(set(wanted) - set(known))}; known: {known}", file=sys.stderr)
            return 2
        plan_items["nfe"] = wanted

    def stop(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"[gpu_check] {mode} run: deadline {deadline_s:.0f} s from start ({time.time() - t0:.0f} s gone), "
          f"stages {', '.join(stages)}", flush=True)  # fmt: skip
    left = []
    if mode != "dry" and "nfe" in stages:  # the check's own prediction: which decode settings the budget reaches
        plan = nfe_plan(mode, [find_setting(n, False) for n in plan_items["nfe"]], tuple(stages))
        reached = [p for p in plan if p["predicted_end_s"] <= deadline_s - RESERVE_S]
        names = ", ".join(f"{p['name']} by {p['predicted_end_s']:.0f} s" for p in reached)
        print(f"[gpu_check] predicted (cold compiles, COMPILE_S): {len(reached)} of {len(plan)} decode settings "
              f"within {deadline_s:.0f} s: {names}", flush=True)  # fmt: skip
        left = [n for n in left_out(mode) if n not in plan_items["nfe"]]
        if left and not args.nfe_settings:
            print(f"[gpu_check] left out by default ({len(left)}; --all-settings runs them after these, "
                  f"--nfe-settings names any): {', '.join(left)}", flush=True)  # fmt: skip
    results: dict = {}
    for p in [out / f"gpu_{s}{suffix}.json" for s in stages] + [out / f"predicted_vs_measured{suffix}.json"]:
        p.unlink(missing_ok=True)  # an earlier run's file in the same folder would pass for this run's
    try:
        for stage in stages:
            path = out / f"gpu_{stage}{suffix}.json"
            until = stage_deadline(time.time(), t0, deadline_s, caps.get(stage))
            if until - time.time() < MIN_STAGE_S:
                doc = {"stage": stage, "status": "deadline", "rows": [], "deadline_hit": True,
                       "items": {i: "not run" for i in plan_items[stage]}, "error": "no time left at its turn"}
                write_json(path, doc)
            else:
                print(f"[gpu_check] {stage}: {len(plan_items[stage])} settings, until +{until - t0:.0f} s",
                      flush=True)  # fmt: skip
                doc = run_stage(stage, plan_items[stage], path, until, args, args.setting_cap_s)
            if stage == "nfe" and left:  # what this run chose not to run, beside what it could not reach
                doc["left_out"] = left
                write_json(path, doc)
            results[stage] = doc
            done = sum(v == "ok" for v in doc["items"].values())
            print(f"[gpu_check] {stage}: {doc['status']} ({done} of {len(doc['items'])} settings ok) in "
                  f"{doc.get('seconds', 0):.1f} s -> {path}", flush=True)  # fmt: skip
    except Interrupted as e:
        print(f"[gpu_check] interrupted ({e}): the finished settings are in {out}", file=sys.stderr, flush=True)
    failed = sum(d.get("status") == "failed" for d in results.values())
    try:
        beside_predicted(out, args.dry_run)
    except Exception as e:  # a comparison that cannot be made must not hide the stages' results
        failed += 1
        print(f"[gpu_check] measured-beside-predicted failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"[gpu_check] done in {time.time() - t0:.0f} s of {deadline_s:.0f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
