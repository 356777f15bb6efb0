"""One model's request queue, worker pool and dynamic batcher.

Every served name has one ``Batcher``: a bounded FIFO queue (full -> ``OverloadedError``, a 429)
and ``workers`` threads that run the runtime. Without ``[models.<name>.batching]`` each job runs
alone. With it, one worker at a time forms a batch from the head of the queue: jobs whose inputs
agree on everything but axis 0 are concatenated (different batch sizes coalesce) until the batch
holds ``max_batch_size`` samples or a preferred size, or ``max_wait_ms`` has passed since the
head arrived and it holds ``min_batch_size`` (a smaller batch still runs before the head's
deadline). The head is always in the batch, so no job starves; the results are split back by rows.

A runtime call running longer than ``hung_call_s`` is hung: its jobs fail with a 500, the
model is dropped from the registry (the next call loads it again from the store; the hung one
is closed if its call ever returns) and a fresh worker replaces the stuck thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_agents.config import BatchingConfig
from device_agents.errors import DeadlineExceededError, OverloadedError, RuntimeFailure, UnavailableError
from device_agents.faults import stall_point
from device_agents.registry import Lease
from device_agents.runtimes import ServedModel
from edgekit.bundle.errors import EdgekitError, InferenceInputError

log = logging.getLogger("edgekit.agent")

# A batch below min_batch_size still runs this long (or twice its recent run time) before its
# head's deadline.
_DEADLINE_MARGIN_S = 0.02


@dataclass(eq=False)
class Job:
    """One request's inputs (checked against the served signature) and, when done, its result."""

    inputs: dict[str, np.ndarray]
    version: int | None  # a version the request asked for, else None (the served one)
    deadline: float  # time.monotonic()
    rows: int = 1
    key: tuple[Any, ...] = ()
    enqueued: float = field(default_factory=time.monotonic)
    started: float = 0.0
    finished: float = 0.0
    batch_rows: int = 0
    served_version: int = 0
    outputs: dict[str, np.ndarray] | None = None
    error: EdgekitError | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        first = next(iter(self.inputs.values()), None)
        self.rows = int(first.shape[0]) if first is not None and first.ndim else 1
        self.key = (self.version, *((n, a.shape[1:], a.dtype.str) for n, a in sorted(self.inputs.items())))


@dataclass(eq=False)
class _Call:
    started: float
    model: ServedModel
    jobs: list[Job]
    hung: bool = False


class Batcher:
    """Queue + workers for one served name. ``lease(version)`` holds the model for one call."""

    def __init__(
        self,
        name: str,
        lease: Callable[[int | None], Lease],
        *,
        batching: BatchingConfig | None,
        workers: int,
        queue_size: int,
        hung_call_s: float,
        retry_after_s: int,
        on_batch: Callable[[int], None] = lambda rows: None,
        on_hung: Callable[[ServedModel], None] = lambda model: None,
    ) -> None:
        self.name = name
        self.lease = lease
        self.batching = batching
        self.queue_size = queue_size
        self.hung_call_s = hung_call_s
        self.retry_after_s = retry_after_s
        self.on_batch = on_batch
        self.on_hung = on_hung
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._forming = threading.Lock()  # one worker forms a batch at a time: batches fill up
        self._calls: dict[int, _Call] = {}  # worker thread id -> its running call
        self._abandoned: set[int] = set()
        self._stopping = False
        self.inflight = 0
        self._run_s = 0.0  # moving average of a batch's runtime call
        self._threads: list[threading.Thread] = []
        for _ in range(workers):
            self._spawn()
        self._watchdog = threading.Thread(target=self._watch, name=f"hung-{name}", daemon=True)
        self._watchdog.start()

    # -- the request side ------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job``; ``OverloadedError`` when the queue is full, ``UnavailableError`` when stopping."""
        with self._cond:
            if self._stopping:
                raise UnavailableError(
                    f"model {self.name} is shutting down", reason="draining", retry_after_s=self.retry_after_s
                )
            if len(self._queue) >= self.queue_size:
                raise OverloadedError(
                    f"model {self.name}: {len(self._queue)} requests are waiting (server.queue_size); retry later",
                    retry_after_s=self.retry_after_s,
                )
            self._queue.append(job)
            self.inflight += 1
            self._cond.notify_all()

    def wait(self, job: Job) -> Job:
        """Block until ``job`` is done or its deadline passes (``DeadlineExceededError``)."""
        try:
            if not job.done.wait(max(0.0, job.deadline - time.monotonic())):
                with self._cond:
                    job.cancelled = True
                    if job in self._queue:
                        self._queue.remove(job)
                if not job.done.is_set():
                    where = "while it ran" if job.started else "before a worker took it"
                    raise DeadlineExceededError(f"model {self.name}: the request's deadline passed {where}")
            if job.error is not None:
                raise job.error
            return job
        finally:
            with self._cond:
                self.inflight -= 1

    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self, timeout_s: float) -> bool:
        """Refuse new jobs, let the workers finish the queued ones; True if all finished in time."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
        for job in left:
            job.error = UnavailableError(f"model {self.name} is shutting down", reason="draining")
            job.done.set()
        return not any(t.is_alive() for t in self._threads) and not left

    # -- the worker side -------------------------------------------------------------------
    def _spawn(self) -> None:
        t = threading.Thread(target=self._work, name=f"infer-{self.name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _work(self) -> None:
        me = threading.get_ident()
        while me not in self._abandoned:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _next_batch(self) -> list[Job] | None:
        with self._forming, self._cond:
            while True:
                self._drop_expired()
                if self._queue:
                    break
                if self._stopping:
                    return None
                self._cond.wait(0.5)
            cfg = self.batching
            while True:
                self._drop_expired()
                if not self._queue:
                    return []
                head = self._queue[0]
                batch, rows = self._compatible(head)
                if cfg is None or self._stopping or rows >= cfg.max_batch_size or rows in cfg.preferred_batch_sizes:
                    break
                now = time.monotonic()
                until = head.enqueued + cfg.max_wait_ms / 1000
                if now >= until:
                    if rows >= cfg.min_batch_size:
                        break
                    until = head.deadline - max(_DEADLINE_MARGIN_S, 2 * self._run_s)
                    if now >= until:
                        break
                self._cond.wait(until - now)
            for job in batch:
                self._queue.remove(job)
            return batch

    def _compatible(self, head: Job) -> tuple[list[Job], int]:
        """The head and the queued jobs after it that can share its batch, in queue order."""
        limit = self.batching.max_batch_size if self.batching else 1
        batch, rows = [head], head.rows
        if self.batching is None:
            return batch, rows
        for job in list(self._queue)[1:]:
            if job.key != head.key:
                continue
            if rows + job.rows > limit:
                break  # keeps the order: a later, smaller job does not overtake this one
            batch.append(job)
            rows += job.rows
        return batch, rows

    def _drop_expired(self) -> None:
        now = time.monotonic()
        while self._queue and (self._queue[0].cancelled or self._queue[0].deadline <= now):
            job = self._queue.popleft()
            if not job.cancelled:
                job.error = DeadlineExceededError(f"model {self.name}: the request's deadline passed in the queue")
                job.done.set()

    def _run(self, batch: list[Job]) -> None:
        if not batch:
            return
        start = time.monotonic()
        rows = sum(j.rows for j in batch)
        for job in batch:
            job.started, job.batch_rows = start, rows
        me = threading.get_ident()
        call: _Call | None = None
        try:
            feed = (
                batch[0].inputs
                if len(batch) == 1
                else {n: np.concatenate([j.inputs[n] for j in batch]) for n in batch[0].inputs}
            )
            with self.lease(batch[0].version) as lease:
                call = _Call(start, lease.model, batch)
                with self._cond:
                    self._calls[me] = call
                stall_point("infer_stall")
                outputs = lease.model.infer(feed)
                version = lease.version
            if call.hung:
                return  # its jobs were answered by the watchdog
            self._run_s = 0.8 * self._run_s + 0.2 * (time.monotonic() - start)
            self.on_batch(rows)
            self._split(batch, outputs, rows, version)
        except EdgekitError as exc:
            if call is not None and call.hung:
                return
            for job in batch:
                job.error = exc
        except Exception as exc:  # runtime SDK errors have no common base
            if call is not None and call.hung:
                return
            failure: EdgekitError
            if call is not None and call.model.rejects_input(exc):
                failure = InferenceInputError(f"model {self.name} cannot take this input: {exc}")
            else:
                log.error("%s failed to run: %s: %s", self.name, type(exc).__name__, exc)
                failure = RuntimeFailure(
                    f"model {self.name} v{call.model.manifest.version if call else '?'} failed to run: {exc}"
                )
            for job in batch:
                job.error = failure
        finally:
            with self._cond:
                self._calls.pop(me, None)
            end = time.monotonic()
            if call is None or not call.hung:
                for job in batch:
                    job.finished = end
                    job.done.set()

    def _split(self, batch: list[Job], outputs: dict[str, np.ndarray], rows: int, version: int) -> None:
        if len(batch) == 1:
            batch[0].outputs, batch[0].served_version = outputs, version
            return
        for name, value in outputs.items():
            if not value.ndim or value.shape[0] != rows:
                raise RuntimeFailure(
                    f"model {self.name}: output {name!r} of shape {list(value.shape)} has no batch axis of {rows}; "
                    f"remove [models.{self.name}.batching]"
                )
        offset = 0
        for job in batch:
            job.outputs = {n: v[offset : offset + job.rows] for n, v in outputs.items()}
            job.served_version = version
            offset += job.rows

    # -- hung calls ------------------------------------------------------------------------
    def _watch(self) -> None:
        period = min(1.0, self.hung_call_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._cond:
                if self._stopping and not self._calls:
                    return
                hung = [(tid, c) for tid, c in self._calls.items() if not c.hung and now - c.started > self.hung_call_s]
                for tid, call in hung:
                    call.hung = True
                    self._abandoned.add(tid)
                    del self._calls[tid]
            for _, call in hung:
                log.error(
                    "%s: a runtime call has run %.1f s (over server.hung_call_s = %g); reloading the model",
                    self.name,
                    now - call.started,
                    self.hung_call_s,
                )
                failure = RuntimeFailure(
                    f"model {self.name} hung: its runtime call ran over server.hung_call_s ({self.hung_call_s:g} s); "
                    "the model is being reloaded"
                )
                for job in call.jobs:
                    job.error = failure
                    job.finished = now
                    job.done.set()
                self.on_hung(call.model)
                self._spawn()
