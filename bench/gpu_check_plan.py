"""What the GPU check runs and how long its own prediction says it takes (bench/gpu_check.py is the parent that
runs it): the budgets, the decode settings (the default set and the opt-in rest, :func:`nfe_settings`), the
``tdlm.decode`` keywords of each mode (:func:`compile_kw`) and the cold-compile timeline (:func:`nfe_plan`).

Standard library only, and it imports nothing of ``bench/`` but the leaf ``gpu_check_common``: the parent, the stage
child (``gpu_check_stages.py``) and the decode stage (``gpu_check_nfe.py``) all read the settings from here.

**The default set and the planned order** (printed at the start of a run): the check's own prediction of each decode
setting's cold compile (``COMPILE_S`` per graph x ``GRAPHS`` per setting and policy) and decode time, from the nfe
stage's start after the training stages at their caps. The default set is what that prediction fits inside the
default 420 s (tests/test_gpu_check_plan.py holds every one of them to it); the run prints the settings it leaves out
(:func:`left_out`), which ``--all-settings`` runs after it and ``--nfe-settings`` names one by one. The rows that
diverge are the first of them: their 4 model-scope graphs (221 s) do not fit beside the reduce-overhead /
compiled-static pair, so they take a run of their own (``--stages nfe``, predicted 241 s).
"""

from __future__ import annotations

from gpu_check_common import STAGE_ORDER

DEADLINE_S = {"full": 420.0, "quick": 240.0, "dry": 900.0}
STAGE_CAP_S = {"full": {"train": 75.0, "deepspeed": 90.0}, "quick": {"train": 40.0, "deepspeed": 60.0}, "dry": {}}
RESERVE_S = 10.0  # kept after the last stage: reaping a killed child and predicted_vs_measured.json


# -- what runs, in which order ---------------------------------------------------------------------------
POLICIES = ("threshold", "tdlm")


def _setting(model: str, batch: int, cache: str, mode: str, gen: int | None = None, diverge: bool = False,
             layers: int | None = None, policies: tuple[str, ...] = POLICIES) -> dict:
    """One decode setting; ``gen``: the decode-memory setting of that response length; ``diverge``: the rows that
    diverge (a peaked LM-head row planted for the first request, bench/gpu_check_nfe.py's docstring); ``layers``:
    the depth option (the model's true width, this many layers; its ms/NFE extrapolated per layer to full depth);
    ``policies``: the decode policies it runs (one of them: its name ends in it, so a name says what it ran).
    ``scope``: the compile scope of its mode (:func:`compile_scope`)."""
    name = (f"{model}/b{batch}/{cache}/{mode}" + (f"/gen{gen}" if gen else "") + (f"/{layers}L" if layers else "")
            + ("/diverge" if diverge else "") + ("" if tuple(policies) == POLICIES else f"/{'+'.join(policies)}"))
    purpose = "memory" if gen else ("diverge" if diverge else "speed")
    return {"name": name, "model": model, "batch": batch, "cache": cache, "mode": mode, "gen": gen,
            "purpose": purpose, "layers": layers, "scope": compile_scope(mode), "policies": tuple(policies)}


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


def nfe_settings(dry_run: bool = False, quick: bool = False, every: bool = False) -> list[dict]:
    """The decode settings in the order they run: the default set, which :func:`nfe_plan` predicts all end within
    the default budget, then with ``every`` (``--all-settings``) the opt-in rest.

    On the GPU the default set answers issue 49's questions in 420 s: ``compile="reduce-overhead"`` (CUDA graphs,
    ``storage="static"``, model scope) at batch 1 uncached, then ``compiled-static`` (compile=True on the same static
    plan and scope, the setting it is timed against: ``gpu_check_common.RATIOS``), both at :data:`RO_LAYERS`
    layers (the depth option) and for the tdlm policy only (its graphs carry the temporal step; each policy is a
    cold model-scope compile, 55 s by ``COMPILE_S``); LLaDA's compiled uncached batch 1 (block scope, both
    policies: TDLM's overhead, kernels per NFE, host time per launch against the H100 / H200 rows), eager batch 1
    uncached (the eager time rows, no compile), and the decode memory of a left-padded batch of 8 (where the full
    history weighs most). The opt-in rest (:func:`left_out`): the rows that diverge first (tdlm only: 4 model-scope
    graphs, 221 s by the prediction, more than what the default set leaves), the pair's threshold policy, batch 8
    and the dual cache compiled, the other CUDA-graph pairs, the other eager settings, Dream last. ``--quick``: the
    default set's compile=True and memory settings, no eager timing and no CUDA graphs. A dry run (toy size, both
    policies everywhere, ``every`` ignored): one compiled setting (block scope, dynamo's eager backend), two
    reduce-overhead ones (on a CPU the static plan under dynamo's eager backend, as CUDA graphs need CUDA:
    uncached, held against its compiled-static twin, and dual, the static spatial KV cache), at the depth option,
    the rows that diverge, the memory setting, then every eager one."""
    S = _setting
    if dry_run:
        L = RO_LAYERS["dry"]
        eager = [S(m, b, c, "eager") for b in (1, 8) for m in ("llada-8b", "dream-7b") for c in ("none", "dual")]
        return [S("llada-8b", 1, "none", "reduce-overhead", layers=L), S("llada-8b", 1, "none", "compiled-static",
                layers=L), S("llada-8b", 1, "none", "compiled"), S("llada-8b", 1, "dual", "reduce-overhead", layers=L),
                S(*DIVERGE, diverge=True, layers=L), S("llada-8b", 8, "none", "eager", 32), *eager]  # fmt: skip
    L, tdlm = RO_LAYERS["full"], ("tdlm",)
    compiled, memory = S("llada-8b", 1, "none", "compiled"), S("llada-8b", 8, "none", "eager", 256)
    if quick:
        return [compiled, memory]
    default = [S("llada-8b", 1, "none", "reduce-overhead", layers=L, policies=tdlm),
               S("llada-8b", 1, "none", "compiled-static", layers=L, policies=tdlm), compiled,
               S("llada-8b", 1, "none", "eager"), memory]  # fmt: skip
    if not every:
        return default
    pairs = [S("llada-8b", b, c, m, layers=L) for b, c in ((1, "dual"), (8, "dual"), (8, "none"))
             for m in ("reduce-overhead", "compiled-static")]  # fmt: skip
    rest = [S(*DIVERGE, diverge=True, layers=L, policies=tdlm),
            S("llada-8b", 1, "none", "reduce-overhead", layers=L, policies=("threshold",)),
            S("llada-8b", 1, "none", "compiled-static", layers=L, policies=("threshold",)),
            S("llada-8b", 8, "none", "compiled"), S("llada-8b", 1, "dual", "compiled"), *pairs[:4],
            S("llada-8b", 8, "dual", "compiled"), *pairs[4:],
            S(*DIVERGE, diverge=True, layers=L, policies=("threshold",)), S("llada-8b", 1, "none", "eager", 256),
            S("llada-8b", 1, "dual", "eager"), S("llada-8b", 8, "none", "eager"), S("llada-8b", 8, "dual", "eager"),
            *(S("dream-7b", b, c, m) for b in (1, 8) for m in ("compiled", "eager") for c in ("none", "dual"))]
    return default + rest


def left_out(mode: str = "full") -> list[str]:
    """The settings the default (or ``--quick``) run leaves out: ``--all-settings`` runs them after it, and
    ``--nfe-settings`` names any of them."""
    chosen = {s["name"] for s in nfe_settings(quick=mode == "quick")}
    return [s["name"] for s in nfe_settings(every=True) if s["name"] not in chosen]


def find_setting(name: str, dry_run: bool) -> dict:
    """A setting by its name, among every setting of the run's size (the stage child looks its items up here)."""
    found = next((s for s in nfe_settings(dry_run, every=True) if s["name"] == name), None)
    if found is None:
        raise KeyError(f"no decode setting named {name!r}")
    return found


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
# The rows that diverge (3 requests in bucket 4, dual, static plan) compile more: the split refresh / window groups
# are new shapes. Counted the same way on the toy (dynamo's unique_graphs, two decodes per policy): threshold 6,
# tdlm 4.
DIVERGE_GRAPHS = (6, 4)
DECODE_MS = {"eager": 40.0, "compiled": 15.0, "compiled-static": 15.0, "reduce-overhead": 10.0}  # per NFE, upper
STARTUP_S = 20.0  # gpu_check.sh's start, the wheel install and the parent's start before the first stage


def predicted_seconds(setting: dict, gen_length: int = 64) -> dict:
    """The check's own prediction of one setting on the GPU: ``compile`` (cold graphs of the policies it runs),
    ``decode`` (per policy: the untimed, timed and, where profiled, profiled decodes; one decode for a memory
    setting; one token per evaluation) and their sum."""
    scope, layers = setting["scope"], setting.get("layers") or FULL_LAYERS[setting["model"]]
    picked = [i for i, p in enumerate(POLICIES) if p in setting.get("policies", POLICIES)]
    compile_s = 0.0
    if scope:
        per = (COMPILE_S["model_step"] + COMPILE_S["model_layer"] * layers) if scope == "model" else \
            COMPILE_S["block_graph"]  # fmt: skip
        if setting["purpose"] == "diverge":
            n = sum(DIVERGE_GRAPHS[i] for i in picked)
        else:
            graphs = GRAPHS[(scope, "none" if setting["cache"] == "none" else "dual")]
            n = sum(graphs[i] for i in picked) + len(picked) * (setting["batch"] > 1)
        compile_s = n * per
    evals = setting.get("gen") or gen_length
    depth = layers / FULL_LAYERS[setting["model"]]
    profiled = setting["mode"] == "reduce-overhead" or (setting["mode"] == "compiled" and setting["batch"] == 1)
    decodes = 1 if setting["purpose"] == "memory" else (3 if profiled else 2)  # as gpu_check_nfe.nfe_item runs
    decode_s = len(picked) * decodes * evals * DECODE_MS[setting["mode"]] * max(depth, 0.1) / 1000
    return {"compile": compile_s, "decode": decode_s, "total": compile_s + decode_s}


def nfe_plan(mode: str = "full", settings: list[dict] | None = None, stages: tuple[str, ...] = STAGE_ORDER
             ) -> list[dict]:
    """The decode settings in order (the run's default set unless given), each with its predicted seconds and the
    predicted time (from the run's start) at which it ends: the nfe stage starts after the start-up and the stages
    before it that run (``stages``) at their caps (the prediction's upper bound), and is stopped at the deadline
    less the reserve."""
    before = STAGE_ORDER[: STAGE_ORDER.index("nfe")]
    t = STARTUP_S + sum(STAGE_CAP_S[mode].get(s, 0.0) for s in before if s in stages)
    plan = []
    for s in nfe_settings(quick=mode == "quick") if settings is None else settings:
        p = predicted_seconds(s)
        t += p["total"]
        plan.append({"name": s["name"], **{f"predicted_{k}_s": v for k, v in p.items()}, "predicted_end_s": t,
                     "within_budget": t <= DEADLINE_S[mode] - RESERVE_S})  # fmt: skip
    return plan


def stage_items(stage: str, dry_run: bool, quick: bool, every: bool = False) -> list[str]:
    if stage == "train":
        return ["all", "dispersed:4"] if dry_run else (["all"] if quick else ["all", "dispersed:16"])
    if stage == "deepspeed":
        return ["zero3"]
    return [s["name"] for s in nfe_settings(dry_run, quick, every)]
