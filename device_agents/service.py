"""The agent service: the one API every front-end calls (HTTP today, the serial console later).

    status()  installed and served models, slots, errors
    install() hand a bundle to the lifecycle (verify, self-test, switch)
    uninstall(), rollback()  the operator's: remove a model, serve its previous version again
    load_model(), unload_model(), repository(), statistics()  what Triton's extensions ask
    infer()   one request through its endpoint's pipeline
    stats()   live serving numbers (latency percentiles, throughput, batch sizes, queues)
    trace()   a Chrome trace of the requests served in the next N seconds (``pipeline.trace``)

Front-ends decode and encode their wire format and map errors to their status codes; they hold
no policy. ``drain`` stops taking requests and lets the running ones finish (SIGTERM).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from device_agents.config import AgentConfig
from device_agents.endpoints import Endpoints
from device_agents.errors import UnavailableError
from device_agents.lifecycle import InstallResult, Lifecycle
from device_agents.metrics import STAGES
from device_agents.pipeline import Request
from device_agents.runtimes import ServedModel
from device_agents.stats import exact_percentiles, serving_stats, snapshot
from device_agents.store import ModelState

T = TypeVar("T")


log = logging.getLogger("edgekit.agent")


def unmatched_model_tables(config: AgentConfig, installed: Iterable[str]) -> list[str]:
    """One warning per ``[models.NAME]`` table that names no installed model (a typo such as
    ``[models.tinyresnt]`` otherwise applies its batching or cache to nothing, silently). Tables
    that make their name an endpoint (``variants``, ``route``) name no installed model by design."""
    names = sorted(set(installed))
    out = []
    for table, mc in sorted(config.models.items()):
        if table in names or mc.variants is not None or mc.route is not None:
            continue
        near = difflib.get_close_matches(table, names, n=1)
        hint = f"; did you mean [models.{near[0]}]?" if near else ""
        out.append(
            f"[models.{table}] names no installed model (installed: {', '.join(names) or 'none'}{hint}): its "
            "settings apply to nothing until a model of that name is installed"
        )
    return out


class AgentService:
    def __init__(self, config: AgentConfig, lifecycle: Lifecycle | None = None) -> None:
        self.config = config
        self.lifecycle = lifecycle or Lifecycle(config)
        self.metrics = self.lifecycle.metrics
        self.endpoints = Endpoints(config, self.lifecycle.registry, self.metrics)
        self.draining = False

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Recover the store and load every installed model (``ConfigError`` if the config cannot
        serve one of them, e.g. batching for a static-batch model)."""
        self.lifecycle.start()
        for name in self.lifecycle.models():
            self.config.model(name).check(name, self.lifecycle.registry.get(name).manifest)
        installed = [n for n, ms in self.lifecycle.model_states().items() if ms.active is not None]
        for warning in unmatched_model_tables(self.config, installed):
            log.warning("%s", warning)

    @property
    def ready(self) -> bool:
        return self.lifecycle.ready and not self.draining

    def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests (503), finish the queued and running ones; True if all finished."""
        self.draining = True
        return self.endpoints.stop(self.config.server.drain_timeout_s if timeout_s is None else timeout_s)

    def stop(self) -> None:
        self.drain()
        self.lifecycle.stop()

    # -- the API ------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self.lifecycle.status()

    def models(self) -> dict[str, int]:
        return self.lifecycle.models()

    def install(self, bundle: Path, *, origin: str = "sideload") -> InstallResult:
        return self.lifecycle.install(bundle, origin=origin)

    def uninstall(self, name: str, *, origin: str = "cli") -> ModelState:
        """Stop serving ``name`` and remove its files (``ModelNotFoundError`` when not installed)."""
        return self.lifecycle.uninstall(name, origin=origin)

    def rollback(self, name: str, *, origin: str = "cli") -> ModelState:
        """Serve ``name``'s previous version again, recorded as the operator's rollback."""
        return self.lifecycle.operator_rollback(name, origin=origin)

    def load_model(self, name: str) -> int:
        """Serve ``name``'s installed version again after ``unload_model``; its version."""
        return self.lifecycle.load(name)

    def unload_model(self, name: str) -> None:
        """Stop serving ``name`` (it stays installed) until ``load_model`` or the next start."""
        self.lifecycle.unload(name)

    def repository(self) -> list[dict[str, Any]]:
        """Every installed model: name, active version, and whether it is served (``ready``) or why not."""
        out = []
        for name, ms in self.lifecycle.model_states().items():
            if ms.active is None:
                continue
            ready = not self.lifecycle.registry.held_unloaded(name)
            reason = "" if ready else (ms.error or "unloaded")
            out.append({"name": name, "version": ms.active.version, "ready": ready, "reason": reason})
        return out

    def statistics(self) -> dict[str, dict[str, Any]]:
        """Per model since start: the served version, requests that succeeded and failed, and per
        stage (``request``, ``decode``, ``queue``, ``infer``, ``encode``, ``batch``) a count and total
        (seconds; rows for ``batch``)."""
        snap = snapshot(self.metrics.registry.collect())
        out: dict[str, dict[str, Any]] = {}
        served = self.models()
        for name, ms in self.lifecycle.model_states().items():
            if ms.active is None:
                continue
            row: dict[str, Any] = {"version": served.get(name, ms.active.version)}
            row["success"] = int(sum(v for (m, code), v in snap.requests.items() if m == name and code == "200"))
            row["fail"] = int(sum(v for (m, code), v in snap.requests.items() if m == name and code != "200"))
            for kind, stage in (("request", ""), *(("stage", s) for s in STAGES), ("batch", "")):
                h = snap.histograms.get((kind, name, stage))
                row[stage or kind] = (int(h.count), h.total) if h is not None else (0, 0.0)
            out[name] = row
        return out

    def serves(self, name: str) -> bool:
        """True when ``name`` is an endpoint (a label safe to put on metrics)."""
        return self.endpoints.has(name)

    def model(self, name: str, version: int | None = None) -> ServedModel:
        """The served model of ``name`` (``ModelNotFoundError`` if none), for metadata."""
        return self.endpoints.get(name).model(version)

    def infer(
        self,
        name: str,
        version: int | None,
        decode: Callable[[ServedModel], Request],
        encode: Callable[[Request], T],
    ) -> T:
        """Run one request through ``name``'s endpoint; raises the refusing stage's typed error."""
        if self.draining:
            raise UnavailableError(
                "the agent is shutting down", reason="draining", retry_after_s=self.config.server.retry_after_s
            )
        return self.endpoints.get(name).infer(version, decode, encode)

    def stats(self) -> dict[str, Any]:
        """``serving_stats``, plus per model ``server_overhead_exact``: exact percentiles of the
        last ``metrics.OVERHEAD_SAMPLES`` server-side overheads (the histogram's are bucketed), and
        ``server_overhead_exact_write_cpu``: the same with each response's write counted by its CPU
        time (without the wait when the woken client preempts the writing thread); and
        ``queue_infer_exact``: exact percentiles of the last requests' own queue + infer time."""
        out = serving_stats(self.metrics.registry)
        for model, samples in self.metrics.overhead_samples().items():
            if samples and model in out:
                out[model]["server_overhead_exact"] = exact_percentiles([wall for wall, _ in samples])
                out[model]["server_overhead_exact_write_cpu"] = exact_percentiles([cpu for _, cpu in samples])
        for model, times in self.metrics.queue_infer_samples().items():
            if times and model in out:
                out[model]["queue_infer_exact"] = exact_percentiles(times)
        return out

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def trace(self, seconds: float) -> dict[str, Any]:
        """Record the requests served in the next ``seconds``; their Chrome trace (``pipeline.trace``)."""
        from device_agents.pipeline.trace import ACTIVE

        return ACTIVE.record(seconds)
