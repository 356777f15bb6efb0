"""Output tensors as bytes and back, without pickle: a small header, then each tensor's raw bytes.

    b"EKT1" u32 count, then per tensor:
        u16 name length, name (UTF-8), u8 dtype length, dtype (numpy's ``str``, e.g. ``<f4``),
        u8 ndim, ndim x u64 dims, u64 byte count, the bytes (C order, little-endian)

A v2 BYTES tensor (an object array of ``bytes`` or ``str``, or a numpy ``S``/``U`` array: labels,
text) has the dtype ``BYTES`` and, as its bytes, each item's u64 length and then the item (``str``
as UTF-8); it decodes to a read-only object array of ``bytes``, which the front-ends send as they
send any BYTES output.

Decoding reads nothing but this layout: numeric arrays are views on the blob (read-only, no copy),
and a blob that does not parse exactly (a short read, a stray byte, a dtype that is neither plain
numbers nor ``BYTES``) is a ``CacheFormatError``, never an object built from the data (no pickle:
a BYTES item is only ever a ``bytes`` object). An object array holding anything but ``bytes`` and
``str`` is not stored: ``UncacheableError``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgekit.bundle.errors import EdgekitError

MAGIC = b"EKT1"
_COUNT = struct.Struct("<I")
_U16 = struct.Struct("<H")
_U8 = struct.Struct("<B")
_U64 = struct.Struct("<Q")
_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex: plain bytes, nothing else
_TEXT_KINDS = frozenset("OSU")  # object (bytes/str items), bytes, str: stored as BYTES
BYTES = "BYTES"


class CacheFormatError(EdgekitError):
    """A stored entry does not parse: the entry is dropped and the request runs the model."""


class UncacheableError(EdgekitError):
    """A tensor the cache cannot store as plain bytes (an object array): the request is not cached."""


def little_endian(arr: np.ndarray) -> np.ndarray:
    """``arr`` C-contiguous and little-endian (the bytes a key hashes and an entry stores)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def encode_tensors(tensors: Mapping[str, np.ndarray]) -> bytes:
    """``tensors`` as one blob (``UncacheableError`` for an object array of other things than
    ``bytes`` and ``str``, or a dtype that is neither numbers nor text)."""
    parts: list[Any] = [MAGIC, _COUNT.pack(len(tensors))]
    for name, value in tensors.items():
        arr = np.asarray(value)
        raw_name = name.encode()
        if arr.dtype.kind in _TEXT_KINDS:
            items = _text_items(name, arr)
            dtype = BYTES.encode()
            size = sum(8 + len(item) for item in items)
            parts += [_U16.pack(len(raw_name)), raw_name, _U8.pack(len(dtype)), dtype, _U8.pack(arr.ndim)]
            parts += [_U64.pack(d) for d in arr.shape]
            parts.append(_U64.pack(size))
            for item in items:
                parts += [_U64.pack(len(item)), item]
            continue
        if arr.dtype.kind not in _KINDS:
            raise UncacheableError(f"output {name!r} has dtype {arr.dtype}; only numeric and BYTES tensors are cached")
        arr = little_endian(arr)
        dtype = arr.dtype.str.encode()
        parts += [_U16.pack(len(raw_name)), raw_name, _U8.pack(len(dtype)), dtype, _U8.pack(arr.ndim)]
        parts += [_U64.pack(d) for d in arr.shape]
        parts += [_U64.pack(arr.nbytes), arr.reshape(-1).data.cast("B")]
    return b"".join(parts)


def _text_items(name: str, arr: np.ndarray) -> list[bytes]:
    items = []
    for item in arr.ravel():
        if isinstance(item, bytes | np.bytes_):
            items.append(bytes(item))
        elif isinstance(item, str | np.str_):
            items.append(str(item).encode())
        else:
            raise UncacheableError(f"output {name!r} holds a {type(item).__name__}; BYTES items are bytes or str")
    return items


def _decode_text(blob: bytes, pos: int, end: int, shape: tuple[int, ...], count: int, name: str) -> np.ndarray:
    """The ``count`` BYTES items in ``blob[pos:end]`` as a read-only object array of ``shape``."""
    out = np.empty(count, dtype=object)
    for i in range(count):
        (n,) = _U64.unpack_from(blob, pos)
        pos += 8
        if pos + n > end:
            raise CacheFormatError(f"cached tensor {name!r}: a BYTES item runs past its tensor")
        out[i] = blob[pos : pos + n]
        pos += n
    if pos != end:
        raise CacheFormatError(f"cached tensor {name!r}: {end - pos} bytes after its {count} BYTES items")
    arr = out.reshape(shape)
    arr.flags.writeable = False
    return arr


def decode_tensors(blob: bytes) -> dict[str, np.ndarray]:
    """The tensors of ``encode_tensors(...)``, as read-only views on ``blob``."""
    try:
        if blob[:4] != MAGIC:
            raise CacheFormatError("not a cached result (bad magic)")
        (count,) = _COUNT.unpack_from(blob, 4)
        pos = 8
        out: dict[str, np.ndarray] = {}
        for _ in range(count):
            (n,) = _U16.unpack_from(blob, pos)
            name = blob[pos + 2 : pos + 2 + n].decode()
            pos += 2 + n
            (n,) = _U8.unpack_from(blob, pos)
            dtype_name = blob[pos + 1 : pos + 1 + n].decode()
            dtype = None if dtype_name == BYTES else np.dtype(dtype_name)
            pos += 1 + n
            if dtype is not None and (dtype.kind not in _KINDS or dtype.byteorder == ">"):
                raise CacheFormatError(f"cached tensor {name!r} has dtype {dtype}")
            (ndim,) = _U8.unpack_from(blob, pos)
            shape = struct.unpack_from(f"<{ndim}Q", blob, pos + 1)
            pos += 1 + 8 * ndim
            (nbytes,) = _U64.unpack_from(blob, pos)
            pos += 8
            count_items = 1
            for d in shape:
                count_items *= d
            if dtype is None:
                if pos + nbytes > len(blob) or nbytes < 8 * count_items:
                    raise CacheFormatError(f"cached tensor {name!r}: {nbytes} bytes cannot hold {count_items} items")
                out[name] = _decode_text(blob, pos, pos + nbytes, shape, count_items, name)
                pos += nbytes
                continue
            if nbytes != count_items * dtype.itemsize or pos + nbytes > len(blob):
                raise CacheFormatError(f"cached tensor {name!r}: {nbytes} bytes do not fit shape {list(shape)}")
            if count_items:
                arr = np.frombuffer(blob, dtype=dtype, count=count_items, offset=pos).reshape(shape)
            else:  # frombuffer refuses an offset at the very end
                arr = np.empty(shape, dtype=dtype)
            pos += nbytes
            out[name] = arr
        if pos != len(blob):
            raise CacheFormatError(f"cached result has {len(blob) - pos} stray bytes")
        return out
    except (struct.error, UnicodeDecodeError, TypeError, ValueError) as exc:
        raise CacheFormatError(f"cached result does not parse: {exc}") from exc
