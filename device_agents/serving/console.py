"""The agent's serial console: framed messages over a tty, a second front-end over ``AgentService``.

``[console] device = "/dev/ttyGS0"`` (any tty: a USB gadget port, a UART, a pty). One thread reads
frames (``console_frames``) and answers each request with a ``RESULT`` or an ``ERROR`` frame whose
``ack`` is the request's ``seq``; a frame that cannot be read is answered with an ``ERROR`` whose
``ack`` is 0 (the host sends its request again), and the session goes on. What it can do is what
the loopback API can (no second orchestration):

    HELLO            -> {"agent", "version", "protocol", "max_body_bytes", "chunk_bytes"}
    STATUS           -> {"ready", "models", "status"}: the store's slots per model (``service.status``)
    STATS            -> ``service.stats()``
    INFER            {"model", "version"?, "header_length"?} + a v2 request body (binary extension)
                     -> {"header_length"} + the v2 response body
    INSTALL_BEGIN    {"sha256", "size_bytes"} -> {"offset"}: bytes of this bundle already received
    INSTALL_CHUNK    {"sha256", "offset"} + bytes -> {"offset"}
    INSTALL_COMMIT   {"sha256"} -> the install result: the bundle goes to ``service.install``
    LOGS             {"lines"?} -> {"lines": [...]}: the agent's recent log lines
    RESTART          -> {"restarting": true}, then the daemon stops cleanly (its supervisor starts it)

A bundle arrives in chunks at explicit offsets into ``<upload_dir>/<sha256>.part``, synced as it
grows: a link that drops, a host that restarts or an agent power cut leaves the part, and the
next ``INSTALL_BEGIN`` of the same bundle answers where to go on from. The whole file is checked
against its sha256 before it is handed to the lifecycle (which verifies its signature as for any
install).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from device_agents import __version__
from device_agents.config import AgentConfig, ConsoleConfig
from device_agents.errors import ServingError, StoreError
from device_agents.service import AgentService
from device_agents.serving.codec import HeaderCache
from device_agents.serving.console_frames import (
    MAX_BODY_BYTES,
    VERSION,
    Frame,
    FrameError,
    FrameReader,
    FrameWriter,
    MessageType,
    pack_message,
    unpack_message,
)
from device_agents.serving.v2 import v2_codec
from device_agents.store import fsync_dir
from device_agents.threads import NamedThread
from edgekit.bundle.codec import to_data
from edgekit.bundle.errors import EdgekitError, InferenceInputError

log = logging.getLogger("edgekit.agent.console")

# A bundle chunk: well under a frame's limit, and a few seconds at 115200 baud on a real UART.
CHUNK_BYTES = 32 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REOPEN_S = 2.0  # a tty that is absent (a USB gadget not plugged in) is tried again this often
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class UploadError(EdgekitError):
    """An install over the console is out of step (offset, size, hash): start it again with
    ``INSTALL_BEGIN``, which answers the offset to go on from."""

    http_status = 409


class LogRing(logging.Handler):
    """The last ``capacity`` formatted log lines, for the console's ``LOGS`` message."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=capacity)
        self.setFormatter(logging.Formatter(_LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except (ValueError, TypeError):  # a record whose arguments do not format: never take the caller down
            self.handleError(record)

    def tail(self, count: int) -> list[str]:
        lines = list(self.lines)
        return lines[-count:] if count > 0 else []


class Uploads:
    """Bundles arriving in chunks: ``<dir>/<sha256>.part``, appended at explicit offsets."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.dir = directory
        self.max_bytes = max_bytes
        self.sizes: dict[str, int] = {}  # sha256 -> declared size, from INSTALL_BEGIN

    def _part(self, sha256: str) -> Path:
        if not isinstance(sha256, str) or not _SHA256.match(sha256):
            raise InferenceInputError(f"sha256 {sha256!r} must be 64 lower-case hex digits")
        return self.dir / f"{sha256}.part"

    def begin(self, sha256: str, size_bytes: int) -> int:
        """Start or resume an upload; returns the bytes already received."""
        part = self._part(sha256)
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0:
            raise InferenceInputError(f"size_bytes must be a positive integer, got {size_bytes!r}")
        if size_bytes > self.max_bytes:
            raise UploadError(
                f"the bundle is {size_bytes} bytes, over max_bundle_mb ({self.max_bytes} bytes); raise "
                "max_bundle_mb in agent.toml or ship a smaller bundle"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        for other in self.dir.glob("*.part"):  # one upload at a time: an abandoned one goes
            if other != part:
                other.unlink(missing_ok=True)
        self.sizes = {sha256: size_bytes}
        try:
            have = part.stat().st_size
        except FileNotFoundError:
            part.touch()
            fsync_dir(self.dir)
            return 0
        if have > size_bytes:
            part.write_bytes(b"")
            return 0
        return have

    def chunk(self, sha256: str, offset: int, data: bytes) -> int:
        part = self._part(sha256)
        size = self.sizes.get(sha256)
        if size is None or not part.exists():
            raise UploadError(f"no upload of {sha256[:12]} is open; send INSTALL_BEGIN first")
        have = part.stat().st_size
        if offset != have:
            raise UploadError(f"chunk at offset {offset}, but {have} bytes are in: resume at offset {have}")
        if offset + len(data) > size:
            raise UploadError(f"chunk ends at {offset + len(data)}, past the declared {size} bytes")
        try:
            with open(part, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            os.truncate(part, have)  # what is in stays whole: a resume goes on from here
            raise StoreError(
                f"cannot write the upload to {self.dir} ({os.strerror(exc.errno or 0)}); free space there "
                "(or set [console] upload_dir to a bigger disk) and send it again: it resumes"
            ) from exc
        return offset + len(data)

    def commit(self, sha256: str) -> Path:
        """The complete bundle, checked against its hash, under its final name (the caller removes it)."""
        part = self._part(sha256)
        size = self.sizes.get(sha256)
        if size is None or not part.exists():
            raise UploadError(f"no upload of {sha256[:12]} is open; send INSTALL_BEGIN first")
        have = part.stat().st_size
        if have != size:
            raise UploadError(f"{have} of {size} bytes are in; resume at offset {have}")
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != sha256:
            part.unlink()
            self.sizes.pop(sha256, None)
            raise UploadError(f"the received bytes hash to {digest.hexdigest()[:12]}, not {sha256[:12]}: send it again")
        done = self.dir / f"{sha256}.ekb"
        os.replace(part, done)
        self.sizes.pop(sha256, None)
        return done


class ConsoleServer:
    """Serves one tty: ``serve_forever`` in a thread, ``close`` from another."""

    def __init__(
        self,
        config: ConsoleConfig,
        service: AgentService,
        *,
        max_bundle_bytes: int,
        on_restart: Callable[[], None],
        logs: LogRing | None = None,
    ) -> None:
        self.config = config
        self.service = service
        self.on_restart = on_restart
        self.logs = logs or LogRing(config.log_lines)
        upload_dir = config.upload_dir or service.config.store / "uploads"
        self.uploads = Uploads(upload_dir, max_bundle_bytes)
        self.header_cache = HeaderCache()
        self.reader = FrameReader()
        self.writer = FrameWriter()
        self._closed = threading.Event()
        self._port: Any = None
        self.frames_in = 0
        self.frames_dropped = 0

    # -- the tty -----------------------------------------------------------------------
    def _open(self) -> Any:
        import serial  # pyserial: only an agent with a console loads it

        try:
            return serial.Serial(str(self.config.device), self.config.baud, timeout=0.2, write_timeout=30)
        except (serial.SerialException, OSError) as exc:
            raise StoreError(f"console.device = {str(self.config.device)!r}: cannot open it ({exc})") from exc

    def open_now(self) -> None:
        """Open the tty in the calling thread (the daemon does before it reports ready: pyserial
        flushes what arrived before it opened the port, so a host's first frame would be lost)."""
        try:
            self._port = self._open()
        except StoreError as exc:
            log.warning("%s; trying again every %g s", exc, _REOPEN_S)

    def serve_forever(self) -> None:
        import serial

        reported = False
        while not self._closed.is_set():
            try:
                self._port = self._port or self._open()
            except StoreError as exc:
                if not reported:
                    log.warning("%s; trying again every %g s", exc, _REOPEN_S)
                    reported = True
                self._closed.wait(_REOPEN_S)
                continue
            log.info("console on %s", self.config.device)
            reported = False
            try:
                self._serve(self._port)
            except (serial.SerialException, OSError) as exc:
                if not self._closed.is_set():
                    log.warning("console %s: %s; opening it again", self.config.device, exc)
                    self._closed.wait(_REOPEN_S)
            finally:
                with contextlib.suppress(serial.SerialException, OSError):
                    self._port.close()
                self._port = None

    def close(self) -> None:
        self._closed.set()

    def _serve(self, port: Any) -> None:
        while not self._closed.is_set():
            data = port.read(max(1, port.in_waiting))
            if not data:
                continue
            for item in self.reader.feed(data):
                if isinstance(item, FrameError):
                    self.frames_dropped += 1
                    log.info("console: %s", item)
                    self._send(port, MessageType.ERROR, _error_doc(item), ack=0)
                    continue
                self.frames_in += 1
                self._answer(port, item)

    def _send(self, port: Any, kind: MessageType, doc: dict[str, Any], blob: bytes = b"", ack: int = 0) -> None:
        _, wire = self.writer.frame(kind, pack_message(doc, blob), ack)
        port.write(wire)
        port.flush()

    def _answer(self, port: Any, frame: Frame) -> None:
        """Answer one request: RESULT, or ERROR with its ``seq`` (0 is kept for frames not read)."""
        try:
            doc, blob = unpack_message(frame.payload) if frame.payload else ({}, b"")
            out, out_blob = self._dispatch(frame.type, doc, blob)
            _, wire = self.writer.frame(MessageType.RESULT, pack_message(out, out_blob), frame.seq)
        except EdgekitError as exc:  # a refusal, or an answer over the frame limit (FrameTooLargeError)
            self._send(port, MessageType.ERROR, _error_doc(exc), ack=frame.seq)
            return
        except Exception as exc:  # the front-end's boundary: one request fails, the session survives
            log.exception("console: %s failed", frame.type.name)
            error = {"error": f"internal error: {exc}", "error_type": type(exc).__name__, "status": 500}
            self._send(port, MessageType.ERROR, error, ack=frame.seq)
            return
        port.write(wire)
        port.flush()
        if frame.type is MessageType.RESTART:
            log.info("console: restart asked; stopping (the supervisor starts the agent again)")
            self.on_restart()

    # -- messages -----------------------------------------------------------------------
    def _dispatch(self, kind: MessageType, doc: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        service = self.service
        if kind is MessageType.HELLO:
            return {
                "agent": "edgekit-agent",
                "version": __version__,
                "protocol": VERSION,
                "max_body_bytes": MAX_BODY_BYTES,
                "chunk_bytes": CHUNK_BYTES,
            }, b""
        if kind is MessageType.STATUS:
            return {"ready": service.ready, "models": service.models(), "status": service.status()}, b""
        if kind is MessageType.STATS:
            return service.stats(), b""
        if kind is MessageType.INFER:
            return self._infer(doc, blob)
        if kind is MessageType.INSTALL_BEGIN:
            return {"offset": self.uploads.begin(doc.get("sha256", ""), doc.get("size_bytes", 0))}, b""
        if kind is MessageType.INSTALL_CHUNK:
            offset = doc.get("offset")
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                raise InferenceInputError(f"offset must be an integer >= 0, got {offset!r}")
            return {"offset": self.uploads.chunk(doc.get("sha256", ""), offset, blob)}, b""
        if kind is MessageType.INSTALL_COMMIT:
            bundle = self.uploads.commit(doc.get("sha256", ""))
            try:
                result = service.install(bundle, origin="console")
            finally:
                bundle.unlink(missing_ok=True)
            return to_data(result), b""
        if kind is MessageType.LOGS:
            count = doc.get("lines", 100)
            if not isinstance(count, int) or isinstance(count, bool):
                raise InferenceInputError(f"lines must be an integer, got {count!r}")
            return {"lines": self.logs.tail(count)}, b""
        if kind is MessageType.RESTART:
            return {"restarting": True}, b""
        raise InferenceInputError(f"{kind.name} is a reply, not a request")

    def _infer(self, doc: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        name = doc.get("model")
        version = doc.get("version")
        header_length = doc.get("header_length")
        if not isinstance(name, str) or not name:
            raise InferenceInputError('infer takes {"model": NAME} and a v2 request body')
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise InferenceInputError(f"version must be an integer, got {version!r}")
        if header_length is not None and (not isinstance(header_length, int) or isinstance(header_length, bool)):
            raise InferenceInputError(f"header_length must be an integer, got {header_length!r}")
        decode, encode = v2_codec(
            name,
            version,
            body,
            header_length=header_length,
            max_bytes=self.service.config.server.max_request_bytes,
            cache=self.header_cache,
        )
        out, json_length = self.service.infer(name, version, decode, encode)
        return {"header_length": json_length}, out


def _error_doc(exc: EdgekitError) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "error": str(exc),
        "error_type": type(exc).__name__,
        "status": exc.http_status,
        "exit_code": exc.exit_code,
    }
    if isinstance(exc, ServingError) and exc.retry_after_s is not None:
        doc["retry_after_s"] = exc.retry_after_s
    return doc


def start_console(config: AgentConfig, service: AgentService, on_restart: Callable[[], None]) -> ConsoleServer:
    """Serve ``config.console`` in a daemon thread; its log ring holds this process's log lines."""
    if config.console is None:
        raise EdgekitError("start_console needs a [console] table in agent.toml")
    logs = LogRing(config.console.log_lines)
    logging.getLogger().addHandler(logs)
    server = ConsoleServer(
        config.console, service, max_bundle_bytes=config.max_bundle_bytes, on_restart=on_restart, logs=logs
    )
    server.open_now()
    NamedThread(target=server.serve_forever, name="console", daemon=True).start()
    return server
