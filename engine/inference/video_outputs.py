"""What infer_chunked.py writes of each video besides the console: --output's JSON lines (each appended whole) and,
with --timeline, its per-frame CSV; --plot's pictures; the split's timeline scores. And the console lines."""

from __future__ import annotations

import csv
import io
import json
import os

from artifacts.timeline_plot import ROW_MINUTES, timeline_plot
from core.files import append_whole, atomic_write_bytes
from engine.inference.video_result import FrameTimeline, VideoResult
from engine.metrics.segments import format_scores


class Outputs:
    """The files of a run: ``start()`` empties them (this run's results only), ``write(result)`` adds a video."""

    def __init__(self, output: str | None, plot_dir: str | None, timeline: bool, row_minutes: float = ROW_MINUTES):
        self.output, self.plot_dir, self.row_minutes = output, plot_dir, row_minutes
        stem = os.path.splitext(output)[0] if output else None
        self.frames_csv = f"{stem}_frames.csv" if output and timeline else None
        self.scores_json = f"{stem}_scores.json" if output else None

    def start(self) -> None:
        if self.output:
            atomic_write_bytes(self.output, b"")  # this run's results only; each line is appended whole
        if self.frames_csv:
            atomic_write_bytes(self.frames_csv, b"video,frame,time_s,label,probability,true_label\n")
        if self.plot_dir:
            os.makedirs(self.plot_dir, exist_ok=True)

    def write(self, result: VideoResult, name: str, class_names: list[str]) -> None:
        if self.output:
            append_whole(self.output, (json.dumps(result.to_json()) + "\n").encode())
        if result.frames is None:
            return
        if self.frames_csv:
            append_whole(self.frames_csv, frame_rows(result, result.frames, class_names).encode())
        if self.plot_dir:
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

    def write_scores(self, scores: dict, videos: int) -> None:
        if self.scores_json:
            atomic_write_bytes(self.scores_json, json.dumps({"videos": videos, **scores}, indent=1).encode())


def frame_rows(result: VideoResult, frames: FrameTimeline, class_names: list[str]) -> str:
    """A video's per-frame CSV rows: frame, time, predicted label and its probability, the annotated label."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    for frame, (label, probability) in enumerate(zip(frames.labels, frames.probability)):
        true = "" if frames.truth is None or frames.truth[frame] < 0 else class_names[frames.truth[frame]]
        writer.writerow(
            [result.video, frame, f"{frame / result.fps:.3f}", class_names[label], f"{probability:.4f}", true]
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
