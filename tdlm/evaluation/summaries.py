"""Per-run summaries and W&B logging of an evaluation (step 5 of :func:`tdlm.evaluation.driver.evaluate`).

:class:`Plan` is one planned run (its spec, folder, task and identity), as the driver plans it and as its summary
reads it. :func:`run_summary` gives a run's ``summary.json`` row (metrics from :mod:`tdlm.evaluation.metrics`, the
adapter's allocation and training run), :func:`log_run` writes it with one W&B run of its samples (skipped when an
identical summary is there: a no-op resume logs nothing), :func:`log_comparison` the comparison's W&B run with the
table and the Pareto plots.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from tdlm.evaluation.config import EvalConfig, RunSpec, read_adapter_config
from tdlm.evaluation.metrics import aggregate
from tdlm.evaluation.paired import wandb_metrics
from tdlm.evaluation.report import method_label
from tdlm.tasks import Task

SUMMARY = "summary.json"


@dataclass
class Plan:
    spec: RunSpec
    run_dir: Path
    task: Task
    identity: dict


def run_summary(cfg: EvalConfig, plan: Plan, samples: list[dict], bb_id: str) -> dict:
    spec = plan.spec
    allocation = trained_by = None
    if spec.adapter:
        ac = read_adapter_config(spec.adapter)
        training = ac.get("training") or {}
        allocation = {"layers": ac.get("layers"), "num_layers": (ac.get("backbone") or {}).get("num_layers"),
                      "heads": ac.get("heads"), "head_dim": ac.get("head_dim"), "trained_history": ac.get("history"),
                      "num_parameters": ac.get("num_parameters"), "spec": training.get("allocation")}  # fmt: skip
        # the training run this adapter came from (its folder and W&B run), recorded by the trainer
        trained_by = {"run_dir": training.get("run_dir"), **(training.get("wandb") or {})} if training else None
    summary = {
        "name": spec.name, "run_dir": str(plan.run_dir), "task": spec.task, "metric": plan.task.metric,
        "prompt_version": plan.task.prompt_version, "backbone": cfg.backbone, "backbone_id": bb_id,
        "policy": spec.policy, "threshold": spec.threshold, "entropy_threshold": spec.entropy_threshold,
        "adapter": spec.adapter, "adapter_label": spec.adapter_label, "history": spec.history, "cache": spec.cache,
        "allocation": allocation, "trained_by": trained_by, "gen_length": cfg.decode.gen_length,
        "block_size": cfg.decode.block_size, "stop_at_eos": cfg.decode.stop_at_eos, "batch_size": cfg.decode.batch_size,
        "dtype": cfg.decode.dtype, "chat": cfg.chat,
        "limit": cfg.limit, "task_source": plan.task.source,
        **aggregate(samples),
        "devices": sorted({s["device"] for s in samples if s.get("device")}),
    }  # fmt: skip
    summary["method"] = method_label(summary)
    return summary


def _wandb_config(summary: dict, cfg: EvalConfig, group: str) -> dict:
    keys = ("backbone", "backbone_id", "task", "policy", "method", "threshold", "entropy_threshold", "history",
            "cache", "adapter", "adapter_label", "allocation", "trained_by", "gen_length", "block_size", "batch_size",
            "dtype", "limit", "prompt_version", "sandbox")  # fmt: skip
    return {**{k: summary.get(k) for k in keys}, "group": group, "output_dir": str(cfg.output_dir)}


NUMERIC = ("accuracy", "n", "correct", "nfe_mean", "nfe_median", "seconds_mean", "seconds_median", "seconds_total",
           "speedup_vs_original", "nfe_ratio_vs_original", "speedup_vs_threshold", "nfe_ratio_vs_threshold")


def log_run(cfg: EvalConfig, group: str, summary: dict, samples: list[dict]) -> None:
    """``summary.json`` + one W&B run, unless an identical summary was already written (a no-op resume)."""
    from tdlm.tracking import Tracker, grid_tags, run_tags, tag

    path = Path(summary["run_dir"]) / SUMMARY
    if path.exists():
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(path.read_text()) == json.loads(json.dumps(summary)):
                return
    alloc = summary.get("allocation") or {}
    knob = summary.get("entropy_threshold") if summary["policy"] == "entropy" else summary.get("threshold")
    tags = run_tags(summary.get("backbone_id") or summary["backbone"], alloc.get("spec") or alloc.get("layers"),
                    summary.get("history"), [tag("policy", summary["policy"]), *grid_tags(
                        task=summary["task"], tau=None if summary["policy"] == "original" else knob,
                        cache=summary.get("cache") or "none"), *cfg.tags])
    tracker = Tracker(summary["run_dir"], cfg.project, group, f"{summary['task']}/{summary['name']}",
                      _wandb_config(summary, cfg, group), cfg.wandb_mode,
                      job_type="eval", tags=tags)  # fmt: skip
    if summary.get("adapter"):  # W&B lineage: this run read the artifact the training run logged
        tracker.use_adapter(summary["adapter"], (summary.get("trained_by") or {}).get("id"))
    tracker.log({**{k: summary[k] for k in NUMERIC if summary.get(k) is not None}, **wandb_metrics(summary)}, step=0)
    if tracker.run is not None:
        import wandb

        cols = ["id", "correct", "status", "nfe", "seconds", "extracted"]
        rows = [[s["id"], s["correct"], s["status"], s["nfe"], s["seconds"], (s["extracted"] or "")[:200]]
                for s in samples]  # fmt: skip
        tracker.run.log({"samples": wandb.Table(columns=cols, data=rows)}, step=0)
    tracker.finish(summary)


def comparison_name(cfg: EvalConfig, group: str) -> str:
    """The comparison run's W&B name. A group given by the user (a sweep, ``--group table1``) is shared by several
    evaluations, so their names carry the output folder's name; the default group is already one per folder."""
    if cfg.group is None:
        return f"{group}/comparison"
    return f"{group}/{Path(cfg.output_dir).name}/comparison"


def log_comparison(cfg: EvalConfig, group: str, runs: list[dict], table: str, plots: list[Path]) -> None:
    """A W&B run for the whole comparison: the run table and the Pareto plots."""
    from tdlm.tracking import Tracker

    tracker = Tracker(Path(cfg.output_dir) / "comparison", cfg.project, group, comparison_name(cfg, group),
                      {"backbone": cfg.backbone, "tasks": cfg.tasks, "runs": len(runs), "group": group},
                      cfg.wandb_mode, job_type="eval-comparison")  # fmt: skip
    if tracker.run is not None:
        import wandb

        cols = ["task", "method", "accuracy", "nfe_mean", "seconds_mean", "speedup_vs_original",
                "speedup_vs_threshold"]  # fmt: skip
        data = [[r["task"], r["method"]] + [r.get(c) for c in cols[2:]] for r in runs]
        payload = {"runs": wandb.Table(columns=cols, data=data), "tables_markdown": wandb.Html(f"<pre>{table}</pre>")}
        payload.update({f"pareto/{p.stem}": wandb.Image(str(p)) for p in plots})
        tracker.run.log(payload, step=0)
    tracker.finish({"runs": len(runs), "table": "table.md"})
