"""``edgekit-agent``: run the daemon, install a bundle, show the store's state.

    edgekit-agent run --config agent.toml [-v] [--log-format json]
    edgekit-agent install BUNDLE.ekb --config agent.toml
    edgekit-agent status --config agent.toml
    edgekit-agent stats --config agent.toml [--interval 2] [--count N]
    edgekit-agent list | uninstall NAME | rollback NAME  [--config agent.toml]
    edgekit-agent trace --seconds 5 -o trace.json --config agent.toml

A running daemon holds ``<store>/daemon.lock`` and writes its address to ``<store>/daemon.json``.
``install`` hands the bundle to that daemon over loopback (``POST /edgekit/v1/install``), so
the running agent switches to it; with no daemon it installs into the store itself, holding the
same lock so that no daemon starts halfway. ``stats`` scrapes the daemon's ``/metrics`` and
prints a live table; ``trace`` asks the daemon (``POST /edgekit/v1/trace``) for a Chrome trace
of the requests it serves in the next N seconds. SIGTERM drains: new requests get 503, running ones finish (up to
``server.drain_timeout_s``), then the daemon stops. Errors print ``edgekit-agent: error: <message>``
and exit with the error's ``exit_code``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from device_agents import __version__
from device_agents.config import AgentConfig, load_config
from device_agents.cpus import usable_cores
from device_agents.errors import StoreError
from device_agents.platforms import systemd
from device_agents.serving.tls import local_context_for, server_context
from device_agents.store import Store, atomic_write, flock
from device_agents.threads import NamedThread
from edgekit.bundle.command_line import Parser, os_error_message, os_error_parts, reader_gone
from edgekit.bundle.errors import ConfigError, EdgekitError

log = logging.getLogger("edgekit.agent")

DAEMON_LOCK = "daemon.lock"
DAEMON_INFO = "daemon.json"
CONFIG_ENV = "EDGEKIT_AGENT_CONFIG"
SYSTEM_CONFIG = Path("/etc/edgekit/agent.toml")
DAEMON_STOPPED = "daemon-stopped.json"  # pid and time of the last clean stop, for `status`
_DAEMON_WAIT_S = 30.0


class RemoteInstallError(EdgekitError):
    """The running daemon refused the bundle; carries the daemon's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- daemon presence ----------------------------------------------------------------------


def daemon_lock(store: Path, *, wait_s: float = 0.0) -> contextlib.AbstractContextManager[bool]:
    """Hold ``<store>/daemon.lock``; yields False (holding nothing) if a daemon has it."""
    store.mkdir(parents=True, exist_ok=True)
    return flock(store / DAEMON_LOCK, wait_s)


def _daemon_pid(store: Path) -> int | None:
    """The pid in ``daemon.json`` if that process is alive (a crashed daemon leaves the file)."""
    try:
        pid = int(json.loads((store / DAEMON_INFO).read_text())["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid


def daemon_url(store: Path) -> str:
    """The URL of the daemon that holds the lock (waits while it is starting)."""
    deadline = time.monotonic() + _DAEMON_WAIT_S
    while True:
        try:
            info = json.loads((store / DAEMON_INFO).read_text())
            url = str(info["url"])
            with urllib.request.urlopen(f"{url}/v2/health/live", timeout=2, context=local_context_for(url)):
                return url
        except (OSError, ValueError, KeyError):
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"an edgekit-agent daemon holds {store / DAEMON_LOCK} but does not answer at the address in "
                    f"{store / DAEMON_INFO}; wait until it has started, or stop it"
                ) from None
            time.sleep(0.2)


def find_config(given: Path | None) -> Path:
    """The config the commands read: ``--config``, else ``$EDGEKIT_AGENT_CONFIG``, else ``./agent.toml``,
    else ``/etc/edgekit/agent.toml``; the first that is given (or, for the last two, exists)."""
    if given is not None:
        return given
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    for candidate in (Path("agent.toml"), SYSTEM_CONFIG):
        if candidate.is_file():
            log.debug("config: %s", candidate.resolve())
            return candidate
    raise ConfigError(
        f"no agent config: give --config FILE, set {CONFIG_ENV}, or put agent.toml in this folder or at {SYSTEM_CONFIG}"
    )


# -- commands -----------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from device_agents.service import AgentService
    from device_agents.serving.http import AgentServer

    config = load_config(args.config)
    config.check_exposure()  # off loopback only with a bearer token or mutual TLS
    server_context(config.server)  # the TLS files load (ConfigError saying what to give) before any model does
    if log.isEnabledFor(logging.DEBUG):  # -v: what the agent runs with, defaults included
        from device_agents.effective_settings import effective_settings

        log.debug("config %s; effective settings follow", args.config)
        for line in effective_settings(config):
            log.debug("setting %s", line)
    raise_nofile_limit(config.server.max_connections)
    log_usable_cpus()
    # wait while a one-shot `install` holds the lock; refuse at once when another daemon does
    wait_s = 0.0 if _daemon_pid(config.store) is not None else _DAEMON_WAIT_S
    with daemon_lock(config.store, wait_s=wait_s) as held:
        if not held:
            raise StoreError(f"another edgekit-agent holds {config.store / DAEMON_LOCK}; stop it first")
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
        service = AgentService(config)
        service.start()
        try:
            server = AgentServer(config.listen_host, config.listen_port, service)
        except OSError as exc:
            service.stop()
            reason, advice = os_error_parts(exc)
            raise ConfigError(
                f"listen = {config.listen!r} ({args.config}): cannot listen there ({reason}); {advice}"
            ) from exc
        updater: Any = None
        console: Any = None
        notifier: systemd.SystemdNotifier | None = None
        try:
            _publish_address(config.store / DAEMON_INFO, server.url)
            if config.console is not None:  # its tty open before the API answers ready
                from device_agents.serving.console import start_console

                console = start_console(config, service, on_restart=stop.set)  # restart: a clean stop
            NamedThread(target=server.serve_forever, name="http", daemon=True).start()
            notifier = on_ready(server.url, service.models())
            if config.updates is not None:
                updater = _update_client(config, service.lifecycle)
                updater.start()
                log.info(
                    "updates: %s, fleet %s, device %s",
                    config.updates.broker,
                    config.updates.fleet,
                    config.updates.device_id,
                )
            while not stop.wait(1.0):
                pass
            log.info("stopping: draining in-flight requests (up to %g s)", config.server.drain_timeout_s)
            notifier.stopping()  # STOPPING=1 while the drain runs
            notifier = None
            if not service.drain():
                log.warning("some requests were still running after server.drain_timeout_s; stopping anyway")
        finally:
            if notifier is not None:
                notifier.stopping()
            if updater is not None:
                updater.stop()
            if console is not None:
                console.close()
            server.shutdown()
            server.server_close()
            service.stop()
            with contextlib.suppress(OSError):
                (config.store / DAEMON_INFO).unlink()
            _record_stop(config.store / DAEMON_STOPPED)
    log.info("stopped")
    exit_past_stuck_calls()
    return 0


def exit_past_stuck_calls() -> None:
    """Exit now (code 0, logs flushed) when runtime calls are still running that their runtime
    could not stop (a hung call abandoned on a runtime without ``terminate``): finalizing the
    interpreter under a runtime's C++ threads ends the process in SIGABRT."""
    from device_agents.runtimes.base import calls_in_runtime

    stuck = calls_in_runtime()
    if stuck:
        log.warning("%d runtime calls never returned; exiting without waiting for them", stuck)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def on_ready(url: str, models: dict[str, int]) -> systemd.SystemdNotifier:
    """The one place where the API is listening and the installed models are loaded: logs it and
    tells the supervisor (systemd's sd_notify READY=1, then the watchdog pings)."""
    served = ", ".join(f"{n} v{v}" for n, v in models.items()) or "no models"
    log.info("listening on %s; serving %s", url, served)
    return systemd.announce_serving(url, f"serving {served} on {url}")


def log_usable_cpus() -> None:
    """Say so where this agent may use fewer cores than the machine has (affinity, cgroup quota): the
    runtimes whose ``threads`` is 0 then start one thread per core it may use (``device_agents.cpus``)."""
    usable, machine = usable_cores()
    if usable < machine:
        log.info(
            "CPUs: this agent may use %d of the machine's %d cores (CPU affinity or cgroup quota); runtimes "
            "with threads = 0 start %d thread(s) each",
            usable,
            machine,
            usable,
        )


# Descriptors the agent holds besides its connections (models, store, cache, logs, MQTT, ...).
_OTHER_FDS = 64


def raise_nofile_limit(max_connections: int | None = None) -> None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit: every connection is a file descriptor.
    Warn when the limit is still below ``max_connections`` and the agent's own files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if max_connections is not None and soft < max_connections + _OTHER_FDS:
        log.warning(
            "the open-file limit (%d) is below server.max_connections (%d) + %d: past it new connections "
            "wait in the listen queue; raise LimitNOFILE / ulimit -n or lower server.max_connections",
            soft,
            max_connections,
            _OTHER_FDS,
        )


def _publish_address(path: Path, url: str) -> None:
    """Write ``daemon.json`` (pid, url) for `edgekit-agent install`; on a full disk serve anyway."""
    try:
        atomic_write(path, json.dumps({"pid": os.getpid(), "url": url}).encode())
    except StoreError as exc:
        log.error("cannot write %s (%s); serving anyway, but `install` will not find this daemon", path, exc)


def _record_stop(path: Path) -> None:
    """Write ``daemon-stopped.json`` (pid, when): `status` says since when the agent is stopped."""
    stopped = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        atomic_write(path, json.dumps({"pid": os.getpid(), "stopped": stopped}).encode())
    except StoreError as exc:
        log.warning("cannot write %s (%s); `status` will not say when this agent stopped", path, exc)


def daemon_state(store: Path, running: bool) -> str:
    """What `status` says about the daemon: running (pid, address), stopped cleanly (since when), gone
    without stopping (its pid; a crash or a kill), or never started on this store."""
    info = _read_json(store / DAEMON_INFO)
    if running:
        return f"running (pid {info.get('pid', '?')}, {info.get('url', 'address not published yet')})"
    if info.get("pid") is not None:  # a daemon that stops cleanly removes daemon.json
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime((store / DAEMON_INFO).stat().st_mtime))
        return f"stopped (pid {info['pid']}, started {started}, exited without stopping cleanly)"
    stopped = _read_json(store / DAEMON_STOPPED)
    if stopped.get("stopped"):
        return f"stopped since {stopped['stopped']} (pid {stopped.get('pid', '?')})"
    return "not running"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _update_client(config: AgentConfig, lifecycle: Any) -> Any:
    try:
        from device_agents.updates.client import UpdateClient
    except ImportError as exc:
        raise EdgekitError(f"[updates] is configured but the update client cannot be loaded ({exc})") from exc
    return UpdateClient(config, lifecycle)


def cmd_install(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    bundle = Path(args.bundle).resolve()
    if not bundle.is_file():
        raise StoreError(f"{args.bundle} does not exist or is not a file")
    with daemon_lock(config.store) as held:
        if held:
            result = _install_here(config, bundle)
        else:
            result = _install_via_daemon(daemon_url(config.store), bundle)
    from device_agents.service import unmatched_model_tables

    installed = [n for n, ms in Store(config.store).load_state().models.items() if ms.active is not None]
    for warning in unmatched_model_tables(config, installed):
        print(f"warning: {warning}", file=sys.stderr)
    if not result["changed"]:
        print(f"{result['name']} v{result['version']} is already installed")
        return 0
    prev = result.get("previous_version")
    test = result.get("selftest") or {}
    p50 = test.get("latency_p50_ms")
    print(
        f"installed {result['name']} v{result['version']}"
        + (f" (was v{prev})" if prev is not None else "")
        + (f"; self-test passed, p50 {p50:.3f} ms" if p50 is not None else "; self-test passed")
    )
    return 0


def _install_here(config: AgentConfig, bundle: Path) -> dict[str, Any]:
    from device_agents.lifecycle import Lifecycle
    from edgekit.bundle.codec import to_data

    lifecycle = Lifecycle(config)
    try:
        installed: dict[str, Any] = to_data(lifecycle.install(bundle, origin="cli"))
        return installed
    finally:
        lifecycle.stop()


def _install_via_daemon(url: str, bundle: Path) -> dict[str, Any]:
    return _post_to_daemon(f"{url}/edgekit/v1/install", {"bundle": str(bundle), "origin": "cli"}, "the bundle")


def _post_to_daemon(url: str, doc: dict[str, Any], what: str) -> dict[str, Any]:
    body = json.dumps(doc).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600, context=local_context_for(url)) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except urllib.error.HTTPError as exc:
        try:
            doc = json.loads(exc.read())
        except ValueError:
            doc = {}
        raise RemoteInstallError(
            doc.get("error", f"the agent answered {exc.code}"), int(doc.get("exit_code", 1))
        ) from exc
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot hand {what} to the running agent at {url}: {exc}") from exc


def _manage(args: argparse.Namespace, action: str) -> dict[str, Any]:
    """Uninstall or roll back ``args.name``: through the running daemon, else in the store here."""
    config = load_config(args.config)
    with daemon_lock(config.store) as held:
        if not held:
            url = f"{daemon_url(config.store)}/edgekit/v1/models/{urllib.parse.quote(args.name, safe='')}/{action}"
            return _post_to_daemon(url, {"origin": "cli"}, f"the {action}")
        from device_agents.lifecycle import Lifecycle
        from edgekit.bundle.codec import to_data

        lifecycle = Lifecycle(config)
        try:
            act = lifecycle.uninstall if action == "uninstall" else lifecycle.operator_rollback
            state: dict[str, Any] = to_data(act(args.name, origin="cli"))
            return state
        finally:
            lifecycle.stop()


def cmd_uninstall(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    before = Store(config.store).model_state(args.name)
    _manage(args, "uninstall")
    was = f" (was v{before.active.version})" if before.active is not None else ""
    print(f"uninstalled {args.name}{was}; a later install must still be newer than v{before.max_version}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    before = Store(config.store).model_state(args.name)
    state = _manage(args, "rollback")
    was = f" (was v{before.active.version})" if before.active is not None else ""
    print(f"rolled back {args.name} to v{state['active']['version']}{was}; recorded as the operator's rollback")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    store = Store(config.store)
    installed = {n: ms for n, ms in sorted(store.load_state().models.items()) if ms.active is not None}
    if not installed:
        print("no models installed")
        return 0
    rows: list[tuple[str, ...]] = [("MODEL", "VERSION", "PREVIOUS", "TARGET", "RUNTIME", "INSTALLED")]
    for name, ms in installed.items():
        slot = ms.active
        if slot is None:  # filtered above; says so to mypy
            continue
        m = store.manifest_of(slot)
        previous = f"v{ms.previous.version}" if ms.previous else "-"
        rows.append((name, f"v{slot.version}", previous, m.target, m.compatibility.runtime, slot.installed or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    with daemon_lock(config.store) as free:
        daemon = daemon_state(config.store, running=not free)
    state = Store(config.store).load_state()
    print(f"agent: {daemon}; store {config.store}")
    if not state.models:
        print("no models installed")
        return 0
    rows: list[tuple[str, ...]] = [("MODEL", "ACTIVE", "CANDIDATE", "PREVIOUS", "STATUS", "ERROR")]
    for name, ms in sorted(state.models.items()):
        rows.append(
            (
                name,
                *(f"v{slot.version}" if slot else "-" for slot in (ms.active, ms.candidate, ms.previous)),
                ms.status if not free or ms.status != "serving" else "installed",  # nothing serves it now
                ms.error or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    from device_agents.budgets.state import budget_line
    from device_agents.stats import snapshot, summarize, table, thread_cpu_line
    from device_agents.threads import ThreadCpu

    config = load_config(args.config)
    with daemon_lock(config.store) as free:
        if free:
            raise StoreError(f"no edgekit-agent daemon runs on {config.store}; start it with `edgekit-agent run`")
    url = daemon_url(config.store)

    texts: list[str] = []  # the last scrape's, for the budget line

    def scrape() -> Any:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10, context=local_context_for(url)) as resp:
                texts[:] = [resp.read().decode()]
                return snapshot(text_string_to_metric_families(texts[0]))
        except (OSError, ValueError) as exc:
            raise StoreError(f"cannot read {url}/metrics: {exc}") from exc

    pid = _daemon_pid(config.store)
    cpu = ThreadCpu.read(pid) if pid is not None else None  # Linux: the daemon's CPU by thread name
    previous, at = scrape(), time.monotonic()
    if args.count == 1:
        print(table(summarize(previous)))  # since the daemon started
        print(budget_line(texts[0]))
        if cpu is not None:
            print(thread_cpu_line(cpu.since(ThreadCpu(0.0, {}))))
        return 0
    shown = 0
    while args.count == 0 or shown < args.count - 1:
        time.sleep(args.interval)
        current, now = scrape(), time.monotonic()
        print(time.strftime("%H:%M:%S"), f"last {now - at:.1f} s")
        print(table(summarize(current.minus(previous), now - at)), flush=True)
        print(budget_line(texts[0]), flush=True)
        later = ThreadCpu.read(pid) if cpu is not None and pid is not None else None
        if cpu is not None and later is not None:
            print(thread_cpu_line(later.since(cpu), now - at), flush=True)
        cpu, previous, at = later, current, now
        shown += 1
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Ask the running daemon for a Chrome trace of the requests it serves in the next N seconds."""
    if not 0 < args.seconds <= 60:
        raise ConfigError(f"--seconds takes 0 < N <= 60, not {args.seconds:g}")
    config = load_config(args.config)
    with daemon_lock(config.store) as free:
        if free:
            raise StoreError(f"no edgekit-agent daemon runs on {config.store}; start it with `edgekit-agent run`")
    url = f"{daemon_url(config.store)}/edgekit/v1/trace?seconds={args.seconds:g}"
    trace = _post_to_daemon(url, {}, "the trace request")
    atomic_write(args.output, json.dumps(trace, separators=(",", ":")).encode())
    other = trace.get("otherData", {})
    print(
        f"wrote {args.output}: {other.get('requests', 0)} requests in {other.get('batches', 0)} runtime calls "
        f"over {args.seconds:g} s (open it in https://ui.perfetto.dev or chrome://tracing)"
    )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Time a split bundle's full model and heads here, for `edgekit split plan --device-profile`."""
    from device_agents.split.profile import profile_bundle, write_profile
    from device_agents.updates.trust import bundle_trust

    config = load_config(args.config)
    bundle = Path(args.bundle)
    if not bundle.is_file():
        raise StoreError(f"{args.bundle} does not exist or is not a file")
    doc = profile_bundle(
        bundle, bundle_trust(config), config.runtime_options, budget_s=args.budget_s, device_power_w=args.device_power_w
    )
    write_profile(args.output, doc)
    cuts = ", ".join(f"{k} {v['head_ms']:.3f}" for k, v in doc["cuts"].items())
    print(f"full model {doc['full_ms']:.3f} ms; heads (ms): {cuts}; wrote {args.output}")
    return 0


COMMANDS = {
    "profile": cmd_profile,
    "run": cmd_run,
    "install": cmd_install,
    "status": cmd_status,
    "stats": cmd_stats,
    "list": cmd_list,
    "uninstall": cmd_uninstall,
    "rollback": cmd_rollback,
    "trace": cmd_trace,
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def build_parser() -> Parser:
    parser = Parser(
        prog="edgekit-agent",
        description="Run signed edgekit bundles on this device.",
        epilog="exit codes: 0 done, 1 error (bundle, store, self-test), 2 bad config or arguments",
    )
    parser.add_argument("--version", action="version", version=f"edgekit-agent {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--log-format", choices=("text", "json"), default="text", help="log lines as text or JSON")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="serve the installed models over HTTP (Open Inference Protocol v2)")
    install = sub.add_parser("install", help="verify, self-test and switch to a bundle (hands it to a running agent)")
    install.add_argument("bundle", type=Path, help="the .ekb file")
    status = sub.add_parser("status", help="show the installed models and their slots")
    stats = sub.add_parser("stats", help="print a live table of the running daemon's serving numbers")
    stats.add_argument("--interval", type=float, default=2.0, help="seconds between rows (default 2)")
    stats.add_argument("--count", type=int, default=0, help="tables to print (0 = until interrupted; 1 = since start)")
    listing = sub.add_parser("list", help="list the installed models: version, previous version, target, runtime")
    uninstall = sub.add_parser("uninstall", help="stop serving a model and remove its files (through a running agent)")
    uninstall.add_argument("name", metavar="NAME", help="the model's name")
    rollback = sub.add_parser("rollback", help="serve a model's previous version again (through a running agent)")
    rollback.add_argument("name", metavar="NAME", help="the model's name")
    trace = sub.add_parser("trace", help="write a Chrome trace of the requests the running daemon serves")
    trace.add_argument("--seconds", type=float, default=5.0, help="how long to record (default 5, at most 60)")
    trace.add_argument("-o", "--output", type=Path, default=Path("trace.json"), help="where (default trace.json)")
    profile = sub.add_parser(
        "profile", help="time a split bundle's full model and heads here (for `edgekit split plan --device-profile`)"
    )
    profile.add_argument("bundle", type=Path, help="the split .ekb (from `edgekit package --split`)")
    profile.add_argument("-o", "--output", type=Path, default=Path("profile.json"), help="where (default profile.json)")
    profile.add_argument("--budget-s", type=float, default=10.0, help="seconds spent timing (default 10)")
    profile.add_argument(
        "--device-power-w", type=float, help="watts to record where the device has no energy meter (stated)"
    )
    for p in (run, install, status, stats, listing, uninstall, rollback, trace, profile):
        p.add_argument(
            "--config",
            type=Path,
            help=f"the agent's TOML config (default: ${CONFIG_ENV}, then ./agent.toml, then {SYSTEM_CONFIG})",
        )
        # also after the subcommand; SUPPRESS keeps a -v given before it
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug messages")
        p.add_argument(
            "--log-format", choices=("text", "json"), default=argparse.SUPPRESS, help="log lines as text or JSON"
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `edgekit-agent status | head`: the reader has what it wanted
        return reader_gone()


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse(argv)
    verbose = args.verbose
    # the daemon logs one line per event; one-shot commands print their result and at most one error line
    level = logging.DEBUG if verbose else logging.INFO if args.command == "run" else logging.CRITICAL
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    try:
        args.config = find_config(args.config)
        return COMMANDS[args.command](args)
    except EdgekitError as exc:
        print(f"edgekit-agent: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        raise
    except OSError as exc:
        print(f"edgekit-agent: error: {os_error_message(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
