"""Fixtures for the target tests: open a packaged bundle the way the agent does, block the network."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from edgekit.bundle import TrustStore, extract, read_verified_manifest
from edgekit.bundle.manifest import Manifest


@pytest.fixture(scope="session")
def open_bundle(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]
) -> Callable[[Path], tuple[Path, Manifest]]:
    """Verify a bundle signed with the test key and extract it: (model dir, manifest)."""
    trust = TrustStore.from_files([keypair[1]])

    def open_(bundle: Path) -> tuple[Path, Manifest]:
        verified = read_verified_manifest(bundle, trust)
        dest = extract(bundle, verified, tmp_path_factory.mktemp("extracted") / "model")
        return dest, verified.manifest

    return open_


@contextmanager
def no_network() -> Iterator[list[Any]]:
    """Every connection attempt (and name lookup) raises; the list collects what was attempted."""
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args[1:] or args)
        raise OSError("network access attempted during an offline conversion")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket.socket, "connect_ex", refuse)
        mp.setattr(socket, "getaddrinfo", refuse)
        yield attempts
