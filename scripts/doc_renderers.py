"""How the pages write the numbers of bench/results/*.json: one renderer per generated table (JSON -> the region's
lines) and one value function per fact in prose (JSON -> each number's text). scripts/doc_tables.py registers them
(``TABLES``, ``FACTS``) and keeps the pages in step; a renderer changes how a page writes a number, never the number.
"""

from __future__ import annotations


# -- formatting, as the pages write numbers ------------------------------------------------------------
def row(*cells: object) -> str:
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"  # an empty cell is "| |"


def header(*cells: str, align: str = "---") -> list[str]:
    return [row(*cells), "|" + "|".join(align for _ in cells) + "|"]


def pair(a: float, b: float) -> str:
    """Backbone / TDLM ms per NFE."""
    return f"{a:.2f} / {b:.2f}"


def pct(x: float, digits: int = 1) -> str:
    """A relative overhead as a signed percentage: 0.0095 -> +0.95% (digits=2)."""
    return f"{100 * x:+.{digits}f}%"


def met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def upto(us: float | None) -> str:
    # bench/true_shape.py stores None when a target holds beyond 100 µs per launch
    return "beyond 100 µs" if us is None else f"up to {us:.1f} µs"


# -- bench/results/true_shape.json -------------------------------------------------------------------------
GPU_NAMES = {"h200": "H200", "gh200": "GH200", "h100": "H100"}
MIB = 2**20


def llada_rows(d: dict, gpus: tuple[str, ...]) -> list[dict]:
    """LLaDA-8B rows of the prediction table on these GPUs, in the JSON's order (cache, history, GPU)."""
    return [r for r in d["table"] if r["model"] == "llada-8b" and r["gpu"] in gpus]


def the_row(d: dict, cache: str, history: str = "full", gpu: str = "h200") -> dict:
    (r,) = [r for r in llada_rows(d, (gpu,)) if (r["cache"], r["history"]) == (cache, history)]
    return r


def true_shape_batch1(d: dict) -> list[str]:
    """docs/training.md: LLaDA-8B batch 1 per NFE on H200 and GH200, three launch models, and the paper's run."""
    nfe = d["paper"]["nfe"]
    out = header("LLaDA-8B, batch 1", "GPU", "launches added: backbone / TDLM ms (overhead)", "launches overlapped",
                 "CUDA graphs", "history read per NFE / its size", f"GSM8K s at {nfe:g} NFE: added / overlapped")
    for r in llada_rows(d, ("h200", "gh200")):
        overlapped_s = nfe * r["tdlm_ms_overlapped"] * 1e-3  # gsm8k_s in the JSON is the launches-added one
        out.append(row(
            f"cache {r['cache']}, history `{r['history']}`", GPU_NAMES[r["gpu"]],
            f"{pair(r['backbone_ms'], r['tdlm_ms'])} ({pct(r['overhead'])})",
            f"{pair(r['backbone_ms_overlapped'], r['tdlm_ms_overlapped'])} ({pct(r['overhead_overlapped'])})",
            f"{pair(r['backbone_ms_cuda_graphs'], r['tdlm_ms_cuda_graphs'])} ({pct(r['overhead_cuda_graphs'])})",
            f"{r['history_read_max'] / MIB:.0f} / {r['history_bytes'] / MIB:.0f} MiB",
            f"{r['gsm8k_s']:.3f} / {overlapped_s:.3f}"))
    paper = d["paper"]
    gpu = paper["device"].split(",")[0]
    out.append(row(f"paper ({paper['device']}; TDLM 16 dispersed)", gpu, f"{paper['ms_per_nfe']:.1f} (TDLM)",
                   "", "", "", f"{paper['gsm8k_s']:.3f}"))
    return out


def true_shape_targets(d: dict) -> list[str]:
    """docs/training.md: the issue's targets (history `full`, H200) under each launch model."""
    out = header("cache", "launches added", "launches overlapped", "CUDA graphs")
    judged = [(k.split("|")[0], t) for k, t in d["targets"].items() if t["limit"] is not None and k.endswith("|full")]
    for i, (cache, t) in enumerate(judged):
        per_launch = " per launch" if i == 0 else ""  # said once, in the first row
        out.append(row(
            f"{cache} (≤ {100 * t['limit']:.0f}%)",
            f"{pct(t['overhead_launches'], 2)}, {met(t['met_launches'])} "
            f"(holds {upto(t.get('launch_us_at_limit_added'))}{per_launch})",
            f"{pct(t['overhead_overlapped'], 2)}, {met(t['met_overlapped'])} "
            f"(holds {upto(t.get('launch_us_at_limit_overlapped'))})",
            f"{pct(t['overhead_cuda_graphs'], 2)}, {met(t['met_cuda_graphs'])}"))
    return out


def true_shape_overhead(d: dict) -> list[str]:
    """docs/decoding.md: the current 8B overhead reference, LLaDA-8B on H200, history `full`, cache none / dual."""
    out = header("LLaDA-8B, H200, history `full`", "launches added", "launches overlapped", "CUDA graphs")
    for i, cache in enumerate(c for c in ("none", "dual") if f"{c}|full" in d["targets"]):
        r, t = the_row(d, cache), d["targets"][f"{cache}|full"]
        label = f"cache {cache}: backbone / TDLM ms, overhead" if i == 0 else f"cache {cache}"
        holds, per_launch = ("holds ", " per launch") if i == 0 else ("", "")  # said once, in the first row
        out.append(row(
            label,
            f"{pair(r['backbone_ms'], r['tdlm_ms'])}, {pct(r['overhead'], 2)} (≤ {100 * t['limit']:.0f}%: "
            f"{met(t['met_launches'])}; {holds}{upto(t.get('launch_us_at_limit_added'))}{per_launch})",
            f"{pair(r['backbone_ms_overlapped'], r['tdlm_ms_overlapped'])}, {pct(r['overhead_overlapped'], 2)} "
            f"({met(t['met_overlapped'])}; {upto(t.get('launch_us_at_limit_overlapped'))})",
            f"{pair(r['backbone_ms_cuda_graphs'], r['tdlm_ms_cuda_graphs'])}, {pct(r['overhead_cuda_graphs'], 2)}"))
    return out


# -- bench/results/engine.json ----------------------------------------------------------------------------
NOISE = 0.10  # docs/decoding.md: one round of process CPU seconds, so ratios within about 10% are noise


def engine_speed(d: dict) -> list[str]:
    """docs/decoding.md: requests/s chunked vs refill under each storage plan, and occupancy."""
    out = header("policy", "chunked dynamic", "refill dynamic", "chunked static", "refill static",
                 "occupancy chunked / refill (dynamic)")
    for policy, p in d["speed"]["policies"].items():
        c, ratio = p["candidates"], p["refill_over_chunked"]
        out.append(row(
            f"{policy}, tau {p['tau']:g}", rate(c["chunked@dynamic"]), rate(c["refill@dynamic"], ratio["dynamic"]),
            rate(c["chunked@static"]), rate(c["refill@static"], ratio["static"]),
            f"{c['chunked@dynamic']['occupancy']:.3f} / {c['refill@dynamic']['occupancy']:.3f}"))
    return out


def rate(candidate: dict, over_chunked: float | None = None) -> str:
    text = f"{candidate['requests_per_s']:.1f} req/s"
    # a refill/chunked ratio is shown only where it is beyond the noise
    return text if over_chunked is None or abs(over_chunked - 1) < NOISE else f"{text} ({over_chunked:.2f}x)"


# -- bench/results/onpolicy.json ---------------------------------------------------------------------------
def points(x: float) -> str:
    """An accuracy difference in points, signed: -0.068 -> -6.8."""
    return f"{100 * x:+.1f}"


def interval(iv: list[float]) -> str:
    return f"[{points(iv[0])}, {points(iv[1])}]"


def onpolicy_cost(d: dict) -> list[str]:
    """docs/training.md: one LLaDA-8B on-policy round on 8 GPUs, predicted per phase, and its assumptions."""
    c = d["cost_llada_8b"]
    a = c["assumptions"]
    out = header("phase", "predicted seconds", "share")
    for phase, s in c["seconds"].items():
        out.append(row(phase, f"{s:.0f}", f"{100 * c['share'][phase]:.0f}%"))
    out.append(row("one round (without model loading)", f"{c['total_s']:.0f}", "100%"))
    # the student decodes with TDLM, the teacher is the backbone
    out += ["", f"{a['prompts']:,} prompts on {a['gpus']} GPUs, {a['updates']} updates; "
                f"{a['ms_per_nfe_tdlm']:.2f} ms per student evaluation and {a['ms_per_nfe_backbone']:.2f} ms per "
                f"teacher evaluation ({GPU_NAMES[a['gpu']]} roofline); {a['update_tflop_per_gpu']:.0f} TFLOP per GPU "
                f"per update at an assumed {100 * a['mfu']:.0f}% MFU = {a['update_s']:.2f} s per update."]
    return out


def onpolicy_search(d: dict) -> list[str]:
    """docs/training.md: the recipe search on the validation split."""
    s = d["search"]
    out = header(f"candidate (validation, seed {s['seed']}, tdlm tau {s['tau']:g})", "accuracy", "NFE")
    out += [row(name, f"{100 * r['accuracy']:.1f}%", f"{r['nfe_mean']:.2f}") for name, r in s["rows"].items()]
    return out


def onpolicy_final(d: dict) -> list[str]:
    """docs/training.md: the 3-seed experiment's arms, their differences and the targets."""
    f = d["final"]
    out = header(f"arm (tdlm tau {f['tau']:g})", "accuracy, mean ± sd over seeds", "per seed", "NFE")
    for arm, a in f["arms"].items():
        out.append(row(arm, f"{100 * a['accuracy_mean']:.1f}% ± {100 * a['accuracy_sd_over_seeds']:.1f}",
                       " / ".join(f"{100 * x:.1f}" for x in a["accuracy_per_seed"]), f"{a['nfe_mean']:.2f}"))
    out += ["", *header("difference (points)", "point", "95% two-level interval")]
    out += [row(name, points(x["accuracy_diff"]), interval(x["interval"])) for name, x in f["differences"].items()]
    out += ["", *header("target", "interval / value", "met")]
    for name, t in d["targets"].items():
        value = f"{interval(t['interval'])} points" if "interval" in t else f"sd {100 * t['sd']:.1f} points"
        if "nfe_ratio" in t:
            value += f", NFE ratio {t['nfe_ratio']:.2f}"
        out.append(row(name, value, "yes" if t["met"] else "no"))
    return out


# -- bench/results/decode_speed*.json: the bench's own table, as the run printed it -----------------------------
def printed_table(d: dict) -> list[str]:
    """The table bench/decode_speed.py printed and stored (``table`` in its JSON), verbatim."""
    return list(d["table"])


# -- bench/results/dispatch_count.json ---------------------------------------------------------------------
DISPATCH_MODELS = (("llada-8b", "LLaDA"), ("dream-7b", "Dream"))


def judged(x: float, limit: float, digits: int) -> str:
    """A count against its target (at most ``limit``): 0.425 -> "0.425, met"."""
    return f"{x:.{digits}f}, {met(x <= limit)}"


def dispatch_counts(d: dict) -> list[str]:
    """docs/decoding.md: aten ops and compiled kernels per NFE, the JSON's ``before`` section beside its counts."""
    runs = (("before", d.get("before") or {}), ("now", d))

    def cells(fn) -> list[str]:
        out = []
        for m, _ in DISPATCH_MODELS:
            for _, r in runs:
                try:
                    out.append(fn(r["eager"][m], r["compiled"][m]))
                except KeyError:  # a section without that count
                    out.append("–")
        return out

    out = header("", *(f"{label} {when}" for _, label in DISPATCH_MODELS for when, _ in runs))
    out[1] = "|---|" + "|".join("---:" for _ in range(2 * len(DISPATCH_MODELS))) + "|"
    out += [row("backbone block, aten ops", *cells(lambda e, c: e["block_ops"])),
            row("one temporal layer, aten ops", *cells(lambda e, c: e["temporal_layer_ops"])),
            row("temporal layer ÷ block (target ≤ 0.5)",
                *cells(lambda e, c: judged(e["temporal_layer_over_block"], 0.5, 3))),
            row("TDLM ops per NFE ÷ backbone", *cells(lambda e, c: f"{e['tdlm_over_backbone']:.3f}")),
            row("compiled kernels per NFE, backbone / TDLM",
                *cells(lambda e, c: f"{c['backbone_kernels_per_nfe']} / {c['tdlm_kernels_per_nfe']}")),
            row("compiled kernels per temporal layer (target ≤ 3)",
                *cells(lambda e, c: judged(c["kernels_per_temporal_layer"], 3, 2))),
            row("compiled TDLM ÷ backbone (target ≤ 1.10)",
                *cells(lambda e, c: judged(c["tdlm_over_backbone"], 1.10, 3)))]  # fmt: skip
    said = []
    for when, r in runs:
        label, date = r.get("label") or "unlabelled", r["machine"]["date"][:10] if r else ""
        if r:
            said.append(f"{when}: {label}" + ("" if date in label else f" ({date})"))
    out += ["", "; ".join(said) + "."]
    return out


# -- bench/results/cache_speed.json ------------------------------------------------------------------------
def cache_speed(d: dict) -> list[str]:
    """docs/decoding.md: ms per NFE and tokens/s per cache mode, medium LLaDA, batch 1 and 8."""
    out = header("policy", "batch", "cache", "NFE / request", "ms / NFE", "tokens/s", "× none per NFE",
                 "× none tokens/s")  # fmt: skip
    out[1] = "|---|---:|---|---:|---:|---:|---:|---:|"
    out += [row(r["policy"], r["batch"], r["cache"], f"{r['nfe_mean']:.1f}", f"{r['ms_per_nfe']:.0f}",
                f"{r['tokens_per_s']:.1f}", f"{r['per_nfe_x_none']:.2f}×", f"{r['tokens_per_s_x_none']:.2f}×")
            for r in d["speed"]]  # fmt: skip
    return out


def cache_quality(d: dict) -> list[str]:
    """docs/decoding.md: tiny-arith accuracy per cache mode (points against the uncached run) and NFE."""
    out = header("block", "problems", "policy", "none", "prefix", "dual", "NFE none / prefix / dual")
    out[1] = "|---:|---:|---|---:|---:|---:|---|"
    groups: dict[tuple, dict[str, dict]] = {}
    for q in d["quality"]:
        groups.setdefault((q["block_size"], q["n"], q["policy"]), {})[q["cache"]] = q

    def acc(q: dict) -> str:
        if q["cache"] == "none":
            return f"{q['accuracy']:.1f}%"
        return f"{q['accuracy']:.1f}% ({q['accuracy_vs_none_points']:+.1f})".replace("(-", "(−")

    for (block, n, policy), by in groups.items():
        modes = [by[c] for c in ("none", "prefix", "dual")]
        out.append(row(block, n, policy, *(acc(q) for q in modes), " / ".join(f"{q['nfe']:.2f}" for q in modes)))
    return out



# -- the numbers of prose facts (doc_tables.FACTS) ----------------------------------------------------
def span(lo: float, hi: float, digits: int = 2) -> dict[str, str]:
    return {"lo": f"{lo:.{digits}f}", "hi": f"{hi:.{digits}f}"}


def ratios(d: dict, setting: str, *, mode: str | None = None, method: str | None = None,
           column: int = 6, both: bool = False) -> list[float]:  # fmt: skip
    """The "a / b" ratio column of a decode_speed side-by-side table (``table`` in its JSON), rows whose setting
    starts with ``setting`` (and of ``mode`` / ``method``); ``both``: min and median, else the min."""
    out = []
    for line in d["table"][2:]:
        c = [x.strip() for x in line.strip("|").split("|")]
        if c[0].startswith(setting) and mode in (None, c[1]) and method in (None, c[2]):
            vals = [float(v) for v in c[column - 1].split(" / ")]
            out += vals if both else vals[:1]
    return out


def readiness(d: dict) -> dict[str, str]:
    return {"captured": str(d["static_captured"]["captured"]), "graphs": str(d["static_captured"]["graphs"]),
            "dyn_captured": str(d["dynamic_captured"]["captured"]),
            "dyn_graphs": str(d["dynamic_captured"]["graphs"])}  # fmt: skip


def readme_overhead(d: dict) -> dict[str, str]:
    t = d["targets"]
    return {f"{c}_{k}": f"{100 * t[f'{c}|full'][key]:+.1f}" for c in ("none", "dual")
            for k, key in (("ovl", "overhead_overlapped"), ("add", "overhead_launches"),
                           ("cg", "overhead_cuda_graphs"))}  # fmt: skip


def readme_decode_speed(d: dict) -> dict[str, str]:
    r = next(r for r in d["results"] if r["setting"] == "tiny")["tdlm_over_backbone"]
    return {"eager": f"{r['eager']['of_min']:.2f}", "compiled": f"{r['compiled']['of_min']:.2f}"}


def storage_spans(d: dict) -> dict[str, str]:
    """decode_speed_storage.json: static / dynamic per NFE (min), the demo's batch and batch 1 per cache."""
    tiny, medium = ratios(d, "tiny"), "medium LLaDA d512x8, 256+256, cache"
    none, dual = ratios(d, f"{medium} none"), ratios(d, f"{medium} dual")
    tdlm = ratios(d, f"{medium} dual", mode="eager", method="tdlm")[0]
    return {"tiny_lo": f"{min(tiny):.2f}", "tiny_hi": f"{max(tiny):.2f}", "none_lo": f"{min(none):.2f}",
            "none_hi": f"{max(none):.2f}", "dual_lo": f"{min(dual):.2f}", "dual_hi": f"{max(dual):.2f}",
            "tdlm": f"{tdlm:.2f}"}  # fmt: skip


def against_spans(against: dict, quiet: dict, itself: dict) -> dict[str, str]:
    """decode_speed_against*.json: today / the loop before the static plan per NFE (min); the quiet medium run's
    TDLM uncached rows; the run against today's loop itself (min and median)."""
    tiny, batch1, same = ratios(against, "tiny"), ratios(quiet, "medium"), ratios(itself, "medium", both=True)
    none = "medium LLaDA d512x8, 256+256, cache none"
    return {"tiny_lo": f"{min(tiny):.2f}", "tiny_hi": f"{max(tiny):.2f}", "b1_lo": f"{min(batch1):.2f}",
            "b1_hi": f"{max(batch1):.2f}", "self_lo": f"{min(same):.2f}", "self_hi": f"{max(same):.2f}",
            "q_eager": f"{ratios(quiet, none, mode='eager', method='tdlm')[0]:.3f}",
            "q_compiled": f"{ratios(quiet, none, mode='compiled', method='tdlm')[0]:.3f}"}  # fmt: skip


def minus(text: str) -> str:
    """Prose writes a negative number with the minus sign (U+2212), as README's intervals do."""
    return text.replace("-", "\u2212")


ARMS = (("off", "off-policy"), ("on", "on-policy"), ("more", "more-data"), ("cur", "current-only"))
BASELINES = (("th", "threshold tau 0.9"), ("cr", "credit tau 0.9"))


def readme_onpolicy_arms(d: dict) -> dict[str, str]:
    """onpolicy.json's 3-seed experiment: each arm's accuracy (mean ± sd over seeds, %) and NFE at its τ, and the
    training-free baselines at theirs (README's "Do trained adapters earn their place?")."""
    f = d["final"]
    arms = f["arms"]
    out = {"tau": f"{f['tau']:g}", "ref_tau": f"{f['reference_tau']:g}", "ref_tau2": f"{f['reference_tau']:g}"}
    for key, arm in ARMS:
        a = arms[arm]
        out |= {f"{key}_acc": f"{100 * a['accuracy_mean']:.1f}", f"{key}_nfe": f"{a['nfe_mean']:.1f}",
                f"{key}_sd": f"{100 * a['accuracy_sd_over_seeds']:.1f}"}  # fmt: skip
    for key, arm in BASELINES:
        out |= {f"{key}_acc": f"{100 * arms[arm]['accuracy_mean']:.1f}", f"{key}_nfe": f"{arms[arm]['nfe_mean']:.1f}"}
    return out


def readme_onpolicy_targets(d: dict) -> dict[str, str]:
    """onpolicy.json's differences in points with their two-level 95% intervals, the NFE ratio against threshold
    and the training-seed sd (README's list of unmet targets)."""
    diff = d["final"]["differences"]
    out = {}
    for key, name in (("credit", "on-policy - credit"), ("more", "on-policy - more-data"),
                      ("cur", "on-policy - current-only"), ("th", "on-policy - threshold")):  # fmt: skip
        x = diff[name]
        out |= {f"d_{key}": minus(f"{100 * x['accuracy_diff']:.1f}"), f"{key}_lo": minus(points(x["interval"][0])),
                f"{key}_hi": minus(points(x["interval"][1]))}  # fmt: skip
    # the targets by what they hold: the one against threshold is the one with its interval and an NFE ratio
    th = next(t for t in d["targets"].values() if t.get("interval") == diff["on-policy - threshold"]["interval"])
    sd = next(t for t in d["targets"].values() if "sd" in t)
    return out | {"th_ratio": f"{th['nfe_ratio']:.2f}", "seed_sd": f"{100 * sd['sd']:.1f}"}


def readme_seed_variance(d: dict) -> dict[str, str]:
    """seed_variance.json: accuracy sd over seeds per τ (points), the widest range, the evaluation's SE and the
    largest NFE sd."""
    spread = d["spread"]
    out = {f"sd_{tau.replace('.', '')}": f"{100 * v['accuracy_sd_over_seeds']:.1f}" for tau, v in spread.items()}
    return out | {
        "range": f"{100 * max(v['accuracy_range'][1] - v['accuracy_range'][0] for v in spread.values()):.0f}",
        "se": f"{100 * max(v['eval_standard_error'] for v in spread.values()):.1f}", "n": str(d["limit"]),
        "nfe_sd": f"{max(v['nfe_sd_over_seeds'] for v in spread.values()):.2f}"}  # fmt: skip


def gpu_compile_scope(d: dict) -> dict[str, str]:
    """compile_scope.json: the cold compile of the 32-layer toy LLaDA at block and at model scope (docs/gpu.md)."""
    r = next(r for r in d["rows"] if r["layers"] == 32)
    return {"block_s": f"{r['block']['compile_s']:.0f}", "model_s": f"{r['model']['compile_s']:.0f}"}


# -- bench/results/multi_recipe_search.json (docs/demo.md) ---------------------------------------------------
# the candidates' descriptions are words (the JSON's "change" is terser); every number comes from the JSON
DEMO_RECIPES = {
    "A": "the shipped `configs/tiny.yaml` recipe (3 dispersed layers, 2 heads, K 8, lr 3e-3)",
    "B": "A with a `threshold` τ 0.9 teacher", "C": "A on all 6 layers, 4 heads", "D": "A, longer",
    "E": "A, shorter", "F": "E with K 16 states", "G": "A on 512 prompts",
    "H": "E with a `threshold` τ 0.9 teacher", "I": "A with lr 1e-3",
}  # fmt: skip


def demo_bar(d: dict) -> dict[str, str]:
    """The validation bar: threshold τ 0.9 less 1 point, at 0.8 x its NFE (the JSON's ``target_bar``)."""
    th = next(b for b in d["baseline"] if b["policy"] == "threshold" and b["tau"] == 0.9)
    return {"bar_acc": f"{100 * th['accuracy'] - 1:.1f}", "bar_nfe": f"{0.8 * th['nfe_mean']:.1f}",
            "th_acc": f"{100 * th['accuracy']:.1f}", "th_nfe": f"{th['nfe_mean']:.1f}"}  # fmt: skip


def demo_recipes(d: dict) -> list[str]:
    """docs/demo.md: each candidate recipe's best accuracy within the bar's NFE, its τ 0.9 point and training CE."""
    limit = float(demo_bar(d)["bar_nfe"])
    out = header("candidate", "teacher", "updates", f"best ≤ {limit:g} NFE", "τ 0.9", "train CE first → last 50")
    for c in sorted(d["candidates"], key=lambda c: c["id"]):
        best = max((x for x in c["rows"] if x["nfe_mean"] <= limit), key=lambda x: x["accuracy"])
        at9 = next(x for x in c["rows"] if x["tau"] == 0.9)
        chosen = "chosen" in c["change"]
        name, best_s = f"{c['id']}: {DEMO_RECIPES[c['id']]}", f"{100 * best['accuracy']:.1f}% at {best['nfe_mean']:.1f}"
        if chosen:
            name, best_s = f"**{name} (chosen)**", f"**{best_s}**"
        loss = c["train_loss"]
        teacher = f"{c['teacher_policy'].split()[0]}, {c['teacher_prompts']:,}"  # its τ is in the description
        tau9 = f"{100 * at9['accuracy']:.1f}% at {at9['nfe_mean']:.1f}"
        out.append(row(name, teacher, c["recipe"]["updates"], best_s, tau9,
                       f"{loss['first_50']:.3f} → {loss['last_50']:.3f}"))  # fmt: skip
    return out


def engine_occupancy(d: dict) -> dict[str, str]:
    o = d["occupancy"]
    p = o["policies"]
    return {"requests": str(o["requests"]), "batch": str(o["batch_size"]),
            "th": f"{p['threshold']['refill']:.3f}", "tdlm": f"{p['tdlm']['refill']:.3f}",
            "th_c": f"{p['threshold']['chunked']:.3f}", "tdlm_c": f"{p['tdlm']['chunked']:.3f}"}  # fmt: skip


def engine_invariance(d: dict) -> dict[str, str]:
    inv = d["invariance"]
    prompts = {r["requests"] for r in inv["rows"]}
    return {"prompts": f"{max(prompts):,}", "mismatches": f"{inv['mismatches']:,}",
            "results": f"{sum(r['requests'] for r in inv['rows']):,}"}  # fmt: skip
