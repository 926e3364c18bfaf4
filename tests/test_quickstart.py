"""The README's Quickstart runs as written from a fresh ``git clone`` (issue 30: its first command needed a file
that only ``make demo`` wrote, and no step showed how to make and activate the venv).

The commands are parsed out of the clone's own README.md, so the test sees what a new user copies, and a file the
commands need but the repository does not track (a prompts file, a config) fails it. Two things differ from a new
user's shell, both stated here:

* the set-up block: ``make venv`` runs as ``make -n venv`` (the target and its recipe must exist; building a second
  venv takes minutes and the network), and ``.venv`` in the clone is a link to the suite's own venv, which
  ``source .venv/bin/activate`` then activates; ``PYTHONPATH`` points at the clone so its code, not the editable
  install's checkout, is what runs;
* the sizes: each tiny command runs with documented flags appended (they override the ones before them):
  16 prompts on one actor (one global micro-batch: 8 per rank x 2 ranks), 1 update, 2 problems per policy, W&B
  disabled. ``deepspeed`` also gets ``--master_port`` (a launcher option, so it goes before the script) because
  other suites' ranks may hold the default port.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Appended to each tiny command (first word + script): flags of that entry point's own --help.
REDUCED = {
    "ray_jobs/generate_trajectories.py": ["--num-prompts", "16", "--actors", "1", "--batch-size", "16",
                                          "--shard-size", "16"],
    "launcher/train.py": ["--max-steps", "1"],
    "eval/run.py": ["--limit", "2", "--batch-size", "2", "--warmup", "0", "--score-workers", "1"],
}


def quickstart_blocks(readme: str) -> list[list[str]]:
    """The command lines of each ```bash block of README's ``## Quickstart`` (comments dropped, continuations
    joined)."""
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S):
        lines = [ln.split(" #")[0].strip() for ln in re.sub(r"\\\n\s*", " ", block).splitlines()]
        blocks.append([ln for ln in lines if ln and not ln.startswith("#")])
    return blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sized(line: str) -> str:
    words = shlex.split(line)
    script = next((w for w in words if w.endswith(".py")), None)
    if script not in REDUCED:
        raise AssertionError(f"README quickstart: {line!r} is not one of the tiny entry points {sorted(REDUCED)}")
    if words[0] == "deepspeed":
        words[1:1] = ["--master_port", str(_free_port())]
    return shlex.join(words + REDUCED[script])


def run_quickstart(clone: Path, log: list[str]) -> None:
    """Run the set-up block and the tiny block of ``clone``'s README (see the module docstring); raise on failure."""
    blocks = quickstart_blocks((clone / "README.md").read_text())
    assert len(blocks) >= 2, f"README quickstart: expected a set-up block and a tiny block, found {len(blocks)}"
    setup, tiny = blocks[0], blocks[1]
    assert any(ln.startswith("make ") for ln in setup) and "source .venv/bin/activate" in setup, setup
    (clone / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    for line in setup:
        if line.startswith("make "):
            cmd = ["make", "-n", *shlex.split(line)[1:]]
            proc = subprocess.run(cmd, cwd=clone, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, f"{line}: {proc.stderr.strip()}"
        else:
            assert line == "source .venv/bin/activate", f"README quickstart set-up: unexpected step {line!r}"
    assert len(tiny) == 3, f"README quickstart: expected generate, train, evaluate; got {tiny}"
    for line in tiny:
        cmd = f"source .venv/bin/activate && {_sized(line)}"
        t0 = time.monotonic()
        proc = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        log.append(f"{time.monotonic() - t0:.1f} s: {cmd}")
        assert proc.returncode == 0, f"{cmd}\nexit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"


@pytest.mark.slow
def test_readme_quickstart_runs_from_a_fresh_clone(tmp_path):
    clone = tmp_path / "tdlm"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    log: list[str] = []
    try:
        run_quickstart(clone, log)
    finally:
        print("\n".join(log))
    tiny = quickstart_blocks((clone / "README.md").read_text())[1]
    outs = {shlex.split(ln)[next(i for i, w in enumerate(shlex.split(ln)) if w.endswith(".py"))]:
            Path(shlex.split(ln)[shlex.split(ln).index("--output-dir") + 1]) for ln in tiny}
    assert (clone / outs["ray_jobs/generate_trajectories.py"] / "manifest.json").is_file()
    assert (clone / outs["launcher/train.py"] / "adapter" / "adapter.safetensors").is_file()
    ev = clone / outs["eval/run.py"]
    assert (ev / "summary.json").is_file() and list(ev.glob("pareto_*.png")), sorted(p.name for p in ev.iterdir())


def test_shipped_prompts_are_the_multi_v1_teacher_prompt_split(tmp_path):
    """data/multi_prompts.jsonl, the quickstart's prompt source, is what make demo writes (tdlm.demo.write_prompts)
    byte for byte, so its problems stay disjoint from the validation and test splits."""
    from tdlm.demo import write_prompts

    shipped = REPO / "data" / "multi_prompts.jsonl"
    write_prompts(tmp_path / "prompts.jsonl", sum(1 for _ in shipped.open()), "multi")
    assert shipped.read_bytes() == (tmp_path / "prompts.jsonl").read_bytes()
    assert "data/multi_prompts.jsonl" in quickstart_blocks((REPO / "README.md").read_text())[1][0]
