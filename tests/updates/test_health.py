"""The switch under load, and rollback when the new version is unhealthy on this device."""

from __future__ import annotations

import re
import threading
import time
import urllib.error
from pathlib import Path

import numpy as np

from tests.factories import sample_inputs
from tests.updates.bundles import bundle, fragile_classifier
from tests.updates.conftest import FLEET, AgentFactory, Keys, publish
from tests.updates.services import Agent, FileServer, Mosquitto, Watcher, wait_for

REPORTED = f"edgekit/{FLEET}/dev-1/reported"


class Load:
    """v2 inference requests in a loop on another thread, bounded in count and time."""

    def __init__(self, agent: Agent, x: np.ndarray, *, max_requests: int = 5000, max_s: float = 60.0) -> None:
        self.results: list[int | str] = []  # the model version that answered, or the error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(agent, x, max_requests, max_s), daemon=True)
        self._thread.start()

    def _run(self, agent: Agent, x: np.ndarray, max_requests: int, max_s: float) -> None:
        deadline = time.monotonic() + max_s
        while not self._stop.is_set() and len(self.results) < max_requests and time.monotonic() < deadline:
            try:
                self.results.append(agent.infer("tiny", x)[0])
            except urllib.error.HTTPError as exc:
                self.results.append(f"HTTP {exc.code}")
            except OSError as exc:
                self.results.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> list[int | str]:
        self._stop.set()
        self._thread.join(30)
        return self.results


def test_no_request_fails_while_the_agent_switches_versions_under_load(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1").start()
    load = Load(agent, sample_inputs(1, seed=5))
    try:
        wait_for(lambda: len(load.results) >= 20, 30, "requests before the update")
        publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
        wait_for(lambda: load.results.count(2) >= 50, 60, "requests answered by v2")
    finally:
        results = load.stop()
    failures = [r for r in results if not isinstance(r, int)]
    assert not failures, failures[:5]
    first_v2 = results.index(2)
    assert set(results[:first_v2]) == {1} and set(results[first_v2:]) == {2}


def test_version_that_fails_requests_in_its_health_window_is_rolled_back(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tmp_path: Path
) -> None:
    fragile = bundle(tmp_path / "tiny-v2-fragile.ekb", keys.private, 2, model=fragile_classifier(tmp_path / "f.onnx"))
    agent = agents(broker.url(), "dev-1").start()
    field_input = sample_inputs(1, seed=5) * 20  # values far outside the golden vectors
    watcher = Watcher(broker.port, [REPORTED])
    load = Load(agent, field_input)
    try:
        notice = publish(fragile, broker.url(), files, keys.public, "--device", "dev-1")
        report = watcher.wait(
            lambda r: r["notice_id"] == notice and r["state"] in ("rolled_back", "serving"), 60, "the health verdict"
        )
        wait_for(lambda: load.results[-1:] == [1], 30, "v1 to answer again")
    finally:
        results = load.stop()
        watcher.close()
    assert report["state"] == "rolled_back", report
    assert re.search(r"v2 failed \d+ of \d+ requests in its health window", report["error"]), report["error"]
    assert report["version"] == 1 and agent.served_version("tiny") == 1
    assert "HTTP 500" in results  # v2 did serve, and failed
    assert agent.metric("edgekit_rollbacks_total", model="tiny") == 1


def test_version_that_keeps_crashing_the_agent_is_rolled_back(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1", extra_updates={"health_window_s": 120.0, "crash_loop_boots": 2}).start()
    watcher = Watcher(broker.port, [REPORTED])
    try:
        notice = publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
        watcher.wait(lambda r: r["state"] == "checking" and r["version"] == 2, 30, "v2 in its health window")
    finally:
        watcher.close()
    agent.kill()  # a crash inside the health window ...
    agent.start()
    assert agent.served_version("tiny") == 2  # ... once is not a loop
    agent.kill()
    watcher = Watcher(broker.port, [REPORTED])
    try:
        agent.start()
        assert agent.served_version("tiny") == 1
        report = watcher.wait(lambda r: r["state"] == "rolled_back", 30, "the rollback report")
        wait_for(lambda: re.search(rf"ignore: notice {notice} .*handled already", agent.log()), 20, "the notice")
    finally:
        watcher.close()
    assert "crash loop" in report["error"] and report["version"] == 1
    assert agent.served_version("tiny") == 1  # the retained notice for v2 does not bring it back


def test_requests_the_previous_version_fails_too_do_not_count_against_the_new_one(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tmp_path: Path
) -> None:
    # Both versions fail on field inputs (a data-dependent Gather) that only arrive once v2 serves:
    # v2 fails far more often than v1 did, yet v1 fails on the same inputs: the input is at fault.
    fragile = {v: fragile_classifier(tmp_path / f"f{v}.onnx", seed=v) for v in (1, 2)}
    v1, v2 = (bundle(tmp_path / f"tiny-v{v}-fragile.ekb", keys.private, v, model=fragile[v]) for v in (1, 2))
    # a window long enough for several field requests on a busy machine
    agent = agents(broker.url(), "dev-1", seed=None, extra_updates={"health_window_s": 6.0}).start()
    watcher = Watcher(broker.port, [REPORTED])
    good = field = None
    try:
        first = publish(v1, broker.url(), files, keys.public, "--device", "dev-1")
        watcher.wait(lambda r: r["notice_id"] == first and r["state"] == "serving", 60, "v1 serving")
        good = Load(agent, sample_inputs(1, seed=5))
        wait_for(lambda: len(good.results) >= 20, 30, "requests before the update")  # type: ignore[union-attr]  # set above
        notice = publish(v2, broker.url(), files, keys.public, "--device", "dev-1")
        watcher.wait(lambda r: r["notice_id"] == notice and r["state"] == "checking", 60, "v2 in its health window")
        good.stop()
        field = Load(agent, sample_inputs(1, seed=5) * 20)
        report = watcher.wait(
            lambda r: r["notice_id"] == notice and r["state"] in ("rolled_back", "serving"), 60, "the health verdict"
        )
    finally:
        for load in (good, field):
            if load is not None:
                load.stop()
        watcher.close()
    assert field is not None and field.results.count("HTTP 500") >= 3  # v2 failed field requests in its window
    assert report["state"] == "serving", report
    assert agent.served_version("tiny") == 2
    assert "v2 failed a request v1 fails too; not counted against it" in agent.log()  # replayed on v1
    assert agent.metric("edgekit_rollbacks_total", model="tiny") == 0
