"""The HIL suite's fixtures: the board (labgrid), the bundles it runs, the report.

    pytest hil/ --lg-env hil/boards/virtual.yaml --report DIR

The suite signs its bundles with ``--hil-key`` (a private key the board's agent trusts); without
it, a key is made for the run, which only the virtual board trusts (it writes its own config).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hil.report import HilReport

MODEL = "hil-tiny"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("edgekit hil")
    group.addoption("--report", type=Path, metavar="DIR", help="write report.md, report.json and PNG plots here")
    group.addoption("--hil-key", type=Path, metavar="KEY", help="private key the board's agent trusts")
    group.addoption("--latency-requests", type=int, default=300, help="batch-1 requests timed (default 300)")
    group.addoption("--offline-s", type=float, default=10.0, help="seconds the board serves offline (default 10)")


_REPORT: HilReport | None = None


def _report(config: pytest.Config) -> HilReport:
    global _REPORT
    if _REPORT is None:
        env = config.getoption("lg_env", None)
        _REPORT = HilReport(Path(env).stem if env else "no board")
    return _REPORT


@pytest.fixture(scope="session")
def report(pytestconfig: pytest.Config) -> HilReport:
    return _report(pytestconfig)


@pytest.fixture(autouse=True)
def _mark_scenario(request: pytest.FixtureRequest, report: HilReport) -> None:
    report.mark(request.node.name.removeprefix("test_"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]  # pluggy's result object
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        scenario = _report(item.config).scenario(item.name.removeprefix("test_"))
        scenario.outcome = rep.outcome
        scenario.seconds = rep.duration if rep.when == "call" else 0.0
        if rep.skipped and isinstance(rep.longrepr, tuple):
            scenario.reason = str(rep.longrepr[2]).removeprefix("Skipped: ")
        elif rep.failed:
            scenario.reason = str(getattr(rep.longrepr, "reprcrash", None) and rep.longrepr.reprcrash.message)[:300]  # type: ignore[union-attr]  # a failed call's longrepr has reprcrash


def pytest_sessionfinish(session: pytest.Session) -> None:
    directory = session.config.getoption("report", None)
    if directory is not None and _REPORT is not None:
        for path in _REPORT.write(Path(directory)):
            print(f"\nwrote {path}")


# -- bundles ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HilBundles:
    private_key: Path
    public_key: Path
    model: Path  # the ONNX model packaged
    v1: Path  # packaged with `edgekit.package`: host latency recorded, golden vectors
    manifest: Any  # v1's verified manifest
    golden: dict[str, np.ndarray]  # v1's golden vectors: in_<name>, out_<name>

    def package(self, version: int, out: Path, name: str = MODEL) -> Path:
        """Version ``version`` of the same model (as ``name``), packaged and signed like v1."""
        import edgekit
        from tests.factories import sample_inputs

        result = edgekit.package(
            self.model,
            targets=["cpu"],
            precision="fp32",
            eval={"input": sample_inputs(64, size=32, seed=version)},
            key=self.private_key,
            name=name,
            version=version,
            out_dir=out,
        )
        return Path(result.bundles["cpu"])


@pytest.fixture(scope="session")
def hil_bundles(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> HilBundles:
    from edgekit.bundle import TrustStore, extract, generate_keypair, read_verified_manifest
    from tests.factories import tiny_classifier

    d = tmp_path_factory.mktemp("hil-bundles")
    given = pytestconfig.getoption("hil_key")
    if given is not None:
        private, public = Path(given), Path(given).with_suffix(".pub")
    else:
        private, public = generate_keypair(d, "hil")
    model = tiny_classifier(d / "tiny.onnx", size=32, channels=3)
    partial = HilBundles(private, public, model, Path(), None, {})
    v1 = partial.package(1, d / "v1")
    verified = read_verified_manifest(v1, TrustStore.from_files([public]))
    opened = extract(v1, verified, d / "v1-open")
    golden_file = verified.manifest.golden.file if verified.manifest.golden else "golden.npz"
    with np.load(opened / golden_file) as z:
        golden = {k: z[k] for k in z.files}
    return HilBundles(private, public, model, v1, verified.manifest, golden)


# -- the board --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def strategy(target: Any, hil_bundles: HilBundles, report: HilReport) -> Iterator[Any]:
    """The board in state ``ready``; for the virtual board, built here (and torn down after)."""
    from hil.labgrid_edgekit import VirtualBoardDriver
    from hil.virtual_board import unsupported_reason

    strategy = target.get_driver("EdgekitStrategy")
    virtual = target.get_driver("VirtualBoardDriver", activate=False) if _has(target, "VirtualBoardDriver") else None
    if isinstance(virtual, VirtualBoardDriver):
        reason = unsupported_reason()
        if reason is not None:
            pytest.skip(reason)  # not root, not Linux; as root on Linux a failure to build it is an error
        target.activate(virtual)
        assert virtual.board is not None
        virtual.board.trusted_keys = (hil_bundles.public_key.resolve(),)
    sampler = _RssSampler(strategy.agent, report)
    try:
        strategy.transition("ready")
        sampler.start()
        yield strategy
    finally:
        sampler.stop()
        target.deactivate_all_drivers()  # the virtual board: agent killed, namespace, mount, cgroup removed


def _has(target: Any, name: str) -> bool:
    return any(type(d).__name__ == name for d in target.drivers)


class _RssSampler(threading.Thread):
    """The agent's RSS every 0.25 s for the whole run (the report's RSS-over-time plot)."""

    def __init__(self, agent: Any, report: HilReport) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.agent, self.report = agent, report
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.25):
            try:
                rss = self.agent.rss_bytes()
            except Exception:  # a board mid-reboot: no reading this time
                rss = None
            if rss:
                self.report.add_rss(rss)

    def stop(self) -> None:
        self._stop_event.set()


@pytest.fixture()
def agent(strategy: Any) -> Any:
    """The agent driver, its board ready (a scenario that cut the power brought it back)."""
    if strategy.status.name != "ready":
        strategy.transition("ready")
    return strategy.agent


@pytest.fixture()
def installed(agent: Any, hil_bundles: HilBundles) -> Any:
    """``hil-tiny`` v1 or later installed on the board (over the console)."""
    with agent.console.client(timeout_s=60) as board:
        if board.status()["models"].get(MODEL) is None:
            board.install(hil_bundles.v1)
    return agent
