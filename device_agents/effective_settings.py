"""The agent's effective settings, one ``key = value`` line each, for ``edgekit-agent run -v``.

Every key of the loaded config (``device_agents.config.AgentConfig``), nested tables as dotted
paths (``server.max_connections``, ``models.tiny.batching.max_batch_size``), each marked
``(default)`` where the config file left it out or gave the default: what the agent runs with,
not only what the file says.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


def effective_settings(config: Any) -> list[str]:
    """``key = value`` lines for every setting of ``config`` (a config dataclass), in field order."""
    lines: list[str] = []
    _walk(config, "", lines)
    return lines


def _walk(obj: Any, prefix: str, lines: list[str]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _walk(value, f"{key}.", lines)
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for name, table in value.items():
                _walk(table, f"{key}.{name}.", lines)
        else:
            default = " (default)" if _is_default(f, value) else ""
            lines.append(f"{key} = {_text(value)}{default}")


def _is_default(f: dataclasses.Field[Any], value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        return bool(value == f.default)
    if f.default_factory is not dataclasses.MISSING:
        return bool(value == f.default_factory())
    return False


def _text(value: Any) -> str:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_text(v)}" for k, v in value.items()) + "}"
    return repr(value)
