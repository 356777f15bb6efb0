"""A small v2 (KServe / Triton REST) client for the tail: a pool of keep-alive connections,
tensors sent and asked for in the binary tensor data extension, a deadline per call.

Every failure is a ``TailError`` with a ``reason`` (the label of the fallback it causes):
``unreachable`` (connect / reset / closed), ``deadline`` (no answer in time), ``status`` (an
HTTP error answer), ``garbage`` (an answer that does not parse, or tensors that are not what the
model's signature says: names, dtypes, shapes, NaN / infinity).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from device_agents.config import SplitConfig
from edgekit.bundle.errors import EdgekitError
from edgekit.bundle.manifest import TensorSpec

_V2 = {"float32": "FP32", "float16": "FP16", "float64": "FP64", "int64": "INT64", "int32": "INT32", "uint8": "UINT8"}
_NP = {v: k for k, v in _V2.items()}
MAX_IDLE_CONNECTIONS = 8


class TailError(EdgekitError):
    """The tail did not answer well; ``reason`` is one of unreachable, deadline, status, garbage."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class TailClient:
    def __init__(self, config: SplitConfig) -> None:
        parts = urlsplit(config.tail_url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        self.base = parts.path.rstrip("/")
        self.headers: dict[str, str] = {}
        if config.auth_token_file is not None:
            token = config.auth_token_file.read_text().strip().splitlines()
            if not token:
                raise EdgekitError(f"split.auth_token_file {config.auth_token_file} is empty")
            self.headers["Authorization"] = f"Bearer {token[0].strip()}"
        self.context: ssl.SSLContext | None = None
        if self.https:
            self.context = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
            if config.client_cert_file is not None and config.client_key_file is not None:
                self.context.load_cert_chain(str(config.client_cert_file), str(config.client_key_file))
        self._local = threading.local()  # what this thread's last call did (``last_call_connected``)
        self._idle: list[http.client.HTTPConnection] = []
        self._pool_lock = threading.Lock()

    # -- calls --------------------------------------------------------------------------
    def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[TensorSpec], timeout_s: float
    ) -> tuple[dict[str, np.ndarray], int, int]:
        """The tail's outputs, checked against ``outputs`` (the full model's signature: the tail
        answers for it), and the bytes sent and received."""
        header: dict[str, Any] = {
            "inputs": [
                {
                    "name": name,
                    "shape": list(t.shape),
                    "datatype": _datatype(t),
                    "parameters": {"binary_data_size": int(t.nbytes)},
                }
                for name, t in inputs.items()
            ],
            "outputs": [{"name": s.name, "parameters": {"binary_data": True}} for s in outputs],
            "parameters": {"binary_data_output": True},
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        body = head + b"".join(np.ascontiguousarray(t).tobytes() for t in inputs.values())
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(head)),
            **self.headers,
        }
        status, reply, json_len = self._call("POST", f"{self.base}/v2/models/{model}/infer", body, headers, timeout_s)
        if status != 200:
            raise TailError(f"tail {model}: HTTP {status}: {reply[:200]!r}", "status")
        rows = next(iter(inputs.values())).shape[0] if inputs else 1
        return decode_outputs(reply, json_len, outputs, rows), len(body), len(reply)

    def probe(self, timeout_s: float) -> float:
        """Seconds for ``GET /v2/health/ready`` (a light round trip); TailError if not ready."""
        t0 = time.perf_counter()
        status, _, _ = self._call("GET", f"{self.base}/v2/health/ready", b"", dict(self.headers), timeout_s)
        if status != 200:
            raise TailError(f"tail not ready: HTTP {status}", "status")
        return time.perf_counter() - t0

    def last_call_connected(self) -> bool:
        """Whether this thread's last call opened its connection (its time includes the TCP and
        TLS handshakes: not a sample of the link's bandwidth)."""
        return bool(getattr(self._local, "fresh", False))

    def close(self) -> None:
        """Close the idle connections (one in use is closed by its call when it ends badly)."""
        with self._pool_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- plumbing -----------------------------------------------------------------------
    def _take(self, timeout_s: float) -> http.client.HTTPConnection:
        """An idle kept-alive connection, or a new one: requests come on many threads (one per
        client connection of the agent), and the link's TCP connections outlive them."""
        with self._pool_lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            if self.https:
                conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self.context)
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._pool_lock:
            if len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _call(
        self, method: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float
    ) -> tuple[int, bytes, int | None]:
        """One request; on a kept-alive connection the server closed meanwhile (it answers nothing:
        RemoteDisconnected, reset, broken pipe), once more on a fresh connection (v2 infer is
        idempotent)."""
        for attempt in (0, 1):
            conn = self._take(max(0.001, timeout_s))
            reused = conn.sock is not None
            self._local.fresh = not reused
            try:
                if not reused:
                    conn.connect()
                    _no_delay(conn)
                conn.request(method, path, body=body or None, headers=headers)
                response = conn.getresponse()
                reply = response.read()
                length = response.getheader("Inference-Header-Content-Length")
            except TimeoutError as exc:
                conn.close()  # a late answer must not be read as the next request's
                raise TailError(f"tail: no answer within {timeout_s * 1000:.0f} ms", "deadline") from exc
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                if not reused or attempt:
                    raise TailError(f"tail unreachable: {exc}", "unreachable") from exc
                continue
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise TailError(f"tail unreachable: {exc}", "unreachable") from exc
            if response.will_close:
                conn.close()
            else:
                self._give_back(conn)
            break
        try:
            json_len = int(length) if length is not None else None
        except ValueError as exc:
            raise TailError(f"tail: Inference-Header-Content-Length {length!r}", "garbage") from exc
        return response.status, reply, json_len


def _no_delay(conn: http.client.HTTPConnection) -> None:
    """TCP_NODELAY: a small request waits for no ACK (Nagle + delayed ACK add 40 ms)."""
    sock: socket.socket | None = conn.sock
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _datatype(t: np.ndarray) -> str:
    try:
        return _V2[str(t.dtype)]
    except KeyError as exc:
        raise TailError(f"cut tensor of dtype {t.dtype} has no v2 datatype here", "garbage") from exc


def decode_outputs(
    reply: bytes, json_len: int | None, outputs: Sequence[TensorSpec], rows: int
) -> dict[str, np.ndarray]:
    """The v2 response's tensors (binary or JSON data), checked: every output of the signature,
    its dtype, its shape (dynamic axes free, a leading dynamic axis = the request's rows), finite."""
    try:
        doc = json.loads(reply[:json_len] if json_len is not None else reply)
        binary = memoryview(reply)[json_len:] if json_len is not None else memoryview(b"")
        found: dict[str, np.ndarray] = {}
        offset = 0
        for out in doc["outputs"]:
            dtype = np.dtype(_NP[out["datatype"]])
            shape = tuple(int(d) for d in out["shape"])
            size = (out.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                value = np.frombuffer(binary[offset : offset + int(size)], dtype=dtype).reshape(shape)
                offset += int(size)
            else:
                value = np.asarray(out["data"], dtype=dtype).reshape(shape)
            found[str(out["name"])] = value
    except (ValueError, KeyError, TypeError) as exc:
        raise TailError(f"tail answered something that is not a v2 response ({exc})", "garbage") from exc
    checked = {}
    for spec in outputs:
        got = found.get(spec.name)
        if got is None:
            raise TailError(f"tail answered without output {spec.name!r} (it sent {sorted(found)})", "garbage")
        value = got
        if str(value.dtype) != spec.dtype:
            raise TailError(f"tail output {spec.name} is {value.dtype}, the model's is {spec.dtype}", "garbage")
        want = tuple(rows if k == 0 and not isinstance(d, int) else d for k, d in enumerate(spec.shape))
        if len(value.shape) != len(want) or any(
            isinstance(w, int) and w != g for w, g in zip(want, value.shape, strict=True)
        ):
            raise TailError(f"tail output {spec.name} has shape {list(value.shape)}, expected {list(want)}", "garbage")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise TailError(f"tail output {spec.name} holds NaN or infinity", "garbage")
        checked[spec.name] = value.copy()  # off the reply's buffer
    return checked
