"""A cascade member served by another v2 server (``[models.<name>.route] url``): the request as
the client sent it (tensors, and BYTES images as they came) goes to ``POST
{url}/v2/models/{member}/infer`` in the binary tensor extension, and the answer comes back as the
cascade's. Anything but a well-formed 200 within ``timeout_ms`` is an ``UnavailableError``, on
which the cascade keeps its earlier (local) answer.
"""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np

from device_agents.errors import UnavailableError
from device_agents.pipeline import Request
from device_agents.runtimes import ServedModel

T = TypeVar("T")

_NUMPY = {"FP32": "<f4", "FP16": "<f2", "FP64": "<f8", "INT64": "<i8", "INT32": "<i4", "INT16": "<i2", "INT8": "i1",
          "UINT8": "u1", "BOOL": "?"}  # fmt: skip
_V2 = {np.dtype(v).str: k for k, v in _NUMPY.items()}


class RemoteMember:
    """Member ``name`` of a cascade, asked at ``url``; ``local`` is the model whose signature the
    cascade serves (the request is decoded against it, and its answer encoded with it)."""

    def __init__(self, name: str, url: str, timeout_ms: float, local: Callable[[], ServedModel]) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must be http://HOST:PORT, got {url!r}")
        self.name = name
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.timeout_s = timeout_ms / 1000
        self._local = local

    def model(self, version: int | None = None) -> ServedModel:
        return self._local()

    def depth(self) -> tuple[int, int]:
        return (0, 0)

    def expected_s(self) -> float:
        return self.timeout_s  # the worst case: an unreachable server is given this long

    def infer(self, version: int | None, decode: Callable[[ServedModel], Request], encode: Callable[[Request], T]) -> T:
        model = self._local()
        request = decode(model)
        tensors = {**request.inputs, **request.raw}
        blobs = [_wire(v) for v in tensors.values()]
        inputs = [
            {"name": k, "datatype": _datatype(v), "shape": list(v.shape), "parameters": {"binary_data_size": len(b)}}
            for (k, v), b in zip(tensors.items(), blobs, strict=True)
        ]
        header = {"inputs": inputs, "parameters": {"binary_data_output": True}}
        head = json.dumps(header, separators=(",", ":")).encode()
        try:
            timeout_s = min(self.timeout_s, request.timeout_s or self.timeout_s)  # the client's own limit too
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
            try:
                conn.request(
                    "POST",
                    f"{self.base}/v2/models/{self.name}/infer",
                    body=head + b"".join(blobs),
                    headers={
                        "Content-Type": "application/octet-stream",
                        "Inference-Header-Content-Length": str(len(head)),
                    },
                )
                reply = conn.getresponse()
                body = reply.read()
                length = reply.getheader("Inference-Header-Content-Length")
            finally:
                conn.close()
        except OSError as exc:  # refused, reset, timed out
            raise UnavailableError(f"remote member {self.name}: {exc}", reason="remote") from exc
        if reply.status != 200:
            raise UnavailableError(f"remote member {self.name}: HTTP {reply.status}: {body[:200]!r}", reason="remote")
        try:
            doc, outputs = _decode_answer(body, None if length is None else int(length))
            request.served_version = int(doc.get("model_version", 0))
        except (ValueError, KeyError, TypeError) as exc:
            raise UnavailableError(f"remote member {self.name}: a malformed answer ({exc})", reason="remote") from exc
        request.model, request.outputs = model, outputs
        return encode(request)


def _datatype(arr: np.ndarray) -> str:
    if arr.dtype == object:
        return "BYTES"
    return _V2[arr.dtype.newbyteorder("<").str]


def _wire(arr: np.ndarray) -> bytes:
    if arr.dtype == object:
        return b"".join(len(v).to_bytes(4, "little") + bytes(v) for v in arr.ravel())
    return np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()


def _decode_answer(body: bytes, json_len: int | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    end = len(body) if json_len is None else json_len
    doc = json.loads(body[:end])
    offset, outputs = end, {}
    for item in doc["outputs"]:
        shape, datatype = [int(d) for d in item["shape"]], item["datatype"]
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is None:
            data = item["data"]
            arr = (
                np.array([v.encode() for v in data], dtype=object)
                if datatype == "BYTES"
                else np.asarray(data, _NUMPY[datatype])
            )
        elif datatype == "BYTES":
            arr, at = np.empty(math.prod(shape), dtype=object), offset
            for i in range(arr.size):
                n = int.from_bytes(body[at : at + 4], "little")
                arr[i], at = body[at + 4 : at + 4 + n], at + 4 + n
        else:
            wire = np.dtype(_NUMPY[datatype])
            arr = np.frombuffer(body, wire, math.prod(shape), offset).astype(wire.newbyteorder("="))
        if size is not None:
            offset += int(size)
        outputs[item["name"]] = arr.reshape(shape)
    return doc, outputs
