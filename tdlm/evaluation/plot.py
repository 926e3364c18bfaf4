"""Quality-latency Pareto plots (the paper's Figure 1) from run summaries.

One PNG per (backbone, task): accuracy against mean generation seconds (left) and mean NFE (right);
one line per method family (original; Fast-dLLM; entropy; TDLM per adapter and history; each spatial KV
cache its own family, labelled with it) through its threshold sweep, and the empirical Pareto frontier
over all points (higher accuracy at lower cost) drawn as a dashed step line with ringed markers.

Both cost axes are logarithmic: the sequential ``original`` decoder costs N evaluations while parallel ones need
a few, and on a linear axis every parallel decoder sat in the left 15%. Each point has a vertical error bar of
one standard error of its accuracy (the report's: ``accuracy_se`` when a run has it, else the binomial
sqrt(p(1-p)/n)); the swept tau next to each point is placed where it overlaps no other label (candidate offsets
tried in turn, in display space). matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tdlm.evaluation.report import TASK_TITLES, cache_suffix, sort_key


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
    else:
        name = f"TDLM [{run.get('adapter_label')}, {run.get('history')}]"
    return name + cache_suffix(run)


def accuracy_se(run: dict) -> float:
    """One standard error of a run's accuracy: the report's ``accuracy_se``, else binomial sqrt(p(1-p)/n)."""
    if run.get("accuracy_se") is not None:
        return float(run["accuracy_se"])
    p, n = run.get("accuracy"), run.get("n") or 0
    return math.sqrt(p * (1.0 - p) / n) if p is not None and n else 0.0


# Offsets (points) tried in turn for a label: right-below, right-above, left-above, left-below, then further out.
LABEL_OFFSETS = ((5, -11), (5, 5), (-20, 5), (-20, -11), (5, -22), (5, 16), (-20, 16), (-20, -22), (14, -4),
                 (-30, -4))


def _overlaps(a: Any, b: Any, pad: float = 1.0) -> bool:
    return not (a.x1 + pad <= b.x0 or b.x1 + pad <= a.x0 or a.y1 + pad <= b.y0 or b.y1 + pad <= a.y0)


def place_labels(ax: Any, items: Sequence[tuple[str, float, float]], renderer: Any) -> list[Any]:
    """Annotate ``(text, x, y)`` points so that no two labels (nor a label and a marker) overlap: each label takes
    the first offset of :data:`LABEL_OFFSETS` that is free; if none is, the least crowded one."""
    placed: list[Any] = []
    boxes: list[Any] = []
    markers = []
    for _, x, y in items:  # a marker's own square (about 6 points across at dpi 120)
        px, py = ax.transData.transform((x, y))
        half = 4.0 * ax.figure.dpi / 72.0
        from matplotlib.transforms import Bbox

        markers.append(Bbox.from_extents(px - half, py - half, px + half, py + half))
    for text, x, y in items:
        best = None
        for dx, dy in LABEL_OFFSETS:
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7, alpha=0.85)
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


def pareto_figure(runs: Sequence[dict], title: str = "") -> Any:
    """The two-panel Pareto figure of ``runs`` (one backbone and task); see the module docstring."""
    import matplotlib

    matplotlib.use("Agg")  # headless: clusters and CI have no display
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.get("accuracy") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels: list[tuple[Any, list[tuple[str, float, float]]]] = []
    for ax, field, xlabel in ((axes[0], "seconds_mean", "mean generation seconds (log scale)"),
                              (axes[1], "nfe_mean", "mean NFE (log scale)")):  # fmt: skip
        families: dict[str, list[dict]] = {}
        for r in sorted(runs, key=sort_key):
            families.setdefault(family(r), []).append(r)
        items: list[tuple[str, float, float]] = []
        for name, group in families.items():
            group = sorted(group, key=lambda r: r[field])
            ax.errorbar([r[field] for r in group], [100 * r["accuracy"] for r in group],
                        yerr=[100 * accuracy_se(r) for r in group], marker="o", capsize=3, label=name)
            for r in group:  # the swept knob next to each point
                knob = r.get("threshold") if r["policy"] != "entropy" else r.get("entropy_threshold")
                if knob is not None and len(group) > 1:
                    items.append((f"{knob:g}", r[field], 100 * r["accuracy"]))
        labels.append((ax, items))
        if all(r[field] and r[field] > 0 for r in runs):
            from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 20, not 2x10^1
            ax.xaxis.set_minor_formatter(NullFormatter())
        pts = [(r[field], 100 * r["accuracy"]) for r in runs]
        front = [pts[i] for i in pareto_front(pts)]
        if front:
            xs, ys = zip(*front, strict=True)
            ax.step(xs, ys, where="post", linestyle="--", color="black", linewidth=1, label="Pareto frontier")
            ax.scatter(xs, ys, s=120, facecolors="none", edgecolors="black", zorder=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy / pass@1 (%) ± 1 SE")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
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
    fig.savefig(out, dpi=120)
    plt.close(fig)
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
