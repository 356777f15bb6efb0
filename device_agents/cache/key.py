"""Exact result-cache keys: what makes two requests the same question to the same model.

A key is, in order: the served name, the model's name, version and artifact digest (the sha256 of
its artifact files, from the signed manifest), every input's name, dtype, shape and byte count
(sorted by name), the request parameters that can change the answer, and then every input's
bytes after decoding (C order, little-endian; so a JSON and a binary request of one tensor are one
key, and the same bytes under another shape are another). The index is the xxh3-128 of all of it;
the whole key is stored with the entry and compared byte for byte on a hit, so a hash collision
is a miss, never another request's answer.

The xxh3-128 of a 1.2 MB input costs more than the rest of a miss; a stream of inputs that never
repeat should not pay it. So a key also has a *sketch*: the xxh3-64 of the header and a sample of
each input (its first and last 64 bytes and ``SKETCH_WORDS`` 8-byte words spread over the rest;
all of an input up to ``SKETCH_ALL_BYTES``). Inputs with different sketches differ; inputs with the
same sketch may still differ (they are compared by the full index and key). The cache remembers
the sketches of what it holds, so a miss whose sketch it never saw is known without the full hash
(``CacheKey.digest`` is computed when first read).

Parameters: every v2 request parameter is part of the key except those that only say how to
carry or schedule the request (``IGNORED_PARAMETERS``): an unknown parameter may change the
answer, so it keys. Requested outputs key by name (their binary/JSON choice does not).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import xxhash

from device_agents.cache.tensors import UncacheableError, little_endian
from edgekit.bundle.manifest import Manifest

# Request parameters that never change an answer: transport (binary data), scheduling (priority,
# deadlines, timeouts) and the cache's own switch.
IGNORED_PARAMETERS = frozenset(
    {
        "cache",
        "binary_data_output",
        "binary_data_size",
        "timeout",
        "timeout_ms",
        "deadline_ms",
        "priority",
        "droppable",
        "sequence_id",
        "headers",
    }
)


def artifact_digest(manifest: Manifest) -> str:
    """sha256 over the artifact files' paths and sha256s (as the signed manifest lists them)."""
    h = hashlib.sha256()
    for f in sorted(manifest.artifact_files(), key=lambda f: f.path):
        h.update(f"{f.path}\0{f.sha256}\n".encode())
    return h.hexdigest()


_HEADERS_KEPT = 64  # KeyMaker's built headers (distinct shapes and parameters) before it starts again
SKETCH_WORDS = 256  # 8-byte words sampled from each input besides its first and last 64 bytes
SKETCH_ALL_BYTES = 4096  # an input up to this size is sketched whole


class CacheKey:
    """One request's key: ``digest`` (xxh3-128, the index; computed when first read), ``sketch``
    (xxh3-64 of the header and a sample of the bytes), ``header`` (everything but the tensor bytes)
    and ``buffers`` (each input's bytes, no copy). ``full()`` builds the stored form;
    ``matches(stored)`` compares without building it."""

    __slots__ = ("_digest", "_sketch", "buffers", "header", "nbytes")

    def __init__(
        self, digest: bytes | None, header: bytes, buffers: tuple[memoryview, ...], sketch: int | None = None
    ) -> None:
        self._digest = digest
        self._sketch = sketch
        self.header = header
        self.buffers = buffers
        self.nbytes = len(header) + sum(b.nbytes for b in buffers)

    @property
    def hashed(self) -> bool:
        """Whether ``digest`` was computed (a miss told by its sketch never is)."""
        return self._digest is not None

    @property
    def digest(self) -> bytes:
        digest = self._digest
        if digest is None:
            # each tensor hashed in one call (its streaming update is ~20% slower), then the header and those
            parts = [self.header, *(xxhash.xxh3_128_digest(b) for b in self.buffers)]
            digest = self._digest = xxhash.xxh3_128_digest(b"".join(parts))
        return digest

    @property
    def sketch(self) -> int:
        sketch = self._sketch
        if sketch is None:
            sketch = self._sketch = xxhash.xxh3_64_intdigest(b"".join([self.header, *map(_sample, self.buffers)]))
        return sketch

    def full(self) -> bytes:
        return b"".join((self.header, *self.buffers))

    def matches(self, stored: bytes | bytearray) -> bool:
        """True if ``stored`` is this key's ``full()``, byte for byte (memcmp, no copy)."""
        if len(stored) != self.nbytes or not stored.startswith(self.header):
            return False
        pos = len(self.header)
        for buf in self.buffers:
            if not stored.startswith(buf, pos):
                return False
            pos += buf.nbytes
        return True


class KeyMaker:
    """Builds the keys of one served name and model version (the model's part is built once)."""

    __slots__ = ("_headers", "model", "prefix", "version")

    def __init__(self, endpoint: str, model: str, version: int, digest: str) -> None:
        self.model = model
        self.version = version
        self.prefix = [endpoint, model, version, digest]
        # headers already built, by (inputs' names, dtypes, shapes, sizes; asked outputs; parameters):
        # a stream of one shape serialises its header once, not per request
        self._headers: dict[tuple[Any, ...], bytes] = {}

    @classmethod
    def for_model(cls, endpoint: str, manifest: Manifest) -> KeyMaker:
        """The keys of ``manifest``'s model served as ``endpoint``."""
        return cls(endpoint, manifest.name, manifest.version, artifact_digest(manifest))

    def key(
        self,
        inputs: Mapping[str, np.ndarray],
        requested_outputs: Iterable[str] | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> CacheKey:
        """The key of a request (``UncacheableError`` for an input that is not plain bytes or
        parameters that are not JSON)."""
        described: list[tuple[str, str, list[int], int]] = []  # (a JSON array, as a list would be)
        buffers = []
        for name in sorted(inputs):
            dtype, shape, buf = _tensor_bytes(name, inputs[name])
            described.append((name, dtype, shape, buf.nbytes))
            buffers.append(buf)
        asked = None if requested_outputs is None else sorted(set(requested_outputs))
        params = {k: v for k, v in (parameters or {}).items() if k not in IGNORED_PARAMETERS}
        plain = all(isinstance(v, str | int | float | bool) or v is None for v in params.values())
        memo: tuple[Any, ...] | None = (
            (tuple((n, d, tuple(sh), b) for n, d, sh, b in described), None if asked is None else tuple(asked),
             tuple(sorted((k, type(v).__name__, v) for k, v in params.items())))  # True == 1 == 1.0, not in JSON
            if plain
            else None
        )  # fmt: skip
        raw_header = None if memo is None else self._headers.get(memo)
        if raw_header is None:
            try:
                header = json.dumps([self.prefix, described, asked, params], separators=(",", ":"), sort_keys=True)
            except (TypeError, ValueError) as exc:
                raise UncacheableError(f"request parameters are not plain JSON: {exc}") from exc
            raw_header = header.encode()
            if memo is not None:
                if len(self._headers) >= _HEADERS_KEPT:
                    self._headers.clear()
                self._headers[memo] = raw_header
        return CacheKey(None, raw_header, tuple(buffers))


def _sample(buf: memoryview) -> bytes | memoryview:
    """What the sketch reads of one input: all of a small one; else its first and last 64 bytes
    and ``SKETCH_WORDS`` 8-byte words at an even stride (a new camera frame differs in most of them)."""
    n = buf.nbytes
    if n <= SKETCH_ALL_BYTES:
        return buf
    words = np.frombuffer(buf, np.uint64, count=n // 8)
    return b"".join((buf[:64], words[:: max(1, len(words) // SKETCH_WORDS)].tobytes(), buf[n - 64 :]))


def _tensor_bytes(name: str, value: Any) -> tuple[str, list[int], memoryview]:
    """(dtype string, shape, bytes) of one input: numbers as their little-endian C-order bytes;
    BYTES tensors (e.g. encoded images before pre-processing) as length-prefixed items."""
    arr = np.asarray(value)
    if arr.dtype.kind in "biufc":
        arr = little_endian(arr)
        return arr.dtype.str, list(arr.shape), arr.reshape(-1).data.cast("B")
    if arr.dtype.kind in "OSU":
        items = []
        for item in arr.ravel():
            raw = item if isinstance(item, bytes) else item.encode() if isinstance(item, str) else None
            if raw is None:
                raise UncacheableError(f"input {name!r} holds a {type(item).__name__}, not bytes")
            items += [len(raw).to_bytes(8, "little"), raw]
        return "BYTES", list(arr.shape), memoryview(b"".join(items))
    raise UncacheableError(f"input {name!r} has dtype {arr.dtype}; it cannot be a cache key")
