"""The architecture rules that keep host and device apart (DESIGN.md, house rule 2)."""

from __future__ import annotations

import ast
import importlib
import json
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


# layer -> device_agents modules it must not import (DESIGN.md "Device agent -> Layers")
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
