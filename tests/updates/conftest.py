"""Fixtures for the over-the-air update tests: real Mosquitto, file server and agent processes."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from examples.fleet_processes import MOSQUITTO
from tests.updates.bundles import bundle, padded_classifier
from tests.updates.services import Agent, AgentSpec, FileServer, Mosquitto

FLEET = "test-fleet"


class _SessionNoticeKey:
    """The session's notice key, set by the ``keys`` fixture, for ``publish`` calls that name none."""

    path: Path = Path("unset")


NOTICE_KEY = _SessionNoticeKey()


def require_mosquitto() -> None:
    if not Path(MOSQUITTO).exists():
        pytest.skip("mosquitto is not installed: apt-get install mosquitto (`make test` does)")


@dataclass(frozen=True)
class Keys:
    private: Path  # bundle role (trusted_keys)
    public: Path
    other_private: Path  # a bundle key no device trusts
    other_public: Path
    notice_private: Path  # notice role (updates.notice_keys): signs desired states
    notice_public: Path
    root_private: Path  # root role (updates.root_keys, where a test sets it): signs keys documents
    root_public: Path


@pytest.fixture(scope="session")
def keys(
    keypair: tuple[Path, Path], other_keypair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Keys:
    from edgekit.bundle import generate_keypair

    d = tmp_path_factory.mktemp("fleetkeys")
    notice, root = generate_keypair(d, "fleet"), generate_keypair(d, "root")
    NOTICE_KEY.path = notice[0]
    return Keys(keypair[0], keypair[1], other_keypair[0], other_keypair[1], *notice, *root)


@pytest.fixture(scope="session")
def tiny_bundles(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> dict[int, Path]:
    """``tiny`` v1..v4, signed with the trusted key; weights differ per version."""
    out = tmp_path_factory.mktemp("bundles")
    return {v: bundle(out / f"tiny-v{v}.ekb", keys.private, v) for v in (1, 2, 3, 4)}


@pytest.fixture(scope="session")
def padded_v2(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Path:
    """v2 of ``tiny`` at about 1 MB: larger than one download block, so a kill leaves a partial file."""
    out = tmp_path_factory.mktemp("padded")
    model = padded_classifier(out / "tiny-v2-padded.onnx", 1024 * 1024, seed=2)
    return bundle(out / "tiny-v2-padded.ekb", keys.private, 2, model=model)


@pytest.fixture(scope="session")
def seeded_stores(
    tmp_path_factory: pytest.TempPathFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> dict[int, Path]:
    """Store directories to copy: 1 = v1 installed; 2 = v1 then v2 installed (v1 is previous)."""
    from device_agents.config import config_from_data
    from device_agents.lifecycle import Lifecycle

    stores = {}
    for top in (1, 2):
        root = tmp_path_factory.mktemp(f"store-v{top}")
        config = config_from_data({"store": str(root), "trusted_keys": [str(keys.public)]}, base=root)
        manager = Lifecycle(config)
        try:
            for v in range(1, top + 1):
                manager.install(tiny_bundles[v], origin="test seed")
        finally:
            manager.stop()
        stores[top] = root
    return stores


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    require_mosquitto()
    b = Mosquitto.plain(tmp_path / "broker").start()
    yield b
    b.kill()


@pytest.fixture
def files(tmp_path: Path) -> Iterator[FileServer]:
    f = FileServer(tmp_path / "www", tmp_path / "www.log").start()
    yield f
    f.kill()


AgentFactory = Callable[..., Agent]


@pytest.fixture
def agents(tmp_path: Path, keys: Keys, seeded_stores: dict[int, Path]) -> Iterator[AgentFactory]:
    """``agents(broker_url, device_id, seed=1, **spec_fields)`` -> an Agent (not started yet)."""
    made: list[Agent] = []

    def make(broker_url: str, device_id: str = "dev-1", *, seed: int | None = 1, **fields: Any) -> Agent:
        store = tmp_path / f"store-{device_id}"
        if seed is not None:
            shutil.copytree(seeded_stores[seed], store)
        fields.setdefault("notice_keys", (keys.notice_public,))
        spec = AgentSpec(
            store=store, trusted_keys=(keys.public,), broker=broker_url, fleet=FLEET, device_id=device_id, **fields
        )
        agent = Agent(spec, tmp_path / f"agent-{device_id}")
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.kill()


def edgekit(*args: str) -> str:
    """Run the real ``edgekit`` CLI in-process; return its stdout (fail on a non-zero exit)."""
    from edgekit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    if rc != 0:
        raise AssertionError(f"edgekit {' '.join(args)} exited {rc}: {err.getvalue()}{out.getvalue()}")
    return out.getvalue()


def publish(
    bundle_path: Path,
    broker_url: str,
    files: FileServer,
    trusted_pub: Path,
    *targets: str,
    tls: tuple[Path, Path, Path] | None = None,
    rollout: int | None = None,
    notice_key: Path | None = None,
    fresh_for: str | None = None,
) -> str:
    """``edgekit publish`` with --copy-to the file server; ``targets`` are ``--device X`` / ``--group G``.

    Signed with ``notice_key`` (default: the session's notice key). Returns the notice id printed by the CLI.
    """
    args = [
        "publish", str(bundle_path), "--broker", broker_url, "--fleet", FLEET,
        "--base-url", files.base_url, "--copy-to", str(files.dir), "--trusted-key", str(trusted_pub), *targets,
        "--notice-key", str(notice_key or NOTICE_KEY.path),
    ]  # fmt: skip
    if fresh_for is not None:
        args += ["--fresh-for", fresh_for]
    if rollout is not None:
        args += ["--rollout", str(rollout)]
    if tls is not None:
        args += ["--ca", str(tls[0]), "--cert", str(tls[1]), "--tls-key", str(tls[2])]
    out = edgekit(*args)
    m = re.search(r"\(notice ([0-9a-f]+),", out)
    assert m, out
    return m.group(1)
