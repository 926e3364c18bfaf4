"""The adapter's files on disk and on the Hub: names, the config-file lookup, the content id, the download, and
reading and writing an adapter folder (``TDLM.adapter_config`` / ``save_adapter`` / ``from_adapter`` delegate here).

Both sides of the format import this one module: the model (``TDLM.save_adapter`` / ``from_adapter``) and the Hub
layer (``tdlm.hub``: model card, upload). It sits below the model so the model never imports the Hub layer. Its
module-level imports stay light (no torch): the evaluation and generation configs import the names and the content
id before any model is built.

An adapter folder holds::

    tdlm_adapter.json     layers, heads x head_dim, history, alignment, the backbone it was trained on
    adapter.safetensors   the temporal weights (fp32)
    README.md             the model card (written by ``tdlm.hub``; optional)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tdlm.errors import TDLMError
from tdlm.models.fingerprints import sha256_file

if TYPE_CHECKING:
    import torch
    from torch import nn

    from tdlm.models.common import Backbone
    from tdlm.temporal.history import HistoryPolicy

ADAPTER_FORMAT_VERSION = 1
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "tdlm_adapter.json"
# Adapters written before the rename used PEFT's file name (Hub tooling took them for PEFT adapters); they still
# load, and nothing writes that name any more.
ADAPTER_CONFIG_LEGACY = "adapter_config.json"
CARD = "README.md"
LIBRARY = "tdlm"


def adapter_config_path(directory: str | os.PathLike) -> Path:
    """The adapter's config file: ``tdlm_adapter.json``, or PEFT's name ``adapter_config.json`` in folders written
    before the rename (a real PEFT adapter there is refused by name)."""
    d = Path(directory)
    if (d / ADAPTER_CONFIG).exists():
        return d / ADAPTER_CONFIG
    legacy = d / ADAPTER_CONFIG_LEGACY
    if legacy.exists():
        try:
            raw = json.loads(legacy.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return legacy  # the reader reports the invalid JSON, naming the file
        if isinstance(raw, dict) and "peft_type" in raw:
            raise TDLMError(f"{legacy}: a PEFT adapter (peft_type={raw['peft_type']!r}), not a TDLM adapter "
                            f"(expected {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS} written by TDLM.save_adapter)")
        return legacy
    raise TDLMError(f"{d}: missing {ADAPTER_CONFIG} (expected a folder written by TDLM.save_adapter)")



def read_config(path: Path) -> dict:
    """An adapter's config file as a dict, or one line naming the file (not JSON, not UTF-8, not an object)."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TDLMError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise TDLMError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def trained_history(directory: str | os.PathLike) -> str:
    """The history an adapter folder was trained with (its config's ``history``; ``full`` where the file has none),
    read without loading a weight: the history a decode of the adapter with ``history=None`` uses."""
    raw = read_config(adapter_config_path(directory))
    return str(raw.get("history") or "full")


def adapter_fingerprint(directory: str) -> str:
    """sha256 over the adapter's two files (small: the temporal weights only)."""
    h = hashlib.sha256()
    for p in (adapter_config_path(directory), Path(directory) / ADAPTER_WEIGHTS):  # config: either file name
        if not p.exists():
            raise TDLMError(f"{directory}: missing {p.name} (expected a folder written by TDLM.save_adapter)")
        sha256_file(p, h)
    return f"sha256:{h.hexdigest()}"


def is_local(source: str | os.PathLike) -> bool:
    return Path(source).expanduser().is_dir()


def resolve_adapter(source: str | os.PathLike, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
            token: str | bool | None = None, local_files_only: bool | None = None) -> Path:
    """A local adapter folder as is; a Hub repo id -> its snapshot (``snapshot_download``: the local cache when
    ``HF_HUB_OFFLINE`` is set or ``local_files_only``, else the Hub)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

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


# -- reading and writing an adapter (TDLM.adapter_config / save_adapter / from_adapter delegate here) --------------
def adapter_config(model: nn.Module) -> dict:
    """The ``tdlm_adapter.json`` record of a TDLM ``model``: its temporal layout, history, alignment and the backbone
    it is attached to (family, shape, weight fingerprint)."""
    from tdlm.temporal.perceiver import NORM_EPS, SOFTCAP

    bb, cfg = model.backbone, model.config
    return {
        "format_version": ADAPTER_FORMAT_VERSION,
        "backbone": {
            "id": bb.backbone_id,
            "family": bb.family,
            "hidden_size": bb.hidden_size,
            "num_layers": bb.num_layers,
            "vocab_size": bb.vocab_size,
            "fingerprint": backbone_identity(bb),
        },
        "layers": list(model.layer_ids),
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "history": str(model.policy),
        "rope_base": cfg.rope_base,
        "alignment": cfg.alignment,
        "num_parameters": model.num_temporal_parameters(),
        **({"perceiver": {"num_latents": model.num_latents, "heads": cfg.perceiver_heads,
                          "head_dim": cfg.perceiver_head_dim, "norm_eps": NORM_EPS, "softcap": SOFTCAP}}
           if model.num_latents else {}),  # fmt: skip
        # the run that trained it (recipe, teacher, run folder, W&B run), kept through load and save
        **({"training": model.training_record} if getattr(model, "training_record", None) else {}),
    }


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The temporal weights of a TDLM ``model`` (nothing of the frozen backbone), on the CPU."""
    return {f"temporal.{k}": v.detach().cpu().contiguous() for k, v in model.temporal.state_dict().items()}


def save_adapter(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``adapter.safetensors`` + ``tdlm_adapter.json`` of a TDLM ``model`` (no backbone weights)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(model), indent=2) + "\n")
    return out


@dataclass
class AdapterFiles:
    """A checked adapter folder (:func:`read_adapter`): the TemporalConfig fields to build the model with, the
    training record, and where the weights are."""

    config: dict
    training: dict | None
    config_path: Path
    weights_path: Path


def read_adapter(backbone: Backbone, directory: str | os.PathLike, history: str | None = None,
                 allow_other_backbone: bool = False) -> AdapterFiles:  # fmt: skip
    """Read and check an adapter folder against ``backbone`` before any tensor is loaded: format version, backbone
    shape, the backbone it was trained on (refused unless ``allow_other_backbone``), perceiver constants, and the
    ``history`` requested against the one trained."""
    from tdlm.temporal.history import HistoryPolicy
    from tdlm.temporal.perceiver import NORM_EPS, SOFTCAP

    d = Path(directory)
    cfg_path, w_path = adapter_config_path(d), d / ADAPTER_WEIGHTS
    if not w_path.exists():
        raise TDLMError(f"{d}: missing {w_path.name} (expected a folder written by TDLM.save_adapter)")
    raw = read_config(cfg_path)
    if raw.get("format_version") != ADAPTER_FORMAT_VERSION:
        raise TDLMError(
            f"{cfg_path}: format_version={raw.get('format_version')!r}; this tdlm reads version "
            f"{ADAPTER_FORMAT_VERSION}"
        )
    bb = raw.get("backbone", {})
    for field, have in (("hidden_size", backbone.hidden_size), ("num_layers", backbone.num_layers)):
        if bb.get(field) != have:
            raise TDLMError(
                f"{cfg_path}: adapter was trained for backbone.{field}={bb.get(field)} "
                f"({bb.get('id')}); this backbone has {field}={have} ({backbone.backbone_id})"
            )
    if not allow_other_backbone:
        have = {"family": backbone.family, "vocab_size": backbone.vocab_size,
                "fingerprint": backbone_identity(backbone)}
        differ = [f"{k}={bb[k]!r} (this backbone: {v!r})" for k, v in have.items()
                  if bb.get(k) is not None and v is not None and bb[k] != v]
        if differ:
            raise TDLMError(
                f"{cfg_path}: adapter was trained on backbone {bb.get('id')!r}, not this one "
                f"({backbone.backbone_id!r}): {'; '.join(differ)}; attach it anyway with "
                f"allow_other_backbone=True (--allow-other-backbone)"
            )
    trained = HistoryPolicy.parse(raw.get("history", "full"))
    perceiver = raw.get("perceiver") or {}
    if trained.recurrent != bool(perceiver) or perceiver.get("num_latents", 0) != trained.num_latents:
        raise TDLMError(
            f"{cfg_path}: history={str(trained)!r} and perceiver={raw.get('perceiver')!r} disagree "
            f"(latent:M needs perceiver.num_latents = M; other policies have no perceiver)"
        )
    for key, have in (("norm_eps", NORM_EPS), ("softcap", SOFTCAP)):
        if key in perceiver and perceiver[key] != have:
            raise TDLMError(f"{cfg_path}: perceiver.{key}={perceiver[key]!r}; this tdlm implements {have}")
    requested = HistoryPolicy.parse(history) if history else trained
    check_history_switch(trained, trained.num_latents, requested, where=f"{d}: ")
    config = {
        "layers": list(raw["layers"]),
        "heads": int(raw["heads"]),
        "head_dim": int(raw["head_dim"]),
        "history": str(requested),
        "rope_base": float(raw.get("rope_base", 10000.0)),
        # Adapters written before the field existed were trained input-aligned.
        "alignment": str(raw.get("alignment", "input")),
        "perceiver_heads": int(perceiver["heads"]) if perceiver else None,
        "perceiver_head_dim": int(perceiver["head_dim"]) if perceiver else None,
    }
    return AdapterFiles(config, raw.get("training"), cfg_path, w_path)


def load_adapter_weights(model: nn.Module, files: AdapterFiles) -> None:
    """Load the checked folder's temporal weights into a TDLM ``model`` built from ``files.config``; names and
    shapes must match what the model expects."""
    from safetensors.torch import load_file

    from tdlm.temporal.attention import fuse_qkv_keys

    state = fuse_qkv_keys(load_file(str(files.weights_path)))  # adapters written before the fused W_QKV
    expected = adapter_state_dict(model)
    w_path, cfg = files.weights_path, model.config
    if set(state) != set(expected):
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise TDLMError(f"{w_path}: tensors do not match {files.config_path.name} (missing {missing}, extra {extra})")
    for k, t in state.items():
        if t.shape != expected[k].shape:
            raise TDLMError(
                f"{w_path}: tensor {k} has shape {tuple(t.shape)} but heads={cfg.heads} x "
                f"head_dim={cfg.head_dim} on hidden_size={model.backbone.hidden_size} needs "
                f"{tuple(expected[k].shape)}"
            )
    model.temporal.load_state_dict({k.removeprefix("temporal."): v for k, v in state.items()})
    model.training_record = files.training


def backbone_identity(backbone: Backbone) -> str | None:
    """The backbone's weight fingerprint (set by the loaders; computed for a backbone built in code)."""
    if backbone.weight_fingerprint is not None:
        return backbone.weight_fingerprint
    params = list(backbone.parameters())
    if not params or any(p.is_meta or p.numel() == 0 for p in params):  # meta or ZeRO-3 partitioned
        return None
    from tdlm.models.fingerprints import weight_fingerprint_module

    return weight_fingerprint_module(backbone)


def check_history_switch(current: HistoryPolicy, num_latents: int, new: HistoryPolicy, where: str = "") -> None:
    """Refuse history changes the temporal weights were not built for (latent <-> entries, other M)."""
    if new.recurrent and num_latents == 0:
        raise TDLMError(
            f"{where}history {str(new)!r} needs perceiver weights, but this adapter was built with history "
            f"{str(current)!r}; build TDLM with TemporalConfig(history={str(new)!r}) and train it"
        )
    if new.recurrent and new.num_latents != num_latents:
        raise TDLMError(
            f"{where}this adapter has {num_latents} learned latents per layer; history {str(new)!r} needs "
            f"{new.num_latents}"
        )
    if not new.recurrent and num_latents:
        raise TDLMError(
            f"{where}this adapter was trained with history 'latent:{num_latents}' (its keys read latents); "
            f"history {str(new)!r} would feed them raw entries"
        )
