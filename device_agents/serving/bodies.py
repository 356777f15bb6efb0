"""Request bodies under hard limits: a shared byte budget, and bounded inflation.

Every byte of request body the agent holds is reserved for as long as the request runs: as
received from one ``ByteBudget`` of ``server.max_buffered_mb``, and what gzip/deflate inflate it
to from a second one of the same size, so N parallel bodies never hold more than twice the
budget however they are encoded. A gzip
body reserves, before it is inflated, all it could inflate to: ``server.max_request_mb`` or
1032 x its size (deflate's largest ratio), whichever is less (at most what the budget can
ever give it), and gives back what it did not use. All or nothing: two bodies can never each
hold half the budget and wait for the other; big compressed bodies are inflated one at a time
unless ``max_buffered_mb`` is raised above ``max_request_mb``.
A 114 KiB gzip bomb of 120 MB costs at most the request cap, and four of them together at most
the budget; they are inflated one after the other (a body waits up to 3 s for room, then 503).
"""

from __future__ import annotations

import threading
import time
import zlib

from device_agents.errors import RequestTooLargeError, UnavailableError
from edgekit.bundle.errors import InferenceInputError

_STEP_BYTES = 1 << 20  # inflate 1 MiB at a time
_DEFLATE_MAX_RATIO = 1032  # zlib's technical note: deflate cannot inflate more than ~1032:1
BUDGET_WAIT_S = 3.0


class ByteBudget:
    """A counting budget of bytes; ``reserve`` blocks up to ``BUDGET_WAIT_S`` for room."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # entered as _lock: a Condition's own `with` is Python
        self._waiters = 0  # reserve() calls waiting for room: release notifies only when there are some

    def reserve(self, n: int, retry_after_s: int = 1) -> None:
        if n > self.capacity:
            raise RequestTooLargeError(
                f"the request needs {n} bytes of buffer, over server.max_buffered_mb ({self.capacity} bytes)"
            )
        with self._lock:
            if self.used + n <= self.capacity:  # room now: the usual case
                self.used += n
                return
            deadline = time.monotonic() + BUDGET_WAIT_S
            while self.used + n > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UnavailableError(
                        "request bodies being decoded fill server.max_buffered_mb; retry later",
                        reason="decode_busy",
                        retry_after_s=retry_after_s,
                    )
                self._waiters += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiters -= 1
            self.used += n

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n
            if self._waiters:
                self._cond.notify_all()


class Reservation:
    """The bytes one request holds: as received (from ``budget``) and inflated (from ``inflating``,
    a second budget, so that bodies waiting to be inflated never block one being inflated);
    ``close`` returns them."""

    def __init__(self, budget: ByteBudget, retry_after_s: int = 1, inflating: ByteBudget | None = None) -> None:
        self.budget = budget
        self.inflating = inflating or budget
        self.retry_after_s = retry_after_s
        self.held = 0
        self.held_inflated = 0

    def add(self, n: int) -> None:
        budget = self.budget  # _take's steps inline: every request body comes here
        if self.held + n > budget.capacity:
            raise RequestTooLargeError(_over(self.held + n, "as received", budget.capacity))
        budget.reserve(n, self.retry_after_s)
        self.held += n

    def add_inflated(self, n: int) -> None:
        self.held_inflated += self._take(self.inflating, self.held_inflated, n, "inflated")

    def _take(self, budget: ByteBudget, held: int, n: int, what: str) -> int:
        if held + n > budget.capacity:  # could never fit, however long it waited
            raise RequestTooLargeError(_over(held + n, what, budget.capacity))
        budget.reserve(n, self.retry_after_s)
        return n

    def give_back_inflated(self, n: int) -> None:
        n = min(n, self.held_inflated)
        if n > 0:
            self.inflating.release(n)
            self.held_inflated -= n

    def close(self) -> None:
        if self.held:
            self.budget.release(self.held)
            self.held = 0
        if self.held_inflated:
            self.inflating.release(self.held_inflated)
            self.held_inflated = 0


def _over(n: int, what: str, capacity: int) -> str:
    return f"the request needs over {n} bytes of buffer ({what}), over server.max_buffered_mb ({capacity} bytes)"


def inflate(body: bytes, encoding: str | None, limit: int, reservation: Reservation) -> bytes | bytearray:
    """``body`` decoded per ``Content-Encoding`` (gzip, deflate, identity), never past ``limit`` bytes."""
    if encoding in (None, "", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise InferenceInputError(f"Content-Encoding {encoding!r} is not supported (use gzip or deflate)")
    d = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
    want = min(limit + 1, _DEFLATE_MAX_RATIO * len(body) + _STEP_BYTES)
    bound = min(want, reservation.inflating.capacity - reservation.held_inflated)  # a big one: all of it
    reservation.add_inflated(bound)
    out = bytearray()
    data = body
    try:
        while True:
            chunk = d.decompress(data, min(_STEP_BYTES, bound - len(out)))
            out += chunk
            data = d.unconsumed_tail
            if len(out) > limit:
                raise RequestTooLargeError(f"decompressed request body is over server.max_request_mb ({limit} bytes)")
            if not data and (d.eof or not chunk):
                break
            if len(out) >= bound:
                if bound < want:
                    raise RequestTooLargeError(
                        f"request body inflates past {bound} bytes, more than server.max_buffered_mb leaves for it"
                    )
                raise InferenceInputError(f"request body inflates past {bound} bytes, more than {encoding} can")
    except zlib.error as exc:
        raise InferenceInputError(f"request body is not valid {encoding} ({exc})") from exc
    if not d.eof:
        raise InferenceInputError(f"request body is not valid {encoding} (it ends early)")
    reservation.give_back_inflated(bound - len(out))
    return out
