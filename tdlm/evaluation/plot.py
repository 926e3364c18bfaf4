"""Quality-latency Pareto plots (the paper's Figure 1) from run summaries.

One PNG per (backbone, task): accuracy against mean seconds per sample (left) and mean NFE (right); one line per
method family (original; Fast-dLLM; entropy; dInfer credit; dInfer soft iteration; TDLM per adapter and history;
each spatial KV cache its own family, labelled with it) through its threshold sweep, and the empirical Pareto
frontier over all points (higher accuracy at lower cost) drawn as a dashed step line with ringed markers. The
baselines are drawn with square markers and dotted lines (grey; dInfer's two in brown and olive), so that TDLM's
lines (one per adapter: a sweep's allocations) stand out against them.

Both cost axes are logarithmic: the sequential ``original`` decoder costs N evaluations while parallel ones need
a few, and on a linear axis every parallel decoder sat in the left 15%. Each point has a vertical error bar of
one standard error of its accuracy (the report's: ``accuracy_se`` when a run has it, else the binomial
sqrt(p(1-p)/n)), and every point with a knob says it (``τ 0.9``, ``H 0.5``), placed where it overlaps no other
label (candidate offsets tried in turn, in display space); a lone point is labelled too, so a one-τ-per-policy
quickstart plot still says which τ it shows. The legend sits below the panels, outside both, so it never covers a
point or an error bar.

What the seconds are: each sample's ``seconds`` is the wall time from the start of the batch it was decoded in to
that sample's end (:func:`tdlm.decode`), so at batch size 1 it is the request's latency and at batch size B it is
about one batch's time, not a latency; the axis label says which (:func:`seconds_label`). matplotlib's Agg backend:
no display needed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tdlm.evaluation.report import REUSE_LABELS, TASK_TITLES, cache_suffix, sort_key


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated (cost, accuracy) points, by increasing cost.

    A point is dominated when another has cost <= and accuracy >= with one strict; of identical
    points the first is kept.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    front: list[int] = []
    best = float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def family(run: dict) -> str:
    """The line a run belongs to: its method without the swept threshold (a cached variant is its own line)."""
    p = run["policy"]
    if p == "original":
        name = "Original"
    elif p == "threshold":
        name = "Fast-dLLM"
    elif p == "entropy":
        name = "Entropy"
    elif p in REUSE_LABELS:
        name = REUSE_LABELS[p]
    else:
        name = f"TDLM [{run.get('adapter_label')}, {run.get('history')}]"
    return name + cache_suffix(run)


def accuracy_se(run: dict) -> float:
    """One standard error of a run's accuracy: the report's ``accuracy_se``, else binomial sqrt(p(1-p)/n)."""
    if run.get("accuracy_se") is not None:
        return float(run["accuracy_se"])
    p, n = run.get("accuracy"), run.get("n") or 0
    return math.sqrt(p * (1.0 - p) / n) if p is not None and n else 0.0


# Offsets (points) and alignment tried in turn for a label: right-below, right-above, left-above, left-below, then
# further out. Left of a point the label is right-aligned, so a wider label ("τ 0.95") never reaches its marker.
LABEL_OFFSETS = ((5, -11, "left"), (5, 5, "left"), (-5, 5, "right"), (-5, -11, "right"), (5, -22, "left"),
                 (5, 16, "left"), (-5, 16, "right"), (-5, -22, "right"), (9, -4, "left"), (-9, -4, "right"))


def _overlaps(a: Any, b: Any, pad: float = 1.0) -> bool:
    return not (a.x1 + pad <= b.x0 or b.x1 + pad <= a.x0 or a.y1 + pad <= b.y0 or b.y1 + pad <= a.y0)


def place_labels(ax: Any, items: Sequence[tuple[str, float, float, str]], renderer: Any) -> list[Any]:
    """Annotate ``(text, x, y, color)`` points so that no two labels (nor a label and a marker) overlap: each label
    takes the first offset of :data:`LABEL_OFFSETS` that is free; if none is, the least crowded one. A label has its
    line's colour, so that crowded points still say whose tau they show."""
    placed: list[Any] = []
    boxes: list[Any] = []
    markers = []
    for _, x, y, _c in items:  # a marker's own square (about 6 points across at dpi 120)
        px, py = ax.transData.transform((x, y))
        half = 4.0 * ax.figure.dpi / 72.0
        from matplotlib.transforms import Bbox

        markers.append(Bbox.from_extents(px - half, py - half, px + half, py + half))
    for text, x, y, color in items:
        best = None
        for dx, dy, ha in LABEL_OFFSETS:
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7, ha=ha,
                              color=color)
            box = ann.get_window_extent(renderer)
            clashes = sum(_overlaps(box, b) for b in boxes) + sum(_overlaps(box, m, 0.0) for m in markers)
            if best is None or clashes < best[0]:
                if best is not None:
                    best[1].remove()
                best = (clashes, ann, box)
            else:
                ann.remove()
            if clashes == 0:
                break
        assert best is not None
        placed.append(best[1])
        boxes.append(best[2])
    return placed


BASELINE_COLORS = {"original": "0.15", "threshold": "0.45", "entropy": "0.65", "credit": "tab:brown",
                   "soft": "tab:olive"}  # fmt: skip


def seconds_label(runs: Sequence[dict]) -> str:
    """The seconds axis' label: per sample, and what the batch size makes of it (see the module docstring)."""
    sizes = sorted({int(r["batch_size"]) for r in runs if r.get("batch_size")})
    if sizes == [1]:
        return "seconds per sample (log scale)\nbatch 1: each sample's latency"
    if not sizes:
        return "seconds per sample (log scale)\nbatch size not recorded"
    shown = ", ".join(map(str, sizes))
    return f"seconds per sample (log scale)\nbatch {shown}: timed from its batch's start, ≈ one batch, not a latency"


def knob_label(run: dict) -> str | None:
    """``τ 0.9`` / ``H 0.5`` for a point, None for ``original`` (no knob)."""
    if run["policy"] == "entropy":
        return None if run.get("entropy_threshold") is None else f"H {run['entropy_threshold']:g}"
    if run["policy"] == "original" or run.get("threshold") is None:
        return None
    return f"τ {run['threshold']:g}"


def _log_ticks(ax: Any) -> None:
    """Readable ticks on a log x axis: 1-2-5 per decade, or every 1..9 when the points span less than that would
    label (a narrow range got one tick or none)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = ax.get_xlim()
    for subs in ((1.0, 2.0, 5.0), tuple(float(i) for i in range(1, 10))):
        locator = LogLocator(base=10, subs=subs)
        if sum(lo <= t <= hi for t in locator.tick_values(lo, hi)) >= 3:
            break
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))  # 20, not 2x10^1
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)


def pareto_figure(runs: Sequence[dict], title: str = "") -> Any:
    """The two-panel Pareto figure of ``runs`` (one backbone and task); see the module docstring."""
    import matplotlib

    matplotlib.use("Agg")  # headless: clusters and CI have no display
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.get("accuracy") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    labels: list[tuple[Any, list[tuple[str, float, float, str]]]] = []
    families: dict[str, list[dict]] = {}
    for r in sorted(runs, key=sort_key):
        families.setdefault(family(r), []).append(r)
    cycle = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    styles = {}
    for name, group in families.items():
        p = group[0]["policy"]
        # Baselines on top (zorder) and larger: several TDLM lines may pass through the same spot.
        styles[name] = (dict(color=BASELINE_COLORS[p], marker="s", markersize=7, linestyle=":", zorder=4)
                        if p in BASELINE_COLORS else dict(color=next(cycle), marker="o", linestyle="-", zorder=2))
    for ax, field, xlabel in ((axes[0], "seconds_mean", seconds_label(runs)),
                              (axes[1], "nfe_mean", "mean NFE per sample (log scale)")):  # fmt: skip
        items: list[tuple[str, float, float, str]] = []
        for name, group in families.items():
            group = sorted(group, key=lambda r: r[field])
            ax.errorbar([r[field] for r in group], [100 * r["accuracy"] for r in group],
                        yerr=[100 * accuracy_se(r) for r in group], capsize=3, label=name, **styles[name])
            for r in group:  # the swept knob next to each point
                text = knob_label(r)
                if text is not None:
                    items.append((text, r[field], 100 * r["accuracy"], styles[name]["color"]))
        labels.append((ax, items))
        log_axis = all(r[field] and r[field] > 0 for r in runs)
        if log_axis:
            ax.set_xscale("log")
        pts = [(r[field], 100 * r["accuracy"]) for r in runs]
        front = [pts[i] for i in pareto_front(pts)]
        if front:
            xs, ys = zip(*front, strict=True)
            ax.step(xs, ys, where="post", linestyle="--", color="black", linewidth=1, label="Pareto frontier")
            ax.scatter(xs, ys, s=120, facecolors="none", edgecolors="black", zorder=3)
        ax.margins(x=0.12, y=0.12)  # room for the labels of the outermost points
        if log_axis:
            _log_ticks(ax)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel("accuracy / pass@1 (%) ± 1 SE")
        ax.grid(alpha=0.3, which="both")
    handles, names = axes[0].get_legend_handles_labels()
    order = sorted(range(len(names)), key=lambda i: names[i] == "Pareto frontier")  # the methods first
    handles, names = [handles[i] for i in order], [names[i] for i in order]
    ncol = min(len(names), 3)
    fig.suptitle(title)
    fig.tight_layout()
    rows = math.ceil(len(names) / ncol) if ncol else 0
    bottom = 0.05 + 0.055 * rows  # figure fraction taken by the legend below the panels
    fig.subplots_adjust(bottom=bottom + 0.12)
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.canvas.draw()  # final limits and layout: labels are placed in display space
    renderer = fig.canvas.get_renderer()
    for ax, items in labels:
        place_labels(ax, items, renderer)
    return fig


def plot_pareto(runs: Sequence[dict], path: str | os.PathLike, title: str = "") -> Path:
    """Write the two-panel Pareto PNG of ``runs`` (one backbone and task) to ``path``."""
    import matplotlib.pyplot as plt

    fig = pareto_figure(runs, title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.png")  # sweep agents may redraw the same figure at once
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def plot_all(runs: Sequence[dict], out_dir: str | os.PathLike) -> list[Path]:
    """One ``pareto_<task>[_<backbone>].png`` per (backbone, task) of ``runs``; returns the paths."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r.get("backbone_id") or r["backbone"], r["task"], r["gen_length"], r["block_size"]),
                          []).append(r)  # fmt: skip
    multi = len({k[0] for k in groups}) > 1 or len({k[2:] for k in groups}) > 1
    paths = []
    for (backbone, task, gen, block), group in groups.items():
        suffix = f"_{Path(str(backbone)).name}_N{gen}_b{block}" if multi else ""
        title = f"{TASK_TITLES.get(task, task)}: {backbone} (N={gen}, block {block})"
        paths.append(plot_pareto(group, Path(out_dir) / f"pareto_{task}{suffix}.png", title))
    return paths
