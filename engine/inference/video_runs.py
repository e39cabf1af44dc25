"""infer_chunked.py's driver: each video of an input list streamed through the model (``classify_video``), its
features written or skipped when already there, its result printed and written, and the run's summary. A video
that cannot be read is one error line, and the others go on; a stalled file ends the run (below)."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

from tqdm import tqdm

from config import Config
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.device_input import InputPreparer
from datasets.video.info import StalledFile
from engine.inference.features import FeatureOutput, mstcn_features_path, write_features, write_mstcn, write_mstcn_index
from engine.inference.stream import InferenceSpec, classify_video
from engine.inference.video_outputs import Outputs, print_result
from engine.inference.video_result import VideoResult
from engine.metrics.segments import SegmentationScores, background_indices, format_scores


class Tally:
    """A run's counts: videos done, skipped (features already there) and failed; the labelled ones right."""

    def __init__(self):
        self.counts, self.correct, self.labelled, self.chunks = Counter(), 0, 0, 0
        self.start = time.perf_counter()

    def add(self, result: VideoResult) -> None:
        if result.correct is not None:
            self.labelled += 1
            self.correct += int(result.correct)

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


def run_videos(
    model,
    records: list,
    names: list[str],
    cfg: Config,
    spec: InferenceSpec,
    runtime,
    class_names,
    outputs: Outputs,
    features: FeatureOutput | None,
) -> int:
    """Each video classified (and with ``features``, its features written, or skipped when already there);
    prints each result and the summary; returns the number that failed."""
    prepare = InputPreparer(runtime.device, cfg.data.mean, cfg.data.std)
    scores = SegmentationScores(background_indices(cfg.data.background_labels, class_names))
    tally = Tally()
    outputs.start()
    progress = tqdm(names, desc="videos", disable=not sys.stderr.isatty() or len(records) == 1)
    for number, (record, name) in enumerate(zip(records, progress)):
        reason = features.done(name) if features else "new"
        if reason is None:
            print(
                f"skipped {record.first_path}: {os.path.join(features.directory, name)} exists with the same settings"
            )
            tally.counts["skipped"] += 1
            continue
        try:
            result = classify_video(
                model,
                record,
                cfg.data,
                spec,
                runtime,
                prepare,
                class_names,
                keep_features=features is not None,
                scores=scores,
            )
        except BAD_INPUT_ERRORS as e:
            if len(records) == 1:
                raise
            if not _go_on_after(e, len(records) - number - 1, tally):
                break
            result = VideoResult(record.first_path, error=str(e))
        if features and result.error is None:
            _save_features(name, result, record, cfg, features, class_names, reason, tally)
        tally.add(result)
        outputs.write(result, name, class_names)
        if result.error is None:  # the console shows the summary with --output too
            print_result(result, spec.timeline)
    for line in tally.summary(scores, features is not None):
        print(line)
    if features and features.layout != "npz":
        labelled = any(r.segments is not None for r in records)
        listed = write_mstcn_index(features, class_names, labelled)
        print(
            f"MS-TCN's layout: {features.directory}/splits/{features.bundle}.bundle lists {len(listed)} of the "
            f"{len(features.all_names)} videos" + (", mapping.txt its classes" if labelled else "")
        )
    if scores.videos:
        outputs.write_scores(scores.result(), scores.videos)
    return tally.counts["failed"]


def _go_on_after(error: Exception, left: int, tally: Tally) -> bool:
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


def _save_features(
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
