"""The ``split`` stage: head here, tail on the v2 server, or pass the request on to the local model.

Per request it picks, for the link measured now, the option with the lowest expected latency::

    local: the plan's local_latency_ms                         (the full model, queue + infer)
    cut:   head_ms + (cut bytes + output bytes) * 8 / bandwidth + rtt + tail_latency_ms

(per-sample costs times the request's rows; ``head_ms`` starts at the plan's and follows the heads
timed here). When a cut wins, the head runs with the model's own runtime and the tail is asked
within ``deadline_ms`` (and the request's deadline); its answer, checked against the model's
signature, answers the request early. Anything else - unreachable, no answer in time, an HTTP
error, garbage (wrong names, dtypes or shapes, NaN), the head failing - counts one fallback of
that reason, holds the tail off for ``retry_after_s``, and passes the request on: the local model
answers it, so no request is lost. A model update is served locally until its own heads load.

Metrics (on /metrics): ``edgekit_split_chosen{model,cut}`` (1 for the option picked last,
``local`` included), ``edgekit_split_link_rtt_ms{model}``, ``edgekit_split_link_bandwidth_mbps{model}``,
``edgekit_split_requests_total{model,cut}`` and ``edgekit_split_fallbacks_total{model,reason}``.

A split answer ends the chain: post-processing stages do not run on it, so a model with
post-processing in its manifest is refused for splitting (ConfigError at start).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from device_agents.config import AgentConfig, SplitConfig
from device_agents.errors import RuntimeFailure
from device_agents.pipeline.stage import Request, StageContext
from device_agents.split.client import TailClient, TailError
from device_agents.split.link import LinkEstimate
from edgekit.bundle.errors import ConfigError
from edgekit.bundle.manifest import Manifest, SplitCut, SplitPlan

if TYPE_CHECKING:
    from device_agents.runtimes import ArtifactRunner, ServedModel

log = logging.getLogger("edgekit.agent.split")
LOCAL = "local"


class SplitMetrics:
    """The split metrics of one metrics registry (made once per registry, shared by its endpoints)."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, SplitMetrics]] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.chosen = Gauge(
            "edgekit_split_chosen", "1 for the option (a cut or local) picked last", ["model", "cut"], registry=r
        )
        self.rtt_ms = Gauge(
            "edgekit_split_link_rtt_ms", "round-trip time to the tail server (EWMA)", ["model"], registry=r
        )
        self.bandwidth_mbps = Gauge(
            "edgekit_split_link_bandwidth_mbps", "bandwidth to the tail server (EWMA)", ["model"], registry=r
        )
        self.requests = Counter(
            "edgekit_split_requests", "requests answered by a head here and a tail there", ["model", "cut"], registry=r
        )
        self.fallbacks = Counter(
            "edgekit_split_fallbacks",
            "split attempts answered locally instead, by reason",
            ["model", "reason"],
            registry=r,
        )

    @classmethod
    def of(cls, registry: CollectorRegistry) -> SplitMetrics:
        with cls._lock:
            found = cls._by_registry.get(registry)
            if found is None:
                found = cls._by_registry[registry] = cls(registry)
            return found


class SplitStage:
    name = "split"

    def __init__(
        self, endpoint: str, config: SplitConfig, agent: AgentConfig, manifest: Manifest, metrics: SplitMetrics
    ) -> None:
        plan = manifest.split
        if plan is None:
            raise ConfigError(f"model {endpoint}: its bundle has no split plan")
        _check_plan(endpoint, plan)
        self.endpoint = endpoint
        self.config = config
        self.agent = agent
        self.metrics = metrics
        self.client = TailClient(config)
        self.link = LinkEstimate(alpha=config.ewma_alpha, bandwidth_mbps=config.bandwidth_mbps)
        self.head_ms = {c.id: float(c.head_latency_ms or 0.0) for c in plan.cuts}
        self.down_until = 0.0  # time.monotonic() before which the tail is not asked
        self.last_split = 0.0  # when a request last went through a tail
        self._chosen = ""
        self._heads: dict[tuple[int, str], ArtifactRunner] = {}
        self._heads_lock = threading.Lock()
        # (tail model, one row of head outputs, the model's outputs, the tail's planned ms per row)
        self._probe_tensor: tuple[str, dict[str, np.ndarray], Any, float] | None = None
        self._stop = threading.Event()
        metrics.bandwidth_mbps.labels(endpoint).set(self.link.bandwidth_mbps)
        thread = threading.Thread(
            target=_probe_loop, args=(weakref.ref(self), self._stop), name=f"split-probe-{endpoint}", daemon=True
        )
        thread.start()

    # -- the stage ----------------------------------------------------------------------
    def process(self, request: Request) -> None:
        model = request.model
        plan = model.manifest.split if model is not None else None
        if model is None or plan is None:
            return
        rows = _rows(request.inputs)
        cut = self.choose(plan, rows)
        self._record_choice(cut.id if cut else LOCAL)
        if cut is None:
            if self._probe_tensor is None and time.monotonic() >= self.down_until:
                self._make_probe_tensor(request, model, plan)
            return
        request.inputs = model.check_inputs(request.inputs)  # a 400 for a bad input, as locally
        try:
            head = self._head(model, cut)
            t0 = time.perf_counter()
            mid = dict(head.run(request.inputs))
            t1 = time.perf_counter()
            self.head_ms[cut.id] = _mix(self.head_ms[cut.id], (t1 - t0) * 1000.0 / rows, self.config.ewma_alpha)
            left_s = min(self.config.deadline_ms / 1000.0, request.deadline - time.monotonic())
            if left_s <= 0:
                raise TailError("no time left for the tail", "deadline")
            outputs, sent, received = self.client.infer(cut.tail_model, mid, model.outputs, left_s)
            elapsed_ms = (time.perf_counter() - t1) * 1000.0
        except TailError as exc:
            self._fallback(exc.reason, exc)
            return
        except Exception as exc:  # whatever the head's runtime raises, the full model may still answer
            self._fallback("head", exc)
            return
        if not self.client.last_call_connected():
            self.link.observe_transfer(sent + received, elapsed_ms, (cut.tail_latency_ms or 0.0) * rows)
            self.metrics.bandwidth_mbps.labels(self.endpoint).set(self.link.bandwidth_mbps)
        self.metrics.requests.labels(self.endpoint, cut.id).inc()
        self.last_split = time.monotonic()
        self._probe_tensor = (
            cut.tail_model,
            {k: v[:1] for k, v in mid.items()},
            model.outputs,
            cut.tail_latency_ms or 0.0,
        )
        request.outputs = outputs
        request.served_version = model.manifest.version
        request.response_parameters["split"] = cut.id

    def _make_probe_tensor(self, request: Request, model: ServedModel, plan: SplitPlan) -> None:
        """Local from the start (the link first thought too slow): the default cut's head on one
        row of this request gives the probes a tensor to measure the link with, so that a link
        better than thought is found (else no request would ever go through the tail)."""
        cut = next((c for c in plan.cuts if c.id == plan.default_cut), plan.cuts[0] if plan.cuts else None)
        if cut is None:
            return
        try:
            inputs = model.check_inputs({k: v[:1] for k, v in request.inputs.items()})
            mid = dict(self._head(model, cut).run(inputs))
        except Exception as exc:  # the request goes on to the local model whatever the head does
            log.warning("%s: head %s for the link probe failed: %s", self.endpoint, cut.id, exc)
            return
        self._probe_tensor = (cut.tail_model, mid, model.outputs, cut.tail_latency_ms or 0.0)

    # -- the choice ---------------------------------------------------------------------
    def choose(self, plan: SplitPlan, rows: int = 1) -> SplitCut | None:
        """The cut expected to answer soonest over the link measured now; None: local."""
        if time.monotonic() < self.down_until:
            return None
        best: SplitCut | None = None
        best_ms = float(plan.local_latency_ms or 0.0) * rows
        rtt = self.link.rtt_ms or 0.0
        back = (plan.output_bytes_per_sample or 0) * rows
        for cut in plan.cuts:
            ms = (
                self.head_ms.get(cut.id, 0.0) * rows
                + self.link.transfer_ms(cut.cut_bytes_per_sample * rows + back)
                + rtt
                + (cut.tail_latency_ms or 0.0) * rows
            )
            if ms < best_ms:
                best, best_ms = cut, ms
        return best

    def _record_choice(self, option: str) -> None:
        if option != self._chosen:
            if self._chosen:
                self.metrics.chosen.labels(self.endpoint, self._chosen).set(0)
            self.metrics.chosen.labels(self.endpoint, option).set(1)
            self._chosen = option

    def _fallback(self, reason: str, exc: BaseException) -> None:
        log.warning("%s: split -> local (%s): %s", self.endpoint, reason, exc)
        self.metrics.fallbacks.labels(self.endpoint, reason).inc()
        self.down_until = time.monotonic() + self.config.retry_after_s
        self._record_choice(LOCAL)

    # -- heads --------------------------------------------------------------------------
    def _head(self, model: ServedModel, cut: SplitCut) -> ArtifactRunner:
        key = (model.manifest.version, cut.id)
        runner = self._heads.get(key)
        if runner is not None:
            return runner
        with self._heads_lock:
            runner = self._heads.get(key)
            if runner is None:
                runner = self._heads[key] = self._load_head(model, cut)
        return runner

    def _load_head(self, model: ServedModel, cut: SplitCut) -> ArtifactRunner:
        m = model.manifest
        runner = load_head(self._model_dir(model), m, cut, self.agent.runtime_options(m.name, m.compatibility.runtime))
        log.info("%s v%d: head %s loaded (%s)", m.name, m.version, cut.id, cut.head_file)
        return runner

    def _model_dir(self, model: ServedModel) -> Path:
        found = getattr(model, "model_dir", None)
        if found is not None:
            return Path(found)
        from device_agents.store import Store

        store = Store(self.agent.store)
        state = store.model_state(model.manifest.name)
        for slot in (state.active, state.candidate, state.previous):
            if slot is not None and slot.version == model.manifest.version:
                return store.model_dir(slot)
        raise RuntimeFailure(f"model {model.manifest.name} v{model.manifest.version}: no store slot holds it")

    # -- probes -------------------------------------------------------------------------
    def probe(self) -> None:
        """One light probe: the RTT; and, when no request went through a tail lately, a small infer
        (the last cut tensor sent, one row) for a bandwidth sample - which also checks the answer."""
        deadline_s = self.config.deadline_ms / 1000.0
        try:
            rtt_s = self.client.probe(deadline_s)
        except TailError as exc:
            if time.monotonic() >= self.down_until:
                self._fallback(f"probe_{exc.reason}", exc)
            else:
                self.down_until = time.monotonic() + self.config.retry_after_s
            return
        self.link.observe_rtt(rtt_s * 1000.0)
        self.metrics.rtt_ms.labels(self.endpoint).set(self.link.rtt_ms or 0.0)
        sample = self._probe_tensor
        if sample is None or time.monotonic() - self.last_split < self.config.probe_interval_s:
            return
        if time.monotonic() < self.down_until:
            return
        tail, mid, outputs, tail_ms = sample
        t0 = time.perf_counter()
        try:
            _, sent, received = self.client.infer(tail, mid, outputs, deadline_s)
        except TailError as exc:
            self._fallback(f"probe_{exc.reason}", exc)
            return
        if not self.client.last_call_connected():
            self.link.observe_transfer(sent + received, (time.perf_counter() - t0) * 1000.0, tail_ms)
            self.metrics.bandwidth_mbps.labels(self.endpoint).set(self.link.bandwidth_mbps)

    def close(self) -> None:
        self._stop.set()
        self.client.close()


def _probe_loop(ref: weakref.ref[SplitStage], stop: threading.Event) -> None:
    stage = ref()
    interval = stage.config.probe_interval_s if stage is not None else 1.0
    del stage
    while not stop.wait(interval):
        stage = ref()
        if stage is None:
            return
        try:
            stage.probe()
        except Exception:  # a probe must never end the loop; the next one tries again
            log.exception("split probe failed")
        del stage


def load_head(model_dir: Path, manifest: Manifest, cut: SplitCut, options: Any) -> ArtifactRunner:
    """The head of ``cut`` opened with the bundle's own runtime and ``options`` (the runtime opens
    the manifest's artifact: the same manifest with the head as its artifact)."""
    from device_agents.runtimes import runner_class

    if not any(f.path == cut.head_file for f in manifest.files):
        raise RuntimeFailure(f"model {manifest.name} v{manifest.version}: {cut.head_file} is not in its bundle")
    files = tuple(
        dataclasses.replace(f, role="artifact")
        if f.path == cut.head_file
        else (dataclasses.replace(f, role="split_head") if f.role == "artifact" else f)
        for f in manifest.files
    )
    head_manifest = dataclasses.replace(manifest, files=files)
    runner: ArtifactRunner = runner_class(manifest.compatibility.runtime)(model_dir, head_manifest, options)  # type: ignore[call-arg]  # the Protocol leaves __init__ to each runtime
    return runner


def _check_plan(endpoint: str, plan: SplitPlan) -> None:
    missing = [c.id for c in plan.cuts if c.tail_latency_ms is None or c.head_latency_ms is None]
    if plan.local_latency_ms is None or missing:
        raise ConfigError(
            f"model {endpoint}: its split plan lacks planned latencies (local_latency_ms, or head/tail of {missing}); "
            "package it again with `edgekit split`"
        )


def _rows(inputs: dict[str, np.ndarray]) -> int:
    for value in inputs.values():
        return int(value.shape[0]) if value.ndim else 1
    return 1


def _mix(old: float, new: float, alpha: float) -> float:
    return new if old <= 0 else (1.0 - alpha) * old + alpha * new


def factory(context: StageContext) -> SplitStage | None:
    """The split stage of a model whose bundle has a split plan, when ``[split]`` is configured."""
    config = context.agent.split
    if config is None or context.manifest.split is None:
        return None
    if config.models and context.name not in config.models:
        return None
    if getattr(context.manifest, "postprocess", ()):
        raise ConfigError(
            f"model {context.name}: split inference does not run post-processing on the tail's answer; "
            f"remove {context.name} from split.models or package it without post-processing"
        )
    return SplitStage(context.name, config, context.agent, context.manifest, SplitMetrics.of(context.metrics.registry))
