"""Per-target typed options: each target's ``Options`` frozen dataclass, set from the API
(``options={"cpu": CpuOptions(...)}`` or ``{"cpu": {"activations": "uint8"}}``) or from the CLI
(``--option cpu.activations=uint8``). Errors name the path (``targets.jetson.workspace_mb``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from edgekit.bundle.codec import from_data
from edgekit.errors import ConfigError


def resolve_options(target_name: str, options_cls: type, given: Any) -> Any:
    """An ``options_cls`` instance from ``None``, an instance, or a mapping of field values."""
    path = f"targets.{target_name}"
    if given is None:
        return options_cls()
    if isinstance(given, options_cls):
        return given
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"{path}: expected {options_cls.__name__} or a mapping of its fields, got {type(given).__name__}"
        )
    hints = typing.get_type_hints(options_cls)
    values = {k: _coerce(hints[k], v) if isinstance(v, str) and k in hints else v for k, v in given.items()}
    fields = {f.name for f in dataclasses.fields(options_cls)}
    for key in values:
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{path}.{key}: unknown option (known: {', '.join(sorted(fields)) or 'none'}){hint}")
    return from_data(options_cls, values, path, ConfigError)


def parse_option_args(items: Iterable[str], targets: Iterable[str]) -> dict[str, dict[str, str]]:
    """``["cpu.activations=uint8"]`` -> ``{"cpu": {"activations": "uint8"}}`` for the given targets."""
    known = list(targets)
    out: dict[str, dict[str, str]] = {}
    for item in items:
        lhs, sep, value = item.partition("=")
        target, dot, key = lhs.strip().partition(".")
        if not sep or not dot or not target or not key:
            raise ConfigError(f"--option {item!r}: expected TARGET.KEY=VALUE such as cpu.activations=uint8")
        if target not in known:
            raise ConfigError(
                f"targets.{target}: --option for a target not being packaged (packaging: {', '.join(known)})"
            )
        out.setdefault(target, {})[key] = value.strip()
    return out


def check_option_targets(options: Mapping[str, Any], targets: Iterable[str]) -> None:
    known = list(targets)
    for name in options:
        if name not in known:
            raise ConfigError(
                f"targets.{name}: options given for a target not being packaged (packaging: {', '.join(known)})"
            )


def _coerce(hint: Any, raw: str) -> Any:
    """A CLI string as the field's type: strings stay strings, anything else is read as JSON."""
    if _is_text(hint):
        return None if raw.lower() in ("none", "null") and _optional(hint) else raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # the codec then reports the type mismatch with the path


def _is_text(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is str:
        return True
    if origin is typing.Literal:
        return all(isinstance(a, str) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        alts = [a for a in typing.get_args(hint) if a is not type(None)]
        return bool(alts) and all(_is_text(a) for a in alts)
    return False


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def describe_options() -> list[str]:
    """``--list-options``: every target's option, type and default, as ``TARGET.KEY: TYPE = DEFAULT``."""
    from edgekit.targets import TARGETS, get_target

    lines = []
    for name in TARGETS:
        options_cls = get_target(name).Options
        hints = typing.get_type_hints(options_cls)
        fields = dataclasses.fields(options_cls)
        if not fields:
            lines.append(f"{name}: no options")
        for f in fields:
            default = f.default if f.default is not dataclasses.MISSING else "(required)"
            lines.append(f"{name}.{f.name}: {_type_name(hints[f.name])} = {default!r}")
    return lines


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    text = getattr(hint, "__name__", None)
    return text if text and typing.get_origin(hint) is None else str(hint).replace("typing.", "")
