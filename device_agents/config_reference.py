"""The agent configuration reference (``docs/agent-config.md``), generated from the typed config
classes (``device_agents.config``): every table and key, its type, default and the comment the
class gives it. A test fails when the committed page differs from what this writes; regenerate
it with ``python -m device_agents.config_reference > docs/agent-config.md``."""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from typing import Any

from device_agents.config import AgentConfig

_FIELD = re.compile(r"^    (\w+): [^#]*?(?:#\s*(?P<comment>.*))?$")
_COMMENT = re.compile(r"^    #\s?(?P<text>.*)$")
_NESTED = re.compile(r"^(?:(?P<dict>dict\[str, )|(?P<tuple>tuple\[))?(?P<name>[A-Z]\w+)(?:, \.\.\.)?\]?(?: \| None)?$")


def reference() -> str:
    """The whole page, Markdown."""
    out = [
        "# Agent configuration reference",
        "",
        "Generated from the typed config classes in `device_agents/config.py` and",
        "`device_agents/runtimes/options.py` by `python -m device_agents.config_reference`; do not edit by hand.",
        "How the agent uses these settings is in [agent.md](agent.md). Unknown keys are errors that name their",
        "path; relative paths are resolved against the config file.",
    ]
    _section(out, "top level", AgentConfig)
    return "\n".join(out) + "\n"


def _section(out: list[str], title: str, cls: type[Any]) -> None:
    doc = inspect.getdoc(cls) or ""
    intro = doc.split("\n\n", 1)[0].replace("\n", " ").replace("``", "`") if title != "top level" else ""
    out += ["", f"## {title}" if title == "top level" else f"## `[{title}]`", ""]
    if intro:
        out += [intro, ""]
    comments = _comments(cls)
    out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    nested: list[tuple[str, type[Any]]] = []
    module = sys.modules[cls.__module__]
    for f in dataclasses.fields(cls):
        kind = str(f.type)
        m = _NESTED.match(kind)
        inner = getattr(module, m.group("name"), None) if m else None
        if inner is not None and dataclasses.is_dataclass(inner):
            prefix = "" if title == "top level" else f"{title}."
            if m and m.group("dict"):
                path = f"{prefix}{f.name}.NAME"
            elif m and m.group("tuple"):
                path = f"[{prefix}{f.name}]"  # an array of tables
            else:
                path = f"{prefix}{f.name}"
            nested.append((path, inner))  # type: ignore[arg-type]  # is_dataclass narrows to the instance union
            out.append(f"| `{f.name}` | table | see `[{path}]` | {_cell(comments.get(f.name, ''))} |")
            continue
        out.append(f"| `{f.name}` | `{kind}` | {_default(f)} | {_cell(comments.get(f.name, ''))} |")
    for path, inner in nested:
        _section(out, path, inner)


def _comments(cls: type[Any]) -> dict[str, str]:
    """Each field's comment in the class source: on its line, or on the comment lines just above it."""
    found: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        c = _COMMENT.match(line)
        if c:
            above.append(c.group("text"))
            continue
        m = _FIELD.match(line)
        if m:
            found[m.group(1)] = " ".join([*above, m.group("comment") or ""]).strip()
        above = []
    return found


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, tuple):
        value = list(value)
    if value is None:
        return "not set"
    text = repr(str(value)) if type(value).__name__ in ("PosixPath", "WindowsPath") else repr(value)
    return f"`{text}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    sys.stdout.write(reference())
