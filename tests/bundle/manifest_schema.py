"""Derive the manifest JSON Schema (current ``SCHEMA_VERSION``) from the ``Manifest`` dataclasses.

The committed ``edgekit/bundle/schema/manifest.v2.schema.json`` must equal what this prints
(``tests/bundle/test_manifest_golden.py`` checks it), so the schema other tools read and the
dataclasses the agent parses with cannot drift apart. After a deliberate schema change::

    python -m tests.bundle.manifest_schema > edgekit/bundle/schema/manifest.v2.schema.json

``manifest.v1.schema.json`` is kept as it was released, for v1 manifests (which agents migrate).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from edgekit.bundle import manifest as m

# Constraints the dataclasses check in code rather than in their types.
EXTRA: dict[tuple[str, str], dict[str, Any]] = {
    ("Manifest", "schema_version"): {"const": m.SCHEMA_VERSION},
    ("Manifest", "name"): {"pattern": "^[A-Za-z0-9._-]+$", "minLength": 1},
    ("Manifest", "version"): {"minimum": 1},
    ("Manifest", "target"): {
        "description": f"known targets: {', '.join(m.KNOWN_TARGETS)}; others are skipped by agents"
    },
    ("TensorSpec", "dtype"): {"enum": list(m.DTYPES)},
    ("FileEntry", "sha256"): {"pattern": "^[0-9a-f]{64}$"},
    ("FileEntry", "size_bytes"): {"minimum": 0},
    ("SourceModel", "sha256"): {"pattern": "^[0-9a-f]{64}$"},
}


def schema() -> dict[str, Any]:
    defs: dict[str, Any] = {}
    _object(m.Manifest, defs)
    root = defs.pop("Manifest")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://edgekit.dev/schema/manifest.v{m.SCHEMA_VERSION}.schema.json",
        "title": f"edgekit bundle manifest, schema_version {m.SCHEMA_VERSION}",
        "description": "Generated from edgekit/bundle/manifest.py by tests/bundle/manifest_schema.py; do not edit.",
        **root,
        "$defs": dict(sorted(defs.items())),
    }


def _object(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    name = cls.__name__
    if name not in defs:
        defs[name] = {}  # placeholder against recursion
        hints = typing.get_type_hints(cls)
        props, required = {}, []
        for f in dataclasses.fields(cls):
            prop = {**_type(hints[f.name], defs), **EXTRA.get((name, f.name), {})}
            props[f.name] = prop
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
        doc = (cls.__doc__ or "").strip().splitlines()
        defs[name] = {
            **({"description": doc[0]} if doc and not doc[0].startswith(f"{name}(") else {}),
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
    return {"$ref": f"#/$defs/{name}"}


def _type(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return {}
    if origin in (typing.Union, types.UnionType):
        alts = [_type(a, defs) for a in args if a is not type(None)]
        if type(None) in args:
            alts.append({"type": "null"})
        return alts[0] if len(alts) == 1 else {"anyOf": alts}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _object(tp, defs)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type(args[0], defs)}
        return {"type": "array", "prefixItems": [_type(a, defs) for a in args], "items": False}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type(args[1], defs)}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"no JSON Schema for {tp!r}")


def render() -> str:
    return json.dumps(schema(), indent=2) + "\n"


if __name__ == "__main__":
    print(render(), end="")
