"""Quality-latency Pareto plots (the paper's Figure 1) from run summaries.

One PNG per (backbone, task): accuracy against mean generation seconds (left) and mean NFE (right);
one line per method family (original; Fast-dLLM; entropy; TDLM per adapter and history; each spatial KV
cache its own family, labelled with it) through its threshold sweep, and the empirical Pareto frontier
over all points (higher accuracy at lower cost) drawn as a dashed step line with ringed markers.
matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

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


def plot_pareto(runs: Sequence[dict], path: str | os.PathLike, title: str = "") -> Path:
    """Write the two-panel Pareto PNG of ``runs`` (one backbone and task) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # headless: clusters and CI have no display
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.get("accuracy") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, field, xlabel in ((axes[0], "seconds_mean", "mean generation seconds"),
                              (axes[1], "nfe_mean", "mean NFE")):  # fmt: skip
        families: dict[str, list[dict]] = {}
        for r in sorted(runs, key=sort_key):
            families.setdefault(family(r), []).append(r)
        for name, group in families.items():
            group = sorted(group, key=lambda r: r[field])
            ax.plot([r[field] for r in group], [100 * r["accuracy"] for r in group], marker="o", label=name)
            for r in group:  # the swept knob next to each point
                knob = r.get("threshold") if r["policy"] != "entropy" else r.get("entropy_threshold")
                if knob is not None and len(group) > 1:
                    ax.annotate(f"{knob:g}", (r[field], 100 * r["accuracy"]), textcoords="offset points",
                                xytext=(4, -10), fontsize=7, alpha=0.8)  # fmt: skip
        pts = [(r[field], 100 * r["accuracy"]) for r in runs]
        front = [pts[i] for i in pareto_front(pts)]
        if front:
            xs, ys = zip(*front, strict=True)
            ax.step(xs, ys, where="post", linestyle="--", color="black", linewidth=1, label="Pareto frontier")
            ax.scatter(xs, ys, s=120, facecolors="none", edgecolors="black", zorder=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy / pass@1 (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
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
