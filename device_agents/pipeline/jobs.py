"""What the queue carries: a ``Job`` (one request's inputs and, when done, its result) and ``Done``,
its completion flag. Shared by the batcher (``batching``) and the hung-call watchdog (``watchdog``)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgekit.bundle.errors import EdgekitError


class Done:
    """A one-shot completion flag that a thread can wait on with a timeout.

    Built on ``queue.SimpleQueue`` (C): a hand-off through it costs ~8 us on a 2-core x86_64 VM, through a
    ``threading.Event`` (a Python ``Condition``) ~57 us, which is most of a small model's budget.
    """

    __slots__ = ("_flag", "_q")

    def __init__(self) -> None:
        self._flag = False
        self._q: queue.SimpleQueue[None] = queue.SimpleQueue()

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            self._q.put(None)

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        try:
            self._q.get(timeout=timeout)
        except queue.Empty:
            return self._flag
        self._q.put(None)  # leave it set for another wait
        return True


@dataclass(eq=False)
class Job:
    """One request's inputs (checked against the served signature) and, when done, its result."""

    inputs: dict[str, np.ndarray]
    version: int | None  # a version the request asked for, else None (the served one)
    deadline: float  # time.monotonic()
    rows: int = 1
    enqueued: float = field(default_factory=time.monotonic)
    started: float = 0.0
    finished: float = 0.0
    runtime_s: float = 0.0  # the runtime call alone (``ServedModel.infer_timed``), of the batch it ran in
    batch_rows: int = 0
    served_version: int = 0
    outputs: dict[str, np.ndarray] | None = None
    error: EdgekitError | None = None
    cancelled: bool = False
    answered: bool = False  # the watchdog answered it through the caller's hook (an inline call hung)
    done: Done = field(default_factory=Done)
    _key: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        first = next(iter(self.inputs.values()), None)
        self.rows = int(first.shape[0]) if first is not None and first.ndim else 1

    @property
    def key(self) -> tuple[Any, ...]:
        """What jobs sharing a batch agree on: the version asked for, every input's name, shape
        past axis 0 and dtype (computed when a batch is formed: unbatched jobs never need it)."""
        if self._key is None:
            self._key = (self.version, *((n, a.shape[1:], a.dtype.str) for n, a in sorted(self.inputs.items())))
        return self._key
