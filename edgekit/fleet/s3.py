"""Bundles in S3-compatible object storage, for ``edgekit publish --upload s3://BUCKET/PREFIX``.

The bundle goes to the content-addressed key ``PREFIX/<sha256>.ekb``. A key therefore never
changes content: a device that resumes a download with ``Range`` continues the same bytes, and
publishing the same bundle again uploads nothing (an object with that key and size is there
already). An S3 PUT is atomic, so devices never see a half-written object.

Devices fetch the object over plain HTTP(S), with no SDK and no credentials of their own: from
a presigned GET URL (the default; SigV4, valid ``url_expires_s``, at most 7 days), or from
``--base-url`` + key where the bucket, or a CDN in front of it, is public. Credentials come from
boto3's standard chain (environment, ``~/.aws`` config and profiles, SSO, instance or task role).
boto3 is imported only inside this module's functions, when an upload is asked for (extra ``s3``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from edgekit.errors import ConfigError, EdgekitError, MissingSDKError

# SigV4 presigned URLs live at most 7 days (S3 refuses a longer X-Amz-Expires).
MAX_URL_EXPIRES_S = 7 * 24 * 3600
DEFAULT_URL_EXPIRES_S = MAX_URL_EXPIRES_S
# S3's bucket naming rules (general purpose buckets); S3-compatible stores accept these too.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class ObjectStoreError(EdgekitError):
    """The object store could not be reached, refused us, or holds something else at the bundle's key."""

    exit_code = 5


@dataclass(frozen=True)
class S3Upload:
    """Where to upload (``s3://bucket/prefix``, an optional endpoint for S3-compatible stores) and
    how long a presigned URL lives (``url_expires_s``; ``None`` = 7 days, for presigned URLs only)."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    url_expires_s: int | None = None

    def __post_init__(self) -> None:
        if not _BUCKET.match(self.bucket) or ".." in self.bucket:
            raise ConfigError(
                f"--upload: bucket {self.bucket!r} is not a valid S3 bucket name "
                "(3-63 lowercase letters, digits, '.' or '-')"
            )
        if self.prefix != self.prefix.strip("/") or "//" in self.prefix:
            raise ConfigError(f"--upload: prefix {self.prefix!r} must not start or end with '/' or hold '//'")
        if self.endpoint_url is not None and (
            urlsplit(self.endpoint_url).scheme not in ("http", "https") or not urlsplit(self.endpoint_url).netloc
        ):
            raise ConfigError(f"--s3-endpoint {self.endpoint_url!r} must be http(s)://HOST[:PORT]")
        if self.url_expires_s is not None and not 1 <= self.url_expires_s <= MAX_URL_EXPIRES_S:
            raise ConfigError(
                f"--url-expires-s {self.url_expires_s} must be 1-{MAX_URL_EXPIRES_S} "
                "(S3 presigned URLs live at most 7 days); for longer, use a public bucket or CDN with --base-url"
            )

    @classmethod
    def parse(
        cls,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        url_expires_s: int | None = None,
    ) -> S3Upload:
        """``s3://BUCKET`` or ``s3://BUCKET/PREFIX`` (a trailing ``/`` is dropped)."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ConfigError(f"--upload {url!r} must be s3://BUCKET or s3://BUCKET/PREFIX")
        return cls(parts.netloc, parts.path.strip("/"), endpoint_url, region, url_expires_s)

    def key(self, sha256: str) -> str:
        """The content address of a bundle: ``PREFIX/<sha256>.ekb``."""
        return f"{self.prefix}/{sha256}.ekb" if self.prefix else f"{sha256}.ekb"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


@dataclass(frozen=True)
class StoredBundle:
    """The bundle's object and the URL devices download it from."""

    uri: str  # s3://bucket/key
    uploaded: bool  # False: an object with that key and size was there already
    url: str
    url_expires: str | None  # ISO 8601 UTC end of a presigned URL; None for a public URL
    temporary_credentials: bool  # the URL was signed with a session token: it dies with the session


def store_bundle(bundle: Path, sha256: str, target: S3Upload, *, public_base_url: str | None = None) -> StoredBundle:
    """Upload ``bundle`` (whose SHA-256 is ``sha256``) to its key unless it is there already; return
    a presigned GET URL for it, or ``public_base_url`` + key when given."""
    bundle = Path(bundle)
    size = bundle.stat().st_size
    key = target.key(sha256)
    uri = target.uri(key)
    session, client = _client(target, target.region)
    credentials = session.get_credentials()
    if credentials is None:
        raise ObjectStoreError(
            f"no AWS credentials found for {uri}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
            "or configure ~/.aws (the standard AWS credential chain)"
        )
    where = target.endpoint_url or "S3"
    with _translated(f"{uri} at {where}"):
        region = _bucket_region(client, target.bucket)
        existing = _object_size(client, target.bucket, key)
        if existing is None:
            client.upload_file(str(bundle), target.bucket, key, ExtraArgs={"ContentType": "application/octet-stream"})
        elif existing != size:
            raise ObjectStoreError(
                f"{uri} exists with {existing} bytes, not the bundle's {size}: the object at this content address "
                "is damaged; delete it and publish again"
            )
        if public_base_url is not None:
            return StoredBundle(uri, existing is None, f"{public_base_url.rstrip('/')}/{quote(key)}", None, False)
        if target.region is None and region is not None and region != client.meta.region_name:
            # A URL signed for another region than the bucket's is refused: sign for the bucket's.
            _, client = _client(target, region)
        expires_s = target.url_expires_s if target.url_expires_s is not None else DEFAULT_URL_EXPIRES_S
        expires = (datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=expires_s)).isoformat()
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": target.bucket, "Key": key}, ExpiresIn=expires_s
        )
    return StoredBundle(uri, existing is None, url, expires.replace("+00:00", "Z"), bool(credentials.token))


def _client(target: S3Upload, region: str | None) -> tuple[Any, Any]:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise MissingSDKError("boto3", "s3", "uploading bundles to S3 (--upload)") from exc
    session = boto3.session.Session(region_name=region)
    # S3-compatible stores (MinIO, Ceph, moto) are addressed by path: bucket names are not DNS names there.
    addressing = "path" if target.endpoint_url is not None else "auto"
    config = Config(signature_version="s3v4", s3={"addressing_style": addressing})
    return session, session.client("s3", endpoint_url=target.endpoint_url, config=config)


def _bucket_region(client: Any, bucket: str) -> str | None:
    """The bucket's region as the store states it (``x-amz-bucket-region``); ``None`` if it does not."""
    response = client.head_bucket(Bucket=bucket)
    region = response.get("BucketRegion") or response["ResponseMetadata"]["HTTPHeaders"].get("x-amz-bucket-region")
    return str(region) if region else None


def _object_size(client: Any, bucket: str, key: str) -> int | None:
    from botocore.exceptions import ClientError

    try:
        return int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])
    except ClientError as exc:
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            return None
        raise


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """boto3's errors as ``ObjectStoreError`` that says what to check."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchBucket"):
            raise ObjectStoreError(f"{what}: the bucket does not exist; create it or fix --upload") from exc
        if status == 403 or code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise ObjectStoreError(
                f"{what}: access denied ({code}); the credentials need s3:ListBucket, s3:GetObject and "
                "s3:PutObject on the bucket"
            ) from exc
        raise ObjectStoreError(f"{what}: {code} {error.get('Message', '')}".rstrip()) from exc
    except S3UploadFailedError as exc:
        raise ObjectStoreError(f"upload to {what} failed: {exc}") from exc
    except BotoCoreError as exc:
        raise ObjectStoreError(f"{what}: {exc}; check --s3-endpoint, --s3-region and the network") from exc
