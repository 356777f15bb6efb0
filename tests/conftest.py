"""Shared fixtures: signing keys and a tiny conv-net classifier built in code."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import tiny_classifier


@pytest.fixture(scope="session")
def keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from edgekit.bundle import generate_keypair

    return generate_keypair(tmp_path_factory.mktemp("keys"), "test")


@pytest.fixture(scope="session")
def other_keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from edgekit.bundle import generate_keypair

    return generate_keypair(tmp_path_factory.mktemp("otherkeys"), "other")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_classifier(tmp_path_factory.mktemp("models") / "tiny.onnx")


# Acceptance tests record how far each gate was cleared ("margin: 9 samples"); printed at the end
# of the run so that a thin margin is seen before it turns into a failure on another machine.
_GATE_MARGINS: list[str] = []


def record_gate(line: str) -> None:
    _GATE_MARGINS.append(line)


def gate_margin(label: str, agreement: float, samples: int, gate: float) -> str:
    """Record and return one line: the agreement, the gate and the margin in samples."""
    import math

    agreeing = round(agreement * samples)
    needed = math.ceil(gate * samples - 1e-9)
    line = (
        f"{label}: top-1 agreement {agreement:.4f} on {samples} held-out samples, gate {gate:.2f} "
        f"(needs {needed}): margin {agreeing - needed} samples"
    )
    record_gate(line)
    return line


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _GATE_MARGINS:
        terminalreporter.section("acceptance gate margins")
        for line in _GATE_MARGINS:
            terminalreporter.write_line(line)
