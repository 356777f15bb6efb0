"""The agent's HTTP API: Open Inference Protocol v2 (KServe / Triton REST), ``/metrics``, and
the loopback-only ``POST /edgekit/v1/install`` that ``edgekit-agent install`` hands bundles to.

Stdlib ``ThreadingHTTPServer`` with HTTP/1.1 keep-alive and TCP_NODELAY (without it, Nagle plus
delayed ACKs add 40+ ms per request). Each response is written with one ``send``.

v2 routes: ``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}[/versions/{v}]``,
``/v2/models/{name}[/versions/{v}]/ready``, ``POST /v2/models/{name}[/versions/{v}]/infer``.
Errors are ``{"error": "..."}`` with 400 (bad input), 404 (unknown model), 413 (body over
``max_request_mb``, refused before it is read) or 500 (the runtime failed; the server goes on).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
import zlib
from email.utils import formatdate
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from device_agents import __version__
from device_agents.manager import ModelManager
from device_agents.serving.codec import decode_request, encode_response, tensor_metadata
from device_agents.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from edgekit.bundle.codec import to_data
from edgekit.bundle.errors import EdgekitError, InferenceInputError, ModelNotFoundError

log = logging.getLogger("edgekit.agent.http")

EXTENSIONS = ("binary_tensor_data",)
_JSON = "application/json"
_BINARY = "application/octet-stream"
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class _RequestTooLarge(EdgekitError):
    http_status = 413


class _Forbidden(EdgekitError):
    http_status = 403


class _RuntimeFailure(EdgekitError):
    http_status = 500


class AgentServer(ThreadingHTTPServer):
    """One server per agent; ``serve_forever`` in a thread, ``shutdown`` from another."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, host: str, port: int, manager: ModelManager, *, max_request_bytes: int) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.manager = manager
        self.max_request_bytes = max_request_bytes
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), self.server_address[1]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"edgekit-agent/{__version__}"
    disable_nagle_algorithm = True  # sets TCP_NODELAY on every accepted socket
    server: AgentServer

    # -- plumbing -----------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def _send(
        self, code: int, body: bytes = b"", content_type: str = _JSON, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        head = [
            f"HTTP/1.1 {code} {_REASONS.get(code, '')}",
            f"Server: {self.server_version}",
            f"Date: {_http_date()}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
        ]
        head += [f"{k}: {v}" for k, v in headers]
        if self.close_connection:
            head.append("Connection: close")
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)

    def _send_json(self, code: int, doc: Any) -> None:
        self._send(code, json.dumps(doc, separators=(",", ":")).encode())

    def _send_error(self, exc: Exception) -> None:
        code = exc.http_status if isinstance(exc, EdgekitError) else 500
        self._send_json(code, {"error": str(exc)})

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise InferenceInputError("chunked request bodies are not supported; send Content-Length")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError as exc:
            self.close_connection = True
            raise InferenceInputError("Content-Length is not a number") from exc
        limit = self.server.max_request_bytes
        if length > limit or length < 0:
            self.close_connection = True  # the body stays unread
            raise _RequestTooLarge(f"request body of {length} bytes is over max_request_mb ({limit} bytes)")
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            raise InferenceInputError("the request body ended early")
        encoding = self.headers.get("Content-Encoding")
        if encoding in ("gzip", "deflate"):
            d = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
            try:
                body = d.decompress(body, limit + 1)
            except zlib.error as exc:
                raise InferenceInputError(f"request body is not valid {encoding} ({exc})") from exc
            if len(body) > limit:
                raise _RequestTooLarge(f"decompressed request body is over max_request_mb ({limit} bytes)")
        elif encoding not in (None, "identity"):
            raise InferenceInputError(f"Content-Encoding {encoding!r} is not supported (use gzip or deflate)")
        return body

    # -- dispatch -----------------------------------------------------------------------
    def do_GET(self) -> None:  # stdlib naming
        parts = _route(self.path)
        try:
            if parts == ["v2", "health", "live"]:
                self._send(200)
            elif parts == ["v2", "health", "ready"]:
                self._send(200 if self.server.manager.ready else 503)
            elif parts == ["v2"]:
                self._send_json(200, {"name": "edgekit-agent", "version": __version__, "extensions": list(EXTENSIONS)})
            elif parts == ["metrics"]:
                self._send(200, self.server.manager.metrics.exposition(), METRICS_CONTENT_TYPE)
            elif parts[:2] == ["v2", "models"] and len(parts) > 2:
                name, version, rest = _model_route(parts)
                if rest == []:
                    self._model_metadata(name, version)
                elif rest == ["ready"]:
                    self.server.manager.get(name, version)
                    self._send(200)
                else:
                    self._not_found()
            else:
                self._not_found()
        except EdgekitError as exc:
            self._send_error(exc)

    def do_POST(self) -> None:  # stdlib naming
        parts = _route(self.path)
        if parts[:2] == ["v2", "models"] and len(parts) > 3 and parts[-1] == "infer":
            self._infer(parts)
            return
        try:
            if parts == ["edgekit", "v1", "install"]:
                self._check_loopback()
                self._check_json()
                self._install(self._read_body())
            else:
                self._read_body()  # keep the connection usable
                self._not_found()
        except EdgekitError as exc:
            self._send_error(exc)

    def _not_found(self) -> None:
        self._send_json(404, {"error": f"no route {self.command} {self.path}"})

    def _check_loopback(self) -> None:
        if not is_loopback(self.client_address[0]):
            self.close_connection = True  # the body stays unread
            raise _Forbidden("this route answers only on loopback; run `edgekit-agent` on the device itself")

    # -- v2 -----------------------------------------------------------------------------
    def _model_metadata(self, name: str, version: int | None) -> None:
        model = self.server.manager.get(name, version)
        m = model.manifest
        self._send_json(
            200,
            {
                "name": name,
                "versions": [str(m.version)],
                "platform": m.compatibility.runtime,
                "inputs": [tensor_metadata(s) for s in model.inputs],
                "outputs": [tensor_metadata(s) for s in model.outputs],
            },
        )

    def _infer(self, parts: list[str]) -> None:
        start = time.perf_counter()
        manager = self.server.manager
        label = ""
        try:
            # The body first: a refused request whose body stays unread would be parsed as the next
            # request on this keep-alive connection (tritonclient reuses connections).
            body = self._read_body()
            name, version, rest = _model_route(parts)
            if rest != ["infer"]:
                raise ModelNotFoundError(f"no route POST {self.path}")
            with manager.lease(name, version) as lease:
                label = name
                model = lease.model
                hlen = self.headers.get("Inference-Header-Content-Length")
                request = decode_request(body, _header_length(hlen), model.inputs, model.outputs)
                try:
                    results = model.infer(request.inputs)
                except EdgekitError:
                    raise
                except Exception as exc:  # runtime SDK errors have no common base
                    log.error("%s v%d failed to run: %s: %s", name, lease.version, type(exc).__name__, exc)
                    manager.count_failure(name, lease.version, request.inputs)
                    raise _RuntimeFailure(f"model {name} v{lease.version} failed to run: {exc}") from exc
                out, json_len = encode_response(name, lease.version, request, results, model.outputs)
            if json_len is None:
                self._send(200, out)
            else:
                self._send(200, out, _BINARY, (("Inference-Header-Content-Length", str(json_len)),))
            code = 200
        except EdgekitError as exc:
            self._send_error(exc)
            code = exc.http_status
        manager.metrics.observe_request(label, code, time.perf_counter() - start)

    # -- edgekit/v1 ---------------------------------------------------------------------
    def _check_json(self) -> None:
        """A web page open on the device can POST to loopback, but only as a "simple" request
        (form or text/plain): requiring application/json forces a CORS preflight, never answered."""
        if self.headers.get_content_type() != _JSON:
            self.close_connection = True  # the body stays unread
            raise _Forbidden("install takes Content-Type: application/json")

    def _install(self, body: bytes) -> None:
        try:
            doc = json.loads(body)
            bundle = Path(doc["bundle"])
            origin = str(doc.get("origin", "cli"))
        except (ValueError, KeyError, TypeError) as exc:
            raise InferenceInputError('install takes {"bundle": "/absolute/path.ekb"}') from exc
        try:
            result = self.server.manager.install(bundle, origin=origin)
        except EdgekitError as exc:
            self._send_json(400, {"error": str(exc), "error_type": type(exc).__name__, "exit_code": exc.exit_code})
            return
        self._send_json(200, to_data(result))


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (``::ffff:127.0.0.1``)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def _route(path: str) -> list[str]:
    path = path.split("?", 1)[0]
    return [unquote(p) for p in path.strip("/").split("/")]


def _model_route(parts: list[str]) -> tuple[str, int | None, list[str]]:
    """``["v2", "models", name, ("versions", v), *rest]`` -> (name, version, rest)."""
    name, rest = parts[2], parts[3:]
    if rest[:1] == ["versions"] and len(rest) >= 2:
        v = rest[1]
        if not v.isdigit():
            raise ModelNotFoundError(f"model {name!r} has no version {v!r} (versions are integers)")
        return name, int(v), rest[2:]
    return name, None, rest


def _header_length(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise InferenceInputError(f"Inference-Header-Content-Length {value!r} is not a number") from exc


_date_cache: tuple[int, str] = (0, "")
_date_lock = threading.Lock()


def _http_date() -> str:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        with _date_lock:
            _date_cache = (now, formatdate(now, usegmt=True))
    return _date_cache[1]
