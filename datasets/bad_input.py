"""Bad input: the errors a file or a manifest line ends in, and the main process's report of the files skipped
(``data.on_bad_video: skip``) and of the workers' warnings."""

from __future__ import annotations

import logging

from datasets.keypoints import KeypointError
from datasets.manifest import ManifestError
from datasets.video.info import VideoReadError

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger

BAD_INPUT_ERRORS = (VideoReadError, KeypointError, ManifestError)
MAX_CONSECUTIVE_FAILURES = 50  # samples skipped in a row (on_bad_video: skip) before the data is called broken


class BadInputReport:
    """In the main process: the warnings the samples carry, printed once per run; the files skipped
    (data.on_bad_video: skip) with their reasons, listed at the end of each epoch and of the run, those rejected
    while indexing included."""

    def __init__(self, *datasets):
        self.indexed = {path: reason for d in datasets if d is not None for path, reason in d.skipped.items()}
        self.skipped: dict[str, str] = dict(self.indexed)  # the run's
        self.epoch: dict[str, str] = {}
        self.seen: set[str] = set()

    def take(self, batch: dict) -> None:
        for note in batch.pop("notes", []):
            if note not in self.seen:
                self.seen.add(note)
                log.warning("%s", note)
        for path, reason in batch.pop("skipped", {}).items():
            if path not in self.skipped:
                log.warning("skipping %s", reason)
            self.skipped.setdefault(path, reason)
            self.epoch.setdefault(path, reason)

    def end_epoch(self, epoch: int) -> None:
        listed = {**self.indexed, **self.epoch}
        if listed:
            log.warning("epoch %d: %d file(s) skipped: %s", epoch, len(listed), self._text(listed))
        self.epoch = {}

    def end_run(self) -> None:
        if self.skipped:
            log.warning(
                "run: %d file(s) skipped (data.on_bad_video: skip): %s", len(self.skipped), self._text(self.skipped)
            )

    @staticmethod
    def _text(files: dict) -> str:
        return "; ".join(f"{path} ({reason})" for path, reason in sorted(files.items()))
