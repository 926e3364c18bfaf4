"""Content ids of backbones and adapters, recorded by generation and evaluation runs so that a
resumed run never mixes outputs of different weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tdlm.errors import TDLMError


def sha256_file(path: Path, h: hashlib._Hash | None = None) -> hashlib._Hash:
    h = h or hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h


def check_listed_files(root: Path, listed: dict[str, str], present: set[str], listing: str, added: str,
                       changed: str) -> None:
    """Files named in a checksum list (relative name -> sha256) against the files ``present``: none added,
    none missing, none changed; each refusal is one TDLMError naming the file (``added`` / ``changed``
    say what to do)."""
    extra = sorted(present - set(listed))
    if extra:
        raise TDLMError(f"{root / extra[0]}: not listed in {listing} ({len(extra)} unlisted file(s)); {added}")
    for name, sha in sorted(listed.items()):
        path = root / name
        if not path.exists():
            raise TDLMError(f"{path}: listed in {listing} but missing")
        if sha256_file(path).hexdigest() != sha:
            raise TDLMError(f"{path}: sha256 differs from {listing} (the file changed after it was written); {changed}")


# -- weight fingerprints (adapter <-> backbone identity) ------------------------------------------
WEIGHT_FP_VERSION = "w1"


def _sample(t) -> bytes:
    """The first row of a >= 2-D tensor, the first 64 values of a 1-D one, as float32 bytes."""
    import torch

    t = t.detach()
    part = t[0] if t.dim() >= 2 else t[:64]
    return part.to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()


def _weights_digest(items) -> str:
    h = hashlib.sha256(WEIGHT_FP_VERSION.encode())
    for name, shape, sample in items:
        h.update(f"{name}:{list(shape)}:".encode())
        h.update(sample)
    return f"{WEIGHT_FP_VERSION}:{h.hexdigest()}"


def weight_fingerprint_files(files: list[Path], keys: set[str]) -> str:
    """Fingerprint of a checkpoint's weights read from its safetensors files (a slice of each tensor).

    Two checkpoints of one architecture (LLaDA-8B Base vs Instruct) share config and file sizes; the first
    row of every tensor tells them apart, and reading it costs no full load.
    """
    from safetensors import safe_open

    items = []
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key not in keys:
                    continue
                sl = fh.get_slice(key)
                shape = tuple(sl.get_shape())
                items.append((key, shape, _sample(sl[0:1] if len(shape) >= 2 else sl[0:64])))
    return _weights_digest(sorted(items))


def weight_fingerprint_module(module) -> str:
    """The same fingerprint computed from a module's (unpartitioned) parameters."""
    items = [(name, tuple(p.shape), _sample(p)) for name, p in module.state_dict().items()]
    return _weights_digest(sorted(items))
