"""The architecture rules that keep host and device apart, and the layers of each, one way (docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("onnx", "torch", "tensorflow", "openvino", "nncf", "coremltools", "onnx2tf", "onnx2torch", "tensorrt")


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=ROOT)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_edgekit_and_device_agents_load_no_ml_sdk() -> None:
    loaded = _loaded_after("import edgekit, edgekit.targets, device_agents, device_agents.runtimes")
    assert not loaded & set(HEAVY), f"light imports pulled in {sorted(loaded & set(HEAVY))}"


def test_agent_daemon_modules_load_no_converter() -> None:
    modules = ["device_agents.cli", "device_agents.service", "device_agents.lifecycle", "device_agents.serving.http"]
    loaded = _loaded_after("\n".join(f"import {m}" for m in modules))
    converters = {"onnx", "torch", "tensorflow", "nncf", "coremltools", "onnx2tf", "onnx2torch"}
    assert not loaded & converters, f"the agent pulled in converters {sorted(loaded & converters)}"


def test_device_agents_imports_only_the_bundle_contract_from_edgekit() -> None:
    offenders = []
    for path in sorted((ROOT / "device_agents").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                if n == "edgekit" or (n.startswith("edgekit.") and not n.startswith("edgekit.bundle")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {n}")
    assert not offenders, "\n".join(offenders)


def _agent_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("device_agents"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("device_agents")}
    return found


# layer -> device_agents modules it must not import (docs/architecture.md, "Device")
_BELOW_THE_SERVICE = ("device_agents.service", "device_agents.serving", "device_agents.cli")


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        # a front-end decodes and encodes; it reaches nothing past the service
        (
            "serving/http.py",
            ("device_agents.lifecycle", "device_agents.registry", "device_agents.endpoints", "device_agents.store"),
        ),
        ("endpoints.py", ("device_agents.lifecycle", *_BELOW_THE_SERVICE)),
        ("pipeline/__init__.py", ("device_agents.lifecycle", "device_agents.endpoints", *_BELOW_THE_SERVICE)),
        ("pipeline/batching.py", ("device_agents.lifecycle", "device_agents.endpoints", *_BELOW_THE_SERVICE)),
        ("registry.py", ("device_agents.lifecycle", "device_agents.pipeline", *_BELOW_THE_SERVICE)),
        ("lifecycle.py", ("device_agents.endpoints", "device_agents.pipeline", *_BELOW_THE_SERVICE)),
    ],
)
def test_agent_layers_import_only_downwards(module: str, forbidden: tuple[str, ...]) -> None:
    imports = _agent_imports(ROOT / "device_agents" / module)
    bad = sorted(i for i in imports if any(i == f or i.startswith(f + ".") for f in forbidden))
    assert not bad, f"device_agents/{module} imports {bad}"


def test_only_the_lifecycle_writes_the_store() -> None:
    writers = ("stage(", "promote(", "rollback(", "reject_candidate(", "update_model(", "cleanup(")
    offenders = []
    for path in sorted((ROOT / "device_agents").rglob("*.py")):
        rel = path.relative_to(ROOT / "device_agents").as_posix()
        if rel in ("lifecycle.py", "store.py"):
            continue
        text = path.read_text()
        offenders += [f"{rel}: store.{w}" for w in writers if f"store.{w}" in text]
    assert not offenders, offenders


def _table_entries() -> list[tuple[str, str]]:
    from device_agents.runtimes import RUNTIMES
    from edgekit.targets import TARGETS

    return [("target", v) for v in TARGETS.values()] + [("runtime", v) for v in RUNTIMES.values()]


@pytest.mark.parametrize(("kind", "spec"), _table_entries())
def test_every_catalogue_entry_imports_or_names_its_extra(kind: str, spec: str) -> None:
    from edgekit.errors import MissingSDKError

    module, cls = spec.split(":")
    try:
        mod = importlib.import_module(module)
    except MissingSDKError as exc:  # an absent SDK must say which extra to install
        assert "pip install 'edgekit[" in str(exc)
        return
    assert hasattr(mod, cls), f"{module} has no {cls}"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test).split(".")[-1] == "TYPE_CHECKING"


def import_graph(packages: tuple[str, ...] = ("edgekit", "device_agents"), root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports, read from the source (nothing is imported).

    Every import counts wherever it stands: at module level, inside a function (a deferred import
    still needs the other module to exist and load, so two modules importing each other from
    functions are one unit all the same) and under ``if TYPE_CHECKING:`` (the types of one module
    are then part of the other's interface). ``from package import name`` counts the submodule
    ``package.name`` when there is one, else ``package``. A parent package that Python runs on
    the way to a submodule is not counted: the edge is to the module named."""
    modules = {
        _module_name(p, root): p
        for pkg in packages
        for p in sorted((root / pkg).rglob("*.py"))
        if "__pycache__" not in p.parts
    }

    def project_module(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {m for a in node.names if (m := project_module(a.name))}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in modules else project_module(base)
                    if target:
                        found.add(target)
        found.discard(name)
        graph[name] = found
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every
    module of one can reach every other by imports, so none can be read or changed alone."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


# Cycles being taken apart, each with the reason it is still here. The test fails on any other
# cycle, and on an entry here that is gone (so the list only shrinks).
KNOWN_CYCLES: dict[tuple[str, ...], str] = {
    ("device_agents.pipeline", "device_agents.pipeline.stage"): (
        "stage.py types a StageContext field with pipeline.RequestTiming (under TYPE_CHECKING) while the "
        "pipeline imports stage.py; RequestTiming belongs in a module both import (the pipeline's "
        "restructure, under way, moves it)"
    ),
}


def test_no_import_cycle_among_the_project_modules() -> None:
    cycles = {tuple(c) for c in import_cycles(import_graph())}
    new = sorted(cycles - set(KNOWN_CYCLES))
    assert not new, "import cycles (move what both need into a module both import): " + "; ".join(
        " <-> ".join(c) for c in new
    )
    gone = sorted(set(KNOWN_CYCLES) - cycles)
    assert not gone, f"no longer cycles: remove them from KNOWN_CYCLES: {gone}"


def test_import_cycles_found_through_functions_type_checking_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")  # inside a function
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    (pkg / "sub" / "c.py").write_text("from .. import d\n")  # relative, two levels
    (pkg / "d.py").write_text("import pkg.sub.c\n")
    (pkg / "e.py").write_text("from pkg import a\n")  # imports into a cycle, is not part of it
    graph = import_graph(("pkg",), tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.sub.c"] == {"pkg.d"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.sub.c"]]


def test_bundle_errors_hold_only_errors_the_device_side_raises_or_catches() -> None:
    """The contract's errors are those the agent (or the contract itself) uses; an error only the
    host raises belongs in ``edgekit.errors``, so the agent cannot come to depend on it."""
    from edgekit.bundle import errors

    device_side = "\n".join(
        p.read_text()
        for p in [*(ROOT / "device_agents").rglob("*.py"), *(ROOT / "edgekit" / "bundle").rglob("*.py")]
        if p.name != "errors.py" or p.parent.name != "bundle"
    )
    host_only = [name for name in errors.__all__ if not re.search(rf"\b{name}\b", device_side)]
    assert not host_only, f"only the host uses {host_only}: move them to edgekit/errors.py"
