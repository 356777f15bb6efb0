"""One model's request queue, worker pool and dynamic batcher.

This module is the queue and the workers that act; what size a batch may grow to and how long it
waits is decided by ``policy`` (a function of the recorded call times: ``CallCost``,
``BatchPolicy``, ``wait_until``), and hung calls are handled by ``watchdog``. The whole policy is
described here, once.

Every served name has one ``Batcher``: a bounded FIFO queue (full -> ``OverloadedError``, a 429),
``workers`` threads that run the runtime (one more for a batched model: it forms the next batch
while every slot is busy), and ``workers`` call slots: the model's concurrency limit, shared by
the workers and by inline calls.

Inline calls. A request that finds the model idle (a free slot, nothing queued, no batch to wait
for) runs in the calling thread (``run_inline``): handing it to a worker and back costs two
thread wake-ups (~40 us on a 2-core x86_64 VM), more than a small model's whole call. Everything else is as for a
worker's call: the slot, the stage times, the watchdog (an inline call that hangs is answered
through the caller's ``answer`` hook from the watchdog's thread, since the caller's own thread is
stuck in the runtime).

Batching. Without ``[models.<name>.batching]`` each job runs alone. With it, one worker at a
time forms a batch from the head of the queue: jobs whose inputs agree on everything but axis 0
are concatenated (different batch sizes coalesce) until the batch holds ``max_batch_size``
samples or a preferred size, or the size measured cheapest per row where a bigger size measured clearly
dearer (``policy.CallCost.measured_sizes``; an exploring batch now and then goes further); the head is
always in the batch, so no job starves; the results are split back by rows. How long a batch
waits for more (the greedy policy of Triton's and TF-Serving's batchers, made adaptive):

- What queued while the model was busy always joins at once, whatever the wait.
- While another call of this model runs, the batch waits for companions up to ``max_wait_ms``
  after its head arrived (it could not run sooner on a free core anyway), and runs at once when
  every request in flight is in it (one client waiting for its answer cannot send the next).
- When the model is idle, waiting would leave it idle: the batch runs at once, unless requests
  for this model are coming and running them apart would cost more than the wait. Coming: being
  decoded (on their way to the queue), or returning: the recent peak of requests present at
  once (decoding, queued or running, the larger of the last two ``_PEAK_WINDOW_S`` windows) less
  those present now. Clients in a closed loop send their next request when answered, so the
  ones the last batch answered are on their way back; run at once with what queued meanwhile,
  the batches split the clients into groups that alternate for good (one group comes back
  while the other runs: at 16 clients, mean batches of 5 where 16 were possible). The batch then
  waits for them up to ``max_wait_ms`` and no longer than the fixed cost of one call, measured
  at run time (``CallCost``: the part of a call's time that does not grow with its rows, which
  is what batching saves), both counted from when the model could take it (a head queued
  behind a running call waited for the model, not for companions: the bound on a request's
  queue + infer stays ``max_wait_ms`` + two calls). An idle model with nothing coming runs a
  request inline (above), as an unbatched model does: a lone client's requests never wait.
- When batching does not pay (a call's fixed cost under twice ``policy.HANDOFF_S``, what handing a
  request to a worker and back costs, or under ``MIN_FIXED_SHARE`` of a single call: a model
  whose batch of n costs about n single calls, such as a small compute-bound conv net), the model
  is run as if unbatched: requests run inline whenever a slot
  is free, and workers take what is queued (no wait) up to the batch size measured cheapest
  per row (``CallCost.cheapest_rows``: 1, one at a time, unless a small batch measured cheaper),
  except an exploring batch that may take twice that (at least ``EXPLORE_ROWS`` rows), so
  the cost model sees when batching starts to pay: one in ``EXPLORE_EVERY`` batches formed,
  half as often after each one that cost more per row (down to one in ``EXPLORE_MAX``).
  Batching therefore never costs more than not batching, beyond those few small batches.
- ``min_batch_size``: a batch below it waits (past ``max_wait_ms``) until its head's deadline
  nears; a batch still runs before that deadline.

So ``max_wait_ms`` is the longest a request waits for companions, never a wait imposed on every
batch.

A runtime call running longer than ``hung_call_s`` is hung (``watchdog``): the runtime is told to stop
it where it can (ONNX Runtime), its jobs fail with a 500, the model is dropped from the registry
(the next call loads it again from the store; the hung one is closed if its call ever returns)
and a fresh worker replaces the stuck thread (a stuck inline caller is answered through its hook
and its slot freed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from device_agents.config import BatchingConfig
from device_agents.errors import DeadlineExceededError, OverloadedError, RuntimeFailure, UnavailableError
from device_agents.faults import stall_armed, stall_point
from device_agents.pipeline.jobs import Job
from device_agents.pipeline.policy import BatchPolicy, wait_until
from device_agents.pipeline.watchdog import Call, Watchdog
from device_agents.registry import Lease
from device_agents.runtimes import ServedModel
from device_agents.threads import NamedThread
from edgekit.bundle.errors import EdgekitError, InferenceInputError

log = logging.getLogger("edgekit.agent")

# The recent peak of requests present for a model is the larger of the last two windows this long.
_PEAK_WINDOW_S = 0.25
# How long a stopping batcher waits for the calls it stopped past the drain to come back.
_STOP_GRACE_S = 2.0


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
        on_failure: Callable[[int, Job | None], None] = lambda version, job: None,
        on_stopped: Callable[[str], None] = lambda how: None,
        degraded: Callable[[], bool] | None = None,
    ) -> None:
        self.name = name
        self.lease = lease
        self.batching = batching
        # whether the power budget's ``batch`` step is on (read once per batch): then batches form
        # by ``batching.degraded()`` (a longer wait, or smaller batches)
        self.degraded = degraded
        self._degraded_batching = batching.degraded() if batching is not None and degraded is not None else None
        self.queue_size = queue_size
        self.hung_call_s = hung_call_s
        self.retry_after_s = retry_after_s
        self.on_batch = on_batch
        self.on_hung = on_hung
        self.on_failure = on_failure  # (version, job) per request the runtime failed (None: hung, no replay)
        self._incoming: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # None: a worker's stop signal
        self._held: deque[Job] = deque()  # taken out while forming a batch, not run yet (queue order)
        self._forming = threading.Lock()  # one worker forms a batch at a time (and owns _held): batches fill up
        self._lock = threading.Lock()  # guards the counters, _calls, _abandoned, _stopping
        # a call slot was freed / an inline call ended; entered as `with self._lock` (its lock: a
        # Condition's own `with` runs Python code, ~0.4 us, on every call)
        self._slot_free = threading.Condition(self._lock)
        self._free = workers  # call slots left: a running batch or inline call holds one
        self._inline = 0  # inline calls running
        self._slot_waiters = 0  # threads waiting on _slot_free (notified only when there are some)
        self._waiting = 0  # submitted, not yet in a running batch
        self._running = 0  # jobs in the workers' running calls (inline calls: _inline)
        # The most requests present at once (decoding, queued or running) over the last
        # _PEAK_WINDOW_S or two: how many clients are sending to this model (``returning``).
        self._peak = self._peak_before = 0
        self._peak_since = time.monotonic()
        self.arriving = 0  # being decoded for this model (batched models only): on their way to the queue
        self.inflight = 0  # submitted, not yet answered
        self._calls: dict[int, Call] = {}  # thread id -> its running call (a worker's or an inline caller's)
        self._abandoned: set[int] = set()
        self._stopping = False
        self.policy = BatchPolicy()  # the batch sizes and waits, from the recorded call times
        self._stall = stall_armed("infer_stall")  # the fault point, armed when this model's batcher is built
        self._exploring: list[Job] | None = None  # the exploring batch formed last, until it has run
        self._threads: list[threading.Thread] = []
        # A batched model gets one thread more than its call slots: that one forms the next batch
        # while the slots are busy (its head taken, waiting for a slot, then what queued meanwhile
        # joins at once), so a batch starts as soon as the previous one ends. Without it the worker
        # that ran the previous batch formed the next one only after it had answered every job of
        # it, while the woken callers took the GIL: the model stood idle between batches.
        for _ in range(workers + (1 if batching is not None else 0)):
            self._spawn()
        self._watchdog = Watchdog(
            name,
            hung_call_s,
            self._collect_hung,
            on_hung=lambda model: self.on_hung(model),
            on_failure=self._count_failure,
            replace=self._spawn,
            on_stopped=on_stopped,
        )
        self._watchdog.start()

    # -- the request side ------------------------------------------------------------------
    def arrive(self, delta: int) -> None:
        """Count a request for this model entering (+1) or leaving (-1) its decode stage."""
        with self._lock:
            self.arriving += delta
            if delta > 0:
                self._note_present()

    def submit(self, job: Job) -> None:
        """Queue ``job``; ``OverloadedError`` when the queue is full, ``UnavailableError`` when stopping."""
        with self._lock:
            if self._stopping:
                raise UnavailableError(
                    f"model {self.name} is shutting down", reason="draining", retry_after_s=self.retry_after_s
                )
            if self._waiting >= self.queue_size:
                raise OverloadedError(
                    f"model {self.name}: {self._waiting} requests are waiting (server.queue_size); retry later",
                    retry_after_s=self.retry_after_s,
                )
            self._waiting += 1
            self.inflight += 1
            self._note_present()
        self._incoming.put(job)

    def _present(self) -> int:
        """Under ``_lock``: the requests for this model decoding, queued or running now."""
        return self.arriving + self._waiting + self._running + self._inline

    def _note_present(self) -> None:
        """Under ``_lock``: fold the requests present now into the recent peak."""
        self._peak = max(self._peak, self._present())

    def returning(self, unseen: int = 0) -> int:
        """Under ``_lock``: how many requests of the recent peak are not here now (answered and
        not yet back, or not sent yet): in a closed loop, the clients whose next request is coming.
        ``unseen``: requests here but not counted (a caller between its decode and its call)."""
        now = time.monotonic()
        if now - self._peak_since > _PEAK_WINDOW_S:
            self._peak_before, self._peak, self._peak_since = self._peak, 0, now
            self._note_present()
        return max(0, max(self._peak, self._peak_before) - self._present() - unseen)

    def wait(self, job: Job) -> Job:
        """Block until ``job`` is done or its deadline passes (``DeadlineExceededError``)."""
        try:
            if not job.done.wait(max(0.0, job.deadline - time.monotonic())):
                job.cancelled = True  # a worker that takes it drops it
                if not job.done.is_set():
                    where = "while it ran" if job.started else "before a worker took it"
                    raise DeadlineExceededError(f"model {self.name}: the request's deadline passed {where}")
            if job.error is not None:
                raise job.error
            return job
        finally:
            with self._lock:
                self.inflight -= 1

    def run_inline(self, job: Job, lease: Lease, answer: Callable[[EdgekitError], None]) -> bool:
        """Run ``job`` in the calling thread if the model is idle; False (nothing done, ``lease``
        still the caller's) if not: a slot is taken, jobs are queued, or requests are on their way
        to a batch. True: ``lease`` was released and the job is done as ``wait`` leaves it (its
        error raised). ``answer`` answers the caller from the watchdog's thread if the call hangs
        (the job is then ``answered``, nothing raised; this returns once that answer was given)."""
        me = threading.get_ident()
        with self._lock:
            if self._stopping or self._waiting or not self._free:
                return False
            if self.batching is not None and (self.arriving or self.returning(unseen=1)) and self.policy.pays():
                return False  # a batch with the requests on their way may save a call
            self._free -= 1
            self._inline += 1
            self.inflight += 1
            self._note_present()
            call = self._calls[me] = Call(time.monotonic(), lease.model, [job], answer, thread=me)
        self._run(call.jobs, lease, call)  # gives the slot and the counts back (or the watchdog does)
        if job.answered:
            job.done.wait()  # the watchdog's answer has been written
            return True
        if job.error is None and job.finished > job.deadline:
            job.error = DeadlineExceededError(f"model {self.name}: the request's deadline passed while it ran")
        if job.error is not None:
            raise job.error
        return True

    def depth(self) -> int:
        return self._waiting

    def stop(self, timeout_s: float) -> bool:
        """Refuse new jobs, let the workers finish the queued ones and the inline calls end;
        True if all finished in time."""
        with self._lock:
            self._stopping = True
            live = [t for t in self._threads if t.is_alive() and t.ident not in self._abandoned]
        for _ in live:
            self._incoming.put(None)  # after every queued job: each worker ends at one
        inline_left = self._wait_ended(live, time.monotonic() + timeout_s)
        with self._lock:
            running = [c for c in self._calls.values() if not c.hung]
            for call in running:
                call.stopped = True
        if running:
            # Calls still running past the drain are stopped where the runtime can (their jobs get
            # 503s, counted against nothing): a runtime's thread left inside a call when the
            # process exits takes it down with SIGABRT.
            stopped = sum(call.model.terminate(call.thread) for call in running)
            log.warning("%s: %d of %d calls still running were stopped", self.name, stopped, len(running))
            inline_left = self._wait_ended(live, time.monotonic() + _STOP_GRACE_S)
        left = []
        if not self._forming.acquire(timeout=0.1):
            return False
        try:
            left = list(self._held)
            self._held.clear()
            while True:
                try:
                    job = self._incoming.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    left.append(job)
        finally:
            self._forming.release()
        for job in left:
            job.error = UnavailableError(f"model {self.name} is shutting down", reason="draining")
            job.done.set()
        return not any(t.is_alive() for t in live) and not left and not inline_left

    def _wait_ended(self, workers: list[threading.Thread], until: float) -> int:
        """Wait until ``workers`` ended and no inline call runs, or ``until``; the inline calls left."""
        for t in workers:
            t.join(max(0.0, until - time.monotonic()))
        with self._lock:
            self._slot_waiters += 1
            while self._inline and time.monotonic() < until:
                self._slot_free.wait(max(0.0, until - time.monotonic()))
            self._slot_waiters -= 1
            return self._inline

    # -- the worker side -------------------------------------------------------------------
    def _spawn(self) -> None:
        t = NamedThread(target=self._work, name=f"infer-{self.name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _work(self) -> None:
        me = threading.get_ident()
        while me not in self._abandoned:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _usable(self, job: Job) -> bool:
        """False (and the job answered) for a job cancelled or past its deadline before it ran."""
        if job.cancelled or job.deadline <= time.monotonic():
            with self._lock:
                self._waiting -= 1
            if not job.cancelled:
                job.error = DeadlineExceededError(f"model {self.name}: the request's deadline passed in the queue")
            job.done.set()
            return False
        return True

    def _take(self) -> Job | None:
        """The oldest usable job (held back ones first); None when this worker is to stop."""
        while True:
            job = self._held.popleft() if self._held else self._incoming.get()
            if job is None:
                return None
            if self._usable(job):
                return job

    def _claim(self) -> None:
        """Wait for a free call slot (inline calls or other workers' batches may hold them all)."""
        with self._lock:
            self._slot_waiters += 1
            while not self._free:
                self._slot_free.wait()
            self._slot_waiters -= 1
            self._free -= 1

    def _release(self) -> None:
        with self._lock:
            self._free += 1
            if self._slot_waiters:
                self._slot_free.notify_all()

    def _next_batch(self) -> list[Job] | None:
        """The next batch, holding a call slot (``_run`` gives it back)."""
        with self._forming:
            while True:
                head = self._take()
                if head is None:
                    return None
                self._claim()  # the head stays counted as waiting: no inline call overtakes it
                if self._usable(head):  # its deadline may have passed while every slot was busy
                    break
                self._release()
            batch, rows = [head], head.rows
            cfg = self.batching
            if self._degraded_batching is not None and self.degraded is not None and self.degraded():
                cfg = self._degraded_batching
            if cfg is not None:
                # the wait for companions counts from now, when the model can take this batch: a
                # head queued behind a running call waited for the model, not for companions
                opened = time.monotonic()
                pays = self.policy.pays()
                limit, explore = self.policy.limit(head.rows, cfg.max_batch_size, pays)
                if limit > head.rows:
                    # when batching does not pay, only what is queued now: no wait
                    rows = self._gather(head, batch, rows, cfg, limit, opened, wait=pays)
                if explore and len(batch) > 1:
                    self._exploring = batch
            with self._lock:
                self._waiting -= len(batch)
                self._running += len(batch)
            return batch

    def _wait_until(self, head: Job, batch: list[Job], rows: int, cfg: BatchingConfig, opened: float) -> float | None:
        """How long this batch may wait for more (a ``time.monotonic()``), None to run it now:
        ``policy.wait_until`` over this model's state now."""
        now = time.monotonic()
        with self._lock:
            busy = bool(self._calls)
            coming = self.arriving + self.returning()
            everyone = self.inflight <= len(batch) + len(self._held)
        return wait_until(
            cfg,
            self.policy.cost,
            now,
            rows=rows,
            head_enqueued=head.enqueued,
            head_deadline=head.deadline,
            opened=opened,
            busy=busy,
            coming=coming,
            everyone=everyone,
        )

    def _gather(
        self, head: Job, batch: list[Job], rows: int, cfg: BatchingConfig, limit: int, opened: float, wait: bool = True
    ) -> int:
        """Add queued jobs that can share ``head``'s batch, in queue order, until it holds
        ``limit`` rows or the wait is over (``wait=False``: only what is queued now); jobs that
        cannot are held back, in order, for the next batches."""
        job: Job | None
        kept: deque[Job] = deque()
        blocked = False  # a same-shape job did not fit: nothing behind it may overtake it
        key = head.key
        for job in self._held:
            if not blocked and job.key == key and rows + job.rows <= limit:
                batch.append(job)
                rows += job.rows
            else:
                blocked = blocked or job.key == key
                kept.append(job)
        self._held = kept
        while not blocked and rows < limit and rows not in cfg.preferred_batch_sizes:
            try:
                job = self._incoming.get_nowait()  # what is queued already joins whatever the wait
            except queue.Empty:
                until = self._wait_until(head, batch, rows, cfg, opened) if wait else None
                if until is None:
                    break
                try:
                    # woken by a new job, or at most every ms: the model may fall idle meanwhile
                    job = self._incoming.get(timeout=max(0.0, min(until - time.monotonic(), 0.001)))
                except queue.Empty:
                    continue
            if job is None:
                self._incoming.put(None)  # stopping: run what we have; the signal is for the next take
                break
            if not self._usable(job):
                continue
            if job.key == key and rows + job.rows <= limit:
                batch.append(job)
                rows += job.rows
            else:
                blocked = job.key == key
                self._held.append(job)
        return rows

    def _run(self, batch: list[Job], lease: Lease | None = None, inline: Call | None = None) -> None:
        """Run ``batch`` holding a call slot (given back here); ``lease``: the caller's, released
        here; ``inline``: the caller's own call, registered already (``run_inline``)."""
        call: Call | None = inline
        start = inline.started if inline is not None else time.monotonic()
        if len(batch) == 1:
            rows = batch[0].rows
            batch[0].started, batch[0].batch_rows = start, rows
        else:
            rows = sum(j.rows for j in batch)
            for job in batch:
                job.started, job.batch_rows = start, rows
        me = threading.get_ident()
        failed_version: int | None = None  # the runtime failed the batch: counted before the answers
        try:
            feed = (
                batch[0].inputs
                if len(batch) == 1
                else {n: np.concatenate([j.inputs[n] for j in batch]) for n in batch[0].inputs}
            )
            held = lease if lease is not None else self.lease(batch[0].version)
            lease = None
            with held:
                if call is None:
                    call = Call(start, held.model, batch, thread=me)
                    with self._lock:
                        self._calls[me] = call
                if self._stall:
                    stall_point("infer_stall")
                outputs, runtime_s = held.model.infer_timed(feed, checked=True)
                version = held.version
            if call.hung:
                return  # its jobs were answered by the watchdog
            cfg = self.batching
            if cfg is not None:  # the cost model is for the batcher's decisions only
                self.policy.cost.record(rows, time.monotonic() - start)
                if batch is self._exploring:
                    self._exploring = None
                    self.policy.explored(rows, cfg.max_batch_size)
            self.on_batch(rows)
            self._split(batch, outputs, rows, version)
            for job in batch:
                job.runtime_s = runtime_s
        except EdgekitError as exc:
            if call is not None and call.hung:
                return
            for job in batch:
                job.error = exc
        except Exception as exc:  # runtime SDK errors have no common base
            if call is not None and call.hung:
                return
            failure: EdgekitError
            if call is not None and call.stopped:  # stopped by a drain that ran out of time
                failure = UnavailableError(
                    f"model {self.name} is shutting down: its call was stopped after server.drain_timeout_s",
                    reason="draining",
                    retry_after_s=self.retry_after_s,
                )
            elif call is not None and call.model.rejects_input(exc):
                failure = InferenceInputError(f"model {self.name} cannot take this input: {exc}")
            else:
                log.error("%s failed to run: %s: %s", self.name, type(exc).__name__, exc)
                failure = RuntimeFailure(
                    f"model {self.name} v{call.model.manifest.version if call else '?'} failed to run: {exc}"
                )
                if call is not None:
                    failed_version = call.model.manifest.version
            for job in batch:
                job.error = failure
        finally:
            if lease is not None:
                lease.release()  # never got to run
            with self._lock:
                self._calls.pop(me, None)
                hung = call is not None and call.hung
                if not hung:  # a hung call's slot (and counts) were given back by the watchdog
                    self._free += 1
                    if inline is not None:
                        self._inline -= 1
                        self.inflight -= 1
                    else:
                        self._running -= len(batch)
                    if self._slot_waiters:
                        self._slot_free.notify_all()
            if failed_version is not None and not hung:  # out of _calls: not a hang
                for job in batch:
                    self._count_failure(failed_version, job)
            if not hung:
                end = time.monotonic()
                for job in batch:
                    job.finished = end
                    job.done.set()
            else:  # its thread is out of the runtime again (terminated, or it ended late)
                log.warning("%s: the hung call returned after %.1f s", self.name, time.monotonic() - start)

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

    def _count_failure(self, version: int, job: Job | None) -> None:
        try:
            self.on_failure(version, job)
        except Exception:  # counting must never keep a request from its answer
            log.exception("%s: could not count a failed request", self.name)

    # -- hung calls ------------------------------------------------------------------------
    def _collect_hung(self, now: float) -> list[Call] | None:
        """The watchdog's ``collect``: the calls running past ``hung_call_s``, marked hung, out of
        ``_calls``, their slots and counts given back (a stuck worker is abandoned: it ends if its
        call ever returns; an inline caller's job is marked answered: back, it writes nothing);
        None once stopping with nothing running."""
        with self._lock:
            if self._stopping and not self._calls:
                return None
            hung = [(tid, c) for tid, c in self._calls.items() if not c.hung and now - c.started > self.hung_call_s]
            for tid, call in hung:
                call.hung = True
                if call.answer is None:
                    self._abandoned.add(tid)  # a worker: it ends if its call ever returns
                else:
                    for job in call.jobs:
                        job.answered = True  # set with the hung mark: the caller, back, writes nothing
                del self._calls[tid]
                self._free += 1  # the stuck call no longer counts against the model's concurrency
                if call.answer is not None:
                    self._inline -= 1  # a drain does not wait for it
                    self.inflight -= 1
                else:
                    self._running -= len(call.jobs)
                if self._slot_waiters:
                    self._slot_free.notify_all()
        return [call for _, call in hung]
