"""Run tracking: a stable local record (``metrics.jsonl``, ``summary.json``) plus W&B.

W&B has no public reader for offline runs, so every number that a comparison needs is also written
to JSON next to the run; W&B is for dashboards (``wandb sync`` later for offline runs). Without an API
key W&B runs offline instead of failing; ``WANDB_MODE`` is respected. Non-zero ranks get a null
tracker (nanochat's ``DummyWandb`` pattern) so callers never branch on rank.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
from pathlib import Path
from typing import Any


def wandb_mode(explicit: str | None = None) -> str:
    """``explicit`` > ``WANDB_MODE`` > online if an API key is configured > offline."""
    if explicit:
        return explicit
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


def _clean(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl; a torn *last* line (a crash or a full disk mid-write) is dropped with a
    warning, a bad line elsewhere is an error naming it."""
    from tdlm.errors import TDLMError

    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                print(f"warning: {path}: dropping a torn last line ({line[:60]!r})", file=sys.stderr, flush=True)
                break
            raise TDLMError(f"{path} line {i + 1}: not JSON ({e}); fix or remove that line") from e
    return out


class NullTracker:
    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def truncate(self, step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


class Tracker(NullTracker):
    """Appends metrics to ``<run_dir>/metrics.jsonl`` and mirrors them to a W&B run."""

    def __init__(self, run_dir: str | Path, project: str, group: str | None, name: str | None,
                 config: dict, mode: str | None = None, job_type: str = "train") -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.run = None
        m = wandb_mode(mode)
        if m != "disabled":
            import wandb

            os.environ.setdefault("WANDB_DIR", str(self.dir))
            self.run = wandb.init(project=project, group=group, name=name, config=config, mode=m,
                                  job_type=job_type, dir=str(self.dir), reinit="finish_previous")

    def truncate(self, step: int) -> None:
        """Drop records after ``step`` (a resumed run rewrites them)."""
        if not self.metrics_path.exists():
            return
        keep = [rec for rec in read_metrics(self.metrics_path) if rec.get("step", 0) <= step]
        tmp = self.metrics_path.with_name(f"{self.metrics_path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(rec) + "\n" for rec in keep))
        os.replace(tmp, self.metrics_path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        rec = _clean({"step": step, **metrics})
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        tmp = self.dir / "summary.json.tmp"
        tmp.write_text(json.dumps(_clean(summary), indent=2) + "\n")
        os.replace(tmp, self.dir / "summary.json")
        if self.run is not None:
            self.run.summary.update(summary)
            self.run.finish()
