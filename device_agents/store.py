"""The agent's local store: verified bundles, per-model A/B slots and a durable state file.

Layout under ``root``::

    state.json  state.json.bak      per-model slots and the anti-rollback counter
    lock                            flock'd by the one writer (daemon or `install`)
    bundles/<sha256>.ekb            bundles as received, addressed by hash
    models/<name>/<version>-<sha12>/ extracted and verified files + manifest.json
    tmp/                            downloads and extractions in progress (debris is removed at start)

Every state change is write -> fsync -> rename -> fsync(dir), and the previous state is kept as
``state.json.bak`` so a truncated or zeroed primary (power loss on a lying disk) still loads.
When neither loads (``StateUnreadableError``), the lifecycle sets both aside as ``*.unreadable``
and rebuilds the state from the slots on disk that verify (``integrity.rebuild_state``).

A model name has three slots: ``active`` (served), ``candidate`` (staged, being tested) and
``previous`` (last good, for rollback). ``max_version`` is the anti-rollback counter: the
highest version ever *committed* (promoted to active), raised in the same state write as the
promotion. A candidate that fails its self-test never raises it, so a signed but broken build
with a huge version cannot block later releases. Versions below it are refused; the counter's
own version may be staged again (after a rollback, a local ``install`` may put it back). The
update client additionally refuses a version it rolled back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from device_agents.errors import StoreError
from edgekit.bundle import TrustStore, VerifiedManifest, extract, read_verified_manifest, verify_extracted
from edgekit.bundle.archive import read_head
from edgekit.bundle.codec import from_data, to_data, upgrade
from edgekit.bundle.errors import BundleError
from edgekit.bundle.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, sha256_file, utc_now

STATE_VERSION = 2


def _state_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    # v1 kept the active slot's health in ``status``: "serving" meant still in its health window.
    models = {
        name: {**ms, "active_healthy": ms.get("status", "empty") != "serving"} if isinstance(ms, dict) else ms
        for name, ms in (data.get("models") or {}).items()
    }
    return {**data, "schema_version": 2, "models": models}


# schema_version -> function upgrading a state dict of that version by one step.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _state_v1_to_v2}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new content."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.errno == errno.ENOSPC:
            raise StoreError(f"no space left writing {path}; free disk space (nothing was changed)") from exc
        raise StoreError(f"cannot write {path}: {exc}") from exc


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself), files first."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


@contextlib.contextmanager
def flock(path: Path, timeout_s: float) -> Iterator[bool]:
    """Hold an exclusive flock on ``path`` (polling up to ``timeout_s``); yields False if another has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Slot:
    version: int
    sha256: str  # of the .ekb
    path: str  # model dir relative to the store root
    installed: str = ""


@dataclass(frozen=True)
class ModelState:
    max_version: int = 0
    active: Slot | None = None
    candidate: Slot | None = None
    previous: Slot | None = None
    # the last event: empty, serving, healthy, staged, testing, switching, failed, rolled_back, degraded
    # (degraded: the active slot did not load at start; the previous version serves for now)
    status: str = "empty"
    error: str = ""
    updated: str = ""
    # Crash-loop guard for the active slot, apart from ``status`` (which a rejected *candidate*
    # overwrites): has the active version run through its health window, and how many agent
    # starts has it seen before that.
    active_healthy: bool = False
    boots_since_switch: int = 0
    last_notice_id: str = ""  # id of the last desired-state notice applied (replay guard)
    last_notice_issued: str = ""  # its ``issued`` time: notices issued earlier are stale


@dataclass(frozen=True)
class State:
    schema_version: int = STATE_VERSION
    models: dict[str, ModelState] = field(default_factory=dict)


@dataclass(frozen=True)
class Staged:
    manifest: Manifest
    slot: Slot
    key_id: str


class StateUnreadableError(StoreError):
    """``state.json`` and its backup both exist and neither reads (corrupt, truncated, an I/O
    error): the lifecycle rebuilds the state from the verified slots on disk
    (``integrity.rebuild_state``)."""


class Store:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        for sub in ("bundles", "models", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.state_path = self.root / "state.json"
        self.backup_path = self.root / "state.json.bak"

    # -- locking ------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, timeout_s: float = 30.0) -> Iterator[None]:
        """Exclusive writer lock (one daemon or one `install` at a time)."""
        with flock(self.root / "lock", timeout_s) as held:
            if not held:
                raise StoreError(
                    f"{self.root}/lock is held by another writer for {timeout_s:.0f}s; "
                    "is another `edgekit-agent install` running?"
                )
            yield

    # -- state --------------------------------------------------------------------------
    def load_state(self) -> State:
        for path in (self.state_path, self.backup_path):
            try:
                data = json.loads(path.read_bytes())
            except FileNotFoundError:
                continue
            except (ValueError, OSError):
                continue  # truncated / zeroed / unreadable: fall back to the backup copy
            if isinstance(data, dict) and isinstance(data.get("schema_version"), int):
                if data["schema_version"] > STATE_VERSION:  # not corrupt: written by a newer agent
                    raise StoreError(
                        f"{path}: schema_version {data['schema_version']} is newer than this agent understands "
                        f"({STATE_VERSION}); upgrade edgekit-agent"
                    )
                try:
                    return from_data(State, self._upgrade(data), "state", StoreError)
                except StoreError:
                    continue  # corrupt content: fall back to the backup copy
        if self.state_path.exists() or self.backup_path.exists():
            raise StateUnreadableError(
                f"{self.state_path} and its backup are both unreadable; the agent rebuilds them from the verified "
                "slots at its next start (edgekit-agent run)"
            )
        return State()

    def set_aside_state(self) -> list[Path]:
        """Rename unreadable state files to ``*.unreadable`` (kept for a look, out of the way of the
        next ``save_state``); returns the new paths."""
        moved = []
        for path in (self.state_path, self.backup_path):
            if path.exists():
                aside = path.with_name(path.name + ".unreadable")
                os.replace(path, aside)
                moved.append(aside)
        fsync_dir(self.root)
        return moved

    def slot_dirs(self) -> Iterator[Slot]:
        """Every extracted slot under ``models/`` (not ``.partial`` debris), whatever the state says;
        ``sha256`` is the full hash of its kept bundle when that is here, else the dir's 12-digit prefix."""
        kept = [b.name.split(".")[0] for b in (self.root / "bundles").iterdir() if b.name.endswith(".ekb")]
        for name_dir in sorted(p for p in (self.root / "models").iterdir() if p.is_dir()):
            for d in sorted(p for p in name_dir.iterdir() if p.is_dir() and not p.name.endswith(".partial")):
                prefix = _sha_prefix(d.name)
                sha = next((k for k in kept if prefix and k.startswith(prefix)), prefix)
                yield Slot(_version_of(d.name), sha, str(d.relative_to(self.root)))

    @staticmethod
    def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
        return upgrade(data, "schema_version", STATE_VERSION, MIGRATIONS, "state", StoreError, "upgrade edgekit-agent")

    def save_state(self, state: State) -> None:
        data = json.dumps(to_data(state), indent=1).encode() + b"\n"
        if self.state_path.exists():
            # keep the last good primary as backup (only if it parses: never back up garbage)
            with contextlib.suppress(ValueError, StoreError, OSError):
                old = self.state_path.read_bytes()
                from_data(State, json.loads(old), "state", StoreError)
                atomic_write(self.backup_path, old)
        atomic_write(self.state_path, data)

    def model_state(self, name: str) -> ModelState:
        return self.load_state().models.get(name, ModelState())

    def update_model(self, name: str, fn: Callable[[ModelState], ModelState]) -> ModelState:
        state = self.load_state()
        new = replace(fn(state.models.get(name, ModelState())), updated=utc_now())
        self.save_state(replace(state, models={**state.models, name: new}))
        return new

    # -- bundles ------------------------------------------------------------------------
    def stage(
        self,
        bundle: Path,
        trust: TrustStore,
        *,
        compatible: Callable[[Manifest], None] | None = None,
        max_bundle_bytes: int = 2 * 1024**3,
    ) -> Staged:
        """Verify and extract ``bundle`` into a new model dir, record it as candidate.

        Raises ``RollbackError`` for a version below the counter. Re-staging the installed
        active version returns its existing slot (a no-op).
        """
        state = self.load_state()
        # Peek at the name first (signature is checked again with the counter below).
        vm = read_verified_manifest(bundle, trust, max_bundle_bytes=max_bundle_bytes, compatible=compatible)
        ms = state.models.get(vm.manifest.name, ModelState())
        sha = sha256_file(bundle)
        # The active version is a no-op even when a higher (rejected) version raised the counter.
        m = vm.manifest
        if ms.active is not None and ms.active.version == m.version:
            # a prefix: the slot was found on disk without its kept bundle (a rebuilt state)
            if not sha.startswith(ms.active.sha256):
                raise BundleError(f"{m.name} v{m.version} is installed with other content; publish a higher --version")
            return Staged(m, ms.active, vm.key_id)
        vm = read_verified_manifest(
            bundle, trust, max_bundle_bytes=max_bundle_bytes, installed_version=ms.max_version, compatible=compatible
        )
        m = vm.manifest
        rel = f"models/{m.name}/{m.version}-{sha[:12]}"
        dest = self.root / rel
        if dest.exists():  # debris of an earlier attempt at the same bundle: start over
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        kept = self.root / "bundles" / f"{sha}.ekb"
        if not kept.exists():
            tmp = self.root / "tmp" / f"{sha}.ekb"
            try:
                shutil.copyfile(bundle, tmp)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise StoreError(f"cannot copy the bundle into {self.root}: {exc}") from exc
            os.replace(tmp, kept)
            fsync_dir(kept.parent)
        try:
            extract(kept, vm, dest)
            # extract writes without fsync: make the files durable before a slot points at them
            fsync_tree(dest)
        except OSError as exc:
            raise StoreError(f"cannot extract into {dest}: {exc}") from exc
        except BundleError as exc:
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno in (errno.ENOSPC, errno.EDQUOT):
                # a full disk is not the bundle's fault: StoreError lets the update be tried again
                raise StoreError(f"no space left extracting into {dest}; free disk space and try again") from exc
            raise
        fsync_dir(dest.parent)
        slot = Slot(version=m.version, sha256=sha, path=rel, installed=utc_now())
        self.update_model(
            m.name,
            lambda s: replace(s, candidate=slot, status="staged", error=""),
        )
        return Staged(m, slot, vm.key_id)

    def promote(self, name: str) -> ModelState:
        """candidate -> active, active -> previous, counter raised (one atomic state write)."""

        def fn(s: ModelState) -> ModelState:
            if s.candidate is None:
                raise StoreError(f"{name}: no candidate to promote")
            prev = s.active if s.active is not None and s.active != s.candidate else s.previous
            return replace(
                s,
                active=s.candidate,
                candidate=None,
                previous=prev,
                max_version=max(s.max_version, s.candidate.version),  # the anti-rollback counter rises at commit
                status="serving",
                error="",
                active_healthy=False,
                boots_since_switch=0,
            )

        return self.update_model(name, fn)

    def reject_candidate(self, name: str, error: str) -> ModelState:
        return self.update_model(name, lambda s: replace(s, candidate=None, status="failed", error=error))

    def rollback(self, name: str, error: str) -> ModelState:
        """active -> previous; the rolled-back version stays counted (no re-install of it)."""

        def fn(s: ModelState) -> ModelState:
            if s.previous is None:
                raise StoreError(f"{name}: no previous version to roll back to")
            return replace(
                s,
                active=s.previous,
                previous=None,
                candidate=None,
                status="rolled_back",
                error=error,
                active_healthy=True,  # the last good version: not watched for crash loops again
                boots_since_switch=0,
            )

        return self.update_model(name, fn)

    def manifest_of(self, slot: Slot) -> Manifest:
        return Manifest.from_json((self.root / slot.path / "manifest.json").read_bytes())

    def model_dir(self, slot: Slot) -> Path:
        return self.root / slot.path

    def verify_slot(self, slot: Slot, trust: TrustStore) -> VerifiedManifest:
        """Verify ``slot``'s files at rest against its signed manifest and today's ``trust``
        (a key revoked since the install fails it). Raises ``SignatureError`` / ``BundleError``
        (``__cause__`` an ``OSError`` when a file is missing or unreadable: maybe transient).

        A slot extracted before signatures were kept beside the files takes its signature from
        the kept bundle (``bundles/<sha>.ekb``, whose manifest must be byte-identical) and keeps
        a copy from then on."""
        d = self.model_dir(slot)
        if (d / SIGNATURE_NAME).exists():
            return verify_extracted(d, trust)
        kept = self.root / "bundles" / f"{slot.sha256}.ekb"
        try:
            raw, sig = read_head(kept)
            same = (d / MANIFEST_NAME).read_bytes() == raw
        except (OSError, BundleError) as exc:
            raise BundleError(f"{d} has no {SIGNATURE_NAME} and {kept} cannot be read ({exc})") from exc
        if not same:
            raise BundleError(f"{d}/{MANIFEST_NAME} differs from what {kept.name} signed: changed at rest")
        verified = verify_extracted(d, trust, signature=sig)
        with contextlib.suppress(StoreError):  # only a cache: the next check reads the bundle again
            atomic_write(d / SIGNATURE_NAME, sig)
        return verified

    def verify_slot_signature(self, slot: Slot, trust: TrustStore) -> str:
        """The signer's key id if ``trust`` still accepts ``slot``'s signed manifest (signature, key
        not revoked, the key's names), its files left unhashed: the cheap half of ``verify_slot``,
        for a change of trust. Raises ``SignatureError``; ``OSError``, ``BundleError`` or
        ``ManifestError`` when it cannot be read."""
        d = self.model_dir(slot)
        raw = (d / MANIFEST_NAME).read_bytes()
        sig_path = d / SIGNATURE_NAME
        sig = sig_path.read_bytes() if sig_path.exists() else read_head(self.root / "bundles" / f"{slot.sha256}.ekb")[1]
        kid = trust.verify(raw, sig)
        trust.check_name(kid, Manifest.from_json(raw).name)
        return kid

    # -- housekeeping -------------------------------------------------------------------
    def cleanup(self, keep_extra: int = 1) -> list[str]:
        """Remove debris and old bundles; keep active, previous, candidate and the newest.

        Never removes a dir that a slot references (so never the loaded model).
        """
        removed = []
        for p in (self.root / "tmp").iterdir():
            _remove(p)
            removed.append(str(p.relative_to(self.root)))
        state = self.load_state()
        referenced_dirs, referenced_shas = set(), set()
        for ms in state.models.values():
            for slot in (ms.active, ms.candidate, ms.previous):
                if slot is not None:
                    referenced_dirs.add(slot.path)
                    referenced_shas.add(slot.sha256)
        models = self.root / "models"
        for name_dir in models.iterdir():
            dirs = sorted(
                (d for d in name_dir.iterdir() if d.is_dir()),
                key=lambda d: _version_of(d.name),
                reverse=True,
            )
            extra = 0
            for d in dirs:
                rel = str(d.relative_to(self.root))
                if rel in referenced_dirs:
                    continue
                if d.name.endswith(".partial") or extra >= keep_extra:
                    _remove(d)
                    removed.append(rel)
                else:
                    extra += 1
                    referenced_shas.add(_sha_prefix(d.name))
        for b in (self.root / "bundles").iterdir():
            sha = b.name.split(".")[0]
            if sha not in referenced_shas and sha[:12] not in referenced_shas:
                _remove(b)
                removed.append(str(b.relative_to(self.root)))
        return removed

    def describe(self) -> dict[str, Any]:
        state: dict[str, Any] = to_data(self.load_state())
        return state


def _version_of(dirname: str) -> int:
    head = dirname.split("-", 1)[0]
    return int(head) if head.isdigit() else -1


def _sha_prefix(dirname: str) -> str:
    return dirname.split("-", 1)[1].split(".")[0] if "-" in dirname else ""


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
