"""The project's one logger: set up once by each script's main(), never at import."""

from __future__ import annotations

import logging
import os

from core.files import DiskFullError, append_whole, repair_torn_tail

log = logging.getLogger("longvideo")


class WholeLineFileHandler(logging.Handler):
    """A log file written a whole line at a time (``core.files.append_whole``). A write that fails for lack of space
    raises DiskFullError out of the logging call, so the run stops at its first failed write with one line (Python's
    FileHandler would print a "--- Logging error ---" traceback per line and let the run go on); after that the
    handler writes nothing more, so the error itself can still be logged to the console."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.failed = path, False

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        try:
            append_whole(self.path, (self.format(record) + "\n").encode("utf-8", errors="replace"))
        except DiskFullError:
            self.failed = True
            raise


def setup_logging(is_main: bool = True, verbose: bool = False) -> logging.Logger:
    """The project's one logger ("longvideo", its children in datasets/), one line format, printed by rank 0
    only (other ranks print errors). Its own handler: the root logger and other libraries are left alone.
    The decoders' own logs are ``datasets.video.capture.quiet_decoder_logs``'s."""
    if not any(getattr(h, "longvideo", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.longvideo = True
        log.addHandler(handler)
    log.setLevel((logging.DEBUG if verbose else logging.INFO) if is_main else logging.ERROR)
    return log


def attach_log_file(path: str) -> logging.Handler:
    """Every line the console shows also goes to ``path``, with its time (appended on resume; a line torn by a kill
    or a full disk is cut off first, with a warning)."""
    torn = repair_torn_tail(path)
    handler = WholeLineFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    if torn:
        log.warning(
            "%s: its last line was cut short (a run killed or a disk full while writing it): removed %d bytes",
            os.path.basename(path),
            torn,
        )
    return handler


def detach_log_file(handler: logging.Handler | None) -> None:
    if handler is not None:
        log.removeHandler(handler)
        handler.close()
