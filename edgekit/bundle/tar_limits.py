"""Bounded reading of a bundle's tar stream: every decompressed byte counted, every header capped.

A bundle is untrusted until its signature is checked, and its tar headers are never signed. Two
things keep an attacker's headers from costing more than a few MiB and a few milliseconds:

- ``BoundedReader`` sits between the gzip decompressor and ``tarfile``: ``tarfile`` sees only
  what it hands over, and it hands over no more than its ``limit`` (raised by the caller once a
  signed manifest says how much more is legitimately coming). Decompression itself is done by
  ``gzip.GzipFile``, which inflates no more than it is asked for (tarfile's own ``r|gz`` stream
  inflates whole input chunks at once, up to ~1000x their size).
- ``BundleTarInfo`` refuses an extended header (PAX ``x``, GNU long name ``L`` / long link ``K``)
  larger than ``MAX_EXTENDED_HEADER_BYTES`` from its 512-byte block, before tarfile reads its
  body, more than ``MAX_EXTENDED_HEADERS_PER_MEMBER`` of them in a row (tarfile chains them by
  recursion), and header kinds edgekit never writes (PAX global ``g``, GNU sparse ``S``, the
  Solaris ``X``). CPython < 3.11.10 parses PAX bodies in time quadratic in their length
  (CVE-2024-6232, python/cpython#121285): the cap bounds that too.

What a reader relies on from a header is its name, its type and its size; each is checked
against the signed manifest (``archive``). Everything else (mode, owner, times, extra PAX
keys) is ignored: files are written with the agent's own mode and no metadata.
"""

from __future__ import annotations

import gzip
import tarfile
from typing import BinaryIO

from edgekit.bundle.errors import BundleError

# An extended header holds one long member name (<= 1 KiB, archive.MAX_MEMBER_NAME_BYTES) plus a
# few short records. 4 KiB also bounds the quadratic PAX parsing of CPython < 3.11.10 (CVE-2024-6232).
MAX_EXTENDED_HEADER_BYTES = 4 * 1024
# edgekit writes at most one (PAX); other tars may put a GNU long name and a PAX header together.
MAX_EXTENDED_HEADERS_PER_MEMBER = 2
# Per member after the signature: its 512-byte header and its capped extended headers with theirs.
MEMBER_HEADER_SLACK_BYTES = (1 + MAX_EXTENDED_HEADERS_PER_MEMBER) * tarfile.BLOCKSIZE + (
    MAX_EXTENDED_HEADERS_PER_MEMBER * MAX_EXTENDED_HEADER_BYTES
)
# The end-of-archive blocks, record padding and tarfile's read-ahead of one record.
END_SLACK_BYTES = 2 * tarfile.RECORDSIZE + 2 * tarfile.BLOCKSIZE

_EXTENDED_TYPES = (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_REFUSED_TYPES = {
    tarfile.XGLTYPE: "a PAX global header",
    tarfile.SOLARIS_XHDTYPE: "a Solaris extended header",
    tarfile.GNUTYPE_SPARSE: "a GNU sparse file",
}


class BoundedReader:
    """A read-only file object over ``gzip.GzipFile(raw)`` that hands out at most ``limit`` bytes.

    ``consumed`` counts every decompressed byte handed to the reader above. Reading past
    ``limit`` raises ``BundleError`` naming ``phase`` (what the bytes were for)."""

    def __init__(self, raw: BinaryIO, limit: int, phase: str) -> None:
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")
        self.limit = limit
        self.phase = phase
        self.consumed = 0
        self.extended_run = 0  # extended headers read since the last member header

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self.limit - self.consumed + 1  # never an unbounded read: one byte over trips the check
        want = min(size, self.limit - self.consumed + 1)
        data = self._gz.read(want) if want > 0 else b""
        self.consumed += len(data)
        if self.consumed > self.limit:
            raise BundleError(
                f"bundle decompresses past {self.limit} bytes {self.phase}; refused "
                "(an oversized or forged tar header?); rebuild it with `edgekit package`"
            )
        return data

    def close(self) -> None:
        self._gz.close()


class BundleTarInfo(tarfile.TarInfo):
    """``TarInfo`` that checks each raw 512-byte header before tarfile acts on it.

    ``open_bounded`` makes a subclass per archive whose ``reader`` counts extended headers."""

    reader: BoundedReader | None = None

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> BundleTarInfo:
        info = super().frombuf(buf, encoding, errors)
        if info.type in _REFUSED_TYPES:
            raise BundleError(
                f"bundle holds {_REFUSED_TYPES[info.type]} (tar type {info.type!r}), "
                "which edgekit never writes; refused"
            )
        if info.type in _EXTENDED_TYPES and info.size > MAX_EXTENDED_HEADER_BYTES:
            raise BundleError(
                f"bundle has a {info.size}-byte extended tar header (type {info.type!r}), "
                f"over the {MAX_EXTENDED_HEADER_BYTES}-byte cap; refused"
            )
        if cls.reader is not None:
            cls.reader.extended_run = cls.reader.extended_run + 1 if info.type in _EXTENDED_TYPES else 0
            if cls.reader.extended_run > MAX_EXTENDED_HEADERS_PER_MEMBER:
                raise BundleError(
                    f"bundle has more than {MAX_EXTENDED_HEADERS_PER_MEMBER} extended tar headers "
                    "before one member; refused"
                )
        return info


def open_bounded(raw: BinaryIO, limit: int, phase: str) -> tuple[tarfile.TarFile, BoundedReader]:
    """A streaming tar reader over gzip'd ``raw`` and the ``BoundedReader`` beneath it."""
    reader = BoundedReader(raw, limit, phase)
    info_cls = type("BundleTarInfo", (BundleTarInfo,), {"reader": reader})
    tar = tarfile.open(fileobj=reader, mode="r|", tarinfo=info_cls)  # type: ignore[call-overload]  # typeshed wants IO[bytes]; tarfile only calls read()
    return tar, reader
