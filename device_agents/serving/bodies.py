"""Request bodies under hard limits: a shared byte budget, and bounded inflation.

Every byte of request body the agent holds (as received, and what gzip/deflate inflate it to)
is reserved from one ``ByteBudget`` (``server.max_buffered_mb``) for as long as the request
runs, so N parallel bodies never hold more than the budget however they are encoded. A gzip
body is inflated in steps, reserving each step first, and never past ``server.max_request_mb``:
a 114 KiB gzip bomb of 120 MB costs at most the request cap, and four of them together at most
the budget (the others wait briefly, then get a 503).
"""

from __future__ import annotations

import threading
import time
import zlib

from device_agents.errors import RequestTooLargeError, UnavailableError
from edgekit.bundle.errors import InferenceInputError

_STEP_BYTES = 1 << 20  # inflate 1 MiB at a time
BUDGET_WAIT_S = 1.0


class ByteBudget:
    """A counting budget of bytes; ``reserve`` blocks up to ``BUDGET_WAIT_S`` for room."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._cond = threading.Condition()

    def reserve(self, n: int, retry_after_s: int = 1) -> None:
        if n > self.capacity:
            raise RequestTooLargeError(
                f"the request needs {n} bytes of buffer, over server.max_buffered_mb ({self.capacity} bytes)"
            )
        deadline = time.monotonic() + BUDGET_WAIT_S
        with self._cond:
            while self.used + n > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UnavailableError(
                        "request bodies being decoded fill server.max_buffered_mb; retry later",
                        reason="decode_busy",
                        retry_after_s=retry_after_s,
                    )
                self._cond.wait(left)
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class Reservation:
    """The bytes one request holds in a ``ByteBudget``; ``close`` returns them."""

    def __init__(self, budget: ByteBudget, retry_after_s: int = 1) -> None:
        self.budget = budget
        self.retry_after_s = retry_after_s
        self.held = 0

    def add(self, n: int) -> None:
        if self.held + n > self.budget.capacity:  # could never fit, however long it waited
            raise RequestTooLargeError(
                f"the request needs over {self.held + n} bytes of buffer (as received plus inflated), over "
                f"server.max_buffered_mb ({self.budget.capacity} bytes)"
            )
        self.budget.reserve(n, self.retry_after_s)
        self.held += n

    def close(self) -> None:
        if self.held:
            self.budget.release(self.held)
            self.held = 0


def inflate(body: bytes, encoding: str | None, limit: int, reservation: Reservation) -> bytes | bytearray:
    """``body`` decoded per ``Content-Encoding`` (gzip, deflate, identity), never past ``limit`` bytes."""
    if encoding in (None, "", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise InferenceInputError(f"Content-Encoding {encoding!r} is not supported (use gzip or deflate)")
    d = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
    out = bytearray()
    data = body
    try:
        while True:
            step = min(_STEP_BYTES, limit + 1 - len(out))
            reservation.add(step)
            chunk = d.decompress(data, step)
            out += chunk
            data = d.unconsumed_tail
            if len(out) > limit:
                raise RequestTooLargeError(f"decompressed request body is over server.max_request_mb ({limit} bytes)")
            if not data and (d.eof or not chunk):
                break
    except zlib.error as exc:
        raise InferenceInputError(f"request body is not valid {encoding} ({exc})") from exc
    if not d.eof:
        raise InferenceInputError(f"request body is not valid {encoding} (it ends early)")
    return out
