"""``edgekit doctor [--json] [--config agent.toml]``: what this machine is, what it can build and what it can run.

Every fact is read, never assumed: CPU features from ``/proc/cpuinfo``, memory from ``/proc/meminfo``,
NVIDIA/Jetson versions from ``/proc/driver/nvidia``, ``/etc/nv_tegra_release`` and the CUDA install,
Edge TPUs from ``/dev/apex_*`` and the USB ids in ``/sys``, power readers from ``/sys/class``, SDK
versions from the installed distributions (``importlib.metadata``; only ONNX Runtime and OpenVINO are
imported, to list their execution providers and devices), serial ports through pyserial.

Each target to build and each runtime to run is a ``Check``; one that is missing carries the exact
command that installs it. Exit status: 0, except with ``--config`` when that agent config cannot run
here (unreadable key, unwritable store, an installed model whose runtime is not available): 1.
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# CPU features that decide which kernels the runtimes use (int8 dot products, bf16, AMX tiles)
X86_FEATURES = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip
ARM_FEATURES = ("neon", "asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2", "fphp")
# (idVendor, idProduct) of the Coral USB Accelerator before and after its firmware is loaded
CORAL_USB_IDS = {("1a6e", "089a"), ("18d1", "9302")}
_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Check:
    """A target this machine can build, or a runtime it can run; ``fix`` says how when it cannot."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Report:
    system: str
    arch: str
    device_class: str  # jetson, nvidia-gpu, coral, apple, intel, x86_64, aarch64, ...
    cpu_model: str
    cpu_count: int
    cpu_features: tuple[str, ...]
    memory_total_mb: int | None
    memory_available_mb: int | None
    nvidia_driver: str | None
    gpus: tuple[str, ...]
    cuda: str | None
    tensorrt: str | None
    jetson_l4t: str | None
    edgetpu: tuple[str, ...]
    libedgetpu: str | None
    litert_interpreter: str | None
    edgetpu_compiler: str | None
    coreml: str | None
    onnxruntime_providers: tuple[str, ...]
    openvino_devices: tuple[str, ...]
    power_readers: tuple[str, ...]
    serial_ports: tuple[str, ...] | None  # None: pyserial is not installed
    mqtt: str | None  # None: no [updates] in the config (or no config)
    build: tuple[Check, ...]
    run: tuple[Check, ...]
    config: str | None = None
    config_problems: tuple[str, ...] = field(default=())


# -- reading the machine ------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """Every flag of the first CPU in ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "Hardware", "Model", "cpu model"):
            return value.strip()
    return platform.processor() or "unknown"


def _meminfo_mb(meminfo: str | None) -> tuple[int | None, int | None]:
    if meminfo is None:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20, None
        except (ValueError, OSError):
            return None, None
    values = {}
    for line in meminfo.splitlines():
        m = re.match(r"(\w+):\s+(\d+) kB", line)
        if m:
            values[m.group(1)] = int(m.group(2)) // 1024
    return values.get("MemTotal"), values.get("MemAvailable")


def _normalize_arch(machine: str) -> str:
    a = machine.lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(a, a)


def installed(module: str) -> bool:
    """True when ``module`` can be imported (found on the path and not blocked in ``sys.modules``)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia(root: Path) -> tuple[str | None, tuple[str, ...], str | None, str | None]:
    """(driver version, GPUs, CUDA version, Jetson L4T release)."""
    driver = None
    text = _read(root / "proc/driver/nvidia/version")
    if text:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
        driver = m.group(1) if m else text.splitlines()[0].strip()
    gpus: list[str] = []
    smi = shutil.which("nvidia-smi") if root == Path("/") else None
    if smi and driver:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=_TIMEOUT_S,
            ).stdout
            gpus = [f"{name.strip()} (compute capability {cap.strip()})" for name, _, cap in
                    (line.partition(",") for line in out.splitlines() if line.strip())]  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            gpus = []
    l4t = None
    tegra = _read(root / "etc/nv_tegra_release")
    if tegra:
        m = re.search(r"R(\d+) \(release\), REVISION: ([\d.]+)", tegra)
        l4t = f"R{m.group(1)}.{m.group(2)}" if m else tegra.splitlines()[0].strip()
        model = (_read(root / "proc/device-tree/model") or "NVIDIA Jetson").strip("\0\n ")
        gpus = gpus or [f"{model} (integrated)"]
    cuda = None
    for cuda_root in (root / "usr/local/cuda",):
        doc = _read(cuda_root / "version.json")
        if doc:
            try:
                cuda = str(json.loads(doc)["cuda"]["version"])
            except (ValueError, KeyError, TypeError):
                cuda = None
        elif (txt := _read(cuda_root / "version.txt")) is not None:
            m = re.search(r"([\d.]+)", txt)
            cuda = m.group(1) if m else None
    return driver, tuple(gpus), cuda, l4t


def _edgetpus(root: Path) -> tuple[str, ...]:
    found = [f"pcie {p.name}" for p in sorted((root / "dev").glob("apex_*"))]
    usb = root / "sys/bus/usb/devices"
    if usb.is_dir():
        for dev in sorted(usb.iterdir()):
            ids = (_read(dev / "idVendor"), _read(dev / "idProduct"))
            if ids[0] and ids[1] and (ids[0].strip(), ids[1].strip()) in CORAL_USB_IDS:
                found.append(f"usb {dev.name} ({ids[0].strip()}:{ids[1].strip()})")
    return tuple(found)


def _libedgetpu(root: Path) -> str | None:
    if root == Path("/"):
        found = ctypes.util.find_library("edgetpu")
        if found:
            return found
    for d in ("usr/lib", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib/arm-linux-gnueabihf",
              "usr/local/lib", "opt/homebrew/lib"):  # fmt: skip
        for name in ("libedgetpu.so.1", "libedgetpu.1.dylib"):
            if (root / d / name).exists():
                return str(Path("/") / d / name)
    return None


def _power_readers(root: Path) -> tuple[str, ...]:
    found = [f"rapl {p.name}" for p in sorted((root / "sys/class/powercap").glob("intel-rapl:*"))
             if (p / "energy_uj").exists()]  # fmt: skip
    for hw in sorted((root / "sys/class/hwmon").glob("hwmon*")):
        inputs = sorted(p.name for p in hw.glob("power*_input")) + sorted(p.name for p in hw.glob("in*_input"))
        name = (_read(hw / "name") or hw.name).strip()
        if any(n.startswith("power") for n in inputs) or name.startswith("ina"):
            found.append(f"hwmon {name} ({hw.name})")
    for supply in sorted((root / "sys/class/power_supply").glob("*")):
        kind = (_read(supply / "type") or "").strip()
        if kind in ("Battery", "Mains", "USB"):
            found.append(f"{kind.lower()} {supply.name}")
    return tuple(found)


def _serial_ports() -> tuple[str, ...] | None:
    if not installed("serial"):
        return None
    from serial.tools import list_ports

    return tuple(sorted(p.device for p in list_ports.comports()))


def _litert_interpreter() -> str | None:
    # the order device_agents/runtimes/litert.py imports them in
    for module, dist in (("ai_edge_litert", "ai-edge-litert"), ("tflite_runtime", "tflite-runtime")):
        if installed(module):
            return f"{module} {version(dist) or 'unknown version'}"
    return None


def _ort_providers() -> tuple[str, ...]:
    if not installed("onnxruntime"):
        return ()
    import onnxruntime

    return tuple(onnxruntime.get_available_providers())


def _openvino_devices() -> tuple[str, ...]:
    if not installed("openvino"):
        return ()
    try:
        import openvino

        return tuple(openvino.Core().available_devices)
    except (RuntimeError, OSError) as exc:  # a broken plugin: report it, do not fail the whole report
        return (f"error: {exc}",)


def _device_class(
    system: str, arch: str, cpuinfo: str, l4t: str | None, gpus: tuple[str, ...], tpus: tuple[str, ...]
) -> str:
    if l4t is not None:
        return "jetson"
    if gpus:
        return "nvidia-gpu"
    if tpus:
        return "coral"
    if system == "Darwin" and arch == "aarch64":
        return "apple"
    if "GenuineIntel" in cpuinfo:
        return "intel"
    return arch


# -- what can be built and run ------------------------------------------------------------------


def _pip(extra: str) -> str:
    return f"pip install 'edgekit[{extra}]'"


def _modules_check(name: str, modules: tuple[tuple[str, str], ...], extra: str, note: str = "") -> Check:
    """``modules``: (import name, distribution name) pairs a target needs."""
    missing = [dist for module, dist in modules if not installed(module)]
    if missing:
        fix = _pip(extra)
        if "tf-keras" in missing and version("tensorflow-cpu") and not version("tensorflow"):
            # tf-keras requires the distribution named `tensorflow`; next to tensorflow-cpu that is a second TF
            fix = f"pip uninstall -y tensorflow-cpu && {fix}  (tf-keras requires `tensorflow` by name)"
        return Check(name, False, f"missing {', '.join(missing)}", fix)
    own = [dist for _, dist in modules if dist not in _ONNX_DISTS] or [dist for _, dist in modules]
    found = ", ".join(f"{dist} {version(dist) or '?'}" for dist in own)
    return Check(name, True, found + (f"; {note}" if note else ""))


_ONNX = (("onnx", "onnx"), ("onnxruntime", "onnxruntime"), ("onnxslim", "onnxslim"))
_ONNX_DISTS = {dist for _, dist in _ONNX}


def build_checks(edgetpu_compiler: str | None) -> tuple[Check, ...]:
    """Every target needs the ONNX trio (``host``); a target's line shows the SDKs of its own."""
    onnx = _ONNX
    compile_note = (
        f"Edge TPU compile: {edgetpu_compiler}"
        if edgetpu_compiler
        else "no edgetpu_compiler on PATH (Coral's Debian repository, x86-64 only): CPU-only .tflite"
    )
    return (
        _modules_check("cpu", onnx, "host"),
        _modules_check("intel", (*onnx, ("openvino", "openvino"), ("nncf", "nncf")), "host,openvino"),
        _modules_check(
            "coral",
            (
                *onnx,
                ("ai_edge_litert", "ai-edge-litert"),
                ("tensorflow", "tensorflow"),
                ("tf_keras", "tf-keras"),
                ("onnx2tf", "onnx2tf"),
                ("onnx_graphsurgeon", "onnx-graphsurgeon"),
                ("sng4onnx", "sng4onnx"),
            ),
            "host,tflite",
            compile_note,
        ),
        _modules_check("jetson", onnx, "host", "the TensorRT engine is built on the device"),
        _modules_check(
            "apple",
            (
                *onnx,
                ("coremltools", "coremltools"),
                ("onnx2torch", "onnx2torch"),
                ("torch", "torch"),
                ("sklearn", "scikit-learn"),
            ),
            "host,coreml",
        ),
    )


def run_checks(r: Report) -> tuple[Check, ...]:
    checks = []
    if r.onnxruntime_providers:
        checks.append(Check("onnxruntime", True, f"{version('onnxruntime')} ({', '.join(r.onnxruntime_providers)})"))
    else:
        checks.append(Check("onnxruntime", False, "onnxruntime is not installed", _pip("agent")))
    if r.openvino_devices:
        checks.append(Check("openvino", True, f"{version('openvino')} (devices {', '.join(r.openvino_devices)})"))
    else:
        checks.append(Check("openvino", False, "openvino is not installed", _pip("agent,openvino")))
    if r.litert_interpreter is None:
        fix = _pip("agent-coral") + " (32-bit Arm: python3-tflite-runtime from Coral's Debian repository)"
        checks.append(Check("litert", False, "neither ai-edge-litert nor tflite-runtime is installed", fix))
    elif r.edgetpu and r.libedgetpu is None:
        fix = "apt-get install libedgetpu1-std (Coral's Debian repository)"
        detail = f"{r.litert_interpreter}; Edge TPU {r.edgetpu[0]} found but libedgetpu is not: CPU only"
        checks.append(Check("litert", True, detail, fix))
    else:
        delegate = "Edge TPU delegate" if r.edgetpu and r.libedgetpu else "CPU (no Edge TPU)"
        checks.append(Check("litert", True, f"{r.litert_interpreter}; {delegate}"))
    if not r.gpus:
        checks.append(Check("tensorrt", False, "needs an NVIDIA GPU or a Jetson; none found", None))
    elif r.tensorrt is None:
        fix = "apt-get install python3-libnvinfer (JetPack)" if r.jetson_l4t else _pip("agent,tensorrt")
        checks.append(Check("tensorrt", False, "TensorRT is not installed", fix))
    else:
        checks.append(Check("tensorrt", True, f"TensorRT {r.tensorrt} on {r.gpus[0]}"))
    if r.system != "Darwin":
        checks.append(Check("coreml", False, f"Core ML runs only on macOS (this is {r.system})", None))
    elif r.coreml is None:
        checks.append(Check("coreml", False, "coremltools is not installed", _pip("agent,coreml")))
    else:
        checks.append(Check("coreml", True, f"coremltools {r.coreml}"))
    return tuple(checks)


# -- the agent config ---------------------------------------------------------------------------


def _mqtt(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=3):
            return f"{host}:{port} reachable"
    except OSError as exc:
        return f"{host}:{port} not reachable ({exc}); the agent serves offline and retries"


def config_problems(path: Path, runnable: dict[str, Check]) -> tuple[str | None, tuple[str, ...]]:
    """(MQTT reachability, what keeps the agent config at ``path`` from running here)."""
    from device_agents.config import load_config  # raises ConfigError naming the bad key

    config = load_config(path)
    problems = []
    for key in config.trusted_keys:
        if not os.access(key, os.R_OK):
            problems.append(f"trusted key {key} does not exist or is not readable")
    store = config.store
    existing = next((p for p in (store, *store.parents) if p.exists()), None)
    if existing is None or not os.access(existing, os.W_OK | os.X_OK):
        problems.append(f"store {store} is not writable here (nearest existing directory: {existing})")
    if (store / "state.json").exists():
        from device_agents.store import Store

        s = Store(store)
        for name, ms in sorted(s.load_state().models.items()):
            if ms.active is None:
                continue
            runtime = s.manifest_of(ms.active).compatibility.runtime
            check = runnable.get(runtime)
            if check is None or not check.ok:
                why = check.detail if check else "unknown runtime"
                problems.append(f"model {name} v{ms.active.version} needs runtime {runtime}: {why}")
    # runtime options that name hardware this machine lacks
    ort = config.runtimes.onnxruntime
    if ort.providers and runnable.get("onnxruntime", Check("", False, "")).ok:
        available = set(_ort_providers())
        missing = [p for p in ort.providers if p not in available]
        if missing:
            problems.append(
                f"runtimes.onnxruntime.providers names {', '.join(missing)}, not available here "
                f"(available: {', '.join(sorted(available))})"
            )
    device = config.runtimes.openvino.device
    if device and not device.startswith(("AUTO", "MULTI", "HETERO")) and installed("openvino"):
        devices = _openvino_devices()
        if device not in devices:
            problems.append(f"runtimes.openvino.device is {device!r}; OpenVINO here has {', '.join(devices)}")
    mqtt = None if config.updates is None else _mqtt(config.updates.broker_host, config.updates.broker_port)
    return mqtt, tuple(problems)


# -- the report ---------------------------------------------------------------------------------


def diagnose(root: Path = Path("/"), config: Path | None = None) -> Report:
    """Read this machine (``root``: where /proc, /sys, /dev and /etc are; tests pass a fake tree)."""
    cpuinfo = _read(root / "proc/cpuinfo") or ""
    flags = cpu_flags(cpuinfo)
    system = platform.system()
    arch = _normalize_arch(platform.machine())
    total, available = _meminfo_mb(_read(root / "proc/meminfo") if system == "Linux" else None)
    driver, gpus, cuda, l4t = _nvidia(root)
    tpus = _edgetpus(root)
    compiler = shutil.which("edgetpu_compiler")
    report = Report(
        system=system,
        arch=arch,
        device_class=_device_class(system, arch, cpuinfo, l4t, gpus, tpus),
        cpu_model=_cpu_model(cpuinfo),
        cpu_count=os.cpu_count() or 1,
        cpu_features=tuple(f for f in (*X86_FEATURES, *ARM_FEATURES) if f in flags),
        memory_total_mb=total,
        memory_available_mb=available,
        nvidia_driver=driver,
        gpus=gpus,
        cuda=cuda,
        tensorrt=version("tensorrt") or (ctypes.util.find_library("nvinfer") if gpus else None),
        jetson_l4t=l4t,
        edgetpu=tpus,
        libedgetpu=_libedgetpu(root),
        litert_interpreter=_litert_interpreter(),
        edgetpu_compiler=compiler,
        coreml=version("coremltools") if system == "Darwin" else None,
        onnxruntime_providers=_ort_providers(),
        openvino_devices=_openvino_devices(),
        power_readers=_power_readers(root),
        serial_ports=_serial_ports(),
        mqtt=None,
        build=build_checks(compiler),
        run=(),
    )
    runs = run_checks(report)
    mqtt, problems = (None, ()) if config is None else config_problems(config, {c.name: c for c in runs})
    return replace(
        report, run=runs, mqtt=mqtt, config=None if config is None else str(config), config_problems=problems
    )


def format_text(r: Report) -> str:
    none = "none"
    lines = [
        f"device     {r.device_class}: {r.system} {r.arch}, {r.cpu_model}, {r.cpu_count} cores",
        f"cpu        {' '.join(r.cpu_features) or none}",
        f"memory     {r.memory_total_mb} MB total, {r.memory_available_mb} MB available",
        f"gpu        {'; '.join(r.gpus) or none}"
        + (f" (driver {r.nvidia_driver})" if r.nvidia_driver else "")
        + (f", CUDA {r.cuda}" if r.cuda else "")
        + (f", TensorRT {r.tensorrt}" if r.tensorrt else "")
        + (f", L4T {r.jetson_l4t}" if r.jetson_l4t else ""),
        f"edge tpu   {'; '.join(r.edgetpu) or none}; libedgetpu {r.libedgetpu or 'not found'}",
        f"litert     {r.litert_interpreter or 'not installed'}",
        f"openvino   {', '.join(r.openvino_devices) or 'not installed'}",
        f"power      {'; '.join(r.power_readers) or none}",
        f"serial     {'pyserial not installed' if r.serial_ports is None else ', '.join(r.serial_ports) or none}",
        f"mqtt       {r.mqtt or 'not configured'}",
    ]
    for title, checks in (("build (host targets)", r.build), ("run (device runtimes)", r.run)):
        lines.append(title)
        width = max(len(c.name) for c in checks)
        for c in checks:
            lines.append(f"  {'ok' if c.ok else 'no':<4}{c.name:<{width + 2}}{c.detail}")
            if c.fix:
                lines.append(f"  {'':<4}{'':<{width + 2}}install: {c.fix}")
    if r.config is not None:
        lines.append(f"config     {r.config}: " + ("can run here" if not r.config_problems else "cannot run here"))
        lines.extend(f"  - {p}" for p in r.config_problems)
    return "\n".join(lines)


def _doctor(args: argparse.Namespace) -> int:
    report = diagnose(config=args.config)
    print(json.dumps(asdict(report), indent=1) if args.json else format_text(report))
    return 1 if report.config_problems else 0


def register(sub: Any) -> None:
    """Add ``edgekit doctor`` to the CLI's subparsers."""
    p = sub.add_parser(
        "doctor",
        help="show what this machine is, which targets it can build and which runtimes it can run",
        description="Detect the device class, CPU features, memory, GPUs, Edge TPUs, SDKs and power readers; "
        "list which targets this machine can build and which runtimes it can run, with the install command for "
        "what is missing. Exits 1 only when --config names an agent config that cannot run here.",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", type=Path, metavar="AGENT.toml", help="also check this agent config")
    p.set_defaults(func=_doctor)
