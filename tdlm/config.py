"""The one config system: typed dataclasses, YAML files that only set values, ``key=value`` overrides.

Unknown keys and wrong types are errors that name the file and the field (no ``kwargs.get``
fallbacks that swallow typos). Derived values are computed in Python, never in YAML.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tdlm.errors import TDLMError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert ``value`` against annotation ``tp`` (str, int, float, bool, None, list, unions)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except TDLMError as e:
                errors.append(str(e))
        raise TDLMError(f"{where}: expected {' or '.join(_type_name(a) for a in args)}; got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list | tuple):
            raise TDLMError(f"{where}: expected a list; got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise TDLMError(f"{where}: expected a mapping; got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TDLMError(f"{where}: expected true/false; got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TDLMError(f"{where}: expected an integer; got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads 3e-3 (no dot) as a string: accept numeric strings for float fields.
            try:
                number = float(value.strip())
            except ValueError:
                number = None
            if number is not None and math.isfinite(number):
                return number
        raise TDLMError(f"{where}: expected a number; got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise TDLMError(f"{where}: expected a string; got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TDLMError(f"{where}: expected a mapping of {tp.__name__} fields; got {value!r}")
        return from_dict(tp, value, where)
    raise TDLMError(f"{where}: unsupported field type {tp!r}")


def from_dict(cls: type[T], raw: dict, where: str = "config") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys and wrong types raise TDLMError."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise TDLMError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    values = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in raw.items()}
    return cls(**values)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _parse_scalar(text: str) -> Any:
    """``key=value`` values are YAML scalars: 3, 0.5, true, null, [1, 2], dispersed:8."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str], where: str = "override") -> dict:
    """Apply dotted ``section.key=value`` overrides to a raw mapping (validated later by from_dict)."""
    out = _deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise TDLMError(f"{where} {item!r}: expected key=value (e.g. train.max_steps=100)")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise TDLMError(f"{where} {item!r}: {p} is not a section")
        node[parts[-1]] = _parse_scalar(value)
    return out


def _deepcopy(d: dict) -> dict:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


def load_yaml(path: str | Path | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    if not p.exists():
        raise TDLMError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise TDLMError(f"{p}: invalid YAML: {e}") from e
    if not isinstance(data, dict):
        raise TDLMError(f"{p}: expected a mapping at the top level")
    return data


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """YAML file (optional) + overrides -> validated dataclass."""
    raw = apply_overrides(load_yaml(path), overrides or [])
    return from_dict(cls, raw, str(path) if path else "config")


def save_yaml(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def diff_settings(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable ``key: old -> new`` lines for every differing (nested) setting."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(diff_settings(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out
