"""Backbone construction and checkpoint I/O in the released folder format.

``load_backbone(name_or_path)`` accepts

* a preset name (``tiny-llada``, ``tiny-dream``): the real classes at toy size with seeded random
  weights, for tests and benches;
* a local folder holding ``config.json`` and ``model.safetensors`` or sharded ``*.safetensors`` with
  ``model.safetensors.index.json`` (the layout of the LLaDA / Dream releases);
* a Hub id (``GSAI-ML/LLaDA-8B-Instruct``) *only* if it is already in the local Hugging Face cache.
  Nothing is downloaded implicitly.

The model is built on the ``meta`` device and the safetensors tensors are assigned to it, so an 8B
backbone never exists twice in memory. The result is frozen and in eval mode.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tdlm.errors import TDLMError
from tdlm.models.common import Backbone
from tdlm.models.dream import Dream, DreamConfig
from tdlm.models.fingerprints import sha256_file, weight_fingerprint_files
from tdlm.models.llada import LLaDA, LLaDAConfig

log = logging.getLogger("tdlm.models")

# Toy sizes of the real architectures. Special ids match tdlm's local toy tokenizer layout
# (0 pad, 1 eos, 2 mask, ...); 4 layers so that dispersed/middle allocations differ.
PRESETS: dict[str, dict] = {
    "tiny-llada": {
        "family": "llada",
        "seed": 1234,
        "config": dict(
            d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden_size=176, vocab_size=128,
            embedding_size=128, rope_theta=10000.0, rms_norm_eps=1e-5, max_sequence_length=1024,
            mask_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32",
            tdlm_temporal_default={"layers": "dispersed:2", "heads": 2, "head_dim": 16},
        ),
    },
    "tiny-dream": {
        "family": "dream",
        "seed": 4321,
        "config": dict(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=176, vocab_size=128, rope_theta=10000.0, rms_norm_eps=1e-6,
            max_position_embeddings=1024, mask_token_id=2, eos_token_id=1, pad_token_id=0,
            torch_dtype="float32",
            tdlm_temporal_default={"layers": "middle:2", "heads": 2, "head_dim": 16},
        ),
    },
}

# Trained checkpoints shipped inside the package (release folder format), addressable by name.
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
SHIPPED = {"tiny-arith": ASSETS_DIR / "tiny-arith", "tiny-multi": ASSETS_DIR / "tiny-multi"}

_FAMILIES = {"llada": (LLaDA, LLaDAConfig), "dream": (Dream, DreamConfig)}
# float64 is for checks of exactness on CPU (tests compare two decode paths' decisions in it), not a serving dtype
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _family_of(raw: dict, source: str) -> str:
    mt = str(raw.get("model_type", "")).lower()
    archs = [a.lower() for a in raw.get("architectures", []) or []]
    if mt == "llada" or any("llada" in a for a in archs):
        return "llada"
    if mt == "dream" or any("dream" in a for a in archs):
        return "dream"
    raise TDLMError(
        f"{source}: model_type={raw.get('model_type')!r} is not a supported backbone "
        f"(expected 'llada' or 'Dream')"
    )


def build_backbone(family: str, config: dict, source: str = "config") -> Backbone:
    """Instantiate a backbone from a release-style config dict (weights uninitialised)."""
    cls, cfg_cls = _FAMILIES[family]
    return cls(cfg_cls.from_dict(config, source))


def init_weights(model: Backbone, seed: int) -> None:
    """The tiny backbones' seeded random init: norms at 1, every other weight N(0, 0.02) from one generator (the
    same weights on every machine for a seed; public for scripts/train_tiny_backbone.py, which starts from it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_f." in name or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def _resolve_dtype(dtype: torch.dtype | str | None, cfg_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or cfg_dtype or "float32"
    if name not in _DTYPES:
        raise TDLMError(f"dtype must be one of {sorted(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def _resolve_folder(name_or_path: str) -> Path:
    if name_or_path in SHIPPED:
        folder = SHIPPED[name_or_path]
        if not (folder / "config.json").exists():
            raise TDLMError(f"shipped backbone {name_or_path!r} is missing from {folder}; "
                            f"recreate it with `python scripts/train_tiny_backbone.py`")
        return folder
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise TDLMError(f"{name_or_path}: expected a checkpoint folder, found a file")
    # A Hub id is accepted only from the local cache: tdlm never downloads weights implicitly.
    if "/" in name_or_path and not name_or_path.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name_or_path, local_files_only=True))
        except Exception:
            pass
    hub_like = "/" in name_or_path and not name_or_path.startswith((".", "/"))
    fetch = (f"`hf download {name_or_path}` (into the HF cache) or `hf download {name_or_path} --local-dir <dir>`"
             if hub_like else "`hf download <repo> --local-dir <dir>` and pass the folder")
    raise TDLMError(
        f"unknown backbone {name_or_path!r}: expected a preset ({', '.join([*PRESETS, *SHIPPED])}), a local "
        f"checkpoint folder (config.json + *.safetensors), or a Hub id in the local Hugging Face cache; tdlm never "
        f"downloads: fetch it with {fetch}"
    )


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise TDLMError(f"{index}: not a valid safetensors index (needs a 'weight_map' object): {e}") from e
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise TDLMError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return shards
    raise TDLMError(
        f"{folder}: no weights found (expected model.safetensors, or *.safetensors shards with "
        f"model.safetensors.index.json)"
    )


def _folder_config(name_or_path: str) -> tuple[Path, dict, str, str]:
    """(folder, raw config.json, family, backbone id) of a checkpoint folder; weights must be present."""
    folder = _resolve_folder(name_or_path)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise TDLMError(f"{folder}: no config.json (expected a LLaDA or Dream checkpoint folder)")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise TDLMError(f"{cfg_path}: invalid JSON: {e}") from e
    family = _family_of(raw, str(cfg_path))
    _weight_files(folder)
    return folder, raw, family, str(raw.get("_name_or_path") or name_or_path)


def load_backbone(
    name_or_path: str,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
) -> Backbone:
    """Return a frozen backbone in eval mode (preset name, local folder, or locally cached Hub id)."""
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        model = build_backbone(preset["family"], preset["config"], name_or_path)
        init_weights(model, preset["seed"])
        model = model.to(device=device, dtype=_resolve_dtype(dtype, "float32"))
        model.backbone_id = name_or_path
        model.weight_fingerprint = f"preset:{name_or_path}"  # seeded: the name is the content
        return model.freeze()

    folder, raw, family, backbone_id = _folder_config(name_or_path)
    cfg_path = folder / "config.json"
    files = _weight_files(folder)
    target = _resolve_dtype(dtype, raw.get("torch_dtype"))
    if target != torch.float32 and torch.device(device).type == "cpu" and dtype is None:
        log.warning("%s: computing in %s (the checkpoint's torch_dtype) on CPU, which is several times slower "
                    "than float32 on CPUs without native %s support; pass dtype='float32' (--dtype float32) "
                    "to compute in fp32", folder, str(target).removeprefix("torch."),
                    str(target).removeprefix("torch."))  # fmt: skip
    with torch.device("meta"):
        model = build_backbone(family, raw, str(cfg_path))
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # safetensors reads "cuda" as cuda:0, not the current device
        dev = torch.device("cuda", torch.cuda.current_device())
    for f in files:
        with safe_open(str(f), framework="pt", device=str(dev)) as fh:
            for key in fh.keys():
                if key not in expected:
                    if key.endswith("rotary_emb.inv_freq"):
                        continue  # a derived buffer some exports include
                    raise TDLMError(f"{f}: unexpected tensor {key!r} for a {family} backbone")
                t = fh.get_tensor(key)
                if tuple(t.shape) != tuple(expected[key].shape):
                    raise TDLMError(
                        f"{f}: tensor {key!r} has shape {tuple(t.shape)}; config.json implies "
                        f"{tuple(expected[key].shape)}"
                    )
                state[key] = t.to(target)
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise TDLMError(f"{folder}: checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:5])}{more}")
    model.load_state_dict(state, assign=True)
    model.backbone_id = backbone_id
    model.weight_fingerprint = weight_fingerprint_files(files, set(expected))
    return model.to(device).freeze()


def _refuse_non_backbone(model: object, called: str) -> None:
    """A TDLM handed to a backbone writer would have every backbone shard written (16 GB at 8B) before its missing
    ``config_dict`` raised, leaving a half-written folder: refuse it, by its adapter method (``tdlm.models`` sits
    below ``tdlm.temporal`` and cannot import ``TDLM``), before any file exists."""
    if isinstance(model, Backbone):
        return
    if hasattr(model, "save_adapter"):
        raise TDLMError(f"{called} writes a backbone, not a TDLM adapter: call model.save_pretrained(dir) for the "
                        f"adapter and its card, or tdlm.save_backbone(model.backbone, dir) for the backbone")
    raise TDLMError(f"{called} writes a tdlm Backbone (tdlm.load_backbone), got {type(model).__name__}")


def save_backbone(
    model: Backbone, folder: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3, name: str | None = None
) -> Path:
    """Write ``config.json`` + safetensors shards + ``model.safetensors.index.json`` (release layout) of a backbone,
    which ``load_backbone(folder)`` reads; a TDLM is refused before anything is written (its adapter:
    ``TDLM.save_pretrained``)."""
    _refuse_non_backbone(model, "tdlm.save_backbone")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"  # not `name`: that is the backbone id below
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    cfg = model.config_dict()
    if name:
        cfg["_name_or_path"] = name  # the backbone id recorded in trajectories and adapters
    dtypes = {t.dtype for t in state.values()}
    cfg["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
        dtypes.pop() if len(dtypes) == 1 else torch.float32
    ]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def save_pretrained(
    model: Backbone, folder: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3, name: str | None = None
) -> Path:
    """Deprecated name of :func:`save_backbone`, kept so existing backbone scripts still run. Renamed because
    ``tdlm.save_pretrained`` read as the pair of ``TDLM.from_pretrained`` (an adapter); a TDLM is refused here
    before any file is written."""
    _refuse_non_backbone(model, "tdlm.save_pretrained (now tdlm.save_backbone)")
    warnings.warn("tdlm.save_pretrained is renamed tdlm.save_backbone (it writes a backbone); an adapter is written by "
                  "TDLM.save_pretrained", DeprecationWarning, stacklevel=2)
    return save_backbone(model, folder, max_shard_bytes, name)


def _key_index(files: list[Path]) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                index[key] = f
    return index


def load_backbone_partitioned(
    name_or_path: str, ds_config: dict, dtype: torch.dtype | str | None = None
) -> Backbone:
    """Build the backbone under ``deepspeed.zero.Init`` (ZeRO-3) so no rank ever holds all weights.

    Every parameter is created partitioned; its tensor is then gathered one at a time, written by
    rank 0 from the checkpoint (or the preset's seeded init) and re-partitioned on exit. Writing
    inside ``GatheredParameters(modifier_rank=0)`` is required: values set on the partitioned
    placeholder would be lost (see shared notes on zero.Init).
    """
    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        family, raw, backbone_id = preset["family"], preset["config"], name_or_path
        target = _resolve_dtype(dtype, "float32")
        full = load_backbone(name_or_path, dtype=target) if rank == 0 else None
        get = (lambda key: full.state_dict()[key]) if full is not None else None
    else:
        folder, raw, family, backbone_id = _folder_config(name_or_path)
        target = _resolve_dtype(dtype, raw.get("torch_dtype"))
        index = _key_index(_weight_files(folder))

        def get(key: str) -> torch.Tensor:
            if key not in index:
                raise TDLMError(f"{folder}: checkpoint lacks tensor {key!r}")
            with safe_open(str(index[key]), framework="pt") as fh:
                return fh.get_tensor(key)

    # dtype is left to the DS config (bf16.enabled): deepspeed 0.19's zero.Init ignores an explicit
    # float32 on accelerators without fp16 (CPU) and silently builds bf16 parameters.
    # mem_efficient_linear=False: its F.linear patch would persist process-wide.
    with deepspeed.zero.Init(config_dict_or_path=ds_config, mem_efficient_linear=False):
        model = build_backbone(family, raw, name_or_path)
    built = next(model.parameters()).dtype
    if built != target:
        raise TDLMError(f"ZeRO-3 builds {built} parameters from the DeepSpeed config but {target} was requested; "
                        f"set bf16.enabled in the DS config to match model.dtype")
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if rank == 0:
                t = get(name)
                if tuple(t.shape) != tuple(p.shape):
                    raise TDLMError(f"{name_or_path}: tensor {name!r} has shape {tuple(t.shape)}; "
                                    f"config implies {tuple(p.shape)}")
                p.data.copy_(t.to(p.dtype))
    model.backbone_id = backbone_id
    model.weight_fingerprint = weight_fingerprint_of(name_or_path, {n for n, _ in model.named_parameters()})
    return model.freeze()


def weight_fingerprint_of(name_or_path: str, names: set[str] | None = None) -> str:
    """The weight fingerprint a loaded backbone carries (what an adapter records as ``backbone.fingerprint``), read
    from the files without loading them: the preset's name, or a slice of every tensor (``names``: the parameters;
    None = those of the backbone's structure)."""
    if name_or_path in PRESETS:
        return f"preset:{name_or_path}"
    if names is None:
        names = {n for n, _ in load_backbone_meta(name_or_path).named_parameters()}
    return weight_fingerprint_files(_weight_files(_resolve_folder(name_or_path)), names)


def load_backbone_meta(name_or_path: str) -> Backbone:
    """The backbone's structure on the ``meta`` device (no weights): for checks before a launch."""
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        family, raw, backbone_id = preset["family"], preset["config"], name_or_path
    else:
        _, raw, family, backbone_id = _folder_config(name_or_path)
    with torch.device("meta"):
        model = build_backbone(family, raw, name_or_path)
    model.backbone_id = backbone_id
    return model.freeze()


def random_backbone(family: str, config: dict, seed: int = 0, backbone_id: str = "random") -> Backbone:
    """A frozen backbone of the real class at any size with seeded random weights (benches, probes)."""
    model = build_backbone(family, config, backbone_id)
    init_weights(model, seed)
    model.backbone_id = backbone_id
    return model.freeze()


# -- the Hugging Face Hub: one quick look, never a retry loop -------------------------------------------
HUB_PROBE_TIMEOUT_S = 3.0
_TRUE = ("1", "true", "yes", "on")


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (``HF_HUB_OFFLINE`` set, or one TCP connect to
    ``HF_ENDPOINT`` failing within ``timeout``), or None when it answers. Behind a proxy nothing is probed (None).

    Without this, a command run with no network sat through huggingface_hub's retries (about 20 lines) and then
    reported the prompt dataset, not the backbone that was missing.
    """
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"{host}:{port} is unreachable ({e.strerror or type(e).__name__})"
    return None


def hub_offline() -> None:
    """From now on this process's Hugging Face libraries read their local cache only: a missing file is an
    immediate error, not a retry loop (``HF_HUB_OFFLINE``; the libraries read it at import, so their flags too)."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
    if "datasets.config" in sys.modules:
        cfg = sys.modules["datasets.config"]
        cfg.HF_HUB_OFFLINE = True
        cfg.HF_DATASETS_OFFLINE = True


def check_backbone_available(name_or_path: str) -> None:
    """The backbone resolves on this machine - a preset, a shipped name, a checkpoint folder with config.json and
    its weight files, or a Hub id already in the local cache - without reading any weights; else TDLMError naming
    it (tdlm never downloads)."""
    load_backbone_meta(name_or_path)


def backbone_fingerprint(name_or_path: str) -> str:
    """The preset name, or sha256 over config.json + weight file names/sizes.

    Hashing multi-GB weights would cost minutes per resume; config + shard sizes catch a different
    checkpoint in practice. Raises TDLMError if the checkpoint is not visible on this machine.
    """
    if name_or_path in PRESETS:
        return f"preset:{name_or_path}"
    folder = _resolve_folder(name_or_path)
    cfg = folder / "config.json"
    if not cfg.exists():
        raise TDLMError(f"{folder}: no config.json (expected a LLaDA or Dream checkpoint folder)")
    h = sha256_file(cfg)
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"sha256:{h.hexdigest()}"
