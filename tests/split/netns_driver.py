"""Run inside the device's network namespace by test_netns: an agent serving the split bundle on
this namespace's loopback, and a client sending it one request after another. For each request
it prints one JSON line: the HTTP status, the option the split stage picked (the
``edgekit_split_chosen`` label at 1), its link estimate and its fallbacks so far. Stops when
its stdin closes.

    python tests/split/netns_driver.py AGENT.toml DEVICE.ekb
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from device_agents.config import load_config
from device_agents.service import AgentService
from device_agents.serving.http import AgentServer


def main() -> int:
    config = load_config(Path(sys.argv[1]))
    service = AgentService(config)
    service.start()
    service.install(Path(sys.argv[2]))
    server = AgentServer("127.0.0.1", 0, service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    x = np.random.default_rng(5).standard_normal((1, 3, 128, 128)).astype(np.float32)
    header = json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    body = header + x.tobytes()
    headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    k = 0
    try:
        while not stop.is_set():
            req = urllib.request.Request(f"{server.url}/v2/models/m/infer", body, headers)
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status = r.status
                    r.read()
            except OSError as exc:
                status = getattr(exc, "code", 0)
            with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
                metrics = r.read().decode()
            print(json.dumps({"i": k, "status": status, **_split_state(metrics)}), flush=True)
            k += 1
            time.sleep(0.05)
    finally:
        server.shutdown()
        server.server_close()
        service.stop()
    return 0


def _split_state(text: str) -> dict[str, object]:
    chosen = re.findall(r'^edgekit_split_chosen\{cut="([^"]+)",model="m"\} 1\.0$', text, re.M)
    chosen += re.findall(r'^edgekit_split_chosen\{model="m",cut="([^"]+)"\} 1\.0$', text, re.M)
    bw = re.findall(r'^edgekit_split_link_bandwidth_mbps\{model="m"\} (\S+)$', text, re.M)
    fallbacks = sum(float(v) for v in re.findall(r"^edgekit_split_fallbacks_total\{[^}]*\} (\S+)$", text, re.M))
    return {
        "chosen": chosen[0] if chosen else None,
        "bandwidth_mbps": float(bw[0]) if bw else None,
        "fallbacks": fallbacks,
    }


if __name__ == "__main__":
    sys.exit(main())
