"""The agent's HTTP/1.1 transport: connections, request parsing and limits, and writing answers.
Nothing here knows the v2 protocol or the service: routes (``serving.v2``, ``serving.install``)
are methods of a handler class built on ``RequestHandler``, and a server built on ``Transport``
serves them (``serving.http`` puts the agent's together).

Stdlib ``ThreadingHTTPServer`` with HTTP/1.1 keep-alive and TCP_NODELAY (without it, Nagle plus
delayed ACKs add 40+ ms per request). Each response is written with one ``send``.

Limits (``[server]``): a connection idle for ``idle_timeout_s`` is closed; at
``max_connections`` the oldest idle connection is closed to make room (if none is idle, and half
the cap or more are reading headers, the longest of those; else the new one gets a 503 and is
closed: sockets never pile up unanswered); a request's headers are due ``header_timeout_s``
after its request line, at most ``max_header_kib`` (431 past that); bodies over ``max_request_mb``
(before or after gzip) are 413; every body byte held is reserved from ``max_buffered_mb`` as it
arrives, and a body is due ``idle_timeout_s`` plus its length at ``min_body_rate_kib_s`` after
its request line.
"""

from __future__ import annotations

import errno
import gc
import hmac
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote

from device_agents import __version__
from device_agents.config import ServerConfig
from device_agents.errors import RequestTooLargeError, ServingError
from device_agents.serving.bodies import ByteBudget, Reservation, inflate
from device_agents.serving.tls import server_context
from device_agents.threads import set_os_name
from edgekit.bundle.errors import ConfigError, EdgekitError, InferenceInputError

log = logging.getLogger("edgekit.agent.http")
access_log = logging.getLogger("edgekit.agent.access")

JSON = "application/json"
BINARY = "application/octet-stream"
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_SERVER = f"edgekit-agent/{__version__}"
# The status line and Server header of the usual answers, built once.
_STATUS_LINES = {code: f"HTTP/1.1 {code} {_REASONS[code]}\r\nServer: {_SERVER}\r\n" for code in (200, 400, 404, 413)}
_MAX_LINE = 65536
_OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")  # probes: answered without the bearer token
_BODY_CHUNK_BYTES = 1 << 20  # a body not all in yet is read (and its budget taken) this much at a time
# accept() failing for want of descriptors (or kernel memory): the listening socket stays readable,
# so the accept loop waits before it tries again, from 10 ms doubling up to 0.5 s (shutdown stays prompt)
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_BACKOFF_S = (0.01, 0.5)


class _Headers(dict[str, str]):
    """Request headers by lower-case name: the part of ``email.message.Message`` this server uses.

    The stdlib parses headers with the ``email`` package: 108 us for tritonclient's six headers
    on this machine, more than the rest of a small request costs.
    """

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]  # case-insensitive
        return dict.get(self, key.lower(), default)

    def get_content_type(self) -> str:
        return (self.get("content-type") or "text/plain").split(";", 1)[0].strip().lower()


_MAX_HEADERS = 100
# Header blocks remembered as parsed (at most this many, each at most this long: 256 KiB in all)
_HEADER_BLOCKS = 256
_HEADER_BLOCK_MAX_BYTES = 1024


class _Connection:
    """One open connection: its socket, whether a request is being handled on it (a new
    connection counts as busy until its handler waits for a request line), and since when it
    reads a request's headers (``perf_counter``; 0.0 when it does not)."""

    __slots__ = ("busy", "head_since", "idle_since", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.busy = True
        self.idle_since = time.monotonic()
        self.head_since = 0.0


class Transport(ThreadingHTTPServer):
    """The HTTP server of a front-end: ``serve_forever`` in a thread, ``shutdown`` from another.
    ``handler``: its ``RequestHandler`` subclass (the routes); ``count_reject(model, reason)``
    counts a refusal (a connection over the cap: model "", reason "connections")."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        host: str,
        port: int,
        handler: type[RequestHandler],
        limits: ServerConfig,
        count_reject: Callable[[str, str], None] = lambda model, reason: None,
    ) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.limits = limits
        self.count_reject = count_reject
        self.max_request_bytes = self.limits.max_request_bytes
        # the bearer token clients not on loopback send (None: none asked for)
        self.auth_token: bytes | None = None
        if self.limits.auth_token_file is not None:
            self.auth_token = _read_token(self.limits.auth_token_file)
        self.tls = server_context(self.limits)  # HTTPS (and client certificates) where configured
        # clients off loopback must show the token or a verified client certificate
        self.guarded = self.auth_token is not None or self.limits.mutual_tls
        self.budget = ByteBudget(self.limits.max_buffered_bytes)  # bodies as received
        self.inflate_budget = ByteBudget(self.limits.max_buffered_bytes)  # what gzip/deflate bodies inflate to
        self.request_queue_size = min(max(128, self.limits.max_connections), socket.SOMAXCONN)
        self.header_blocks: dict[bytes, _Headers] = {}  # HTTP header blocks seen before: not parsed again
        self._header_blocks_lock = threading.Lock()
        self._conns: dict[int, _Connection] = {}
        self._conns_lock = threading.Lock()
        self._reaper_stop = threading.Event()
        self._accept_backoff_s = 0.0  # the wait after the last accept() that found no descriptor
        self._out_of_fds_logged = 0.0  # time.monotonic() of the last warning about it
        super().__init__((host, port), handler)
        threading.Thread(target=self._reap_slow_headers, name="http-reaper", daemon=True).start()
        # What the agent loaded to get here (SDKs, models, config: ~100k objects) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it. A full
        # collection of it took 85-120 ms on a 2-core x86_64 VM, every thread stopped; it came once in ~2000 small
        # requests of a fresh agent (a tail the batching p99 and the overhead p99 both see). Frozen
        # objects freed later by reference counting still go; only cycles among them stay.
        gc.freeze()

    def keep_header_block(self, block: bytes, headers: _Headers) -> None:
        """Remember what ``block`` parsed to (a copy), if it is small; the oldest goes at the bound."""
        if len(block) > _HEADER_BLOCK_MAX_BYTES:
            return
        with self._header_blocks_lock:
            while len(self.header_blocks) >= _HEADER_BLOCKS:
                del self.header_blocks[next(iter(self.header_blocks))]
            self.header_blocks[block] = _Headers(headers)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), self.server_address[1]
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    # -- the connection cap -------------------------------------------------------------
    def get_request(self) -> tuple[socket.socket, Any]:
        """``accept()``; when it fails for want of file descriptors, wait before the next try (the
        pending connection keeps the listening socket readable: without a wait the accept loop
        spins on a core until a descriptor is free)."""
        try:
            got = super().get_request()
        except OSError as exc:
            if exc.errno in _OUT_OF_DESCRIPTORS:
                self._out_of_descriptors(exc)
            raise  # socketserver drops this accept and goes on
        self._accept_backoff_s = 0.0
        return got

    def _out_of_descriptors(self, exc: OSError) -> None:
        self.count_reject("", "descriptors")
        low, high = _ACCEPT_BACKOFF_S
        self._accept_backoff_s = min(high, max(low, self._accept_backoff_s * 2))
        now = time.monotonic()
        if now - self._out_of_fds_logged >= 10.0:
            self._out_of_fds_logged = now
            log.warning(
                "cannot accept connections: %s; waiting up to %g s between tries (raise LimitNOFILE / "
                "ulimit -n, or lower server.max_connections)",
                exc.strerror or exc,
                high,
            )
        time.sleep(self._accept_backoff_s)

    def process_request(self, request: Any, client_address: Any) -> None:
        sock: socket.socket = request
        with self._conns_lock:
            if len(self._conns) >= self.limits.max_connections:
                oldest = self._evictable()
                if oldest is None:
                    self._refuse(sock)
                    return
                self._conns.pop(oldest.sock.fileno(), None)
                _shut(oldest.sock)  # its handler sees EOF and ends
            self._conns[sock.fileno()] = _Connection(sock)
        super().process_request(request, client_address)

    def _evictable(self) -> _Connection | None:
        """At the cap: the oldest idle connection, else (when connections reading headers hold
        half the cap or more) the one reading its headers longest; None when every one is busy."""
        idle = [c for c in self._conns.values() if not c.busy]
        if idle:
            return min(idle, key=lambda c: c.idle_since)
        heads = [c for c in self._conns.values() if c.head_since]
        if heads and len(heads) * 2 >= self.limits.max_connections:
            return min(heads, key=lambda c: c.head_since)
        return None

    def _reap_slow_headers(self) -> None:
        """Close connections whose headers are not all in ``header_timeout_s`` after their
        request line (a per-read timeout lets a byte every few seconds hold one for ever)."""
        timeout_s = self.limits.header_timeout_s
        while not self._reaper_stop.wait(min(1.0, timeout_s / 4)):
            late = time.perf_counter() - timeout_s
            with self._conns_lock:
                for conn in self._conns.values():
                    if 0.0 < conn.head_since < late:
                        conn.head_since = 0.0
                        _shut(conn.sock)  # its handler sees EOF and ends

    def server_close(self) -> None:
        self._reaper_stop.set()
        super().server_close()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        set_os_name("http-conn")  # a connection's thread, to top -H (device_agents.threads)
        if self.tls is not None:
            request = self._handshake(request)
            if request is None:
                return
        super().process_request_thread(request, client_address)

    def _handshake(self, sock: socket.socket) -> ssl.SSLSocket | None:
        """The TLS handshake of a new connection, in its own thread (never the accept loop's), due
        like headers ``header_timeout_s`` after the connection came (the socket timeout bounds the
        whole handshake, not each read; meanwhile it counts as reading headers for the reaper and
        the connection cap); None (closed) when it fails."""
        if self.tls is None:
            return None
        fd = sock.fileno()
        with self._conns_lock:
            conn = self._conns.get(fd)
            if conn is not None:
                conn.head_since = time.perf_counter()
        try:
            tls_sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError:
            self.shutdown_request(sock)
            return None
        with self._conns_lock:
            if conn is not None and self._conns.get(fd) is conn:
                conn.sock = tls_sock  # the plain socket object gave its descriptor to this one
        try:
            tls_sock.settimeout(self.limits.header_timeout_s)
            tls_sock.do_handshake()
        except OSError as exc:  # ssl.SSLError included: no TLS, a certificate that does not verify, too slow
            self.count_reject("", "tls")
            log.debug("TLS handshake failed: %s", exc)
            self.shutdown_request(tls_sock)
            return None
        if conn is not None:
            conn.head_since = 0.0
        return tls_sock

    def connection(self, sock: socket.socket) -> _Connection | None:
        with self._conns_lock:
            return self._conns.get(sock.fileno())

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            conn = self._conns.get(request.fileno())
            if conn is not None and conn.sock is request:
                del self._conns[request.fileno()]
        super().shutdown_request(request)

    def _refuse(self, sock: socket.socket) -> None:
        self.count_reject("", "connections")
        body = b'{"error":"too many open connections (server.max_connections); retry later"}'
        head = (
            f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: {JSON}\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {self.limits.retry_after_s}\r\nConnection: close\r\n\r\n"
        )
        try:
            sock.settimeout(1.0)
            sock.sendall(head.encode("latin-1") + body)
        except OSError:
            pass  # the client went away: nothing to answer
        _shut(sock)
        sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer


class RequestHandler(BaseHTTPRequestHandler):
    """Reads requests off one connection and writes their answers; subclasses add the routes
    (``do_GET``, ``do_POST``)."""

    protocol_version = "HTTP/1.1"
    server_version = _SERVER
    disable_nagle_algorithm = True  # sets TCP_NODELAY on every accepted socket
    server: Transport

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.limits.idle_timeout_s)  # a read that waits this long: closed
        self._conn = self.server.connection(self.connection)
        self._status = 0
        self._sent = 0
        limits = self.server.limits
        self.loopback = (
            is_loopback(self.client_address[0])
            if self.server.guarded or limits.metrics_loopback_only
            else True  # (not asked: no one checks)
        )
        # a client certificate that verified against server.client_ca_file
        self.certified = (
            limits.mutual_tls and isinstance(self.connection, ssl.SSLSocket) and bool(self.connection.getpeercert())
        )

    # -- plumbing -----------------------------------------------------------------------
    def handle_one_request(self) -> None:
        """The stdlib's, with the connection marked idle while it waits for a request line."""
        conn = self._conn
        if conn is not None:
            conn.busy, conn.idle_since = False, time.monotonic()
        try:
            self.raw_requestline = self.rfile.readline(_MAX_LINE + 1)
        except (TimeoutError, OSError):
            self.close_connection = True  # idle past server.idle_timeout_s, or evicted for a new one
            return
        self._received = time.perf_counter()  # the request line is in: the request was received
        if conn is not None:
            conn.busy, conn.head_since = True, self._received
        if len(self.raw_requestline) > _MAX_LINE:
            self.requestline = self.request_version = self.command = ""
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
            return
        if not self.raw_requestline:
            self.close_connection = True
            return
        if not self.parse_request():
            return
        if conn is not None:
            conn.head_since = 0.0
        if (
            not self.loopback
            and self.server.guarded
            and not self.certified
            and self.path not in _OPEN_PATHS
            and not self._authorized()
        ):
            return
        handler = getattr(self, f"do_{self.command}", None)
        if handler is None:
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
            return
        self._start = time.perf_counter()
        self._status, self._sent, self._answered = 0, 0, False
        try:
            handler()
            self.wfile.flush()
        except (TimeoutError, ConnectionError):
            self.close_connection = True  # the client stalled mid-body or went away
        if not self._answered:  # else the watchdog's answer logged it
            self._log_access()

    def _log_access(self) -> None:
        if access_log.isEnabledFor(logging.DEBUG):
            access_log.debug(
                '%s "%s %s" %d %d %.3fms',
                self.client_address[0],
                self.command,
                self.path,
                self._status,
                self._sent,
                (time.perf_counter() - self._start) * 1000,
            )

    def parse_request(self) -> bool:
        """The request line and headers (HTTP/1.0 and 1.1); False after answering a 4xx."""
        self.command = ""
        self.request_version = "HTTP/1.1"
        self.requestline = line = self.raw_requestline.decode("iso-8859-1").rstrip("\r\n")
        words = line.split()
        if len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
            self.close_connection = True
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request line {line[:100]!r}")
            return False
        self.command, self.path, self.request_version = words
        self.close_connection = self.request_version == "HTTP/1.0"
        block = self._header_block()
        if block is False:
            return False
        if block is None:
            headers = _Headers()
            left = self.server.limits.max_header_kib * 1024  # the block's bytes, counted before they are kept
            for _ in range(_MAX_HEADERS + 1):
                raw = self.rfile.readline(min(left, _MAX_LINE) + 1)
                if raw in (b"\r\n", b"\n"):
                    break
                if not raw:  # the client went away, or was closed for sending its headers too slowly
                    self.close_connection = True
                    return False
                left -= len(raw)
                if left < 0 or len(raw) > _MAX_LINE:
                    self.close_connection = True
                    self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Headers over server.max_header_kib")
                    return False
                if not self._add_header(headers, raw.decode("iso-8859-1")):
                    return False
            else:
                self.close_connection = True
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"More than {_MAX_HEADERS} headers")
                return False
        else:
            headers = block
        self.headers = headers  # type: ignore[assignment]  # _Headers offers what this server reads of Message
        connection = (dict.get(headers, "connection") or "").lower()
        if connection == "close":
            self.close_connection = True
        elif connection == "keep-alive":
            self.close_connection = False
        if (dict.get(headers, "expect") or "").lower() == "100-continue":
            self.send_response_only(HTTPStatus.CONTINUE)
            self.end_headers()
        return True

    def _header_block(self) -> _Headers | Literal[False] | None:
        """The headers when all of them are in the read buffer already (the usual case: one
        ``peek``, one ``split``); None to read them line by line; False after answering a 4xx.

        A client sends the same header block with every request of one kind (tritonclient: the
        same six headers, byte for byte): a block parsed before is a dict look-up
        (``AgentServer.header_blocks``; only blocks that parsed without a 4xx are kept)."""
        buffered = self.rfile.peek(_MAX_LINE)  # type: ignore[attr-defined]  # rfile is a BufferedReader
        if buffered.startswith(b"\r\n"):
            self.rfile.read(2)  # no headers: the blank line only
            return _Headers()
        end = buffered.find(b"\r\n\r\n")  # the first blank line ends the headers
        if end < 0:  # not all in yet
            return None
        block = buffered[:end]
        known = self.server.header_blocks.get(block)
        if known is not None:
            self.rfile.read(end + 4)
            return _Headers(known)  # a copy: nothing a request does to its headers reaches the next
        if buffered.count(b"\n", 0, end) != buffered.count(b"\r\n", 0, end):  # bare-LF lines
            return None
        if end > self.server.limits.max_header_kib * 1024:  # line by line: answered with a 431 there
            return None
        self.rfile.read(end + 4)
        headers = self._parse_block(block)
        if headers is not False:
            self.server.keep_header_block(block, headers)
        return headers

    def _parse_block(self, block: bytes) -> _Headers | Literal[False]:
        """The ``Name: value`` lines of ``block`` (CRLF between them); False after answering a 4xx."""
        lines = block.decode("iso-8859-1").split("\r\n")
        if len(lines) > _MAX_HEADERS:
            self.close_connection = True
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"More than {_MAX_HEADERS} headers")
            return False
        headers = _Headers()
        for line in lines:
            # _add_header's checks inline for a well-formed line (a call per header costs ~0.5 us)
            name, sep, value = line.partition(":")
            key = name.strip().lower()
            if not sep or not key or (key == "content-length" and key in headers):  # bad, or a second length
                if not self._add_header(headers, line):
                    return False
                continue
            headers[key] = value.strip()
        return headers

    def _add_header(self, headers: _Headers, line: str) -> bool:
        """Add one ``Name: value`` line; False after answering a 400 (bad line, request smuggling)."""
        name, sep, value = line.partition(":")
        key = name.strip().lower()
        value = value.strip()
        if not sep or not key:
            self.close_connection = True
            self.send_error(HTTPStatus.BAD_REQUEST, "Bad header line")
            return False
        if key == "content-length" and dict.get(headers, key, value) != value:  # request smuggling
            self.close_connection = True
            self.send_error(HTTPStatus.BAD_REQUEST, "Conflicting Content-Length headers")
            return False
        headers[key] = value
        return True

    def _authorized(self) -> bool:
        """Whether the request carries the bearer token (compared in constant time); else a 401
        (a 403 where only a client certificate would do)."""
        token = self.server.auth_token
        if token is not None:
            headers: dict[str, str] = self.headers  # type: ignore[assignment]  # a _Headers
            given = (dict.get(headers, "authorization") or "").encode("latin-1")
            if given.startswith(b"Bearer ") and hmac.compare_digest(given[7:].strip(), token):
                return True
        self.close_connection = True  # any body stays unread
        ways = ["Authorization: Bearer <token>"] if token is not None else []
        if self.server.limits.mutual_tls:
            ways.append("a client certificate signed by the CA in server.client_ca_file")
        error = {"error": f"this agent takes requests from off the device with {' or '.join(ways)}"}
        if token is not None:
            self._send_json(401, error, (("WWW-Authenticate", "Bearer"),))
        else:
            self._send_json(403, error)
        return False

    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def _send(
        self,
        code: int,
        body: bytes = b"",
        content_type: str = JSON,
        headers: tuple[tuple[str, str], ...] = (),
        extra: str = "",
    ) -> None:
        """Write one response; ``extra``: more header lines, each ending in CRLF, as they are."""
        if headers:
            extra += "".join(f"{k}: {v}\r\n" for k, v in headers)
        if self.close_connection:
            extra += "Connection: close\r\n"
        status = _STATUS_LINES.get(code) or f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nServer: {_SERVER}\r\n"
        head = (
            f"{status}Date: {_http_date()}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        )
        data = head.encode("latin-1") + body
        self._write_start, cpu = time.perf_counter(), time.thread_time()
        self.connection.sendall(data)  # (what wfile.write does, less a Python call and a memoryview)
        self._written = time.perf_counter()  # as soon as the write returned: not after the CPU clock read below
        # the write's own CPU time too: a write that wakes the client can be preempted by it (on a
        # busy 2-core machine, the client is woken onto this core), and that wait is the client's
        self._write_cpu_s = time.thread_time() - cpu
        self._status, self._sent = code, len(body)

    def _send_json(self, code: int, doc: Any, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self._send(code, json.dumps(doc, separators=(",", ":")).encode(), headers=headers)

    def _send_error(self, exc: Exception) -> None:
        code = exc.http_status if isinstance(exc, EdgekitError) else 500
        headers: tuple[tuple[str, str], ...] = ()
        if isinstance(exc, ServingError):
            if exc.retry_after_s is not None:
                headers = (("Retry-After", str(exc.retry_after_s)),)
            if exc.reason:
                self.server.count_reject(self._label, exc.reason)
        self._send_json(code, {"error": str(exc)}, headers)

    _label = ""

    def _read_raw_body(self, reservation: Reservation) -> bytes:
        """The body as sent (``Content-Length`` bytes), its size reserved from the buffer budget."""
        # a _Headers: lower-case keys, read with dict.get (no .lower() per look-up)
        headers: dict[str, str] = self.headers  # type: ignore[assignment]
        if dict.get(headers, "transfer-encoding"):
            self.close_connection = True
            raise InferenceInputError("chunked request bodies are not supported; send Content-Length")
        try:
            length = int(dict.get(headers, "content-length", "0"))
        except ValueError as exc:
            self.close_connection = True
            raise InferenceInputError("Content-Length is not a number") from exc
        limit = self.server.max_request_bytes
        if length > limit or length < 0:
            self.close_connection = True  # the body stays unread
            raise RequestTooLargeError(f"request body of {length} bytes is over server.max_request_mb ({limit} bytes)")
        rfile = self.rfile
        if not length or len(rfile.peek(1)) >= length:  # type: ignore[attr-defined]  # all in the buffer: the usual case
            try:
                reservation.add(length)
            except ServingError:
                self.close_connection = True  # the body stays unread
                raise
            return rfile.read(length)
        return self._read_arriving_body(length, reservation)

    def _read_arriving_body(self, length: int, reservation: Reservation) -> bytes:
        """A body not all in yet: its budget taken as its bytes arrive (a slow sender holds what it
        sent, not what it declared), and all of it due by ``ServerConfig.body_deadline_s`` from the
        request line (each read still waits at most ``idle_timeout_s``)."""
        deadline = self._received + self.server.limits.body_deadline_s(length)
        chunks: list[bytes] = []
        left = length
        try:
            while left:
                chunk = self.rfile.read1(min(left, _BODY_CHUNK_BYTES))
                if not chunk:
                    raise InferenceInputError("the request body ended early")
                reservation.add(len(chunk))
                chunks.append(chunk)
                left -= len(chunk)
                if left and time.perf_counter() > deadline:
                    raise TimeoutError("request body slower than server.min_body_rate_kib_s")
        except (ServingError, InferenceInputError):
            self.close_connection = True  # the rest of the body stays unread
            raise
        return b"".join(chunks)

    def _read_body(self, reservation: Reservation) -> bytes | bytearray:
        return inflate(
            self._read_raw_body(reservation),
            self.headers.get("Content-Encoding"),
            self.server.max_request_bytes,
            reservation,
        )

    def _reservation(self) -> Reservation:
        return Reservation(self.server.budget, self.server.limits.retry_after_s, self.server.inflate_budget)

    def _not_found(self) -> None:
        self._send_json(404, {"error": f"no route {self.command} {self.path}"})

    def _discard(self) -> None:
        """A 404 for a request with a body: the body is read (within the budget) to keep the
        connection usable."""
        reservation = self._reservation()
        try:
            self._read_raw_body(reservation)
            self._not_found()
        except EdgekitError as exc:
            self._send_error(exc)
        finally:
            reservation.close()


def _read_token(path: Path) -> bytes:
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"server.auth_token_file {path}: {exc.strerror}; write the bearer token there") from None
    if len(token) < 16:
        raise ConfigError(f"server.auth_token_file {path} holds under 16 bytes: write a longer random token there")
    return token


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (``::ffff:127.0.0.1``)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def route(path: str) -> list[str]:
    path = path.split("?", 1)[0]
    parts = path.strip("/").split("/")
    return [unquote(p) for p in parts] if "%" in path else parts


_date_cache: tuple[int, str] = (0, "")
_date_lock = threading.Lock()


def _http_date() -> str:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        with _date_lock:
            _date_cache = (now, formatdate(now, usegmt=True))
    return _date_cache[1]
