"""Agent fixtures: a set of good and bad bundles, configs, and a real `edgekit-agent run` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from device_agents.serving.tls import local_context_for
from examples.agent_process import pinned
from tests.agent.bundles import rebundle, reshape_model, tamper
from tests.factories import make_cpu_bundle, sample_inputs

if TYPE_CHECKING:
    from device_agents.lifecycle import Lifecycle

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux CPU affinity and two CPUs",
)


@contextmanager
def one_cpu() -> Iterator[int]:
    """This thread on one of its CPUs (as ``taskset -c`` or systemd's ``CPUAffinity=`` leave a
    process; threads and processes it starts meanwhile inherit it); yields that CPU."""
    cpu = max(os.sched_getaffinity(0))
    with pinned({cpu}):
        yield cpu


@dataclass(frozen=True)
class Bundles:
    v1: Path
    v2: Path
    v3_bad_golden: Path
    v4: Path
    expired: Path
    untrusted: Path
    tampered_artifact: Path
    tampered_manifest: Path
    wrong_arch: Path
    unknown_runtime: Path
    runtime_fails: Path  # a garbage .onnx whose hashes match the manifest
    reshape: Path  # model "reshape": fails at run time for batch > 1


@pytest.fixture(scope="session")
def bundles(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    keypair: tuple[Path, Path],
    other_keypair: tuple[Path, Path],
) -> Bundles:
    d = tmp_path_factory.mktemp("bundles")
    key = keypair[0]
    v1 = make_cpu_bundle(d / "tiny-1.ekb", tiny_model, key, version=1)
    v2 = make_cpu_bundle(d / "tiny-2.ekb", tiny_model, key, version=2)
    v5 = make_cpu_bundle(d / "tiny-5.ekb", tiny_model, key, version=5)
    reshape_onnx = reshape_model(d / "reshape.onnx")
    return Bundles(
        v1=v1,
        v2=v2,
        v3_bad_golden=make_cpu_bundle(d / "tiny-3-bad.ekb", tiny_model, key, version=3, corrupt_golden=True),
        v4=make_cpu_bundle(d / "tiny-4.ekb", tiny_model, key, version=4),
        expired=make_cpu_bundle(d / "tiny-expired.ekb", tiny_model, key, version=6, expires="2001-01-01T00:00:00Z"),
        untrusted=make_cpu_bundle(d / "tiny-untrusted.ekb", tiny_model, other_keypair[0], version=6),
        tampered_artifact=tamper(v5, d / "tiny-tampered-artifact.ekb", "model.onnx"),
        tampered_manifest=tamper(
            v5, d / "tiny-tampered-manifest.ekb", "manifest.json", lambda b: b.replace(b'"version": 5', b'"version": 7')
        ),
        wrong_arch=rebundle(v5, key, d / "tiny-riscv.ekb", compat={"arch": ("riscv64",)}),
        unknown_runtime=rebundle(v5, key, d / "tiny-npu.ekb", compat={"runtime": "hailort"}),
        runtime_fails=rebundle(v5, key, d / "tiny-garbage.ekb", files={"model.onnx": b"not an onnx model" * 64}),
        reshape=make_cpu_bundle(
            d / "reshape-1.ekb", reshape_onnx, key, name="reshape", golden_inputs=np.ones((1, 4), np.float32)
        ),
    )


@pytest.fixture(scope="module")
def installed(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], bundles: Bundles
) -> Iterator[Lifecycle]:
    """A started lifecycle with ``tiny`` v1 installed, one per test module (in-process: no agent)."""
    from device_agents.config import load_config
    from device_agents.lifecycle import Lifecycle

    lc = Lifecycle(load_config(write_config(tmp_path_factory.mktemp("installed"), keypair[1])))
    lc.start()
    lc.install(bundles.v1)
    yield lc
    lc.stop()


def write_config(directory: Path, pub: Path, extra: str = "", *, listen: str = "127.0.0.1:0") -> Path:
    """An agent.toml with a relative store and key path (resolved against ``directory``)."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = directory / "keys"
    keys.mkdir(exist_ok=True)
    (keys / "trusted.pub").write_bytes(pub.read_bytes())
    path = directory / "agent.toml"
    path.write_text(
        "config_version = 2\n"
        f'store = "store"\nlisten = "{listen}"\ntrusted_keys = ["keys/trusted.pub"]\n'
        f"[runtimes.onnxruntime]\nthreads = 1\n{extra}"
    )
    return path


@pytest.fixture()
def config_path(tmp_path: Path, keypair: tuple[Path, Path]) -> Path:
    return write_config(tmp_path / "agent", keypair[1])


def agent_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real ``edgekit-agent`` entry point."""
    return subprocess.run(
        [sys.executable, "-m", "device_agents.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@dataclass
class RunningAgent:
    proc: subprocess.Popen[bytes]
    url: str
    config: Path
    log: Path

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def start_agent(
    config: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = (), prefix: tuple[str, ...] = ()
) -> RunningAgent:
    """Start `edgekit-agent run` (with ``args`` after the subcommand, the whole command after ``prefix``,
    e.g. an ``unshare`` wrapper) and wait until it answers /v2/health/ready."""
    store = config.parent / "store"
    info = store / "daemon.json"
    info.unlink(missing_ok=True)
    log = config.parent / "agent.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "device_agents.cli", "run", "--config", str(config), *args],
            stdout=out,
            stderr=out,
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited {proc.returncode}:\n{log.read_text()}")
        try:
            url = json.loads(info.read_text())["url"]
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2, context=local_context_for(url)) as r:
                if r.status == 200:
                    return RunningAgent(proc, url, config, log)
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"agent did not become ready:\n{log.read_text()}")


@pytest.fixture()
def good_input() -> np.ndarray:
    return sample_inputs(2, seed=7)


AgentFactory = Callable[..., RunningAgent]


@pytest.fixture()
def agent_factory() -> Iterator[AgentFactory]:
    started: list[RunningAgent] = []

    def factory(config: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> RunningAgent:
        agent = start_agent(config, env, args)
        started.append(agent)
        return agent

    yield factory
    for agent in started:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
