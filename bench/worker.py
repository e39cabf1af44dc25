"""What the benchmarks share: each measurement runs in a fresh process of the same script (``--worker``), so one
measurement's allocator, caches and threads cannot colour the next one's."""

from __future__ import annotations

import argparse
import json


def parse_or_measure(parser: argparse.ArgumentParser, measure, **worker_options: type) -> argparse.Namespace | None:
    """The parsed command line; None when this process is a worker, after it printed ``measure(args)`` as JSON.
    ``worker_options``: the hidden options (name=type) a worker gets besides the script's own."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name, kind in worker_options.items():
        parser.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:
        return args
    print(json.dumps(measure(args)))
    return None
