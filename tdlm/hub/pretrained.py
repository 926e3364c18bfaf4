"""Adapters on the Hugging Face Hub: ``save_pretrained`` / ``push_to_hub`` with a model card and its evaluation
table, and the ``card`` / ``push`` commands (``TDLM.from_pretrained`` reads them: :mod:`tdlm.temporal.adapter_files`).

``TDLM.save_pretrained(dir)`` writes the same folder without an evaluation table (the model never imports this layer,
which reads evaluation results); ``save_pretrained`` here is that method plus the table. Both write the card with
:func:`tdlm.temporal.card.write_card`. (``tdlm.save_backbone`` writes a *backbone*, never an adapter.)

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
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tdlm.errors import TDLMError
from tdlm.temporal.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_CONFIG_LEGACY,
    ADAPTER_WEIGHTS,
    CARD,
    adapter_config_path,
)
from tdlm.temporal.card import write_card

if TYPE_CHECKING:
    from tdlm.temporal.model import TDLM

def _weights_sha(adapter_dir: str | os.PathLike) -> str | None:
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


def write_model_card(adapter_dir: str | os.PathLike, evaluations: Sequence[str | os.PathLike] = (),
                     repo_id: str | None = None) -> Path:
    """(Re)write ``README.md`` in an adapter folder from its config and the evaluations that decoded it."""
    adapter_config_path(adapter_dir)  # a folder without a config is refused before any evaluation is read
    return write_card(adapter_dir, evaluation_runs(adapter_dir, evaluations) if evaluations else [], repo_id)


# -- save / load -----------------------------------------------------------------------------------
def save_pretrained(model: TDLM, directory: str | os.PathLike, evaluations: Sequence[str | os.PathLike] = (),
                    repo_id: str | None = None) -> Path:
    """``model.save_pretrained`` (the adapter files and the card), then the card again with the evaluation table
    when ``evaluations`` decoded these weights: the rows are matched against the written weights, so they exist
    only after the files do."""
    out = model.save_pretrained(directory, repo_id=repo_id)
    if evaluations:
        write_model_card(out, evaluations, repo_id)
    return out


# -- push ------------------------------------------------------------------------------------------
def upload_adapter_folder(folder: str | os.PathLike, repo_id: str, private: bool | None = None,
                          token: str | bool | None = None, commit_message: str | None = None,
                          revision: str | None = None, create_pr: bool = False):
    """``HfApi.create_repo`` (exist_ok) then ``HfApi.upload_folder`` of the adapter files and the card only."""
    from huggingface_hub import HfApi


    folder = Path(folder)
    cfg_path = adapter_config_path(folder)
    if not (folder / ADAPTER_WEIGHTS).exists():
        raise TDLMError(f"{folder}: missing {ADAPTER_WEIGHTS} (expected a folder written by tdlm.hub.save_pretrained)")
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
