"""The paper's 8B / 7B recipes: config files, their true-shape adapters, and the README / docs / --help commands."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tdlm.config import load_config
from tdlm.errors import TDLMError
from tdlm.evaluation.config import EvalConfig
from tdlm.generation import GenerationConfig
from tdlm.models.loading import build_backbone
from tdlm.temporal.model import TDLM
from tdlm.training import preflight, temporal_config
from tdlm.training.launch import parse_launch
from tdlm.training.planner.model import resolve_backbone

REPO = Path(__file__).resolve().parents[1]
RELEASE = {"GSAI-ML/LLaDA-8B-Instruct": "llada-8b", "Dream-org/Dream-v0-Instruct-7B": "dream-7b"}
# config -> (release id, layers, heads x head_dim, adapter parameters L_t (4 d d_t + 1), Section 2.4)
RECIPES = {
    "configs/llada_8b.yaml": ("GSAI-ML/LLaDA-8B-Instruct", list(range(1, 32, 2)), (4, 64), 67_108_880),
    "configs/dream_7b.yaml": ("Dream-org/Dream-v0-Instruct-7B", list(range(7, 21)), (4, 84), 67_436_558),
}


def meta_backbone(hub_id: str):
    spec = resolve_backbone(RELEASE[hub_id])
    with torch.device("meta"):
        return build_backbone(spec.family, spec.config, spec.name)


@pytest.mark.parametrize("path", sorted(RECIPES))
def test_recipe_builds_the_paper_adapter_at_true_shape(path):
    hub_id, layers, (heads, head_dim), count = RECIPES[path]
    run = parse_launch(["--ds", str(REPO / "ds_configs/zero3.json"), "--config", str(REPO / path)]).run
    assert run.model.backbone == hub_id
    assert run.train.max_steps == 750 and run.model.history == "full"
    with torch.device("meta"):
        model = TDLM(meta_backbone(hub_id), temporal_config(run))
    assert model.layer_ids == layers
    assert (model.config.heads, model.config.head_dim) == (heads, head_dim)
    assert model.num_temporal_parameters() == model.expected_temporal_parameters() == count
    assert model.offset == (1 if "dream" in path else 0)  # Dream: prediction-aligned by default


@pytest.mark.parametrize("override,n", [("dispersed:8", 8), ("middle:16", 16), ("dispersed:16", 16), ("all", 32)])
def test_table4_allocations_are_one_override_each(override, n):
    run = parse_launch(["--ds", str(REPO / "ds_configs/zero3.json"), "--config", str(REPO / "configs/llada_8b.yaml"),
                        f"model.layers={override}"]).run
    with torch.device("meta"):
        model = TDLM(meta_backbone(run.model.backbone), temporal_config(run))
    assert len(model.layer_ids) == n
    assert model.num_temporal_parameters() == n * (4 * 4096 * 256 + 1)
    if override == "middle:16":
        assert model.layer_ids == list(range(8, 24))  # Table 5


@pytest.mark.parametrize("name", ["gen_llada_8b", "gen_dream_7b"])
def test_teacher_generation_recipes(name):
    cfg = load_config(GenerationConfig, REPO / "configs" / f"{name}.yaml").validate()
    assert cfg.num_prompts == 3500 and cfg.prompt_split == "train" and not cfg.allow_eval_prompts
    assert (cfg.decode.gen_length, cfg.decode.block_size) == (256, 32)
    train_cfg = REPO / "configs" / f"{name.removeprefix('gen_')}.yaml"
    run = parse_launch(["--ds", str(REPO / "ds_configs/zero3.json"), "--config", str(train_cfg)]).run
    assert cfg.backbone == run.model.backbone and cfg.output_dir == run.data.trajectories


def test_evaluation_recipes():
    llada = load_config(EvalConfig, REPO / "configs/eval_llada_table1.yaml")
    dream = load_config(EvalConfig, REPO / "configs/eval_dream_table1.yaml")
    assert llada.thresholds == [0.9] and llada.entropy_thresholds == [0.5]
    assert dream.tdlm_thresholds == [0.95] and dream.entropy_thresholds == [0.4] and dream.thresholds == [0.9]
    for cfg in (llada, dream):
        assert (cfg.decode.gen_length, cfg.decode.block_size, cfg.decode.batch_size) == (256, 32, 1)
        assert set(cfg.tasks) == {"gsm8k", "math500", "mbpp"}


def doc_texts() -> str:
    """README.md and every docs/*.md page: the commands and file names the user reads."""
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def _commands(text: str) -> list[str]:
    """Shell commands in text, continuation lines joined."""
    return [c.strip() for c in re.sub(r"\\\n\s*", " ", text).splitlines()]


def test_readme_training_commands_resolve_to_the_recipes(monkeypatch):
    monkeypatch.chdir(REPO)  # the README and docs run from the repository root
    found = {}
    for line in _commands(doc_texts()):
        if "launcher/train.py" in line and ("llada_8b" in line or "dream_7b" in line) and line.startswith("deepspeed"):
            argv = shlex.split(line)
            launch = parse_launch(argv[argv.index("launcher/train.py") + 1:])
            found.setdefault(launch.source, launch.run)
    assert set(found) == set(RECIPES), sorted(found)
    for path, run in found.items():
        assert run.model.backbone == RECIPES[path][0] and run.train.max_steps == 750


def test_every_config_named_in_readme_docs_and_help_exists():
    texts = [doc_texts(),
             subprocess.run([sys.executable, str(REPO / "launcher/train.py"), "--help"], capture_output=True,
                            text=True, check=True).stdout,
             subprocess.run([sys.executable, str(REPO / "ray_jobs/generate_trajectories.py"), "--help"],
                            capture_output=True, text=True, check=True).stdout]
    named = set()
    for text in texts:
        named |= set(re.findall(r"(?:configs|ds_configs)/[\w.-]+\.(?:yaml|json)", text))
    assert {"configs/llada_8b.yaml", "configs/dream_7b.yaml"} <= named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, missing


def test_bad_recipe_input_is_one_line_naming_file_and_field(tmp_path):
    z3 = str(REPO / "ds_configs/zero3.json")
    cfg = str(REPO / "configs/llada_8b.yaml")
    cases = [
        (["model.backbone=/data/no-such-LLaDA"],
         r"configs/llada_8b.yaml: model.backbone='/data/no-such-LLaDA': .*hf download"),
        (["model.backbone=tiny-llada", "model.layers=dispersed:16"],
         r"configs/llada_8b.yaml: model.layers='dispersed:16'.* 4 layers"),
        (["model.backbone=tiny-llada", "model.layers=all", "model.head_dim=7"], r"model.head_dim=7 .*even"),
    ]
    for extra, pattern in cases:
        launch = parse_launch(["--ds", z3, "--config", cfg, *extra])
        with pytest.raises(TDLMError, match=pattern) as info:
            preflight(launch.run, launch.ds_raw, 8, on_gpu=False, source=launch.source)
        assert "\n" not in str(info.value)
