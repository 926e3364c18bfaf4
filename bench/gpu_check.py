"""The GPU check: run once whenever a GPU is lent (``bash bench/gpu_check.sh``; stages, order and budgets here).

Commands (repository root; gpu_check.sh sets PYTHONPATH, installs the carried wheels and tees a log to $OUT)::

    bash bench/gpu_check.sh                  # one H100/H200: every stage, at most 7 minutes (420 s), JSON to $OUT
    bash bench/gpu_check.sh --quick          # the subset below, at most 4 minutes (240 s)
    bash bench/gpu_check.sh --dry-run        # any CPU: every stage at toy size (the test suite runs it)
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
nfe         the rest  the rest  :func:`nfe_settings` (reduce-overhead vs compiled-static: the default run only)
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

**CUDA graphs** (``compile="reduce-overhead"``, :func:`compile_kw`): the default run times LLaDA's batch 1 and 8,
uncached and dual, threshold and tdlm, under ``compile="reduce-overhead"`` with ``storage="static"`` (setting
``<model>/b<batch>/<cache>/reduce-overhead/4L``) beside the same settings under ``compile=True`` with
``storage="static"`` (``.../compiled-static/4L``), both at the model scope (block scope refuses CUDA graphs, and a
ratio stays within one scope) and at 4 of LLaDA's 32 layers at the true width (the depth option: a 32-layer
model-scope compile would not fit the budget, :func:`nfe_plan`), their ms/NFE extrapolated per layer to 32 and said
so in the printed row; each after an untimed decode that compiles and records its graphs. ``compile=True`` settings
on the dynamic plan (``.../compiled``) compile by block (``compile_scope="block"``, regional compilation).
bench/true_shape.py predicted them before any GPU run (``reduce_overhead`` in true_shape.json: the fused roofline,
launches about 0, against the compile=True rows' launches at 5 µs each); the comparison prints each measured
reduce-overhead ms/NFE beside its prediction, the measured reduce-overhead / compiled-static ratio (CUDA graphs
alone) beside the predicted one, and compiled-static / compiled (the static plan alone, predicted 1: modelled by
the dynamic trace) where both ran at one scope and depth.

**The planned order** (:func:`nfe_plan`, printed at the start of a run): the check's own prediction of each decode
setting's cold compile (``COMPILE_S`` per graph x ``GRAPHS`` per setting) and decode time, from the nfe stage's
start after the training stages at their caps; the settings are ordered so that the first reduce-overhead setting
and its compiled-static pair end inside the default 420 s (tests/test_gpu_check.py holds the plan to it).

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

DEADLINE_S = {"full": 420.0, "quick": 240.0, "dry": 900.0}
STAGE_CAP_S = {"full": {"train": 75.0, "deepspeed": 90.0}, "quick": {"train": 40.0, "deepspeed": 60.0}, "dry": {}}
RESERVE_S = 10.0  # kept after the last stage: reaping a killed child and predicted_vs_measured.json
MIN_STAGE_S = 5.0  # a stage with less than this left is not started (a child needs seconds to import torch)
HOOKS_ENV = "TDLM_GPU_CHECK_HOOKS"
T0_ENV = "GPU_CHECK_T0"  # gpu_check.sh's start (date +%s.%N), exported before its wheel install
CHILD = Path(__file__).resolve().with_name("gpu_check_stages.py")  # one stage in one process (its docstring)


# -- what runs, in which order ---------------------------------------------------------------------------
def _setting(model: str, batch: int, cache: str, mode: str, gen: int | None = None, diverge: bool = False,
             layers: int | None = None) -> dict:
    """One decode setting; ``gen``: the decode-memory setting of that response length; ``diverge``: the rows that
    diverge (a peaked LM-head row planted for the first request, bench/gpu_check_nfe.py's docstring); ``layers``:
    the depth option (the model's true width, this many layers; its ms/NFE extrapolated per layer to full depth).
    ``scope``: the compile scope of its mode (:func:`compile_scope`)."""
    name = (f"{model}/b{batch}/{cache}/{mode}" + (f"/gen{gen}" if gen else "") + (f"/{layers}L" if layers else "")
            + ("/diverge" if diverge else ""))  # fmt: skip
    purpose = "memory" if gen else ("diverge" if diverge else "speed")
    return {"name": name, "model": model, "batch": batch, "cache": cache, "mode": mode, "gen": gen,
            "purpose": purpose, "layers": layers, "scope": compile_scope(mode)}  # fmt: skip


# The rows that diverge: 3 requests, so the static plan decodes them in its bucket of 4 with one padding row; dual
# cache (split refresh / window groups), under CUDA graphs (where finished and padding rows ride replayed graphs).
DIVERGE = ("llada-8b", 3, "dual", "reduce-overhead")
# The depth option of the CUDA-graph pairs: reduce-overhead needs the model scope, whose cold compile grows with
# depth (a 32-layer graph would not fit the default budget, COMPILE_S): these layers at the true width.
RO_LAYERS = {"full": 4, "dry": 2}
FULL_LAYERS = {"llada-8b": 32, "dream-7b": 28}


def compile_scope(mode: str) -> str | None:
    """The compile scope of a mode: ``compiled`` (compile=True, dynamic plan) compiles by block (regional
    compilation: one graph per region, whatever the depth); ``reduce-overhead`` needs the model scope (block scope
    refuses CUDA graphs), and so does ``compiled-static``, the setting it is timed against: a ratio is taken within
    one scope only. Eager compiles nothing (None)."""
    return {"compiled": "block", "compiled-static": "model", "reduce-overhead": "model"}.get(mode)


def nfe_settings(dry_run: bool = False, quick: bool = False) -> list[dict]:
    """The decode settings, in the order :func:`nfe_plan` predicts reaches the CUDA-graph settings within the
    default budget. On the GPU: ``compile="reduce-overhead"`` (CUDA graphs, ``storage="static"``, model scope) at
    batch 1 uncached first, then ``compiled-static`` (compile=True on the same static plan and scope, the setting it
    is timed against: ``gpu_check_common.RATIOS``), both at :data:`RO_LAYERS` layers (the depth option); then
    LLaDA's compiled uncached batch 1 (block scope: TDLM's overhead, kernels per NFE, host time per launch), the
    decode memory of a left-padded batch of 8 (where the full history weighs most), batch 8 compiled, the dual cache
    compiled; then the other CUDA-graph pairs (batch 1 dual, batch 8), the rows that diverge, eager (compiled / eager
    ratios), Dream last. ``--quick``: the four compile=True / memory settings, no eager timing and no reduce-overhead.
    A dry run: one compiled setting (block scope, dynamo's eager backend), two reduce-overhead ones (on a CPU the
    static plan under dynamo's eager backend, as CUDA graphs need CUDA: uncached, held against its compiled-static
    twin, and dual, the static spatial KV cache), at the depth option, the rows that diverge, the memory setting,
    then every eager one."""
    S = _setting
    if dry_run:
        L = RO_LAYERS["dry"]
        eager = [S(m, b, c, "eager") for b in (1, 8) for m in ("llada-8b", "dream-7b") for c in ("none", "dual")]
        return [S("llada-8b", 1, "none", "reduce-overhead", layers=L), S("llada-8b", 1, "none", "compiled-static",
                layers=L), S("llada-8b", 1, "none", "compiled"), S("llada-8b", 1, "dual", "reduce-overhead", layers=L),
                S(*DIVERGE, diverge=True, layers=L), S("llada-8b", 8, "none", "eager", 32), *eager]  # fmt: skip
    first = [S("llada-8b", 1, "none", "compiled"), S("llada-8b", 8, "none", "eager", 256),
             S("llada-8b", 8, "none", "compiled"), S("llada-8b", 1, "dual", "compiled")]
    if quick:
        return first
    L = RO_LAYERS["full"]
    ro = [S("llada-8b", 1, "none", "reduce-overhead", layers=L), S("llada-8b", 1, "none", "compiled-static", layers=L)]
    graphs = [S("llada-8b", 1, "dual", "reduce-overhead", layers=L), S("llada-8b", 1, "dual", "compiled-static",
              layers=L), S("llada-8b", 8, "dual", "reduce-overhead", layers=L),
              S("llada-8b", 8, "dual", "compiled-static", layers=L), S("llada-8b", 8, "dual", "compiled"),
              S("llada-8b", 8, "none", "reduce-overhead", layers=L),
              S("llada-8b", 8, "none", "compiled-static", layers=L), S(*DIVERGE, diverge=True, layers=L)]  # fmt: skip
    return ro + first + graphs + [S("llada-8b", 1, "none", "eager", 256),
                                  S("llada-8b", 1, "none", "eager"), S("llada-8b", 1, "dual", "eager"),
                                  S("llada-8b", 8, "none", "eager"), S("llada-8b", 8, "dual", "eager"),
                                  S("dream-7b", 1, "none", "compiled"), S("dream-7b", 1, "dual", "compiled"),
                                  S("dream-7b", 1, "none", "eager"), S("dream-7b", 1, "dual", "eager"),
                                  S("dream-7b", 8, "none", "compiled"), S("dream-7b", 8, "dual", "compiled"),
                                  S("dream-7b", 8, "none", "eager"), S("dream-7b", 8, "dual", "eager")]  # fmt: skip


def compile_kw(mode: str, dry_run: bool) -> dict:
    """``tdlm.decode`` keywords of a setting's mode: ``compiled`` is ``compile=True`` with ``compile_scope="block"``
    (dynamo's eager backend in a dry run); ``compiled-static`` is ``compile=True`` with ``storage="static"`` at the
    model scope (what reduce-overhead is timed against: the same plan and scope, no CUDA graphs);
    ``reduce-overhead`` is ``compile="reduce-overhead"`` with ``storage="static"`` (CUDA graphs keep the spatial KV
    cache only at fixed addresses: DecodeConfig refuses the dynamic plan, and block scope refuses CUDA graphs), in a
    dry run the same static plan under dynamo's eager backend (CUDA graphs need CUDA); ``eager`` compiles nothing."""
    if mode == "reduce-overhead":
        return {"compile": "eager" if dry_run else "reduce-overhead", "storage": "static", "compile_scope": "model"}
    if mode == "compiled-static":
        return {"compile": "eager" if dry_run else True, "storage": "static", "compile_scope": "model"}
    if mode == "compiled":
        return {"compile": "eager" if dry_run else True, "compile_scope": "block"}
    return {"compile": False}


# -- the check's own prediction of its time: cold compiles first -----------------------------------------------
# Cold compile per graph on the GPU (a bare machine: every cache cold), from bench/results/compile_scope.json (this
# CPU, inductor, fresh caches): the model scope took 55.3 s at 4 layers and 120.3 s at 32, i.e. 46 s for the step's
# own work plus 2.3 s per layer; the block scope 17.0 s and 21.1 s for 2 region graphs, about 10.5 s a graph
# whatever the depth. The GPU is taken to compile at the same pace: issue 49's estimate of 1-3 min per 32-layer 8B
# graph brackets the model scope's 120 s. Each setting's row records its warm-up seconds (compile included): the
# first GPU run's numbers replace these.
COMPILE_S = {"model_step": 46.0, "model_layer": 2.3, "block_graph": 10.5}
# Graphs one decode compiles per policy (threshold, tdlm), counted with dynamo's unique_graphs on the toy models at
# batch 1 (dual: 3 under the dynamic plan, 2 under the static one; taken as 3); the block scope's graphs are regions
# x step kinds: attention and feed-forward, plus the temporal step for tdlm. A batch of 8 is given one more graph per
# policy (rows leaving the batch make its size dynamic; the toy's uncached batch 8 compiled the same count as b1).
GRAPHS = {("model", "none"): (1, 1), ("model", "dual"): (3, 3), ("block", "none"): (2, 4), ("block", "dual"): (4, 8)}
DECODE_MS = {"eager": 40.0, "compiled": 15.0, "compiled-static": 15.0, "reduce-overhead": 10.0}  # per NFE, upper
STARTUP_S = 20.0  # gpu_check.sh's start, the wheel install and the parent's start before the first stage


def predicted_seconds(setting: dict, gen_length: int = 64) -> dict:
    """The check's own prediction of one setting on the GPU: ``compile`` (cold graphs, both policies), ``decode``
    (the untimed, timed and profiled decodes of both policies, one token per evaluation) and their sum."""
    scope, layers = setting["scope"], setting.get("layers") or FULL_LAYERS[setting["model"]]
    compile_s = 0.0
    if scope:
        per = (COMPILE_S["model_step"] + COMPILE_S["model_layer"] * layers) if scope == "model" else \
            COMPILE_S["block_graph"]  # fmt: skip
        n = sum(GRAPHS[(scope, "none" if setting["cache"] == "none" else "dual")]) + 2 * (setting["batch"] > 1)
        compile_s = n * per
    evals = setting.get("gen") or gen_length
    depth = layers / FULL_LAYERS[setting["model"]]
    decode_s = 2 * 3 * evals * DECODE_MS[setting["mode"]] * max(depth, 0.1) / 1000
    return {"compile": compile_s, "decode": decode_s, "total": compile_s + decode_s}


def nfe_plan(mode: str = "full") -> list[dict]:
    """The default run's decode settings in order, each with its predicted seconds and the predicted time (from the
    run's start) at which it ends: the nfe stage starts after the start-up and the train and deepspeed stages at
    their caps (the prediction's upper bound), and is stopped at the deadline less the reserve."""
    t = STARTUP_S + sum(STAGE_CAP_S[mode].values())
    plan = []
    for s in nfe_settings(quick=mode == "quick"):
        p = predicted_seconds(s)
        t += p["total"]
        plan.append({"name": s["name"], **{f"predicted_{k}_s": v for k, v in p.items()}, "predicted_end_s": t,
                     "within_budget": t <= DEADLINE_S[mode] - RESERVE_S})  # fmt: skip
    return plan


def stage_items(stage: str, dry_run: bool, quick: bool) -> list[str]:
    if stage == "train":
        return ["all", "dispersed:4"] if dry_run else (["all"] if quick else ["all", "dispersed:16"])
    if stage == "deepspeed":
        return ["zero3"]
    return [s["name"] for s in nfe_settings(dry_run, quick)]


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
    ap.add_argument("--nfe-settings", default="", help="comma list of nfe setting names to run (default: all)")
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
    plan_items = {s: stage_items(s, args.dry_run, args.quick) for s in stages}
    if args.nfe_settings and "nfe" in plan_items:
        wanted = args.nfe_settings.split(",")
        known = [s["name"] for s in nfe_settings(args.dry_run, False)]
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
    if mode != "dry" and "nfe" in stages:  # the check's own prediction: which decode settings the budget reaches
        plan = nfe_plan(mode)
        reached = [p for p in plan if p["within_budget"]]
        names = ", ".join(f"{p['name']} by {p['predicted_end_s']:.0f} s" for p in reached)
        print(f"[gpu_check] predicted (cold compiles, COMPILE_S): {len(reached)} of {len(plan)} decode settings "
              f"within {DEADLINE_S[mode]:.0f} s: {names}", flush=True)  # fmt: skip
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
