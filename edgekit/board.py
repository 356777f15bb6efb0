"""``edgekit board``: the agent's serial console from the host, over pyserial.

    with BoardClient("/dev/ttyACM0") as board:
        board.status()                          # {"ready", "models", "status"}
        board.infer("tiny", {"x": array})       # {"y": array}: tensors as a v2 binary body, no pickle
        board.install(Path("tiny-2.ekb"))       # chunked; resumes where the agent's part file ends
        board.stats(); board.logs(50); board.restart()

Each request is a frame (``device_agents.serving.console_frames``) answered by a ``RESULT`` or an
``ERROR`` frame carrying its sequence number. When the agent answers ``ERROR`` with no sequence
number (it could not read a frame: bytes were flipped or lost on the line), the request is sent
again with a new number, up to ``retries`` times. An agent error is a ``BoardError`` carrying
the agent's message and error type.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from device_agents.serving.codec import V2_TO_NUMPY
from device_agents.serving.console_frames import (
    Frame,
    FrameError,
    FrameReader,
    FrameWriter,
    MessageType,
    pack_message,
    unpack_message,
)
from edgekit.errors import EdgekitError

_NUMPY_TO_V2 = {dtype: name for name, dtype in V2_TO_NUMPY.items()}
CHUNK_BYTES = 32 * 1024
# Requests that may be sent twice (no effect, or one the agent refuses the second time: a chunk at
# an offset already written), when their answer may have been lost on the line.
_RESENDABLE = frozenset(
    {
        MessageType.HELLO,
        MessageType.STATUS,
        MessageType.STATS,
        MessageType.INFER,
        MessageType.LOGS,
        MessageType.INSTALL_BEGIN,
        MessageType.INSTALL_CHUNK,
    }
)
_LOST_ANSWER_S = 1.0
_HELLO_EVERY_S = 2.0


class BoardError(EdgekitError):
    """The agent answered a console request with an error (``error_type`` is the agent's)."""

    def __init__(self, message: str, error_type: str = "", exit_code: int = 1) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.exit_code = exit_code


class BoardTimeoutError(EdgekitError):
    """No answer on the serial line in time: check the cable/port, that the agent runs with
    ``[console] device`` set to its end, and nothing else holds the port."""


def encode_v2_request(inputs: Mapping[str, np.ndarray]) -> tuple[bytes, int]:
    """A v2 request body with every input as a binary tensor; returns (body, JSON header length)."""
    items, blobs = [], []
    for name, value in inputs.items():
        arr = np.ascontiguousarray(value)
        wire = arr.dtype.newbyteorder("<") if arr.dtype.byteorder not in ("|",) else arr.dtype
        datatype = _NUMPY_TO_V2.get(np.dtype(wire))
        if datatype is None:
            raise EdgekitError(f"input {name!r}: dtype {arr.dtype} has no v2 datatype")
        raw = arr.astype(wire, copy=False).tobytes()
        items.append(
            {"name": name, "datatype": datatype, "shape": list(arr.shape), "parameters": {"binary_data_size": len(raw)}}
        )
        blobs.append(raw)
    header = json.dumps({"inputs": items, "parameters": {"binary_data_output": True}}).encode()
    return header + b"".join(blobs), len(header)


def decode_v2_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    end = len(body) if header_length is None else header_length
    doc = json.loads(body[:end])
    out: dict[str, np.ndarray] = {}
    offset = end
    for item in doc["outputs"]:
        dtype = V2_TO_NUMPY[item["datatype"]]
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is None:
            out[item["name"]] = np.asarray(item["data"], dtype).reshape(item["shape"])
            continue
        out[item["name"]] = np.frombuffer(body, dtype, int(size) // dtype.itemsize, offset).reshape(item["shape"])
        offset += int(size)
    return out


class BoardClient:
    """One console session over ``port`` (any tty path pyserial opens, or an open ``serial.Serial``)."""

    def __init__(self, port: str | Any, baud: int = 115200, *, timeout_s: float = 30.0, retries: int = 3) -> None:
        self.port_name = port if isinstance(port, str) else getattr(port, "port", "serial")
        self._given = None if isinstance(port, str) else port
        self.baud = baud
        self.timeout_s = timeout_s
        self.retries = retries
        self.writer = FrameWriter()
        self.reader = FrameReader()
        self.errors_seen: list[FrameError | dict[str, Any]] = []  # frames the agent or we could not read
        self._serial: Any = None

    def __enter__(self) -> BoardClient:
        self.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open(self) -> dict[str, Any]:
        """Open the port and start a session (``HELLO``); returns the agent's answer."""
        if self._given is not None:
            self._serial = self._given
        else:
            import serial

            try:
                self._serial = serial.Serial(self.port_name, self.baud, timeout=0.05)
            except (serial.SerialException, OSError) as exc:
                raise BoardTimeoutError(f"cannot open {self.port_name}: {exc}") from exc
        return self.hello()

    def close(self) -> None:
        if self._serial is not None and self._given is None:
            self._serial.close()
        self._serial = None

    # -- messages -----------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        """Start a session: sent again every ``_HELLO_EVERY_S`` until the agent answers (it may be
        booting, or opening its end of the line) or ``timeout_s`` passes."""
        self.reader.reset()  # the agent may have restarted: its numbering starts again
        self.writer = FrameWriter()
        self._serial.reset_input_buffer()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.request(MessageType.HELLO, timeout_s=min(_HELLO_EVERY_S, self.timeout_s))[0]
            except BoardTimeoutError:
                if time.monotonic() >= deadline:
                    raise

    def status(self) -> dict[str, Any]:
        return self.request(MessageType.STATUS)[0]

    def stats(self) -> dict[str, Any]:
        return self.request(MessageType.STATS)[0]

    def logs(self, lines: int = 100) -> list[str]:
        return list(self.request(MessageType.LOGS, {"lines": lines})[0]["lines"])

    def restart(self) -> dict[str, Any]:
        return self.request(MessageType.RESTART)[0]

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: int | None = None) -> dict[str, np.ndarray]:
        body, header_length = encode_v2_request(inputs)
        doc: dict[str, Any] = {"model": model, "header_length": header_length}
        if version is not None:
            doc["version"] = version
        answer, blob = self.request(MessageType.INFER, doc, body)
        return decode_v2_response(blob, answer.get("header_length"))

    def install(
        self,
        bundle: Path,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        progress: Callable[[int, int], None] | None = None,
        timeout_s: float = 600.0,
    ) -> dict[str, Any]:
        """Send ``bundle`` in chunks and install it; resumes an upload the agent holds part of."""
        data = Path(bundle).read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        offset = int(self.request(MessageType.INSTALL_BEGIN, {"sha256": sha256, "size_bytes": len(data)})[0]["offset"])
        resumed = 0
        while offset < len(data):
            chunk = data[offset : offset + chunk_bytes]
            try:
                answer = self.request(MessageType.INSTALL_CHUNK, {"sha256": sha256, "offset": offset}, chunk)[0]
            except BoardError as exc:
                if exc.error_type != "UploadError" or resumed >= self.retries:
                    raise
                resumed += 1  # out of step (a lost answer, another upload): ask where to go on from
                begin = {"sha256": sha256, "size_bytes": len(data)}
                offset = int(self.request(MessageType.INSTALL_BEGIN, begin)[0]["offset"])
                continue
            offset = int(answer["offset"])
            if progress is not None:
                progress(offset, len(data))
        return self.request(MessageType.INSTALL_COMMIT, {"sha256": sha256}, timeout_s=timeout_s)[0]

    # -- the exchange -------------------------------------------------------------------
    def request(
        self, kind: MessageType, doc: dict[str, Any] | None = None, blob: bytes = b"", *, timeout_s: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """Send one request and wait for its answer; resend it when the agent could not read it."""
        if self._serial is None:
            raise BoardTimeoutError("the board client is not open; call open() or use it as a context manager")
        payload = pack_message(doc or {}, blob)
        for _attempt in range(self.retries + 1):
            sent, wire = self.writer.frame(kind, payload)
            self._serial.write(wire)
            self._serial.flush()
            reply = self._wait(sent.seq, self.timeout_s if timeout_s is None else timeout_s, kind in _RESENDABLE)
            if reply is None:  # a damaged frame came instead of the answer: ask again
                continue
            answer, answer_blob = unpack_message(reply.payload)
            if reply.type is MessageType.ERROR and reply.ack == 0:
                self.errors_seen.append(answer)  # the agent dropped our frame: send it again
                continue
            if reply.type is MessageType.ERROR:
                raise BoardError(
                    f"{self.port_name}: {answer.get('error', 'error')}",
                    str(answer.get("error_type", "")),
                    int(answer.get("exit_code", 1)),
                )
            return answer, answer_blob
        raise BoardError(
            f"{self.port_name}: the agent could not read {kind.name} in {self.retries + 1} tries; check the line "
            "(baud rate, cable, noise)",
            "FrameError",
        )

    def _wait(self, seq: int, timeout_s: float, resendable: bool) -> Frame | None:
        """The answer to ``seq``; None when a frame came damaged and no answer followed within
        ``_LOST_ANSWER_S`` (the answer was probably that frame) and the request may be sent again."""
        deadline = time.monotonic() + timeout_s
        damaged_at: float | None = None
        while time.monotonic() < deadline:
            if resendable and damaged_at is not None and time.monotonic() - damaged_at > _LOST_ANSWER_S:
                return None
            data = self._serial.read(max(1, self._serial.in_waiting))
            if not data:
                continue
            for item in self.reader.feed(data):
                if isinstance(item, FrameError):
                    self.errors_seen.append(item)
                    damaged_at = time.monotonic()
                    continue
                if item.ack == seq or (item.type is MessageType.ERROR and item.ack == 0):
                    return item
                # an answer to an earlier request (given up on): not this one's
        raise BoardTimeoutError(
            f"{self.port_name}: no answer in {timeout_s:g} s; check that edgekit-agent runs with [console] device "
            "set to the other end of this line"
        )
