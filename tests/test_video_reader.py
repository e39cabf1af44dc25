import dataclasses
import logging
import os
import shutil

import cv2
import numpy as np
import pytest
from conftest import HEIGHT, WIDTH, barcode_frame, decode_sequentially, read_barcode, write_with_opencv, write_with_pyav

from datasets.video import capture, index_cache, pyav_reader
from datasets.video.choice import DECODERS, open_reader
from datasets.video.index_cache import VideoIndexCache
from datasets.video.info import VideoReadError
from datasets.video.opencv_reader import OpenCVReader
from datasets.video.probe import probe
from datasets.video.pyav_reader import PyAVReader

CONTAINERS = ["h264_bframes_mp4", "mpeg4_avi", "h264_mkv", "vp9_webm"]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", CONTAINERS)
def test_frames_are_exact_after_seeks_grabs_and_backward_jumps(barcode_videos, name, decoder):
    path, n = barcode_videos[name]
    reader = open_reader(path, decoder=decoder)
    assert reader.num_frames == n
    # far seeks (across GOPs), short gaps read through with grab(), backward jumps, repeats and disorder
    requests = [
        [0, 1, 2],
        [300, 301, 310],
        [5, 7, 9],
        [399],
        [120, 240, 360, 250],
        list(range(200, 232, 2)),
        [17, 17, 3],
    ]
    rng = np.random.default_rng(0)
    requests += [sorted(rng.choice(n, size=8, replace=False)) for _ in range(6)]
    for indices in requests:
        frames = reader.read(indices)
        assert frames.shape == (len(indices), HEIGHT, WIDTH, 3)
        assert [read_barcode(f) for f in frames] == list(indices), f"{name}: asked {indices}"
    assert reader.stats["seeks"] > 0 and reader.stats["grabbed"] > 0
    assert reader.seeks_exactly
    assert path not in pyav_reader._PYAV_UNRELIABLE  # with pyav: PyAV read them all, no fallback to OpenCV


@pytest.mark.parametrize("name", CONTAINERS)
def test_both_decoders_give_the_same_pixels(barcode_videos, name):
    path, _ = barcode_videos[name]
    indices = [0, 397, 123, 124, 250, 12]
    for size in (None, (24, 60)):
        np.testing.assert_array_equal(OpenCVReader(path, size).read(indices), PyAVReader(path, size).read(indices))


def test_pyav_does_not_decode_the_non_reference_frames_before_a_clip(barcode_videos):
    path, _ = barcode_videos["h264_bframes_mp4"]  # GOP 250, 3 B-frames: frame 240 is 240 frames past a keyframe
    skipping = PyAVReader(path, threads=1)
    assert read_barcode(skipping.read([240])[0]) == 240
    decoding_all = PyAVReader(path, threads=1)
    decoding_all.skip_unneeded_frames = False
    assert read_barcode(decoding_all.read([240])[0]) == 240
    assert decoding_all.stats["grabbed"] == 240  # every frame from the keyframe on
    assert skipping.stats["grabbed"] <= 0.75 * 240, skipping.stats  # the B-frames nothing refers to: not decoded


def test_pyav_falls_back_to_opencv_when_timestamps_do_not_number_frames(barcode_videos, monkeypatch, caplog, tmp_path):
    path = str(shutil.copy(barcode_videos["h264_mkv"][0], tmp_path / "jump.mkv"))
    real_number = PyAVReader._frame_number
    monkeypatch.setattr(
        PyAVReader,
        "_frame_number",  # timestamps that jump over frame 150
        lambda self, pts: real_number(self, pts) + (real_number(self, pts) >= 150),
    )
    reader = PyAVReader(path)
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        frames = reader.read(range(140, 160))
        frames_again = reader.read([300, 20])
    assert [read_barcode(f) for f in frames] == list(range(140, 160))
    assert [read_barcode(f) for f in frames_again] == [300, 20]
    warnings = [r.getMessage() for r in caplog.records if "reading this file with OpenCV" in r.getMessage()]
    assert warnings == [
        f"{path}: frame timestamps jump from frame 149 to 151; reading this file with OpenCV from "
        f"now on (exact, slower seeks)"
    ]


def write_with_dropped_frames(path: str, num_frames: int, dropped_at: int) -> str:
    """H.264 whose timestamps skip 5 frame durations at ``dropped_at`` (a camera that dropped frames)."""
    from fractions import Fraction

    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 25)
        stream.options = {"g": "100"}
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(barcode_frame(i), format="rgb24")
            frame.pts, frame.time_base = (i if i < dropped_at else i + 5), Fraction(1, 25)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_file_with_dropped_frames_is_read_sequentially_and_exactly(tmp_path, caplog, decoder):
    path = write_with_dropped_frames(str(tmp_path / f"dropped_{decoder}.mp4"), 400, dropped_at=200)
    assert not probe(path).regular_timestamps
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        reader = open_reader(path, decoder=decoder)
        # before the fix, a seek to 150 returned frame 152 with timestamps that looked right
        assert [read_barcode(f) for f in reader.read([150, 300, 399, 10])] == [150, 300, 399, 10]
    assert sum("timestamps skip frames" in r.getMessage() and path in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("name", CONTAINERS)
def test_regular_files_have_regular_timestamps(barcode_videos, name, tmp_path):
    assert probe(barcode_videos[name][0]).regular_timestamps
    # 30 fps in Matroska: timestamps in whole milliseconds step by 33 and 34 ms, still one frame each
    assert probe(write_with_pyav(str(tmp_path / "30fps.mkv"), 60, "libx264", fps=30)).regular_timestamps


def test_a_frame_equals_the_same_frame_of_a_sequential_decode(barcode_videos):
    path, _ = barcode_videos["h264_bframes_mp4"]
    cap = cv2.VideoCapture(path)
    sequential = [cap.read()[1] for _ in range(260)]
    cap.release()
    frames = OpenCVReader(path).read([259, 3, 251])
    for index, frame in zip([259, 3, 251], frames):
        np.testing.assert_array_equal(frame, cv2.cvtColor(sequential[index], cv2.COLOR_BGR2RGB))


def test_resize_happens_per_frame_to_the_configured_size(barcode_videos):
    path, _ = barcode_videos["mpeg4_avi"]
    frames = OpenCVReader(path, size=(24, 60)).read([10, 11])
    assert frames.shape == (2, 24, 60, 3) and frames.dtype == np.uint8


def test_metadata_without_decoding_the_file(barcode_videos):
    path, n = barcode_videos["h264_bframes_mp4"]
    info = probe(path)
    assert (info.num_frames, info.fps, info.width, info.height, info.codec) == (n, 25.0, WIDTH, HEIGHT, "h264")


class LyingCapture:
    """A cv2.VideoCapture whose seek lands 3 frames early and reports where it really is (opencv#9053)."""

    def __init__(self, path, *args):
        self.cap = cv2.VideoCapture(path)

    def set(self, prop, value):
        if prop == cv2.CAP_PROP_POS_FRAMES:
            value = max(0, value - 3)
        return self.cap.set(prop, value)

    def __getattr__(self, name):
        return getattr(self.cap, name)


def test_an_inexact_seek_is_detected_once_and_reading_falls_back_to_sequential(
    barcode_videos, monkeypatch, caplog, tmp_path
):
    path = shutil.copy(barcode_videos["h264_bframes_mp4"][0], tmp_path / "lying.mp4")
    monkeypatch.setattr(capture, "open_capture", lambda p, threads: LyingCapture(p))
    reader = OpenCVReader(str(path))
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        frames = reader.read([300, 301, 50, 390])
    assert [read_barcode(f) for f in frames] == [300, 301, 50, 390]
    assert not reader.seeks_exactly
    warnings = [r for r in caplog.records if "not frame-exact" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert [read_barcode(f) for f in OpenCVReader(str(path)).read([280, 10])] == [280, 10]  # remembered per file


def test_timestamps_offset_but_frames_right_is_accepted(barcode_videos, monkeypatch):
    path, _ = barcode_videos["mpeg4_avi"]
    real_open = capture.open_capture

    class Shifted:
        def __init__(self, cap):
            self.cap = cap

        def get(self, prop):
            value = self.cap.get(prop)
            return value + 1000.0 if prop == cv2.CAP_PROP_POS_MSEC else value

        def __getattr__(self, name):
            return getattr(self.cap, name)

    monkeypatch.setattr(capture, "open_capture", lambda p, threads: Shifted(real_open(p, threads)))
    reader = OpenCVReader(path)
    assert [read_barcode(f) for f in reader.read([200, 100, 300])] == [200, 100, 300]
    assert reader.seeks_exactly and reader.stats["seek_checks"] == 1  # one pixel check, then the offset is known


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_cut_file_is_indexed_at_its_whole_frames_and_reads_past_the_end_get_the_last(tmp_path, caplog, decoder):
    # an AVI's header says 200 frames; cutting the file keeps the header but drops the last frames' data, and
    # leaves the frame at the cut half there (a partial packet, which each decoder would conceal its own way)
    path = write_with_opencv(str(tmp_path / "cut.avi"), 200, "MJPG")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    info = probe(path)
    sequential = decode_sequentially(path)  # OpenCV decodes the half frame too
    assert info.header_frames == 200 and info.num_frames == len(sequential) - 1
    assert info.header_note() == (
        f"{path}: the header says 200 frames but the file holds {info.num_frames} (cut "
        f"short, or a wrong duration in its header); using {info.num_frames}"
    )
    reader = open_reader(path, decoder=decoder)
    frames = reader.read([10, 150, 199, info.num_frames - 1])
    assert [read_barcode(f) for f in frames] == [10] + [info.num_frames - 1] * 3
    np.testing.assert_array_equal(frames[1], sequential[info.num_frames - 1])


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_reader_told_a_longer_length_learns_the_real_end(tmp_path, caplog, decoder):
    """An index that over-states the length (a file cut after it was indexed): decoding finds the end, warns once,
    and serves the last frame it decodes for the frames past it."""
    path = write_with_pyav(str(tmp_path / "cut.mkv"), 200, "libx264", gop=50)
    whole = probe(path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * 0.6)])
    reader = open_reader(path, decoder=decoder, info=whole)
    assert reader.num_frames == 200
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        frames = reader.read([10, 150, 199])
    sequential = decode_sequentially(path)
    assert reader.num_frames == len(sequential) and 10 < len(sequential) < 200
    assert [read_barcode(f) for f in frames] == [10, len(sequential) - 1, len(sequential) - 1]
    np.testing.assert_array_equal(frames[2], sequential[-1])
    assert any(path in r.getMessage() and "decoding ends at frame" in r.getMessage() for r in caplog.records)


@pytest.fixture
def av1_file(tmp_path) -> str:
    """60 barcoded frames of AV1 in MKV: a codec OpenCV's pip wheel cannot decode and PyAV can."""
    try:
        path = write_with_pyav(str(tmp_path / "av1.mkv"), 60, "libsvtav1")
    except Exception as e:  # pragma: no cover - depends on the PyAV build
        pytest.skip(f"cannot write AV1 here: {e}")
    if cv2.VideoCapture(path).read()[0]:
        pytest.skip("this OpenCV build decodes AV1")
    return path


def test_an_undecodable_codec_is_a_clear_error(av1_file):
    path = av1_file
    with pytest.raises(VideoReadError) as info:
        probe(path)
    assert str(info.value) == (
        f"{path}: OpenCV opens this file but cannot decode its 'AV01' video (its FFmpeg "
        f"build lacks a decoder); re-encode it, e.g. ffmpeg -i in.mkv -c:v libx264 "
        f"-pix_fmt yuv420p out.mp4, or set data.decoder: pyav if PyAV decodes it"
    )


def test_the_pyav_decoder_reads_a_codec_only_pyav_decodes(av1_file, tmp_path):
    """data.decoder: pyav used to refuse AV1 with OpenCV's error although PyAV decodes it."""
    path = av1_file
    info = probe(path, "pyav")
    assert (info.num_frames, info.opencv_decodes, info.codec) == (60, False, "AV01")
    reader = open_reader(path, decoder="pyav")
    assert [read_barcode(f) for f in reader.read([0, 7, 33, 59, 12])] == [0, 7, 33, 59, 12]
    cache = VideoIndexCache(str(tmp_path / "index.json"))
    assert cache.info(path, "pyav").opencv_decodes is False
    with pytest.raises(VideoReadError, match="OpenCV opens this file but cannot decode"):
        cache.info(path, "opencv")  # the cached entry is not taken for the decoder that cannot read it


@pytest.mark.parametrize("codec", ["libx264", "libx265"])
def test_both_decoders_give_the_same_pixels_on_10_bit_video(tmp_path, codec):
    """They differed by up to 23 (mean 0.9) on 10-bit H.264: PyAV converted straight to RGB, bilinearly."""
    import av

    path = str(tmp_path / "ten.mp4")
    with av.open(path, "w") as container:
        stream = container.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = 160, 96, "yuv420p10le"
        if codec == "libx265":
            stream.options = {"x265-params": "log-level=none"}
        for i in range(30):
            image = np.zeros((96, 160, 3), np.uint8)
            image[..., 0] = np.arange(160)[None, :]
            image[..., 1] = np.arange(96)[:, None] * 2
            image[30:60, i * 4 : i * 4 + 30] = [250, 20, 180]  # sharp colour edges: where chroma filters differ
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    for size in (None, (64, 80)):
        np.testing.assert_array_equal(
            OpenCVReader(path, size).read([0, 13, 29]), PyAVReader(path, size).read([0, 13, 29])
        )


SHARED_CLIP = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "nasa_13013.mp4"
)


@pytest.mark.skipif(not os.path.exists(SHARED_CLIP), reason="../shared/data/nasa_13013.mp4 is not there")
@pytest.mark.parametrize("decoder", DECODERS)
def test_a_file_with_two_video_streams_is_read_from_its_first_by_both_decoders(decoder, caplog):
    """nasa_13013.mp4 holds a 320x180 and a 480x270 video stream: both decoders read the first, and say so."""
    info = probe(SHARED_CLIP)
    assert info.video_streams == [[320, 180, 325], [480, 270, 390]]
    frames = open_reader(SHARED_CLIP, decoder=decoder).read([0, 100, 324])
    assert frames.shape == (3, 180, 320, 3)
    sequential = decode_sequentially(SHARED_CLIP)
    assert len(sequential) == 325
    for got, index in zip(frames, [0, 100, 324]):
        np.testing.assert_array_equal(got, sequential[index])
    from datasets.manifest import VideoRecord
    from datasets.video_dataset import VideoWindowDataset

    with caplog.at_level(logging.WARNING, logger="longvideo"):
        VideoWindowDataset(
            [VideoRecord({"video": SHARED_CLIP}, label="a", where="m.jsonl:1")],
            ["a"],
            dataclasses.replace(data_cfg_for_streams(), decoder=decoder),
            training=False,
        )
    [note] = [r.getMessage() for r in caplog.records if "video streams" in r.getMessage()]
    assert note == (
        f"{SHARED_CLIP}: 2 video streams (#0 320x180 (325 frames), #1 480x270 (390 frames)); both "
        f"decoders read #0, the first (OpenCV's FFmpeg backend reads no other); FFmpeg's tools would "
        f"pick #1, the largest: extract it with ffmpeg -i in.mp4 -map 0:v:1 -c copy out.mp4"
    )


def data_cfg_for_streams() -> dict:
    from config import load_config

    return load_config(None, ["data.img_size=64", "data.num_frames=8"]).data


def test_missing_empty_and_non_video_files(tmp_path):
    with pytest.raises(
        VideoReadError,
        match=r"missing\.mp4: file not found; check the path in the manifest "
        r"\(relative paths are resolved against the manifest's folder\)$",
    ):
        probe(str(tmp_path / "missing.mp4"))
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(VideoReadError, match=r"empty\.mp4: empty file \(0 bytes\)$"):
        probe(str(tmp_path / "empty.mp4"))
    (tmp_path / "notes.mp4").write_text("this is not a video\n" * 50)
    with pytest.raises(
        VideoReadError,
        match=r"notes\.mp4: OpenCV cannot open this file as a video .*; check it "
        r"with ffprobe, re-encode it, e.g. ffmpeg .*, or remove it from the "
        r"manifest$",
    ):
        probe(str(tmp_path / "notes.mp4"))


def test_index_cache_is_reused_and_invalidated_by_changes(barcode_videos, tmp_path, monkeypatch):
    path = shutil.copy(barcode_videos["mpeg4_avi"][0], tmp_path / "v.avi")
    cache_file = str(tmp_path / "index.json")
    cache = VideoIndexCache(cache_file)
    first = cache.info(str(path))
    cache.save()
    calls = []
    monkeypatch.setattr(index_cache.probing, "probe", lambda p, decoder="opencv": calls.append(p) or first)
    assert VideoIndexCache(cache_file).info(str(path)) == first and calls == []  # from the file, no probe
    os.utime(path, ns=(1, 1))
    VideoIndexCache(cache_file).info(str(path))
    assert calls == [str(path)]  # mtime changed: probed again


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_file_removed_after_indexing_is_a_clear_error(barcode_videos, tmp_path, decoder):
    path = str(shutil.copy(barcode_videos["h264_mkv"][0], tmp_path / "moved.mkv"))
    reader = open_reader(path, decoder=decoder)  # indexed while the file was there
    os.remove(path)
    name = {"opencv": "OpenCV", "pyav": "PyAV"}[decoder]
    with pytest.raises(VideoReadError) as info:
        reader.read([5])
    assert str(info.value).startswith(f"{path}: {name} can no longer open this file (moved or truncated?)")


@pytest.mark.parametrize(
    "codec, ext, random_choice",
    [("h264", "mp4", "pyav"), ("hevc", "mp4", "pyav"), ("vp9", "webm", "pyav"), ("mpeg4", "avi", "pyav")],
)
def test_auto_picks_the_measured_decoder_for_each_access_pattern(tmp_path, codec, ext, random_choice):
    """data.decoder: auto (the default): PyAV for random clips where bench/loader.py measured it faster, OpenCV
    for every sequential pass; the frames are the same either way."""
    from config import load_config
    from datasets.video.choice import choose_decoder
    from datasets.video.pyav_reader import PyAVReader
    from datasets.video_files import write_h264

    assert load_config(None, []).data.decoder == "auto"
    path = write_h264(str(tmp_path / f"v.{ext}"), 40, 160, 96, codec=codec)
    info = probe(path, "auto")
    assert choose_decoder("auto", info, "random") == random_choice
    assert choose_decoder("auto", info, "sequential") == "opencv"
    assert choose_decoder("opencv", info, "random") == "opencv"  # a forced decoder stays
    random_reader = open_reader(path, decoder="auto", access="random")
    sequential_reader = open_reader(path, decoder="auto", access="sequential")
    assert isinstance(random_reader, PyAVReader) == (random_choice == "pyav")
    assert not isinstance(sequential_reader, PyAVReader)
    indices = [30, 3, 17, 17, 39]
    np.testing.assert_array_equal(random_reader.read(indices), sequential_reader.read(indices))
    np.testing.assert_array_equal(random_reader.read(indices), open_reader(path, decoder="opencv").read(indices))


def test_auto_reads_a_codec_only_pyav_decodes_with_pyav():
    from datasets.video.choice import choose_decoder
    from datasets.video.info import VideoInfo

    only_pyav = VideoInfo("a.mkv", 10, 25.0, 64, 64, "av01", opencv_decodes=False)
    assert choose_decoder("auto", only_pyav, "sequential") == "pyav" == choose_decoder("auto", only_pyav, "random")


def test_pyav_reads_an_avi_with_b_frames_exactly_by_seeking_earlier(tmp_path):
    """AVI indexes packets by decode time: with B-frames a keyframe carries the decode time of the frames shown
    before it, so a seek to frame i can land on the keyframe after i. The reader seeks again from earlier (it
    used to give the file up to OpenCV, whose seek goes a whole 12-frame GOP back before every clip)."""
    from datasets.video_files import write_h264

    path = write_h264(str(tmp_path / "b_frames.avi"), 120, 160, 96, codec="mpeg4")  # GOP 12, 2 B-frames
    sequential = decode_sequentially(path)
    reader = open_reader(path, decoder="pyav")
    order = np.random.default_rng(0).permutation(120)
    for start in range(0, 120, 8):
        indices = sorted(order[start : start + 8])
        for got, index in zip(reader.read(indices), indices):
            np.testing.assert_array_equal(got, sequential[index])
    assert path not in pyav_reader._PYAV_UNRELIABLE  # read by PyAV throughout, no fall-back


def test_pyav_tries_every_seek_margin_before_giving_a_file_up(barcode_videos, monkeypatch):
    """A read whose seeks keep landing after the frame is retried from each of SEEK_MARGINS earlier, the last
    included, before the file goes to OpenCV."""
    path = barcode_videos["h264_bframes_mp4"][0]
    reader = open_reader(path, decoder="pyav")
    margins, real_until = [], PyAVReader._decode_until
    real_seek = PyAVReader._seek

    def seek(self, index, margin=0):
        margins.append(margin)
        return real_seek(self, index, margin)

    def until(self, index, dst):  # lands "after" the frame until seeked from the last margin
        return real_until(self, index, dst) if margins[-1] == pyav_reader.SEEK_MARGINS[-1] else None

    monkeypatch.setattr(PyAVReader, "_seek", seek)
    monkeypatch.setattr(PyAVReader, "_decode_until", until)
    frame = reader.read([200])
    assert margins == [0, *pyav_reader.SEEK_MARGINS] and read_barcode(frame[0]) == 200
    assert path not in pyav_reader._PYAV_UNRELIABLE
