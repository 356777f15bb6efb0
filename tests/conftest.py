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
