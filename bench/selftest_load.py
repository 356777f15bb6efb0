"""The self-test's latency check under load: an identical candidate against the serving version.

A real agent serves v1 of a ``[batch, 1700] x [1700, 1700]`` MatMul (installed while idle), and
steady clients (tritonclient, binary, batch 1) keep it busy while identical bundles v2, v3, ...
are installed one after the other. Each self-test times the candidate and the serving version
side by side in its child (interleaved); its ratio should be about 1.0 however busy the device
is. For contrast, the second row compares the same candidates' p50 with what the agent used as
the baseline before: the serving version's own self-test p50, recorded at its install (idle).
(The agent's check refuses a candidate over ``selftest.latency_slack`` x its baseline, 3 by default.)
"""

from __future__ import annotations

import statistics
import threading

import numpy as np

from bench.registry import BenchContext, BenchError, Measurement

WIDE = 1700
CLIENTS = 2


def run(ctx: BenchContext, *, name: str) -> list[Measurement]:
    import edgekit
    from bench.agent_roundtrip import tiny_model
    from device_agents.selftest import REPORT_NAME, SelfTestReport
    from device_agents.store import Store
    from examples.agent_process import RunningAgent

    work = ctx.workdir / "selftest-load"
    work.mkdir(parents=True, exist_ok=True)
    rounds = 3 if ctx.repeats <= 15 else 5
    model = tiny_model(work / "wide.onnx", WIDE, WIDE)
    calib = {"x": np.random.default_rng(1).standard_normal((8, WIDE)).astype(np.float32)}
    bundles = []
    for version in range(1, rounds + 2):
        ctx.progress(f"{name}: packaging wide v{version} (fp32, identical model)")
        result = edgekit.package(model, precision="fp32", calib=calib, key=ctx.key, name="wide", version=version,
                                 out_dir=work / "bundles" / str(version))  # fmt: skip
        bundles.append(result.bundles["cpu"])

    def report_of(store: Store) -> SelfTestReport:
        active = store.model_state("wide").active
        if active is None:
            raise BenchError("no active version after an install")
        return SelfTestReport.from_json((store.model_dir(active) / REPORT_NAME).read_bytes())

    side: list[tuple[float, float]] = []
    # threads = 1: one core per inference, as on a small device; the clients make it busy
    with RunningAgent(work / "agent", [ctx.pub], threads=1) as agent:
        agent.install(bundles[0])  # idle: this p50 is what the old check compared with
        store = Store(agent.store)
        idle_p50 = report_of(store).latency_p50_ms
        if not idle_p50:
            raise BenchError("v1's self-test measured no latency")
        load = _SteadyClients(agent.host_port, "wide", np.ones((1, WIDE), np.float32), CLIENTS)
        try:
            for r, bundle in enumerate(bundles[1:], start=2):
                agent.install(bundle)
                rep = report_of(store)
                if rep.baseline_source != "side_by_side" or not rep.latency_p50_ms or not rep.baseline_p50_ms:
                    raise BenchError(f"v{r} was not timed side by side ({rep.baseline_source!r}: {rep.baseline_note})")
                side.append((rep.baseline_p50_ms, rep.latency_p50_ms))
                ratio = rep.latency_p50_ms / rep.baseline_p50_ms
                ctx.progress(f"{name}: v{r}: candidate {rep.latency_p50_ms:.3f} ms, serving {rep.baseline_p50_ms:.3f}"
                             f" ms side by side (x{ratio:.2f})")  # fmt: skip
        finally:
            sent = load.stop()
    if not sent:
        raise BenchError("the clients sent no request during the installs")
    median_a = statistics.median(a for a, _ in side)
    median_b = statistics.median(b for _, b in side)
    note = f"{CLIENTS} clients, {sent} requests during {rounds} installs; medians over the installs"
    return [
        Measurement(name, "identical candidate vs serving, side by side", "self-test p50, batch 1", "ms",
                    "serving version", "candidate", median_a, median_b, note),
        Measurement(name, "identical candidate vs recorded baseline", "self-test p50, batch 1", "ms",
                    "v1 at its install (idle)", "candidate under load", idle_p50, median_b,
                    "what the check compared with before it was side by side"),
    ]  # fmt: skip


class _SteadyClients:
    """``count`` threads sending v2 binary infer requests in a loop; ``stop`` returns how many."""

    def __init__(self, host_port: str, model: str, x: np.ndarray, count: int) -> None:
        self._args = (host_port, model, x)
        self._stop = threading.Event()
        self._sent = [0] * count
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        import tritonclient.http as httpclient

        host_port, model, x = self._args
        client = httpclient.InferenceServerClient(host_port)
        while not self._stop.is_set():
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            client.infer(model, [inp])
            self._sent[i] += 1

    def stop(self) -> int:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        return sum(self._sent)
