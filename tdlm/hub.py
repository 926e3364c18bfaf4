"""Adapters on the Hugging Face Hub: ``TDLM.from_pretrained`` / ``save_pretrained`` / ``push_to_hub`` and model cards.

A TDLM adapter repository holds the adapter's two files and a model card::

    tdlm_adapter.json     layers, heads x head_dim, history, alignment, the backbone it was trained on (id, family,
                          weight fingerprint) and the training record (recipe, teacher, run folder, W&B run)
    adapter.safetensors   the temporal weights (fp32)
    README.md             generated card: backbone, allocation, history, recipe, the evaluation table when one exists

It is deliberately *not* a PEFT adapter (PEFT's ``adapter_config.json`` name is only read, for folders written before
the rename). Everything goes through ``huggingface_hub``: ``snapshot_download`` (which honours ``HF_HUB_OFFLINE`` and
the local cache), ``HfApi.create_repo`` + ``HfApi.upload_folder``, ``ModelCard`` / ``ModelCardData`` (``model-index``
results for the benchmarks that live on the Hub). The backbone is never downloaded here (``tdlm.load_backbone``).

Commands::

    python -m tdlm.hub card runs/x/train/adapter --eval runs/x/eval        # (re)write README.md in the folder
    python -m tdlm.hub push runs/x/train/adapter me/tdlm-llada-16d --eval runs/x/eval [--private]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tdlm.errors import TDLMError

if TYPE_CHECKING:
    from tdlm.model import TDLM
    from tdlm.models.common import Backbone

CARD = "README.md"
LIBRARY = "tdlm"
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


def _weights_sha(adapter_dir: str | os.PathLike) -> str | None:
    from tdlm.model import ADAPTER_WEIGHTS

    p = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not p.exists():
        return None
    return hashlib.sha256(p.read_bytes()).hexdigest()


def evaluation_runs(adapter_dir: str | os.PathLike, evaluations: Sequence[str | os.PathLike]) -> list[dict]:
    """Runs of ``evaluations`` (eval output dirs / summary files) that decoded *these* weights, plus the baselines
    (original, threshold, entropy) on the same backbone, task, budget and block size; speedups over the union."""
    from tdlm.evaluation.metrics import comparison_key, compute_speedups
    from tdlm.evaluation.report import load_runs

    runs = compute_speedups(load_runs(list(evaluations)))
    mine_sha = _weights_sha(adapter_dir)
    same = Path(adapter_dir).resolve()
    mine = [r for r in runs if r["policy"] == "tdlm" and r.get("adapter")
            and (Path(r["adapter"]).resolve() == same or _weights_sha(r["adapter"]) == mine_sha)]  # fmt: skip
    keys = {comparison_key(r) for r in mine}
    base = [r for r in runs if r["policy"] != "tdlm" and comparison_key(r) in keys]
    return base + mine


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


def write_model_card(adapter_dir: str | os.PathLike, evaluations: Sequence[str | os.PathLike] = (),
                     repo_id: str | None = None) -> Path:
    """(Re)write ``README.md`` in an adapter folder from its config and the evaluations that decoded it."""
    from tdlm.model import adapter_config_path

    cfg_path = adapter_config_path(adapter_dir)
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise TDLMError(f"{cfg_path}: invalid JSON: {e}") from e
    runs = evaluation_runs(adapter_dir, evaluations) if evaluations else []
    out = Path(adapter_dir) / CARD
    model_card(cfg, runs, repo_id).save(str(out))
    return out


# -- save / load -----------------------------------------------------------------------------------
def save_pretrained(model: TDLM, directory: str | os.PathLike, evaluations: Sequence[str | os.PathLike] = (),
                    repo_id: str | None = None) -> Path:
    """The adapter files plus the model card (with the evaluation table when ``evaluations`` decoded it)."""
    out = model.save_adapter(directory)
    write_model_card(out, evaluations, repo_id)
    return out


def is_local(source: str | os.PathLike) -> bool:
    return Path(source).expanduser().is_dir()


def resolve(source: str | os.PathLike, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
            token: str | bool | None = None, local_files_only: bool | None = None) -> Path:
    """A local adapter folder as is; a Hub repo id -> its snapshot (``snapshot_download``: the local cache when
    ``HF_HUB_OFFLINE`` is set or ``local_files_only``, else the Hub)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    from tdlm.model import ADAPTER_CONFIG, ADAPTER_CONFIG_LEGACY, ADAPTER_WEIGHTS

    if is_local(source):
        return Path(source).expanduser()
    text = str(source)
    try:
        validate_repo_id(text)
    except Exception:
        raise TDLMError(f"adapter {text!r}: not a folder, and not a Hub repo id (expected a folder written by "
                        f"save_pretrained, or owner/name)") from None
    try:
        path = snapshot_download(text, revision=revision, cache_dir=cache_dir, token=token,
                                 local_files_only=bool(local_files_only), library_name=LIBRARY,
                                 allow_patterns=[ADAPTER_CONFIG, ADAPTER_CONFIG_LEGACY, ADAPTER_WEIGHTS, CARD])
    except LocalEntryNotFoundError:
        raise TDLMError(f"adapter {text!r}: not a local folder and not in the Hugging Face cache (offline: "
                        f"HF_HUB_OFFLINE or local_files_only); fetch it with `hf download {text}` while online"
                        ) from None  # fmt: skip
    except RepositoryNotFoundError:
        raise TDLMError(f"adapter {text!r}: no such Hub repository (or it is private: pass token=...)") from None
    except HfHubHTTPError as e:
        raise TDLMError(f"adapter {text!r}: Hub error: {str(e).splitlines()[0]}") from None
    return Path(path)


def from_pretrained(backbone: Backbone | str, source: str | os.PathLike, history: str | None = None,
                    allow_other_backbone: bool = False, revision: str | None = None,
                    cache_dir: str | os.PathLike | None = None, token: str | bool | None = None,
                    local_files_only: bool | None = None, dtype=None, device="cpu", cls=None) -> TDLM:
    """Attach the adapter at ``source`` (folder or Hub repo id) to ``backbone`` (a Backbone, or a name / folder /
    cached Hub id for :func:`tdlm.load_backbone`). The backbone check of ``TDLM.from_adapter`` applies."""
    from tdlm.model import TDLM
    from tdlm.models.loading import load_backbone

    folder = resolve(source, revision, cache_dir, token, local_files_only)
    bb = load_backbone(backbone, dtype=dtype, device=device) if isinstance(backbone, str) else backbone
    model = (cls or TDLM).from_adapter(bb, folder, history=history, allow_other_backbone=allow_other_backbone)
    return model.to(next(bb.parameters()).device).eval()


# -- push ------------------------------------------------------------------------------------------
def upload_adapter_folder(folder: str | os.PathLike, repo_id: str, private: bool | None = None,
                          token: str | bool | None = None, commit_message: str | None = None,
                          revision: str | None = None, create_pr: bool = False):
    """``HfApi.create_repo`` (exist_ok) then ``HfApi.upload_folder`` of the adapter files and the card only."""
    from huggingface_hub import HfApi

    from tdlm.model import ADAPTER_CONFIG, ADAPTER_CONFIG_LEGACY, ADAPTER_WEIGHTS, adapter_config_path

    folder = Path(folder)
    cfg_path = adapter_config_path(folder)
    if not (folder / ADAPTER_WEIGHTS).exists():
        raise TDLMError(f"{folder}: missing {ADAPTER_WEIGHTS} (expected a folder written by TDLM.save_pretrained)")
    if cfg_path.name == ADAPTER_CONFIG_LEGACY:
        raise TDLMError(f"{folder}: written before the rename ({ADAPTER_CONFIG_LEGACY}, PEFT's name); load and "
                        f"save_pretrained it first so the Hub sees {ADAPTER_CONFIG}")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                             commit_message=commit_message or "Upload TDLM adapter", create_pr=create_pr,
                             allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD])  # fmt: skip


def push_to_hub(model: TDLM, repo_id: str, evaluations: Sequence[str | os.PathLike] = (),
                private: bool | None = None, token: str | bool | None = None, commit_message: str | None = None,
                revision: str | None = None, create_pr: bool = False):
    """``save_pretrained`` into a temporary folder (card included), then upload it; returns the ``CommitInfo``."""
    with tempfile.TemporaryDirectory(prefix="tdlm-push-") as tmp:
        folder = save_pretrained(model, tmp, evaluations, repo_id)
        return upload_adapter_folder(folder, repo_id, private, token, commit_message, revision, create_pr)


# -- command line ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tdlm.hub", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("card", help="write README.md (the model card) into an adapter folder")
    c.add_argument("adapter", help="adapter folder (runs/<run>/adapter, or one written by save_pretrained)")
    c.add_argument("--eval", nargs="+", default=[], metavar="DIR",
                   help="evaluation output dirs (eval/run.py) whose runs decoded this adapter: the card's table")
    c.add_argument("--repo-id", help="the Hub repository the card will live in (shown in the usage snippet)")
    p = sub.add_parser("push", help="write the card, then upload the adapter files and the card to a Hub repository")
    p.add_argument("adapter", help="adapter folder")
    p.add_argument("repo_id", help="owner/name on the Hub (created if missing)")
    p.add_argument("--eval", nargs="+", default=[], metavar="DIR", help="evaluation output dirs for the card's table")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", help="branch to push to (default: main)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--message", help="commit message")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "card":
            print(write_model_card(args.adapter, args.eval, args.repo_id))
            return 0
        write_model_card(args.adapter, args.eval, args.repo_id)
        info = upload_adapter_folder(args.adapter, args.repo_id, private=args.private or None,
                                     commit_message=args.message, revision=args.revision, create_pr=args.create_pr)
        print(getattr(info, "commit_url", None) or info)
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
