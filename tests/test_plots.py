"""The Pareto plots read as the issue-30 review asked: the knob on every point (also a lone one), a legend that
covers no point or error bar, a seconds axis that says per sample and what the batch size makes of it, and a sweep
figure with every allocation's frontier against the baselines. The PNGs were also rendered and looked at by eye
(tdlm/evaluation/plot.py's docstring says what they show)."""

from __future__ import annotations

import json

import pytest


def _run(policy, tau, acc, nfe, sec, label=None, bs=16, n=100, **kw) -> dict:
    r = dict(policy=policy, threshold=tau, accuracy=acc, n=n, nfe_mean=nfe, seconds_mean=sec, batch_size=bs,
             task="multi", backbone="tiny-multi", gen_length=56, block_size=56, **kw)
    if label:
        r.update(adapter_label=label, history="full")
    return r


QUICKSTART = [_run("threshold", 0.9, 0.64, 29.3, 0.59), _run("tdlm", 0.9, 0.62, 17.0, 0.42, label="adapter")]


def _texts(fig) -> list[list[str]]:
    return [[t.get_text() for t in ax.texts] for ax in fig.axes]


def test_every_point_with_a_knob_says_it_even_one_tau_per_policy():
    import matplotlib.pyplot as plt

    from tdlm.evaluation.plot import pareto_figure

    fig = pareto_figure(QUICKSTART, "quickstart")
    try:
        assert _texts(fig) == [["τ 0.9", "τ 0.9"], ["τ 0.9", "τ 0.9"]]
        colors = {t.get_color() for t in fig.axes[1].texts}
        assert len(colors) == 2  # each label in its line's colour
    finally:
        plt.close(fig)
    runs = [_run("original", None, 0.6, 56, 1.0), _run("entropy", None, 0.5, 20, 0.4, entropy_threshold=0.5)]
    fig = pareto_figure(runs, "")
    try:
        assert _texts(fig) == [["H 0.5"], ["H 0.5"]]  # original has no knob to show
    finally:
        plt.close(fig)


def test_the_legend_covers_no_point_and_no_error_bar():
    """The legend sits below both panels (it covered TDLM's error bar inside the NFE panel)."""
    import matplotlib.pyplot as plt

    from tdlm.evaluation.plot import pareto_figure

    fig = pareto_figure(QUICKSTART, "quickstart")
    try:
        renderer = fig.canvas.get_renderer()
        assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
        box = fig.legends[0].get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), "the legend overlaps a panel"
            assert not box.overlaps(ax.xaxis.label.get_window_extent(renderer)), "the legend covers an axis label"
        assert fig.legends[0].texts[-1].get_text() == "Pareto frontier"  # the methods first
    finally:
        plt.close(fig)


def test_seconds_axis_says_per_sample_and_what_the_batch_makes_of_it():
    import matplotlib.pyplot as plt

    from tdlm.evaluation.plot import pareto_figure, seconds_label

    assert seconds_label([{"batch_size": 1}]) == "seconds per sample (log scale)\nbatch 1: each sample's latency"
    assert "batch 16, 50: timed from its batch's start, ≈ one batch, not a latency" in seconds_label(
        [{"batch_size": 50}, {"batch_size": 16}])
    assert "batch size not recorded" in seconds_label([{}])
    fig = pareto_figure(QUICKSTART, "")
    try:
        assert fig.axes[0].get_xlabel().startswith("seconds per sample") and "batch 16" in fig.axes[0].get_xlabel()
        assert fig.axes[1].get_xlabel() == "mean NFE per sample (log scale)"
    finally:
        plt.close(fig)


def _write_eval(out, runs: list[dict]) -> None:
    """An evaluation output dir as tdlm.evaluation.report.load_runs reads it (runs/<task>/<run>/summary.json)."""
    for r in runs:
        d = out / "runs" / r["task"] / r["name"]
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({**r, "run_dir": str(d)}))


def test_a_sweep_draws_every_allocation_against_the_baselines(tmp_path, monkeypatch):
    """One figure per task: each allocation's TDLM line through its taus, and the baselines (each trial's own
    eval/<slug>/pareto_*.png holds its adapter alone)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tdlm.evaluation.plot import pareto_figure
    from tdlm.sweep.table import load_sweep, plot_sweep

    sweep = tmp_path / "sweep"
    (sweep / "trials").mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"experiment": "t4", "backbone": "tiny-arith",
                                                  "allocations": ["dispersed:2", "all"],
                                                  "settings": {"eval": {"thresholds": [0.8, 0.9]}}}))
    base = dict(task="arith", backbone="tiny-arith", gen_length=40, block_size=40, batch_size=1, n=50)
    _write_eval(sweep / "eval" / "baselines", [
        {**base, "policy": "original", "threshold": None, "accuracy": 0.6, "nfe_mean": 40, "seconds_mean": 1.0,
         "name": "original"},
        {**base, "policy": "threshold", "threshold": 0.9, "accuracy": 0.58, "nfe_mean": 14, "seconds_mean": 0.4,
         "name": "threshold-tau0.9"}])
    for slug, acc in (("dispersed-2", 0.5), ("all", 0.56)):
        _write_eval(sweep / "eval" / slug, [
            {**base, "policy": "tdlm", "threshold": tau, "accuracy": acc + tau / 10, "nfe_mean": 40 * tau - 24,
             "seconds_mean": tau - 0.5, "adapter_label": slug, "history": "full", "name": f"tdlm-{slug}-{tau}"}
            for tau in (0.8, 0.9)])
    import tdlm.evaluation.plot as plot

    drawn = []
    real = plot.plot_pareto
    monkeypatch.setattr(plot, "plot_pareto", lambda runs, path, title="": drawn.append((runs, title)) or
                        real(runs, path, title))
    (path,) = plot_sweep(sweep)
    assert path == sweep / "pareto_arith.png" and path.stat().st_size > 10_000
    ((runs, title),) = drawn
    assert title.startswith("Arith: 2 allocation(s) of sweep t4 against the baselines")
    assert len(runs) == len(load_sweep(sweep)[2]) == 6
    fig = pareto_figure(runs, "")
    try:
        names = [t.get_text() for t in fig.legends[0].texts]
        assert names == ["Original", "Fast-dLLM", "TDLM [all, full]", "TDLM [dispersed-2, full]", "Pareto frontier"]
        assert sorted(_texts(fig)[1]) == sorted(["τ 0.9"] + ["τ 0.8", "τ 0.9"] * 2)
    finally:
        plt.close(fig)


@pytest.mark.parametrize("runs", [QUICKSTART])
def test_plot_file_is_written_atomically(tmp_path, runs):
    from tdlm.evaluation.plot import plot_pareto

    out = plot_pareto(runs, tmp_path / "p.png")
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]  # no temporary file left beside it
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
