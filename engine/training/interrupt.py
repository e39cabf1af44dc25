"""Ending a run that does not finish: the first Ctrl-C asks the loop to stop after the current batch, a second one
stops at once; ``saved_on_stop`` saves last.pt once, whatever stopped the run, and says how to continue."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from engine.training.run import RunStopped, TrainingRun

log = logging.getLogger("longvideo")


STOP_REQUESTED = threading.Event()  # set by the first Ctrl-C (see stop_on_ctrl_c)


@contextlib.contextmanager
def stop_on_ctrl_c():
    """Ctrl-C during training: the first one asks the loop to stop after the current batch (checked between
    batches and epochs, where raising cannot be lost: a KeyboardInterrupt raised inside a finalizer, such as the
    previous epoch's DataLoader iterator shutting its workers down, is printed and dropped by Python), a second
    one stops at once."""

    def request_stop(signum, frame):
        if STOP_REQUESTED.is_set():
            raise KeyboardInterrupt
        STOP_REQUESTED.set()
        log.warning("Ctrl-C: stopping after this batch and saving last.pt (Ctrl-C again to stop at once)")

    STOP_REQUESTED.clear()
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        yield
        return
    previous = signal.signal(signal.SIGINT, request_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_if_asked() -> None:
    if STOP_REQUESTED.is_set():
        raise KeyboardInterrupt


def next_batch(iterator):
    """The next loader batch; after a Ctrl-C the workers (which got it too) may be gone: stop, do not crash."""
    stop_if_asked()
    try:
        return next(iterator)
    except RuntimeError:
        stop_if_asked()
        raise


@contextlib.contextmanager
def saved_on_stop(run: TrainingRun, resume_command: str = "--resume auto"):
    """The one place a run that ends abnormally saves last.pt: a ``RunStopped`` (an OOM nothing could fit, a row
    of non-finite losses) leaves with the checkpoint named in its message; Ctrl-C saves at the last optimizer
    step (the unfinished accumulation group is trained again on resume) and says how to continue."""
    try:
        yield
    except RunStopped as stop:
        if stop.saves_checkpoint:
            stop.note_checkpoint(run.save("last.pt"))
        raise
    except KeyboardInterrupt:
        state = run.state
        state.batches_done -= state.batches_done % run.cfg.train.accumulate_grad_batches
        path = run.save("last.pt")
        log.warning(
            "interrupted at epoch %d, step %d: saved %s; continue with: %s",
            state.epoch + 1,
            state.global_step,
            path,
            resume_command,
        )
        raise
