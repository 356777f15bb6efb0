"""The fleet subcommands of ``edgekit``: ``publish``, ``fleet status|refresh|keys|acl|serve``.

``edgekit.cli`` calls ``register(subparsers)``; each subcommand sets ``func`` (``args -> exit
code``) and raises ``EdgekitError`` subclasses for the CLI entry point to print.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgekit.errors import ConfigError
from edgekit.fleet.s3 import S3Upload
from edgekit.fleet.session import broker_address

# `--key` meant the MQTT client's TLS key here and the signing key on `package`: one spelling per concept.
_RENAMED = {
    "--key": "it is --tls-key now (the private key of the --cert client certificate); bundles are signed by "
    "`edgekit package --signing-key`"
}


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse keeps it generic-less
    publish = subparsers.add_parser(
        "publish",
        renamed=_RENAMED,
        help="publish a bundle to devices over MQTT (desired state) and HTTP(S) (the file)",
        description=(
            "Verify BUNDLE, copy it where an HTTP(S) server serves --base-url (--copy-to) or upload it to "
            "S3-compatible object storage (--upload), and publish its desired-state notice retained (QoS 1) on "
            "edgekit/<fleet>/<device>/desired or edgekit/<fleet>/group/<group>/desired."
        ),
    )
    publish.add_argument("bundle", type=Path, help="the signed .ekb bundle")
    _fleet_arguments(publish)
    publish.add_argument("--device", action="append", default=[], metavar="ID", help="device id (repeatable)")
    publish.add_argument("--group", action="append", default=[], metavar="NAME", help="device group (repeatable)")
    publish.add_argument(
        "--rollout",
        type=int,
        default=100,
        metavar="PERCENT",
        help="share of devices to update, by a stable hash of the device id",
    )
    publish.add_argument(
        "--base-url",
        metavar="URL",
        help="where devices download the bundle from; with --upload, the public URL of the bucket or of a CDN "
        "in front of it (instead of a presigned URL)",
    )
    publish.add_argument(
        "--copy-to", type=Path, metavar="DIR", help="directory that the HTTP server serves at --base-url"
    )
    s3 = publish.add_argument_group(
        "object storage", "upload to S3 or an S3-compatible store; credentials from the standard AWS chain"
    )
    s3.add_argument(
        "--upload",
        metavar="s3://BUCKET/PREFIX",
        help="upload the bundle to PREFIX/<sha256>.ekb (skipped when that object exists with the same size)",
    )
    s3.add_argument("--s3-endpoint", metavar="URL", help="endpoint of an S3-compatible store (MinIO, Ceph, ...)")
    s3.add_argument("--s3-region", metavar="REGION", help="the bucket's region (default: asked from the bucket)")
    s3.add_argument(
        "--url-expires-s",
        type=int,
        metavar="N",
        help="life of the presigned URL in the notice (default and maximum 604800 = 7 days)",
    )
    publish.add_argument(
        "--trusted-key",
        type=Path,
        action="append",
        required=True,
        metavar="PUB",
        help="public key the bundle must verify with",
    )
    _notice_arguments(publish)
    publish.set_defaults(func=_publish)

    fleet = subparsers.add_parser("fleet", help="look at a fleet of devices", description="Fleet commands.")
    fleet_commands = fleet.add_subparsers(dest="fleet_command", required=True, metavar="COMMAND")
    status = fleet_commands.add_parser(
        "status",
        renamed=_RENAMED,
        help="every device's reported state as a table",
        description="Read the retained edgekit/<fleet>/+/reported messages and print one row per device.",
    )
    _fleet_arguments(status)
    status.add_argument("--wait-s", type=float, default=1.0, help="how long to collect retained messages (default 1 s)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=_status)

    from edgekit.fleet import fileserver

    serve = fleet_commands.add_parser(
        "serve",
        help="serve a directory over HTTP with Range support (single box and tests)",
        description=fileserver.__doc__.splitlines()[0].replace("``", "") if fileserver.__doc__ else None,
    )
    fileserver.add_arguments(serve)
    serve.set_defaults(func=fileserver.run)

    refresh = fleet_commands.add_parser(
        "refresh",
        help="re-sign the desired state of devices or groups with a new expiry (run it more often than --fresh-for)",
        description=(
            "Read each retained desired state, check it is signed by --notice-key, and publish it again with a new "
            "issued time and expiry; --drop NAME removes a model from the state (and so from its allowlist)."
        ),
    )
    _fleet_arguments(refresh)
    refresh.add_argument("--device", action="append", default=[], metavar="ID", help="device id (repeatable)")
    refresh.add_argument("--group", action="append", default=[], metavar="NAME", help="device group (repeatable)")
    refresh.add_argument("--drop", action="append", default=[], metavar="NAME", help="model name to remove")
    _notice_arguments(refresh)
    refresh.set_defaults(func=_refresh)

    from edgekit.fleet import keys as keys_module

    keys = fleet_commands.add_parser(
        "keys",
        help="publish the fleet's keys document (add notice and bundle keys, revoke key ids), signed by root keys",
        description=keys_module.__doc__.splitlines()[0] if keys_module.__doc__ else None,
    )
    _fleet_arguments(keys)
    keys_module.add_arguments(keys)
    keys.set_defaults(func=keys_module.run)

    from edgekit.fleet import acl as acl_module

    acl = fleet_commands.add_parser(
        "acl",
        help="write the Mosquitto ACL of a fleet: each device its own topics, each group's topic its members only",
        description=acl_module.__doc__.splitlines()[0] if acl_module.__doc__ else None,
    )
    acl_module.add_arguments(acl)
    acl.set_defaults(func=acl_module.run)


def _notice_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--notice-key",
        type=Path,
        required=True,
        metavar="KEY",
        help="private key of the fleet's notice role, which signs the desired state (edgekit keygen --name fleet)",
    )
    parser.add_argument(
        "--fresh-for",
        default="24h",
        metavar="DURATION",
        help="how long the signed desired state stays fresh (24h, 30m, 7d; bare number = hours; default 24h); "
        "devices report frozen after it until a refresh",
    )
    parser.add_argument(
        "--previous-notice-key",
        type=Path,
        action="append",
        default=[],
        metavar="PUB",
        help="after a rotation: a retired notice key whose signed states are carried over (their models kept)",
    )


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", required=True, metavar="URL", help="mqtt://HOST:PORT or mqtts://HOST:PORT")
    parser.add_argument("--fleet", required=True, help="fleet name (a topic level)")
    parser.add_argument("--ca", type=Path, help="CA certificate of the broker (mqtts)")
    parser.add_argument("--cert", type=Path, help="client certificate (mqtts)")
    parser.add_argument("--tls-key", dest="key", type=Path, help="private key of the --cert client certificate (mqtts)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="give up on the broker after this long")


def _upload(args: argparse.Namespace) -> S3Upload | None:
    if args.upload is None:
        given = [f for f in ("s3_endpoint", "s3_region", "url_expires_s") if getattr(args, f) is not None]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ConfigError(f"{flags} go with --upload s3://BUCKET/PREFIX")
        return None
    return S3Upload.parse(
        args.upload, endpoint_url=args.s3_endpoint, region=args.s3_region, url_expires_s=args.url_expires_s
    )


def _publish(args: argparse.Namespace) -> int:
    from edgekit.fleet.publish import PublishOptions, parse_duration, publish

    options = PublishOptions(
        broker=broker_address(args),
        fleet=args.fleet,
        base_url=args.base_url,
        trusted_keys=tuple(args.trusted_key),
        devices=tuple(args.device),
        groups=tuple(args.group),
        rollout_percent=args.rollout,
        copy_to=args.copy_to,
        timeout_s=args.timeout_s,
        upload=_upload(args),
        notice_key=args.notice_key,
        fresh_for_s=parse_duration(args.fresh_for),
        previous_notice_keys=tuple(args.previous_notice_key),
    )
    done = publish(args.bundle, options)
    n = done.notice
    for warning in done.warnings:
        print(f"warning: {warning}")
    if done.copied_to is not None:
        print(f"copied {args.bundle} to {done.copied_to}")
    if done.stored is not None:
        s = done.stored
        print(f"uploaded {args.bundle} to {s.uri}" if s.uploaded else f"{s.uri} exists (same size): upload skipped")
    for topic in done.topics:
        print(f"published {n.name} v{n.version} (notice {n.notice_id}, rollout {n.rollout_percent}%) on {topic}")
    print(f"devices download {n.url} ({n.size_bytes} bytes, sha256 {n.sha256})")
    if done.states:
        print(f"the signed desired state is fresh until {done.states[0].expires} (edgekit fleet refresh renews it)")
    if done.stored is not None and done.stored.url_expires is not None:
        print(
            f"the URL expires at {done.stored.url_expires}: devices that have not downloaded the bundle by then "
            "need a new publish"
        )
        if done.stored.temporary_credentials:
            print("it was signed with temporary credentials (a session token) and stops working with them if sooner")
    return 0


def _refresh(args: argparse.Namespace) -> int:
    from edgekit.fleet.publish import bindings, drop_models, keep_models, parse_duration, update_states

    if not args.device and not args.group:
        raise ConfigError("name the devices or groups to refresh: --device ID or --group NAME")
    bindings(args.fleet, tuple(args.device), tuple(args.group))  # topic levels checked before connecting
    change = drop_models(tuple(args.drop)) if args.drop else keep_models
    states, warnings = update_states(
        broker_address(args), args.fleet, tuple(args.device), tuple(args.group), args.notice_key, change,
        fresh_for_s=parse_duration(args.fresh_for), timeout_s=args.timeout_s,
        previous_notice_keys=tuple(args.previous_notice_key),
    )  # fmt: skip
    for warning in warnings:
        print(f"warning: {warning}")
    for state in states:
        models = ", ".join(f"{m.name} v{m.version}" for m in state.models) or "no models"
        print(f"refreshed {state.topic}: {models}; fresh until {state.expires}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from edgekit.fleet.status import format_json, format_table, read_status

    rows = read_status(broker_address(args), args.fleet, window_s=args.wait_s, timeout_s=args.timeout_s)
    if args.json:
        print(format_json(rows))
    elif rows:
        print(format_table(rows))
    else:
        print(f"no device of fleet {args.fleet} has reported yet")
    return 0
