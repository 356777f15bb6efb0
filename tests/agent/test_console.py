"""The serial console against a real `edgekit-agent run` process, over a real tty pair.

The agent opens one end of a null-modem cable (two pty pairs joined by a thread,
``examples.serial_link``) as its ``[console] device``; the host client opens the other end with
pyserial. Nothing goes over HTTP in these tests except where a test says it checks against it.
"""

from __future__ import annotations

import hashlib
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import serial

from device_agents.serving.console_frames import FrameReader, FrameWriter, MessageType, pack_message, unpack_message
from edgekit.board import BoardClient, BoardError
from examples.serial_link import NullModem
from tests.agent.conftest import AgentFactory, Bundles, RunningAgent, write_config
from tests.factories import sample_inputs


@pytest.fixture()
def link() -> Iterator[NullModem]:
    with NullModem() as cable:
        yield cable


@pytest.fixture()
def console_agent(
    tmp_path: Path, keypair: tuple[Path, Path], agent_factory: AgentFactory, link: NullModem
) -> RunningAgent:
    config = write_config(tmp_path / "agent", keypair[1], f'[console]\ndevice = "{link.device_port}"\n')
    return agent_factory(config)


def _reference(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {session.get_inputs()[0].name: x})[0])


def test_console_installs_and_infers_over_serial_only(
    console_agent: RunningAgent, link: NullModem, bundles: Bundles, tiny_model: Path
) -> None:
    with BoardClient(link.host_port, timeout_s=60) as board:
        assert board.status()["models"] == {}
        chunks: list[int] = []
        result = board.install(bundles.v1, chunk_bytes=4096, progress=lambda done, total: chunks.append(done))
        assert result["name"] == "tiny" and result["version"] == 1 and result["origin"] == "console"
        assert len(chunks) > 1 and chunks[-1] == bundles.v1.stat().st_size  # it went in several chunks
        status = board.status()
        assert status["ready"] and status["models"] == {"tiny": 1}
        assert status["status"]["tiny"]["active"] == 1
        x = sample_inputs(2, seed=11)
        out = board.infer("tiny", {"input": x})
        np.testing.assert_allclose(out["probs"], _reference(tiny_model, x), rtol=1e-5, atol=1e-6)
        assert any("installed" in line or "tiny" in line for line in board.logs(50))
        assert "tiny" in board.stats()
        # the same model answers over the loopback API: one service behind both front-ends
        with urllib.request.urlopen(f"{console_agent.url}/v2/models/tiny/ready", timeout=5) as resp:
            assert resp.status == 200
    assert not (console_agent.config.parent / "store" / "uploads" / f"{_sha(bundles.v1)}.ekb").exists()


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_console_rejects_a_corrupted_frame_and_the_session_recovers(
    console_agent: RunningAgent, link: NullModem
) -> None:
    port = serial.Serial(link.host_port, timeout=0.05)
    try:
        writer, reader = FrameWriter(), FrameReader()

        def exchange(wire: bytes) -> list[tuple[MessageType, int, dict[str, object]]]:
            port.write(wire)
            got: list[tuple[MessageType, int, dict[str, object]]] = []
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                for item in reader.feed(port.read(4096)):
                    assert not isinstance(item, Exception), item
                    got.append((item.type, item.ack, unpack_message(item.payload)[0]))
            return got

        hello, wire = writer.frame(MessageType.HELLO, pack_message({}))
        [(kind, ack, _)] = exchange(wire)
        assert (kind, ack) == (MessageType.RESULT, hello.seq)
        sent, wire = writer.frame(MessageType.STATUS, pack_message({}))
        damaged = bytearray(wire)
        damaged[len(damaged) // 2] ^= 0x20  # a flipped bit on the line
        [(kind, ack, doc)] = exchange(bytes(damaged))
        assert (kind, ack, doc["error_type"]) == (MessageType.ERROR, 0, "CorruptFrameError")
        [(kind, ack, doc)] = exchange(wire[: len(wire) // 2] + b"\x00")  # cut short, then the line idles
        assert (kind, ack) == (MessageType.ERROR, 0) and doc["error_type"] in (
            "CorruptFrameError",
            "TruncatedFrameError",
        )
        [(kind, ack, doc)] = exchange(wire)  # the same frame, intact: answered
        assert (kind, ack) == (MessageType.RESULT, sent.seq) and doc["models"] == {}
        [(kind, ack, doc)] = exchange(wire)  # replayed: refused by its sequence number
        assert (kind, ack, doc["error_type"]) == (MessageType.ERROR, 0, "ReplayedFrameError")
        nxt, wire = writer.frame(MessageType.STATUS, pack_message({}))
        [(kind, ack, _)] = exchange(wire)
        assert (kind, ack) == (MessageType.RESULT, nxt.seq)
    finally:
        port.close()


def test_board_client_resends_a_request_the_line_corrupted(console_agent: RunningAgent, link: NullModem) -> None:
    with BoardClient(link.host_port, timeout_s=30) as board:
        link.corrupt_next("to_device", 5)
        assert board.status()["models"] == {}
        assert board.errors_seen and board.errors_seen[0]["error_type"] == "CorruptFrameError"  # type: ignore[index]  # the agent's error document


def test_console_answers_errors_as_error_frames_and_goes_on(console_agent: RunningAgent, link: NullModem) -> None:
    with BoardClient(link.host_port, timeout_s=30) as board:
        with pytest.raises(BoardError, match=r"missing") as caught:
            board.infer("missing", {"input": sample_inputs(1)})
        assert caught.value.error_type == "ModelNotFoundError"
        with pytest.raises(BoardError) as bad_upload:
            board.request(MessageType.INSTALL_CHUNK, {"sha256": "0" * 64, "offset": 0}, b"data")
        assert bad_upload.value.error_type == "UploadError"
        assert board.status()["ready"] is True


def test_console_resumes_an_interrupted_upload(console_agent: RunningAgent, link: NullModem, bundles: Bundles) -> None:
    data = bundles.v2.read_bytes()
    sha = _sha(bundles.v2)
    with BoardClient(link.host_port, timeout_s=60) as board:
        assert board.request(MessageType.INSTALL_BEGIN, {"sha256": sha, "size_bytes": len(data)})[0]["offset"] == 0
        board.request(MessageType.INSTALL_CHUNK, {"sha256": sha, "offset": 0}, data[:5000])
    # a new session (the host restarted): the agent still holds the first 5000 bytes
    with BoardClient(link.host_port, timeout_s=60) as board:
        sent: list[int] = []
        result = board.install(bundles.v2, chunk_bytes=4096, progress=lambda done, total: sent.append(done))
        assert result["version"] == 2
        assert sent[0] == 5000 + 4096  # it went on from the agent's offset


def test_console_restart_stops_the_agent_cleanly(console_agent: RunningAgent, link: NullModem) -> None:
    with BoardClient(link.host_port, timeout_s=30) as board:
        assert board.restart() == {"restarting": True}
    assert console_agent.proc.wait(timeout=30) == 0
    info = console_agent.config.parent / "store" / "daemon.json"
    assert not info.exists()  # it went through the daemon's own stop path


def test_console_config_defaults_uploads_under_the_store_and_names_unknown_keys(tmp_path: Path) -> None:
    from device_agents.config import config_from_data
    from edgekit.bundle.errors import ConfigError

    base = {"store": "store", "trusted_keys": ["k.pub"], "config_version": 2}
    config = config_from_data({**base, "console": {"device": "/dev/ttyGS0"}}, tmp_path)
    assert config.console is not None and config.console.upload_dir == tmp_path / "store" / "uploads"
    with pytest.raises(ConfigError, match=r"agent\.console: unknown key 'devcie'.*did you mean 'device'"):
        config_from_data({**base, "console": {"devcie": "/dev/ttyGS0"}}, tmp_path)


def test_edgekit_board_cli_installs_shows_status_and_infers(
    console_agent: RunningAgent,
    link: NullModem,
    bundles: Bundles,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from edgekit.cli import main

    port = ["--port", link.host_port]
    assert main(["board", "status", *port]) == 0
    assert capsys.readouterr().out == "agent: ready\nno models installed\n"
    assert main(["board", "install", str(bundles.v1), *port]) == 0
    assert capsys.readouterr().out == "installed tiny v1\n"
    assert main(["board", "status", *port]) == 0
    assert capsys.readouterr().out == "agent: ready\ntiny: serving (active v1)\n"
    x = sample_inputs(3, seed=5)
    np.savez(tmp_path / "x.npz", input=x)
    assert main(["board", "infer", *port, "--model", "tiny", "--input", str(tmp_path / "x.npz")]) == 0
    assert capsys.readouterr().out.startswith("probs: float32 [3, 10] top-1 [")
    assert main(["board", "infer", *port, "--model", "nope", "--input", str(tmp_path / "x.npz")]) == 1
    assert "nope" in capsys.readouterr().err
    assert main(["board", "status"]) == 2  # no --port and no EDGEKIT_BOARD_PORT


def test_console_upload_on_a_full_disk_is_a_store_error_and_keeps_what_is_in(tmp_path: Path) -> None:
    from device_agents.errors import StoreError
    from device_agents.serving.console import Uploads
    from tests.updates.tmpfs import small_tmpfs

    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        uploads = Uploads(disk / "uploads", max_bytes=1 << 20)
        data = bytes(range(256)) * 1024  # 256 KiB: more than the disk holds
        sha = hashlib.sha256(data).hexdigest()
        assert uploads.begin(sha, len(data)) == 0
        assert uploads.chunk(sha, 0, data[:16384]) == 16384
        with pytest.raises(StoreError, match="free space there"):
            uploads.chunk(sha, 16384, data[16384 : 16384 + 131072])
        assert uploads.begin(sha, len(data)) == 16384  # the part is whole: a resume starts after the first chunk
