"""The project's one logger: set up once by each script's main(), never at import."""
from __future__ import annotations

import logging

log = logging.getLogger("longvideo")


def setup_logging(is_main: bool = True, verbose: bool = False) -> logging.Logger:
    """The project's one logger ("longvideo", its children in datasets/), one line format, printed by rank 0
    only (other ranks print errors). Its own handler: the root logger and other libraries are left alone.
    The decoders' own logs are ``datasets.video_reader.quiet_decoder_logs``'s."""
    if not any(getattr(h, "longvideo", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.longvideo = True
        log.addHandler(handler)
    log.setLevel((logging.DEBUG if verbose else logging.INFO) if is_main else logging.ERROR)
    return log


def attach_log_file(path: str) -> logging.Handler:
    """Every line the console shows also goes to ``path``, with its time (appended on resume)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return handler


def detach_log_file(handler: logging.Handler | None) -> None:
    if handler is not None:
        log.removeHandler(handler)
        handler.close()
