"""``edgekit fleet acl``: the Mosquitto ACL of one fleet, from a groups file.

Written for a broker configured as ``packaging/mosquitto/edgekit.conf`` (the user name, and the
client id, are the client certificate's common name). Each device reads only its own desired
state and the fleet's keys document and writes only its own reported state; a group's desired
state is readable only by the devices the groups file lists in it; the publisher certificates
(``--publisher``, default ``edgekit-publisher``) write desired states and keys and read reports.
The groups file (TOML)::

    [groups]
    cameras = ["cam-07", "cam-08"]
    lobby = ["cam-09"]

Regenerate the ACL and reload the broker (``systemctl reload mosquitto``) when membership changes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from edgekit.bundle.codec import from_data
from edgekit.bundle.fleet_protocol import NoticeError, check_topic_level
from edgekit.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI
    import tomli as tomllib

DEFAULT_PUBLISHER = "edgekit-publisher"


@dataclass(frozen=True)
class GroupsFile:
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # group -> device ids


def load_groups(path: Path) -> GroupsFile:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"groups file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    groups: GroupsFile = from_data(GroupsFile, data, "groups", ConfigError)
    try:
        for group, members in groups.groups.items():
            check_topic_level("group", group)
            for device in members:
                check_topic_level("device", device)
    except NoticeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return groups


def render_acl(fleet: str, groups: GroupsFile, publishers: tuple[str, ...] = (DEFAULT_PUBLISHER,)) -> str:
    """The ``acl_file`` text: patterns for every device, a block per publisher and per group member."""
    try:
        check_topic_level("fleet", fleet)
    except NoticeError as exc:
        raise ConfigError(str(exc)) from exc
    members: dict[str, list[str]] = {}
    for group, devices in sorted(groups.groups.items()):
        for device in devices:
            members.setdefault(device, []).append(group)
    clash = sorted(set(members) & set(publishers))
    if clash:
        raise ConfigError(f"{clash[0]} is both a publisher and a group member; give the publisher its own CN")
    root = f"edgekit/{fleet}"
    lines = [
        f"# Mosquitto ACL of fleet {fleet}: written by `edgekit fleet acl`; regenerate it, do not edit it.",
        "# %u is the client certificate's common name (use_identity_as_username), which is the device id.",
        "",
        "# Every device: its own desired state and the fleet's keys (read), its own reported state (write).",
        f"pattern read {root}/%u/desired",
        f"pattern write {root}/%u/reported",
        f"pattern read {root}/keys",
    ]
    for publisher in publishers:
        lines += [
            "",
            f"user {publisher}",
            f"topic readwrite {root}/+/desired",
            f"topic readwrite {root}/group/+/desired",
            f"topic readwrite {root}/keys",
            f"topic read {root}/+/reported",
        ]
    if members:
        lines += ["", "# Group desired states: readable by the group's members only."]
    for device, device_groups in sorted(members.items()):
        lines += ["", f"user {device}", *(f"topic read {root}/group/{g}/desired" for g in device_groups)]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", required=True, help="fleet name (a topic level)")
    parser.add_argument("--groups", type=Path, required=True, metavar="TOML", help="[groups] name = [device ids]")
    parser.add_argument(
        "--publisher", action="append", default=[], metavar="CN",
        help=f"common name of a host-tool certificate (repeatable; default {DEFAULT_PUBLISHER})",
    )  # fmt: skip
    parser.add_argument("-o", "--output", type=Path, metavar="FILE", help="write here instead of stdout")


def run(args: argparse.Namespace) -> int:
    text = render_acl(args.fleet, load_groups(args.groups), tuple(args.publisher) or (DEFAULT_PUBLISHER,))
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        print(f"wrote {args.output}")
    return 0
