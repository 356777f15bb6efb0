"""The edgekit-agent .deb: built with dpkg-deb, checked with lintian, installed, run as its unit would, purged.

There is no systemd (PID 1) here, so the install test runs the unit's ExecStart itself, as the unit's
User= (setpriv execs, like systemd: the notifying process is the main one), with a NOTIFY_SOCKET
listener, and checks READY=1, /v2/health/ready and WATCHDOG=1.
"""

from __future__ import annotations

import configparser
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.conftest import Bundles
from tests.packaging.notify import NotifyListener

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "packaging" / "debian" / "build.sh"
UNIT = REPO / "packaging" / "systemd" / "edgekit-agent.service"
SYSTEM_PYTHON = Path("/usr/bin/python3")
# what must never be in the agent's environment (host converters and ML frameworks)
HOST_ONLY = ("torch", "tensorflow", "onnx", "onnx2tf", "openvino", "coremltools", "onnxslim", "nncf", "tf_keras")

pytestmark = pytest.mark.slow


def _run(*cmd: str, timeout: float = 300, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload, no-any-return]


def _uv() -> str | None:
    found = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    return found if Path(found).exists() else None


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is not installed (Debian/Ubuntu only)")
    uv = _uv()
    if uv is None:
        pytest.skip("uv is not installed (the .deb's venv is made with it)")
    if _run(str(SYSTEM_PYTHON), "-c", "import tomllib", timeout=60).returncode != 0:
        pytest.skip(f"{SYSTEM_PYTHON} is missing or older than 3.11")
    out = tmp_path_factory.mktemp("deb")
    started = time.monotonic()
    done = _run("sh", str(BUILD), str(out), timeout=600, env={**os.environ, "UV": uv, "DEB_GZIP_LEVEL": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    path = Path(done.stdout.strip().splitlines()[-1])
    print(f"\nbuilt {path.name}: {path.stat().st_size / 2**20:.1f} MiB in {time.monotonic() - started:.0f} s")
    return path


def _contents(deb: Path) -> list[str]:
    listing = _run("dpkg-deb", "--contents", str(deb)).stdout.splitlines()
    return [line.split(None, 5)[5].split(" -> ")[0].removeprefix("./") for line in listing]


def test_deb_holds_the_one_unit_its_config_and_a_venv_without_host_sdks(deb: Path) -> None:
    fields = {k: _run("dpkg-deb", "--field", str(deb), k).stdout.strip() for k in ("Package", "Depends")}
    minor = _run(str(SYSTEM_PYTHON), "-c", "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip()
    assert fields["Package"] == "edgekit-agent"
    assert fields["Depends"].startswith(f"python{minor}, adduser")
    assert _run("dpkg-deb", "--info", str(deb), "conffiles").stdout.split() == ["/etc/edgekit/agent.toml"]
    files = _contents(deb)
    site = f"opt/edgekit/lib/python{minor}/site-packages/"
    for expected in ("lib/systemd/system/edgekit-agent.service", "usr/bin/edgekit-agent", "etc/edgekit/keys/"):
        assert expected in files
    for package in ("onnxruntime", "numpy", "paho", "cryptography", "edgekit", "device_agents"):
        assert f"{site}{package}/" in files
    assert not [f for f in files if f.split("/")[5:6] and f.split("/")[5] in HOST_ONLY]
    assert not [f for f in files if "__pycache__" in f]  # postinst compiles; dpkg does not own caches
    tar = f"dpkg-deb --fsys-tarfile {shlex.quote(str(deb))} | tar -xOf - ./lib/systemd/system/edgekit-agent.service"
    unit = _run("sh", "-c", tar)
    assert unit.stdout == UNIT.read_text()  # one unit file: the package ships packaging/systemd's


def test_deb_cross_builds_for_the_other_architecture(tmp_path: Path, deb: Path) -> None:
    host = _run("dpkg", "--print-architecture").stdout.strip()
    other = {"amd64": "arm64", "arm64": "amd64"}.get(host)
    if other is None:
        pytest.skip(f"cross-building is for amd64 <-> arm64; this machine is {host}")
    env = {**os.environ, "UV": str(_uv()), "DEB_GZIP_LEVEL": "1", "DEB_ARCH": other}
    done = _run("sh", str(BUILD), str(tmp_path), timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    cross = Path(done.stdout.strip().splitlines()[-1])
    assert _run("dpkg-deb", "--field", str(cross), "Architecture").stdout.strip() == other
    machine = {"amd64": 0x3E, "arm64": 0xB7}[other]  # ELF e_machine: x86-64, AArch64
    shared = [f for f in _contents(cross) if f.endswith(".so") and "/site-packages/" in f]
    assert len(shared) > 10
    with tempfile.TemporaryDirectory() as unpacked:
        assert _run("dpkg-deb", "--extract", str(cross), unpacked).returncode == 0
        for rel in shared:
            header = (Path(unpacked) / rel).read_bytes()[:20]
            assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == machine, rel


def test_deb_has_no_lintian_errors(deb: Path) -> None:
    if shutil.which("lintian") is None:
        pytest.skip("lintian is not installed (apt-get install -y lintian)")
    done = _run("lintian", "--tag-display-limit", "0", str(deb), timeout=900)
    tags = [line for line in done.stdout.splitlines() if line[:2] in ("E:", "W:")]
    print("\n".join(["lintian:", *tags]))
    assert not [t for t in tags if t.startswith("E:")], done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


# -- install, run, remove, purge ------------------------------------------------------------------


def _dpkg(*args: str) -> subprocess.CompletedProcess[str]:
    """dpkg, waiting (up to 5 min) while another apt/dpkg holds the lock."""
    deadline = time.monotonic() + 300
    while True:
        done = _run("dpkg", "--force-confold", *args, timeout=600, stdin=subprocess.DEVNULL)
        if done.returncode == 0 or "lock" not in done.stderr or time.monotonic() > deadline:
            return done
        time.sleep(2)


def _installed() -> bool:
    return "ok installed" in _run("dpkg-query", "-W", "-f=${Status}", "edgekit-agent").stdout


@pytest.fixture()
def installed_deb(deb: Path) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("dpkg") is None or shutil.which("setpriv") is None:
        pytest.skip("installing the .deb needs root, dpkg and setpriv (CI runs as root on Debian)")
    if _installed() or any(Path(p).exists() for p in ("/etc/edgekit", "/var/lib/edgekit", "/opt/edgekit")):
        pytest.skip("edgekit-agent (or its config/store) is already on this machine: not touching it")
    try:
        pwd.getpwnam("edgekit")
        pytest.skip("a user 'edgekit' exists that this package did not create: not touching it")
    except KeyError:
        pass
    done = _dpkg("-i", str(deb))
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        yield deb
    finally:
        if _installed() or Path("/etc/edgekit").exists():
            _dpkg("--purge", "edgekit-agent")


def as_edgekit_cmd(user: pwd.struct_passwd) -> list[str]:
    """Run as the user like systemd's User=: setpriv execs (no child process), with the user's groups."""
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--"]


def _exec_start(unit_text: str) -> tuple[list[str], str]:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment, method-assign]  # systemd keys are case-sensitive
    unit.read_string(unit_text)
    return shlex.split(unit["Service"]["ExecStart"]), unit["Service"]["User"]


@pytest.mark.requires_root
def test_deb_installs_runs_its_exec_start_as_edgekit_keeps_state_and_purges(
    installed_deb: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    user = pwd.getpwnam("edgekit")
    store = Path("/var/lib/edgekit")
    assert (store.stat().st_uid, store.stat().st_mode & 0o777) == (user.pw_uid, 0o750)
    unit_path = Path("/lib/systemd/system/edgekit-agent.service")
    if shutil.which("systemd-analyze"):
        verify = _run("systemd-analyze", "verify", str(unit_path))
        assert verify.returncode == 0, verify.stderr
        security = _run("systemd-analyze", "security", "--offline=true", str(unit_path))
        print("\n" + security.stdout.strip().splitlines()[-1])
    argv, unit_user = _exec_start(unit_path.read_text())
    assert unit_user == "edgekit"

    # what an admin does after installing: a trusted key, and (here) any free port instead of 8500
    Path("/etc/edgekit/keys/release.pub").write_bytes(keypair[1].read_bytes())
    config = Path("/etc/edgekit/agent.toml")
    config.write_text(config.read_text().replace('listen = "127.0.0.1:8500"', 'listen = "127.0.0.1:0"'))
    clean_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}  # what systemd gives a service
    shared = Path(tempfile.mkdtemp(prefix="edgekit-deb-"))  # readable by the edgekit user
    try:
        shared.chmod(0o755)
        bundle = shared / "tiny-1.ekb"
        shutil.copyfile(bundles.v1, bundle)
        bundle.chmod(0o644)
        as_edgekit = as_edgekit_cmd(user)
        install = ["/usr/bin/edgekit-agent", "install", str(bundle), "--config", str(config)]
        done = _run(*as_edgekit, *install, env=clean_env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith("installed tiny v1; self-test passed")

        listener = NotifyListener(shared / "notify.sock")
        env = {**clean_env, "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000"}
        out = subprocess.PIPE
        proc = subprocess.Popen([*as_edgekit, *argv], env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT)
        try:
            ready = listener.wait_for("READY", "1", timeout_s=180)
            assert ready["MAINPID"] == str(proc.pid)  # the notifying process is the one systemd started
            status = Path(f"/proc/{proc.pid}/status").read_text()
            assert f"Uid:\t{user.pw_uid}\t" in status
            url = json.loads((store / "daemon.json").read_text())["url"]
            for route in ("/v2/health/ready", "/v2/models/tiny/ready"):
                with urllib.request.urlopen(url + route, timeout=10) as resp:
                    assert resp.status == 200
            listener.wait_for("WATCHDOG", "1", timeout_s=30)
            proc.send_signal(signal.SIGTERM)
            listener.wait_for("STOPPING", "1", timeout_s=30)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            output = proc.communicate(timeout=30)[0].decode(errors="replace")
            print(output[-2000:])
            listener.close()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert all(p.stat().st_uid == user.pw_uid for p in store.rglob("*"))
    # the package's `edgekit doctor` runs in the lean environment: it can run this config, build nothing
    done = _run(*as_edgekit_cmd(user), "/usr/bin/edgekit", "doctor", "--config", str(config), env=clean_env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == f"config     {config}: can run here"
    assert [line.split()[:2] for line in lines if line.startswith("  ok  onnxruntime ")] == [["ok", "onnxruntime"]]
    assert "  no  cpu     missing onnx, onnxslim" in lines

    # reinstall (an upgrade's scripts): the edited config and the store are kept
    assert _dpkg("-i", str(installed_deb)).returncode == 0
    assert 'listen = "127.0.0.1:0"' in config.read_text()
    assert (store / "state.json").exists()
    # remove keeps config and store; purge deletes them, the environment and the user
    done = _dpkg("--remove", "edgekit-agent")
    assert done.returncode == 0, done.stderr
    assert config.exists() and any(store.iterdir()) and not Path("/opt/edgekit").exists()
    done = _dpkg("--purge", "edgekit-agent")
    assert done.returncode == 0, done.stderr
    assert not any(Path(p).exists() for p in ("/etc/edgekit", "/var/lib/edgekit", "/opt/edgekit"))
    with pytest.raises(KeyError):
        pwd.getpwnam("edgekit")
