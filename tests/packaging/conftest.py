"""Packaging fixtures: the agent test bundles (shared with tests/agent) and a NOTIFY_SOCKET listener."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.conftest import bundles  # noqa: F401  # re-exported fixture: signed tiny-model bundles
from tests.packaging.notify import NotifyListener


@pytest.fixture()
def notify_listener(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NotifyListener]:
    # a short path: AF_UNIX paths are limited to 107 bytes
    listener = NotifyListener(tmp_path_factory.mktemp("n") / "notify.sock")
    yield listener
    listener.close()


@pytest.fixture()
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
