"""Check that every requirement of edgekit's extras is installed at a version the extra allows.

`uv pip check` (run first) checks what installed distributions require; it cannot know which
extras of edgekit the environment is meant to have, so a package that only an extra names
(onnx-ir for int4-weights, tf-keras for coral) would slip through it when missing from
requirements/lock.txt. This walks the extras given on the command line (default: all dev),
recursively through self-references such as ``edgekit[agent]``, and fails naming what is
missing or at the wrong version.

    python requirements/check_extras.py all dev
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def problems(dist_name: str, extras: list[str]) -> list[str]:
    dist = metadata.distribution(dist_name)
    reqs = [Requirement(r) for r in dist.requires or []]
    own = canonicalize_name(dist_name)
    seen: set[str] = set()
    todo = list(extras)
    found: list[str] = []
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in reqs:
            if req.marker is None or not req.marker.evaluate({"extra": extra}):
                continue
            wanted = f"{req.name}{req.specifier}"
            if canonicalize_name(req.name) == own:
                todo.extend(req.extras)
                continue
            try:
                version = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                found.append(f"edgekit[{extra}] requires {wanted}, which is not installed")
                continue
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                found.append(f"edgekit[{extra}] requires {wanted}, but {req.name} {version} is installed")
    return sorted(set(found))


def main(argv: list[str]) -> int:
    extras = argv or ["all", "dev"]
    found = problems("edgekit", extras)
    for line in found:
        print(f"check_extras: {line}: add it to requirements/lock.txt (make lock)", file=sys.stderr)
    if not found:
        print(f"check_extras: every requirement of edgekit[{','.join(extras)}] is installed")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
