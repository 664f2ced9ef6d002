"""YAML composition, dotted overrides and typed conversion into :class:`MegaRLConfig`.

Composition: a YAML file may start with ``defaults: [a.yaml, ../layouts/b.yaml]`` (paths relative
to that file). Its defaults are merged first, left to right, then the file itself; mappings merge
recursively, anything else (scalars, lists) is replaced. Several files given to
:func:`load_config` compose the same way, left to right, and the overrides come last.

Overrides are ``dotted.key=value`` strings; the value is parsed with ``yaml.safe_load`` so
``1e-6``, ``true``, ``null``, ``[a, b]`` get their YAML types (YAML 1.1 reads ``1e-6`` as a
string; float fields accept such strings).

Every leaf remembers the file (or override) that set it, so errors name the dotted path and where
the bad value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

from megarl.config.errors import ConfigError
from megarl.config.schema import MegaRLConfig
from megarl.config.validate import validate_config

DEFAULTS_KEY = "defaults"
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^[+-]?(inf|nan)$", re.IGNORECASE)


# ----------------------------------------------------------------------------- composition


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available: same safe subset


@functools.lru_cache(maxsize=256)
def _parse_yaml(path: str, mtime_ns: int, size: int) -> Any:
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader


def _read_yaml(path: str) -> dict[str, Any]:
    st = os.stat(path)
    try:
        data = _parse_yaml(os.path.realpath(path), st.st_mtime_ns, st.st_size)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return _copy(data)


def _merge(dst: dict, src: dict, prov: dict[str, str], source: str, prefix: str = "") -> None:
    """Merge ``src`` into ``dst`` in place (mappings recurse, other values replace); record sources."""
    for key, value in src.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {key!r} under '{prefix or '<top>'}' must be a string")
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            prov[path] = source
            _merge(dst[key], value, prov, source, path + ".")
        else:
            for old in [p for p in prov if p.startswith(path + ".")]:
                del prov[old]
            dst[key] = _copy(value)
            _record(value, prov, source, path)


def _record(value: Any, prov: dict[str, str], source: str, path: str) -> None:
    prov[path] = source
    if isinstance(value, dict):
        for k, v in value.items():
            _record(v, prov, source, f"{path}.{k}")


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def compose_file(path: str, _stack: tuple[str, ...] = ()) -> tuple[dict, dict[str, str]]:
    """Resolve ``path`` and its ``defaults`` chain into one mapping plus a provenance map."""
    real = os.path.realpath(path)
    if real in _stack:
        chain = " -> ".join(list(_stack) + [real])
        raise ConfigError(f"{path}: circular defaults: {chain}")
    if not os.path.isfile(path):
        where = f" (listed in defaults of {_stack[-1]})" if _stack else ""
        raise ConfigError(f"config file not found: {path}{where}")
    data = _read_yaml(path)
    merged: dict = {}
    prov: dict[str, str] = {}
    defaults = data.pop(DEFAULTS_KEY, [])
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"{path}: 'defaults' must be a list of file paths, got {defaults!r}")
    base_dir = os.path.dirname(os.path.abspath(path))
    for rel in defaults:
        sub_path = rel if os.path.isabs(rel) else os.path.normpath(os.path.join(base_dir, rel))
        sub, sub_prov = compose_file(sub_path, _stack + (real,))
        _merge_with_prov(merged, prov, sub, sub_prov)
    _merge(merged, data, prov, path)
    return merged, prov


def _merge_with_prov(dst: dict, prov: dict[str, str], src: dict, src_prov: dict[str, str]) -> None:
    """Merge an already-composed mapping, keeping the sources it recorded for each leaf."""
    _merge(dst, src, prov, "<composed>")
    for p, s in src_prov.items():
        prov[p] = s


def parse_override(text: str) -> tuple[str, Any]:
    """``"actor.lr=1e-6"`` -> ``("actor.lr", "1e-6")`` with the value parsed by ``yaml.safe_load``."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: cannot parse value: {e}") from e
    return key, value


def apply_override(tree: dict, prov: dict[str, str], text: str) -> None:
    key, value = parse_override(text)
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
            prov[".".join(parts[: i + 1])] = f"override '{text}'"
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ConfigError(f"override {text!r}: '{prefix}' is {child!r}, not a mapping")
        node = child
    _merge(node, {parts[-1]: value}, prov, f"override '{text}'", ".".join(parts[:-1]) + "." if len(parts) > 1 else "")


# ----------------------------------------------------------------------------- typed conversion


def field_docs(cls: type = MegaRLConfig, prefix: str = "") -> dict[str, tuple[str, Any, str]]:
    """Every dotted field path -> (type text, default, doc)."""
    out: dict[str, tuple[str, Any, str]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(tp):
            out[path] = (tp.__name__, None, f.metadata.get("doc", ""))
            out.update(field_docs(tp, path + "."))
        else:
            out[path] = (type_name(tp), default, f.metadata.get("doc", ""))
    return out


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is typing.Literal:
        return "|".join("null" if a is None else str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


class _Converter:
    def __init__(self, prov: dict[str, str]):
        self.prov = prov
        self.errors: list[str] = []

    def where(self, path: str) -> str:
        probe = re.sub(r"(\[\d+\])+$", "", path)
        while probe:
            if probe in self.prov:
                return self.prov[probe]
            probe = probe.rpartition(".")[0]
        return "defaults"

    def error(self, path: str, msg: str) -> None:
        self.errors.append(f"{path} (from {self.where(path)}): {msg}")

    def build(self, cls: type, data: Any, path: str) -> Any:
        if not isinstance(data, dict):
            self.error(path or "<top>", f"expected a mapping of {cls.__name__} fields, got {_show(data)}")
            return cls()
        hints = _type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in data.items():
            sub = f"{path}.{key}" if path else str(key)
            if key not in fields:
                self.error(sub, f"unknown key{_suggest(str(key), fields, path)}")
                continue
            ok, converted, why = self.convert(value, hints[key], sub)
            if ok:
                kwargs[key] = converted
            elif why is not None:
                doc = fields[key].metadata.get("doc", "")
                self.error(sub, f"{why}; expected {type_name(hints[key])}" + (f" — {doc}" if doc else ""))
        return cls(**kwargs)

    def convert(self, value: Any, tp: Any, path: str) -> tuple[bool, Any, str | None]:
        """(ok, value, reason). reason None with ok False means an error was already recorded."""
        origin = typing.get_origin(tp)
        if tp is Any:
            return True, value, None
        if dataclasses.is_dataclass(tp):
            before = len(self.errors)
            built = self.build(tp, value, path)
            return (len(self.errors) == before), built, None
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            if value is None:
                return (type(None) in args), None, "got null"
            for arg in args:
                if arg is type(None):
                    continue
                if dataclasses.is_dataclass(arg) or typing.get_origin(arg) in (list, dict):
                    if _shape_matches(value, arg):
                        return self.convert(value, arg, path)
                    continue
                ok, conv, _ = self.convert(value, arg, path)
                if ok:
                    return True, conv, None
            return False, value, f"got {_show(value)}"
        if origin is typing.Literal:
            allowed = typing.get_args(tp)
            if value in allowed and type(value) is type(allowed[allowed.index(value)]):
                return True, value, None
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            return False, value, f"got {_show(value)}{hint}"
        if origin is list:
            if not isinstance(value, (list, tuple)):
                return False, value, f"got {_show(value)}"
            (item_tp,) = typing.get_args(tp)
            out, ok_all = [], True
            for i, item in enumerate(value):
                ok, conv, why = self.convert(item, item_tp, f"{path}[{i}]")
                if not ok:
                    ok_all = False
                    if why is not None:
                        self.error(f"{path}[{i}]", f"{why}; expected {type_name(item_tp)}")
                out.append(conv)
            return ok_all, out, None if not ok_all else None
        if origin is dict:
            if not isinstance(value, dict):
                return False, value, f"got {_show(value)}"
            return True, value, None
        if tp is bool:
            return (isinstance(value, bool)), value, f"got {_show(value)}"
        if tp is int:
            return (isinstance(value, int) and not isinstance(value, bool)), value, f"got {_show(value)}"
        if tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return True, float(value), None
            if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
                return True, float(value), None
            return False, value, f"got {_show(value)}"
        if tp is str:
            return isinstance(value, str), value, f"got {_show(value)}"
        if tp is type(None):
            return value is None, value, f"got {_show(value)}"
        raise TypeError(f"{path}: unsupported config type {tp!r}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _shape_matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is list:
        return isinstance(value, (list, tuple))
    return isinstance(value, dict)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _suggest(key: str, fields: dict, parent: str) -> str:
    # the key may belong to another section (e.g. actor.clip_high -> algorithm.clip_high)
    leaves = [p for p in field_docs() if p.rsplit(".", 1)[-1] == key]
    if leaves:
        return f"; did you mean '{leaves[0]}'?"
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    if close:
        where = f"{parent}.{close[0]}" if parent else close[0]
        return f"; did you mean '{where}'?"
    return f"; valid keys: {', '.join(sorted(fields))}"


def from_dict(data: dict, prov: dict[str, str] | None = None, validate: bool = True) -> MegaRLConfig:
    """Build and (by default) validate a config from a plain mapping (merged over the defaults, so
    free-form mappings such as ``reward`` keep their default keys)."""
    conv = _Converter(prov or {})
    if isinstance(data, dict):
        merged = config_to_dict(MegaRLConfig())
        _merge(merged, data, {}, "<data>")
        data = merged
    cfg = conv.build(MegaRLConfig, data, "")
    if conv.errors:
        raise ConfigError(conv.errors)
    if validate:
        validate_config(cfg, where=conv.where)
    return cfg


def compose(paths: str | Sequence[str] | None, overrides: Sequence[str] = ()) -> tuple[dict, dict[str, str]]:
    """The merged raw mapping of ``paths`` (left to right) plus ``overrides``, with provenance."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, os.PathLike)):
        paths = [os.fspath(paths)]
    tree: dict = {}
    prov: dict[str, str] = {}
    for p in paths:
        sub, sub_prov = compose_file(os.fspath(p))
        _merge_with_prov(tree, prov, sub, sub_prov)
    for text in overrides:
        apply_override(tree, prov, text)
    return tree, prov


def load_config(path: str | Sequence[str] | None, overrides: Sequence[str] = ()) -> MegaRLConfig:
    """Load ``path`` (one YAML file, several composed left to right, or None for the defaults),
    apply ``overrides`` (``dotted.key=value``), convert to typed dataclasses and validate.

    Raises :class:`ConfigError` naming every bad field with the file or override that set it.
    """
    tree, prov = compose(path, overrides)
    return from_dict(tree, prov)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (or sub-config) dataclass."""
    return dataclasses.asdict(cfg)


def save_config(cfg: MegaRLConfig, path: str) -> None:
    """Write the resolved config as YAML (loadable again with :func:`load_config`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=False)
