"""The adapter's files on disk and on the Hub: names, the config-file lookup, the content id, the download.

Both sides of the format import this one module: the model (``TDLM.save_adapter`` / ``from_adapter``) and the Hub
layer (``tdlm.hub``: model card, upload). It sits below the model so the model never imports the Hub layer.

An adapter folder holds::

    tdlm_adapter.json     layers, heads x head_dim, history, alignment, the backbone it was trained on
    adapter.safetensors   the temporal weights (fp32)
    README.md             the model card (written by ``tdlm.hub``; optional)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tdlm.errors import TDLMError
from tdlm.models.fingerprints import sha256_file

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
