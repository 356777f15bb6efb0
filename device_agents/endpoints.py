"""Endpoints: a served name -> an ``Endpoint``. The only place that knows the mapping.

An endpoint is one model (``ModelEndpoint``: the model of that name in the registry, behind its
pipeline) or a cascade of such endpoints (``[models.<name>.route]``:
``device_agents.pipeline.cascade``). A variant set under budgets and a split pipeline are planned
endpoint kinds; they plug in here, and nothing above (service, front-ends) changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from device_agents.config import AgentConfig, RouteConfig
from device_agents.metrics import AgentMetrics
from device_agents.pipeline import Pipeline, Request
from device_agents.pipeline.cascade import CascadeEndpoint
from device_agents.pipeline.remote import RemoteMember
from device_agents.pipeline.slots import Slots
from device_agents.registry import Registry
from device_agents.runtimes import ServedModel
from edgekit.bundle.errors import ConfigError

T = TypeVar("T")


class Endpoint(Protocol):
    name: str

    def model(self, version: int | None = None) -> ServedModel:
        """The model whose signature this endpoint serves (for metadata and decoding)."""
        ...

    def infer(
        self,
        version: int | None,
        decode: Callable[[ServedModel], Request],
        encode: Callable[[Request], T],
    ) -> T: ...

    def depth(self) -> tuple[int, int]:
        """(requests queued, requests in flight)."""
        ...

    def stop(self, timeout_s: float) -> bool: ...


class ModelEndpoint:
    """One model, served under its own name."""

    def __init__(self, name: str, registry: Registry, pipeline: Pipeline) -> None:
        self.name = name
        self.registry = registry
        self.pipeline = pipeline

    def model(self, version: int | None = None) -> ServedModel:
        return self.registry.get(self.name, version)

    def infer(
        self,
        version: int | None,
        decode: Callable[[ServedModel], Request],
        encode: Callable[[Request], T],
    ) -> T:
        return self.pipeline.run(version, decode, encode)

    def depth(self) -> tuple[int, int]:
        return self.pipeline.batcher.depth(), self.pipeline.batcher.inflight

    def expected_s(self) -> float:
        """The median runtime call of the model's recent requests (0 before any): what escalating
        to it is expected to take, for a cascade."""
        p50_ms, _ = self.registry.get(self.name).latency.p50_between(0.0, float("inf"))
        return (p50_ms or 0.0) / 1000

    def stop(self, timeout_s: float) -> bool:
        return self.pipeline.stop(timeout_s)


class Endpoints:
    """Served name -> endpoint, built on first use for every model the registry serves."""

    def __init__(self, config: AgentConfig, registry: Registry, metrics: AgentMetrics) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.decode_slots = Slots(config.server.max_concurrent_decodes)
        self._endpoints: dict[str, Endpoint] = {}
        self._lock = threading.Lock()
        metrics.watch_queues(self._depths)

    def get(self, name: str) -> Endpoint:
        """The endpoint of ``name``; ``ModelNotFoundError`` when no model of that name is installed
        (for a cascade, ``[models.<name>.route]``: when one of its members is not)."""
        endpoint = self._endpoints.get(name)
        if endpoint is not None:
            return endpoint
        route = self.config.model(name).route
        if route is not None:
            return self._cascade(name, route)
        variants = self.config.model(name).variants
        if variants is not None:
            return self._variant_set(name, variants)
        self.registry.get(name)  # ModelNotFoundError for a name that is not served: no endpoint for it
        with self._lock:
            endpoint = self._endpoints.get(name)
            if endpoint is None:
                pipeline = Pipeline(name, self.registry, self.config, self.metrics, self.decode_slots)
                endpoint = self._endpoints[name] = ModelEndpoint(name, self.registry, pipeline)
        return endpoint

    def _cascade(self, name: str, route: RouteConfig) -> Endpoint:
        for member in route.members:
            if self.config.model(member).route is not None:
                raise ConfigError(f"agent.models.{name}.route: member {member!r} is a cascade itself; name models")
        local = route.members[:-1] if route.url is not None else route.members
        members: list[Any] = [self.get(member) for member in local]
        if route.url is not None:  # the last member answers on another v2 server
            first = members[0]
            members.append(RemoteMember(route.members[-1], route.url, route.timeout_ms, first.model))
        with self._lock:
            endpoint = self._endpoints.get(name)
            if endpoint is None:
                endpoint = self._endpoints[name] = CascadeEndpoint(name, members, route.threshold, self.metrics)
        return endpoint

    def _variant_set(self, name: str, variants: tuple[str, ...]) -> Endpoint:
        from device_agents.budgets.state import budgets_for
        from device_agents.budgets.variants import VariantEndpoint

        for variant in variants:
            if self.config.model(variant).route is not None or self.config.model(variant).variants is not None:
                raise ConfigError(f"agent.models.{name}.variants: {variant!r} is not a model; name served models")
        members: list[Any] = [self.get(variant) for variant in variants]
        with self._lock:
            endpoint = self._endpoints.get(name)
            if endpoint is None:
                endpoint = VariantEndpoint(name, members, self.registry, budgets_for(self.config.store))
                self._endpoints[name] = endpoint
        return endpoint

    def has(self, name: str) -> bool:
        return name in self._endpoints

    def names(self) -> list[str]:
        routes = {name for name, m in self.config.models.items() if m.route is not None or m.variants is not None}
        return sorted(set(self.registry.models()) | set(self.registry.installed()) | routes)

    def _depths(self) -> list[tuple[str, int, int]]:
        with self._lock:
            items = list(self._endpoints.items())
        return [(name, *endpoint.depth()) for name, endpoint in items]

    def stop(self, timeout_s: float) -> bool:
        """Drain every endpoint (new requests get 503); True if all finished within ``timeout_s``."""
        with self._lock:
            items = list(self._endpoints.values())
        deadline = time.monotonic() + timeout_s
        return all([endpoint.stop(max(0.0, deadline - time.monotonic())) for endpoint in items])
