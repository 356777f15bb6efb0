"""A do-nothing v2 server: the client-side floor that the agent's round trip is compared with.

``python -m bench.null_server`` listens on a free loopback port (printed on stdout); one thread
per connection reads each request (headers up to the blank line, then ``Content-Length`` bytes)
and answers with one canned v2 binary response of a [1, 16] FP32 output named ``y``, HTTP/1.1
keep-alive, TCP_NODELAY. No header parsing beyond Content-Length, no decode, no model, no
encode: what is left is the socket and client cost.
"""

from __future__ import annotations

import json
import socket
import sys
import threading

import numpy as np

_OUT = np.zeros((1, 16), np.float32).tobytes()
_HEADER = json.dumps(
    {
        "model_name": "roundtrip",
        "model_version": "1",
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 16], "parameters": {"binary_data_size": len(_OUT)}}],
    },
    separators=(",", ":"),
).encode()
_BODY = _HEADER + _OUT


_RESPONSE = (
    "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
    f"Inference-Header-Content-Length: {len(_HEADER)}\r\nContent-Length: {len(_BODY)}\r\n\r\n"
).encode("latin-1") + _BODY


def _serve(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = conn.makefile("rb")
    with conn, reader:
        while True:
            length = 0
            line = reader.readline()
            if not line:
                return
            while line not in (b"\r\n", b"\n", b""):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
                line = reader.readline()
            reader.read(length)
            conn.sendall(_RESPONSE)


def main() -> int:
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
