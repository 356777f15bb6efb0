"""``edgekit split plan`` (and ``edgekit serve-tail``): registered on the ``edgekit`` parser."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from edgekit.split import compression


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse keeps it generic-less
    split = subparsers.add_parser("split", help="split inference: where to cut a model between device and server")
    split_sub = split.add_subparsers(dest="split_command", required=True, metavar="COMMAND")
    plan = split_sub.add_parser(
        "plan",
        help="the cut that minimises end-to-end latency per bandwidth",
        description=(
            "Enumerate the cut points of MODEL where few tensors cross, extract each head and tail, check that they "
            "compose to MODEL, measure them with ONNX Runtime here (or read --device-profile / --server-profile), "
            "and print, per bandwidth, all-local, all-remote and the best split. Writes the heads, tails, "
            "plan.json, plan.txt and latency.png under --output-dir."
        ),
    )
    plan.add_argument("model", type=Path, help="the ONNX model")
    plan.add_argument("--target", default="cpu", help="device target (cpu: measured with ONNX Runtime here)")
    plan.add_argument("--input-shape", action="append", default=[], metavar="NAME=1x3x320x320")
    plan.add_argument("--calib", type=Path, metavar="C.npz", help="sample inputs (one array per input name)")
    plan.add_argument("--samples", type=int, default=8, help="samples checked and compressed per cut")
    plan.add_argument("--device-profile", type=Path, metavar="P.json", help="head/full times recorded on the device")
    plan.add_argument("--server-profile", type=Path, metavar="P.json", help="tail/full times recorded on the server")
    plan.add_argument(
        "--server-speedup",
        type=float,
        default=10.0,
        help="without --server-profile: how many times faster than this host the server runs a tail (default 10)",
    )
    plan.add_argument("--bandwidth-mbps", default="1,10,100,1000", help="Mbit/s, comma-separated")
    plan.add_argument("--rtt-ms", type=float, default=20.0, help="round-trip time to the server (default 20)")
    plan.add_argument(
        "--compress", choices=compression.MODES, default="none", help="send cut tensors as fp16/int8 + zlib"
    )
    plan.add_argument("--max-tensors", type=int, default=1, help="most tensors allowed to cross a cut (default 1)")
    plan.add_argument("--budget-s", type=float, default=20.0, help="time spent timing the segments")
    plan.add_argument("--output-dir", "-o", type=Path, help="where to write (default: MODEL's stem + '-split')")
    plan.add_argument("--save-profile", type=Path, metavar="P.json", help="write this host's times as a profile")
    plan.add_argument("--no-plot", action="store_true", help="skip latency.png")
    plan.set_defaults(func=_plan)


def _plan(args: Any) -> int:
    from edgekit.compress.onnx_prep import parse_input_shape
    from edgekit.split.plan import parse_bandwidths
    from edgekit.split.planner import plan_model

    bandwidths = parse_bandwidths(args.bandwidth_mbps)
    out = args.output_dir or args.model.with_name(args.model.stem + "-split")
    run = plan_model(
        args.model,
        out,
        bandwidths,
        target=args.target,
        rtt_ms=args.rtt_ms,
        input_shapes=dict(parse_input_shape(s) for s in args.input_shape),
        calib=args.calib,
        samples=args.samples,
        device_profile=args.device_profile,
        server_profile=args.server_profile,
        server_speedup=args.server_speedup,
        compress=args.compress,
        max_tensors=args.max_tensors,
        budget_s=args.budget_s,
        save_profile=args.save_profile,
        plot=not args.no_plot,
    )
    print(run.table)
    print(f"wrote {out}/plan.json, plan.txt" + ("" if args.no_plot else ", latency.png") + ", heads/, tails/")
    return 0
