"""The hung-call watchdog of one model: a runtime call running longer than ``hung_call_s`` is hung.

Every ``min(1 s, hung_call_s / 4)`` it asks its owner (the batcher) for the calls running past
the limit (``collect``: the owner marks them hung and gives their call slots and counts back,
under its own lock). For each hung call, in this order: the runtime is told to stop it
(``ServedModel.terminate``: ONNX Runtime's ``RunOptions.terminate``, the call then raises in its
thread and the core it burned is free; a runtime that cannot stop a call leaves its thread
running, abandoned), which ``on_stopped`` counts (``"terminated"`` or ``"abandoned"``); the
model is dropped (``on_hung``: the
next call loads it again from the store; the hung one is closed if its call ever returns), so
that a caller who retries at once on the 500 reaches a fresh load, never the stuck session;
then its jobs fail with a ``RuntimeFailure`` (an inline caller, whose own thread is stuck in the
runtime, is answered through its ``answer`` hook), each counted against the model's health
(``on_failure(version, None)``: a hang is not replayed); then a worker thread stuck in it is
replaced (``replace``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from device_agents.errors import RuntimeFailure
from device_agents.pipeline.jobs import Job
from device_agents.runtimes import ServedModel
from device_agents.threads import NamedThread
from edgekit.bundle.errors import EdgekitError

log = logging.getLogger("edgekit.agent")


@dataclass(eq=False)
class Call:
    """One running runtime call: a worker's batch, or an inline caller's job."""

    started: float  # time.monotonic()
    model: ServedModel
    jobs: list[Job]
    answer: Callable[[EdgekitError], None] | None = None  # set for an inline call: how to answer its caller
    hung: bool = False
    thread: int = 0  # threading.get_ident() of the thread running it (what ``terminate`` stops)
    stopped: bool = False  # stopped by a drain that ran out of time (its jobs are 503s, not failures)


class Watchdog:
    """Watches one model's running calls from its own thread (``hung-<name>``) until ``collect``
    returns None (the owner is stopping and nothing runs)."""

    def __init__(
        self,
        name: str,
        hung_call_s: float,
        collect: Callable[[float], list[Call] | None],
        *,
        on_hung: Callable[[ServedModel], None],
        on_failure: Callable[[int, Job | None], None],
        replace: Callable[[], None],
        on_stopped: Callable[[str], None] = lambda how: None,
    ) -> None:
        self.name = name
        self.hung_call_s = hung_call_s
        self.collect = collect  # (now) -> the calls found hung (marked, un-counted), None to stop
        self.on_hung = on_hung
        self.on_failure = on_failure
        self.replace = replace  # a fresh worker for one stuck in a hung call
        self.on_stopped = on_stopped  # ("terminated" | "abandoned") per hung call
        self._thread = NamedThread(target=self._watch, name=f"hung-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        period = min(1.0, self.hung_call_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            hung = self.collect(now)
            if hung is None:
                return
            for call in hung:
                self.handle(call, now)

    def handle(self, call: Call, now: float) -> None:
        """What follows a hang (``call`` was collected: marked hung, its slot given back)."""
        try:
            terminated = call.model.terminate(call.thread)
        except Exception:  # the callers must still hear of the hang
            log.exception("%s: could not terminate the hung call", self.name)
            terminated = False
        runtime = call.model.manifest.compatibility.runtime
        if terminated:
            what = "it was terminated"
        elif getattr(call.model.runner, "terminate", None) is not None:
            what = f"its thread was not inside {runtime} (nothing to terminate) and is left running"
        else:
            what = f"{runtime} cannot stop a call: its thread is left running"
        log.error(
            "%s: a runtime call has run %.1f s (over server.hung_call_s = %g); %s; reloading the model",
            self.name,
            now - call.started,
            self.hung_call_s,
            what,
        )
        try:
            self.on_stopped("terminated" if terminated else "abandoned")
        except Exception:  # counting must never keep the callers from their answer
            log.exception("%s: could not count a hung call", self.name)
        # Drop the hung model before anyone hears of the hang: a caller told "being reloaded"
        # that retries at once must reach a fresh load, never the stuck session.
        try:
            self.on_hung(call.model)
        except Exception:  # the callers must still hear of the hang
            log.exception("%s: could not drop the hung model", self.name)
        failure = RuntimeFailure(
            f"model {self.name} hung: its runtime call ran over server.hung_call_s ({self.hung_call_s:g} s); "
            "the model is being reloaded"
        )
        for job in call.jobs:
            job.error = failure
            job.finished = now
            if call.answer is not None:
                try:
                    call.answer(failure)
                except Exception:  # the caller's connection may be gone: nothing else to tell
                    log.exception("%s: could not answer a hung inline call", self.name)
            job.done.set()
            self.on_failure(call.model.manifest.version, None)  # a hang is not replayed
        if call.answer is None:
            self.replace()
