"""The one config system: typed dataclasses, YAML files that only set values, ``key=value`` overrides.

Unknown keys and wrong types are errors that name the file and the field (no ``kwargs.get``
fallbacks that swallow typos). Derived values are computed in Python, never in YAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tdlm.errors import TDLMError

T = TypeVar("T")


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true/false", type(None): "null"}


def _type_name(tp: Any) -> str:
    if tp in _TYPE_WORDS:
        return _TYPE_WORDS[tp]
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _at(where: str, path: str) -> str:
    """``file: section.key`` (or just the file / argument list when the problem is at the top)."""
    return f"{where}: {path}" if path else where


class FieldError(TDLMError):
    """A bad key or value at ``path`` (``section.key``) of the mapping read from ``where``; ``keys`` lists the
    unknown keys' full paths. :func:`from_dict` re-raises it naming the override that set the value, if one did."""

    def __init__(self, where: str, path: str, detail: str, keys: list[str] | None = None) -> None:
        self.where, self.path, self.detail, self.keys = where, path, detail, keys or []
        super().__init__(f"{_at(where, path)}: {detail}")


def _coerce(value: Any, tp: Any, where: str, path: str = "") -> Any:
    """Check/convert ``value`` against annotation ``tp`` (str, int, float, bool, None, list, unions); errors are
    ``<where>: <path>: expected ...`` with ``path`` the dotted key inside ``where`` (a file, --model_args ...)."""
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
                return _coerce(value, a, where, path)
            except TDLMError as e:
                errors.append(str(e))
        raise FieldError(where, path, f"expected {' or '.join(_type_name(a) for a in args)}; got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list | tuple):
            raise FieldError(where, path, f"expected a list; got {value!r}")
        return [_coerce(v, item, where, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise FieldError(where, path, f"expected a mapping; got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise FieldError(where, path, f"expected true/false; got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise FieldError(where, path, f"expected an integer; got {value!r}")
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
        raise FieldError(where, path, f"expected a number; got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise FieldError(where, path, f"expected a string; got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise FieldError(where, path, f"expected a mapping of {tp.__name__} fields; got {value!r}")
        return from_dict(tp, value, where, path)
    raise FieldError(where, path, f"unsupported field type {tp!r}")


def from_dict(cls: type[T], raw: dict, where: str = "config", path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys and wrong types raise TDLMError naming
    ``<where>: <section.key>`` (``where`` = the file or the argument list; ``path`` = where ``raw`` sits in it).

    A value that an override set (``raw`` from :func:`apply_overrides`) is blamed on that override, not the file."""
    try:
        return _from_dict(cls, raw, where, path)
    except FieldError as e:
        found = _origin(getattr(raw, "origins", {}), e.keys or [e.path])
        if found is None:
            raise
        label, key = found
        detail = e.detail if e.keys or e.path == key else f"{e.path}: {e.detail}"
        raise TDLMError(f"{label}: {detail}") from None


def _from_dict(cls: type[T], raw: dict, where: str, path: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    prefix = f"{path}." if path else ""
    unknown = sorted(set(raw) - set(fields))
    moved = [(k, s) for k in unknown for s in _sections(cls, hints) if k in _field_names(hints[s])]
    if moved:  # a flat key of an older config that now lives in a section (decode.gen_length)
        key, section = moved[0]
        raise FieldError(where, prefix + key, f"moved into the {section}: section; write it as {prefix}{section}: "
                         f"{{{key}: {raw[key]!r}}} (or the override {prefix}{section}.{key}=...)", [prefix + key])
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(fields), n=1, cutoff=0.5)
        hint = f"; did you mean {prefix + near[0]!r}?" if near else ""
        inside = f" in {path}" if path else ""
        keys = [prefix + k for k in unknown]
        raise FieldError(where, "", f"unknown key(s) {keys}; allowed{inside}: {sorted(fields)}{hint}", keys)
    values = {}
    for k, v in raw.items():
        default = fields[k].default_factory  # type: ignore[misc]
        if k in _sections(cls, hints) and isinstance(v, dict) and default is not dataclasses.MISSING:
            # A section's keys fill in its default object, so a job's own default (generation's batch of 1408 in
            # its decode section) survives a YAML section that sets only other keys.
            obj = default()
            v = {**{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, **v}
        values[k] = _coerce(v, hints[k], where, prefix + k)
    return cls(**values)


def _sections(cls: type, hints: dict) -> list[str]:
    """The fields of ``cls`` that are dataclasses themselves (nested sections such as ``decode``)."""
    return [f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]  # type: ignore[arg-type]


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def _origin(origins: dict[str, str], paths: list[str]) -> tuple[str, str] | None:
    """(label, key) of the override that set one of ``paths`` or a section above it."""
    for p in paths:
        parts = p.split("[", 1)[0].split(".")
        for n in range(len(parts), 0, -1):
            key = ".".join(parts[:n])
            if key in origins:
                return origins[key], key
    return None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _parse_scalar(text: str) -> Any:
    """``key=value`` values are YAML scalars: 3, 0.5, true, null, [1, 2], dispersed:8."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


class _Overridden(dict):
    """A raw mapping that remembers which override set which key (``origins``: ``section.key`` -> its label)."""

    origins: dict[str, str]


def apply_overrides(raw: dict, overrides: list[str], where: str = "override") -> dict:
    """Apply dotted ``section.key=value`` overrides to a raw mapping (validated later by :func:`from_dict`, which
    blames a bad value on its override, labelled ``<where> 'key=value'``)."""
    out = _Overridden(_deepcopy(raw))
    out.origins = dict(getattr(raw, "origins", {}))
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
        out.origins[".".join(parts)] = f"{where} {item!r}"
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


# -- command lines generated from a dataclass -------------------------------------------------------------
# A field's help is its own documentation in the source: the comment after it (``x: int = 1  # what x is``), or
# the comment block right above it when it has none. The dataclasses are already documented that way, so the
# flags cannot drift from the schema, and no field needs rewriting with ``metadata={"help": ...}``.
_FIELD_LINE = re.compile(r"^\s+(\w+)\s*:[^#]*?(?:#\s*(.*))?$")


def field_docs(cls: type) -> dict[str, str]:
    """``{field: doc}`` from the comments in ``cls``'s source (trailing comment, else the comment block above); an
    inherited field's from the base class that declares it (DecodeSettings' fields of DecodeConfig)."""
    docs: dict[str, str] = {}
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            for name, doc in _own_field_docs(klass, {f.name for f in dataclasses.fields(cls)}).items():  # type: ignore[arg-type]
                docs.setdefault(name, doc)
    return docs


def _own_field_docs(cls: type, names: set[str]) -> dict[str, str]:
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    above: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        m = _FIELD_LINE.match(line)
        if m and m.group(1) in names and m.group(1) not in docs:
            doc = (m.group(2) or "").strip() or " ".join(above).strip()
            docs[m.group(1)] = doc
        above = []
    return docs


class SuggestingParser(argparse.ArgumentParser):
    """argparse with "did you mean" for an invalid choice and for an unrecognised flag."""

    def _check_value(self, action, value):  # noqa: ANN001 - argparse's own signature
        if action.choices is not None and value not in action.choices:
            near = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise argparse.ArgumentError(action, f"invalid choice {value!r} (choose from "
                                                 f"{', '.join(map(str, action.choices))}){hint}")
        return super()._check_value(action, value)

    def error(self, message: str):  # noqa: ANN201 - argparse's own signature
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            parts = []
            for arg in m.group(1).split():
                near = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
                parts.append(f"{arg} (did you mean {near[0]}?)" if near and arg.startswith("-") else arg)
            message = "unrecognized arguments: " + " ".join(parts)
        # One line: the usage block (22 lines for the planner) buried the mistake; --help still prints it.
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


@dataclasses.dataclass
class Flag:
    """How one dataclass field appears on the command line (everything optional; the field gives the rest)."""

    name: str | None = None  # default: --field-name
    choices: tuple | list | None = None
    metavar: str | None = None
    group: str | None = None
    negate: bool = False  # a bool field whose default is True: ``--no-<name>`` stores False
    extend: bool = False  # a list field that may be given several times (action="extend")
    skip: bool = False  # no flag (an evaluation sweeps decode.policy through its own --policies)


def _scalar_type(tp: Any) -> Any:
    """The argparse ``type`` of a field annotation's scalar part (int, float, str, or a YAML scalar)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _scalar_type(args[0])
        return _parse_scalar  # e.g. bool | str: let from_dict decide
    if origin is list:
        (item,) = typing.get_args(tp) or (str,)
        return _scalar_type(item)
    return tp if tp in (int, float, str) else _parse_scalar


def _is_list(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(tp))
    return origin is list


def _is_bool(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args == [bool]
    return tp is bool


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, flags: dict[str, Flag] | None = None,
                        groups: dict[str, str] | None = None, prefix: str = "",
                        made: dict | None = None) -> dict[str, str]:
    """Add one flag per field of dataclass ``cls``, help = the field's doc (:func:`field_docs`) + its default.

    Every flag defaults to None (absent), so values from a config file survive unless a flag is given; the real
    defaults stay in the dataclass. Bool fields are switches (``store_const True``, or ``--no-x`` storing False
    with ``Flag(negate=True)``); list fields take ``nargs="+"``. ``groups`` maps a group title to its
    description; ``Flag.group`` picks one. A field that is a dataclass (a section: ``decode``) gets one flag per
    field of its own, named after that field (``--gen-length``), with dest ``section.field`` and ``flags`` keyed
    ``section.field``; :func:`nest_flags` puts them back into their section. Returns ``{dest: field}``.
    """
    flags = flags or {}
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    made = {} if made is None else made
    for title in dict.fromkeys([*(groups or {}), *(spec.group for spec in flags.values() if spec.group)]):
        if title not in made:
            made[title] = parser.add_argument_group(title, (groups or {}).get(title))  # in the order given
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        spec = flags.get(prefix + f.name, Flag())
        tp = hints[f.name]
        if spec.skip:
            continue
        if dataclasses.is_dataclass(tp):
            out.update(add_dataclass_flags(parser, tp, flags, None, f"{prefix}{f.name}.", made))  # type: ignore[arg-type]
            continue
        container: argparse._ActionsContainer = parser
        if spec.group:
            if spec.group not in made:
                made[spec.group] = parser.add_argument_group(spec.group, (groups or {}).get(spec.group))
            container = made[spec.group]
        help_text = docs.get(f.name) or f.name.replace("_", " ")
        if spec.negate:
            help_text = f"turn off: {help_text}"
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = dataclasses.MISSING
        if default is dataclasses.MISSING:
            help_text += " (required)"
        elif default is not None and not isinstance(default, bool):  # a switch's default is its absence
            shown = " ".join(map(str, default)) if isinstance(default, list) else default
            help_text += f" (default: {shown})" if shown != "" else ""
        name = spec.name or "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": prefix + f.name, "help": help_text.replace("%", "%%"), "default": None}
        if _is_bool(tp):
            kw.update(action="store_const", const=not spec.negate)
        else:
            kw["type"] = _scalar_type(tp)
            if _is_list(tp):
                kw["nargs"] = "+"
                if spec.extend:
                    kw["action"] = "extend"
            if spec.choices is not None:
                kw["choices"] = list(spec.choices)
            if spec.metavar:
                kw["metavar"] = spec.metavar
        container.add_argument(name, **kw)
        out[prefix + f.name] = prefix + f.name
    return out


def nest_flags(raw: dict, args: dict) -> dict:
    """``raw`` (a --config file's mapping) with the flags given in ``args`` (argparse's dests; None = not given)
    written over it; a dest ``section.field`` (:func:`add_dataclass_flags`) goes into that section of ``raw``."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for dest, value in args.items():
        if value is None:
            continue
        section, dot, name = dest.rpartition(".")
        if not dot:
            out[dest] = value
            continue
        node = out.setdefault(section, {})
        if not isinstance(node, dict):
            raise TDLMError(f"{section}: expected a mapping of settings (the {section}: section); got {node!r}")
        node[name] = value
    return out


def check_override_keys(cls: type, overrides: list[str], where: str | None = None) -> None:
    """A ``section.key=value`` override whose key is not a field of ``cls`` (nested dataclasses followed) is an
    error naming the override (or ``where``, e.g. the file the keys came from) and the nearest valid key."""
    for item in overrides:
        if "=" not in item:
            raise TDLMError(f"override {item!r}: expected key=value (e.g. train.max_steps=100)")
        parts = item.split("=", 1)[0].strip().split(".")
        node: Any = cls
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(node):
                if where:  # a mapping-valued field of the file: nothing to check below it
                    break
                raise TDLMError(f"override {item!r}: {'.'.join(parts[:depth])} is not a section")
            hints = typing.get_type_hints(node)
            names = [f.name for f in dataclasses.fields(node)]
            if part not in names:
                near = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
                prefix = ".".join(parts[:depth])
                full = f"{prefix}.{near[0]}" if prefix and near else (near[0] if near else "")
                hint = f"; did you mean {full!r}?" if near else f"; valid keys: {', '.join(names)}"
                who = where or f"override {item!r}"
                raise TDLMError(f"{who}: unknown key {'.'.join(parts[: depth + 1])!r}{hint}")
            node = hints[part]
