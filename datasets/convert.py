"""Importers: the annotation files users already have -> this project's JSONL manifest.

    python -m datasets.convert ucf101 ucfTrainTestlist --videos UCF-101 --split 1 --subset train --out ucf_train.jsonl
    python -m datasets.convert hmdb51 testTrainMulti_7030_splits --videos hmdb51 --subset test --out hmdb_test.jsonl
    python -m datasets.convert kinetics kinetics400/train.csv --videos kinetics400/train --out k400_train.jsonl
    python -m datasets.convert activitynet activity_net.v1-3.min.json --videos anet --subset validation \
        --out anet_val.jsonl
    python -m datasets.convert thumos thumos14.json --videos thumos --subset test --out thumos_test.jsonl
    python -m datasets.convert mmaction train_list_videos.txt --videos data/videos --classes classes.txt \
        --out train.jsonl

Every line of the source is mapped or reported: videos not on disk, labels not in the class list, lines that do not
parse. Anything unmapped stops the import (exit 2, nothing written) with one summary; ``--skip-missing`` writes the
lines that did map and still prints the summary. The manifest is written atomically (never half a file), with
video paths relative to it, so the data folder can move with its manifests.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

from core.cli import exit_on_usage_error
from core.files import atomic_open
from datasets.manifest import VIDEO_EXTENSIONS

FORMATS = ("ucf101", "hmdb51", "kinetics", "activitynet", "thumos", "mmaction")


class ConvertError(Exception):
    """A source that cannot be imported as asked: one line naming the file and what to do."""


@dataclass
class Imported:
    lines: list[dict] = field(default_factory=list)  # manifest lines, video paths absolute until written
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # kind -> where, what
    source_lines: int = 0

    def problem(self, kind: str, text: str) -> None:
        self.problems[kind].append(text)

    def summary(self) -> str:
        unmapped = sum(len(v) for v in self.problems.values())
        parts = [f"{len(items)} {kind} (first: {items[0]})" for kind, items in sorted(self.problems.items())]
        return f"{unmapped} of {self.source_lines} entries not mapped: " + "; ".join(parts)


def _text_lines(path: str) -> list[tuple[int, str]]:
    if not os.path.isfile(path):
        raise ConvertError(f"{path}: not found")
    with open(path, encoding="utf-8") as f:
        return [(number, line.strip()) for number, line in enumerate(f, start=1) if line.strip()]


def _video(videos: str, relative: str, result: Imported, where: str) -> str | None:
    path = os.path.normpath(os.path.join(videos, relative))
    if not os.path.isfile(path):
        result.problem("missing video files", f"{where}: {path}")
        return None
    return path


# ------------------------------------------------------------------------------------------- UCF101 / HMDB51


def _ucf101(src: str, videos: str, split: int, subset: str, classes: str | None) -> Imported:
    """classInd.txt ("1 ApplyEyeMakeup"), trainlist0N.txt ("Class/v_x.avi 1"), testlist0N.txt ("Class/v_x.avi")."""
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: expected the folder with classInd.txt and trainlist0{split}.txt")
    names = {}
    for _number, line in _text_lines(os.path.join(src, "classInd.txt")):
        index, _, name = line.partition(" ")
        names[index] = name.strip()
    listing = os.path.join(src, f"{'trainlist' if subset == 'train' else 'testlist'}{split:02d}.txt")
    result = Imported()
    for number, line in _text_lines(listing):
        result.source_lines += 1
        where = f"{listing}:{number}"
        parts = line.split()
        relative = parts[0]
        folder = relative.replace("\\", "/").split("/")[0]
        label = names.get(parts[1]) if len(parts) > 1 else folder
        if label is None or label not in names.values():
            result.problem("unknown labels", f"{where}: {parts[1] if len(parts) > 1 else folder}")
            continue
        path = _video(videos, relative, result, where)
        if path:
            result.lines.append({"video": path, "label": label})
    return result


def _hmdb51(src: str, videos: str, split: int, subset: str, classes: str | None) -> Imported:
    """<class>_test_split<N>.txt: "video.avi 1" (1 training, 2 testing, 0 unused); videos under <videos>/<class>/."""
    files = sorted(glob.glob(os.path.join(src, f"*_test_split{split}.txt")))
    if not files:
        raise ConvertError(f"{src}: no *_test_split{split}.txt files (HMDB51's split folder)")
    wanted = {"train": "1", "test": "2"}[subset]
    result = Imported()
    for listing in files:
        label = os.path.basename(listing)[: -len(f"_test_split{split}.txt")]
        for number, line in _text_lines(listing):
            parts = line.split()
            if len(parts) != 2 or parts[1] not in "012":
                result.source_lines += 1
                result.problem("unparsed lines", f"{listing}:{number}: {line!r}")
                continue
            if parts[1] != wanted:
                continue
            result.source_lines += 1
            path = _video(videos, os.path.join(label, parts[0]), result, f"{listing}:{number}")
            if path:
                result.lines.append({"video": path, "label": label})
    return result


# ------------------------------------------------------------------------------------------------ Kinetics


def _kinetics(src: str, videos: str, split: int, subset: str | None, classes: str | None) -> Imported:
    """label,youtube_id,time_start,time_end,split; clips named <youtube_id>_<start:06d>_<end:06d>.<ext> (the
    downloaders' naming) or <youtube_id>.<ext>, in <videos>/<label>/ or <videos>/."""
    if not os.path.isfile(src):
        raise ConvertError(f"{src}: not found")
    result = Imported()
    with open(src, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"label", "youtube_id", "time_start", "time_end"} - set(reader.fieldnames or [])
        if missing:
            raise ConvertError(
                f"{src}: a Kinetics CSV needs the columns label,youtube_id,time_start,time_end[,split]; "
                f"missing {', '.join(sorted(missing))}"
            )
        for number, row in enumerate(reader, start=2):
            if subset and row.get("split") and row["split"] != subset:
                continue
            result.source_lines += 1
            where = f"{src}:{number}"
            try:
                stem = f"{row['youtube_id']}_{int(float(row['time_start'])):06d}_{int(float(row['time_end'])):06d}"
            except ValueError:
                result.problem(
                    "unparsed lines", f"{where}: time_start/time_end {row['time_start']!r}, {row['time_end']!r}"
                )
                continue
            label = row["label"]
            candidates = [
                os.path.join(folder, name + ext)
                for folder in (os.path.join(videos, label), videos)
                for name in (stem, row["youtube_id"])
                for ext in VIDEO_EXTENSIONS
            ]
            path = next((c for c in candidates if os.path.isfile(c)), None)
            if path is None:
                result.problem(
                    "missing video files",
                    f"{where}: {os.path.join(videos, label, stem)}.mp4 (or .webm, ..., or in {videos}/)",
                )
                continue
            result.lines.append({"video": os.path.normpath(path), "label": label})
    return result


# ------------------------------------------------------------------------------------ ActivityNet / THUMOS


def _untrimmed(src: str, videos: str, split: int, subset: str | None, classes: str | None) -> Imported:
    """{"database": {"<id>": {"subset": "validation", "annotations": [{"segment": [s, e], "label": "x"}]}}}, the
    segments in seconds; the video is <id>.<ext> or v_<id>.<ext> (ActivityNet's downloads) under <videos>."""
    if not os.path.isfile(src):
        raise ConvertError(f"{src}: not found")
    try:
        with open(src, encoding="utf-8") as f:
            database = json.load(f).get("database")
    except (ValueError, AttributeError) as e:
        raise ConvertError(f"{src}: not an ActivityNet/THUMOS JSON ({e})")
    if not isinstance(database, dict):
        raise ConvertError(f'{src}: no "database" object of videos (the ActivityNet/THUMOS JSON layout)')
    result = Imported()
    for video_id, entry in database.items():
        if subset and str(entry.get("subset", "")).lower() != subset.lower():
            continue
        result.source_lines += 1
        where = f"{src}: {video_id}"
        segments = []
        for annotation in entry.get("annotations", []):
            try:
                start, end = (float(v) for v in annotation["segment"])
                segments.append({"start_sec": start, "end_sec": end, "label": str(annotation["label"])})
            except (KeyError, TypeError, ValueError):
                result.problem("unparsed lines", f"{where}: annotation {annotation!r}")
        if not segments:
            result.problem("videos without segments", where)
            continue
        candidates = [
            os.path.join(videos, prefix + video_id + ext) for prefix in ("", "v_") for ext in VIDEO_EXTENSIONS
        ]
        path = next((c for c in candidates if os.path.isfile(c)), None)
        if path is None:
            result.problem(
                "missing video files",
                f"{where}: {os.path.join(videos, video_id)}.mp4 (or v_{video_id}, .mkv, .webm, ...)",
            )
            continue
        result.lines.append(
            {"video": os.path.normpath(path), "segments": sorted(segments, key=lambda s: s["start_sec"])}
        )
    return result


# ------------------------------------------------------------------------------------------------ MMAction2


def _mmaction(src: str, videos: str, split: int, subset: str | None, classes: str | None) -> Imported:
    """ "path label" or "path num_frames label" a line (MMAction2's video and rawframe lists); labels are class
    indices, named by --classes (one name a line) or kept as numbers."""
    names = [line for _, line in _text_lines(classes)] if classes else None
    result = Imported()
    for number, line in _text_lines(src):
        result.source_lines += 1
        where = f"{src}:{number}"
        parts = line.split()
        if len(parts) not in (2, 3) or not parts[-1].isdigit():
            result.problem("unparsed lines", f"{where}: {line!r} (expected 'path label' or 'path num_frames label')")
            continue
        index = int(parts[-1])
        if names is not None and index >= len(names):
            result.problem("unknown labels", f"{where}: {index} (the class list has {len(names)})")
            continue
        if os.path.isdir(os.path.join(videos, parts[0])):
            result.problem("frame folders (extract-free videos only)", f"{where}: {parts[0]}")
            continue
        path = _video(videos, parts[0], result, where)
        if path:
            result.lines.append({"video": path, "label": names[index] if names is not None else str(index)})
    return result


IMPORTERS = {
    "ucf101": _ucf101,
    "hmdb51": _hmdb51,
    "kinetics": _kinetics,
    "activitynet": _untrimmed,
    "thumos": _untrimmed,
    "mmaction": _mmaction,
}


def convert(
    fmt: str, src: str, videos: str | None = None, split: int = 1, subset: str | None = None, classes: str | None = None
) -> Imported:
    """The manifest lines of ``src`` (video paths absolute) and what could not be mapped."""
    if fmt not in IMPORTERS:
        raise ConvertError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt in ("ucf101", "hmdb51") and subset not in ("train", "test"):
        raise ConvertError(f"{fmt}: --subset must be train or test, got {subset!r}")
    if videos is None:  # the folder beside the annotations
        videos = os.path.dirname(os.path.abspath(src.rstrip("/")))
    if not os.path.isdir(videos):
        raise ConvertError(f"{videos}: the videos folder (--videos) does not exist")
    return IMPORTERS[fmt](src, os.path.abspath(videos), split, subset, classes)


def write_manifest(result: Imported, out: str) -> None:
    """JSONL, video paths relative to the manifest's folder, written atomically."""
    base = os.path.dirname(os.path.abspath(out))
    with atomic_open(out) as f:
        for line in result.lines:
            f.write((json.dumps({**line, "video": os.path.relpath(line["video"], base)}) + "\n").encode())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m datasets.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("format", choices=FORMATS)
    parser.add_argument("src", help="the annotation file (or split folder for ucf101 / hmdb51)")
    parser.add_argument("--out", required=True, help="the manifest to write (JSONL)")
    parser.add_argument("--videos", help="the folder the video paths are relative to (default: the one holding src)")
    parser.add_argument("--split", type=int, default=1, choices=(1, 2, 3), help="ucf101 / hmdb51 split number")
    parser.add_argument(
        "--subset",
        help="train | test (ucf101, hmdb51); the split column's value (kinetics: train, "
        "val, test); the subset (activitynet / thumos: training, validation, ...)",
    )
    parser.add_argument("--classes", help="mmaction: class names, one a line, in label-index order")
    parser.add_argument(
        "--skip-missing",
        action="store_true",
        help="write the lines that map even if some do not (the summary still lists them)",
    )
    args = parser.parse_args(argv)
    try:
        result = convert(args.format, args.src, args.videos, args.split, args.subset, args.classes)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result.problems and not args.skip_missing:
        print(
            f"error: {result.summary()}; nothing written (fix them, or --skip-missing to write the "
            f"{len(result.lines)} that map)",
            file=sys.stderr,
        )
        return 2
    if not result.lines:
        print(f"error: {args.src}: no entries to write (check --subset / --split)", file=sys.stderr)
        return 2
    write_manifest(result, args.out)
    labels = {item["label"] for line in result.lines for item in line.get("segments", [line])}
    print(f"{args.out}: {len(result.lines)} videos, {len(labels)} classes")
    if result.problems:
        print(f"warning: {result.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    exit_on_usage_error(main, disk_advice="free space there and run it again")
