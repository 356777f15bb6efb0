"""The serving pipeline of one endpoint: its stages in order, and the one place that times them.

    decode (front-end's, under the decode cap) -> queue (batcher) -> infer (runtime) -> encode (front-end's)

A request to an idle model skips the queue: it runs in the calling thread (``Batcher.run_inline``)
when the front-end can be answered from another thread (``Decoded.answer``), so that the
hung-call watchdog can still answer it; its queue stage is then ~0.

Pre/post-processing, the result cache and budgets join as stages here when they exist. Every
stage's time is measured by ``Pipeline.run`` and nowhere else, and a request's stages are
observed into ``edgekit_stage_seconds{model,stage}`` together, once: by ``Pipeline.run`` when it
ends, or, when the front-end gave a ``RequestTiming``, by the front-end after it has written the
answer (metrics work kept out of the request's received -> written time). A stage refuses a
request by raising a typed ``ServingError`` (or ``InferenceInputError``), which the front-end
maps to one status.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from device_agents.config import AgentConfig
from device_agents.errors import AnsweredError, RuntimeFailure, UnavailableError
from device_agents.metrics import AgentMetrics
from device_agents.pipeline.batching import Batcher, Job
from device_agents.pipeline.slots import Slots
from device_agents.registry import Registry
from device_agents.runtimes import ServedModel
from edgekit.bundle.errors import EdgekitError

T = TypeVar("T")
R = TypeVar("R")

# How long a request waits for a decode slot before a 503 (a burst of big bodies, or gzip bombs).
DECODE_WAIT_S = 1.0


class RequestTiming:
    """Filled in by the pipeline for the front-end: what a request's runtime call took (the
    front-end subtracts it from received -> written to get the server-side overhead), and what
    is left for the front-end to record once its response is written: the request's stage times
    (``stages``, of pipeline ``model``) and, when it ran in its own thread, the size of that call
    (``batch_rows``). Recording them is metrics work, not serving: done after the write, it stays
    out of the request's received -> written time. The front-end records them exactly once,
    whatever ends the request (``AgentMetrics.observe_request(..., stages, model, batch_rows)``,
    or ``observe_stages`` when no answer was written); ``take`` hands them over and clears them."""

    __slots__ = ("batch_rows", "model", "runtime_s", "stages")

    def __init__(self) -> None:
        self.runtime_s = 0.0
        self.model = ""
        self.stages: list[tuple[str, float]] | None = None
        self.batch_rows = 0

    def take(self) -> tuple[list[tuple[str, float]] | None, int]:
        """The stages and batch size left to record (None, 0 once taken)."""
        stages, rows = self.stages, self.batch_rows
        self.stages, self.batch_rows = None, 0
        return stages, rows


@dataclass(slots=True)
class Decoded(Generic[R]):
    """What a front-end's decode returns: its own request object and the input tensors.

    Not frozen: it is built once per request and read only by the pipeline, and a frozen
    dataclass's ``__init__`` (``object.__setattr__`` per field) costs ~2 us more."""

    request: R
    inputs: dict[str, np.ndarray]
    timeout_s: float | None = None  # the request's own deadline, if it sets one
    # Answers the request from another thread (the hung-call watchdog's) with an error, when the
    # caller's thread is stuck in a runtime call; given, an idle model runs the request inline.
    answer: Callable[[EdgekitError], None] | None = None
    # Given, the pipeline records the runtime call's time in it, and leaves the request's stage
    # metrics in it for the front-end to record after its answer is written (``RequestTiming``).
    timing: RequestTiming | None = None


class Pipeline:
    """The stages of one served name. Thread-safe; one per endpoint."""

    def __init__(
        self,
        name: str,
        registry: Registry,
        config: AgentConfig,
        metrics: AgentMetrics,
        decode_slots: Slots,
    ) -> None:
        self.name = name
        self.registry = registry
        # The RequestTiming of the request this thread runs inline, if any: its call's batch size
        # is left in it (recorded after the answer is written) instead of observed by ``on_batch``.
        self._inline = threading.local()
        self.metrics = metrics
        self.decode_slots = decode_slots
        server = config.server
        self.request_timeout_s = server.request_timeout_s
        self.retry_after_s = server.retry_after_s
        self.batcher = Batcher(
            name,
            lambda version: registry.lease(name, version),
            batching=config.model(name).batching,
            workers=config.model(name).workers or server.workers,
            queue_size=server.queue_size,
            hung_call_s=server.hung_call_s,
            retry_after_s=server.retry_after_s,
            on_batch=self._observe_batch,
            on_hung=self._hung,
            on_failure=self._failed,
        )

    def run(
        self,
        version: int | None,
        decode: Callable[[ServedModel], Decoded[R]],
        encode: Callable[[R, dict[str, np.ndarray], int], T],
        timeout_s: float | None = None,
    ) -> T:
        """Decode, queue, infer and encode one request; raise the refusing stage's error."""
        budget = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
        start = time.monotonic()
        deadline = start + budget
        batcher = self.batcher
        batched = batcher.batching is not None
        stages: list[tuple[str, float]] = []  # observed together, once, whatever stage ends the request
        deferred: RequestTiming | None = None  # where the front-end takes them from, if it gave one
        t0 = time.perf_counter()
        if batched:
            batcher.arrive(1)  # on its way (waiting for a decode slot, then decoding): a batch may wait for it
        if not self.decode_slots.acquire(timeout=DECODE_WAIT_S):
            if batched:
                batcher.arrive(-1)
            raise UnavailableError(
                f"{self.name}: every decode slot (server.max_concurrent_decodes) is busy",
                reason="decode_busy",
                retry_after_s=self.retry_after_s,
            )
        try:
            try:
                lease = self.registry.lease(self.name, version)
                try:
                    decoded = decode(lease.model)
                    inputs = lease.model.check_inputs(decoded.inputs)
                except BaseException:
                    lease.release()
                    raise
            except BaseException:
                if batched:
                    batcher.arrive(-1)
                raise
            finally:
                self.decode_slots.release()
            stages.append(("decode", time.perf_counter() - t0))
            deferred = decoded.timing
            if decoded.timeout_s is not None:
                deadline = min(deadline, start + decoded.timeout_s)
            job = Job(inputs, version, deadline)
            try:
                if batched:
                    batcher.arrive(-1)
                if decoded.answer is None:
                    inline = False
                else:
                    local = self._inline
                    local.timing = deferred  # the call's batch size goes there (``_observe_batch``)
                    try:
                        inline = batcher.run_inline(job, lease, decoded.answer)
                    finally:
                        local.timing = None
                if not inline:
                    lease.release()  # (run_inline released it when it ran the job here)
                    batcher.submit(job)
                    batcher.wait(job)
            finally:
                if job.started:
                    stages.append(("queue", job.started - job.enqueued))
                    if job.finished:
                        stages.append(("infer", job.finished - job.started))
            if job.answered:
                raise AnsweredError(f"model {self.name}: the hung-call watchdog answered this request")
            if job.outputs is None:  # no error raised: the batcher set them
                raise RuntimeFailure(f"model {self.name} returned no outputs")
            if deferred is not None:
                deferred.runtime_s = job.runtime_s
            t2 = time.perf_counter()
            out = encode(decoded.request, job.outputs, job.served_version)
            stages.append(("encode", time.perf_counter() - t2))
            return out
        finally:
            if stages:
                if deferred is not None:  # recorded by the front-end, after its answer is written
                    deferred.model, deferred.stages = self.name, stages
                else:
                    self.metrics.observe_stages(self.name, stages)

    def _observe_batch(self, rows: int) -> None:
        """The batcher's ``on_batch``: a call of ``rows`` ran; left in the request's RequestTiming
        when the call ran inline for it (in this thread), else observed now."""
        timing = getattr(self._inline, "timing", None)
        if timing is not None:
            timing.batch_rows = rows
        else:
            self.metrics.observe_batch(self.name, rows)

    def _failed(self, version: int, job: Job | None) -> None:
        """A request the runtime failed to run (a 500): counted against ``version`` unless the
        version it replaced, held through the health window, fails on it too (a hang: counted)."""
        if job is None:
            self.metrics.model_failures.labels(self.name).inc()
        else:
            self.registry.count_failure(self.name, version, job.inputs)

    def _hung(self, model: ServedModel) -> None:
        self.metrics.hung_calls.labels(self.name).inc()
        entry = self.registry.drop_if(self.name, model)
        if entry is not None:
            self.registry.retire(entry, wait_s=0)  # closed if its call ever returns

    def stop(self, timeout_s: float) -> bool:
        return self.batcher.stop(timeout_s)
