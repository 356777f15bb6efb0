"""Progress of ``edgekit package``: which target of how many, which stage, time so far.

The packager reports plain messages (``[intel] building int8``); ``PackageProgress`` adds the
target's position and the elapsed time. On a terminal it draws a ``rich`` progress bar (target
k/N, stage, elapsed) refreshed only when a message arrives: while a converter runs its output is
captured into a log (``edgekit.targets.sdk_output``), so a display that redrew itself from a
timer thread would write into that log. Elsewhere (CI, pipes) it prints one plain line per
message: ``  12.3s [2/5 intel] building int8``.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

_TARGET = re.compile(r"^\[(?P<target>[a-z0-9_-]+)\] (?P<rest>.*)$", re.S)


class PackageProgress:
    """A ``progress`` callable for ``edgekit.package`` (messages go to ``stream``, never stdout)."""

    def __init__(self, targets: Sequence[str], stream: TextIO | None = None, fancy: bool | None = None) -> None:
        self.targets = list(targets)
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()
        self._bar: Any = None
        self._task: Any = None
        use_rich = self.stream.isatty() if fancy is None else fancy
        if use_rich:
            self._bar = _rich_bar(self.stream, len(self.targets))
            if self._bar is not None:
                self._task = self._bar.add_task("preparing", total=len(self.targets))
                self._bar.start()

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        m = _TARGET.match(message)
        if m and m.group("target") in self.targets:
            k = self.targets.index(m.group("target")) + 1
            position = f"[{k}/{len(self.targets)} {m.group('target')}] "
            text = m.group("rest")
        else:
            k, position, text = 0, "", message
        line = f"{elapsed:6.1f}s {position}{text}"
        if self._bar is None:
            print(line, file=self.stream, flush=True)
            return
        done = max(0, k - 1) + (1 if text.startswith("wrote ") else 0)
        stage = f"target {k}/{len(self.targets)} {m.group('target')}: {text}" if m and k else text
        self._bar.console.print(line, highlight=False, markup=False)
        self._bar.update(self._task, completed=done, description=stage[:60])
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _rich_bar(stream: TextIO, total: int) -> Any:
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # rich is optional: plain lines then
        return None
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=stream),
        auto_refresh=False,
        transient=True,
    )
