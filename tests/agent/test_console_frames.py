"""The console's framing: COBS + CRC32 + sequence numbers, checked with random damage to the stream.

Each property test runs a few hundred seeded random cases: every intact frame after a damaged one
must come through unchanged, and every damaged one must come out as a typed ``FrameError``.
"""

from __future__ import annotations

import random
import struct
import zlib

import pytest
from cobs import cobs

from device_agents.serving.console_frames import (
    MAX_BODY_BYTES,
    CorruptFrameError,
    Frame,
    FrameError,
    FrameReader,
    FrameTooLargeError,
    FrameWriter,
    MessageFormatError,
    MessageType,
    ReplayedFrameError,
    TruncatedFrameError,
    UnknownMessageError,
    UnsupportedVersionError,
    encode_body,
    encode_frame,
    pack_message,
    unpack_message,
)

CASES = 300


def _frames(rng: random.Random, count: int) -> list[tuple[Frame, bytes]]:
    writer = FrameWriter()
    out = []
    for _ in range(count):
        payload = rng.randbytes(rng.choice([0, 1, 7, 253, 254, 255, 600]))  # around COBS's 254-byte blocks
        out.append(writer.frame(rng.choice(list(MessageType)[1:]), payload, ack=rng.randrange(0, 10)))
    return out


def _frames_only(items: list[Frame | FrameError]) -> list[Frame]:
    return [i for i in items if isinstance(i, Frame)]


def test_frame_reader_returns_frames_as_sent_when_fed_in_random_pieces() -> None:
    rng = random.Random(1)
    for _ in range(CASES // 3):
        sent = _frames(rng, 5)
        wire = b"".join(w for _, w in sent)
        reader = FrameReader()
        got: list[Frame | FrameError] = []
        i = 0
        while i < len(wire):
            step = rng.randint(1, 64)
            got += reader.feed(wire[i : i + step])
            i += step
        assert got == [f for f, _ in sent]


def test_frame_reader_drops_a_corrupted_frame_and_keeps_the_next() -> None:
    rng = random.Random(2)
    for _ in range(CASES):
        (a, wa), (b, wb), (c, wc) = _frames(rng, 3)
        damaged = bytearray(wb)
        pos = rng.randrange(0, len(damaged) - 1)  # not the delimiter: that case merges frames (below)
        damaged[pos] ^= rng.randint(1, 255)
        got = FrameReader().feed(wa + bytes(damaged) + wc)
        frames = _frames_only(got)
        assert frames[0] == a and frames[-1] == c, got
        assert b not in frames
        errors = [g for g in got if isinstance(g, FrameError)]
        assert errors and all(isinstance(e, (CorruptFrameError, TruncatedFrameError)) for e in errors), got


def test_frame_reader_resynchronises_when_a_delimiter_is_lost() -> None:
    rng = random.Random(3)
    for _ in range(CASES):
        (a, wa), (_b, wb), (_c, wc), (d, wd) = _frames(rng, 4)
        got = FrameReader().feed(wa + wb[:-1] + wc + wd)  # b's 0x00 lost: b and c arrive as one stretch
        assert _frames_only(got) == [a, d]
        assert len([g for g in got if isinstance(g, FrameError)]) == 1


def test_frame_reader_rejects_truncated_frames_as_typed_errors() -> None:
    rng = random.Random(4)
    for _ in range(CASES):
        (_a, wa), (b, wb) = _frames(rng, 2)
        cut = wa[: rng.randrange(0, len(wa) - 1)] + b"\x00"  # a's tail lost, the line idles (a delimiter)
        got = FrameReader().feed(cut + wb)
        assert _frames_only(got) == [b]
        if len(cut) > 1:
            assert isinstance(got[0], (CorruptFrameError, TruncatedFrameError)), got


def test_frame_reader_rejects_a_replayed_frame_by_its_sequence_number() -> None:
    rng = random.Random(5)
    for _ in range(CASES // 3):
        sent = _frames(rng, 6)
        k = rng.randrange(0, 5)
        replayed = sent[k][1]
        reader = FrameReader()
        got = reader.feed(b"".join(w for _, w in sent[: k + 2]) + replayed + b"".join(w for _, w in sent[k + 2 :]))
        assert _frames_only(got) == [f for f, _ in sent]
        (error,) = [g for g in got if isinstance(g, FrameError)]
        assert isinstance(error, ReplayedFrameError)


def test_frame_reader_hello_starts_a_new_sequence() -> None:
    old, new = FrameWriter(), FrameWriter()
    reader = FrameReader()
    for _ in range(3):
        reader.feed(old.frame(MessageType.STATUS)[1])
    hello, wire = new.frame(MessageType.HELLO)
    status, wire2 = new.frame(MessageType.STATUS)
    assert reader.feed(wire + wire2) == [hello, status]


def test_frame_reader_refuses_other_versions_and_unknown_types() -> None:
    body = bytearray(encode_body(Frame(MessageType.STATUS, 1)))
    body[0] = 9
    body[-4:] = struct.pack(">I", zlib.crc32(bytes(body[:-4])))
    (error,) = FrameReader().feed(cobs.encode(bytes(body)) + b"\x00")
    assert isinstance(error, UnsupportedVersionError)
    body[0], body[1] = 1, 0x42
    body[-4:] = struct.pack(">I", zlib.crc32(bytes(body[:-4])))
    (error,) = FrameReader().feed(cobs.encode(bytes(body)) + b"\x00")
    assert isinstance(error, UnknownMessageError)


def test_frame_reader_skips_an_oversized_stretch_up_to_the_next_delimiter() -> None:
    reader = FrameReader(max_body_bytes=1000)
    status = Frame(MessageType.STATUS, 1)
    got = reader.feed(b"\x01" * 3000) + reader.feed(b"\x01" * 10 + b"\x00" + encode_frame(status))
    assert len(got) == 2 and isinstance(got[0], FrameTooLargeError) and got[1] == status


def test_encode_frame_refuses_a_body_over_the_limit() -> None:
    with pytest.raises(FrameTooLargeError, match="in chunks"):
        encode_frame(Frame(MessageType.INSTALL_CHUNK, 1, 0, bytes(MAX_BODY_BYTES)))


def test_message_payload_round_trips_json_and_blob() -> None:
    doc, blob = unpack_message(pack_message({"model": "tiny", "offset": 5}, b"\x00\x01raw"))
    assert doc == {"model": "tiny", "offset": 5} and blob == b"\x00\x01raw"
    for bad in (b"", b"\x00\x00\x00\x09{}", b"\x00\x00\x00\x02[]", b"\x00\x00\x00\x02{x"):
        with pytest.raises(MessageFormatError):
            unpack_message(bad)
