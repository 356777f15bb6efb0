"""Errors the serving path raises, each mapping to one HTTP status (``http_status``).

A stage refuses a request with one of these; the front-end answers it and adds ``Retry-After``
where ``retry_after_s`` is set. Only ``RuntimeFailure`` (500) counts against a model's health:
a full queue, a passed deadline or a bad input says nothing about the model.
"""

from __future__ import annotations

from edgekit.bundle.errors import BundleError, EdgekitError

# -- what only the device raises: a bundle for other hardware, a model it does not serve, its store


class IncompatibleError(BundleError):
    """The bundle is for other hardware or a runtime this device does not have."""


class ModelNotFoundError(EdgekitError):
    """No model of that name (or version) is served."""

    http_status = 404


class SelfTestError(EdgekitError):
    """A model failed its golden self-test on this device."""


class StoreError(EdgekitError):
    """The agent's local store cannot be read or written (lock held, disk full, corrupt state)."""


class ServingError(EdgekitError):
    """Base of the serving path's refusals; ``reason`` labels ``edgekit_rejects``."""

    reason = ""
    retry_after_s: int | None = None

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class OverloadedError(ServingError):
    """The model's queue is full: retry after ``Retry-After`` seconds."""

    http_status = 429
    reason = "queue_full"


class UnavailableError(ServingError):
    """The agent cannot take the request now (draining, too many decodes or connections)."""

    http_status = 503

    def __init__(self, message: str, *, reason: str, retry_after_s: int | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.reason = reason


class DeadlineExceededError(ServingError):
    """The request's deadline passed before its result was ready."""

    http_status = 504
    reason = "deadline"


class RequestTooLargeError(ServingError):
    """The body (or what it inflates to) is over ``server.max_request_mb``."""

    http_status = 413


class RuntimeFailure(ServingError):
    """The runtime raised (or hung) on a valid input: counts against the model's health."""

    http_status = 500


class AnsweredError(ServingError):
    """The request was answered already from another thread (its inline runtime call hung and
    the watchdog answered it): the front-end writes nothing more and closes the connection."""

    http_status = 500
