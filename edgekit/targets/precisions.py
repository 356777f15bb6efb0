"""Which precision each target builds: one name for every target, or a default plus per-target choices.

API: ``precision="int8"`` or ``precision={"cpu": "int8", "apple": "int8-weights"}`` (targets not
named get ``DEFAULT_PRECISION``). CLI: ``--precision int8``, ``--precision int8,apple=int8-weights``
(a default, then ``TARGET=PRECISION`` overrides) or ``--precision cpu=int8,apple=palettize4``.

Nothing is mapped onto something else: a precision a target cannot build is an error that lists
what it builds and the nearest name.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

from edgekit.errors import ConfigError
from edgekit.package_defaults import DEFAULT_PRECISION
from edgekit.targets import TARGETS
from edgekit.targets.base import PRECISIONS, Target


def parse_precision_arg(text: str) -> str | dict[str, str]:
    """``"int8"`` -> ``"int8"``; ``"int8,apple=int8-weights"`` -> ``{"*": "int8", "apple": "int8-weights"}``.

    The result is what ``resolve_precisions`` takes; ``"*"`` holds the default when one is given.
    Names are checked later, against the targets being packaged.
    """
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ConfigError(
            f"--precision {text!r}: expected PRECISION[,TARGET=PRECISION...] such as int8,apple=int8-weights"
        )
    if len(items) == 1 and "=" not in items[0]:
        return items[0]
    out: dict[str, str] = {}
    for item in items:
        target, sep, value = (s.strip() for s in item.partition("="))
        key = target if sep else "*"
        value = value if sep else target
        if not key or not value:
            raise ConfigError(f"--precision {text!r}: {item!r} is not TARGET=PRECISION such as apple=int8-weights")
        if key in out:
            what = "more than one default precision" if key == "*" else f"target {key!r} given twice"
            raise ConfigError(f"--precision {text!r}: {what}; give one default and at most one TARGET=PRECISION each")
        out[key] = value
    return out


def resolve_precisions(precision: str | Mapping[str, str], targets: Sequence[str]) -> dict[str, str]:
    """Target -> precision name for every target in ``targets``.

    A mapping names targets (key ``"*"``: the default for the others, else ``DEFAULT_PRECISION``);
    naming a target that is not being packaged is an error, as for ``--option``.
    """
    if isinstance(precision, str):
        return dict.fromkeys(targets, precision)
    if not isinstance(precision, Mapping):
        raise ConfigError(f"precision: expected a name or a mapping target -> name, got {type(precision).__name__}")
    for name, value in precision.items():
        if name != "*" and name not in TARGETS:
            near = difflib.get_close_matches(name, TARGETS, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"--precision {name}={value}: unknown target {name!r} (choose from {', '.join(TARGETS)}){hint}"
            )
        if name != "*" and name not in targets:
            raise ConfigError(
                f"--precision {name}={value}: a precision for a target not being packaged "
                f"(packaging: {', '.join(targets)})"
            )
        if not isinstance(value, str):
            raise ConfigError(f"--precision {name}: expected a precision name, got {type(value).__name__}")
    default = precision.get("*", DEFAULT_PRECISION)
    return {t: precision.get(t, default) for t in targets}


def choose_precisions(precision: str | Mapping[str, str], targets: Mapping[str, Target]) -> dict[str, str]:
    """Target name -> precision, each checked against what that target builds (before any work)."""
    resolved = resolve_precisions(precision, list(targets))
    named = set() if isinstance(precision, str) else set(precision) - {"*"}
    for name, target in targets.items():
        check_precision(target, resolved[name], named=name in named, several=len(targets) > 1)
    return resolved


def check_precision(target: Target, precision: str, named: bool = False, several: bool = False) -> None:
    """Raise ``ConfigError`` unless ``target`` builds ``precision``: it lists what the target builds and
    the nearest name. ``named``: the user chose it for this target (``apple=...``), not as the default;
    ``several``: other targets are packaged too, so a per-target override is the way out.
    """
    shown = f"{target.name}={precision}" if named else precision
    if precision not in PRECISIONS:
        typed = _nearest_precision(precision)
        hint = f"; did you mean {typed!r}?" if typed else ""
        raise ConfigError(f"--precision {shown!r} is not one of {', '.join(PRECISIONS)}{hint}")
    if precision in target.precisions:
        return
    near = difflib.get_close_matches(precision, target.precisions, n=1, cutoff=0.3)
    hint = f"; nearest: {near[0]!r}" if near else ""
    if several and not named:
        example = near[0] if near else target.precisions[0]
        hint += (
            f"; to keep {precision} for the other targets, give {target.name} its own: "
            f"--precision {precision},{target.name}={example}"
        )
    raise ConfigError(
        f"--precision {shown!r} is not available for target {target.name!r} "
        f"(it builds {', '.join(target.precisions)}){hint}"
    )


# the weights/activations labels the table and the manifest show -> the --precision name
LABELS = {
    "w32a32": "fp32",
    "w16a16": "fp16",
    "w32abf16": "bf16",
    "w16abf16": "bf16",  # weights stored in fp16, computed in bf16
    "w8a8": "int8",
    "w8abf16": "int8",  # an INT8 IR whose float ops run in bf16
    "w8a16": "int8-weights",
    "w8a32": "int8-weights",
    "w4a16": "int4-weights",
    "w4a32": "int4-weights",
}


def _nearest_precision(text: str) -> str | None:
    """A precision name for what was typed: another case (``INT8``), a label (``w8a8``), a typo."""
    low = text.strip().lower()
    if low in PRECISIONS:
        return low
    if low in LABELS:
        return LABELS[low]
    near = difflib.get_close_matches(low, PRECISIONS, n=1)
    return near[0] if near else None
