"""Annotations: one manifest format, JSONL (or CSV for the simple case), or a root/<class>/<video> folder.

A JSONL line is one sample:

    {"video": "videos/a.mp4", "label": "left"}
    {"views": {"front": "f.mp4", "left": "l.mp4"}, "label": "left", "keypoints": "keypoints/a"}
    {"video": "long.mp4", "segments": [{"start": 0, "end": 300, "label": "up"}, ...]}

``segments`` are frames [start, end) (or ``start_sec``/``end_sec``); ``keypoints`` is a directory of
per-frame files ``NNNNNN_<name>.npz`` (NNNNNN = the global frame index) or one ``.npy``/``.npz`` array
[T, J, C]. A CSV has a header with ``video`` and ``label`` (and optionally ``keypoints``). Paths are
relative to the manifest's directory; they are never passed to a shell.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".m4v", ".mpg", ".mpeg")


class ManifestError(Exception):
    """A manifest line (or file) that cannot be used; the message names the file and the line."""


@dataclass
class Segment:
    start: int | None
    end: int | None
    label: str
    start_sec: float | None = None
    end_sec: float | None = None

    def in_frames(self, fps: float) -> tuple[int, int]:
        start = self.start if self.start is not None else int(round(self.start_sec * fps))
        end = self.end if self.end is not None else int(round(self.end_sec * fps))
        return start, end


@dataclass
class VideoRecord:
    views: dict[str, str]  # view name -> path; a single-view record has the one view "video"
    label: str | None = None
    segments: list[Segment] | None = None
    keypoints: str | None = None
    where: str = ""  # "manifest.jsonl:12", for error messages
    extra: dict = field(default_factory=dict)

    @property
    def first_path(self) -> str:
        return next(iter(self.views.values()))

    @property
    def video(self) -> str | dict[str, str]:
        """What a result names the record by: its file, or its camera views' files."""
        return self.first_path if len(self.views) == 1 else self.views

    def labels(self) -> list[str]:
        return [self.label] if self.segments is None else [s.label for s in self.segments]


def read_manifest(path: str, labelled: bool = True) -> list[VideoRecord]:
    """The records of a manifest; ``labelled`` False: a line may have no label (a run that reads none:
    train.objective: motion)."""
    if os.path.isdir(path):
        return _read_folder(path)
    if not os.path.exists(path):
        raise ManifestError(f"{path}: manifest not found")
    if path.endswith(".csv"):
        return _read_csv(path, labelled)
    return _read_jsonl(path, labelled)


def _resolve(base: str, value, where: str, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where}: '{key}' must be a path (a non-empty string), got {value!r}")
    return value if os.path.isabs(value) else os.path.normpath(os.path.join(base, value))


def _read_jsonl(path: str, labelled: bool = True) -> list[VideoRecord]:
    base = os.path.dirname(os.path.abspath(path))
    records = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            text = text.strip()
            if not text or text.startswith("#"):
                continue
            where = f"{path}:{number}"
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as e:
                raise ManifestError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object")
            if not isinstance(entry, dict):
                raise ManifestError(f"{where}: each line must be a JSON object, got {type(entry).__name__}")
            records.append(_record(entry, base, where, labelled))
    if not records:
        raise ManifestError(f"{path}: the manifest has no samples")
    return records


def _record(entry: dict, base: str, where: str, labelled: bool = True) -> VideoRecord:
    known = {"video", "views", "label", "segments", "keypoints"}
    if ("video" in entry) == ("views" in entry):
        raise ManifestError(f"{where}: give exactly one of 'video' (one file) or 'views' ({{name: file}})")
    if "video" in entry:
        views = {"video": _resolve(base, entry["video"], where, "video")}
    else:
        if not isinstance(entry["views"], dict) or not entry["views"]:
            raise ManifestError(f'{where}: \'views\' must map view names to files, e.g. {{"front": "f.mp4"}}')
        views = {str(name): _resolve(base, p, where, f"views.{name}") for name, p in entry["views"].items()}
    label, segments = entry.get("label"), None
    if "segments" in entry:
        if label is not None:
            raise ManifestError(f"{where}: give 'label' (one label for the video) or 'segments' (a timeline), not both")
        segments = _segments(entry["segments"], where)
    elif label is None and labelled:
        raise ManifestError(f"{where}: missing 'label' (or 'segments')")
    if label is not None and (isinstance(label, bool) or not isinstance(label, (str, int))):
        raise ManifestError(f"{where}: 'label' must be a class name, got {label!r}")
    keypoints = _resolve(base, entry["keypoints"], where, "keypoints") if entry.get("keypoints") else None
    extra = {k: v for k, v in entry.items() if k not in known}
    return VideoRecord(views, None if label is None else str(label), segments, keypoints, where, extra)


def manifest_entry(record: VideoRecord) -> dict:
    """A record as a JSON line of a manifest (its files absolute): what ``_record`` reads back."""
    entry = {"video": record.first_path} if list(record.views) == ["video"] else {"views": dict(record.views)}
    if record.label is not None:
        entry["label"] = record.label
    if record.segments is not None:
        entry["segments"] = [
            {"start": s.start, "end": s.end, "label": s.label}
            if s.start is not None
            else {"start_sec": s.start_sec, "end_sec": s.end_sec, "label": s.label}
            for s in record.segments
        ]
    if record.keypoints is not None:
        entry["keypoints"] = record.keypoints
    return entry | record.extra


def _segments(value, where: str) -> list[Segment]:
    if not isinstance(value, list) or not value:
        raise ManifestError(f"{where}: 'segments' must be a non-empty list of {{start, end, label}}")
    segments = []
    for i, seg in enumerate(value):
        here = f"{where}: segments[{i}]"
        if not isinstance(seg, dict) or "label" not in seg:
            raise ManifestError(f"{here} must be an object with start, end (frames) or start_sec, end_sec, and label")
        frames = "start" in seg and "end" in seg
        seconds = "start_sec" in seg and "end_sec" in seg
        if not (frames or seconds):
            raise ManifestError(f"{here} needs start and end (frames) or start_sec and end_sec")
        keys = ("start", "end") if frames else ("start_sec", "end_sec")
        a, b = seg[keys[0]], seg[keys[1]]
        number = int if frames else (int, float)
        if not all(isinstance(v, number) and not isinstance(v, bool) for v in (a, b)) or a < 0 or b <= a:
            raise ManifestError(f"{here}: needs 0 <= {keys[0]} < {keys[1]}, got {a!r}, {b!r}")
        segments.append(
            Segment(a, b, str(seg["label"])) if frames else Segment(None, None, str(seg["label"]), float(a), float(b))
        )
    return segments


def _read_csv(path: str, labelled: bool = True) -> list[VideoRecord]:
    base = os.path.dirname(os.path.abspath(path))
    records = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        needed = ["video", "label"] if labelled else ["video"]
        missing = set(needed) - set(reader.fieldnames or [])
        if missing:
            raise ManifestError(
                f"{path}:1: the CSV header needs the columns {' and '.join(needed)} "
                f"(missing: {', '.join(sorted(missing))})"
            )
        for number, row in enumerate(reader, start=2):
            entry = {k: v for k, v in row.items() if k and v}  # other columns (a group key) as a JSON line's
            records.append(_record(entry, base, f"{path}:{number}", labelled))
    if not records:
        raise ManifestError(f"{path}: the manifest has no samples")
    return records


def _read_folder(root: str) -> list[VideoRecord]:
    """root/<class>/<video>: the layout of public datasets (UCF101, Kinetics folders)."""
    records = []
    for label in sorted(os.listdir(root)):
        class_dir = os.path.join(root, label)
        if not os.path.isdir(class_dir) or label.startswith("."):
            continue
        for name in sorted(os.listdir(class_dir)):
            if name.lower().endswith(VIDEO_EXTENSIONS):
                records.append(VideoRecord({"video": os.path.join(class_dir, name)}, label, where=class_dir))
    if not records:
        raise ManifestError(
            f"{root}: no videos found in the root/<class>/<video> layout (extensions: {', '.join(VIDEO_EXTENSIONS)})"
        )
    return records
