"""What both command-line tools (``edgekit`` and ``edgekit-agent``) share: an argument parser that
suggests the nearest flag, command or choice, and one-line messages for OS errors.

Part of the contract both sides import (``edgekit.bundle``): ``device_agents`` may import nothing
of ``edgekit`` but it.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

EXIT_READER_GONE = 141
_INVALID_CHOICE = re.compile(r"argument (?P<arg>[^:]+): invalid choice: '(?P<got>[^']*)' \(choose from (?P<opts>.*)\)")

# What to do about an OS error, by errno; the message always names the path first.
_ADVICE = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EISDIR: "it is a folder; give a file path",
    errno.EACCES: "choose a path you may write, or fix its permissions",
    errno.EPERM: "choose a path you may write, or fix its permissions",
    errno.EROFS: "the file system is read-only; choose another path",
    errno.ENOSPC: "the disk is full; free some space or choose another path",
    errno.EEXIST: "it already exists; remove it or choose another path",
    errno.EADDRINUSE: "the address is in use; stop what listens there or choose another port",
    errno.EADDRNOTAVAIL: "this machine has no such address; listen on 127.0.0.1 or one of its own addresses",
}


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors suggest the nearest valid command, choice or flag.

    ``renamed`` maps a removed flag to a sentence saying what replaced it. Use ``parse`` instead
    of ``parse_args``: it reports an unknown flag against the subcommand it was given to.
    """

    def __init__(self, *args: object, renamed: Mapping[str, str] | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # argparse's own keyword types
        self.renamed = dict(renamed or {})

    def error(self, message: str) -> NoReturn:
        m = _INVALID_CHOICE.search(message)
        if m:
            options = [o.strip().strip("'") for o in m.group("opts").split(",")]
            got = m.group("got")
            swapped = [o for o in options if sorted(o) == sorted(got)]  # `stauts` is `status`, not `stats`
            near = swapped or difflib.get_close_matches(got, options, n=1)
            if near:
                message += f"; did you mean {near[0]!r}?"
        # one line, like every other error (the usage is one `--help` away)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        argv = list(sys.argv[1:] if argv is None else argv)
        chain = _chain(self, argv)
        deepest = chain[-1]
        _check_command_word(self, argv)  # a misspelt command before the flags that belong to it
        known = [s for p in chain for a in p._actions for s in a.option_strings]
        # Unknown flags first: a misspelt required flag would otherwise be reported as missing.
        for token in argv:
            if token == "--":
                break
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and not any(k.startswith(flag) for k in known):
                deepest._unknown(flag, known)
        args, extra = self.parse_known_args(argv)
        if extra:
            flag = extra[0].split("=", 1)[0]
            if flag.startswith("-"):
                deepest._unknown(flag, known)
            deepest.error(f"unrecognized extra argument {extra[0]!r}")
        return args

    def _unknown(self, flag: str, known: Sequence[str]) -> NoReturn:
        if flag in self.renamed:
            self.error(f"{flag} is gone: {self.renamed[flag]}")
        near = difflib.get_close_matches(flag, known, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        self.error(f"unrecognized argument {flag}{hint}")


def _chain(parser: Parser, argv: Sequence[str]) -> list[Parser]:
    """The parser and the subparsers that the command words in ``argv`` select, outermost first."""
    chain = [parser]
    for token in argv:
        sub = next((a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            break
        chosen = sub.choices.get(token)
        if isinstance(chosen, Parser):
            chain.append(chosen)
    return chain


def _check_command_word(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Report a misspelt command word (``edgekit pakage``) as the invalid choice it is, with the nearest
    command, before the flags after it are reported as unknown to the parser above it."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return
        if token.startswith("-"):
            action = parser._option_string_actions.get(token.split("=", 1)[0])
            i += 2 if action is not None and action.nargs != 0 and "=" not in token else 1
            continue
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or sub.choices is None:
            return
        chosen = sub.choices.get(token)
        if chosen is None:
            choices = ", ".join(repr(c) for c in sub.choices)
            parser.error(f"argument {sub.metavar or sub.dest}: invalid choice: {token!r} (choose from {choices})")
        parser, i = chosen, i + 1


def reader_gone() -> int:
    """stdout's reader went away (``edgekit inspect X | head``): end quietly with 141 (128 + SIGPIPE),
    what a shell reports for a tool that its reader stopped. stdout is pointed at /dev/null so that
    the interpreter's last flush does not complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (captured); nothing left to flush to
        pass
    return EXIT_READER_GONE


def os_error_message(exc: OSError) -> str:
    """One line: the path (or paths), what failed and what to do."""
    where = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    reason, advice = os_error_parts(exc)
    return f"{where}: {reason}; {advice}" if where else f"{reason}; {advice}"


def os_error_parts(exc: OSError) -> tuple[str, str]:
    """(the reason in lower case, what to do) for an ``OSError``."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if reason[:1].isupper() and reason[1:2].islower():
        reason = reason[0].lower() + reason[1:]
    return reason, _ADVICE.get(exc.errno or 0, "check the path and its permissions")
