"""The errors a user can fix, and how any error becomes one line of our own text."""
from __future__ import annotations

import re


class ConfigError(Exception):
    """A config, a flag or a file the user gave that cannot be used; the scripts print it as one line and exit 2."""


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def error_summary(error: Exception) -> str:
    """One line of a load error, for messages and files: the unpickler's own reason where torch gives one
    (never torch's advice to retry with weights_only=False, which would run the file's code), no terminal
    colour codes."""
    text = ANSI_ESCAPE.sub("", str(error)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = next((line for line in lines if "Unsupported global" in line or "WeightsUnpickler error" in line), None)
    if reason is None:
        reason = next((line for line in lines if "weights_only" not in line), lines[0] if lines else "")
    reason = reason.replace("WeightsUnpickler error: ", "")
    return reason or type(error).__name__


def one_line(error: Exception) -> str:
    """The error's own message. One raised in a DataLoader worker comes back as "Caught X in DataLoader worker
    process 0." plus the worker's traceback, whose last line ends with the original message."""
    text = str(error)
    if text.startswith("Caught ") and "Original Traceback" in text:
        text = text.rstrip().splitlines()[-1].split(": ", 1)[-1]
    return text
