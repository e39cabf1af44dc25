"""The one ``torch.load`` of the project: tensors and plain values only (``weights_only=True``), and every way it can
fail said in our own words, whatever torch version is installed.

A file that needs pickled code is refused (a cron job must never run code that a file in a shared directory
brings): torch's message for that advises ``weights_only=False`` or allow-listing the class, which we never print.
torch's warnings while loading (a pickle protocol note, a future default) are caught and classified, so nothing
of torch's reaches stderr: see ``load_tensors``.
"""

from __future__ import annotations

import logging
import pickle
import re
import warnings
import zipfile

import torch

log = logging.getLogger("longvideo")
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_PROTOCOL = re.compile(r"pickle protocol (\d+)")


class UnsafeFile(Exception):
    """The file holds objects other than tensors and plain values: loading it would run code."""


class UnreadableFile(Exception):
    """Not a complete file torch can read (truncated, corrupt, not a torch file)."""


def load_tensors(path: str, map_location="cpu"):
    """``torch.load(path, weights_only=True)``; UnsafeFile or UnreadableFile with a reason of our own words.
    Warnings torch raises while loading are logged at debug level by category (what they concern, e.g. the
    file's pickle protocol, does not change what was loaded), never printed as torch's text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            protocol = next((m.group(1) for w in caught for m in [_PROTOCOL.search(str(w.message))] if m), None)
            name = _GLOBAL.search(str(e))
            if name:
                detail = f"it names {name.group(1)}, which is not a tensor or a plain value"
            elif protocol:
                detail = (
                    f"it was written with pickle protocol {protocol}, which the safe loader cannot read in "
                    f"full; re-save it with torch.save's default protocol"
                )
            else:
                detail = "it holds objects other than tensors and plain values"
            raise UnsafeFile(f"refused: the file needs pickled code to load ({detail})") from None
        except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
            raise UnreadableFile(_unreadable_reason(e)) from None
        except OSError as e:
            raise UnreadableFile(f"cannot be read ({e.strerror or type(e).__name__})") from None
        finally:
            for warning in caught:
                log.debug(
                    "torch.load(%s): a %s (%s) was raised and dropped",
                    path,
                    warning.category.__name__,
                    _warning_kind(str(warning.message)),
                )


def _unreadable_reason(error: Exception) -> str:
    text = str(error).lower()
    if isinstance(error, EOFError) or "ran out of input" in text:
        return "it ends early"
    if isinstance(error, zipfile.BadZipFile) or "zip archive" in text or "central directory" in text:
        return "not a complete zip archive"
    return f"torch cannot read it ({type(error).__name__})"


def _warning_kind(message: str) -> str:
    if "pickle protocol" in message:
        return "the file's pickle protocol"
    if "weights_only" in message:
        return "the weights_only default"
    return "other"
