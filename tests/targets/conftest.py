"""Fixtures for the target tests: package the tiny classifier, open a bundle the way the agent does, block the
network."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from edgekit.bundle import TrustStore, extract, read_verified_manifest
from edgekit.bundle.manifest import Manifest
from edgekit.packaging.result import PackageResult
from tests.factories import confident_inputs, tiny_classifier
from tests.factories import package_small_data as package


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


@pytest.fixture(scope="session")
def package_tiny(
    tmp_path_factory: pytest.TempPathFactory,
    keypair: tuple[Path, Path],
    open_bundle: Callable[[Path], tuple[Path, Manifest]],
) -> Callable[..., tuple[PackageResult, Manifest, Path]]:
    """``edgekit.package`` of the tiny classifier for one target, calibrated on ``samples`` confident
    inputs; returns (result, verified manifest, extracted model dir)."""

    def package_(
        target: str, precision: str, samples: int, options: Mapping[str, Any] | None = None
    ) -> tuple[PackageResult, Manifest, Path]:
        root = tmp_path_factory.mktemp(f"{target}-pkg")
        model = tiny_classifier(root / "tiny.onnx")
        result = package(
            model,
            targets=[target],
            precision=precision,
            calib={"input": confident_inputs(model, samples)},
            key=keypair[0],
            name="tiny",
            version=1,
            out_dir=root / "out",
            options=options,
        )
        model_dir, manifest = open_bundle(result.bundles[target])
        return result, manifest, model_dir

    return package_


@contextmanager
def no_network() -> Iterator[list[Any]]:
    """Every connection attempt (and name lookup) made by this thread raises; the list collects what
    was attempted. Other threads (daemon threads an earlier test left, such as a split stage's link
    probes to 127.0.0.1) go through: the conversion runs in this thread."""
    attempts: list[Any] = []
    mine = threading.get_ident()
    real = {"connect": socket.socket.connect, "connect_ex": socket.socket.connect_ex, "getaddrinfo": socket.getaddrinfo}

    def refusing(name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != mine:
                return real[name](*args, **kwargs)
            attempts.append(args[1:] or args)
            raise OSError("network access attempted during an offline conversion")

        return refuse

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refusing("connect"))
        mp.setattr(socket.socket, "connect_ex", refusing("connect_ex"))
        mp.setattr(socket, "getaddrinfo", refusing("getaddrinfo"))
        yield attempts
