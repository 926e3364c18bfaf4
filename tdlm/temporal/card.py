"""The model card of a TDLM adapter, rendered from data: the adapter's config and its evaluation rows.

The rows are plain dicts (one per evaluated run, as ``tdlm.evaluation.report.load_runs`` returns them); this module
never reads an evaluation folder, so it has no dependency on the evaluator. That is why it sits beside the adapter
files, below the model: ``TDLM.save_pretrained`` writes the card with no evaluation table through :func:`write_card`,
and the Hub layer (``tdlm.hub.save_pretrained`` / ``write_model_card``) calls the same function with the rows it
reads from evaluation folders, so the model never imports the Hub layer and there is one card writer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from tdlm.errors import TDLMError
from tdlm.temporal.adapter_files import CARD, LIBRARY, adapter_config_path

# Benchmarks with a Hub dataset: their accuracy goes into the card's model-index metadata too.
HUB_DATASETS = {"gsm8k": ("openai/gsm8k", "GSM8K", "main", "test"),
                "math500": ("HuggingFaceH4/MATH-500", "MATH-500", None, "test"),
                "mbpp": ("google-research-datasets/mbpp", "MBPP", "sanitized", "test")}  # fmt: skip
TASK_TITLES = {"gsm8k": "GSM8K", "math500": "MATH-500", "mbpp": "MBPP", "arith": "Arith (tiny-arith held-out)"}

TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

A **TDLM temporal adapter** (temporal self-conditioning for masked-diffusion language models) for the frozen
backbone `{{ backbone_id }}`. At {{ n_layers }} of the backbone's {{ backbone_layers }} layers, each still-masked
response position attends to its own hidden states from earlier denoising steps; the backbone weights are not part of
this repository and stay unchanged.

This is not a PEFT adapter: load it with `tdlm`.

```python
import tdlm

model = tdlm.TDLM.from_pretrained("{{ backbone_id }}", "{{ repo_id }}")   # backbone: preset, folder or cached Hub id
results = tdlm.decode(model, prompt_ids, policy="tdlm", threshold=0.9, gen_length=256, block_size=32)
```

## Adapter

| field | value |
|---|---|
| backbone | `{{ backbone_id }}` ({{ family }}, {{ backbone_layers }} layers, hidden size {{ hidden_size }}) |
| backbone weight fingerprint | `{{ fingerprint }}` (other weights are refused unless `allow_other_backbone=True`) |
| temporal layers | {{ allocation }} |
| heads x head width | {{ heads }} x {{ head_dim }} |
| parameters | {{ parameters }} |
| history | `{{ history }}` |
| alignment | `{{ alignment }}` |

## Training recipe

{{ recipe }}

## Evaluation

{{ evaluation }}
"""


# -- card ------------------------------------------------------------------------------------------
def allocation_text(cfg: dict) -> str:
    """``16, dispersed (1, 3, ..., 31)``: the spec the run used (when recorded) and the indices."""
    layers = cfg.get("layers") or []
    spec = (cfg.get("training") or {}).get("allocation")
    idx = ", ".join(map(str, layers))
    if isinstance(spec, str) and ":" in spec:
        kind, n = spec.split(":", 1)
        return f"{n}, {kind} ({idx})"
    if spec == "all":
        return f"{len(layers)}, all ({idx})"
    return f"{len(layers)} ({idx})"


def _recipe_text(training: dict | None) -> str:
    if not training:
        return "Not recorded (the adapter was saved outside `launcher/train.py`)."
    r = training.get("recipe") or {}
    rows = [("optimizer updates", training.get("steps")), ("teacher trajectories", training.get("trajectories"))]
    teacher = training.get("teacher") or {}
    if teacher.get("decode"):
        rows.append(("teacher decoding", ", ".join(f"{k}={v}" for k, v in teacher["decode"].items())))
    if teacher.get("prompts"):
        rows.append(("teacher prompts", teacher["prompts"]))
    if r:
        rows += [("sampled states K", r.get("states")),
                 ("global batch", f"{r.get('global_batch')} trajectories ({r.get('micro_batch_size')} x "
                                  f"{r.get('grad_accum')} accumulation x {r.get('world_size')} ranks)"),
                 ("AdamW", f"lr {r.get('lr')}, betas {r.get('betas')}, weight decay {r.get('weight_decay')}"),
                 ("schedule", f"{r.get('warmup_steps')} warm-up steps, cosine to {r.get('min_lr_ratio')} x lr"),
                 ("gradient clipping", r.get("grad_clip")),
                 ("seeds", f"train {r.get('seed')}, data {r.get('data_seed')}")]
    wb = training.get("wandb") or {}
    if wb.get("id"):
        where = wb.get("url") or f"project `{wb.get('project')}`, group `{wb.get('group')}`"
        rows.append(("W&B training run", f"`{wb['id']}` ({where})"))
    body = "\n".join(f"| {k} | {v} |" for k, v in rows if v is not None)
    return "| field | value |\n|---|---|\n" + body


def _method(run: dict) -> str:
    p = run["policy"]
    if p == "original":
        return "Original (one token per step)"
    if p == "threshold":
        return f"Fast-dLLM threshold τ={run['threshold']:g}"
    if p == "entropy":
        return f"Entropy H={run['entropy_threshold']:g}"
    return f"**TDLM τ={run['threshold']:g}** (history {run.get('history')})"


def evaluation_text(runs: Sequence[dict]) -> str:
    """The card's table: this adapter's runs and the baselines evaluated beside them."""
    if not runs:
        return "No evaluation recorded yet (`python -m tdlm.hub card DIR --eval EVAL_DIR` adds one)."
    order = {"original": 0, "threshold": 1, "entropy": 2, "tdlm": 3}
    rows = []
    for r in sorted(runs, key=lambda r: (r["task"], order.get(r["policy"], 9), r.get("threshold") or 0.0)):
        acc = "–" if r.get("accuracy") is None else f"{100 * r['accuracy']:.2f}"
        sp = r.get("speedup_vs_original")
        rows.append(f"| {TASK_TITLES.get(r['task'], r['task'])} | {_method(r)} | {r.get('n')} | {acc} | "
                    f"{r['nfe_mean']:.2f} | {r['seconds_mean']:.3f} | {'–' if sp is None else f'{sp:.2f}×'} |")
    first = runs[0]
    head = (f"Greedy decoding, {first.get('gen_length')} response tokens in blocks of {first.get('block_size')}, "
            f"batch {first.get('batch_size')}, dtype {first.get('dtype') or 'checkpoint'}; seconds per request on "
            f"{', '.join(first.get('devices') or ['?'])}; speedup = seconds of `original` / seconds of the row.\n\n")
    return head + ("| task | method | n | accuracy (%) | NFE | seconds | speedup |\n|---|---|---|---|---|---|---|\n"
                   + "\n".join(rows))


def model_card(cfg: dict, runs: Sequence[dict] = (), repo_id: str | None = None):
    """A ``huggingface_hub.ModelCard`` for an adapter config (``tdlm_adapter.json`` contents) and its evaluation."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    bb = cfg.get("backbone") or {}
    backbone_id = bb.get("id") or "?"
    results = []
    for r in runs:
        if r["policy"] == "tdlm" and r["task"] in HUB_DATASETS and r.get("accuracy") is not None:
            ds, title, config, split = HUB_DATASETS[r["task"]]
            results.append(EvalResult(task_type="text-generation", dataset_type=ds, dataset_name=title,
                                      dataset_config=config, dataset_split=split, metric_type="accuracy",
                                      metric_value=round(100 * r["accuracy"], 2),
                                      metric_name=f"accuracy (TDLM τ={r['threshold']:g}, {r['nfe_mean']:.2f} NFE)",
                                      source_name="tdlm eval/run.py"))  # fmt: skip
    name = repo_id or f"tdlm-{backbone_id.rsplit('/', 1)[-1]}"
    data = ModelCardData(
        library_name=LIBRARY,
        base_model=backbone_id if "/" in backbone_id else None,  # Hub ids only (presets are not repositories)
        tags=["tdlm", "masked-diffusion", "temporal-self-conditioning", bb.get("family") or "diffusion-lm"],
        model_name=name if results else None,
        eval_results=results or None,
    )
    return ModelCard.from_template(
        data, template_str=TEMPLATE, title=f"TDLM adapter for {backbone_id}", repo_id=repo_id or "path/to/this/folder",
        backbone_id=backbone_id, family=bb.get("family"), backbone_layers=bb.get("num_layers"),
        hidden_size=bb.get("hidden_size"), fingerprint=bb.get("fingerprint") or "not recorded",
        n_layers=len(cfg.get("layers") or []), allocation=allocation_text(cfg), heads=cfg.get("heads"),
        head_dim=cfg.get("head_dim"), parameters=f"{cfg.get('num_parameters', 0):,}", history=cfg.get("history"),
        alignment=cfg.get("alignment", "input"), recipe=_recipe_text(cfg.get("training")),
        evaluation=evaluation_text(list(runs)),
    )


def write_card(adapter_dir: str | os.PathLike, runs: Sequence[dict] = (), repo_id: str | None = None) -> Path:
    """(Re)write ``README.md`` in an adapter folder from its ``tdlm_adapter.json`` and evaluation rows given as data
    (the one card writer: ``TDLM.save_pretrained`` passes none, ``tdlm.hub.write_model_card`` the rows it read)."""
    cfg_path = adapter_config_path(adapter_dir)
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise TDLMError(f"{cfg_path}: invalid JSON: {e}") from e
    out = Path(adapter_dir) / CARD
    model_card(cfg, runs, repo_id).save(str(out))
    return out
