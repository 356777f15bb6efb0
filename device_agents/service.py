"""The agent service: the one API every front-end calls (HTTP today, the serial console later).

    status()  installed and served models, slots, errors
    install() hand a bundle to the lifecycle (verify, self-test, switch)
    uninstall(), rollback()  the operator's: remove a model, serve its previous version again
    infer()   one request through its endpoint's pipeline
    stats()   live serving numbers (latency percentiles, throughput, batch sizes, queues)

Front-ends decode and encode their wire format and map errors to their status codes; they hold
no policy. ``drain`` stops taking requests and lets the running ones finish (SIGTERM).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from device_agents.config import AgentConfig
from device_agents.endpoints import Endpoints
from device_agents.errors import UnavailableError
from device_agents.lifecycle import InstallResult, Lifecycle
from device_agents.pipeline import Request
from device_agents.runtimes import ServedModel
from device_agents.stats import exact_percentiles, serving_stats
from device_agents.store import ModelState

T = TypeVar("T")


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
