"""agent.toml: strict, versioned (v1 files migrate), paths relative to the file."""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from device_agents import config as config_module
from device_agents.config import AgentConfig, load_config
from device_agents.runtimes import RUNTIMES
from device_agents.runtimes.options import OPTIONS, OnnxRuntimeOptions, OpenVinoOptions
from edgekit.bundle.codec import to_data
from edgekit.bundle.errors import ConfigError

GOLDEN = Path(__file__).resolve().parents[1] / "golden"

BASE = 'store = "store"\ntrusted_keys = ["keys/a.pub"]\n'
UPDATES = (
    '[updates]\nbroker = "mqtt://127.0.0.1:1883"\nfleet = "lab"\ndevice_id = "dev-1"\n'
    'notice_keys = ["keys/fleet.pub"]\n'
)


def _load(tmp_path: Path, text: str) -> AgentConfig:
    path = tmp_path / "conf" / "agent.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return load_config(path)


def test_config_defaults_and_paths_relative_to_the_file(tmp_path: Path) -> None:
    cfg = _load(tmp_path, BASE + '[runtime]\nthreads = 2\ncache_dir = "cache"\n' + UPDATES + 'ca = "/etc/ca.pem"\n')
    conf = tmp_path / "conf"
    assert cfg.store == conf / "store"
    assert cfg.trusted_keys == (conf / "keys/a.pub",)
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 8500)
    assert cfg.max_bundle_bytes == 512 * 2**20 and cfg.server.max_request_bytes == 64 * 2**20
    assert cfg.runtimes.onnxruntime.threads == 2 and cfg.runtimes.openvino.cache_dir == conf / "cache"
    assert (cfg.selftest.timeout_s, cfg.selftest.memory_mb, cfg.selftest.latency_slack) == (60.0, 2048, 3.0)
    assert cfg.config_version == 2  # migrated from 1
    u = cfg.updates
    assert u is not None
    assert (u.broker_tls, u.broker_host, u.broker_port) == (False, "127.0.0.1", 1883)
    assert u.ca == Path("/etc/ca.pem")
    assert u.download_dir == conf / "store" / "downloads"  # default: survives the cleanup of store/tmp
    assert (u.groups, u.keepalive_s, u.crash_loop_boots, u.defer_on_battery) == ((), 30, 3, True)


def test_config_without_updates_table_has_none(tmp_path: Path) -> None:
    assert _load(tmp_path, BASE).updates is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BASE + "colour = 1\n", "agent: unknown key 'colour'"),
        (BASE + UPDATES + 'brokr = "x"\n', "agent.updates: unknown key 'brokr' (did you mean 'broker'?"),
        (
            BASE + "[runtimes.onnxrt]\nthreads = 1\n",
            "agent.runtimes: unknown key 'onnxrt' (did you mean 'onnxruntime'?",
        ),
        (BASE + "[runtimes.openvino]\nperf_hint = 'LATENCY'\n", "agent.runtimes.openvino: unknown key 'perf_hint'"),
        (BASE + "[runtimes.openvino]\nperformance_hint = 'FAST'\n", "agent.runtimes.openvino.performance_hint: 'FAST'"),
        (
            BASE + "[server]\nidle_timeout = 3\n",
            "agent.server: unknown key 'idle_timeout' (did you mean 'idle_timeout_s'?",
        ),
        (BASE + "[server]\nqueue_size = 0\n", "agent.server: queue_size must be > 0"),
        (BASE + "[models.m.batching]\nmax_batch = 4\n", "agent.models.m.batching: unknown key 'max_batch' (did you"),
        (BASE + "[models.m.batching]\nmax_batch_size = 4\nmin_batch_size = 8\n", "min_batch_size must be between 1"),
        (BASE + "[models.m.batching]\npreferred_batch_sizes = [64]\n", "preferred_batch_sizes: 64 is not between"),
        (BASE + "[models.m.cache]\nttl = 3\n", "agent.models.m.cache: unknown key 'ttl' (did you mean 'ttl_s'?"),
        (BASE + "[models.m.cache]\nmode = 'fuzzy'\n", "agent.models.m.cache: mode 'fuzzy' must be one of exact"),
        (BASE + "[models.m.cache]\nmode = 'semantic'\n", 'agent.models.m.cache: mode = "semantic" goes with'),
        (BASE + "[models.m.cache]\nmax_mb = 0\n", "agent.models.m.cache: max_mb must be > 0"),
        (BASE + "[models.m.cache]\nrecheck_fraction = 0.1\n", "agent.models.m.cache: recheck_fraction applies to"),
        (BASE + "[models.m.cache]\nadmit = 'third'\n", "agent.models.m.cache: admit 'third' must be one of first"),
        (
            BASE + "[models.m.cache]\nmode = 'approximate'\nmax_distance = 0.1\nadmit = 'second'\n",
            'agent.models.m.cache: admit = "second" goes with mode = "exact"',
        ),
        (BASE + "[cache]\nmax_mbytes = 5\n", "agent.cache: unknown key 'max_mbytes' (did you mean 'max_mb'?"),
        (BASE + "[models.m.route]\nmembers = ['a']\nthreshold = 0.5\n", "agent.models.m.route: members must name two"),
        (
            BASE + "[models.m.route]\nmembers = ['a', 'b']\nthreshold = 0.5\nremote = 'x'\n",
            "agent.models.m.route: unknown key",
        ),
        (
            BASE + "[models.m.route]\nmembers = ['a', 'b']\nthreshold = 0.5\nurl = 'ftp://x'\n",
            "agent.models.m.route: url must be http://HOST:PORT",
        ),
        (BASE + "[models.m]\nvariants = ['a']\n", "agent.models.m: variants lists ['a']: name two or more"),
        (BASE + "[budgets]\nmemory_mb = 0\n", "agent.budgets: memory_mb must be > 0"),
        (
            BASE + "[budgets]\nwhen_full = 'swap'\n",
            "agent.budgets: when_full 'swap' must be one of refuse, unload_idle",
        ),
        (BASE + "[budgets]\npower_w = 5\nenergy_j = 50\n", "agent.budgets: power_w and energy_j are two ways"),
        (
            BASE + "[models.m.batching]\nmax_batch_size = 4\nbudget_max_batch_size = 8\n",
            "agent.models.m.batching: budget_max_batch_size must be between 1 and max_batch_size (4), got 8",
        ),
        (BASE + "[budgets]\npower_mw = 5000\n", "agent.budgets: unknown key 'power_mw'"),
        (BASE + "[runtime]\nextra = { FOO = '1' }\n", "agent.runtime.extra.FOO: config v2 has no free-form runtime"),
        (BASE + "[runtime]\nthreds = 1\n", "agent.runtime: unknown key 'threds'"),
        (BASE + "allow_failed_validaton = true\n", "(did you mean 'allow_failed_validation'?"),
        (BASE + "[selftest]\ntimeout = 3\n", "agent.selftest: unknown key 'timeout'"),
        (BASE + 'max_request_mb = "big"\n', "agent.server.max_request_mb: expected an integer"),  # v1 key, migrated
        ('store = "s"\n', "agent: trusted_keys is empty"),
        ('store = "s"\ntrusted_keys = []\n', "trusted_keys is empty"),
        (BASE + 'listen = "localhost"\n', "listen 'localhost' must be HOST:PORT"),
        (BASE + UPDATES.replace("mqtt://", "http://"), "must be mqtt://HOST:PORT or mqtts://HOST:PORT"),
        (BASE + UPDATES + 'maintenance_window = "2am-4am"\n', "must be HH:MM-HH:MM"),
        (BASE + UPDATES + 'cert = "c.pem"\n', "cert and key go together"),
        (BASE + UPDATES.replace('"lab"', '"lab/+"'), "fleet 'lab/+' must be letters"),
        (BASE + "config_version = 9\n", "newer than this agent understands"),
        ("store = [", "is not valid TOML"),
    ],
)
def test_config_errors_name_the_path(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    assert message in str(err.value)
    assert err.value.exit_code == 2


def test_config_missing_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; pass --config"):
        load_config(tmp_path / "nope.toml")


def test_config_migration_hook_upgrades_old_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def v2_to_v3(data: dict[str, object]) -> dict[str, object]:
        data = dict(data)
        data["listen"] = data.pop("address")  # pretend v2 called it "address"
        data["config_version"] = 3
        return data

    monkeypatch.setattr(config_module, "CONFIG_VERSION", 3)
    monkeypatch.setitem(config_module.MIGRATIONS, 2, v2_to_v3)
    cfg = _load(tmp_path, BASE + 'config_version = 2\naddress = "127.0.0.1:9000"\n')
    assert cfg.listen_port == 9000 and cfg.config_version == 3


def _golden_data(tmp_path: Path, name: str) -> str:
    """``tests/golden/<name>`` loaded from a copy in ``tmp_path``, as sorted JSON with that folder as <dir>."""
    shutil.copy(GOLDEN / name, tmp_path / "agent.toml")
    data = to_data(load_config(tmp_path / "agent.toml"))
    return json.dumps(data, indent=1, sort_keys=True).replace(str(tmp_path), "<dir>") + "\n"


@pytest.mark.parametrize(
    ("source", "expected"),
    [("agent_config_v1.toml", "agent_config_v1.migrated.json"), ("agent_config_v2.toml", "agent_config_v2.json")],
)
def test_config_golden_files_load_to_the_committed_v2_data(tmp_path: Path, source: str, expected: str) -> None:
    got = _golden_data(tmp_path, source)
    if os.environ.get("EDGEKIT_WRITE_GOLDEN") == "1":  # regenerate after an intended change, then review the diff
        (GOLDEN / expected).write_text(got)
    assert got == (GOLDEN / expected).read_text()


def test_config_v1_migration_spreads_runtime_over_the_runtimes_it_applied_to(tmp_path: Path) -> None:
    shutil.copy(GOLDEN / "agent_config_v1.toml", tmp_path / "agent.toml")
    cfg = load_config(tmp_path / "agent.toml")
    r = cfg.runtimes
    assert (r.onnxruntime.threads, r.openvino.threads, r.litert.threads, r.tensorrt.threads) == (2, 2, 2, 2)
    assert r.onnxruntime.providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert (r.openvino.device, r.openvino.performance_hint, r.openvino.num_streams) == ("GPU", "LATENCY", 2)
    assert r.openvino.cache_dir == r.tensorrt.cache_dir == tmp_path / "cache"
    assert (r.tensorrt.workspace_mb, r.tensorrt.memory_budget_mb, r.tensorrt.fallback) == (512, 300, "ort-trt")
    assert cfg.server.max_request_mb == 8
    assert cfg.models["digits"].batching is not None and cfg.models["digits"].batching.max_batch_size == 16


def test_config_v1_device_of_core_ml_goes_to_coreml(tmp_path: Path) -> None:
    cfg = _load(tmp_path, BASE + '[runtime]\ndevice = "CPU_ONLY"\n')
    assert cfg.runtimes.coreml.compute_units == "CPU_ONLY" and cfg.runtimes.openvino.device == ""


def test_config_model_threads_override_the_runtime_threads(tmp_path: Path) -> None:
    cfg = _load(tmp_path, BASE + "config_version = 2\n[runtimes.openvino]\nthreads = 4\n[models.m]\nthreads = 1\n")
    assert cfg.runtime_options("m", "openvino") == OpenVinoOptions(threads=1)
    assert cfg.runtime_options("other", "openvino") == OpenVinoOptions(threads=4)
    assert cfg.runtime_options("m", "onnxruntime") == OnnxRuntimeOptions(threads=1)
    assert cfg.runtimes_for("m").openvino.threads == 1 and cfg.runtimes_for("other") is cfg.runtimes


def test_runtime_options_table_matches_the_runtime_table() -> None:
    assert list(OPTIONS) == list(RUNTIMES)


@pytest.mark.parametrize(
    ("window", "hhmm", "inside"),
    [
        ("02:00-04:00", "03:00", True),
        ("02:00-04:00", "04:00", False),
        ("22:00-02:00", "23:30", True),
        ("22:00-02:00", "01:59", True),
        ("22:00-02:00", "12:00", False),
    ],
)
def test_maintenance_window_wraps_midnight(tmp_path: Path, window: str, hhmm: str, inside: bool) -> None:
    cfg = _load(tmp_path, BASE + UPDATES + f'maintenance_window = "{window}"\n')
    assert cfg.updates is not None
    now = datetime.fromisoformat(f"2025-01-01T{hhmm}:00")
    assert cfg.updates.in_maintenance_window(now) is inside
