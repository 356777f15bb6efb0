"""What converter SDKs print while a target builds: captured into a log file, not the user's terminal.

onnx2tf / TensorFlow / Keras ("Saved artifact at ...", absl warnings), NNCF progress bars, ONNX
Runtime's calibration prints and coremltools' progress bars write to the process's stdout and
stderr, from Python and from C++. ``sdk_output_to(log)`` sends all of it to ``log`` while it is
open:

- file descriptors 1 and 2 point at the log (C/C++ output, subprocesses);
- ``sys.stdout`` / ``sys.stderr`` are text streams on the log (Python prints, tqdm, warnings);
- ``logging`` handlers that write to the console write to the log (NNCF, absl, TensorFlow);
  handlers an SDK creates meanwhile are pointed back at the console afterwards.

The packager's own progress lines stay visible: the ``say`` it yields writes them with the
original streams. If the block raises, the last lines of the log are printed to the original
stderr (the log itself lives in a scratch folder that is removed).

Not touched: ``TQDM_DISABLE`` (tqdm reads it once, when first imported, so setting it here would
switch off progress bars for the rest of the user's process) and ``TF_CPP_MIN_LOG_LEVEL``, which
``edgekit.compress.onnx2tflite`` sets just before it imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

TAIL_LINES = 20


@contextlib.contextmanager
def sdk_output_to(log: Path, say: Callable[[str], None]) -> Iterator[Callable[[str], None]]:
    """Capture stdout/stderr (fd and ``sys`` level) and console logging into ``log`` (appended).

    Yields a progress function that calls ``say`` with the original streams in place.
    """
    capture = _Capture(log)
    capture.to_log()

    def visible(message: str) -> None:
        capture.to_console()
        try:
            say(message)
        finally:
            capture.to_log()

    try:
        yield visible
    except BaseException:
        capture.to_console()
        _print_tail(log, capture.console_err)
        raise
    else:
        capture.to_console()
    finally:
        capture.close()


class _Capture:
    """The console (``sys`` streams, copies of fds 1 and 2, console logging handlers) and the log."""

    def __init__(self, log: Path) -> None:
        _flush_all()
        log.parent.mkdir(parents=True, exist_ok=True)
        # Two line-buffered streams on one O_APPEND file: stdout and stderr lines keep their order.
        self.log_out = open(log, "a", buffering=1, encoding="utf-8", errors="replace")
        self.log_err = open(log, "a", buffering=1, encoding="utf-8", errors="replace")
        self.console_out, self.console_err = sys.stdout, sys.stderr
        self.saved_fds = (_dup(1), _dup(2))
        err_like = {id(s) for s in (sys.stderr, sys.__stderr__) if s is not None}
        self.handlers = {h: (h.stream, id(h.stream) in err_like) for h in _console_handlers()}

    def to_log(self) -> None:
        _flush_all()
        for fd, saved in ((1, self.saved_fds[0]), (2, self.saved_fds[1])):
            if saved is not None:
                os.dup2(self.log_out.fileno(), fd)
        sys.stdout, sys.stderr = self.log_out, self.log_err
        for handler, (_, is_err) in self.handlers.items():
            handler.setStream(self.log_err if is_err else self.log_out)

    def to_console(self) -> None:
        _flush_all()
        for fd, saved in ((1, self.saved_fds[0]), (2, self.saved_fds[1])):
            if saved is not None:
                os.dup2(saved, fd)
        sys.stdout, sys.stderr = self.console_out, self.console_err
        for handler, (original, _) in self.handlers.items():
            handler.setStream(original)

    def close(self) -> None:
        # Handlers an SDK created while captured hold the log streams: give them the console's.
        for handler in _stream_handlers():
            if handler.stream is self.log_out:
                handler.setStream(self.console_out)
            elif handler.stream is self.log_err:
                handler.setStream(self.console_err)
        for saved in self.saved_fds:
            if saved is not None:
                os.close(saved)
        self.log_out.close()
        self.log_err.close()


def _dup(fd: int) -> int | None:
    """A copy of ``fd``; None where the process has no such descriptor (then only ``sys`` is switched)."""
    try:
        return os.dup(fd)
    except OSError:
        return None


def _console_handlers() -> list[logging.StreamHandler[TextIO]]:
    """Every ``logging`` handler that writes to the console's stdout or stderr."""
    console = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}
    return [h for h in _stream_handlers() if id(h.stream) in console]


def _stream_handlers() -> list[logging.StreamHandler[TextIO]]:
    named = (v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))
    found: dict[int, logging.StreamHandler[TextIO]] = {}
    for logger in (logging.getLogger(), *named):
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                found[id(handler)] = handler
    return list(found.values())


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    # C code (printf) buffers in stdio; flush it before the descriptors move under it.
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).fflush(None)


def _print_tail(log: Path, err: TextIO) -> None:
    try:
        lines = [line.rstrip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return
    if not lines:
        return
    tail = lines[-TAIL_LINES:]
    print(f"last {len(tail)} of {len(lines)} lines the SDK printed before the error:", file=err)
    for line in tail:
        print(f"  | {line[-300:]}", file=err)
    err.flush()
