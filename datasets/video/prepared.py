"""Prepared copies (``data.prepared_dir``): each source video re-encoded once at the size a preset decodes it to.

A random read from a camera's file decodes from the keyframe before it (100-300 frames back with the GOPs that
cameras, phones and screen recorders write), every frame at the source's full size, to keep a few frames resized to
a few percent of their pixels. A prepared copy holds every frame of the source, in order, already turned as
displayed and resized as the reader resizes it (``FrameReader._store``), with a keyframe every ``gop`` frames and no
B-frames: the same read decodes at most ``gop`` small frames. Frame i of the copy is frame i of the source (a
file cut short keeps the frames that decode), so labels, windows and indices stay those of the source.

A copy is found by what decides its content, never by its name alone: its source's identity (absolute path,
size, modification time, and a hash of the file's first and last 64 KiB) and the preparation (``Preparation``:
size, GOP, quality). Each copy is ``<stem>-<key>.mp4`` beside ``<stem>-<key>.json`` (the record of both, written
last, atomically: a copy without its record, or with a record of another source or preparation, is not used).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np

from core.files import atomic_path, atomic_write_bytes
from datasets.video.frame_reader import FrameReader
from datasets.video.info import VideoInfo

PREPARED_FORMAT = 1  # the record's layout: a record of another format is prepared again
SAMPLED_BYTES = 64 * 1024  # hashed at each end of a source: an edited file of unchanged size and time is caught
WINDOW = 64  # frames read from the source at a time while preparing
# x264's options besides the preparation's: in each copy's record, so a copy made with others is made again
ENCODER = {
    "pix_fmt": "yuv444p",
    "bf": "0",  # presentation order is decode order: a seek lands on the frame asked for
    "sc_threshold": "0",  # keyframes exactly every gop frames, where the reader expects them
    "preset": "veryfast",
    # no CABAC, no deblocking: random reads decode faster, for slightly larger files
    "tune": "fastdecode",
}


@dataclass(frozen=True)
class Preparation:
    """What decides a copy's pixels: the decode size (``height`` x ``width``, as read), the ``orientation``
    applied to the stored frames (none where the file has none), a keyframe every
    ``gop`` frames, and x264's constant quality ``crf`` (0: lossless) in full-resolution chroma (yuv444p, which
    also takes the odd sizes decode sizes can have)."""

    height: int
    width: int
    orientation: str
    gop: int
    crf: int


def source_identity(path: str) -> dict:
    """What says a source is the file a copy was made from: absolute path, size, modification time, and the
    sha256 of its first and last SAMPLED_BYTES."""
    stat = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(SAMPLED_BYTES))
        if stat.st_size > SAMPLED_BYTES:
            f.seek(max(SAMPLED_BYTES, stat.st_size - SAMPLED_BYTES))
            digest.update(f.read(SAMPLED_BYTES))
    return {
        "path": os.path.abspath(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256_ends": digest.hexdigest(),
    }


def copy_stem(folder: str, source: str, preparation: Preparation) -> str:
    """``folder/<stem>-<key>``: the key is of the source's absolute path and the preparation, so two sources of
    one name, or two sizes of one source, are two copies."""
    key = json.dumps([os.path.abspath(source), asdict(preparation)], sort_keys=True)
    stem = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(folder, f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


@dataclass(frozen=True)
class PreparedCopy:
    """A copy whose record matches its source and preparation: where it is, and its VideoInfo (what a probe of
    it would say, from the record, so finding a copy costs no probe)."""

    path: str
    info: VideoInfo
    record: dict


def find_copy(
    folder: str, source: str, preparation: Preparation, encoder: dict = ENCODER
) -> tuple[PreparedCopy | None, str]:
    """The copy of ``source`` made with ``preparation`` (and ``encoder``'s options) in ``folder``, or None and why
    there is none (no copy yet, a changed source, a record of an older format)."""
    stem = copy_stem(folder, source, preparation)
    try:
        with open(stem + ".json") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None, "not prepared yet"
    except (OSError, ValueError):
        return None, f"{stem}.json is unreadable"
    if record.get("format") != PREPARED_FORMAT:
        return None, f"{stem}.json is of format {record.get('format')}, this version writes {PREPARED_FORMAT}"
    if record.get("preparation") != asdict(preparation) or record.get("encoder") != encoder:
        return None, f"{stem}.json was made with other settings"
    try:
        identity = source_identity(source)
    except OSError as e:
        return None, f"the source cannot be read ({e.strerror})"
    if record.get("source") != identity:
        return None, "the source changed since it was prepared"
    if not os.path.exists(stem + ".mp4"):
        return None, f"{stem}.mp4 is missing"
    frames = int(record["frames"])
    info = VideoInfo(
        stem + ".mp4",
        frames,
        float(record["fps"]),
        preparation.width,
        preparation.height,
        "h264",
        True,
        [[preparation.width, preparation.height, frames]],
        header_frames=frames,
    )
    return PreparedCopy(stem + ".mp4", info, record), ""


def prepare_copy(
    reader: FrameReader, folder: str, preparation: Preparation, frame_times=None, encoder: dict = ENCODER
) -> PreparedCopy:
    """Write the copy of ``reader``'s video (opened at the preparation's size, as displayed) into ``folder``:
    every frame the source decodes, read in order through the reader (its pixels are what training reads from the
    source), encoded with a keyframe every ``gop`` frames at a constant rate, frame i at timestamp i. The copy and
    then its record are written atomically; ``frame_times`` (the source's presentation times in seconds, if
    known) go into the record, cut to the frames kept. ``encoder``: x264's other options (another set than
    ENCODER only to compare them: python -m bench.loader --part prepared)."""
    import av  # the encoder: PyAV (OpenCV's wheel cannot encode H.264)

    source = reader.path
    identity = source_identity(source)
    stem = copy_stem(folder, source, preparation)
    os.makedirs(folder, exist_ok=True)
    written = 0
    with atomic_path(stem + ".mp4") as tmp, av.open(tmp, "w") as container:
        rate = Fraction(reader.info.fps).limit_denominator(1001)  # 29.97 as 30000/1001, 25 as 25
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = preparation.width, preparation.height, encoder["pix_fmt"]
        stream.options = {k: v for k, v in encoder.items() if k != "pix_fmt"} | {
            "g": str(preparation.gop),
            "keyint_min": str(preparation.gop),
            "crf": str(preparation.crf),
        }
        start = 0
        while start < reader.num_frames:
            end = min(start + WINDOW, reader.num_frames)
            frames = reader.read(range(start, end))  # past a damaged end: the last frame, and num_frames lowered
            frames = frames[: max(0, min(end, reader.num_frames) - start)]
            for frame in frames:
                picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                picture.pts, picture.time_base = written, 1 / rate
                for packet in stream.encode(picture):
                    container.mux(packet)
                written += 1
            start = end
        for packet in stream.encode():
            container.mux(packet)
    record = {
        "format": PREPARED_FORMAT,
        "source": identity,
        "preparation": asdict(preparation),
        "encoder": encoder,
        "frames": written,
        "fps": float(rate),  # the copy's own rate: the readers' seeks and checks go by it
        "source_frames": reader.info.num_frames,
        "bytes": os.path.getsize(stem + ".mp4"),
    }
    if frame_times is not None:
        record["frame_times"] = [round(float(t), 6) for t in frame_times[:written]]
    atomic_write_bytes(stem + ".json", json.dumps(record).encode())
    found, why = find_copy(folder, source, preparation, encoder)
    if found is None:  # the source changed while it was read
        raise RuntimeError(f"{source}: its copy is not usable after preparing it: {why}")
    return found
