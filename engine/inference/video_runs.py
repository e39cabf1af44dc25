"""What infer_chunked.py's loop over videos keeps and decides: the run's counts and summary (``Tally``), whether the
run goes on after a video fails (``go_on_after``: a video that cannot be read is one error line and the others go
on; a stalled file ends the run), and a video's features files (``save_features``)."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

from config import Config
from datasets.video.info import StalledFile
from engine.inference.features import FeatureOutput, mstcn_features_path, write_features, write_mstcn
from engine.inference.video_result import VideoResult
from engine.metrics.segments import SegmentationScores, format_scores


class Tally:
    """A run's counts: videos done, skipped (features already there) and failed; the labelled ones right."""

    def __init__(self):
        self.counts, self.correct, self.labelled, self.chunks = Counter(), 0, 0, 0
        self.start = time.perf_counter()

    def add(self, result: VideoResult) -> None:
        self._label(result.correct)
        self.counts["run"] += 1

    def resumed(self, rows: list[dict], output: str | None) -> list[dict]:
        """The rows an earlier run wrote to --output, counted (its accuracy is over every video of the file)."""
        for row in rows:
            self._label(row.get("correct"))
        if rows:
            print(f"resuming: {len(rows)} videos are in {output} already; they are skipped")
        self.counts["resumed"] = len(rows)
        return rows

    def _label(self, correct: bool | None) -> None:
        """A video's top label against the manifest's (None: the video has no label)."""
        if correct is not None:
            self.labelled += 1
            self.correct += int(correct)

    def progress(self, number: int, total: int) -> str:
        """The line after each video: how many are done, and the time left at this run's pace so far."""
        ran = self.counts["run"]
        elapsed = time.perf_counter() - self.start
        left = (total - number) * elapsed / ran if ran else 0.0
        return f"[{number}/{total} videos, {_duration(elapsed)} elapsed, about {_duration(left)} left]"

    def summary(self, scores: SegmentationScores, features: bool) -> list[str]:
        lines = []
        if self.labelled:
            lines.append(f"accuracy: {self.correct}/{self.labelled} = {self.correct / self.labelled:.4f}")
        if scores.videos:
            lines.append(f"timelines over {scores.videos} annotated videos: {format_scores(scores.result())}")
        if features:
            rate = self.chunks / max(time.perf_counter() - self.start, 1e-9)
            lines.append(
                f"features: {self.counts['done']} done, {self.counts['skipped']} skipped (already there), "
                f"{self.counts['failed']} failed; {rate:.1f} chunks/s"
            )
        return lines


def go_on_after(error: Exception, left: int, tally: Tally) -> bool:
    """A video that failed, said on stderr and counted; False when the videos left cannot run."""
    tally.counts["failed"] += 1
    print(f"error: {error}", file=sys.stderr)
    if isinstance(error, StalledFile) and left:
        # OpenCV opens files under one process-wide lock, which the blocked decoder holds for good
        print(
            f"error: the other {left} videos are not run: a stalled file keeps the decoder blocked in this "
            f"process; run infer_chunked.py again without it",
            file=sys.stderr,
        )
        tally.counts["failed"] += left
        return False
    return True


def save_features(
    name: str, result: VideoResult, record, cfg: Config, features: FeatureOutput, class_names, reason: str, tally: Tally
) -> None:
    """A video's features files written (atomically), in the layouts asked for; its arrays then leave the result."""
    written = []
    if features.layout != "mstcn":
        written.append(os.path.join(features.directory, name))
        write_features(written[-1], result, record, cfg, features.settings, class_names, features.checkpoint)
    if features.layout != "npz":
        write_mstcn(features.directory, name, result, record, class_names)
        written.append(mstcn_features_path(features.directory, name))
    print(f"features: {' and '.join(written)} ({len(result.features.features)} chunks; {reason})")
    tally.chunks += len(result.features.features)
    tally.counts["done"] += 1
    result.features = None


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
