"""What infer_chunked.py writes of each video besides the console: --output's JSON lines and CSV rows (each appended
whole; a rerun goes on where they end) and, with --timeline, its per-frame CSV; --plot's pictures; the split's
timeline scores. And the console lines."""

from __future__ import annotations

import csv
import io
import json
import os

from artifacts.timeline_plot import ROW_MINUTES, timeline_plot
from core.errors import UsageError
from core.files import append_whole, atomic_write_bytes
from engine.inference.video_result import FrameTimeline, VideoResult
from engine.metrics.segments import SegmentationScores, format_scores


class Outputs:
    """The files of a run. ``--output OUT.jsonl``: a JSON line per video and ``OUT.csv`` (video, its label, the top-k
    labels with their probabilities), each row appended whole after the video; with --timeline ``OUT_frames.csv``
    (every frame's label); with annotated segments ``OUT_scores.json`` (the timeline scores over all videos);
    ``--plot`` a picture per video. ``OUT_settings.json`` says what wrote them: a rerun with the same checkpoint and
    settings goes on where the files end (``resume``), the videos already there skipped."""

    def __init__(self, output: str | None, plot_dir: str | None, timeline: bool, settings: dict, topk: int,
                 row_minutes: float = ROW_MINUTES):  # fmt: skip
        if output and output.lower().endswith(".csv"):
            raise UsageError(
                f"--output {output}: names the JSON lines file (OUT.jsonl); the CSV is written beside it as OUT.csv"
            )
        self.output, self.plot_dir, self.row_minutes, self.topk = output, plot_dir, row_minutes, topk
        stem = os.path.splitext(output)[0] if output else None
        self.csv = f"{stem}.csv" if output else None
        self.frames_csv = f"{stem}_frames.csv" if output and timeline else None
        self.scores_json = f"{stem}_scores.json" if output else None
        self.settings_json = f"{stem}_settings.json" if output else None
        self.settings = settings

    def resume(self, scores: SegmentationScores) -> list[dict]:
        """The rows of the videos an earlier run with these settings wrote (their timeline counts added back to
        ``scores``); the files made whole again: a row cut short by a kill, a video that failed (it runs again),
        and the frame rows of a video whose JSON line was not written are dropped. A first run starts them."""
        rows = self._earlier_rows()
        done = [row for row in rows if "error" not in row]
        if self.output:
            atomic_write_bytes(self.settings_json, (json.dumps(self.settings, indent=1) + "\n").encode())
            atomic_write_bytes(self.output, "".join(json.dumps(row) + "\n" for row in done).encode())
            atomic_write_bytes(self.csv, (self._csv_header() + "".join(self._csv_row(row) for row in done)).encode())
        if self.frames_csv:
            _keep_frame_rows(self.frames_csv, {video_key(row["video"]) for row in done})
        if self.plot_dir:
            os.makedirs(self.plot_dir, exist_ok=True)
        for row in done:
            if "score_counts" in row:
                scores.add_counts(row["score_counts"])
        return done

    def _earlier_rows(self) -> list[dict]:
        if not self.output or not os.path.exists(self.output):
            return []
        rows = []
        with open(self.output, "rb") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:  # the last line, cut short by a kill: that video runs again
                    break
        if not rows:
            return []
        before = _read_json(self.settings_json)
        if before != self.settings:
            changed = (
                f"{self.settings_json} is missing"
                if before is None
                else "its " + ", ".join(sorted(k for k in self.settings if before.get(k) != self.settings[k]))
            )
            raise UsageError(
                f"--output {self.output}: holds {len(rows)} videos of another run ({changed} differ from this "
                f"run's); give another --output, or delete the file to start over"
            )
        return rows

    def write(self, result: VideoResult, name: str, class_names: list[str]) -> None:
        """A video's rows and picture; its JSON line last, so a run stopped before it (a kill, a full disk) runs the
        video again."""
        if result.frames is not None and self.frames_csv:
            append_whole(self.frames_csv, frame_rows(result, result.frames, class_names).encode())
        if result.frames is not None and self.plot_dir:
            path = os.path.join(self.plot_dir, os.path.splitext(name)[0] + ".png")
            timeline_plot(
                path,
                result.frames.labels,
                result.frames.truth,
                class_names,
                result.fps,
                os.path.basename(str(result.video)),
                result.scores,
                self.row_minutes,
            )
            print(f"  timeline picture: {path}")
        if self.output:
            row = result.to_json()
            append_whole(self.output, (json.dumps(row) + "\n").encode())
            if result.error is None:
                append_whole(self.csv, self._csv_row(row).encode())

    def write_scores(self, scores: dict, videos: int) -> None:
        if self.scores_json:
            atomic_write_bytes(self.scores_json, json.dumps({"videos": videos, **scores}, indent=1).encode())

    def _csv_header(self) -> str:
        ranks = [f"{name}_{k}" for k in range(2, self.topk + 1) for name in ("predicted", "probability")]
        return ",".join(["video", "label", "predicted", "probability", *ranks]) + "\n"

    def _csv_row(self, row: dict) -> str:
        text = io.StringIO()
        top = [value for t in row["topk"] for value in (t["label"], t["prob"])]
        top += [""] * (2 * self.topk - len(top))
        csv.writer(text, lineterminator="\n").writerow([video_key(row["video"]), row.get("label", ""), *top])
        return text.getvalue()


def video_key(video: str | dict) -> str:
    """A video as its rows name it: its file, or its camera views' files as one JSON object."""
    return video if isinstance(video, str) else json.dumps(video, sort_keys=True)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _keep_frame_rows(path: str, videos: set[str]) -> None:
    """OUT_frames.csv cut back to its header and the rows of ``videos``: a video's rows come before its JSON line,
    so rows of another video can only be at the end."""
    if not os.path.exists(path):
        atomic_write_bytes(path, FRAMES_HEADER.encode())
        return
    with open(path, "rb+") as f:
        end = len(f.readline())  # the header
        for line in iter(f.readline, b""):
            if next(csv.reader([line.decode("utf-8")]))[0] not in videos:
                break
            end += len(line)
        f.truncate(end)


FRAMES_HEADER = "video,frame,time_s,label,probability,true_label\n"


def frame_rows(result: VideoResult, frames: FrameTimeline, class_names: list[str]) -> str:
    """A video's per-frame CSV rows: frame, time, predicted label and its probability, the annotated label."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    for frame, (label, probability) in enumerate(zip(frames.labels, frames.probability)):
        true = "" if frames.truth is None or frames.truth[frame] < 0 else class_names[frames.truth[frame]]
        writer.writerow(
            [
                video_key(result.video),
                frame,
                f"{frame / result.fps:.3f}",
                class_names[label],
                f"{probability:.4f}",
                true,
            ]
        )
    return text.getvalue()


def print_result(result: VideoResult, show_timeline: bool) -> None:
    """A video's console lines: its top labels (and the true one), its timeline scores, with --timeline its
    segments."""
    top = ", ".join(f"{t['label']} {t['prob']:.2f}" for t in result.topk)
    truth = f"  (true: {result.label})" if result.label is not None else ""
    print(f"{result.video}: {result.num_frames} frames @ {result.fps:.1f} fps, {result.chunks} chunks -> {top}{truth}")
    if result.scores is not None:
        print(f"  timeline against the annotated segments: {format_scores(result.scores)}")
    if show_timeline:
        print(f"  {'start':>8s} {'end':>8s} {'start s':>8s} {'end s':>8s}  label")
        for seg in result.segments:
            print(
                f"  {seg['start']:8d} {seg['end']:8d} {seg['start'] / result.fps:8.2f} "
                f"{seg['end'] / result.fps:8.2f}  {seg['label']}"
            )
