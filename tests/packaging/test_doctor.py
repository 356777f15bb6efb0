"""`edgekit doctor`: reports this machine as /proc, /sys and the installed SDKs say; install commands; exit codes."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edgekit.doctor import ARM_FEATURES, X86_FEATURES, cpu_flags, diagnose
from tests.agent.conftest import Bundles, agent_cli, write_config

REPO = Path(__file__).resolve().parents[2]


def doctor(*args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The real ``edgekit doctor``, with the modules in ``block`` made unimportable (as if not installed)."""
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{m!r}] = None\n" for m in block)
        + "from edgekit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.fixture(scope="module")
def report() -> dict:
    done = doctor("--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_doctor_cpu_features_and_memory_match_proc(report: dict) -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo (not Linux)")
    flags = set()
    for line in cpuinfo.read_text().splitlines():  # read here independently of edgekit.doctor
        if line.split(":")[0].strip() in ("flags", "Features"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert flags, "no flags line in /proc/cpuinfo"
    for feature in (*X86_FEATURES, *ARM_FEATURES):
        assert (feature in report["cpu_features"]) == (feature in flags), feature
    assert report["cpu_count"] == os.cpu_count()
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert report["memory_total_mb"] == int(meminfo["MemTotal"].split()[0]) // 1024


def test_doctor_finds_no_gpu_and_no_edge_tpu_on_this_machine(report: dict) -> None:
    if Path("/proc/driver/nvidia").exists() or Path("/dev/nvidia0").exists() or Path("/etc/nv_tegra_release").exists():
        pytest.skip("this machine has an NVIDIA GPU")
    if any(Path("/dev").glob("apex_*")):
        pytest.skip("this machine has a PCIe Edge TPU")
    assert (report["gpus"], report["nvidia_driver"], report["jetson_l4t"], report["edgetpu"]) == ([], None, None, [])
    runs = {c["name"]: c for c in report["run"]}
    assert runs["tensorrt"] == {
        "name": "tensorrt",
        "ok": False,
        "detail": "needs an NVIDIA GPU or a Jetson; none found",
        "fix": None,
    }
    assert report["device_class"] in ("intel", "x86_64", "aarch64")


def test_doctor_reports_the_installed_sdks_by_their_versions(report: dict) -> None:
    runs = {c["name"]: c for c in report["run"]}
    ort = importlib.metadata.version("onnxruntime")
    assert runs["onnxruntime"]["ok"] and runs["onnxruntime"]["detail"].startswith(f"{ort} (")
    assert "CPUExecutionProvider" in report["onnxruntime_providers"]
    try:
        litert = importlib.metadata.version("ai-edge-litert")
    except importlib.metadata.PackageNotFoundError:
        litert = None
    if litert is not None:
        assert report["litert_interpreter"] == f"ai_edge_litert {litert}"
    builds = {c["name"]: c for c in report["build"]}
    assert builds["cpu"]["ok"] == all(
        importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime", "onnxslim")
    )


def test_doctor_reads_a_jetson_with_a_coral_from_its_device_tree(tmp_path: Path) -> None:
    root = tmp_path
    files = {
        "etc/nv_tegra_release": "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64\n",
        "proc/device-tree/model": "NVIDIA Jetson Orin Nano Developer Kit\0",
        "proc/cpuinfo": "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 atomics fphp asimdhp asimddp\n",
        "proc/meminfo": "MemTotal:        7989452 kB\nMemAvailable:    5001234 kB\n",
        "dev/apex_0": "",
        "sys/bus/usb/devices/2-1/idVendor": "1a6e\n",
        "sys/bus/usb/devices/2-1/idProduct": "089a\n",
        "sys/bus/usb/devices/1-1/idVendor": "046d\n",
        "sys/bus/usb/devices/1-1/idProduct": "c52b\n",
        "sys/class/hwmon/hwmon3/name": "ina3221\n",
        "sys/class/hwmon/hwmon3/in1_input": "5000\n",
        "sys/class/power_supply/BAT0/type": "Battery\n",
        "usr/lib/aarch64-linux-gnu/libedgetpu.so.1": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    r = diagnose(root=root)
    assert r.device_class == "jetson"
    assert r.jetson_l4t == "R35.4.1"
    assert r.gpus == ("NVIDIA Jetson Orin Nano Developer Kit (integrated)",)
    assert r.edgetpu == ("pcie apex_0", "usb 2-1 (1a6e:089a)")
    assert r.libedgetpu == "/usr/lib/aarch64-linux-gnu/libedgetpu.so.1"
    assert {"asimd", "asimddp", "asimdhp", "fphp"} <= set(r.cpu_features) and "i8mm" not in r.cpu_features
    assert (r.memory_total_mb, r.memory_available_mb) == (7802, 4884)
    assert r.power_readers == ("hwmon ina3221 (hwmon3)", "battery BAT0")
    runs = {c.name: c for c in r.run}
    if r.tensorrt is None:
        assert runs["tensorrt"].fix == "apt-get install python3-libnvinfer (JetPack)"
    if r.litert_interpreter is not None:
        assert runs["litert"].detail.endswith("; Edge TPU delegate")


def test_cpu_flags_reads_the_first_cpu_of_x86_and_arm() -> None:
    assert cpu_flags("processor : 0\nflags : fpu avx2 avx512_vnni\n\nprocessor : 1\nflags : fpu\n") == {
        "fpu",
        "avx2",
        "avx512_vnni",
    }
    assert cpu_flags("Features\t: fp asimd asimddp i8mm\n") == {"fp", "asimd", "asimddp", "i8mm"}


def test_doctor_prints_the_install_command_for_what_is_missing() -> None:
    done = doctor(block=("tf_keras", "openvino", "ai_edge_litert", "tflite_runtime"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    coral = next(i for i, line in enumerate(lines) if line.startswith("  no  coral "))
    assert lines[coral].split(None, 2)[2] == "missing ai-edge-litert, tf-keras"
    assert lines[coral + 1].split() == ["install:", "pip", "install", "'edgekit[host,tflite]'"]
    openvino = next(i for i, line in enumerate(lines) if line.startswith("  no  openvino "))
    assert lines[openvino].split(None, 2)[2] == "openvino is not installed"
    assert lines[openvino + 1].split() == ["install:", "pip", "install", "'edgekit[agent,openvino]'"]
    litert = next(i for i, line in enumerate(lines) if line.startswith("  no  litert "))
    assert lines[litert + 1].strip().startswith("install: pip install 'edgekit[agent-coral]'")
    assert "litert     not installed" in lines


def test_doctor_exits_nonzero_only_for_a_config_that_cannot_run_here(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    with socket.socket() as broker:  # something listening on loopback where the config's broker is
        broker.bind(("127.0.0.1", 0))
        broker.listen()
        port = broker.getsockname()[1]
        config = write_config(
            tmp_path / "good",
            keypair[1],
            f'[updates]\nbroker = "mqtt://127.0.0.1:{port}"\nfleet = "f"\ndevice_id = "d"\n'
            f'notice_keys = ["{keypair[1]}"]\n',
        )
        done = doctor("--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"mqtt       127.0.0.1:{port} reachable" in done.stdout.splitlines()
    assert done.stdout.splitlines()[-1] == f"config     {config}: can run here"

    assert agent_cli("install", str(bundles.v1), "--config", str(config)).returncode == 0
    done = doctor("--config", str(config), block=("onnxruntime",))
    assert done.returncode == 1
    assert done.stdout.splitlines()[-2:] == [
        f"config     {config}: cannot run here",
        "  - model tiny v1 needs runtime onnxruntime: onnxruntime is not installed",
    ]

    (config.parent / "keys" / "trusted.pub").unlink()
    done = doctor("--config", str(config), "--json")
    assert done.returncode == 1
    key = config.parent / "keys" / "trusted.pub"
    assert json.loads(done.stdout)["config_problems"] == [f"trusted key {key} does not exist or is not readable"]

    (config.parent / "keys" / "trusted.pub").write_bytes(keypair[1].read_bytes())
    npu = write_config(tmp_path / "npu", keypair[1], '[runtimes.openvino]\ndevice = "NPU"\n')
    done = doctor("--config", str(npu))
    if "NPU" in done.stdout.split("openvino   ", 1)[1].splitlines()[0] or "openvino   not installed" in done.stdout:
        pytest.skip("OpenVINO is absent or this machine has an NPU")
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1].startswith("  - runtimes.openvino.device is 'NPU'; OpenVINO here has ")

    bad = tmp_path / "bad.toml"
    bad.write_text('store = "s"\ntrusted_keys = ["k.pub"]\nlisten = 8500\n')
    done = doctor("--config", str(bad))
    assert (done.returncode, done.stderr) == (2, "edgekit: error: agent.listen: expected a string, got 8500\n")
