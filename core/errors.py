"""The errors a user can fix, and how any error becomes one line of our own text."""

from __future__ import annotations


class UserError(Exception):
    """Something the user gave that cannot be used; the scripts print it as one line and exit 2."""


class ConfigError(UserError):
    """A config (a preset, a key, a --set) that cannot be used, or a checkpoint's config."""


class UsageError(UserError):
    """A command-line flag or argument that cannot be used (--input, --shard, --resume, ...)."""


def one_line(error: Exception) -> str:
    """The error's own message. One raised in a DataLoader worker comes back as "Caught X in DataLoader worker
    process 0." plus the worker's traceback, whose last line ends with the original message."""
    text = str(error)
    if text.startswith("Caught ") and "Original Traceback" in text:
        text = text.rstrip().splitlines()[-1].split(": ", 1)[-1]
    return text
