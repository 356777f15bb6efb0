"""examples.agent_process: an agent daemon and a load generator kept on separate CPUs (what the
serving benchmark's separate-cores run relies on)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from device_agents.cpus import physical_cores
from edgekit.bundle import generate_keypair
from examples.agent_process import RunningAgent, pinned
from tests.agent.conftest import needs_two_cpus


@needs_two_cpus
def test_pinned_runs_the_calling_thread_and_threads_it_starts_on_the_cpus_given_then_restores() -> None:
    before = os.sched_getaffinity(0)
    one = {min(before)}
    seen: list[set[int]] = []
    with pinned(one):
        assert os.sched_getaffinity(0) == one
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
    t.join()
    assert seen == [one], "a thread started inside keeps the CPUs it started with"
    assert os.sched_getaffinity(0) == before


def test_pinned_with_none_changes_nothing() -> None:
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with pinned(None):
        if before is not None:
            assert os.sched_getaffinity(0) == before


@needs_two_cpus
def test_running_agent_runs_every_daemon_thread_on_the_cpus_given_and_the_agent_logs_them(tmp_path: Path) -> None:
    _, pub = generate_keypair(tmp_path / "keys", "t")
    mine = os.sched_getaffinity(0)
    last = {max(mine)}
    with RunningAgent(tmp_path / "agent", [pub], cpus=last) as agent:
        assert agent.pid is not None
        tasks = list(Path(f"/proc/{agent.pid}/task").iterdir())
        assert len(tasks) > 1  # the daemon's HTTP, watchdog and other threads, not only its main one
        assert {frozenset(os.sched_getaffinity(int(t.name))) for t in tasks} == {frozenset(last)}
        # and it says so: its runtimes size their default thread pools to that one CPU (device_agents.cpus)
        machine = physical_cores(set(range(os.cpu_count() or 1)))
        assert f"CPUs: this agent may use 1 of the machine's {machine} cores" in agent.log_tail()
    assert os.sched_getaffinity(0) == mine, "starting the agent left this thread's CPUs as they were"
