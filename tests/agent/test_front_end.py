"""A second front-end reuses the v2 routes' decode and encode (``serving.v2.v2_codec``) and the
service, and nothing else: a trivial length-prefixed protocol over a socket pair answers the same
bytes as the HTTP routes for the same v2 body, and the same refusals."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton

from device_agents.config import load_config
from device_agents.service import AgentService
from device_agents.serving.codec import HeaderCache
from device_agents.serving.http import AgentServer
from device_agents.serving.v2 import v2_codec
from edgekit.bundle.errors import EdgekitError
from tests.agent.conftest import Bundles, write_config
from tests.factories import sample_inputs


class FramedFrontEnd:
    """One frame in: ``<u32 name length><name><u32 JSON header length, 0 = all JSON><v2 body>``; one
    frame out: ``<u16 status><u32 JSON header length><v2 response body or error JSON>``."""

    def __init__(self, service: AgentService, sock: socket.socket) -> None:
        self.service, self.sock = service, sock
        self.cache = HeaderCache()

    def serve(self) -> None:
        with self.sock.makefile("rb") as rfile:
            while True:
                head = rfile.read(4)
                if len(head) < 4:
                    return
                name = rfile.read(struct.unpack("<I", head)[0]).decode()
                header_length, body_length = struct.unpack("<II", rfile.read(8))
                body = rfile.read(body_length)
                self.sock.sendall(self.answer(name, header_length or None, body))

    def answer(self, name: str, header_length: int | None, body: bytes) -> bytes:
        limit = self.service.config.server.max_request_bytes
        try:
            decode, encode = v2_codec(name, None, body, header_length=header_length, max_bytes=limit, cache=self.cache)
            out, json_length = self.service.infer(name, None, decode, encode)
        except EdgekitError as exc:
            doc = json.dumps({"error": str(exc)}).encode()
            return struct.pack("<HII", exc.http_status, 0, len(doc)) + doc
        return struct.pack("<HII", 200, json_length or 0, len(out)) + out


@pytest.fixture()
def agent(tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles) -> Iterator[tuple[AgentService, str]]:
    service = AgentService(load_config(write_config(tmp_path / "agent", keypair[1])))
    service.start()
    service.install(bundles.v1)
    server = AgentServer("127.0.0.1", 0, service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield service, server.url.removeprefix("http://")
    server.shutdown()
    server.server_close()
    service.stop()


def _body(x: np.ndarray) -> tuple[bytes, int]:
    """A binary v2 request body as tritonclient builds it, and its JSON header's length."""
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = triton.InferRequestedOutput("probs", binary_data=True)
    body, header_length = triton.InferenceServerClient.generate_request_body([inp], outputs=[out])
    return body, header_length or 0


def _ask(sock: socket.socket, name: str, header_length: int, body: bytes) -> tuple[int, int, bytes]:
    sock.sendall(struct.pack("<I", len(name)) + name.encode() + struct.pack("<II", header_length, len(body)) + body)
    with sock.makefile("rb") as rfile:
        status, json_length, length = struct.unpack("<HII", rfile.read(10))
        return status, json_length, rfile.read(length)


def test_second_front_end_answers_what_the_http_routes_answer(agent: tuple[AgentService, str]) -> None:
    service, url = agent
    ours, theirs = socket.socketpair()
    threading.Thread(target=FramedFrontEnd(service, theirs).serve, daemon=True).start()
    x = sample_inputs(1, seed=21)
    body, header_length = _body(x)
    status, json_length, out = _ask(ours, "tiny", header_length, body)
    assert status == 200
    result = triton.InferResult.from_response_body(out, header_length=json_length)
    client = triton.InferenceServerClient(url)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    over_http = client.infer("tiny", [inp], outputs=[triton.InferRequestedOutput("probs", binary_data=True)])
    np.testing.assert_array_equal(result.as_numpy("probs"), over_http.as_numpy("probs"))
    assert result.get_response() == over_http.get_response()  # same model, version, outputs header
    client.close()
    # a refusal maps to the status the HTTP routes give it
    status, _, doc = _ask(ours, "nope", header_length, body)
    assert status == 404 and "nope" in json.loads(doc)["error"]
    status, _, doc = _ask(ours, "tiny", 0, b'{"inputs": [{"name": "input"}]}')
    assert status == 400
    ours.close()
