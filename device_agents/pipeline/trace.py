"""Request traces: while ``edgekit-agent trace`` runs, ``Pipeline.run`` hands each request's stage
times to the active ``Recording``, which turns them into a Chrome trace (Trace Event Format JSON,
``"X"`` complete events, ``ts``/``dur`` in microseconds) that Perfetto and ``chrome://tracing`` open.

One request is one ``request`` slice on the thread that served it, with its stages nested in it in
chain order (decode, the configured stages, queue, infer, the stages after infer, encode). The
``infer`` slice's ``args`` say which runtime call it was part of: ``batch_id`` (shared by every
request of one call) and ``batch_rows``; the ``request`` slice's ``args`` name the endpoint, the
model that ran it (a cascade's member) and what the stages answered (``cache``, ``member``, ...).

Off unless a trace runs: ``Pipeline.run`` reads ``ACTIVE.recording`` once per request, and does
nothing more while it is None. While on, a request costs one tuple appended to a list; the events
are built when the trace ends.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from device_agents.errors import ServingError
from edgekit.bundle.errors import InferenceInputError

# The longest trace the agent records (the events of every request are held until it ends).
MAX_TRACE_S = 60.0
# Requests kept per trace: those past it are counted in ``dropped``, not recorded.
MAX_TRACE_REQUESTS = 200_000


class TraceBusyError(ServingError):
    """Another trace is recording: one at a time."""

    http_status = 409
    reason = "trace_busy"


class Recording:
    """The requests of one trace, as the pipeline handed them over (thread-safe: appends only)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        # monotonic -> perf_counter (the batcher's times are monotonic, the pipeline's perf_counter)
        self.offset_s = self.t0 - time.monotonic()
        self.requests: list[tuple[Any, ...]] = []
        self.dropped = 0

    def add(
        self,
        model: str,
        endpoint: str,
        start: float,
        end: float,
        stages: list[tuple[str, float]],
        batch: tuple[float, float, float, int] | None,
        answered: dict[str, Any],
    ) -> None:
        """One request: ``start``/``end`` perf_counter; ``stages`` (name, seconds) in chain order;
        ``batch`` (enqueued, started, finished: monotonic, rows) of its runtime call, if it had one."""
        if len(self.requests) >= MAX_TRACE_REQUESTS:
            self.dropped += 1
            return
        self.requests.append((model, endpoint, threading.get_ident(), start, end, stages, batch, answered))

    def events(self) -> dict[str, Any]:
        """The Chrome trace of the requests recorded so far."""
        pid = os.getpid()
        us = 1e6
        t0 = self.t0
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "edgekit-agent"}}
        ]
        threads: set[int] = set()
        batch_ids: dict[tuple[float, int], int] = {}
        for n, (model, endpoint, tid, start, end, stages, batch, answered) in enumerate(self.requests):
            threads.add(tid)
            args = {"request": n, "endpoint": endpoint, "model": model, **answered}
            out.append(_slice("request", "request", pid, tid, (start - t0) * us, (end - start) * us, args))
            for name, begin, seconds, extra in self._layout(start, end, stages, batch, batch_ids):
                extra["request"] = n
                out.append(_slice(name, "stage", pid, tid, (begin - t0) * us, seconds * us, extra))
        for tid in sorted(threads):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": f"request {tid}"}})
        return {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {"requests": len(self.requests), "dropped": self.dropped, "batches": len(batch_ids)},
        }

    def _layout(
        self,
        start: float,
        end: float,
        stages: list[tuple[str, float]],
        batch: tuple[float, float, float, int] | None,
        batch_ids: dict[tuple[float, int], int],
    ) -> list[tuple[str, float, float, dict[str, Any]]]:
        """Each stage's (name, start, seconds, args): one after the other from ``start``; queue and
        infer where the batcher ran them; encode ending at ``end``. Kept within [start, end]."""
        placed: list[tuple[str, float, float, dict[str, Any]]] = []
        at = start
        for i, (name, seconds) in enumerate(stages):
            args: dict[str, Any] = {}
            if batch is not None and name in ("queue", "infer"):
                enqueued, started, _finished, rows = batch
                if name == "queue":
                    at = max(at, enqueued + self.offset_s)
                else:
                    at = max(at, started + self.offset_s)
                    args = {"batch_id": batch_ids.setdefault((started, rows), len(batch_ids)), "batch_rows": rows}
            elif name == "encode" and i == len(stages) - 1:
                at = max(at, end - seconds)
            at = min(at, end)
            seconds = max(0.0, min(seconds, end - at))
            placed.append((name, at, seconds, args))
            at += seconds
        return placed


def _slice(name: str, cat: str, pid: int, tid: int, ts: float, dur: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


class Tracing:
    """Where ``Pipeline.run`` finds the trace recording now (``recording``: None while none runs)."""

    def __init__(self) -> None:
        self.recording: Recording | None = None
        self._lock = threading.Lock()

    def record(self, seconds: float) -> dict[str, Any]:
        """Record the requests served in the next ``seconds`` (at most ``MAX_TRACE_S``); their trace."""
        if not 0 < seconds <= MAX_TRACE_S:
            raise InferenceInputError(f"a trace takes 0 < seconds <= {MAX_TRACE_S:g}, not {seconds:g}")
        if not self._lock.acquire(blocking=False):
            raise TraceBusyError("a trace is already recording on this agent; wait for it to end")
        try:
            recording = Recording()
            self.recording = recording
            try:
                time.sleep(seconds)
            finally:
                self.recording = None
            return recording.events()
        finally:
            self._lock.release()


ACTIVE = Tracing()
