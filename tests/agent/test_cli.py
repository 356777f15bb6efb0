"""`edgekit-agent` end to end: exact output, exit codes, install into a running daemon, shutdown."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import tritonclient.http as triton

from device_agents.serving.http import is_loopback
from tests.agent.conftest import AgentFactory, Bundles, RunningAgent, agent_cli


def _infer_ok(agent: RunningAgent) -> dict:
    client = triton.InferenceServerClient(agent.address)
    x = np.ones((1, 3, 16, 16), np.float32)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("tiny", [inp])
    assert result.as_numpy("probs").shape == (1, 10)
    return result.get_response()  # type: ignore[no-any-return]  # the JSON header


def test_install_and_status_print_exact_lines(config_path: Path, bundles: Bundles) -> None:
    done = agent_cli("install", str(bundles.v1), "--config", str(config_path))
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"installed tiny v1; self-test passed, p50 \d+\.\d{3} ms\n", done.stdout)
    done = agent_cli("install", str(bundles.v1), "--config", str(config_path))
    assert (done.returncode, done.stdout) == (0, "tiny v1 is already installed\n")
    done = agent_cli("install", str(bundles.v3_bad_golden), "--config", str(config_path))
    assert done.returncode == 1
    assert done.stderr.startswith("edgekit-agent: error: tiny: v3 failed its self-test: output 'probs' does not match")
    assert done.stderr.rstrip().endswith("; v1 keeps serving")
    done = agent_cli("status", "--config", str(config_path))
    store = config_path.parent / "store"
    error = "v3 failed its self-test: output 'probs' does not match the golden vectors"
    lines = done.stdout.splitlines()
    assert lines[:2] == [
        f"agent: not running; store {store}",
        "MODEL  ACTIVE  CANDIDATE  PREVIOUS  STATUS  ERROR",
    ]
    assert lines[2].startswith(f"tiny   v1      -          -         failed  {error}")
    assert len(lines) == 3


def test_errors_print_one_line_and_exit_with_the_error_code(tmp_path: Path, config_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('store = "s"\ntrusted_keys = ["k.pub"]\nlisten = 8500\n')
    done = agent_cli("status", "--config", str(bad))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "edgekit-agent: error: agent.listen: expected a string, got 8500\n"
    done = agent_cli("install", str(tmp_path / "missing.ekb"), "--config", str(config_path))
    assert done.returncode == 1
    assert done.stderr.endswith("missing.ekb does not exist or is not a file\n")
    done = agent_cli("status", "--config", str(config_path))
    assert done.stdout.splitlines()[1] == "no models installed"


def test_install_hands_the_bundle_to_the_running_daemon(
    config_path: Path, bundles: Bundles, agent_factory: AgentFactory
) -> None:
    assert agent_cli("install", str(bundles.v1), "--config", str(config_path)).returncode == 0
    agent = agent_factory(config_path)
    assert _infer_ok(agent)["model_version"] == "1"
    done = agent_cli("install", str(bundles.v2), "--config", str(config_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("installed tiny v2 (was v1); self-test passed")
    assert _infer_ok(agent)["model_version"] == "2"  # the daemon switched without a restart
    refused = (
        (bundles.v3_bad_golden, "failed its self-test"),
        (bundles.untrusted, "untrusted key"),
        (bundles.tampered_artifact, "sha256 does not match the manifest"),
        (bundles.expired, "expired at"),
        (bundles.v1, "tiny v1 is older than installed v"),
        (bundles.runtime_fails, "failed its self-test"),
    )
    for bad, message in refused:
        done = agent_cli("install", str(bad), "--config", str(config_path))
        assert done.returncode == 1 and message in done.stderr, done.stderr
        assert done.stderr.startswith("edgekit-agent: error: ") and done.stderr.count("\n") == 1
        assert _infer_ok(agent)["model_version"] == "2"
    status = agent_cli("status", "--config", str(config_path)).stdout
    assert status.startswith(f"agent: running (pid {agent.proc.pid}, {agent.url}); ")
    assert agent.stop() == 0
    assert not (config_path.parent / "store" / "daemon.json").exists()
    log = agent.log.read_text()
    assert "install " in log and "now serving v2 (was v1)" in log and log.rstrip().endswith("stopped")


def test_a_candidate_that_kills_its_test_process_does_not_take_the_daemon_down(
    config_path: Path, bundles: Bundles, agent_factory: AgentFactory
) -> None:
    assert agent_cli("install", str(bundles.v1), "--config", str(config_path)).returncode == 0
    # the daemon's self-test children inherit this and SIGKILL themselves while loading the model
    agent = agent_factory(config_path, {"EDGEKIT_FAULT": "selftest_child"})
    done = agent_cli("install", str(bundles.v2), "--config", str(config_path))
    assert done.returncode == 1
    assert "the self-test process was killed by signal 9" in done.stderr
    assert agent.proc.poll() is None
    assert _infer_ok(agent)["model_version"] == "1"


def test_a_second_daemon_on_the_same_store_is_refused(config_path: Path, agent_factory: AgentFactory) -> None:
    agent_factory(config_path)
    done = agent_cli("run", "--config", str(config_path))
    assert done.returncode == 1
    assert f"another edgekit-agent holds {config_path.parent / 'store' / 'daemon.lock'}; stop it first" in done.stderr


def test_install_route_answers_only_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.1.2.3") and not is_loopback("::ffff:192.168.0.9") and not is_loopback("fe80::1")


def test_daemon_json_names_the_bound_port(config_path: Path, agent_factory: AgentFactory) -> None:
    agent = agent_factory(config_path)
    info = json.loads((config_path.parent / "store" / "daemon.json").read_text())
    assert info["url"] == agent.url and info["pid"] == agent.proc.pid
    assert not agent.url.endswith(":0")


def test_run_raises_the_soft_open_file_limit_to_the_hard_one() -> None:
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from device_agents.cli import raise_nofile_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "raise_nofile_limit()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    soft, hard = (int(v) for v in done.stdout.split())
    assert soft > 64 and (soft == hard or hard < 0)  # RLIM_INFINITY is -1: raised to a large finite number
