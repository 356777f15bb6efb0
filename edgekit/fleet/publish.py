"""``edgekit publish``: tell devices to run a bundle, and put the bundle where they can fetch it.

The bundle is verified here first (signature against ``--trusted-key``, expiry, schema), so that
a bundle the devices would refuse is refused before it reaches a fleet. The notice built from
its verified manifest is published retained with QoS 1 on each device or group topic; devices
that are offline pick it up when they reconnect. The bundle reaches the devices one of two ways:

- ``--copy-to DIR`` places it in a directory that an HTTP(S) server serves at ``--base-url``;
- ``--upload s3://BUCKET/PREFIX`` puts it in S3-compatible object storage under its content
  address and points the notice at a presigned GET URL, or at ``--base-url`` + key where the
  bucket is public (``edgekit.fleet.s3``).

Without either, the bundle must already be at ``<base-url>/<file name>``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

from device_agents.updates.connection import BrokerAddress
from device_agents.updates.protocol import (
    NOTICE_SCHEMA_VERSION,
    Notice,
    NoticeError,
    device_desired_topic,
    group_desired_topic,
)
from edgekit.bundle import TrustStore, VerifiedManifest, read_verified_manifest
from edgekit.bundle.manifest import sha256_file, utc_now
from edgekit.errors import ConfigError
from edgekit.fleet.s3 import S3Upload, StoredBundle, store_bundle
from edgekit.fleet.session import FleetSession

_NO_SOURCE = (
    "say where devices download the bundle: --base-url URL (with --copy-to DIR or a server of your own) "
    "or --upload s3://BUCKET/PREFIX"
)


@dataclass(frozen=True)
class PublishOptions:
    broker: BrokerAddress
    fleet: str
    base_url: str | None  # None only with ``upload``: devices get a presigned URL
    trusted_keys: tuple[Path, ...]
    devices: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    rollout_percent: int = 100
    copy_to: Path | None = None
    timeout_s: float = 10.0
    upload: S3Upload | None = None

    def __post_init__(self) -> None:
        if not self.devices and not self.groups:
            raise ConfigError("name the devices or groups to update: --device ID or --group NAME")
        if self.base_url is None and self.upload is None:
            raise ConfigError(_NO_SOURCE)
        if self.base_url is not None and urlsplit(self.base_url).scheme not in ("http", "https"):
            raise ConfigError(f"--base-url {self.base_url!r} must start with http:// or https://")
        if self.upload is not None and self.copy_to is not None:
            raise ConfigError("--copy-to and --upload both place the bundle; choose one")
        if self.upload is not None and self.base_url is not None and self.upload.url_expires_s is not None:
            raise ConfigError(
                "--url-expires-s is the life of a presigned URL, but with --base-url devices download from the "
                "public URL: leave one of them out"
            )
        if not 0 <= self.rollout_percent <= 100:
            raise ConfigError(f"--rollout {self.rollout_percent} must be 0-100 (percent of devices)")
        if not self.trusted_keys:
            raise ConfigError("--trusted-key PUB is required: the bundle is verified before it is published")

    def topics(self) -> tuple[str, ...]:
        try:
            return tuple(device_desired_topic(self.fleet, d) for d in self.devices) + tuple(
                group_desired_topic(self.fleet, g) for g in self.groups
            )
        except NoticeError as exc:
            raise ConfigError(str(exc)) from exc


@dataclass(frozen=True)
class Published:
    notice: Notice
    topics: tuple[str, ...]
    copied_to: Path | None
    stored: StoredBundle | None = None  # with ``upload``


def build_notice(bundle: Path, verified: VerifiedManifest, url: str, *, rollout_percent: int = 100) -> Notice:
    """The desired-state notice for ``bundle`` (whose manifest was verified as ``verified``)."""
    m = verified.manifest
    return Notice(
        schema_version=NOTICE_SCHEMA_VERSION,
        notice_id=uuid.uuid4().hex,
        issued=utc_now(),
        name=m.name,
        version=m.version,
        sha256=sha256_file(bundle),
        size_bytes=Path(bundle).stat().st_size,
        url=url,
        rollout_percent=rollout_percent,
        target=m.target,
        expires=m.expires,
        signer_key_id=verified.key_id,
    )


def bundle_url(base_url: str, bundle: Path) -> str:
    return f"{base_url.rstrip('/')}/{quote(Path(bundle).name)}"


def copy_bundle(bundle: Path, directory: Path) -> Path:
    """Place ``bundle`` in ``directory`` under its own name, atomically; refuse to replace other content."""
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / Path(bundle).name
    if dest.exists():
        if sha256_file(dest) == sha256_file(bundle):
            return dest
        raise ConfigError(
            f"{dest} exists with other content; devices may be downloading it. Give the new bundle another file name"
        )
    tmp = directory / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        shutil.copyfile(bundle, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def publish(bundle: Path, options: PublishOptions) -> Published:
    """Verify ``bundle``, copy (``copy_to``) or upload it (``upload``), then publish its notice on every topic."""
    bundle = Path(bundle)
    trust = TrustStore.from_files(options.trusted_keys)
    verified = read_verified_manifest(bundle, trust)
    topics = options.topics()
    copied = copy_bundle(bundle, options.copy_to) if options.copy_to is not None else None
    stored = None
    if options.upload is not None:
        stored = store_bundle(bundle, sha256_file(bundle), options.upload, public_base_url=options.base_url)
        url = stored.url
    elif options.base_url is not None:
        url = bundle_url(options.base_url, bundle)
    else:  # PublishOptions refuses this combination already; this branch narrows the type
        raise ConfigError(_NO_SOURCE)
    notice = build_notice(bundle, verified, url, rollout_percent=options.rollout_percent)
    with FleetSession(options.broker, timeout_s=options.timeout_s) as session:
        for topic in topics:
            session.publish_retained(topic, notice.to_json())
    return Published(notice, topics, copied, stored)
