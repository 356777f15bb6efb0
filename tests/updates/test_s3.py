"""``edgekit publish --upload s3://...``: the bundle in S3-compatible object storage (a real
``moto_server`` process on loopback), devices downloading it from a presigned URL with resume."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from device_agents.updates.download import download
from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.bundle.fleet_protocol import Notice, device_desired_topic, parse_desired, parse_signed
from edgekit.bundle.manifest import sha256_file
from edgekit.errors import MissingSDKError
from edgekit.fleet.s3 import MAX_URL_EXPIRES_S, ObjectStoreError, S3Upload, store_bundle
from edgekit.fleet.session import FleetSession
from tests.updates.conftest import FLEET, AgentFactory, Keys, edgekit
from tests.updates.services import Mosquitto, MotoServer, Watcher

pytest.importorskip("boto3", reason="boto3 is not installed: pip install 'edgekit[s3]'")
pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install 'edgekit[dev]'")

PREFIX = "fleet/bundles"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    yield server
    server.kill()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Test credentials in the environment and no other source of AWS settings (no ~/.aws, no IMDS)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "edgekit-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "edgekit-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _client(server: MotoServer, region: str = "us-east-1") -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=server.url, region_name=region, config=Config(s3={"addressing_style": "path"})
    )


@pytest.fixture
def bucket(s3_server: MotoServer) -> str:
    name = f"edgekit-{uuid.uuid4().hex[:12]}"
    _client(s3_server).create_bucket(Bucket=name)
    return name


def _publish_s3(bundle: Path, broker: Mosquitto, server: MotoServer, bucket: str, keys: Keys, *extra: str) -> str:
    return edgekit(
        "publish", str(bundle), "--broker", broker.url(), "--fleet", FLEET, "--device", "dev-1",
        "--trusted-key", str(keys.public), "--upload", f"s3://{bucket}/{PREFIX}", "--s3-endpoint", server.url,
        "--notice-key", str(keys.notice_private), *extra,
    )  # fmt: skip


def _retained_notice(broker: Mosquitto) -> Notice:
    topic = device_desired_topic(FLEET, "dev-1")
    with FleetSession(BrokerAddress(False, "127.0.0.1", broker.port)) as session:
        state = parse_desired(parse_signed(session.collect_retained(topic, 0.3)[topic]))
    return state.models[0]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()  # type: ignore[no-any-return]  # http.client.HTTPResponse.read


def test_publish_uploads_to_the_content_address_once_and_notices_carry_a_presigned_url(
    broker: Mosquitto, s3_server: MotoServer, bucket: str, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    b = tiny_bundles[2]
    key = f"{PREFIX}/{sha256_file(b)}.ekb"
    first = _publish_s3(b, broker, s3_server, bucket, keys)
    assert f"uploaded {b} to s3://{bucket}/{key}\n" in first
    assert "the URL expires at " in first
    stored = _client(s3_server).get_object(Bucket=bucket, Key=key)["Body"].read()
    assert stored == b.read_bytes()

    notice = _retained_notice(broker)
    url = urlsplit(notice.url)
    assert url.path == f"/{bucket}/{key}"
    query = parse_qs(url.query)
    assert query["X-Amz-Expires"] == [str(MAX_URL_EXPIRES_S)] and query["X-Amz-Signature"]
    assert _get(notice.url) == b.read_bytes()

    second = _publish_s3(b, broker, s3_server, bucket, keys, "--url-expires-s", "3600")
    assert f"s3://{bucket}/{key} exists (same size): upload skipped" in second
    puts = [r for r in s3_server.requests(f"/{bucket}/{PREFIX}/") if r.startswith("PUT ")]
    assert puts == [f"PUT /{bucket}/{key} 200"]
    again = _retained_notice(broker)
    assert again.notice_id != notice.notice_id
    assert parse_qs(urlsplit(again.url).query)["X-Amz-Expires"] == ["3600"]


def test_publish_with_a_public_base_url_points_devices_at_the_object_itself(
    broker: Mosquitto, s3_server: MotoServer, bucket: str, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    everyone = {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/*"}
    policy = {"Version": "2012-10-17", "Statement": [everyone]}
    _client(s3_server).put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))
    b = tiny_bundles[3]
    out = _publish_s3(b, broker, s3_server, bucket, keys, "--base-url", f"{s3_server.url}/{bucket}/")
    notice = _retained_notice(broker)
    assert notice.url == f"{s3_server.url}/{bucket}/{PREFIX}/{sha256_file(b)}.ekb"
    assert _get(notice.url) == b.read_bytes()  # no signature: the bucket policy lets anyone read
    assert "expires" not in out


def test_agent_installs_from_a_presigned_url_resuming_a_download_cut_by_a_kill(
    broker: Mosquitto, s3_server: MotoServer, bucket: str, keys: Keys, agents: AgentFactory, padded_v2: Path
) -> None:
    agent = agents(broker.url(), "dev-1").start(fault="download")  # SIGKILL after the first block
    _publish_s3(padded_v2, broker, s3_server, bucket, keys)
    assert agent.wait_exit(60) == -9, agent.log()[-2000:]
    (part,) = (agent.spec.store / "downloads").glob("*.part")
    assert 0 < part.stat().st_size < padded_v2.stat().st_size

    watcher = Watcher(broker.port, [f"edgekit/{FLEET}/dev-1/reported"])
    try:
        agent.start()
        agent.wait_version("tiny", 2)
        watcher.wait(lambda r: r["state"] == "serving" and r["version"] == 2, 30, "the update to complete")
    finally:
        watcher.close()
    gets = [r.rsplit(" ", 1)[1] for r in s3_server.requests(f"/{bucket}/") if r.startswith("GET ")]
    assert gets == ["200", "206"]  # the whole object, cut off; then the rest of it with a Range request
    assert not list((agent.spec.store / "downloads").glob("*.part"))


def test_downloader_resumes_from_s3_with_its_206_and_content_range(
    s3_server: MotoServer, bucket: str, tmp_path: Path, padded_v2: Path
) -> None:
    data = padded_v2.read_bytes()
    stored = store_bundle(padded_v2, sha256_file(padded_v2), S3Upload(bucket, PREFIX, s3_server.url))
    notice = Notice("n", "2026-03-04T12:00:00Z", "tiny", 2, sha256_file(padded_v2), len(data), stored.url)
    (tmp_path / f"{notice.sha256}.part").write_bytes(data[:300_000])
    got = download(notice, tmp_path, max_bytes=10**8)
    assert got.read_bytes() == data
    (get,) = [r for r in s3_server.requests(f"/{bucket}/") if r.startswith("GET ")]
    assert get.endswith(" 206")


def test_presigned_url_is_signed_for_the_bucket_region(s3_server: MotoServer, tiny_bundles: dict[int, Path]) -> None:
    name = f"edgekit-{uuid.uuid4().hex[:12]}"
    _client(s3_server, "eu-central-1").create_bucket(
        Bucket=name, CreateBucketConfiguration={"LocationConstraint": "eu-central-1"}
    )
    b = tiny_bundles[2]
    url = store_bundle(b, sha256_file(b), S3Upload(name, "", s3_server.url)).url  # the client's region: us-east-1
    (credential,) = parse_qs(urlsplit(url).query)["X-Amz-Credential"]
    assert credential.split("/")[2:] == ["eu-central-1", "s3", "aws4_request"]
    assert urlsplit(url).path == f"/{name}/{sha256_file(b)}.ekb"


def test_upload_refuses_an_object_of_another_size_at_the_content_address(
    s3_server: MotoServer, bucket: str, tiny_bundles: dict[int, Path]
) -> None:
    b = tiny_bundles[2]
    target = S3Upload(bucket, PREFIX, s3_server.url)
    key = target.key(sha256_file(b))
    _client(s3_server).put_object(Bucket=bucket, Key=key, Body=b"torn")
    with pytest.raises(ObjectStoreError, match=r"exists with 4 bytes, not the bundle's \d+.*delete it"):
        store_bundle(b, sha256_file(b), target)
    assert _client(s3_server).get_object(Bucket=bucket, Key=key)["Body"].read() == b"torn"


def test_upload_errors_say_what_to_check(
    s3_server: MotoServer, tiny_bundles: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = tiny_bundles[2]
    with pytest.raises(ObjectStoreError, match="the bucket does not exist; create it or fix --upload"):
        store_bundle(b, sha256_file(b), S3Upload("edgekit-no-such-bucket", "", s3_server.url))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ObjectStoreError, match="no AWS credentials found"):
        store_bundle(b, sha256_file(b), S3Upload("edgekit-no-such-bucket", "", s3_server.url))
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if boto3 were not installed
    with pytest.raises(MissingSDKError, match=r"pip install 'edgekit\[s3\]'"):
        store_bundle(b, sha256_file(b), S3Upload("edgekit-no-such-bucket"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--base-url URL (with --copy-to DIR or a server of your own) or --upload"),
        (["--upload", "s3://bk1/p", "--copy-to", "www"], "--copy-to and --upload both place the bundle"),
        (["--upload", "s3://bk1/p", "--base-url", "http://cdn", "--url-expires-s", "60"], "leave one of them out"),
        (["--base-url", "http://x", "--s3-endpoint", "http://s3", "--s3-region", "r"], "--s3-endpoint, --s3-region go"),
        (["--upload", "s3://bk1", "--url-expires-s", "604801"], "must be 1-604800"),
        (["--upload", "s3://bk1", "--url-expires-s", "0"], "must be 1-604800"),
        (["--upload", "https://bk1/p"], "must be s3://BUCKET or s3://BUCKET/PREFIX"),
        (["--upload", "s3://Bad_Bucket/p"], "not a valid S3 bucket name"),
        (["--upload", "s3://bk1/a//b"], "must not start or end with '/' or hold '//'"),
        (["--upload", "s3://bk1", "--s3-endpoint", "localhost:9000"], "must be http(s)://HOST[:PORT]"),
    ],
)
def test_publish_refuses_bad_storage_options_before_any_work(
    args: list[str], message: str, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    from edgekit.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(
            ["publish", str(tiny_bundles[2]), "--broker", "mqtt://127.0.0.1:1", "--fleet", FLEET, "--device", "d",
             "--trusted-key", str(keys.public), "--notice-key", str(keys.notice_private), *args]
        )  # fmt: skip
    assert rc == 2
    assert message in err.getvalue()


def test_fleet_commands_load_boto3_only_for_an_upload() -> None:
    code = "import sys, edgekit.cli, edgekit.fleet.commands, edgekit.fleet.publish; print('boto3' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
