"""The result cache as two stages of an endpoint's pipeline (``device_agents.pipeline.stage``):

    cache_lookup  before pre-processing and the queue: a hit answers the request (no queue, no infer)
    cache_store   after post-processing: stores what the chain produced for a missed request

Both are present when the model caches: ``[models.<name>.cache]``, else the manifest's cache
policy (the config overrides it, ``enabled = false`` turns it off), and ``[cache] enabled``.
With ``mode = "approximate"``, an exact miss is looked up again by its inputs' signature
(``device_agents.cache.approximate``): the nearest stored answer of the same key context within
the distance threshold answers it (response parameters ``cache = "hit"`` and ``distance``), and
``recheck_fraction`` of those hits are re-run through the model in a background thread (models
without pre- or post-processing: the answer compared is the model's own), which holds the
false-hit budget by halving the threshold. An answer's signature is stored with it, so an
approximate hit that was written to disk (at its first hit) answers again after a restart.
Without a configured ``max_distance`` the threshold is
the one the packager calibrated into the manifest (``edgekit package --cache approximate``).
With ``mode = "semantic"`` the vector looked up is the unit-length output of ``embed_with``,
another served model run on the same inputs (``StageContext.registry`` leases it), instead of
the inputs' signature; the rest (threshold, hits, rechecks) is the approximate mode's.
A request with the v2 parameter ``"cache": "bypass"`` is neither looked up nor stored. Every
request through them carries the response parameter ``cache``: ``hit``, ``miss`` or ``bypass``.

The key is built from the leased model's manifest (name, version, artifact digest) and the inputs
as they arrive (``request.inputs`` and ``request.raw``, before pre-processing), so a version
switch changes every key; the first request to a newly active version sweeps the entries of the
others. An answer is stored only under the key of the version that produced it: in memory at
once (its key copied into the buffer of an entry evicted unwritten, where one fits), and on disk at its first
hit, so that what survives a restart is what repeated. In the exact mode, once the memory tier
is full, an answer is stored only at its key's second sighting (``admit = "second"``, the default:
``device_agents.cache.admission``), so traffic that never repeats costs a hash and a probe.

One ``ResultCache`` per store directory serves every endpoint (``shared_cache``); if it cannot
be opened the agent still serves (memory tier only, one log line).
"""

from __future__ import annotations

import atexit
import logging
import queue
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from device_agents.cache.approximate import FalseHitMeter, NearIndex, agrees, signature
from device_agents.cache.key import CacheKey, KeyMaker
from device_agents.cache.store import ResultCache
from device_agents.cache.tensors import UncacheableError
from device_agents.config import DEFAULT_CACHE_TTL_S, AgentConfig, ModelCacheConfig
from device_agents.metrics import CacheSeries
from device_agents.pipeline.stage import Request, StageContext
from device_agents.runtimes import ServedModel
from edgekit.bundle.errors import ConfigError, InferenceInputError
from edgekit.bundle.manifest import Manifest

log = logging.getLogger("edgekit.agent")

_MB = 1024 * 1024
CACHE_PARAMETER = "cache"  # v2 request parameter: "bypass" skips the cache for this request
BYPASS = "bypass"

_caches: dict[Path, ResultCache] = {}
_caches_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """What one endpoint caches: the mode, how long an entry lives, its share of the disk tier."""

    mode: str
    ttl_s: float
    max_bytes: int | None
    max_distance: float | None = None  # approximate mode: the starting distance threshold
    recheck_fraction: float = 0.0
    false_hit_budget: float = 0.01
    embed_with: str | None = None  # semantic mode: the served model whose output vector is the key
    admit: str = "first"  # "second": a full memory tier takes an answer at its key's second sighting


def policy(name: str, agent: AgentConfig, manifest: Manifest) -> CachePolicy | None:
    """The cache policy of endpoint ``name`` serving ``manifest``; None when it does not cache.
    ``ConfigError`` for a configured cache on a stateful model."""
    configured: ModelCacheConfig | None = agent.model(name).cache
    declared = manifest.cache
    if configured is not None and manifest.stateful:
        agent.model(name).check(name, manifest)  # ConfigError: says what to do
    if not agent.cache.enabled or (configured is None and declared is None):
        return None
    if configured is not None and not configured.enabled:
        return None
    if manifest.stateful:
        log.warning(
            "%s: the manifest of %s v%d asks for a result cache, but the model is stateful: not cached",
            name,
            manifest.name,
            manifest.version,
        )
        return None
    calibrated = declared.approximate if declared is not None and declared.mode == "approximate" else None
    mode = configured.mode if configured is not None else ("approximate" if calibrated is not None else "exact")
    if configured is None and declared is not None and declared.mode not in ("exact", "approximate"):
        log.warning(
            "%s: the manifest asks for a %s cache, which this agent version does not have; caching exact matches only",
            name,
            declared.mode,
        )
    ttl_s = configured.ttl_s if configured is not None and configured.ttl_s is not None else None
    if ttl_s is None:
        ttl_s = float(declared.ttl_s) if declared is not None else DEFAULT_CACHE_TTL_S
    max_mb = configured.max_mb if configured is not None else None
    max_bytes = None if max_mb is None else max_mb * _MB
    if configured is not None and configured.mode == "semantic":
        if configured.embed_with == name:
            raise ConfigError(
                f"agent.models.{name}.cache: embed_with names the model itself; name another served model "
                "(an encoder) whose output vector keys the cache"
            )
        return CachePolicy(
            mode,
            ttl_s,
            max_bytes,
            configured.max_distance,
            configured.recheck_fraction,
            configured.false_hit_budget,
            configured.embed_with,
        )
    if mode == "approximate":
        # the config's threshold and budget, else those the packager calibrated into the manifest
        max_distance = configured.max_distance if configured is not None else None
        if max_distance is None and calibrated is not None:
            max_distance = calibrated.max_distance
        if max_distance is None:
            raise ConfigError(
                f'agent.models.{name}.cache: mode = "approximate" needs max_distance (the cosine distance under '
                f"which an answer is reused, e.g. 0.01), and the manifest of {manifest.name} v{manifest.version} "
                "has no calibrated one: set it, or package with --cache approximate --false-hit-budget 0.01"
            )
        budget = configured.false_hit_budget if configured is not None else None
        if budget is None:
            budget = calibrated.false_hit_budget if calibrated is not None and calibrated.false_hit_budget else 0.01
        recheck = configured.recheck_fraction if configured is not None else 0.0
        return CachePolicy(mode, ttl_s, max_bytes, max_distance, recheck, budget)
    admit = configured.admit if configured is not None and configured.admit is not None else "second"
    return CachePolicy(mode, ttl_s, max_bytes, admit=admit)


def shared_cache(agent: AgentConfig, series: CacheSeries) -> ResultCache:
    """The agent's ``ResultCache`` under ``<store>/cache/``, opened on first use. A new metrics
    object for the same store (an agent started again in this process) gets a fresh one."""
    directory = agent.store / "cache"
    with _caches_lock:
        cache = _caches.get(directory)
        if cache is not None and cache.series is series:
            return cache
        if cache is not None:
            cache.close()
        cache = ResultCache(
            directory, max_bytes=agent.cache.max_mb * _MB, memory_max_bytes=agent.cache.memory_mb * _MB, series=series
        )
        _caches[directory] = cache
        atexit.register(cache.close)  # the writer's queue is committed before a clean exit
        return cache


class _Link:
    """What the lookup of a missed request hands its store stage: the key (hashed once) and when
    the lookup started, by request, until the request ends (``request.on_done``)."""

    __slots__ = ("index", "pending")

    def __init__(self, index: NearIndex | None = None) -> None:
        # request id -> (key, lookup start, version, (context, vector) in the approximate and semantic modes)
        self.pending: dict[int, tuple[CacheKey, float, int, tuple[bytes, np.ndarray] | None]] = {}
        self.index = index  # the approximate mode's signatures


class CacheLookup:
    """Answers a request from the cache, or marks it a miss for ``CacheStore``."""

    name = "cache_lookup"

    def __init__(
        self,
        endpoint: str,
        cache: ResultCache,
        policy: CachePolicy,
        series: CacheSeries,
        link: _Link,
        registry: Any = None,  # device_agents.registry.Registry: runs the semantic mode's embed_with model
    ) -> None:
        self.endpoint = endpoint
        self.registry = registry
        self._embed_failed = False  # the encoder failed last time: said once, not per request
        self.cache = cache
        self.policy = policy
        self.series = series
        self.link = link
        self._makers: dict[tuple[str, int], KeyMaker] = {}
        self._active: tuple[str, int] | None = None
        self._lock = threading.Lock()
        if policy.max_bytes is not None:
            cache.model_max_bytes[endpoint] = policy.max_bytes
        self.meter: FalseHitMeter | None = None
        self._rechecks: queue.Queue[tuple[ServedModel, dict[str, np.ndarray], Mapping[str, np.ndarray]]] | None = None
        if policy.max_distance is not None:
            self.meter = FalseHitMeter(endpoint, policy.max_distance, policy.false_hit_budget)
            self._publish()
            if policy.recheck_fraction > 0:
                self._rechecks = queue.Queue(maxsize=8)  # more pending than this: a hit is not rechecked
                threading.Thread(target=self._recheck_loop, name=f"cache-recheck-{endpoint}", daemon=True).start()

    def process(self, request: Request) -> None:
        asked = request.parameters.get(CACHE_PARAMETER)
        if asked is not None:
            if asked != BYPASS:
                raise InferenceInputError(f'parameters.cache must be "{BYPASS}" (or absent), got {asked!r}')
            request.response_parameters["cache"] = BYPASS
            self.series.lookup(self.endpoint, BYPASS)
            return
        t0 = time.perf_counter()
        model = request.model
        if model is None:  # the pipeline sets it before any stage; without it there is no key
            return
        maker = self._maker(model.manifest, active=request.version is None)
        try:
            key = maker.key({**request.inputs, **request.raw}, request.requested_outputs, request.parameters)
        except UncacheableError:
            request.response_parameters["cache"] = BYPASS
            self.series.lookup(self.endpoint, BYPASS)
            return
        hit = self.cache.get(key, self.endpoint)
        sig = None
        if hit is None and self.meter is not None and self.link.index is not None:
            sig = self._key_vector(request, key.header)
            near = None if sig is None else self.link.index.nearest(*sig)
            if near is not None and near[1] <= self.meter.threshold:
                hit = self.cache.get_digest(near[0], self.endpoint)
                if hit is not None:
                    request.response_parameters["distance"] = round(near[1], 6)
                    self._maybe_recheck(request, model, hit.outputs)
        if hit is not None:
            request.outputs = dict(hit.outputs)
            request.served_version = hit.version
            request.response_parameters["cache"] = "hit"
            self.series.lookup(self.endpoint, "hit", time.perf_counter() - t0, hit.cost_s)
            return
        request.response_parameters["cache"] = "miss"
        self.series.lookup(self.endpoint, "miss")
        pending = self.link.pending
        rid = id(request)
        pending[rid] = (key, t0, maker.version, sig)
        request.on_done.append(lambda: _forget(pending, rid))

    def _key_vector(self, request: Request, header: bytes) -> tuple[bytes, np.ndarray] | None:
        """(context, vector) looked up: the inputs' signature (approximate), or the unit-length
        output of the ``embed_with`` model on the same inputs (semantic; None when it cannot run:
        then the request is an exact look-up only). The context is the key's header (model,
        version, shapes, parameters), and in the semantic mode the encoder's name and version
        too: another encoder version maps inputs elsewhere, so its vectors are never compared."""
        if request.raw:
            return None
        embed_with = self.policy.embed_with
        if embed_with is None:
            sig = signature(request.inputs)
            return None if sig is None else (header, sig)
        if self.registry is None:
            return None
        try:
            with self.registry.lease(embed_with) as lease:
                encoder = lease.model.manifest
                outputs = lease.model.infer(dict(request.inputs))
        except Exception as exc:  # the encoder is not served, or refused these inputs: exact look-up only
            (log.debug if self._embed_failed else log.warning)(
                "%s: semantic cache: %s could not embed a request (%s); exact look-ups until it can",
                self.endpoint,
                embed_with,
                exc,
            )
            self._embed_failed = True
            return None
        self._embed_failed = False
        vector = np.asarray(next(iter(outputs.values())), np.float32).ravel()
        norm = float(np.linalg.norm(vector))
        if not norm > 0:
            return None
        return header + f"\0embed_with={encoder.name} v{encoder.version}".encode(), vector / norm

    def _maybe_recheck(self, request: Request, model: ServedModel, cached: Mapping[str, np.ndarray]) -> None:
        """Queue this approximate hit for a fresh run, with probability ``recheck_fraction``."""
        if self._rechecks is None or random.random() >= self.policy.recheck_fraction:
            return
        manifest = model.manifest
        if manifest.preprocess or manifest.postprocess:  # the cached answer is not the model's own output
            return
        try:
            self._rechecks.put_nowait((model, dict(request.inputs), cached))
        except queue.Full:
            pass  # rechecks are a sample: one dropped under load changes nothing but their count

    def _recheck_loop(self) -> None:
        rechecks, meter = self._rechecks, self.meter
        if rechecks is None or meter is None:
            return
        while True:
            model, inputs, cached = rechecks.get()
            try:
                fresh = model.infer(inputs)
            except Exception as exc:  # the model was unloaded or replaced meanwhile: no verdict
                log.debug("%s: a cache recheck could not run (%s)", self.endpoint, exc)
                continue
            meter.record(agrees(cached, fresh))
            self._publish()

    def _publish(self) -> None:
        meter = self.meter
        if meter is not None:
            self.series.approximate(self.endpoint, meter.threshold, meter.rate, meter.bound, meter.rechecked)

    def _maker(self, manifest: Manifest, active: bool) -> KeyMaker:
        ident = (manifest.name, manifest.version)
        maker = self._makers.get(ident)
        if maker is None:
            with self._lock:
                maker = self._makers.get(ident)
                if maker is None:
                    maker = self._makers[ident] = KeyMaker.for_model(self.endpoint, manifest)
        if active and ident != self._active:
            with self._lock:
                if ident != self._active:
                    self._active = ident
                    self.cache.sweep(self.endpoint, manifest.version)  # the replaced version's entries
                    index = self.link.index
                    if index is not None:
                        index.clear()  # their signatures; this version's stored ones (a restart) come back
                        for context, sig, digest in self.cache.signatures(
                            self.endpoint, manifest.version, index.capacity
                        ):
                            index.add(context, sig, digest)
        return maker


def _forget(pending: dict[int, tuple[CacheKey, float, int, tuple[bytes, np.ndarray] | None]], rid: int) -> None:
    pending.pop(rid, None)


class CacheStore:
    """Stores the answer of a request ``CacheLookup`` missed (what the chain produced)."""

    name = "cache_store"

    def __init__(self, endpoint: str, cache: ResultCache, policy: CachePolicy, link: _Link) -> None:
        self.endpoint = endpoint
        self.cache = cache
        self.policy = policy
        self.link = link

    def process(self, request: Request) -> None:
        pending = self.link.pending.pop(id(request), None)
        if pending is None or request.outputs is None:
            return
        key, t0, version, sig = pending  # sig: (context, vector) in the approximate and semantic modes
        if request.served_version != version:  # an update switched versions meanwhile: not this key's answer
            return
        try:
            self.cache.put(
                key,
                request.outputs,
                model=self.endpoint,
                version=version,
                ttl_s=self.policy.ttl_s,
                cost_s=time.perf_counter() - t0,
                disk_on_hit=True,  # durable once it repeats: an answer never asked again costs no disk write
                admit=self.policy.admit,
                signature=sig,  # kept with it: found again after a restart
            )
        except UncacheableError:
            return
        if sig is not None and self.link.index is not None:
            self.link.index.add(sig[0], sig[1], key.digest)


# The stages of one endpoint share a _Link; the store factory runs right after the lookup's
# (table order, one pipeline at a time per endpoint) and takes it from here.
_links: dict[tuple[Path, str], _Link] = {}


def lookup(context: StageContext) -> CacheLookup | None:
    """Stage factory (``STAGE_FACTORIES["cache_lookup"]``)."""
    found = policy(context.name, context.agent, context.manifest)
    if found is None:
        return None
    link = _links[(context.agent.store, context.name)] = _Link(NearIndex() if found.max_distance is not None else None)
    cache = shared_cache(context.agent, context.metrics.cache)
    return CacheLookup(context.name, cache, found, context.metrics.cache, link, context.registry)


def store(context: StageContext) -> CacheStore | None:
    """Stage factory (``STAGE_FACTORIES["cache_store"]``)."""
    found = policy(context.name, context.agent, context.manifest)
    link = _links.pop((context.agent.store, context.name), None)
    if found is None or link is None:
        return None
    return CacheStore(context.name, shared_cache(context.agent, context.metrics.cache), found, link)
