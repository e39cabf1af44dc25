"""What the three scripts share at their edge: the config flags, and one line plus exit code 2 for a usage error.

``config`` knows what a valid config is; this module knows how a command line reaches it and how its errors
reach the user.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from core.errors import UserError, one_line
from core.files import DiskFullError


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", required=required, help="YAML preset, e.g. configs/rtx5080.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, typed by YAML rules (repeatable): --set data.batch_size=8",
    )
    parser.add_argument(
        "--use_amp", "--use-amp", action="store_true", help="mixed precision: fp16 + GradScaler on CUDA, bf16 on CPU"
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved, validated config and exit")


def exit_on_usage_error(main: Callable[[], int | None], input_errors: tuple = (), disk_advice: str = "") -> None:
    """Run a script's main(); a UserError (a config or usage error) or one of ``input_errors`` (a bad file the user
    gave) becomes one line on stderr and exit code 2, a full disk (DiskFullError) one line and exit code 1
    (``disk_advice``: what to do then, after "; "), never a traceback."""
    try:
        code = main()
    except (UserError, *input_errors) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except DiskFullError as e:
        print(f"error: {one_line(e)}" + (f"; {disk_advice}" if disk_advice else ""), file=sys.stderr)
        sys.exit(1)
    sys.exit(code or 0)
