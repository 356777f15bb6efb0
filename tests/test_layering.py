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
        ("endpoints.py", ("device_agents.lifecycle", *_BELOW_THE_SERVICE)),
        ("pipeline/__init__.py", ("device_agents.lifecycle", "device_agents.endpoints", *_BELOW_THE_SERVICE)),
        ("pipeline/batching.py", ("device_agents.lifecycle", "device_agents.endpoints", *_BELOW_THE_SERVICE)),
        ("pipeline/policy.py", ("device_agents.registry", "device_agents.runtimes", "device_agents.pipeline.batching")),
        ("pipeline/watchdog.py", ("device_agents.registry", "device_agents.pipeline.batching", *_BELOW_THE_SERVICE)),
        ("pipeline/stage.py", ("device_agents.pipeline.batching", "device_agents.registry", *_BELOW_THE_SERVICE)),
        ("health.py", ("device_agents.updates", "device_agents.pipeline", *_BELOW_THE_SERVICE)),
        ("updates/client.py", ("device_agents.store", "device_agents.registry", "device_agents.health")),
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
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


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


def test_bundle_errors_hold_no_error_only_the_device_raises() -> None:
    """An error only the agent uses (a store, a model it does not serve) belongs in
    ``device_agents.errors``; the contract keeps those the host or the contract itself uses too."""
    from edgekit.bundle import errors

    host_side = "\n".join(
        p.read_text() for p in (ROOT / "edgekit").rglob("*.py") if p.name != "errors.py" or p.parent.name != "bundle"
    )
    device_only = [name for name in errors.__all__ if not re.search(rf"\b{name}\b", host_side)]
    assert not device_only, f"only the device uses {device_only}: move them to device_agents/errors.py"


def _contract_offenders(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a contract module (``edgekit.bundle``) reaching anything outside the contract."""
    return [
        f"{m} imports {i}"
        for m, imported in sorted(graph.items())
        if m == "edgekit.bundle" or m.startswith("edgekit.bundle.")
        for i in sorted(imported)
        if not (i == "edgekit.bundle" or i.startswith("edgekit.bundle."))
    ]


def test_the_contract_imports_neither_side() -> None:
    """The bottom layer (bundle format and signing, the fleet wire protocol, base errors, the CLI
    error helpers) imports nothing of the host or the device: both sides stand on it."""
    offenders = _contract_offenders(import_graph())
    assert not offenders, offenders


def test_contract_rule_catches_an_import_of_either_side() -> None:
    graph = {
        "edgekit.bundle.fleet_connection": {"device_agents.config", "edgekit.bundle.errors"},
        "edgekit.bundle.command_line": {"edgekit.errors"},
        "edgekit.cli": {"device_agents.cli"},
    }
    assert _contract_offenders(graph) == [
        "edgekit.bundle.command_line imports edgekit.errors",
        "edgekit.bundle.fleet_connection imports device_agents.config",
    ]


# -- stages and front-ends ------------------------------------------------------------------------


def _stage_modules() -> list[str]:
    """The modules of the stage table's entries (``pipeline.stage.STAGE_FACTORIES``), and the
    batcher's (queue + infer, the table's ``INFER`` place)."""
    from device_agents.pipeline.stage import STAGE_FACTORIES

    named = [ref.partition(":")[0] for ref in STAGE_FACTORIES.values() if isinstance(ref, str)]
    return sorted({*named, "device_agents.pipeline.batching"})


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_stage_reaches_another_stage_or_the_pipeline() -> None:
    """A stage sees the request (``pipeline.stage``) and its own package; through no chain of
    imports does it reach another stage's module, or the pipeline that runs them."""
    graph = import_graph()
    stages = _stage_modules()
    assert len(stages) > 1 and all(s in graph for s in stages), stages
    offenders = []
    for stage in stages:
        reached = _reachable(graph, stage)
        offenders += [f"{stage} reaches {other}" for other in stages if other != stage and other in reached]
        if "device_agents.pipeline" in reached:
            offenders.append(f"{stage} reaches device_agents.pipeline (the Pipeline)")
    assert not offenders, offenders


# What a front-end (device_agents/serving/*) may import from device_agents: the service (the one
# API), its fellow front-end modules, and the types it shares with the layers under the service
# without reaching into them: the request and its timing (the pipeline's Request, RequestTiming),
# the signature decode reads (runtimes' ServedModel, processing's WireTensor: wire names, dtypes
# and shapes), the typed errors it maps to statuses, its config, the metrics exposition's content
# type, OS thread names. Anything else (lifecycle, registry, endpoints, store, batcher, stages'
# modules, updates) is below the service.
FRONT_END_MAY_IMPORT: dict[str, set[str] | None] = {  # module -> the names it may import (None: any)
    "device_agents": {"__version__"},
    "device_agents.service": None,
    "device_agents.serving": None,  # and every device_agents.serving.* module
    "device_agents.pipeline": {"Request", "RequestTiming"},
    "device_agents.pipeline.stage": {"Request", "RequestTiming"},
    "device_agents.runtimes": {"ServedModel", "TensorSpec"},
    "device_agents.processing.signature": {"WireTensor"},
    "device_agents.errors": None,
    "device_agents.config": None,
    "device_agents.metrics": {"CONTENT_TYPE"},
    "device_agents.threads": None,
}
# Imports allowed one by one, each with why it is not a reach below the service.
FRONT_END_EXCEPTIONS: dict[tuple[str, str, str], str] = {
    ("serving/console.py", "device_agents.store", "fsync_dir"): (
        "a file helper (fsync a directory after a rename) for the console's own upload files, not the store's API"
    ),
}


def _front_end_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) per name a front-end imports from device_agents (name "" for ``import m``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "device_agents":
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "device_agents"]
    return found


def _front_end_may(module: str, name: str) -> bool:
    if module.startswith("device_agents.serving."):
        return True
    allowed = FRONT_END_MAY_IMPORT.get(module, set())
    return allowed is None or name in allowed


@pytest.mark.parametrize(
    "module", sorted(p.name for p in (ROOT / "device_agents" / "serving").glob("*.py") if p.name != "__init__.py")
)
def test_front_end_reaches_nothing_below_the_service(module: str) -> None:
    rel = f"serving/{module}"
    bad = [
        f"{m}.{n}" if n else m
        for m, n in _front_end_imports(ROOT / "device_agents" / rel)
        if not _front_end_may(m, n) and (rel, m, n) not in FRONT_END_EXCEPTIONS
    ]
    assert not bad, f"device_agents/{rel} imports {bad}, below the service"


def test_front_end_rule_catches_a_reach_below_the_service(tmp_path: Path) -> None:
    path = tmp_path / "front.py"
    path.write_text(
        "from device_agents.service import AgentService\n"
        "from device_agents.pipeline import Request, Pipeline\n"
        "import device_agents.registry\n"
        "from device_agents.serving.v2 import v2_codec\n"
    )
    bad = [(m, n) for m, n in _front_end_imports(path) if not _front_end_may(m, n)]
    assert bad == [("device_agents.pipeline", "Pipeline"), ("device_agents.registry", "")]


def test_the_update_client_asks_the_lifecycle_and_never_reads_the_store() -> None:
    tree = ast.parse((ROOT / "device_agents" / "updates" / "client.py").read_text())
    reads = sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "store"
        and ast.unparse(node.value) != "config"  # config.store: the store's directory, for downloads beside it
    )
    assert not reads, f"device_agents/updates/client.py reaches the store at lines {reads}"


# -- host: the engine builds, targets describe ------------------------------------------------------

# What builds, measures and chooses: a target hands the engine its candidates and never calls back.
ENGINE_RUNNER = ("edgekit.optimize.run", "edgekit.optimize.engine", "edgekit.packaging")


def _target_offenders(graph: dict[str, set[str]], targets: set[str]) -> list[str]:
    """Imports of a target module that reach the engine's runner or another target's module."""
    offenders = []
    for target in sorted(targets):
        for imported in sorted(graph.get(target, ())):
            runner = any(imported == r or imported.startswith(r + ".") for r in ENGINE_RUNNER)
            if runner or imported in targets:
                offenders.append(f"{target} imports {imported}")
    return offenders


def test_no_target_imports_the_engine_runner_or_another_target() -> None:
    from edgekit.targets import TARGETS

    graph = import_graph()
    targets = {spec.partition(":")[0] for spec in TARGETS.values()}
    assert targets <= set(graph), sorted(targets - set(graph))
    offenders = _target_offenders(graph, targets)
    assert not offenders, "a target describes; only the engine builds: " + "; ".join(offenders)


def test_target_rule_catches_a_call_back_into_the_engine_and_a_sibling_target() -> None:
    graph = {
        "edgekit.targets.cpu": {"edgekit.optimize.run", "edgekit.targets.intel", "edgekit.optimize.candidates"},
        "edgekit.targets.intel": {"edgekit.optimize.openvino_candidates", "edgekit.targets.base"},
    }
    offenders = _target_offenders(graph, {"edgekit.targets.cpu", "edgekit.targets.intel"})
    assert offenders == [
        "edgekit.targets.cpu imports edgekit.optimize.run",
        "edgekit.targets.cpu imports edgekit.targets.intel",
    ]
