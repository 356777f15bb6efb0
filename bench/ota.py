"""Over-the-air updates on loopback: a real broker (Mosquitto), file server and agent.

1. Publish-to-serving of a ~10 MB bundle (a [batch, 1700] x [1700, 1700] MatMul, random FP32
   weights). A is ``edgekit-agent install`` of the same kind of bundle on the
   device (a sideload: no network, no broker); B is ``edgekit publish`` until ``GET
   /v2/models/{name}`` shows the new version (MQTT notice, HTTP download, verify, self-test,
   switch). Interleaved rounds, medians.
2. v2 inference requests run in a loop through every switch of (1); the failures are counted.
3. 50 simulated devices (real ``UpdateClient`` instances, each with its own store, against a
   stand-in lifecycle that stages and promotes without loading a runtime) take one group notice;
   then the broker is SIGKILLed and restarted. A is 50 plain paho clients with paho's own
   reconnect (exponential, no jitter) on the same broker at the same time; B is the update
   clients (full jitter). Reported: how far their reconnects are spread out in time.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from bench.registry import BenchContext, BenchError, Measurement

if TYPE_CHECKING:
    from device_agents.lifecycle import Lifecycle

WIDE = 1700  # 1700 x 1700 float32 weights = 11.6 MB, a bundle of about 10 MB
FLEET = "bench"
RECONNECT_MAX_S = 8.0  # both kinds of simulated device back off to at most this


def run(ctx: BenchContext, *, name: str, devices: int = 50) -> list[Measurement]:
    from examples.fleet_processes import FileServer, Mosquitto

    work = ctx.workdir / "ota"
    work.mkdir(parents=True, exist_ok=True)
    broker = Mosquitto.plain(work / "broker").start()
    files = FileServer(work / "www", work / "www.log").start()
    try:
        rows = _publish_to_serving(ctx, name, work, broker, files)
        rows += _fleet(ctx, name, work, broker, files, devices)
    finally:
        files.kill()
        broker.kill()
    return rows


# -- 1 + 2: one real agent, 10 MB bundles ---------------------------------------------------


def _publish_to_serving(ctx: BenchContext, name: str, work: Path, broker: Any, files: Any) -> list[Measurement]:
    import edgekit
    from bench.agent_roundtrip import tiny_model
    from edgekit.bundle.fleet_connection import BrokerAddress
    from edgekit.fleet.publish import PublishOptions, publish
    from examples.agent_process import RunningAgent
    from examples.fleet_processes import toml_table

    rounds = 3 if ctx.repeats <= 15 else 5
    model = tiny_model(work / "wide.onnx", WIDE, WIDE)
    calib = {"x": np.random.default_rng(1).standard_normal((8, WIDE)).astype(np.float32)}
    bundles = []
    for version in range(1, 2 * rounds + 2):
        ctx.progress(f"{name}: packaging wide v{version} (fp32, {WIDE}x{WIDE} weights)")
        result = edgekit.package(model, precision="fp32", calib=calib, key=ctx.key, name="wide", version=version,
                                 out_dir=work / "bundles" / str(version), allow_small_eval=True)  # fmt: skip
        bundles.append(result.bundles["cpu"])
    size_mb = bundles[-1].stat().st_size / 2**20
    from edgekit.bundle import generate_keypair

    notice_key, notice_pub = generate_keypair(work / "fleet-keys-agent", "fleet")
    updates = toml_table(
        "updates",
        {"broker": broker.url(), "fleet": FLEET, "device_id": "bench-agent", "health_window_s": 1.0,
         "reconnect_max_s": 2.0, "notice_keys": [str(notice_pub)]},
    )  # fmt: skip
    options = PublishOptions(
        BrokerAddress(False, "127.0.0.1", broker.port), FLEET, files.base_url, (ctx.pub,),
        devices=("bench-agent",), copy_to=files.dir, notice_key=notice_key,
    )  # fmt: skip
    sideload_s, publish_s = [], []
    with RunningAgent(work / "agent", [ctx.pub], extra_config=updates) as agent:
        agent.install(bundles[0])
        load = _Load(agent.url, "wide", np.zeros((1, WIDE), np.float32))
        try:
            for r in range(rounds):
                sideload, published = bundles[1 + 2 * r], bundles[2 + 2 * r]
                t0 = time.perf_counter()
                agent.install(sideload)
                _wait_served(agent.url, "wide", 2 + 2 * r)
                sideload_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                publish(published, options)
                _wait_served(agent.url, "wide", 3 + 2 * r)
                publish_s.append(time.perf_counter() - t0)
                ctx.progress(f"{name}: round {r + 1}: sideload {sideload_s[-1]:.2f} s, publish {publish_s[-1]:.2f} s")
                time.sleep(1.2)  # let the health window of the update pass before the next switch
        finally:
            sent, failed = load.stop()
    if not sent:
        raise BenchError("no inference request ran during the switches")
    note = f"{size_mb:.1f} MB bundle on loopback, median of {rounds}; issue target <= 2 s"
    return [
        Measurement(name, f"{size_mb:.0f} MB bundle: publish vs sideload", "time to serving", "s",
                    "edgekit-agent install", "edgekit publish", statistics.median(sideload_s),
                    statistics.median(publish_s), note),
        Measurement(name, f"v2 requests during {2 * rounds} switches", "answered / sent", "requests", "sent",
                    "answered", float(sent), float(sent - failed),
                    f"{failed} failed; a loop of v2 JSON infer requests through every switch"),
    ]  # fmt: skip


def _wait_served(url: str, model: str, version: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v2/models/{model}", timeout=5) as r:
                if json.loads(r.read())["versions"] == [str(version)]:
                    return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    raise BenchError(f"{model} v{version} was not served within {timeout_s:g} s")


class _Load:
    """v2 JSON infer requests in a loop on a thread; counts sent and failed."""

    def __init__(self, url: str, model: str, x: np.ndarray) -> None:
        body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
        self._request = (f"{url}/v2/models/{model}/infer", json.dumps(body).encode())
        self.sent = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        url, data = self._request
        while not self._stop.is_set():
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    r.read()
            except (urllib.error.URLError, OSError):
                self.failed += 1
            self.sent += 1

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join(30)
        return self.sent, self.failed


# -- 3: 50 simulated devices ---------------------------------------------------------------


class _StandInManager:
    """What ``UpdateClient`` needs of ``Lifecycle``, with a real store but no runtime (bench only)."""

    def __init__(self, store_dir: Path, pub: Path) -> None:
        from device_agents.metrics import AgentMetrics
        from device_agents.store import Store
        from edgekit.bundle import TrustStore

        self.store = Store(store_dir)
        self.trust = TrustStore.from_files([pub])
        self.metrics = AgentMetrics()
        self._models: dict[str, int] = {}

    def models(self) -> dict[str, int]:
        return dict(self._models)

    def record_notice(self, name: str, notice_id: str, issued: str) -> None:
        from dataclasses import replace

        with self.store.lock():
            self.store.update_model(name, lambda s: replace(s, last_notice_id=notice_id, last_notice_issued=issued))

    def install(self, bundle_path: Path, *, origin: str) -> Any:
        from device_agents.lifecycle import InstallResult

        with self.store.lock():
            staged = self.store.stage(bundle_path, self.trust)
            self.store.promote(staged.manifest.name)
        m = staged.manifest
        previous = self._models.get(m.name)
        self._models[m.name] = m.version
        return InstallResult(m.name, m.version, True, previous, origin)


def _fleet(ctx: BenchContext, name: str, work: Path, broker: Any, files: Any, devices: int) -> list[Measurement]:
    import paho.mqtt.client as mqtt

    import edgekit
    from bench.agent_roundtrip import tiny_model
    from device_agents.config import config_from_data
    from device_agents.updates.client import UpdateClient
    from edgekit.bundle.fleet_connection import BrokerAddress
    from edgekit.fleet.publish import PublishOptions, publish
    from examples.fleet_processes import wait_for

    small = edgekit.package(
        tiny_model(work / "small.onnx"), precision="fp32", key=ctx.key, name="sim", version=1, out_dir=work / "sim",
        calib={"x": np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)},
        allow_small_eval=True,  # the benchmark times updates, not the gate
    ).bundles["cpu"]  # fmt: skip
    # 50 clients x one line per reconnect attempt would bury the benchmark's own output
    logging.getLogger("edgekit.agent").setLevel(logging.ERROR)
    clients = []
    from edgekit.bundle import generate_keypair

    notice_key, notice_pub = generate_keypair(work / "fleet-keys-sims", "fleet")
    for i in range(devices):
        root = work / "devices" / f"sim-{i:02d}"
        config = config_from_data(
            {"store": str(root), "trusted_keys": [str(ctx.pub)],
             "updates": {"broker": broker.url(), "fleet": FLEET, "device_id": f"sim-{i:02d}", "groups": ["sims"],
                         "health_window_s": 0.5, "reconnect_max_s": RECONNECT_MAX_S,
                         "notice_keys": [str(notice_pub)]}},
            base=root,
        )  # fmt: skip
        stand_in = cast("Lifecycle", _StandInManager(root, ctx.pub))  # duck-typed: what UpdateClient uses
        clients.append(UpdateClient(config, stand_in))
    baseline_times: list[float] = []

    def on_connect(client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        baseline_times.append(time.time())

    plain = []
    for i in range(devices):
        p = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"plain-{i:02d}", protocol=mqtt.MQTTv5)
        p.reconnect_delay_set(min_delay=1, max_delay=int(RECONNECT_MAX_S))
        p.on_connect = on_connect
        p.connect_async("127.0.0.1", broker.port, 30)
        p.loop_start()
        plain.append(p)
    for c in clients:
        c.start()
    try:
        wait_for(lambda: all(c.connections for c in clients) and len(baseline_times) >= devices, 60, "all connected")
        ctx.progress(f"{name}: {devices} update clients and {devices} plain paho clients connected")
        options = PublishOptions(BrokerAddress(False, "127.0.0.1", broker.port), FLEET, files.base_url, (ctx.pub,),
                                 groups=("sims",), copy_to=files.dir, notice_key=notice_key)  # fmt: skip
        t0 = time.perf_counter()
        publish(small, options)
        done: dict[int, float] = {}

        def converged() -> bool:
            for i, c in enumerate(clients):
                if i not in done and c.lifecycle.models().get("sim") == 1:
                    done[i] = time.perf_counter() - t0
            return len(done) == devices

        wait_for(converged, 120, f"{devices} devices to serve sim v1", interval_s=0.01)
        ctx.progress(f"{name}: all {devices} devices serve sim v1 after {max(done.values()):.2f} s")

        baseline_times.clear()
        broker.kill()
        time.sleep(1.5)  # the broker is down for a while, as after a crash
        restarted = time.time()
        broker.start()
        wait_for(lambda: all(c.connections >= 2 for c in clients) and len(baseline_times) >= devices, 60,
                 "every client to reconnect")  # fmt: skip
        ours = sorted(c.last_connected_at - restarted for c in clients)  # type: ignore[operator]  # set on connect
        theirs = sorted(t - restarted for t in baseline_times[:devices])
    finally:
        for c in clients:
            c.stop()
        for p in plain:
            p.disconnect()
            p.loop_stop()
    ctx.progress(f"{name}: reconnect spread paho {theirs[-1] - theirs[0]:.2f} s, edgekit {ours[-1] - ours[0]:.2f} s")
    spread_note = (
        f"{devices} clients each; broker SIGKILLed, down 1.5 s; seconds after the restart; "
        f"paho delays 1-{RECONNECT_MAX_S:g} s, edgekit reconnect_max_s {RECONNECT_MAX_S:g}"
    )
    return [
        Measurement(name, f"{devices} devices, one group notice", "publish to serving", "s", "first device",
                    "last device", min(done.values()), max(done.values()),
                    "stand-in lifecycle: stage + promote, no runtime"),
        Measurement(name, "reconnects after broker restart", "spread (last - first)", "s", "paho fixed backoff",
                    "edgekit full jitter", theirs[-1] - theirs[0], ours[-1] - ours[0], spread_note),
        Measurement(name, "reconnects after broker restart", "median reconnect", "s", "paho fixed backoff",
                    "edgekit full jitter", statistics.median(theirs), statistics.median(ours), spread_note),
    ]  # fmt: skip
