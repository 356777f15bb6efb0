"""The serving pipeline of one endpoint: its stages in order, and the one place that times them.

    decode (front-end's, under the decode cap) -> [configured stages before infer] ->
    queue (batcher) -> infer (runtime) -> [configured stages after infer] -> encode (front-end's)

The configured stages (admission, cache, pre/post-processing, ...) are built once per endpoint
from the stage table (``device_agents.pipeline.stage.STAGE_FACTORIES``: its docstring says how to
add one); a model that configures none runs decode -> queue -> infer -> encode, and the empty
chain costs two tuple tests and a list test per request (what each stage adds: the benchmark
``serving.stages``). A stage before infer may answer the request early (a cache hit): the rest
of the chain is skipped up to encode.

A request to an idle model skips the queue: it runs in the calling thread (``Batcher.run_inline``)
when the front-end can be answered from another thread (``Request.answer``), so that the
hung-call watchdog can still answer it; its queue stage is then ~0.

Every stage's time is measured by ``Pipeline.run`` and nowhere else, and a request's stages are
observed into ``edgekit_stage_seconds{model,stage}`` together, once: by ``Pipeline.run`` when it
ends, or, when the front-end gave a ``RequestTiming``, by the front-end after it has written the
answer (metrics work kept out of the request's received -> written time). A stage refuses a
request by raising a typed ``ServingError`` (or ``InferenceInputError``), which the front-end
maps to one status.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from device_agents.budgets.state import batch_step
from device_agents.config import AgentConfig
from device_agents.errors import AnsweredError, RuntimeFailure, UnavailableError
from device_agents.metrics import AgentMetrics
from device_agents.pipeline import stage as stage_table
from device_agents.pipeline.batching import Batcher
from device_agents.pipeline.jobs import Job
from device_agents.pipeline.slots import Slots
from device_agents.pipeline.stage import Request, RequestTiming, Stage, StageContext
from device_agents.pipeline.trace import ACTIVE as TRACING
from device_agents.pipeline.trace import Recording
from device_agents.registry import Lease, Registry
from device_agents.runtimes import ServedModel

__all__ = ["DECODE_WAIT_S", "Pipeline", "Request", "RequestTiming", "Stage"]

log = logging.getLogger("edgekit.agent")

T = TypeVar("T")

# How long a request waits for a decode slot before a 503 (a burst of big bodies, or gzip bombs).
DECODE_WAIT_S = 1.0


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
        # the configured stages (built before the batcher's threads start: a factory may refuse)
        context = StageContext(name, config.model(name), config, registry.get(name).manifest, metrics, registry)
        self.before: tuple[Stage, ...]
        self.after: tuple[Stage, ...]
        self.before, self.after = stage_table.build_stages(context)
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
            on_stopped=lambda how: metrics.hung_call_stops.labels(name, how).inc(),
            degraded=batch_step(config),
        )

    def run(self, version: int | None, decode: Callable[[ServedModel], Request], encode: Callable[[Request], T]) -> T:
        """Decode, run the chain (configured stages, queue + infer) and encode one request;
        raise the refusing stage's error."""
        start = time.monotonic()
        deadline = start + self.request_timeout_s
        batcher = self.batcher
        batched = batcher.batching is not None
        stages: list[tuple[str, float]] = []  # observed together, once, whatever stage ends the request
        deferred: RequestTiming | None = None  # where the front-end takes them from, if it gave one
        request: Request | None = None
        job: Job | None = None  # its runtime call (read only while a trace records)
        before = self.before
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
                    request = decode(lease.model)
                    if not before:  # else checked once the stages before infer made them the model's
                        request.inputs = lease.model.check_inputs(request.inputs)
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
            deferred = request.timing
            request.model = lease.model
            if request.timeout_s is not None:
                deadline = min(deadline, start + request.timeout_s)
            request.deadline = deadline
            if before and not self._run_before(request, lease, stages):
                if batched:
                    batcher.arrive(-1)
                lease.release()  # answered early: no queue, no infer
            else:
                job = self._queue_infer(request, lease, stages, version, batched)
                if self.after:
                    self._chain(self.after, request, stages, early=False)
            t2 = time.perf_counter()
            out = encode(request)
            stages.append(("encode", time.perf_counter() - t2))
            return out
        finally:
            if request is not None and request.on_done:
                self._done(request)
            recording = TRACING.recording  # None unless `edgekit-agent trace` runs: the only cost then
            if recording is not None and stages:
                self._trace(recording, request, job, t0, stages)
            if stages:
                if deferred is not None:  # recorded by the front-end, after its answer is written
                    deferred.model, deferred.stages = self.name, stages
                else:
                    self.metrics.observe_stages(self.name, stages)

    def _trace(
        self, recording: Recording, request: Request | None, job: Job | None, t0: float, stages: list[tuple[str, float]]
    ) -> None:
        """Hand this request's stage times to the trace recording (``pipeline.trace``)."""
        batch = None if job is None or not job.started else (job.enqueued, job.started, job.finished, job.batch_rows)
        answered = {} if request is None else dict(request.response_parameters)
        endpoint = self.name if request is None else request.endpoint
        recording.add(self.name, endpoint, t0, time.perf_counter(), list(stages), batch, answered)

    def _run_before(self, request: Request, lease: Lease, stages: list[tuple[str, float]]) -> bool:
        """The configured stages before the queue, timed; False when one answered the request
        (the rest skipped). The inputs are checked against the model's signature after them."""
        try:
            if self._chain(self.before, request, stages, early=True):
                return False
            request.inputs = lease.model.check_inputs(request.inputs)
        except BaseException:
            lease.release()
            if self.batcher.batching is not None:
                self.batcher.arrive(-1)
            raise
        return True

    @staticmethod
    def _chain(chain: tuple[Stage, ...], request: Request, stages: list[tuple[str, float]], early: bool) -> bool:
        """Run ``chain`` on ``request``, each stage timed into ``stages``; True when ``early`` and a
        stage answered the request (the rest of the chain skipped)."""
        t1 = time.perf_counter()
        for stage in chain:
            stage.process(request)
            t2 = time.perf_counter()
            stages.append((stage.name, t2 - t1))
            t1 = t2
            if early and request.outputs is not None:
                return True
        return False

    def _queue_infer(
        self, request: Request, lease: Lease, stages: list[tuple[str, float]], version: int | None, batched: bool
    ) -> Job:
        """The batcher's stages: queue and infer (inline when the model is idle); ``lease`` released.
        Returns the job (its call's times, for a trace)."""
        batcher = self.batcher
        deferred = request.timing
        job = Job(request.inputs, version, request.deadline)
        try:
            if batched:
                batcher.arrive(-1)
            if request.answer is None:
                inline = False
            else:
                local = self._inline
                local.timing = deferred  # the call's batch size goes there (``_observe_batch``)
                try:
                    inline = batcher.run_inline(job, lease, request.answer)
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
        request.outputs, request.served_version = job.outputs, job.served_version
        return job

    def _done(self, request: Request) -> None:
        """The stages' cleanups, once each, in reverse order; one that raises is logged."""
        cleanups, request.on_done = request.on_done, []
        for cleanup in reversed(cleanups):
            try:
                cleanup()
            except Exception:  # a cleanup must never keep the request from its answer
                log.exception("%s: a stage's cleanup failed", self.name)

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
        stopped = self.batcher.stop(timeout_s)
        for stage in (*self.before, *self.after):
            close = getattr(stage, "close", None)  # stages holding threads or connections (split's probes)
            if close is not None:
                close()
        return stopped
