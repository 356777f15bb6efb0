"""Mutual TLS as the other way (besides the bearer token) to listen off loopback: certificates
made here (a CA, the agent's server certificate, a client certificate the CA signed, and one
from another CA); a real agent listening on all addresses, reached from this machine's
non-loopback address (a client there is not on loopback) with ``http.client``."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import ssl
from pathlib import Path
from typing import Any

import pytest

from tests.agent.conftest import Bundles, agent_cli, start_agent, write_config
from tests.agent.test_client_held import _off_loopback_address
from tests.factories import sample_inputs


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _cert(name: str, key: Any, issuer: tuple[str, Any] | None, *, ca: bool = False, ips: tuple[str, ...] = ()) -> Any:
    """A certificate for ``name``/``key``, signed by ``issuer`` (name, key), else self-signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    issuer_name, issuer_key = issuer if issuer is not None else (name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)
    else:
        purpose = ExtendedKeyUsageOID.SERVER_AUTH if ips else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
    if ips:
        names = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, stem: str, cert: Any, key: Any) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ca.crt; server.crt/.key (for this machine's address); client.crt/.key (signed by ca);
    rogue.crt/.key (signed by another CA)."""
    d = tmp_path_factory.mktemp("pki")
    address = _off_loopback_address()
    ca_key, other_ca_key = _key(), _key()
    ca = _cert("edgekit test CA", ca_key, None, ca=True)
    _write(d, "ca", ca, ca_key)
    server_key, client_key, rogue_key = _key(), _key(), _key()
    _write(d, "server", _cert("agent", server_key, ("edgekit test CA", ca_key), ips=(address, "127.0.0.1")), server_key)
    _write(d, "client", _cert("device-client", client_key, ("edgekit test CA", ca_key)), client_key)
    _write(d, "rogue", _cert("rogue-client", rogue_key, ("another CA", other_ca_key)), rogue_key)
    return {p.stem + p.suffix: p for p in d.iterdir()}


def _client_context(pki: dict[str, Path], who: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca.crt"]))
    if who is not None:
        context.load_cert_chain(pki[f"{who}.crt"], pki[f"{who}.key"])
    return context


def _request(
    address: str, port: int, context: ssl.SSLContext, method: str, path: str, body: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPSConnection(address, port, timeout=30, context=context)
    try:
        conn.request(method, path, body)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


MTLS = '[server]\ntls_cert_file = "{d}/server.crt"\ntls_key_file = "{d}/server.key"\nclient_ca_file = "{d}/ca.crt"\n'


def test_mtls_serves_a_client_certificate_from_the_ca_and_refuses_others_off_loopback(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, pki: dict[str, Path]
) -> None:
    address = _off_loopback_address()
    config = write_config(tmp_path / "a", keypair[1], MTLS.format(d=pki["ca.crt"].parent), listen="0.0.0.0:0")
    done = agent_cli("install", str(bundles.v1), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    agent = start_agent(config)  # (its readiness probe: https on loopback, no certificate needed there)
    try:
        assert agent.url.startswith("https://")
        port = int(agent.url.rsplit(":", 1)[1])
        x = sample_inputs(1)
        infer = json.dumps(
            {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
        ).encode()

        certified = _client_context(pki, "client")
        assert _request(address, port, certified, "GET", "/v2")[0] == 200
        status, doc = _request(address, port, certified, "POST", "/v2/models/tiny/infer", infer)
        assert status == 200 and doc["outputs"][0]["shape"] == [1, 10]

        anonymous = _client_context(pki, None)
        status, doc = _request(address, port, anonymous, "GET", "/v2")
        assert status == 403
        assert doc["error"] == (
            "this agent takes requests from off the device with a client certificate signed by the CA in "
            "server.client_ca_file"
        )
        assert _request(address, port, anonymous, "POST", "/v2/models/tiny/infer", infer)[0] == 403
        assert _request(address, port, anonymous, "GET", "/v2/health/ready")[0] == 200  # probes are open

        with pytest.raises((ssl.SSLError, ConnectionError)):  # a certificate another CA signed: no handshake
            _request(address, port, _client_context(pki, "rogue"), "GET", "/v2")
        plain = http.client.HTTPConnection(address, port, timeout=30)  # no TLS at all: nothing served
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/v2")
            plain.getresponse().read()
        plain.close()

        # the device's own tools reach the daemon over https on loopback without a certificate
        again = agent_cli("install", str(bundles.v2), "--config", str(config))
        assert again.returncode == 0 and "installed tiny v2" in again.stdout, again.stdout + again.stderr
    finally:
        assert agent.stop() == 0


def test_non_loopback_listen_without_token_or_mtls_refuses_to_start_saying_both_ways(
    tmp_path: Path, keypair: tuple[Path, Path], pki: dict[str, Path]
) -> None:
    # TLS alone (no client CA) authenticates no client: still refused
    tls_only = f'[server]\ntls_cert_file = "{pki["server.crt"]}"\ntls_key_file = "{pki["server.key"]}"\n'
    config = write_config(tmp_path / "open", keypair[1], tls_only, listen="0.0.0.0:0")
    done = agent_cli("run", "--config", str(config), timeout=60)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "0.0.0.0:0" in line]
    assert len(lines) == 1, done.stderr
    assert "auth_token_file" in lines[0] and "tls_cert_file, tls_key_file and client_ca_file" in lines[0]


@pytest.mark.parametrize(
    ("server", "says"),
    [
        ('tls_cert_file = "a.crt"\n', "tls_cert_file and tls_key_file go together"),
        ('client_ca_file = "ca.crt"\n', "client_ca_file needs tls_cert_file and tls_key_file"),
    ],
)
def test_tls_settings_that_do_not_go_together_are_config_errors(
    tmp_path: Path, keypair: tuple[Path, Path], server: str, says: str
) -> None:
    from device_agents.config import load_config
    from edgekit.bundle.errors import ConfigError

    config = write_config(tmp_path, keypair[1], f"[server]\n{server}")
    with pytest.raises(ConfigError, match=says):
        load_config(config)


def test_tls_files_that_do_not_load_stop_the_start_with_what_to_give(
    tmp_path: Path, keypair: tuple[Path, Path], pki: dict[str, Path]
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "garbage.crt").write_text("not a certificate\n")
    bad = f'[server]\ntls_cert_file = "garbage.crt"\ntls_key_file = "{pki["server.key"]}"\n'
    done = agent_cli("run", "--config", str(write_config(tmp_path / "a", keypair[1], bad)), timeout=60)
    assert done.returncode != 0
    assert "server.tls_cert_file" in done.stderr and "give a PEM certificate chain" in done.stderr, done.stderr


def test_a_tls_handshake_trickled_a_byte_at_a_time_is_closed_after_header_timeout_s(
    tmp_path: Path, keypair: tuple[Path, Path], pki: dict[str, Path]
) -> None:
    import select
    import socket
    import time

    extra = MTLS.format(d=pki["ca.crt"].parent) + "header_timeout_s = 1.0\nidle_timeout_s = 30.0\n"
    agent = start_agent(write_config(tmp_path / "a", keypair[1], extra))
    try:
        host, port = agent.url.removeprefix("https://").split(":")
        slow = socket.create_connection((host, int(port)), timeout=10)
        hello = b"\x16\x03\x01\x02\x00" + b"\x01" * 512  # a TLS record header announcing 512 bytes, then them
        sent, closed = 0, False
        try:
            # a byte every 0.4 s: each read waits less than header_timeout_s, the whole handshake longer
            while sent < 40 and not closed:
                slow.send(hello[sent : sent + 1])
                sent += 1
                if select.select([slow], [], [], 0.4)[0]:
                    closed = slow.recv(1) == b""
                else:
                    time.sleep(0)
        except (ConnectionResetError, BrokenPipeError):
            closed = True
        finally:
            slow.close()
        # closed after about 1 s (a few bytes), long before 40 bytes (16 s), which the connection's
        # idle_timeout_s (30 s) would have let through
        assert closed and sent < 40, sent
        status, _ = _request("127.0.0.1", int(port), _client_context(pki, None), "GET", "/v2/health/ready")
        assert status == 200
    finally:
        assert agent.stop() == 0
