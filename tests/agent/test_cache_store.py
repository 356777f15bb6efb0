"""The result cache's core (device_agents/cache): exact keys, the output format, the memory and
SQLite tiers, TTL, budgets, sweeping replaced versions, and a file that is corrupt or cannot be
opened. Real SQLite files in tmp_path; a settable clock instead of sleeping."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from device_agents.cache.admission import Doorkeeper
from device_agents.cache.key import CacheKey, KeyMaker
from device_agents.cache.store import DB_NAME, ResultCache
from device_agents.cache.tensors import CacheFormatError, UncacheableError, decode_tensors, encode_tensors
from device_agents.metrics import AgentMetrics, CacheSeries

MB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _maker(version: int = 1, digest: str = "d" * 64) -> KeyMaker:
    return KeyMaker("det", "det", version, digest)


def _cache(directory: Path, clock: Clock | None = None, **kw: object) -> ResultCache:
    args: dict[str, object] = {"max_bytes": 64 * MB, "memory_max_bytes": 16 * MB, "retry_s": 0.0}
    args.update(kw)
    return ResultCache(directory, clock=clock or Clock(), **args)  # type: ignore[arg-type]  # test helper: kwargs checked by the call


def _exposition(series: CacheSeries) -> bytes:
    registry = CollectorRegistry()
    registry.register(series)
    return generate_latest(registry)


def _x(seed: int, shape: tuple[int, ...] = (1, 3, 8, 8)) -> np.ndarray:
    return np.random.default_rng(seed).random(shape).astype(np.float32)


def test_key_json_and_binary_tensors_of_one_value_share_a_key() -> None:
    x = _x(0)
    from_json = np.array(json.loads(json.dumps(x.ravel().tolist())), dtype=np.float32).reshape(x.shape)
    from_binary = np.frombuffer(x.tobytes(), dtype="<f4").reshape(x.shape)
    big_endian = x.astype(">f4")  # same values, other byte order: the key reads little-endian bytes
    transposed_back = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)  # not C-contiguous
    keys = {_maker().key({"x": a}).digest for a in (x, from_json, from_binary, big_endian, transposed_back)}
    assert len(keys) == 1


def test_key_same_bytes_with_other_shapes_never_share_a_key() -> None:
    x = _x(1, (1, 2, 6))
    keys = [_maker().key({"x": x.reshape(s)}) for s in ((1, 2, 6), (1, 6, 2), (2, 6), (12,))]
    assert len({k.digest for k in keys}) == 4
    assert all(not keys[0].matches(k.full()) for k in keys[1:])


def test_key_changes_with_model_version_digest_dtype_outputs_and_answer_parameters() -> None:
    x = _x(2)
    base = _maker().key({"x": x}).digest
    assert _maker(version=2).key({"x": x}).digest != base
    assert _maker(digest="e" * 64).key({"x": x}).digest != base
    assert _maker().key({"x": x.view(np.int32)}).digest != base  # same bytes, other dtype
    assert _maker().key({"x": x}, requested_outputs=["scores"]).digest != base
    assert _maker().key({"x": x}, parameters={"top_k": 3}).digest != base  # unknown: may change the answer
    ignored = {"cache": "bypass", "priority": 1, "timeout": 100, "binary_data_output": True}
    assert _maker().key({"x": x}, parameters=ignored).digest == base
    assert _maker().key({"x": x}, requested_outputs=["b", "a"]).digest == _maker().key({"x": x}, ["a", "b"]).digest


def test_key_maker_reuses_a_header_only_for_the_same_shapes_outputs_and_parameters() -> None:
    maker, x = _maker(), _x(1)
    asked = [
        ({"x": x}, None, None),
        ({"x": x}, None, {"top_k": 1}),
        ({"x": x}, None, {"top_k": True}),  # equal to 1 in Python, not in the answer's JSON
        ({"x": x}, None, {"top_k": 1.0}),
        ({"x": x}, ["scores"], None),
        ({"x": x.reshape(1, 3, 64, 1)}, None, None),
        ({"x": x}, None, {"top_k": [1]}),  # not a plain value: built, not remembered
    ]
    first = [maker.key(i, o, p).header for i, o, p in asked]
    again = [maker.key(i, o, p).header for i, o, p in asked]  # the same maker: from its remembered headers
    assert first == again and len(set(first)) == len(asked)
    assert first == [_maker().key(i, o, p).header for i, o, p in asked]  # what a fresh maker builds


def test_key_bytes_inputs_key_by_items_and_shape() -> None:
    one = np.array([b"ab", b"c"], dtype=object)
    other_split = np.array([b"a", b"bc"], dtype=object)
    assert _maker().key({"img": one}).digest != _maker().key({"img": other_split}).digest
    assert _maker().key({"img": one}).digest == _maker().key({"img": np.array([b"ab", b"c"], dtype=object)}).digest
    with pytest.raises(UncacheableError):
        _maker().key({"img": np.array([1, "a"], dtype=object)})


def test_tensors_round_trip_without_pickle_and_reject_bad_blobs() -> None:
    outputs = {"scores": _x(3, (2, 5)), "ids": np.arange(4, dtype=np.int64), "empty": np.zeros((0, 3), np.float32)}
    back = decode_tensors(encode_tensors(outputs))
    assert list(back) == list(outputs)
    for name, arr in outputs.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape
        np.testing.assert_array_equal(back[name], arr)
    assert not back["scores"].flags.writeable
    blob = encode_tensors(outputs)
    for bad in (blob[:-1], blob + b"\0", b"EKT0" + blob[4:], blob.replace(b"<f4", b"|O8", 1)):
        with pytest.raises(CacheFormatError):
            decode_tensors(bad)
    with pytest.raises(UncacheableError):
        encode_tensors({"text": np.array([1.5], dtype=object)})


def test_tensors_bytes_outputs_round_trip_as_read_only_bytes_items() -> None:
    labels = np.array([[b"cat", "d\u00f6g"], [b"", "x" * 300]], dtype=object)  # bytes and str items, one empty
    outputs = {"label": labels, "fixed": np.array([b"ab", b"c"]), "text": np.array(["hi"]), "score": _x(4, (2,))}
    back = decode_tensors(encode_tensors(outputs))
    assert back["label"].dtype == object and back["label"].shape == (2, 2) and not back["label"].flags.writeable
    assert back["label"].tolist() == [[b"cat", "d\u00f6g".encode()], [b"", b"x" * 300]]
    assert back["fixed"].tolist() == [b"ab", b"c"] and back["text"].tolist() == [b"hi"]
    np.testing.assert_array_equal(back["score"], outputs["score"])
    blob = encode_tensors({"label": labels})
    for bad in (blob[:-1], blob + b"\0", blob.replace(b"x" * 300, b"x" * 299 + b"\xff\xff", 1)[:-2]):
        with pytest.raises(CacheFormatError):
            decode_tensors(bad)


def test_cache_bytes_outputs_hit_from_memory_and_from_disk(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    key = _maker().key({"x": _x(50)})
    outputs = {"label": np.array(["person", "bicycle"], dtype=object), "boxes": _x(51, (2, 4))}
    assert cache.put(key, outputs, model="det", version=1, ttl_s=60, wait=True)
    hit = cache.get(_maker().key({"x": _x(50)}), "det")
    assert hit is not None and hit.outputs["label"].tolist() == [b"person", b"bicycle"]
    cache.close()
    reopened = _cache(tmp_path)
    hit = reopened.get(_maker().key({"x": _x(50)}), "det")
    assert hit is not None and hit.tier == "disk" and hit.outputs["label"].tolist() == [b"person", b"bicycle"]
    reopened.close()


def test_cache_hit_from_memory_then_from_disk_after_reopen(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    key = _maker().key({"x": _x(4)})
    assert cache.get(key, "det") is None
    out = {"y": _x(5, (1, 10))}
    assert cache.put(key, out, model="det", version=1, ttl_s=60, cost_s=0.02, wait=True)
    hit = cache.get(key, "det")
    assert hit is not None and hit.tier == "memory" and hit.version == 1 and hit.cost_s == 0.02
    np.testing.assert_array_equal(hit.outputs["y"], out["y"])
    cache.close()
    reopened = _cache(tmp_path)
    assert reopened.entries() == 1
    hit = reopened.get(_maker().key({"x": _x(4)}), "det")
    assert hit is not None and hit.tier == "disk"
    np.testing.assert_array_equal(hit.outputs["y"], out["y"])
    again = reopened.get(_maker().key({"x": _x(4)}), "det")
    assert again is not None and again.tier == "memory"  # promoted
    reopened.close()


def test_cache_hash_collision_is_a_miss_in_both_tiers(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    key = _maker().key({"x": _x(6)})
    cache.put(key, {"y": _x(7, (3,))}, model="det", version=1, ttl_s=60, wait=True)
    other = _maker().key({"x": _x(8)})
    forged = CacheKey(key.digest, other.header, other.buffers, key.sketch)  # the same xxh3-128 and sketch
    assert cache.get(forged, "det") is None
    cache.close()
    reopened = _cache(tmp_path)
    assert reopened.get(forged, "det") is None
    assert reopened.get(key, "det") is not None
    reopened.close()


def test_cache_entries_expire_after_ttl_in_both_tiers(tmp_path: Path) -> None:
    clock = Clock()
    cache = _cache(tmp_path, clock)
    key = _maker().key({"x": _x(9)})
    cache.put(key, {"y": _x(10, (3,))}, model="det", version=1, ttl_s=10, wait=True)
    clock.now += 9
    assert cache.get(key, "det") is not None
    clock.now += 2
    assert cache.get(key, "det") is None
    cache.close()
    assert _cache(tmp_path, clock).get(key, "det") is None


def test_cache_disk_budget_evicts_oldest_and_memory_tier_is_bounded_by_bytes(tmp_path: Path) -> None:
    clock = Clock()
    series = CacheSeries()
    entry_bytes = len(encode_tensors({"y": _x(0, (64, 64))})) + _maker().key({"x": _x(0, (64, 64))}).nbytes
    cache = _cache(tmp_path, clock, max_bytes=5 * entry_bytes, memory_max_bytes=2 * entry_bytes, series=series)
    keys = []
    for i in range(8):
        clock.now += 1
        keys.append(_maker().key({"x": _x(100 + i, (64, 64))}))
        cache.put(keys[-1], {"y": _x(i, (64, 64))}, model="det", version=1, ttl_s=600, wait=True)
    assert cache.memory_bytes() <= 2 * entry_bytes
    assert cache.disk_bytes() <= 5 * entry_bytes and cache.entries() == 5
    cache.close()
    reopened = _cache(tmp_path, clock)
    present = [reopened.get(k, "det") is not None for k in keys]
    assert present == [False] * 3 + [True] * 5  # the oldest went first
    text = _exposition(series)
    assert b'edgekit_cache_evictions_total{tier="disk"} 3.0' in text
    assert b'edgekit_cache_evictions_total{tier="memory"} 6.0' in text
    reopened.close()


def test_cache_model_budget_evicts_only_that_model(tmp_path: Path) -> None:
    clock = Clock()
    cache = _cache(tmp_path, clock)
    size = len(encode_tensors({"y": _x(0, (32, 32))})) + _maker().key({"x": _x(0, (32, 32))}).nbytes
    cache.model_max_bytes["det"] = 2 * size
    other = KeyMaker("cls", "cls", 1, "c" * 64)
    for i in range(4):
        clock.now += 1
        cache.put(_maker().key({"x": _x(i, (32, 32))}), {"y": _x(i, (32, 32))}, model="det", version=1, ttl_s=60)
        cache.put(other.key({"x": _x(i, (32, 32))}), {"y": _x(i, (32, 32))}, model="cls", version=1, ttl_s=60)
    assert cache.flush()
    rows = dict(sqlite3.connect(tmp_path / DB_NAME).execute("SELECT model, count(*) FROM entries GROUP BY model"))
    assert rows == {"det": 2, "cls": 4}
    cache.close()


def test_cache_sweep_drops_the_replaced_version_only(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    old, new = _maker(version=1).key({"x": _x(11)}), _maker(version=2).key({"x": _x(11)})
    other_model = KeyMaker("cls", "cls", 1, "c" * 64).key({"x": _x(11)})
    assert old.digest != new.digest  # unreachable by construction: the version keys
    cache.put(old, {"y": _x(12, (2,))}, model="det", version=1, ttl_s=60, wait=True)
    cache.put(new, {"y": _x(13, (2,))}, model="det", version=2, ttl_s=60, wait=True)
    cache.put(other_model, {"y": _x(14, (2,))}, model="cls", version=1, ttl_s=60, wait=True)
    cache.sweep("det", 2)
    assert cache.flush()
    assert cache.get(old, "det") is None and cache.get(new, "det") is not None
    assert cache.entries() == 2
    cache.close()
    rows = sqlite3.connect(tmp_path / DB_NAME).execute("SELECT model, version FROM entries ORDER BY model").fetchall()
    assert rows == [("cls", 1), ("det", 2)]


def test_cache_corrupt_file_is_moved_aside_and_a_fresh_one_starts(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    key = _maker().key({"x": _x(15)})
    cache.put(key, {"y": _x(16, (2,))}, model="det", version=1, ttl_s=60, wait=True)
    cache.close()
    db = tmp_path / DB_NAME
    raw = bytearray(db.read_bytes())
    raw[100:4096] = b"\xa5" * (4096 - 100)  # the schema page overwritten
    db.write_bytes(bytes(raw))
    metrics = AgentMetrics()
    fresh = _cache(tmp_path, series=metrics.cache)
    assert fresh.state == "ok"
    assert [p.name for p in tmp_path.glob(f"{DB_NAME}.corrupt-*")] != []
    assert fresh.get(key, "det") is None
    assert fresh.put(key, {"y": _x(16, (2,))}, model="det", version=1, ttl_s=60, wait=True)
    assert fresh.get(key, "det") is not None
    assert b"edgekit_cache_corrupt_total 1.0" in metrics.exposition()
    fresh.close()
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_cache_garbage_file_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / DB_NAME).write_bytes(b"this is not a database" * 100)
    cache = _cache(tmp_path)
    assert cache.state == "ok"
    assert len(list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))) == 1
    cache.close()


def test_cache_that_cannot_be_opened_caches_in_memory_only(tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    cache = _cache(blocker)
    assert cache.state == "off"
    key = _maker().key({"x": _x(17)})
    assert cache.put(key, {"y": _x(18, (2,))}, model="det", version=1, ttl_s=60, wait=True) is False
    hit = cache.get(key, "det")
    assert hit is not None and hit.tier == "memory"
    cache.close()


def test_cache_disk_on_hit_writes_an_entry_to_disk_only_once_it_repeats(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    once, twice = _x(20), _x(21)
    for x in (once, twice):
        cache.put(_maker().key({"x": x}), {"y": _x(22, (2,))}, model="det", version=1, ttl_s=60, disk_on_hit=True)
    assert cache.flush() and cache.entries() == 0  # nothing written for answers asked once
    hit = cache.get(_maker().key({"x": twice.copy()}), "det")
    assert hit is not None and hit.tier == "memory"
    assert cache.flush() and cache.entries() == 1  # its first hit wrote it
    cache.close()
    reopened = _cache(tmp_path)
    assert reopened.get(_maker().key({"x": twice.copy()}), "det") is not None
    assert reopened.get(_maker().key({"x": once.copy()}), "det") is None
    reopened.close()


def test_cache_memory_tier_compares_a_kept_key_in_full(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    x = _x(23)
    key = _maker().key({"x": x})
    cache.put(key, {"y": _x(24, (2,))}, model="det", version=1, ttl_s=60, disk_on_hit=True)
    other = _maker().key({"x": _x(25)})
    assert cache.get(CacheKey(key.digest, other.header, other.buffers, key.sketch), "det") is None
    assert cache.get(_maker().key({"x": x.copy()}), "det") is not None
    cache.close()


def test_cache_file_found_corrupt_while_serving_is_moved_aside_and_reads_go_on(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    key = _maker().key({"x": _x(26)})
    cache.put(key, {"y": _x(27, (2,))}, model="det", version=1, ttl_s=60, wait=True)
    cache.close()  # checkpointed: every page in the main file
    metrics = AgentMetrics()
    running = _cache(tmp_path, series=metrics.cache, memory_max_bytes=1)  # nothing fits in memory: reads go to disk
    db = tmp_path / DB_NAME
    raw = bytearray(db.read_bytes())
    raw[4096:] = b"\x5a" * (len(raw) - 4096)  # every page after the schema page overwritten under the open cache
    db.write_bytes(bytes(raw))
    assert running.get(key, "det") is None  # a miss, not an error
    assert running.flush()
    assert len(list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))) == 1
    assert running.state == "ok" and b"edgekit_cache_corrupt_total 1.0" in metrics.exposition()
    assert running.put(key, {"y": _x(27, (2,))}, model="det", version=1, ttl_s=60, wait=True)
    assert running.get(key, "det") is not None
    running.close()


def test_cache_memory_tier_keeps_a_copy_of_the_key_not_the_caller_s_array(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    x = _x(28)
    original = x.copy()
    cache.put(_maker().key({"x": x}), {"y": _x(29, (2,))}, model="det", version=1, ttl_s=60, disk_on_hit=True)
    x[0, 0, 0, 0] += 1.0  # the caller's array stays its own, writable; the stored key does not change with it
    assert cache.get(_maker().key({"x": x}), "det") is None
    assert cache.get(_maker().key({"x": original}), "det") is not None
    cache.close()


def test_cache_memory_tier_stays_exact_when_it_reuses_evicted_key_buffers(tmp_path: Path) -> None:
    size = _maker().key({"x": _x(0, (64, 64))}).nbytes + len(encode_tensors({"y": _x(0, (2,))}))
    cache = _cache(tmp_path, memory_max_bytes=2 * size)
    keys = [_maker().key({"x": _x(30 + i, (64, 64))}) for i in range(4)]
    for key in keys:
        cache.put(key, {"y": _x(0, (2,))}, model="det", version=1, ttl_s=60, disk_on_hit=True)
    # two fit: each later put evicted the oldest, whose buffer took the next key; every key still compares right
    assert [cache.get(k, "det") is not None for k in keys] == [False, False, True, True]
    cache.close()


def test_cache_admit_second_stores_a_full_tier_s_answer_only_at_its_key_s_second_sighting(tmp_path: Path) -> None:
    size = _maker().key({"x": _x(0, (64, 64))}).nbytes + len(encode_tensors({"y": _x(0, (2,))}))
    metrics = AgentMetrics()
    cache = _cache(tmp_path, memory_max_bytes=3 * size, series=metrics.cache)

    def put(key: CacheKey, admit: str) -> bool:
        return cache.put(key, {"y": _x(0, (2,))}, model="det", version=1, ttl_s=60, disk_on_hit=True, admit=admit)

    kept = [_maker().key({"x": _x(40 + i, (64, 64))}) for i in range(3)]
    assert all(put(k, "second") for k in kept)  # the tier has room: taken at the first sighting
    for i in range(20):  # a stream that never repeats, into a full tier: remembered by hash only
        assert not put(_maker().key({"x": _x(100 + i, (64, 64))}), "second")
    assert all(cache.get(k, "det") is not None for k in kept)  # nothing of the stream evicted them
    assert b"edgekit_cache_deferred_total 20.0" in metrics.exposition()
    again = _maker().key({"x": _x(119, (64, 64))})  # the stream's last input, seen a second time
    assert put(again, "second") and cache.get(again, "det") is not None
    assert put(_maker().key({"x": _x(200, (64, 64))}), "first")  # "first": every answer, whatever it evicts
    cache.close()


def test_cache_doorkeeper_says_seen_only_of_a_digest_it_was_shown() -> None:
    keeper = Doorkeeper(slots=4)
    digests = [_maker().key({"x": _x(300 + i)}).sketch for i in range(64)]
    assert [keeper.seen_before(d) for d in digests[:1]] == [False]
    assert keeper.seen_before(digests[0])
    # 64 digests through 4 slots: a digest is "seen" only after it was shown, never because of another's
    fresh = Doorkeeper(slots=4)
    assert not any(fresh.seen_before(d) for d in digests)
    with pytest.raises(ValueError, match="power of two"):
        Doorkeeper(slots=3)


def test_cache_file_of_the_previous_format_is_migrated_with_its_entries(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    key = _maker().key({"x": _x(60)})
    assert cache.put(key, {"y": _x(61, (2,))}, model="det", version=1, ttl_s=60, wait=True)
    cache.close()
    with sqlite3.connect(tmp_path / DB_NAME) as db:  # as format 1 wrote it: no signature columns
        db.execute("ALTER TABLE entries DROP COLUMN context")
        db.execute("ALTER TABLE entries DROP COLUMN signature")
        db.execute("ALTER TABLE entries DROP COLUMN sketch")
        db.execute("PRAGMA user_version=1")
    reopened = _cache(tmp_path)
    hit = reopened.get(_maker().key({"x": _x(60)}), "det")
    assert hit is not None and hit.tier == "disk" and not list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))
    sig = np.ones(4, np.float32) / 2
    other = _maker().key({"x": _x(62)})
    assert reopened.put(other, {"y": _x(63, (2,))}, model="det", version=1, ttl_s=60, wait=True, signature=(b"c", sig))
    reopened.close()
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (3,)
    again = _cache(tmp_path)
    [(context, stored, digest)] = again.signatures("det", 1, 10)
    assert context == b"c" and digest == other.digest
    np.testing.assert_array_equal(stored, sig)
    again.close()


def test_cache_miss_reads_the_file_only_for_a_digest_it_holds(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    stored = [_maker().key({"x": _x(70 + i)}) for i in range(3)]
    for key in stored:
        assert cache.put(key, {"y": _x(80, (2,))}, model="det", version=1, ttl_s=60, wait=True)
    cache.close()
    reopened = _cache(tmp_path, memory_max_bytes=1)  # nothing fits in memory: every hit is the file's
    statements: list[str] = []
    assert reopened._reader is not None
    reopened._reader.set_trace_callback(statements.append)
    for i in range(20):  # an all-miss stream: answered without a query
        assert reopened.get(_maker().key({"x": _x(100 + i)}), "det") is None
    assert statements == []
    hit = reopened.get(_maker().key({"x": _x(70)}), "det")
    assert hit is not None and hit.tier == "disk" and len(statements) == 1
    reopened.sweep("det", 2)  # the file's entries were all version 1: gone, and so are their fingerprints
    assert reopened.flush() and reopened.entries() == 0
    assert reopened.get(_maker().key({"x": _x(71)}), "det") is None and len(statements) == 1
    v2 = _maker(version=2).key({"x": _x(71)})
    assert reopened.put(v2, {"y": _x(80, (2,))}, model="det", version=2, ttl_s=60, wait=True)
    assert reopened.get(_maker(version=2).key({"x": _x(71)}), "det") is not None and len(statements) == 2
    reopened.close()


def test_cache_miss_of_a_never_seen_sketch_skips_the_full_hash(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    x = _x(90, (3, 64, 64))
    assert cache.put(_maker().key({"x": x}), {"y": _x(91, (2,))}, model="det", version=1, ttl_s=60, wait=True)
    fresh = _maker().key({"x": _x(92, (3, 64, 64))})
    assert cache.get(fresh, "det") is None and not fresh.hashed  # its sketch is no entry's: no xxh3-128 of it
    same_sample = x.copy()
    same_sample[0, 5, 3] += 1.0  # a byte the sketch does not read: the same sketch, another key
    twin = _maker().key({"x": same_sample})
    assert twin.sketch == _maker().key({"x": x}).sketch
    assert cache.get(twin, "det") is None and twin.hashed  # compared in full: a miss, never x's answer
    assert cache.get(_maker().key({"x": x.copy()}), "det") is not None
    cache.close()
    reopened = _cache(tmp_path)  # the sketches of the file's entries are read back with them
    assert reopened.get(_maker().key({"x": x.copy()}), "det") is not None
    again = _maker().key({"x": _x(92, (3, 64, 64))})
    assert reopened.get(again, "det") is None and not again.hashed
    reopened.close()
