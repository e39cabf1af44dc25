"""Files as phones, cameras and interrupted copies make them: a display rotation or mirror, a file cut short, a header
whose duration lies. Every decoder, the dataset (training and evaluation geometry) and the streaming reader must see
the frames a viewer sees, or say clearly that they cannot."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys

import av
import numpy as np
import pytest
from conftest import decode_sequentially, read_barcode, write_with_pyav

from config import load_config
from datasets.chunk_stream import ChunkStream
from datasets.manifest import VideoRecord, read_manifest
from datasets.video.choice import DECODERS, open_reader
from datasets.video.info import VideoReadError
from datasets.video.probe import probe
from datasets.video_dataset import VideoWindowDataset
from engine.inference.stream import InferenceSpec

STORED_H, STORED_W = 64, 96
# the stored frame's quadrants: white, red / black, grey; any of the eight orientations moves them differently
LAYOUT = np.array([["white", "red"], ["black", "grey"]])
COLOURS = {"white": (255, 255, 255), "red": (255, 0, 0), "black": (0, 0, 0), "grey": (128, 128, 128)}
MIRROR = [-65536, 0, 0, 0, 65536, 0, 0, 0, 1 << 30]  # FFmpeg's display matrix of a left-right mirror


def marked_frame(index: int) -> np.ndarray:
    frame = np.zeros((STORED_H, STORED_W, 3), np.uint8)
    h, w = STORED_H // 2, STORED_W // 2
    for (row, col), name in np.ndenumerate(LAYOUT):
        frame[row * h : (row + 1) * h, col * w : (col + 1) * w] = COLOURS[name]
    frame[h - 4 : h + 4, : 12 + 6 * (index % 8)] = 200  # a bar whose length changes frame to frame
    return frame


def write_turned(path: str, case: str) -> str:
    """H.264 in MP4 with a display rotation (counter-clockwise degrees) or a mirror, as a phone writes it: the
    frames stored landscape."""
    turn = {"display_matrix": MIRROR} if case == "mirror" else {"display_rotation": int(case)}
    return write_with_pyav(path, 24, "libx264", frame=marked_frame, **turn)


def displayed(stored: np.ndarray, case: str) -> np.ndarray:
    """What a viewer sees of a stored array: PyAV's rotation is counter-clockwise, as np.rot90's k."""
    return np.fliplr(stored) if case == "mirror" else np.rot90(stored, k=int(case) // 90)


def quadrants(frame: np.ndarray) -> np.ndarray:
    """The colour name of each quadrant of an RGB frame (its centre pixels, away from the bar and the edges)."""
    h, w = frame.shape[0] // 2, frame.shape[1] // 2
    names = np.empty((2, 2), object)
    for row in range(2):
        for col in range(2):
            block = frame[row * h + h // 4 : (row + 1) * h - h // 4, col * w + w // 4 : (col + 1) * w - w // 4]
            mean = block.reshape(-1, 3).mean(0)
            names[row, col] = min(COLOURS, key=lambda n: np.abs(mean - COLOURS[n]).sum())
    return names


CASES = ["90", "180", "270", "mirror"]


@pytest.fixture(scope="module")
def turned(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("turned")
    return {case: write_turned(str(folder / f"phone_{case}.mp4"), case) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_the_probe_reports_the_displayed_size(turned, case):
    info = probe(turned[case])
    upright = displayed(np.zeros((STORED_H, STORED_W)), case).shape
    assert (info.height, info.width) == upright
    assert info.frame_size(autorotate=False) == (STORED_H, STORED_W)
    assert (probe(turned[case], "pyav").height, probe(turned[case], "pyav").width) == upright


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("case", CASES)
def test_every_decoder_gives_the_frames_upright(turned, case, decoder):
    path = turned[case]
    indices = [3, 0, 17, 9]
    frames = open_reader(path, decoder=decoder).read(indices)
    stored = open_reader(path, decoder=decoder, autorotate=False).read(indices)
    assert stored.shape[1:3] == (STORED_H, STORED_W)
    assert [quadrants(f).tolist() for f in stored] == [LAYOUT.tolist()] * len(indices)
    for frame, as_stored in zip(frames, stored):
        np.testing.assert_array_equal(frame, displayed(as_stored, case))
        assert quadrants(frame).tolist() == displayed(LAYOUT, case).tolist()
    if case != "mirror":  # OpenCV's own rotation (it turns a mirror by 180 degrees): the same pixels
        reference = decode_sequentially(path)
        for index, frame in zip(indices, frames):
            np.testing.assert_array_equal(frame, reference[index])
    # resized on the way: the same size for both decoders, the same pixels
    small = open_reader(path, (frames.shape[1] // 2, frames.shape[2] // 2), decoder=decoder).read(indices)
    np.testing.assert_array_equal(small, open_reader(path, small.shape[1:3], decoder="opencv").read(indices))


def dataset_of(path: str, tmp_path, decoder: str, training: bool, **data) -> VideoWindowDataset:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"video": path, "label": "a"}) + "\n")
    cfg = load_config(
        None, ["data.num_workers=0", f"data.decoder={decoder}"] + [f"data.{k}={json.dumps(v)}" for k, v in data.items()]
    )
    return VideoWindowDataset(read_manifest(str(manifest)), ["a"], cfg.data, training=training)


@pytest.mark.parametrize("case", CASES)
def test_training_evaluation_and_streaming_see_the_same_upright_pixels_whatever_the_decoder(turned, case, tmp_path):
    path = turned[case]
    upright = displayed(np.zeros((STORED_H, STORED_W)), case).shape
    size = [upright[0] // 2, upright[1] // 2]  # the displayed aspect: nothing cropped away
    evaluation, training, streamed = {}, {}, {}
    for decoder in ("opencv", "pyav", "auto"):
        evaluation[decoder] = dataset_of(path, tmp_path, decoder, False, num_frames=-1, img_size=size)[0]["video"]
        augmented = dataset_of(
            path,
            tmp_path,
            decoder,
            True,
            num_frames=8,
            img_size=size,
            augment=True,
            color_jitter=0.2,
        )
        augmented.set_epoch(1)
        training[decoder] = augmented[0]["video"]
        data = load_config(None, [f"data.decoder={decoder}", f"data.img_size={json.dumps(size)}"]).data
        stream = ChunkStream(VideoRecord({"video": path}, where="test"), data, InferenceSpec(chunk=8, overlap=0))
        try:
            streamed[decoder] = np.concatenate(
                [t["video"][k].numpy() for _, t in stream for k in range(len(t["video"]))], axis=1
            )
        finally:
            stream.close()
    for decoder in ("pyav", "auto"):
        np.testing.assert_array_equal(evaluation[decoder].numpy(), evaluation["opencv"].numpy())
        np.testing.assert_array_equal(training[decoder].numpy(), training["opencv"].numpy())
        np.testing.assert_array_equal(streamed[decoder], streamed["opencv"])
    np.testing.assert_array_equal(streamed["opencv"], evaluation["opencv"].numpy())  # inference = evaluation
    frame = evaluation["opencv"].permute(1, 2, 3, 0).numpy()[0]  # [C, T, H, W] -> frame 0, [H, W, C]
    assert frame.shape[:2] == tuple(size) and quadrants(frame).tolist() == displayed(LAYOUT, case).tolist()


def write_front_indexed(path: str, num_frames: int = 200) -> str:
    """H.264 with B-frames in MP4 with its index (moov) at the front, as cameras and `-movflags faststart` write it:
    a copy interrupted half-way keeps a header that lists every frame."""
    return write_with_pyav(path, num_frames, "libx264", gop=50, container_options={"movflags": "faststart"})


CUTS = {"near the end, mid-GOP": 0.97, "in the middle": 0.5, "inside the header": 0.05}


@pytest.fixture(scope="module")
def cut_files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("cut")
    whole = write_front_indexed(str(folder / "whole.mp4"))
    data = open(whole, "rb").read()
    files = {}
    for name, share in CUTS.items():
        path = folder / f"cut_{int(share * 100)}.mp4"
        path.write_bytes(data[: int(len(data) * share)])
        files[name] = str(path)
    return files


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("cut", ["near the end, mid-GOP", "in the middle"])
def test_a_cut_file_is_read_to_its_real_end_by_both_decoders(cut_files, cut, decoder):
    path = cut_files[cut]
    reference = decode_sequentially(path)
    reader = open_reader(path, decoder=decoder)
    assert reader.info.header_frames == 200 and reader.num_frames < 200
    asked = [0, len(reference) - 1, len(reference) // 2, 150, 199]
    frames = reader.read(asked)
    assert [read_barcode(f) for f in frames] == [min(i, len(reference) - 1) for i in asked]
    assert reader.num_frames == len(reference)
    np.testing.assert_array_equal(frames[1], reference[-1])


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_file_cut_inside_its_header_is_a_bad_input_error(cut_files, decoder):
    with pytest.raises(VideoReadError, match="cut_5.mp4: OpenCV cannot open this file"):
        open_reader(cut_files["inside the header"], decoder=decoder)


def test_pyav_errors_while_decoding_become_the_real_end(cut_files, monkeypatch):
    """Whatever PyAV raises while it decodes (here: InvalidDataError once frame 20 is out), the reader
    learns the real end and warns; it never lets PyAV's exception out."""
    from datasets.video.pyav_reader import PyAVReader

    path = cut_files["in the middle"]
    real_decode = PyAVReader._decode

    def failing(self):
        for frame in real_decode(self):
            if self._last_out >= 20:
                raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input")
            yield frame

    monkeypatch.setattr(PyAVReader, "_decode", failing)
    monkeypatch.setattr(PyAVReader, "_count_frames", lambda self, limit: min(limit, 22))
    reader = PyAVReader(path)
    frames = reader.read([5, 30])
    assert [read_barcode(f) for f in frames] == [5, 21] and reader.num_frames == 22


@pytest.mark.parametrize("on_bad_video", ["skip", "raise"])
@pytest.mark.parametrize("decoder", DECODERS)
def test_cut_files_through_the_dataset(cut_files, tmp_path, decoder, on_bad_video):
    lines = [{"video": cut_files[name], "label": "a"} for name in CUTS]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = load_config(
        None,
        [
            "data.num_workers=0",
            f"data.decoder={decoder}",
            f"data.on_bad_video={on_bad_video}",
            "data.num_frames=16",
            "data.max_video_frames=64",
            "data.img_size=[48, 120]",
        ],
    ).data
    records = read_manifest(str(tmp_path / "m.jsonl"))
    if on_bad_video == "raise":
        with pytest.raises(VideoReadError, match=r"cut_5\.mp4: OpenCV cannot open this file .* \(sample at .*:3\)"):
            VideoWindowDataset(records, ["a"], cfg, training=False)
        return
    dataset = VideoWindowDataset(records, ["a"], cfg, training=False)
    assert list(dataset.skipped) == [cut_files["inside the header"]]
    for index in range(len(dataset)):
        sample = dataset[index]
        assert [read_barcode(f) for f in sample["video"].permute(1, 2, 3, 0).numpy()] == sample[
            "frame_indices"
        ].tolist()
    lengths = {w.end for w in dataset.windows}
    assert max(lengths) < 200


def test_cut_files_through_infer_chunked(cut_files, trained_run, tmp_path):
    """infer_chunked.py on a folder of cut files: the readable ones classified to their real end, the one cut
    inside its header one line; no traceback."""
    folder = tmp_path / "videos"
    folder.mkdir()
    for path in cut_files.values():
        (folder / path.rsplit("/", 1)[1]).symlink_to(path)
    checkpoint = f"{trained_run[0]}/checkpoints/best.pt"
    result = subprocess.run(
        [
            sys.executable,
            "infer_chunked.py",
            "--checkpoint",
            checkpoint,
            "--input",
            str(folder),
            "--chunk",
            "4",
            "--overlap",
            "1",
            "--output",
            str(tmp_path / "out.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1 and "cut_5.mp4: OpenCV cannot open this file" in result.stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    lengths = {line["video"].rsplit("/", 1)[1]: line.get("num_frames") for line in lines}
    assert lengths == {name: len(decode_sequentially(str(folder / name))) for name in ("cut_97.mp4", "cut_50.mp4")} | {
        "cut_5.mp4": None
    }


# ------------------------------------------------------------------------------------------------ lengths that lie
def with_mkv_duration(path: str, factor: float) -> str:
    """The same MKV with its Segment Duration (EBML 0x4489) multiplied by ``factor``: a header that lies."""
    data = bytearray(open(path, "rb").read())
    at = data.find(b"\x44\x89")
    size = data[at + 2] & 0x7F
    fmt = ">d" if size == 8 else ">f"
    value = struct.unpack(fmt, data[at + 3 : at + 3 + size])[0]
    data[at + 3 : at + 3 + size] = struct.pack(fmt, value * factor)
    out = path.replace(".mkv", f"_x{factor:g}.mkv")
    open(out, "wb").write(bytes(data))
    return out


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_a_header_that_misstates_the_length_is_said_and_every_frame_read(tmp_path, factor, decoder, caplog):
    path = with_mkv_duration(write_with_pyav(str(tmp_path / "v.mkv"), 200, "libx264"), factor)
    info = probe(path)
    assert (info.header_frames, info.num_frames) == (int(200 * factor), 200)
    assert info.header_note().startswith(f"{path}: the header says {int(200 * factor)} frames but the file holds 200")
    frames = open_reader(path, decoder=decoder).read([0, 150, 199, 120])
    assert [read_barcode(f) for f in frames] == [0, 150, 199, 120]
    # a sequential pass (inference, features) reads to the real end
    data = load_config(None, [f"data.decoder={decoder}", "data.img_size=[48, 120]"]).data
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        stream = ChunkStream(VideoRecord({"video": path}, where="test"), data, InferenceSpec(chunk=50, overlap=0))
    try:
        windows = [w for group, _ in stream for w in group]
    finally:
        stream.close()
    assert windows[-1][1] == 200 and stream.num_frames == 200
    assert "the header says" in caplog.text
