"""Strict conversion between frozen dataclasses and plain JSON/TOML data.

Used for the manifest and for the agent's config: unknown keys, missing fields and wrong types
are errors that name their path (``manifest.validation.tolerance.min_cosine``) and the nearest
known key. Supported field
types: ``str``, ``int``, ``float``, ``bool``, ``Path``, nested dataclasses, ``tuple[X, ...]``,
``dict[str, X]``, ``X | None`` and ``Literal[...]``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath
from typing import Any, TypeVar

from edgekit.bundle.errors import EdgekitError, ManifestError

T = TypeVar("T")

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def from_data(cls: type[T], data: Any, path: str, error: type[EdgekitError] = ManifestError) -> T:
    """Build ``cls`` from ``data``; raise ``error`` naming ``path`` on any mismatch."""
    built: T = _convert(cls, data, path, error)  # _convert checked every field against cls
    return built


def _convert(tp: Any, value: Any, path: str, error: type[EdgekitError]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        last: EdgekitError | None = None
        for alt in non_none:
            try:
                return _convert(alt, value, path, error)
            except EdgekitError as exc:
                last = exc
        raise last or error(f"{path}: unexpected value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise error(f"{path}: {value!r} is not one of {choices}")
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _convert_dataclass(tp, value, path, error)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise error(f"{path}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]", error) for i, v in enumerate(value))
        if len(args) != len(value):
            raise error(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, f"{path}[{i}]", error) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{path}: expected a table/object, got {type(value).__name__}")
        _, val_tp = args
        return {str(k): _convert(val_tp, v, f"{path}.{k}", error) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise error(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise error(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is Path:  # config files name paths as strings; callers resolve relative ones
        if not isinstance(value, str) or not value:
            raise error(f"{path}: expected a path (a non-empty string), got {value!r}")
        return Path(value)
    if tp is str:
        if not isinstance(value, str):
            raise error(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"codec does not support type {tp!r} at {path}")


def _convert_dataclass(cls: type, value: Any, path: str, error: type[EdgekitError]) -> Any:
    if not isinstance(value, dict):
        raise error(f"{path}: expected a table/object, got {type(value).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        near = difflib.get_close_matches(str(unknown[0]), list(fields), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise error(f"{path}: unknown key {unknown[0]!r} ({hint}known keys: {known})")
    kwargs = {}
    for name, field in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], f"{path}.{name}", error)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise error(f"{path}: missing required key {name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise error(f"{path}: {exc}") from exc


def upgrade(
    data: dict[str, Any],
    key: str,
    current: int,
    migrations: Mapping[int, Callable[[dict[str, Any]], dict[str, Any]]],
    path: str,
    error: type[EdgekitError],
    newer_hint: str,
) -> dict[str, Any]:
    """Bring a versioned document (``data[key]``) up to ``current`` one migration at a time.

    A version newer than ``current`` is refused with ``newer_hint`` (what to upgrade).
    """
    version = data.get(key)
    if not isinstance(version, int) or isinstance(version, bool):
        raise error(f"{path}.{key}: expected an integer, got {version!r}")
    if version > current:
        raise error(f"{path}.{key}: {version} is newer than this agent understands ({current}); {newer_hint}")
    while version < current:
        if version not in migrations:
            raise error(f"{path}.{key}: no migration from version {version}")
        data = migrations[version](data)
        version = data[key]
    return data


def to_data(obj: Any) -> Any:
    """Plain JSON-ready data from a dataclass tree; ``None`` fields are left out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is not None:
                out[f.name] = to_data(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(v) for k, v in obj.items()}
    if isinstance(obj, PurePath):
        return str(obj)
    return obj
