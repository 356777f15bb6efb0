"""Acceptance scenarios on a board: what edgekit packaged runs there, is fast enough, and survives
power cuts, updates and network loss. Each scenario records what it measured in the report.

Timings are reported, and held to a limit only where the board file sets one
(``EdgekitAgent.max_p99_ms``, ``max_rss_mb``): a board's numbers are its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.fleet_processes import wait_for
from hil.conftest import MODEL, HilBundles
from hil.report import HilReport

FLEET = "hil"


def _status(agent: Any) -> dict[str, Any]:
    with agent.console.client(timeout_s=60) as board:
        status: dict[str, Any] = board.status()
    return status


def test_boot_to_ready(strategy: Any, report: HilReport) -> None:
    """Power off and on; the time until the console answers and the agent reports ready."""
    times = [strategy.power_cut() for _ in range(3)]
    status = _status(strategy.agent)
    assert status["ready"]
    report.measure(
        "boot_to_ready",
        boots=len(times),
        boot_to_ready_s_min=min(times),
        boot_to_ready_s_max=max(times),
        first_boot_s=strategy.boot_s[0],
    )


def test_install_over_serial_only(agent: Any, hil_bundles: HilBundles, report: HilReport) -> None:
    """The bundle goes over the console with the network cable pulled (where the board can pull it)."""
    pulled = _network(agent, up=False)
    try:
        with agent.console.client(timeout_s=120) as board:
            before = board.status()["models"].get(MODEL)
            started = time.monotonic()
            result = board.install(hil_bundles.v1)
            seconds = time.monotonic() - started
            status = board.status()
    finally:
        if pulled:
            _network(agent, up=True)
    assert status["models"][MODEL] >= 1 and status["status"][MODEL]["status"] in ("serving", "active")
    report.measure(
        "install_over_serial_only",
        network="pulled" if pulled else "not pulled (no network_off_cmd)",
        bundle_bytes=hil_bundles.v1.stat().st_size,
        install_s=seconds,
        changed=result["changed"] if before is None else f"already v{before}",
    )


def test_install_over_the_network(agent: Any, hil_bundles: HilBundles, report: HilReport, tmp_path: Path) -> None:
    """The bundle copied onto the board and handed to the running agent there (SSH on a real board:
    ``edgekit-agent install``), then served over the network."""
    if agent.command is None:
        pytest.skip("the board file has no SSHDriver: install over the network needs a shell on the board")
    name = f"{MODEL}-net"
    bundle = hil_bundles.package(1, tmp_path, name=name)
    started = time.monotonic()
    printed = agent.install_network(bundle)
    seconds = time.monotonic() - started
    assert f"{name} v1" in printed, printed
    assert _status(agent)["models"].get(name) == 1
    x = {k.removeprefix("in_"): v for k, v in hil_bundles.golden.items() if k.startswith("in_")}
    if agent.url:
        out = agent.infer_http(name, x)
        expected = hil_bundles.golden[next(k for k in hil_bundles.golden if k.startswith("out_"))]
        np.testing.assert_allclose(next(iter(out.values())), expected, rtol=1e-4, atol=1e-5)
    report.measure("install_over_the_network", install_s=seconds, printed=printed.strip())


def test_golden_vectors_on_the_board(installed: Any, hil_bundles: HilBundles, report: HilReport) -> None:
    """The bundle's golden vectors, run on the board (console and network), within their tolerances."""
    golden = hil_bundles.manifest.golden
    inputs = {k.removeprefix("in_"): v for k, v in hil_bundles.golden.items() if k.startswith("in_")}
    expected = {k.removeprefix("out_"): v for k, v in hil_bundles.golden.items() if k.startswith("out_")}
    with installed.console.client(timeout_s=60) as board:
        via_console = board.infer(MODEL, inputs)
    paths = {"console": via_console}
    if installed.url:
        paths["network"] = installed.infer_http(MODEL, inputs)
    worst_abs, worst_cos = 0.0, 1.0
    for path, outputs in paths.items():
        for name, want in expected.items():
            got = outputs[name].astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=golden.rtol, atol=golden.atol, err_msg=f"{path}: {name}")
            worst_abs = max(worst_abs, float(np.max(np.abs(got - want))))
            cos = float(np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want) + 1e-30))
            worst_cos = min(worst_cos, cos)
            assert cos >= golden.min_cosine, f"{path}: {name} cosine {cos:.4f} < {golden.min_cosine}"
    report.measure(
        "golden_vectors_on_the_board",
        vectors=golden.count,
        paths="+".join(paths),
        max_abs_error=worst_abs,
        min_cosine=worst_cos,
        atol=golden.atol,
    )


def test_latency_batch1_against_recorded(
    installed: Any, hil_bundles: HilBundles, report: HilReport, pytestconfig: pytest.Config
) -> None:
    """p50/p99 of batch-1 requests over the network, beside the bundle's recorded host p50/p90."""
    if not installed.url:
        pytest.skip("the board file gives no network address for the agent (EdgekitAgent.url)")
    count = int(pytestconfig.getoption("latency_requests"))
    x = hil_bundles.golden[next(k for k in hil_bundles.golden if k.startswith("in_"))][:1]
    name = next(k for k in hil_bundles.golden if k.startswith("in_")).removeprefix("in_")
    for _ in range(20):  # warm-up: connection, first calls
        installed.infer_http(MODEL, {name: x})
    energy_before, energy_started = _energy_j(installed.url, installed.headers), time.monotonic()
    times_ms = []
    for _ in range(count):
        started = time.perf_counter()
        installed.infer_http(MODEL, {name: x})
        times_ms.append((time.perf_counter() - started) * 1000)
    sent = count
    if energy_before is not None:  # the agent samples its meter each second: a few seconds of load
        while time.monotonic() - energy_started < 5.0:
            installed.infer_http(MODEL, {name: x})
            sent += 1
    energy_after = _energy_j(installed.url, installed.headers)
    values = sorted(times_ms)
    p50, p99 = values[len(values) // 2], values[min(len(values) - 1, int(len(values) * 0.99))]
    validation = hil_bundles.manifest.validation
    report.latencies_ms = times_ms
    report.recorded_p50_ms = validation.latency_p50_ms
    report.measure(
        "latency_batch1_against_recorded",
        requests=count,
        p50_ms=p50,
        p99_ms=p99,
        recorded_host_p50_ms=validation.latency_p50_ms,
        recorded_host_p90_ms=validation.latency_p90_ms,
        p50_over_recorded=p50 / validation.latency_p50_ms if validation.latency_p50_ms else None,
        note="board: HTTP round trip over the network; recorded: the runtime call on the packaging host",
        energy_mj_per_request=(
            (energy_after[0] - energy_before[0]) * 1000 / sent
            if energy_before is not None and energy_after is not None
            else "no energy reader on this board"
        ),
        energy_reader=energy_before[1] if energy_before is not None else "none",
    )
    limit = installed.agent.max_p99_ms
    if limit is not None:
        assert p99 <= limit, f"p99 {p99:.2f} ms is over the board file's max_p99_ms {limit}"


def test_rss_against_estimates(installed: Any, hil_bundles: HilBundles, report: HilReport, tmp_path: Path) -> None:
    """The agent's resident memory serving the model, and what one more loaded copy of it adds,
    beside the bundle's estimate (the memory of one loaded session) where it has one."""
    if installed.rss_bytes() is None:
        pytest.skip("the board offers no way to read the agent's RSS (no SSHDriver)")
    x = {k.removeprefix("in_"): v for k, v in hil_bundles.golden.items() if k.startswith("in_")}
    name = f"{MODEL}-rss"
    bundle = hil_bundles.package(1, tmp_path, name=name)
    with installed.console.client(timeout_s=120) as board:
        for _ in range(50):
            board.infer(MODEL, x)
        before = _steady_rss(installed)
        board.install(bundle)
        for _ in range(50):
            board.infer(name, x)
        after = _steady_rss(installed)
    estimates = hil_bundles.manifest.estimates
    estimate = None if estimates is None else estimates.memory_mb
    delta_mb = (after - before) / 2**20
    report.measure(
        "rss_against_estimates",
        agent_rss_mb=after / 2**20,
        one_more_model_mb=delta_mb,
        estimate_mb=estimate if estimate is not None else "none in the bundle",
        note="agent_rss: the whole agent (runtime, Python, every model); one_more_model: RSS added by loading "
        "and serving another copy of the model in the running agent; estimate: the packager's, a first load and "
        "inference in a fresh process (the runtime's one-time costs included, so above one_more_model)",
    )
    limit = installed.agent.max_rss_mb
    if limit is not None:
        assert after / 2**20 <= limit, f"RSS {after / 2**20:.1f} MB is over the board file's max_rss_mb {limit}"


def _steady_rss(agent: Any) -> int:
    """The agent's RSS once two readings 0.5 s apart agree within 1 MiB (the largest of the last two)."""
    last = agent.rss_bytes() or 0
    for _ in range(20):
        time.sleep(0.5)
        now = agent.rss_bytes() or 0
        if abs(now - last) < 2**20:
            return max(now, last)
        last = now
    return last


def test_offline_while_serving(
    installed: Any, hil_bundles: HilBundles, report: HilReport, pytestconfig: pytest.Config
) -> None:
    """The network cable pulled for N seconds: the agent keeps serving (over its console), and
    answers over the network again once it is back."""
    seconds = float(pytestconfig.getoption("offline_s"))
    x = {k.removeprefix("in_"): v for k, v in hil_bundles.golden.items() if k.startswith("in_")}
    if not _network(installed, up=False):
        pytest.skip("the board file has no network_off_cmd / network_on_cmd (and it is not the virtual board)")
    served = 0
    try:
        if installed.url:
            with pytest.raises(OSError):
                installed.infer_http(MODEL, x, timeout_s=1.0)
        with installed.console.client(timeout_s=30) as board:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                board.infer(MODEL, x)
                served += 1
                time.sleep(0.1)
    finally:
        _network(installed, up=True)
    back = wait_for(lambda: _try_http(installed, x), 30, "the agent to answer over the network again")
    report.measure("offline_while_serving", offline_s=seconds, served_offline=served, back_online_s=back)


def test_mqtt_update_with_power_cut_during_staging(
    strategy: Any, hil_bundles: HilBundles, report: HilReport, tmp_path: Path
) -> None:
    """An update over MQTT; the power is cut while it is staged; the board comes back serving one
    consistent version, and then completes the update."""
    from hil.labgrid_edgekit import VirtualBoardDriver

    power = strategy.power
    if not isinstance(power, VirtualBoardDriver) or power.board is None:
        pytest.skip("the update scenario drives the virtual board's agent config; on a real board, point its "
                    "[updates] at a broker and use `edgekit publish` (docs/hil.md)")  # fmt: skip
    board = power.board
    agent = strategy.agent
    with agent.console.client(timeout_s=120) as console:
        if console.status()["models"].get(MODEL) is None:
            console.install(hil_bundles.v1)
        if console.status()["models"][MODEL] >= 2:
            pytest.skip("the board already runs v2: run the suite on a fresh store")
    v2 = hil_bundles.package(2, tmp_path / "v2")
    broker, files = _fleet_services(tmp_path, board.host_address)
    try:
        from edgekit.bundle import generate_keypair
        from examples.fleet_processes import toml_table

        notice_private, notice_public = generate_keypair(tmp_path / "keys", "fleet")
        board.extra_config = toml_table(
            "updates",
            {
                "broker": f"mqtt://{board.host_address}:{broker.port}",
                "fleet": FLEET,
                "device_id": "virtual",
                "notice_keys": [str(notice_public)],
                "health_window_s": 2.0,
            },
        )
        strategy.power_cut(env={"EDGEKIT_FAULT": "stage"})  # dies at the staging step of the next install
        _publish(
            v2,
            broker.port,
            board.host_address,
            files,
            hil_bundles.public_key,
            notice_private,
        )
        code = board.wait_exit(120)  # the power cut: SIGKILL at staging
        assert code == -9, f"the agent exited {code}, not by the power cut at staging:\n{board.log_tail()}"
        started = time.monotonic()
        strategy.power_cut()  # power back, no fault
        status = _status(agent)
        first = status["status"][MODEL]
        assert first["active"] in (1, 2) and status["models"][MODEL] == first["active"], status  # one version
        done = wait_for(
            lambda: _status(agent)["models"].get(MODEL) == 2, 120, "the update to complete after the power cut"
        )
        final = _status(agent)["status"][MODEL]
        assert done and final["active"] == 2 and final["previous"] == 1, final
        report.measure(
            "mqtt_update_with_power_cut_during_staging",
            came_back_with=f"v{first['active']} ({first['status']})",
            then=f"v{final['active']} active, v{final['previous']} kept",
            recovered_s=time.monotonic() - started,
        )
    finally:
        board.extra_config = ""
        broker.stop()
        files.stop()
        strategy.power_cut()  # back to a board without [updates]


def test_split_inference_over_a_degraded_link() -> None:
    pytest.skip("not written yet: the agent splits (tests/split covers it under shaped links between network "
                "namespaces); this board scenario needs a tail server on the host end of the link")  # fmt: skip


def test_result_cache_across_a_power_cut() -> None:
    pytest.skip("not written yet: the result cache's power-loss safety is tested on the host (a writer killed at "
                "every write point, tests/agent/test_cache_crash.py); this board scenario is to come")  # fmt: skip


# -- helpers ------------------------------------------------------------------------------


def _network(agent: Any, *, up: bool) -> bool:
    """Pull or plug back the board's network cable; False where the board file cannot."""
    from hil.labgrid_edgekit import VirtualBoardDriver

    if isinstance(agent.command, VirtualBoardDriver) and agent.command.board is not None:
        agent.command.board.set_network(up)
        return True
    cmd = agent.agent.network_on_cmd if up else agent.agent.network_off_cmd
    if not cmd:
        return False
    import shlex
    import subprocess

    subprocess.run(shlex.split(cmd), check=True, timeout=60)
    return True


def _energy_j(url: str, headers: dict[str, str]) -> tuple[float, str] | None:
    """The joules the agent's energy meter has counted (``edgekit_energy_joules``) and which meter
    (``edgekit_budget_reader``; "modelled" where it is an estimate), or None where it reads none."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=headers), timeout=10) as resp:
        text = resp.read().decode()
    joules, reader = None, ""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "edgekit_energy_joules_total":
                joules = (joules or 0.0) + sample.value
            elif sample.name == "edgekit_budget_reader" and sample.value == 1:
                reader = sample.labels.get("reader", "")
                if sample.labels.get("modelled") == "true":
                    reader += " (modelled)"
    if joules is None or reader in ("", "none"):
        return None
    return joules, reader


def _try_http(agent: Any, x: dict[str, np.ndarray]) -> float | None:
    started = time.monotonic()
    try:
        agent.infer_http(MODEL, x, timeout_s=1.0)
    except OSError:
        return None
    return time.monotonic() - started or 1e-9


def _fleet_services(tmp_path: Path, address: str) -> tuple[Any, Any]:
    """A real Mosquitto and the bundle file server, listening on the host end of the board's link."""
    import sys

    from examples.fleet_processes import Mosquitto, Process, free_port

    port = free_port()
    broker = Mosquitto(
        tmp_path / "mosquitto",
        f"persistence false\nlistener {port} {address}\nallow_anonymous true\n",
        port,
    )
    broker.spawn()
    _wait_port(address, port)
    files_port = free_port()
    files = Process(
        [sys.executable, "-m", "edgekit.fleet.fileserver", str(tmp_path / "files"), "--bind", address,
         "--port", str(files_port)],
        tmp_path / "files.log",
    )  # fmt: skip
    (tmp_path / "files").mkdir()
    files.spawn()
    _wait_port(address, files_port)
    files.base_url = f"http://{address}:{files_port}"  # type: ignore[attr-defined]  # the publish step reads it
    files.dir = tmp_path / "files"  # type: ignore[attr-defined]
    return broker, files


def _wait_port(address: str, port: int) -> None:
    import socket

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex((address, port)) == 0

    wait_for(listening, 15, f"{address}:{port} to listen")


def _publish(bundle: Path, port: int, address: str, files: Any, trusted_pub: Path, notice_key: Path) -> None:
    from edgekit.cli import main

    rc = main(
        [
            "publish", str(bundle), "--broker", f"mqtt://{address}:{port}", "--fleet", FLEET,
            "--base-url", files.base_url, "--copy-to", str(files.dir), "--trusted-key", str(trusted_pub),
            "--device", "virtual", "--notice-key", str(notice_key),
        ]
    )  # fmt: skip
    assert rc == 0, "edgekit publish failed (see its error above)"
