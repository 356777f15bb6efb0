"""``edgekit board status|stats|logs|infer|install|restart --port TTY``: the agent's serial console.

    edgekit board status --port /dev/ttyACM0
    edgekit board install tiny-2.ekb --port /dev/ttyACM0
    edgekit board infer --port /dev/ttyACM0 --model tiny --input x.npz [--output y.npz]
    edgekit board logs --port /dev/ttyACM0 -n 50

``--port`` defaults to ``$EDGEKIT_BOARD_PORT``. The client (``edgekit.board``, pyserial) is imported
only when one of these runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError, InferenceInputError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "board",
        help="talk to an agent over its serial console (status, stats, logs, infer, install, restart)",
        description="Talk to edgekit-agent over the tty its [console] device is wired to.",
    )
    board_sub = p.add_subparsers(dest="board_command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        c: argparse.ArgumentParser = board_sub.add_parser(name, help=help_text)
        c.add_argument(
            "--port", default=os.environ.get("EDGEKIT_BOARD_PORT"), help="the tty (default: $EDGEKIT_BOARD_PORT)"
        )
        c.add_argument("--baud", type=int, default=115200, help="baud rate of a UART (default 115200)")
        c.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds to wait for each answer")
        c.set_defaults(func=_board)
        return c

    command("status", "models installed and served, slots, errors")
    command("stats", "live serving numbers (JSON)")
    logs = command("logs", "the agent's recent log lines")
    logs.add_argument("-n", "--lines", type=int, default=100)
    infer = command("infer", "run X.npz through a model on the board")
    infer.add_argument("--model", required=True)
    infer.add_argument("--version", type=int)
    infer.add_argument("--input", type=Path, required=True, metavar="X.npz", help="one array per input name")
    infer.add_argument("--output", type=Path, metavar="Y.npz", help="save the outputs here")
    install = command("install", "send a bundle over the line and install it (resumes an interrupted send)")
    install.add_argument("bundle", type=Path)
    command("restart", "stop the agent cleanly (its supervisor starts it again)")


def _board(args: argparse.Namespace) -> int:
    from edgekit.board import BoardClient

    if not args.port:
        raise ConfigError("--port is missing: name the tty wired to the agent's console, or set EDGEKIT_BOARD_PORT")
    if args.board_command == "install" and not args.bundle.is_file():
        raise ConfigError(f"{args.bundle} does not exist or is not a file")
    with BoardClient(args.port, args.baud, timeout_s=args.timeout) as board:
        if args.board_command == "status":
            _print_status(board.status())
        elif args.board_command == "stats":
            print(json.dumps(board.stats(), indent=2, sort_keys=True))
        elif args.board_command == "logs":
            for line in board.logs(args.lines):
                print(line)
        elif args.board_command == "infer":
            _infer(board, args)
        elif args.board_command == "install":
            result = board.install(args.bundle)
            if not result["changed"]:
                print(f"{result['name']} v{result['version']} is already installed")
            else:
                prev = result.get("previous_version")
                print(f"installed {result['name']} v{result['version']}" + (f" (was v{prev})" if prev else ""))
        elif args.board_command == "restart":
            board.restart()
            print("the agent is stopping; its supervisor starts it again")
    return 0


def _print_status(doc: dict[str, Any]) -> None:
    print(f"agent: {'ready' if doc['ready'] else 'not ready'}")
    if not doc["status"]:
        print("no models installed")
    for name, ms in sorted(doc["status"].items()):
        slots = " ".join(f"{slot} v{ms[slot]}" for slot in ("active", "candidate", "previous") if ms.get(slot))
        print(
            f"{name}: {ms['status']} ({slots or 'no slots'})" + (f"; error: {ms['error']}" if ms.get("error") else "")
        )


def _infer(board: Any, args: argparse.Namespace) -> None:
    import numpy as np

    from edgekit.validate.calib import load_arrays

    inputs = load_arrays(args.input, "--input")
    if not inputs:
        raise InferenceInputError(f"--input {args.input} holds no arrays")
    outputs = board.infer(args.model, inputs, args.version)
    if args.output is not None:
        np.savez(args.output, **outputs)
        print(f"wrote {args.output}")
    for name, value in outputs.items():
        line = f"{name}: {value.dtype} {list(value.shape)}"
        if value.ndim == 2 and value.shape[1] > 1:
            line += f" top-1 {value.argmax(axis=1).tolist()}"
        print(line)
