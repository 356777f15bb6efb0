"""The agent's serving core under load, driven over HTTP by ``tritonclient`` (one client per thread).

- ``batching``: a compute-heavy MLP with a dynamic batch axis (1024 -> 4096 -> 1024) served twice
  by one agent, as ``mlp`` (``max_batch_size = 32``, one batch at a time: ``workers = 1``, as
  the weights are read once per call) and ``mlp_unbatched`` (server default); throughput at
  concurrency 1/4/16/64, the two interleaved round by round; the server-side p99 (queue + infer,
  from the stage histograms) against ``max_wait_ms`` + 2x the batch's run time; the CPU per
  request (load generator + agent) of both at c=16, which bounds their throughput ratio when the
  clients share the agent's cores and both keep them full (less noisy than throughput), with the
  agent's share split by thread role where the OS names its threads (connections, batch workers,
  the runtime's own threads: ``device_agents.threads``); then c=16
  again in an agent with ``[runtimes.onnxruntime] spinning = false`` and in one with
  ``spin_between_runs = false`` (both models); then c=16 again with the agent and the load
  generator on separate cores (Linux, two CPUs or more: the clients on the lower half of them, the
  agent on the rest), as where the clients are remote. Then the digits conv net example, batched
  vs unbatched at concurrency 16.
- ``overhead``: p50 round trip of a 1 KB tensor to the agent vs to a do-nothing v2 server (the
  client-side floor), and the runtime call alone (``session.run``), side by side; their difference
  (agent - floor - runtime call) is printed beside the server-side overhead the issue defines,
  measured by the agent itself (request line received -> response written, minus the runtime call:
  exact percentiles from ``/edgekit/v1/stats``).
- ``limits``: 1000 idle connections held open (a health probe's latency; how many the server
  closed within its idle timeout); 4 parallel gzip bombs (~116 KiB inflating to 120 MB each):
  the answers and the agent's RSS growth.
"""

from __future__ import annotations

import gzip
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bench.registry import NOT_HERE, BenchContext, BenchError, Measurement
from device_agents.threads import ENDED, ThreadCpu

MLP_IN, MLP_HIDDEN = 1024, 4096
MAX_BATCH, MAX_WAIT_MS = 32, 2.0
CONCURRENCY = (1, 4, 16, 64)
IDLE_CONNECTIONS = 1000
IDLE_TIMEOUT_S = 5.0


def mlp_model(path: Path) -> Path:
    """``relu(x @ w1) @ w2``: [batch, 1024] -> [batch, 1024] through 4096 hidden units (33 MB fp32)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((MLP_IN, MLP_HIDDEN)) * 0.03).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((MLP_HIDDEN, MLP_IN)) * 0.015).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", MLP_IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", MLP_IN])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="edgekit-bench")
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _package(ctx: BenchContext, model: Path, name: str, calib: dict[str, np.ndarray], out: Path) -> Path:
    import edgekit

    result = edgekit.package(model, targets=["cpu"], precision="fp32", calib=calib, key=ctx.key, name=name, out_dir=out)
    return Path(result.bundles["cpu"])


# The agent's thread roles by OS thread name (device_agents.threads names them); the
# CPU of threads that ended meanwhile is the connections' (their threads end as their clients close)
_ROLES = (("infer-", "batch workers"), ("rt-", "runtime threads"), ("http-conn", "connections"))


def _role(thread_name: str) -> str:
    if thread_name == ENDED:
        return "connections"
    return next((role for prefix, role in _ROLES if thread_name.startswith(prefix)), "other agent threads")


class Load:
    """``concurrency`` threads, each with its own tritonclient, sending ``x`` to ``model`` for ``seconds``.

    It adds up the CPU time the load generator itself used (this process: only its client threads
    run meanwhile) and, given ``server_pid``, the agent's, over the seconds measured: on a 2-core
    machine the clients take cores the agent needs, and their share says whether they limit."""

    def __init__(
        self, address: str, model: str, inputs: dict[str, np.ndarray], output: str, server_pid: int | None = None
    ) -> None:
        self.address, self.model, self.inputs, self.output = address, model, inputs, output
        self.server_pid = server_pid
        self.client_cpu_s = self.server_cpu_s = self.measured_s = 0.0
        self.answered = 0  # requests answered while measured
        self.thread_cpu_s: dict[str, float] = {}  # the agent's CPU by thread role (Linux), while measured

    def _server_cpu(self) -> float:
        if self.server_pid is None:
            return 0.0
        import psutil

        times = psutil.Process(self.server_pid).cpu_times()
        return float(times.user + times.system)

    def cpu_note(self) -> str:
        """The client's and the agent's CPU use while measured, in cores."""
        if not self.measured_s:
            return ""
        agent = f", agent {self.server_cpu_s / self.measured_s:.2f}" if self.server_pid is not None else ""
        return f"clients {self.client_cpu_s / self.measured_s:.2f}{agent} cores"

    def cpu_per_request_ms(self) -> tuple[float, float]:
        """(clients, agent) CPU milliseconds per answered request while measured."""
        if not self.answered:
            return float("nan"), float("nan")
        return self.client_cpu_s * 1000 / self.answered, self.server_cpu_s * 1000 / self.answered

    def reset(self) -> None:
        self.client_cpu_s = self.server_cpu_s = self.measured_s = 0.0
        self.answered = 0
        self.thread_cpu_s = {}

    def thread_note(self) -> str:
        """The agent's CPU ms per answered request by thread role, where the OS names its threads."""
        if not self.answered or not self.thread_cpu_s:
            return ""
        parts = (f"{role} {s * 1000 / self.answered:.3f}" for role, s in sorted(self.thread_cpu_s.items()) if s > 0)
        return "agent by thread (ms/request): " + ", ".join(parts)

    def run(self, concurrency: int, seconds: float) -> tuple[int, list[float], int]:
        import tritonclient.http as httpclient

        latencies: list[list[float]] = [[] for _ in range(concurrency)]
        errors = [0] * concurrency
        start = threading.Barrier(concurrency + 1)
        stop_at = [0.0]

        def worker(i: int) -> None:
            client = httpclient.InferenceServerClient(self.address, connection_timeout=60, network_timeout=60)
            ins = []
            for name, arr in self.inputs.items():
                inp = httpclient.InferInput(name, list(arr.shape), "FP32")
                inp.set_data_from_numpy(arr)
                ins.append(inp)
            outs = [httpclient.InferRequestedOutput(self.output)]
            start.wait()
            mine = latencies[i]
            try:
                while time.perf_counter() < stop_at[0]:
                    t0 = time.perf_counter()
                    try:
                        client.infer(self.model, ins, outputs=outs)
                    except Exception:  # a load generator counts failures; any exception is one
                        errors[i] += 1
                        continue
                    mine.append((time.perf_counter() - t0) * 1000)
            finally:
                client.close()
                _drop_gevent_hub()

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
        for t in threads:
            t.start()
        stop_at[0] = time.perf_counter() + 60  # set properly once every client is connected
        start.wait()
        stop_at[0] = time.perf_counter() + seconds
        cpu0, server0, wall0 = time.process_time(), self._server_cpu(), time.perf_counter()
        threads0 = ThreadCpu.read(self.server_pid) if self.server_pid is not None else None
        for t in threads:
            t.join(seconds + 60)
        self.client_cpu_s += time.process_time() - cpu0
        self.server_cpu_s += self._server_cpu() - server0
        threads1 = ThreadCpu.read(self.server_pid) if threads0 is not None and self.server_pid is not None else None
        if threads0 is not None and threads1 is not None:  # Linux: the agent's CPU by thread role
            for thread, spent in threads1.since(threads0).items():
                role = _role(thread)
                self.thread_cpu_s[role] = self.thread_cpu_s.get(role, 0.0) + spent
        self.measured_s += time.perf_counter() - wall0
        flat = [v for lat in latencies for v in lat]
        self.answered += len(flat)
        return len(flat), flat, sum(errors)


def _drop_gevent_hub() -> None:
    """Destroy the gevent hub of the calling thread (tritonclient.http runs on gevent, one hub per
    thread that used it). A hub is not destroyed when its thread ends and keeps its event loop's
    two file descriptors (gevent/gevent#1601, #1816): a bench run starts ~500 client threads, and
    past 1024 open descriptors every later load ran 2-3x slower here (client CPU per request 0.22
    -> 0.41 ms at 1 client), which made the later agent variants look slow."""
    import gevent

    gevent.get_hub().destroy(destroy_loop=True)


def _scrape(url: str) -> Any:
    from prometheus_client.parser import text_string_to_metric_families

    from device_agents.stats import snapshot

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return snapshot(text_string_to_metric_families(resp.read().decode()))


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class SideBySide(NamedTuple):
    """One load's share of ``_throughput_side_by_side``."""

    rps: float  # the median over rounds
    latencies: list[float]  # ms, every request of every round
    errors: int
    per_round: list[float]  # req/s of each round


def _round_ratios(first: SideBySide, second: SideBySide) -> str:
    """Each round's ratio, second over first (the rounds ran side by side): the spread that the
    median ratio is read against on a noisy machine."""
    return "per round " + "/".join(f"{b / a:.2f}" for a, b in zip(first.per_round, second.per_round, strict=True) if a)


def _throughput_side_by_side(
    loads: dict[str, Load],
    concurrency: int,
    seconds: float,
    rounds: int,
    after: Callable[[str], None] | None = None,
) -> dict[str, SideBySide]:
    """Requests per second of each load, run one after the other per round (A, B, B, A, ...);
    ``after(name)`` is called after each load's round."""
    done: dict[str, list[float]] = {n: [] for n in loads}
    lat: dict[str, list[float]] = {n: [] for n in loads}
    errors = dict.fromkeys(loads, 0)
    names = list(loads)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            count, latencies, failed = loads[name].run(concurrency, seconds)
            done[name].append(count / seconds)
            lat[name] += latencies
            errors[name] += failed
            if after is not None:
                after(name)
    return {n: SideBySide(statistics.median(done[n]), lat[n], errors[n], done[n]) for n in names}


def _round_p99s(url: str, model: str, into: list[dict[str, Any]]) -> Callable[[str], None]:
    """An ``after`` hook that keeps ``model``'s exact queue + infer percentiles after each of its rounds
    (the agent's window: the last 4096 requests, about the last second of a round at c=16)."""

    def after(name: str) -> None:
        if name == model:
            exact = _stats(url).get(model, {}).get("queue_infer_exact")
            if not exact:
                raise BenchError(f"the agent reported no queue_infer_exact for {model}")
            into.append(dict(exact))

    return after


def run_batching(ctx: BenchContext, *, name: str) -> list[Measurement]:
    from examples.agent_process import RunningAgent

    work = ctx.workdir / "serving-batching"
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    calib = {"x": rng.standard_normal((16, MLP_IN)).astype(np.float32)}
    model = mlp_model(work / "mlp.onnx")
    ctx.progress(f"{name}: packaging the {MLP_IN}->{MLP_HIDDEN}->{MLP_IN} MLP as mlp and mlp_unbatched")
    batched_bundle = _package(ctx, model, "mlp", calib, work / "b1")
    plain_bundle = _package(ctx, model, "mlp_unbatched", calib, work / "b2")
    seconds = 1.5 if ctx.repeats < 30 else 3.0
    rounds = 2
    extra = (
        f"[models.mlp]\nworkers = 1\n[models.mlp.batching]\nmax_batch_size = {MAX_BATCH}\n"
        f"max_wait_ms = {MAX_WAIT_MS}\n"
        "[server]\nqueue_size = 256\n"
    )
    rows: list[Measurement] = []
    # The agent as configured by default (ONNX Runtime's threads spin), then at c=16 again with
    # [runtimes.onnxruntime] spinning = false, and with spin_between_runs = false (they spin inside
    # a run only): both models of one agent get the same settings.
    variants = (("", CONCURRENCY), ("spinning = false", (16,)), ("spin_between_runs = false", (16,)))
    for i, (setting, levels) in enumerate(variants):
        config = extra + (f"[runtimes.onnxruntime]\n{setting}\n" if setting else "")
        tag = f", {setting}" if setting else ""
        with RunningAgent(work / f"agent-{i}", [ctx.pub], extra_config=config) as agent:
            for b in (batched_bundle, plain_bundle):
                agent.install(b)
            x = calib["x"][:1].copy()
            loads = {n: Load(agent.host_port, n, {"x": x}, "y", agent.pid) for n in ("mlp_unbatched", "mlp")}
            for c in levels:
                before = _scrape(agent.url) if c == 16 else None
                n = 2 * rounds if c == 16 else rounds  # c=16: the ratio the issue judges
                ctx.progress(f"{name}: concurrency {c}{tag}, {n} rounds of {seconds:g} s each, interleaved")
                p99s: list[dict[str, Any]] = []  # c=16: the batched model's after each of its rounds
                after = _round_p99s(agent.url, "mlp", p99s) if before is not None else None
                got = _throughput_side_by_side(loads, c, seconds, n, after)
                note = _mlp_note(got, loads)
                if c == 16:
                    rows.append(_cpu_per_request(name, loads["mlp_unbatched"], loads["mlp"], tag))
                for load in loads.values():
                    load.reset()
                rows.append(
                    Measurement(name, f"mlp batched vs unbatched, c={c}{tag}", "throughput", "req/s", "unbatched",
                                f"max_batch_size {MAX_BATCH}", got["mlp_unbatched"].rps, got["mlp"].rps, note)
                )  # fmt: skip
                if before is not None:
                    rows.append(_server_p99(name, _scrape(agent.url).minus(before), p99s, tag))
    x = calib["x"][:1].copy()
    rows += _separate_cores(ctx, name, work, (plain_bundle, batched_bundle), extra, x, seconds, 2 * rounds)
    rows += _conv_batching(ctx, name, work, seconds, 2 * rounds)  # c=16 and the conv net: the ratios judged
    return rows


def split_cpus(cpus: set[int]) -> tuple[list[int], list[int]] | None:
    """(the load generator's CPUs, the agent's): the lower half of ``cpus`` and the rest; None for one CPU."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return None
    half = len(ordered) // 2
    return ordered[:half], ordered[half:]


def _cpu_list(cpus: list[int]) -> str:
    return ("CPU " if len(cpus) == 1 else "CPUs ") + ",".join(map(str, cpus))


def _separate_cores(
    ctx: BenchContext,
    name: str,
    work: Path,
    bundles: tuple[Path, Path],
    extra: str,
    x: np.ndarray,
    seconds: float,
    rounds: int,
) -> list[Measurement]:
    """The MLP at c=16 again, with the agent and the load generator on separate cores (Linux).

    On a device the clients are elsewhere; on this machine the 16 tritonclient threads take about
    a third of the CPU, on the cores the agent's runtime call needs, and the call's own tail (its
    p99 three times its p50) is then the scheduler's, not the batcher's. Here the agent runs on
    the upper half of this process's CPUs (it sizes its runtimes' pools to them), the clients on
    the lower half: the same batcher, measured without the load generator in its way."""
    from examples.agent_process import RunningAgent, pinned

    split = split_cpus(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    case = "mlp batched vs unbatched, c=16, agent and clients on separate cores"
    if split is None:
        return [Measurement(name, case, "throughput", "req/s", "unbatched", f"max_batch_size {MAX_BATCH}",
                            note=f"{NOT_HERE}: one CPU (the agent and its clients cannot be kept apart)")]  # fmt: skip
    clients, agent_cpus = split
    tag = f", agent on {_cpu_list(agent_cpus)}, clients on {_cpu_list(clients)}"
    with RunningAgent(work / "agent-cores", [ctx.pub], extra_config=extra, cpus=agent_cpus) as agent:
        for b in bundles:
            agent.install(b)
        loads = {n: Load(agent.host_port, n, {"x": x}, "y", agent.pid) for n in ("mlp_unbatched", "mlp")}
        ctx.progress(f"{name}: concurrency 16{tag}, {rounds} rounds of {seconds:g} s each, interleaved")
        with pinned(clients):  # the client threads start here and keep these CPUs
            before = _scrape(agent.url)
            p99s: list[dict[str, Any]] = []
            got = _throughput_side_by_side(loads, 16, seconds, rounds, _round_p99s(agent.url, "mlp", p99s))
            snap = _scrape(agent.url).minus(before)
    return [
        Measurement(name, f"mlp batched vs unbatched, c=16{tag}", "throughput", "req/s", "unbatched",
                    f"max_batch_size {MAX_BATCH}", got["mlp_unbatched"].rps, got["mlp"].rps, _mlp_note(got, loads)),
        _server_p99(name, snap, p99s, tag),
    ]  # fmt: skip


def _mlp_note(got: dict[str, SideBySide], loads: dict[str, Load]) -> str:
    """Per-round ratios, client latencies, errors and CPU of the MLP's two loads."""
    a, b = got["mlp_unbatched"], got["mlp"]
    return (
        f"{_round_ratios(a, b)}; client p50/p99 ms: unbatched {_pct(a.latencies, 50):.2f}/"
        f"{_pct(a.latencies, 99):.2f}, batched {_pct(b.latencies, 50):.2f}/{_pct(b.latencies, 99):.2f}; "
        f"errors {a.errors}/{b.errors}; CPU: unbatched {loads['mlp_unbatched'].cpu_note()}, "
        f"batched {loads['mlp'].cpu_note()}"
    )


def _cpu_per_request(name: str, unbatched: Load, batched: Load, tag: str) -> Measurement:
    """CPU per answered request (the load generator's and the agent's), unbatched vs batched.

    Less noisy than throughput on a shared machine, and what bounds the throughput ratio when the
    clients run on the agent's cores and both loads keep them full: about A/B."""
    (uc, ua), (bc, ba) = unbatched.cpu_per_request_ms(), batched.cpu_per_request_ms()
    by_thread = (("unbatched", unbatched.thread_note()), ("batched", batched.thread_note()))
    return Measurement(name, f"CPU per request (clients + agent), c=16{tag}", "CPU", "ms", "unbatched",
                       f"max_batch_size {MAX_BATCH}", uc + ua, bc + ba,
                       f"unbatched clients {uc:.3f} + agent {ua:.3f} ms, batched clients {bc:.3f} + agent {ba:.3f} ms; "
                       f"cores kept full: throughput ratio ~ A/B = {(uc + ua) / (bc + ba):.2f}x"
                       + "".join(f"; {label} {note}" for label, note in by_thread if note))  # fmt: skip


def _server_p99(name: str, snap: Any, rounds: list[dict[str, Any]], tag: str) -> Measurement:
    """Server-side p99 of the batched MLP (each request's queue + infer, exact, from the agent's
    stats after each of its rounds: the worst round's, each round's beside it) against its bound,
    with the stage histograms' p99 queue + p99 infer over every round beside it."""
    from device_agents.stats import summarize

    stats = summarize(snap)["mlp"]
    queue_p99, infer_p99 = stats["queue"]["p99_ms"], stats["infer"]["p99_ms"]
    infer_h = snap.histograms[("stage", "mlp", "infer")]
    batch_ms = (infer_h.mean or 0.0) * 1000
    if not rounds:
        raise BenchError("no round of the batched MLP reported its queue + infer percentiles")
    p99 = max(r["p99_ms"] for r in rounds)  # the worst round: a p99 over ~1 s of requests is noisy
    per_round = "/".join(f"{r['p99_ms']:.2f}" for r in rounds)
    return Measurement(name, f"server-side p99 (queue + infer), c=16{tag}", "latency", "ms",
                       f"max_wait_ms + 2 x batch run ({batch_ms:.2f} ms)", "p99 of queue + infer (exact)",
                       MAX_WAIT_MS + 2 * batch_ms, p99,
                       f"the worst round's p99 (each over that round's last {rounds[-1]['samples']} requests): "
                       f"per round {per_round} ms, p50 "
                       f"{statistics.median(r['p50_ms'] for r in rounds):.2f} ms; stage buckets over all rounds: "
                       f"p99 queue {queue_p99:.2f} + p99 infer {infer_p99:.2f} = {queue_p99 + infer_p99:.2f} ms "
                       f"(infer p50 {stats['infer']['p50_ms']:.2f}); "
                       f"mean batch {stats.get('batch_mean', 0):.1f}")  # fmt: skip


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/edgekit/v1/stats", timeout=30) as resp:
        return dict(json.loads(resp.read()))


def _conv_batching(ctx: BenchContext, name: str, work: Path, seconds: float, rounds: int) -> list[Measurement]:
    """The digits conv net example, batched vs unbatched, at concurrency 16."""
    import onnxruntime as ort

    from examples.agent_process import RunningAgent

    root = Path(__file__).resolve().parents[1] / "examples" / "digits"
    models = sorted(root.glob("*.onnx"))
    if not models:
        return [Measurement(name, "digits conv net", "throughput", "req/s", "", "", note="no examples/digits/*.onnx")]
    model = models[0]
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    spec = sess.get_inputs()[0]
    if isinstance(spec.shape[0], int):
        return [Measurement(name, "digits conv net", "throughput", "req/s", "", "", note="its batch axis is static")]
    shape = [d if isinstance(d, int) else 1 for d in spec.shape]
    calib = {spec.name: np.random.default_rng(5).standard_normal([16, *shape[1:]]).astype(np.float32)}
    out_name = sess.get_outputs()[0].name
    batched = _package(ctx, model, "digits", calib, work / "d1")
    plain = _package(ctx, model, "digits_unbatched", calib, work / "d2")
    extra = f"[models.digits.batching]\nmax_batch_size = {MAX_BATCH}\nmax_wait_ms = {MAX_WAIT_MS}\n"
    with RunningAgent(work / "agent-digits", [ctx.pub], extra_config=extra) as agent:
        for b in (batched, plain):
            agent.install(b)
        x = {spec.name: calib[spec.name][:1].copy()}
        loads = {n: Load(agent.host_port, n, x, out_name, agent.pid) for n in ("digits_unbatched", "digits")}
        ctx.progress(f"{name}: digits conv net ({model.name}), concurrency 16")
        before = _scrape(agent.url)
        got = _throughput_side_by_side(loads, 16, seconds, rounds)
        from device_agents.stats import summarize

        batched = summarize(_scrape(agent.url).minus(before)).get("digits", {})
    (a_rps, a_lat, _, _), (b_rps, b_lat, _, _) = got["digits_unbatched"], got["digits"]
    return [
        Measurement(name, "digits conv net batched vs unbatched, c=16", "throughput", "req/s", "unbatched",
                    f"max_batch_size {MAX_BATCH}", a_rps, b_rps,
                    f"{_round_ratios(got['digits_unbatched'], got['digits'])}; {model.name} {shape}; "
                    f"client p50 ms {_pct(a_lat, 50):.2f} vs {_pct(b_lat, 50):.2f}; "
                    f"batched: mean batch {batched.get('batch_mean', 0):.2f}, infer p50 "
                    f"{batched.get('infer', {}).get('p50_ms', 0):.2f} ms; CPU: unbatched "
                    f"{loads['digits_unbatched'].cpu_note()}, batched {loads['digits'].cpu_note()}")
    ]  # fmt: skip


def run_overhead(ctx: BenchContext, *, name: str) -> list[Measurement]:
    import onnxruntime as ort
    import tritonclient.http as httpclient

    from bench.agent_roundtrip import FEATURES, MODEL_NAME, tiny_model
    from edgekit.validate.latency import p50_side_by_side
    from examples.agent_process import RunningAgent

    work = ctx.workdir / "serving-overhead"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_model(work / "roundtrip.onnx")
    calib = {"x": np.random.default_rng(1).standard_normal((32, FEATURES)).astype(np.float32)}
    bundle = _package(ctx, model, MODEL_NAME, calib, work / "bundles")
    x = calib["x"][:1].copy()
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    null = subprocess.Popen(
        [sys.executable, "-m", "bench.null_server"], stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1]
    )
    try:
        if null.stdout is None:
            raise BenchError("the do-nothing server has no stdout")
        null_port = int(null.stdout.readline())
        with RunningAgent(work / "agent", [ctx.pub]) as agent:
            agent.install(bundle)
            agent.wait_model_ready(MODEL_NAME)
            clients = {
                "agent": httpclient.InferenceServerClient(agent.host_port),
                "null": httpclient.InferenceServerClient(f"127.0.0.1:{null_port}"),
            }
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            out = [httpclient.InferRequestedOutput("y")]
            if clients["null"].infer(MODEL_NAME, [inp], outputs=out).as_numpy("y").shape != (1, 16):
                raise BenchError("the do-nothing server's canned answer does not parse")
            ctx.progress(f"{name}: agent vs do-nothing server vs session.run, interleaved")
            before = _scrape(agent.url)
            p50 = p50_side_by_side(
                {
                    "session.run": lambda: session.run(["y"], {"x": x}),
                    "null server": lambda: clients["null"].infer(MODEL_NAME, [inp], outputs=out),
                    "agent": lambda: clients["agent"].infer(MODEL_NAME, [inp], outputs=out),
                },
                repeats=ctx.repeats * 5,
                budget_s=ctx.budget_s,
                warmup=20,
            )
            from device_agents.stats import summarize

            stages = summarize(_scrape(agent.url).minus(before))[MODEL_NAME]
            exact, exact_cpu = _server_overhead(agent.url)
            for c in clients.values():
                c.close()
    finally:
        null.terminate()
        null.wait(10)
    overhead = p50["agent"] - p50["null server"] - p50["session.run"]
    stage_note = ", ".join(
        f"{s} {stages[s]['p50_ms']:.3f}" for s in ("decode", "queue", "infer", "encode") if s in stages
    )
    return [
        Measurement(name, "agent vs do-nothing v2 server (1 KB, binary)", "p50 round trip", "ms",
                    "do-nothing server", "agent", p50["null server"], p50["agent"],
                    f"session.run {p50['session.run']:.3f} ms; round-trip difference = agent - floor - run = "
                    f"{overhead:.3f} ms; stage p50 ms (bucketed): {stage_note}"),
        Measurement(name, "server-side overhead (1 KB, binary), measured in the agent", "p50", "ms",
                    "issue bound", "request received -> response written - runtime call", 0.15, exact["p50_ms"],
                    f"exact, over the agent's last {exact['samples']} requests (these runs); p90 "
                    f"{exact['p90_ms']:.3f} ms, p99 {exact['p99_ms']:.3f} ms; with the write counted by its CPU "
                    f"time (not the wait when the woken client preempts the writer) p50 {exact_cpu['p50_ms']:.3f} "
                    f"ms; beside it the round-trip difference {overhead:.3f} ms"),
    ]  # fmt: skip


def _server_overhead(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's own exact server-side overhead percentiles of the round-trip model
    (``/edgekit/v1/stats``): as measured, and with the write counted by its CPU time."""
    from bench.agent_roundtrip import MODEL_NAME

    got = _stats(url)
    row = got.get(MODEL_NAME, {})
    exact, exact_cpu = row.get("server_overhead_exact"), row.get("server_overhead_exact_write_cpu")
    if not exact or not exact_cpu:
        raise BenchError(f"the agent reported no server_overhead_exact for {MODEL_NAME} (stats: {got})")
    return dict(exact), dict(exact_cpu)


def _rss_mb(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).memory_info().rss) / 2**20


def run_limits(ctx: BenchContext, *, name: str) -> list[Measurement]:
    from bench.agent_roundtrip import FEATURES, MODEL_NAME, tiny_model
    from examples.agent_process import RunningAgent

    work = ctx.workdir / "serving-limits"
    work.mkdir(parents=True, exist_ok=True)
    calib = {"x": np.random.default_rng(1).standard_normal((32, FEATURES)).astype(np.float32)}
    bundle = _package(ctx, tiny_model(work / "m.onnx"), MODEL_NAME, calib, work / "bundles")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < IDLE_CONNECTIONS + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    extra = f"[server]\nmax_connections = {IDLE_CONNECTIONS + 100}\nidle_timeout_s = {IDLE_TIMEOUT_S}\n"
    rows: list[Measurement] = []
    with RunningAgent(work / "agent", [ctx.pub], extra_config=extra) as agent:
        agent.install(bundle)
        host, port = agent.host_port.split(":")

        def probe_ms() -> float:
            t0 = time.perf_counter()
            with urllib.request.urlopen(agent.url + "/v2/health/ready", timeout=30) as resp:
                resp.read()
            return (time.perf_counter() - t0) * 1000

        quiet = statistics.median(probe_ms() for _ in range(5))
        ctx.progress(f"{name}: opening {IDLE_CONNECTIONS} idle connections")
        socks = [socket.create_connection((host, int(port)), timeout=30) for _ in range(IDLE_CONNECTIONS)]
        opened = time.monotonic()
        try:
            busy = max(probe_ms() for _ in range(5))
            closed: set[int] = set()
            deadline = opened + IDLE_TIMEOUT_S + 5
            with selectors.DefaultSelector() as sel:  # epoll: select() stops at fd 1024
                for i, sock in enumerate(socks):
                    sel.register(sock, selectors.EVENT_READ, i)
                while len(closed) < len(socks) and time.monotonic() < deadline:
                    for key, _ in sel.select(0.5):
                        try:
                            data = key.fileobj.recv(1)  # type: ignore[union-attr]  # registered sockets
                        except OSError:
                            data = b""
                        if data == b"":
                            closed.add(key.data)
                            sel.unregister(key.fileobj)
            all_closed_s = time.monotonic() - opened
        finally:
            for s in socks:
                s.close()
        rows.append(
            Measurement(name, f"health probe with {IDLE_CONNECTIONS} idle connections", "latency", "ms",
                        "no idle connections (p50)", f"{IDLE_CONNECTIONS} idle (max of 5)", quiet, busy,
                        f"server closed {len(closed)}/{IDLE_CONNECTIONS} idle connections, the last after "
                        f"{all_closed_s:.1f} s (idle_timeout_s = {IDLE_TIMEOUT_S:g})")
        )  # fmt: skip

    with RunningAgent(work / "agent-gzip", [ctx.pub]) as agent:  # default limits
        agent.install(bundle)
        pid = agent.pid
        if pid is None:
            raise BenchError("the agent is not running")
        bomb = gzip.compress(b"\0" * (120 * 2**20), compresslevel=9)
        before = _rss_mb(pid)
        peak = [before]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_mb(pid))
                time.sleep(0.005)

        codes: list[int] = []

        def send() -> None:
            req = urllib.request.Request(
                agent.url + f"/v2/models/{MODEL_NAME}/infer",
                data=bomb,
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    codes.append(resp.status)
            except urllib.error.HTTPError as exc:
                codes.append(exc.code)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        ctx.progress(f"{name}: 4 parallel gzip bombs of {len(bomb) / 1024:.0f} KiB (120 MB inflated)")
        threads = [threading.Thread(target=send) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop.set()
        watcher.join(5)
        rows.append(
            Measurement(name, "4 parallel gzip bombs", "agent RSS", "MB", "before", "peak during", before, peak[0],
                        f"growth {peak[0] - before:.1f} MB; answers {sorted(codes)}; {len(bomb) / 1024:.0f} KiB each, "
                        "120 MB inflated; server.max_request_mb = 64, max_buffered_mb = 64")
        )  # fmt: skip
    return rows
