"""The result cache's two tiers: a hot in-memory LRU (bounded by bytes) in front of a durable
SQLite file (``<store>/cache/results.db``, WAL, ``synchronous=NORMAL``).

    get(key)  memory tier, else the file; the stored key is compared byte for byte (``CacheKey.matches``);
              a key whose sketch (``CacheKey.sketch``) no entry has is a miss without hashing the whole key
    put(...)  into memory now; into the file by one writer thread, several entries per transaction
              (``disk_on_hit``: into the file once it is hit, so an answer that never repeats, and
              the input bytes its key holds, never costs a disk write)

Durability: an entry is *acknowledged* when its transaction has committed (``put(wait=True)``
returns True, or ``flush()`` after it). WAL with ``synchronous=NORMAL`` keeps every committed
transaction across a killed process (the WAL is in the OS's page cache) and the file consistent
across a power cut (the last transactions may be lost then, never half of one). Every step of a
write passes the counted fault point ``cache_write`` (``device_agents.faults.FaultCounter``).

Bad conditions never stop serving; each is one log line and a metric:
- a file that is corrupt (or not a cache file of this format) at open, or whose reads or writes
  say so later, is moved aside (``results.db.corrupt-<time>``) and a fresh one starts;
- a full disk (``SQLITE_FULL``, or an I/O error with the disk nearly full) pauses writing to the
  file (the memory tier goes on); after ``retry_s`` the next write tries again, and writing
  resumes when it succeeds;
- a directory that cannot hold the file (not writable, a file in its place) leaves the memory
  tier only.

Budgets: the file holds at most ``max_bytes`` (and each model at most its own budget, where set),
oldest entries evicted first; entries expire ``ttl_s`` after they were stored (wall clock, so the
age survives a restart). ``sweep(model, version)`` drops the entries of a model's other versions
(unreachable already: the version and artifact digest are part of every key).
"""

from __future__ import annotations

import errno
import logging
import shutil
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from device_agents.cache.admission import Doorkeeper
from device_agents.cache.key import CacheKey
from device_agents.cache.tensors import CacheFormatError, decode_tensors, encode_tensors
from device_agents.faults import FaultCounter
from device_agents.metrics import CacheSeries

log = logging.getLogger("edgekit.agent")

DB_NAME = "results.db"
# PRAGMA user_version of a file this code wrote; an older one is migrated (_MIGRATIONS), another moved aside
FORMAT_VERSION = 3
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries ("
    " digest BLOB NOT NULL UNIQUE, model TEXT NOT NULL, version INTEGER NOT NULL,"
    " key BLOB NOT NULL, value BLOB NOT NULL, size_bytes INTEGER NOT NULL,"
    " created_s REAL NOT NULL, expires_s REAL NOT NULL, cost_s REAL NOT NULL,"
    " context BLOB, signature BLOB, sketch INTEGER)",
    "CREATE INDEX IF NOT EXISTS entries_created ON entries(created_s)",
    "CREATE INDEX IF NOT EXISTS entries_model ON entries(model, created_s)",
)
# user_version -> the statements that bring such a file to the next version
_MIGRATIONS = {
    # 2: the approximate and semantic modes' signatures, so their hits survive a restart
    1: ("ALTER TABLE entries ADD COLUMN context BLOB", "ALTER TABLE entries ADD COLUMN signature BLOB"),
    # 3: each key's sketch (entries without one, as formats 1 and 2 wrote them, are looked up by full hash)
    2: ("ALTER TABLE entries ADD COLUMN sketch INTEGER",),
}
# SQLite primary result codes (the low byte of ``sqlite_errorcode``)
_SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 10, 11, 13, 26
_LOW_SPACE_BYTES = 1 << 20  # an I/O error with less free than this is a full disk
_EXPIRED_SWEEP_S = 60.0  # expired entries are deleted from the file at most this often
_SPARE_SIZES, _SPARES_PER_SIZE = 4, 2  # evicted key buffers kept for reuse
_SKETCH_SLACK = 4096  # sketches of entries gone, at most twice those held plus this, before a rebuild


@dataclass(frozen=True, slots=True)
class Hit:
    """A cached answer: the outputs (read-only arrays), the version that produced them, what its
    inference took (``cost_s``) and the tier it came from (``memory`` or ``disk``)."""

    outputs: dict[str, np.ndarray]
    version: int
    cost_s: float
    tier: str


class _Entry:
    __slots__ = (
        "context", "cost_s", "created_s", "expires_s", "key", "model", "on_disk", "outputs", "signature", "size",
        "sketch", "version",
    )  # fmt: skip

    def __init__(
        self, key: bytes | bytearray, outputs: dict[str, np.ndarray], size: int, expires_s: float, model: str,
        version: int, cost_s: float,
    ) -> None:  # fmt: skip
        self.key, self.outputs, self.size, self.expires_s = key, outputs, size, expires_s
        self.model, self.version, self.cost_s = model, version, cost_s
        self.on_disk = True  # in the file, or queued for it (False: written when first hit)
        self.created_s = 0.0
        self.context: bytes | None = None  # approximate/semantic: the signature's context (the key's header)
        self.signature: bytes | None = None  # and the signature (float32 bytes)
        self.sketch: int | None = None  # CacheKey.sketch (None: an entry formats 1 or 2 wrote)


class _Write:
    __slots__ = (
        "context", "cost_s", "created_s", "digest", "done", "expires_s", "key", "model", "ok", "signature", "size",
        "sketch", "value", "version",
    )  # fmt: skip

    def __init__(
        self, digest: bytes, model: str, version: int, key: bytes | bytearray, value: bytes, created_s: float,
        expires_s: float, cost_s: float, done: threading.Event | None, context: bytes | None = None,
        signature: bytes | None = None, sketch: int | None = None,
    ) -> None:  # fmt: skip
        self.digest, self.model, self.version, self.key, self.value = digest, model, version, key, value
        self.created_s, self.expires_s, self.cost_s, self.done = created_s, expires_s, cost_s, done
        self.context, self.signature, self.sketch = context, signature, sketch
        self.ok = False
        self.size = len(key) + len(value)


class _Sweep:
    __slots__ = ("model", "version")

    def __init__(self, model: str, version: int) -> None:
        self.model, self.version = model, version


class _Reopen:
    """A reader found the file corrupt: the writer (which owns the write connection) moves it aside."""


class ResultCache:
    """One agent's result cache, shared by every model's cache stages. Thread-safe."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        memory_max_bytes: int,
        series: CacheSeries | None = None,
        clock: Callable[[], float] = time.time,
        retry_s: float = 5.0,
        max_pending: int = 256,
    ) -> None:
        self.directory = Path(directory)
        self.path = self.directory / DB_NAME
        self.max_bytes = max_bytes
        self.memory_max_bytes = memory_max_bytes
        self.series = series or CacheSeries()
        self.clock = clock
        self.retry_s = retry_s
        self.max_pending = max_pending
        self.model_max_bytes: dict[str, int] = {}
        self._fault = FaultCounter("cache_write")
        # memory tier
        self._hot: OrderedDict[bytes, _Entry] = OrderedDict()
        self._hot_bytes = 0
        self._hot_lock = threading.Lock()
        self._spare: dict[int, list[bytearray]] = {}  # key buffers of evicted entries, by size
        self._doorkeeper = Doorkeeper()  # keys seen once, for put(admit="second")
        # file tier: one connection for reads (under _read_lock), one for the writer thread
        self._read_lock = threading.Lock()
        self._reader: sqlite3.Connection | None = None
        self._writer: sqlite3.Connection | None = None
        self._disk_bytes: dict[str, int] = {}
        self._disk_entries = 0
        # 64-bit fingerprints of the digests in the file: a miss in memory reads the file only when
        # its digest may be there (an all-miss stream then never waits on SQLite). A fingerprint is
        # added before its write commits and dropped after its delete did: in doubt, a read too many.
        self._filed: set[int] = set()
        # the sketches of every entry in memory, in the file or queued for it (and, until the next
        # rebuild, of some that are gone: in doubt, a full hash too many); None: the file holds
        # entries without one, so every look-up hashes in full
        self._sketches: set[int] | None = set()
        self.state = "off"  # "ok", "paused" (a full disk: writes wait for retry_at), "off" (no file)
        self.pause_reason = ""
        self._retry_at = 0.0
        self._last_expiry_sweep = 0.0
        self._cond = threading.Condition()
        self._pending: list[_Write | _Sweep | _Reopen] = []
        self._busy = False
        self._closing = False
        self._open()
        self.series.watch(self._sizes)
        self._thread = threading.Thread(target=self._writer_loop, name="cache-writer", daemon=True)
        self._thread.start()

    # -- the API --------------------------------------------------------------------------
    def get(self, key: CacheKey, model: str) -> Hit | None:
        """The cached answer of ``key``, or None (absent, expired, another key with its hash)."""
        sketches = self._sketches
        if sketches is not None and key.sketch not in sketches:
            return None  # nothing held has its sketch: a miss, known without hashing the whole key
        now = self.clock()
        digest = key.digest
        with self._hot_lock:
            entry = self._hot.get(digest)
            if entry is not None:
                if entry.expires_s <= now or not key.matches(entry.key):
                    if entry.expires_s <= now:
                        self._drop_hot(digest)
                    return None
                self._hot.move_to_end(digest)
                promote = not entry.on_disk
                entry.on_disk = True
        if entry is None:
            return self._get_disk(key, model, now)
        if promote:  # it repeated: worth its disk write now
            self._queue_write(digest, entry, None)
        return Hit(entry.outputs, entry.version, entry.cost_s, "memory")

    def get_digest(self, digest: bytes, model: str) -> Hit | None:
        """The answer stored under ``digest`` for ``model``, with no key to compare: the approximate
        mode's look-up of the entry its signature index chose."""
        now = self.clock()
        with self._hot_lock:
            entry = self._hot.get(digest)
            if entry is not None and entry.model == model and entry.expires_s > now:
                self._hot.move_to_end(digest)
                promote = not entry.on_disk
                entry.on_disk = True
            else:
                entry = None
        if entry is not None:
            if promote:
                self._queue_write(digest, entry, None)
            return Hit(entry.outputs, entry.version, entry.cost_s, "memory")
        if _fingerprint(digest) not in self._filed:
            return None
        rows = self._read(
            "SELECT value, version, expires_s, cost_s FROM entries WHERE digest = ? AND model = ?", (digest, model)
        )
        if not rows or rows[0][2] <= now:
            return None
        try:
            outputs = decode_tensors(rows[0][0])
        except CacheFormatError:
            return None
        return Hit(outputs, int(rows[0][1]), float(rows[0][3]), "disk")

    def put(
        self,
        key: CacheKey,
        outputs: Mapping[str, np.ndarray],
        *,
        model: str,
        version: int,
        ttl_s: float,
        cost_s: float = 0.0,
        wait: bool = False,
        disk_on_hit: bool = False,
        admit: str = "first",
        signature: tuple[bytes, np.ndarray] | None = None,
    ) -> bool:
        """Store ``outputs`` under ``key``; in memory now, in the file by the writer. ``admit =
        "second"``: once the memory tier is full, only a key seen before is stored (the first
        sighting is remembered by its hash: ``device_agents.cache.admission``), so a stream of
        inputs that never repeat costs a probe, not a copy of each input; False when not stored.
        ``signature``: (context, vector) of the approximate or semantic mode, stored with the entry
        so that ``signatures()`` finds it again after a restart. ``wait``:
        return once the file's transaction committed (True) or failed (False); without it, True
        when queued. ``disk_on_hit``: write it to the file only once it is hit (from memory), so
        an answer that never repeats costs no disk write (an all-miss stream of large inputs
        would write every input, since the whole key is stored) and one that repeats is made
        durable at its first hit; an entry too big for the memory tier goes to the file now.
        ``UncacheableError`` for outputs that are neither numbers nor BYTES."""
        if (
            admit == "second"
            and self._hot_bytes + key.nbytes > self.memory_max_bytes
            and not self._doorkeeper.seen_before(key.sketch)
        ):
            self.series.deferred()
            return False
        value = encode_tensors(outputs)
        now = self.clock()
        decoded = decode_tensors(value)  # read-only views: what a hit hands out, whatever the caller does next
        full = self._copy_key(key) if disk_on_hit else key.full()
        entry = _Entry(full, decoded, len(full) + len(value), now + ttl_s, model, version, cost_s)
        entry.created_s = now
        entry.on_disk = not disk_on_hit
        entry.sketch = key.sketch
        if signature is not None:
            entry.context = signature[0]
            entry.signature = np.asarray(signature[1], "<f4").tobytes()
        try:
            if self._put_hot(key.digest, entry) and disk_on_hit:
                return True
            entry.on_disk = True
            return self._queue_write(key.digest, entry, value, wait)
        finally:  # once the entry is in memory or queued: a rebuild of the set finds it there
            with self._hot_lock:
                if self._sketches is not None:
                    self._sketches.add(entry.sketch)

    def _copy_key(self, key: CacheKey) -> bytearray:
        """``key.full()`` copied into a buffer of an entry the memory tier evicted unwritten, where one
        of that size is spare: a stream of misses then copies into pages already mapped instead of
        faulting in fresh ones for every request (600 KB: ~0.4 ms of page faults, ~0.03 ms of copy)."""
        n = key.nbytes
        with self._hot_lock:
            spares = self._spare.get(n)
            buf = spares.pop() if spares else None
        if buf is None:
            buf = bytearray(n)
        pos = len(key.header)
        buf[:pos] = key.header
        for part in key.buffers:
            buf[pos : pos + part.nbytes] = part
            pos += part.nbytes
        return buf

    def _queue_write(self, digest: bytes, entry: _Entry, value: bytes | None, wait: bool = False) -> bool:
        """Hand ``entry`` to the writer (``value``: its encoded outputs; None: encoded here)."""
        now = self.clock()
        if self.state == "off" or entry.size > self._budget(entry.model):
            return False
        if self.state == "paused" and now < self._retry_at:
            return False
        if value is None:
            value = encode_tensors(entry.outputs)
        write = _Write(
            digest, entry.model, entry.version, entry.key, value, entry.created_s or now, entry.expires_s,
            entry.cost_s, threading.Event() if wait else None, entry.context, entry.signature, entry.sketch,
        )  # fmt: skip
        with self._cond:
            if len(self._pending) >= self.max_pending:
                self.series.write_dropped()
                return False
            self._pending.append(write)
            self._cond.notify()
        if write.done is None:
            return True
        write.done.wait()
        return write.ok

    def signatures(self, model: str, version: int, limit: int) -> list[tuple[bytes, np.ndarray, bytes]]:
        """(context, signature, digest) of ``model`` ``version``'s live entries that have one, in
        memory or in the file, at most ``limit``, oldest first (so the newest win a full index)."""
        now = self.clock()
        found: dict[bytes, tuple[float, bytes, bytes]] = {}
        for digest, context, sig, created_s in self._read(
            "SELECT digest, context, signature, created_s FROM entries WHERE model = ? AND version = ?"
            " AND signature IS NOT NULL AND expires_s > ? ORDER BY created_s DESC LIMIT ?",
            (model, version, now, limit),
        ):
            found[bytes(digest)] = (float(created_s), bytes(context), bytes(sig))
        with self._hot_lock:
            for digest, entry in self._hot.items():
                if entry.model == model and entry.version == version and entry.signature is not None:
                    if entry.context is not None and entry.expires_s > now:
                        found[digest] = (entry.created_s, entry.context, entry.signature)
        rows = sorted(found.items(), key=lambda item: item[1][0])[-limit:]
        out = []
        for digest, (_, context, sig) in rows:
            if len(sig) % 4 == 0 and sig:
                out.append((context, np.frombuffer(sig, "<f4").astype(np.float32), digest))
        return out

    def sweep(self, model: str, version: int) -> None:
        """Drop the entries of ``model``'s versions other than ``version`` (after an update)."""
        with self._hot_lock:
            for digest in [d for d, e in self._hot.items() if e.model == model and e.version != version]:
                self._drop_hot(digest)
        with self._cond:
            self._pending.append(_Sweep(model, version))
            self._cond.notify()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is committed (or failed); True if done in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        self.flush(timeout_s=5.0)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        with self._read_lock:
            for conn in (self._reader, self._writer):
                if conn is not None:
                    conn.close()
            self._reader = self._writer = None

    def entries(self) -> int:
        """Entries in the file (as this process counts them)."""
        return self._disk_entries

    def disk_bytes(self) -> int:
        return sum(self._disk_bytes.values())

    def memory_bytes(self) -> int:
        return self._hot_bytes

    # -- memory tier ----------------------------------------------------------------------
    def _put_hot(self, digest: bytes, entry: _Entry) -> bool:
        """Keep ``entry`` in memory (LRU by bytes); False when it is bigger than the memory tier."""
        if entry.size > self.memory_max_bytes:
            return False
        evicted = 0
        with self._hot_lock:
            if digest in self._hot:
                self._drop_hot(digest)
            self._hot[digest] = entry
            self._hot_bytes += entry.size
            while self._hot_bytes > self.memory_max_bytes:
                _, old = self._hot.popitem(last=False)
                self._hot_bytes -= old.size
                evicted += 1
                if not old.on_disk and isinstance(old.key, bytearray) and len(self._spare) < _SPARE_SIZES:
                    # never queued for the writer, so nothing else holds it: its buffer takes the next key
                    spares = self._spare.setdefault(len(old.key), [])
                    if len(spares) < _SPARES_PER_SIZE:
                        spares.append(old.key)
        if evicted:
            self.series.evicted("memory", evicted)
        return True

    def _drop_hot(self, digest: bytes) -> None:
        """(under _hot_lock)"""
        old = self._hot.pop(digest, None)
        if old is not None:
            self._hot_bytes -= old.size

    # -- file tier ------------------------------------------------------------------------
    def _read(self, sql: str, args: tuple[object, ...]) -> list[tuple[Any, ...]]:
        """The rows of one query on the read connection; [] without a file or when the read fails."""
        if self._reader is None:
            return []
        try:
            with self._read_lock:
                if self._reader is None:
                    return []
                # fetchall: the statement runs to its end, so its read transaction ends with it (one
                # left open pins the WAL: no checkpoint gets past it, and the WAL grows without end)
                return self._reader.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            self._read_failed(exc)
            return []

    def _get_disk(self, key: CacheKey, model: str, now: float) -> Hit | None:
        if _fingerprint(key.digest) not in self._filed:
            return None
        rows = self._read(
            "SELECT key, value, version, expires_s, cost_s, sketch FROM entries WHERE digest = ?", (key.digest,)
        )
        if not rows:
            return None
        stored, value, version, expires_s, cost_s, sketch = rows[0]
        if expires_s <= now or not key.matches(stored):
            return None
        try:
            outputs = decode_tensors(value)
        except CacheFormatError as exc:
            log.warning("result cache: an entry of %s does not parse (%s); it is ignored", model, exc)
            return None
        entry = _Entry(stored, outputs, len(stored) + len(value), expires_s, model, version, cost_s)
        entry.on_disk = True
        entry.sketch = None if sketch is None else int(sketch)
        self._put_hot(key.digest, entry)
        return Hit(outputs, int(version), float(cost_s), "disk")

    def _read_failed(self, exc: sqlite3.Error) -> None:
        code = _code(exc)
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            with self._cond:  # the writer thread moves it aside (it owns the write connection)
                self._pending.append(_Reopen())
                self._cond.notify()
        else:
            log.warning("result cache: a read failed (%s); answered as a miss", exc)

    def _budget(self, model: str) -> int:
        return min(self.max_bytes, self.model_max_bytes.get(model, self.max_bytes))

    def _open(self) -> None:
        """Open (or create) the file; move a corrupt or foreign one aside; without a usable
        directory, stay in memory only (state ``off``)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("result cache: cannot create %s (%s); caching in memory only", self.directory, exc)
            self.state = "off"
            return
        for attempt in (1, 2):
            try:
                self._connect()
                self.state = "ok"
                return
            except sqlite3.Error as exc:
                self._close_connections()
                if attempt == 1 and _code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB, -1) and self.path.exists():
                    self._move_aside(str(exc))
                    continue
                log.warning("result cache: cannot open %s (%s); caching in memory only", self.path, exc)
            except OSError as exc:
                self._close_connections()
                log.warning("result cache: cannot open %s (%s); caching in memory only", self.path, exc)
            self.state = "off"
            return

    def _connect(self) -> None:
        writer = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        self._writer = writer
        check = writer.execute("PRAGMA quick_check").fetchone()
        if check is None or check[0] != "ok":
            raise _Corrupt(f"quick_check says {check[0] if check else 'nothing'}")
        (user_version,) = writer.execute("PRAGMA user_version").fetchone()
        has_tables = writer.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if has_tables and user_version != FORMAT_VERSION and user_version not in _MIGRATIONS:
            raise _Corrupt(f"format version {user_version}, this agent writes {FORMAT_VERSION}")
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute("PRAGMA synchronous=NORMAL")
        if has_tables and user_version != FORMAT_VERSION:
            writer.execute("BEGIN IMMEDIATE")  # one transaction: a file is at one version or the next
            while user_version != FORMAT_VERSION:
                for statement in _MIGRATIONS[user_version]:
                    writer.execute(statement)
                user_version += 1
            writer.execute(f"PRAGMA user_version={FORMAT_VERSION}")
            writer.execute("COMMIT")
        for statement in _SCHEMA:
            writer.execute(statement)
        writer.execute(f"PRAGMA user_version={FORMAT_VERSION}")
        self._disk_bytes = {
            model: int(size)
            for model, size in writer.execute("SELECT model, sum(size_bytes) FROM entries GROUP BY model")
        }
        self._disk_entries = int(writer.execute("SELECT count(*) FROM entries").fetchone()[0])
        self._filed = {_fingerprint(bytes(d)) for (d,) in writer.execute("SELECT digest FROM entries")}
        self._sketches = _stored_sketches(writer)
        reader = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        reader.execute("PRAGMA synchronous=NORMAL")
        self._reader = reader

    def _close_connections(self) -> None:
        with self._read_lock:
            for conn in (self._reader, self._writer):
                if conn is not None:
                    try:
                        conn.close()
                    except sqlite3.Error:
                        pass  # closing a broken connection: nothing left to keep
            self._reader = self._writer = None

    def _move_aside(self, why: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.path.with_name(f"{DB_NAME}.corrupt-{stamp}")
        log.warning("result cache: %s is unusable (%s); moved to %s, starting an empty cache", self.path, why, target)
        self.series.corrupt()
        for suffix in ("", "-wal", "-shm"):
            src = Path(f"{self.path}{suffix}")
            if src.exists():
                try:
                    src.replace(Path(f"{target}{suffix}"))
                except OSError:
                    src.unlink(missing_ok=True)
        self._disk_bytes, self._disk_entries = {}, 0
        self._filed = set()
        with self._hot_lock:  # what memory holds keeps its sketches
            self._sketches = {e.sketch for e in self._hot.values() if e.sketch is not None}

    def _reopen_fresh(self, why: str) -> None:
        self._close_connections()
        self._move_aside(why)
        self._open()

    # -- the writer thread ----------------------------------------------------------------
    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                batch, self._pending = self._pending, []
                self._busy = True
            try:
                self._write(batch)
            except Exception:  # the one writer must outlive a bug in one batch: those entries are lost, not the cache
                log.exception("result cache: writing %d entries failed; they are not stored", len(batch))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                for item in batch:
                    if isinstance(item, _Write) and item.done is not None:
                        item.done.set()

    def _write(self, queued: list[_Write | _Sweep | _Reopen]) -> None:
        if any(isinstance(i, _Reopen) for i in queued):  # a reader found the file corrupt
            self._reopen_fresh("a read said the file is corrupt")
        batch = [i for i in queued if not isinstance(i, _Reopen)]
        db = self._writer
        if db is None or self.state == "off":
            return
        now = self.clock()
        if self.state == "paused" and now < self._retry_at:
            return
        sizes = dict(self._disk_bytes)
        entries = self._disk_entries
        evicted = 0
        filed: dict[int, bool] = {}  # fingerprint -> in the file once this transaction commits (last change wins)
        try:
            self._fault.hit()
            db.execute("BEGIN IMMEDIATE")
            for item in batch:
                if isinstance(item, _Sweep):
                    gone = db.execute(
                        "SELECT digest, size_bytes FROM entries WHERE model = ? AND version != ?",
                        (item.model, item.version),
                    ).fetchall()
                    db.execute("DELETE FROM entries WHERE model = ? AND version != ?", (item.model, item.version))
                    entries -= len(gone)
                    sizes[item.model] = sizes.get(item.model, 0) - sum(int(size) for _, size in gone)
                    filed.update((_fingerprint(bytes(digest)), False) for digest, _ in gone)
                    self._fault.hit()
                    continue
                old = db.execute("SELECT model, size_bytes FROM entries WHERE digest = ?", (item.digest,)).fetchone()
                if old is not None:
                    sizes[old[0]] = sizes.get(old[0], 0) - int(old[1])
                    entries -= 1
                db.execute(
                    "INSERT OR REPLACE INTO entries (digest, model, version, key, value, size_bytes, created_s,"
                    " expires_s, cost_s, context, signature, sketch) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        item.digest, item.model, item.version, item.key, item.value, item.size,
                        item.created_s, item.expires_s, item.cost_s, item.context, item.signature,
                        None if item.sketch is None else _signed(item.sketch),
                    ),
                )  # fmt: skip
                sizes[item.model] = sizes.get(item.model, 0) + item.size
                entries += 1
                fingerprint = _fingerprint(item.digest)
                self._filed.add(fingerprint)
                filed[fingerprint] = True
                self._fault.hit()
            if now - self._last_expiry_sweep > _EXPIRED_SWEEP_S:
                entries, evicted = self._delete(db, "expires_s <= ?", (now,), sizes, entries, 1 << 62, filed)
                self._fault.hit()
            for model in {i.model for i in batch if isinstance(i, _Write)}:
                budget = self._budget(model)
                if sizes.get(model, 0) > budget:
                    entries, n = self._delete(db, "model = ?", (model,), sizes, entries, sizes[model] - budget, filed)
                    evicted += n
                    self._fault.hit()
            total = sum(sizes.values())
            if total > self.max_bytes:
                entries, n = self._delete(db, "1", (), sizes, entries, total - self.max_bytes, filed)
                evicted += n
                self._fault.hit()
            db.execute("COMMIT")
            self._fault.hit()
        except sqlite3.Error as exc:
            self._rollback(db)
            self._write_failed(exc)
            return
        except OSError as exc:
            self._rollback(db)
            self._write_failed(exc)
            return
        if now - self._last_expiry_sweep > _EXPIRED_SWEEP_S:
            self._last_expiry_sweep = now
        self._disk_bytes, self._disk_entries = {m: s for m, s in sizes.items() if s > 0}, entries
        for fingerprint, present in filed.items():
            if not present:
                self._filed.discard(fingerprint)
        sketches = self._sketches
        if (sketches is None and evicted) or (
            sketches is not None and len(sketches) > 2 * (len(self._hot) + entries) + _SKETCH_SLACK
        ):  # too many, or entries without a sketch may be gone now
            self._rebuild_sketches(db)
        if evicted:
            self.series.evicted("disk", evicted)
        for item in batch:
            if isinstance(item, _Write):
                item.ok = True
        if self.state == "paused":
            self.state, self.pause_reason = "ok", ""
            self.series.paused(False)
            log.warning("result cache: writing to %s again", self.path)

    def _rebuild_sketches(self, db: sqlite3.Connection) -> None:
        """The sketch set again from what is held (it only grows between rebuilds). Runs in the
        writer thread after a commit, so the file cannot change meanwhile; memory and the queue
        are read under their locks, so a put's sketch is in the new set."""
        try:
            held = _stored_sketches(db)
        except sqlite3.Error:
            return  # kept as it is: too big is only slower
        with self._hot_lock:
            if held is not None:
                held.update(e.sketch for e in self._hot.values() if e.sketch is not None)
                with self._cond:
                    held.update(w.sketch for w in self._pending if isinstance(w, _Write) and w.sketch is not None)
            self._sketches = held

    def _delete(
        self,
        db: sqlite3.Connection,
        where: str,
        args: tuple[object, ...],
        sizes: dict[str, int],
        entries: int,
        free_bytes: int,
        filed: dict[int, bool],
    ) -> tuple[int, int]:
        """Delete the oldest entries matching ``where`` until ``free_bytes`` are freed (noting each
        in ``filed``); (entries, deleted)."""
        freed = deleted = 0
        while freed < free_bytes:
            rows = db.execute(
                f"SELECT rowid, model, size_bytes, digest FROM entries WHERE {where} ORDER BY created_s LIMIT 64", args
            ).fetchall()
            if not rows:
                break
            for rowid, model, size, digest in rows:
                if freed >= free_bytes:
                    break
                db.execute("DELETE FROM entries WHERE rowid = ?", (rowid,))
                filed[_fingerprint(bytes(digest))] = False
                sizes[model] = sizes.get(model, 0) - int(size)
                freed += int(size)
                deleted += 1
                entries -= 1
        return entries, deleted

    def _rollback(self, db: sqlite3.Connection) -> None:
        if db.in_transaction:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # the transaction is gone already (SQLite rolls back on some errors by itself)

    def _write_failed(self, exc: sqlite3.Error | OSError) -> None:
        code = _code(exc) if isinstance(exc, sqlite3.Error) else -1
        no_space = (
            code == _SQLITE_FULL
            or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC)
            or (code == _SQLITE_IOERR and _free_bytes(self.directory) < _LOW_SPACE_BYTES)
        )
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            self._reopen_fresh(str(exc))
            return
        self._retry_at = self.clock() + self.retry_s
        if self.state != "paused":
            self.state, self.pause_reason = "paused", "disk_full" if no_space else "write_error"
            self.series.paused(True)
            log.warning(
                "result cache: %s writing %s (%s); writing to disk is off (memory tier only), retried every %.0f s",
                "the disk is full" if no_space else "an error",
                self.path,
                exc,
                self.retry_s,
            )

    def _sizes(self) -> tuple[int, int, int, int]:
        """(memory entries, memory bytes, file entries, file bytes), for /metrics."""
        return len(self._hot), self._hot_bytes, self._disk_entries, sum(self._disk_bytes.values())


class _Corrupt(sqlite3.DatabaseError):
    """The file opened but is not a usable cache file (quick_check or the format version)."""

    sqlite_errorcode = _SQLITE_CORRUPT


def _code(exc: sqlite3.Error) -> int:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF
    if isinstance(exc, sqlite3.DatabaseError) and "not a database" in str(exc):
        return _SQLITE_NOTADB
    return -1


def _fingerprint(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little")


def _signed(sketch: int) -> int:
    """A 64-bit sketch as SQLite's signed INTEGER."""
    return sketch - (1 << 64) if sketch >= 1 << 63 else sketch


def _stored_sketches(db: sqlite3.Connection) -> set[int] | None:
    """The sketches of the file's entries (unsigned); None when one has none (formats 1 and 2 wrote such)."""
    if db.execute("SELECT 1 FROM entries WHERE sketch IS NULL LIMIT 1").fetchone() is not None:
        return None
    return {s & 0xFFFF_FFFF_FFFF_FFFF for (s,) in db.execute("SELECT sketch FROM entries")}


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0
