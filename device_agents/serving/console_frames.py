"""The serial console's wire format: COBS-framed, checksummed, sequenced messages.

One frame on the wire is ``COBS(body) 0x00``; ``body`` is::

    version u8 | type u8 | seq u32 | ack u32 | payload ... | crc32 u32     (big-endian)

``version`` is ``VERSION`` (a frame of another version is refused, never guessed at); ``type`` a
``MessageType``; ``seq`` counts the sender's frames (1, 2, ...); ``ack`` is the ``seq`` of the
request a reply answers (0 in requests); the CRC32 (zlib's) covers every byte before it.

A serial line loses, flips and repeats bytes. ``FrameReader`` takes bytes as they arrive and
hands back frames and typed errors in stream order: a frame whose COBS coding, length or CRC is
wrong, or whose ``seq`` is not above the last one accepted (a replayed or duplicated frame), is
one ``FrameError`` and nothing more: the reader re-synchronises at the next 0x00, so the frame
after it is read as usual. ``HELLO`` starts a new session and resets the sequence: the console
is an interface for whoever holds the wire (it can do what the loopback API can), and the
sequence check guards against stale and duplicated frames, not against an attacker on the line.

A message's payload is a JSON object and, for tensors and bundle chunks, raw bytes after it::

    json_length u32 | JSON (UTF-8) | blob

Tensors travel as an Open Inference Protocol v2 binary body in the blob (no pickle).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from edgekit.bundle.errors import EdgekitError, MissingSDKError

try:
    from cobs import cobs
except ImportError as exc:  # an optional extra: PyPI has no cobs wheel for every device architecture
    raise MissingSDKError("cobs", "agent-console", "the serial console ([console] in agent.toml)") from exc

VERSION = 1
DELIMITER = b"\x00"
_HEADER = struct.Struct(">BBII")
_CRC = struct.Struct(">I")
_JSON_LENGTH = struct.Struct(">I")
MIN_BODY_BYTES = _HEADER.size + _CRC.size
# A frame's body (before COBS) is at most this long: a bundle travels in chunks well under it.
MAX_BODY_BYTES = 1 << 20
MAX_SEQ = 2**32 - 1


class MessageType(IntEnum):
    HELLO = 1  # host -> agent: a new session (resets the sequence); answered with the agent's version
    STATUS = 2
    STATS = 3
    INFER = 4  # {"model", "version"?, "header_length"?} + a v2 request body
    INSTALL_BEGIN = 5  # {"sha256", "size_bytes"} -> {"offset": bytes already received}
    INSTALL_CHUNK = 6  # {"sha256", "offset"} + bytes -> {"offset": bytes received}
    INSTALL_COMMIT = 7  # {"sha256"} -> the install result
    LOGS = 8  # {"lines"?} -> {"lines": [...]}
    RESTART = 9  # the agent stops cleanly (its supervisor starts it again)
    RESULT = 0x80  # agent -> host: the answer to ``ack``
    ERROR = 0x81  # agent -> host: {"error", "error_type", "retry_after_s"?} answering ``ack``


class FrameError(EdgekitError):
    """A frame that was dropped; the stream goes on at the next 0x00 delimiter."""


class CorruptFrameError(FrameError):
    """The COBS coding or the CRC32 is wrong: bytes were flipped or lost on the line."""


class TruncatedFrameError(FrameError):
    """Fewer bytes than a header and a CRC: the frame was cut short."""


class FrameTooLargeError(FrameError):
    """More than ``MAX_BODY_BYTES`` without a delimiter: skipped up to the next 0x00."""


class UnsupportedVersionError(FrameError):
    """The frame's version byte is not this side's ``VERSION``: upgrade the older side."""


class UnknownMessageError(FrameError):
    """The frame's type byte is no ``MessageType``."""


class ReplayedFrameError(FrameError):
    """The frame's sequence number is not above the last one accepted (a stale or repeated frame)."""


class MessageFormatError(FrameError):
    """The payload is not ``json_length | JSON object | blob``."""


@dataclass(frozen=True)
class Frame:
    type: MessageType
    seq: int
    ack: int = 0
    payload: bytes = b""


def encode_body(frame: Frame) -> bytes:
    """The unframed body of ``frame``: header, payload, CRC32."""
    if not 0 <= frame.seq <= MAX_SEQ or not 0 <= frame.ack <= MAX_SEQ:
        raise ValueError(f"seq and ack must be 0..{MAX_SEQ}, got {frame.seq} and {frame.ack}")
    body = _HEADER.pack(VERSION, int(frame.type), frame.seq, frame.ack) + frame.payload
    if len(body) + _CRC.size > MAX_BODY_BYTES:
        raise FrameTooLargeError(
            f"a {len(body) + _CRC.size}-byte frame is over the {MAX_BODY_BYTES}-byte limit; send it in chunks"
        )
    return body + _CRC.pack(zlib.crc32(body))


def encode_frame(frame: Frame) -> bytes:
    """``frame`` as it goes on the wire: COBS-coded, then the 0x00 delimiter."""
    return bytes(cobs.encode(encode_body(frame))) + DELIMITER


def decode_body(body: bytes) -> Frame:
    """The frame in an unframed ``body`` (version, type and CRC checked; not the sequence)."""
    if len(body) < MIN_BODY_BYTES:
        raise TruncatedFrameError(f"a frame of {len(body)} bytes is shorter than the {MIN_BODY_BYTES}-byte minimum")
    (crc,) = _CRC.unpack_from(body, len(body) - _CRC.size)
    if zlib.crc32(body[: -_CRC.size]) != crc:
        raise CorruptFrameError(f"CRC32 mismatch in a {len(body)}-byte frame: dropped")
    version, kind, seq, ack = _HEADER.unpack_from(body)
    if version != VERSION:
        raise UnsupportedVersionError(
            f"frame version {version}, this side speaks {VERSION}: run the same edgekit version on host and device"
        )
    try:
        message_type = MessageType(kind)
    except ValueError:
        raise UnknownMessageError(f"unknown message type 0x{kind:02x}") from None
    return Frame(message_type, seq, ack, bytes(body[_HEADER.size : -_CRC.size]))


class FrameReader:
    """Bytes in, frames and errors out, in stream order (one reader per direction of a session).

    ``feed`` returns a list of ``Frame`` and ``FrameError`` items: an error stands for one dropped
    frame (or stretch of bytes up to a delimiter); the frames after it are read as usual.
    """

    def __init__(self, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_body_bytes = max_body_bytes
        self.last_seq = 0  # the sequence number of the last frame accepted
        self._buffer = bytearray()
        self._skipping = False  # discarding an oversized stretch up to the next delimiter

    def reset(self) -> None:
        """Forget the sequence (a new session) and any partial frame."""
        self.last_seq = 0
        self._buffer.clear()
        self._skipping = False

    def feed(self, data: bytes) -> list[Frame | FrameError]:
        out: list[Frame | FrameError] = []
        start = 0
        while True:
            end = data.find(DELIMITER, start)
            if end < 0:
                self._hold(data[start:], out)
                return out
            if self._skipping:
                self._skipping = False
                self._buffer.clear()
            else:
                self._buffer += data[start:end]
                if self._buffer:  # empty stretches (repeated delimiters, line idle noise) are no frame
                    out.append(self._decode(bytes(self._buffer)))
                self._buffer.clear()
            start = end + 1

    def _hold(self, tail: bytes, out: list[Frame | FrameError]) -> None:
        if self._skipping:
            return
        self._buffer += tail
        # COBS adds one byte in 254, plus one: a longer stretch cannot be a frame we accept
        if len(self._buffer) > self.max_body_bytes + self.max_body_bytes // 254 + 2:
            out.append(FrameTooLargeError(f"over {self.max_body_bytes} bytes without a frame delimiter: skipped"))
            self._buffer.clear()
            self._skipping = True

    def _decode(self, coded: bytes) -> Frame | FrameError:
        try:
            body = cobs.decode(coded)
        except cobs.DecodeError as exc:
            return CorruptFrameError(f"bad COBS coding ({exc}): dropped")
        try:
            frame = decode_body(body)
        except FrameError as exc:
            return exc
        if frame.type is MessageType.HELLO:
            self.last_seq = frame.seq  # a new session starts its own count
            return frame
        if frame.seq <= self.last_seq:
            return ReplayedFrameError(
                f"frame seq {frame.seq} is not above the last accepted ({self.last_seq}): a replayed or repeated "
                "frame, dropped"
            )
        self.last_seq = frame.seq
        return frame


class FrameWriter:
    """Numbers outgoing frames (1, 2, ...) and encodes them for the wire."""

    def __init__(self) -> None:
        self.seq = 0

    def frame(self, message_type: MessageType, payload: bytes = b"", ack: int = 0) -> tuple[Frame, bytes]:
        if self.seq >= MAX_SEQ:
            self.seq = 0  # the peer sees HELLO before the count could wrap in practice; keep it defined
        self.seq += 1
        frame = Frame(message_type, self.seq, ack, payload)
        return frame, encode_frame(frame)


def pack_message(doc: dict[str, Any], blob: bytes = b"") -> bytes:
    """A payload: the JSON object ``doc`` and, after it, raw ``blob`` bytes."""
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return _JSON_LENGTH.pack(len(text)) + text + blob


def unpack_message(payload: bytes) -> tuple[dict[str, Any], bytes]:
    """``(doc, blob)`` from a payload; ``MessageFormatError`` if it is not one."""
    if len(payload) < _JSON_LENGTH.size:
        raise MessageFormatError(f"a {len(payload)}-byte payload has no JSON length")
    (length,) = _JSON_LENGTH.unpack_from(payload)
    end = _JSON_LENGTH.size + length
    if end > len(payload):
        raise MessageFormatError(f"JSON length {length} is past the {len(payload)}-byte payload")
    try:
        doc = json.loads(payload[_JSON_LENGTH.size : end])
    except (UnicodeDecodeError, ValueError) as exc:
        raise MessageFormatError(f"the message is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise MessageFormatError(f"a message is a JSON object, got {type(doc).__name__}")
    return doc, payload[end:]
