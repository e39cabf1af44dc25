"""Prepared copies (data.prepared_dir, python -m datasets.prepare): frame i of a copy is frame i of its source, for
the files real cameras write (long GOPs with B-frames, a phone's rotation, dropped frames, a file cut short); a copy
is used only while its source and settings are those it was made from; training, evaluation and streaming read it;
the command says what it will write, skips what is done and splits between shards."""

import json
import os

import numpy as np
import pytest
from conftest import HEIGHT, WIDTH, overrides, read_barcode, run_in_process
from test_real_world_files import displayed, quadrants, write_front_indexed, write_turned
from test_video_reader import write_with_dropped_frames

from config import load_config
from datasets.chunk_stream import ChunkStream
from datasets.manifest import read_manifest
from datasets.prepared_copies import PreparedCopies, preparation_of
from datasets.video.choice import DECODERS, open_reader
from datasets.video.prepared import Preparation, find_copy, prepare_copy
from datasets.video.probe import frame_times, probe
from datasets.video_dataset import VideoWindowDataset

AT_SOURCE_SIZE = Preparation(HEIGHT, WIDTH, "none", gop=16, crf=18)


def prepared(path: str, folder, preparation: Preparation = AT_SOURCE_SIZE, autorotate: bool = True):
    with open_reader(path, (preparation.height, preparation.width), decoder="pyav", autorotate=autorotate) as reader:
        return prepare_copy(reader, str(folder), preparation, frame_times(path))


@pytest.mark.parametrize("decoder", DECODERS)
def test_every_frame_of_a_long_gop_camera_file_is_the_same_frame_of_its_copy(barcode_videos, tmp_path, decoder):
    """H.264 with 3 B-frames and a 250-frame GOP: the copy's random reads (short GOPs, no B-frames) land on the
    source's frame numbers, and its pixels are the source's within the re-encode's loss."""
    source, count = barcode_videos["h264_bframes_mp4"]
    copy = prepared(source, tmp_path)
    assert copy.info.num_frames == count and copy.record["frames"] == count
    order = np.random.default_rng(0).permutation(count)[:80].tolist() + [count - 1, 0]
    with open_reader(copy.path, (HEIGHT, WIDTH), info=copy.info, decoder=decoder) as reader:
        frames = reader.read(order)
    assert [read_barcode(f) for f in frames] == order
    with open_reader(source, (HEIGHT, WIDTH), decoder=decoder) as reader:
        original = reader.read(order)
    assert np.abs(frames.astype(int) - original).mean() < 2.0  # crf 18 over 4:4:4 chroma
    # the GOP asked for: a read of the last frame decodes at most 16 frames of the copy
    with open_reader(copy.path, (HEIGHT, WIDTH), info=copy.info, decoder=decoder) as reader:
        reader.read([count - 1])
        assert reader.stats["decoded"] + reader.stats["grabbed"] <= 16


def test_a_phones_rotation_is_applied_once_in_the_copy(tmp_path):
    """A file stored landscape with a 90-degree display rotation: the copy is stored upright (no rotation left
    to apply), so its frames are what the reader shows of the source, and its record says what was applied."""
    source = write_turned(str(tmp_path / "phone_90.mp4"), "90")
    info = probe(source)
    cfg = load_config(None, [f"data.img_size=[{info.height},{info.width}]", "data.resize=stretch"]).data
    preparation = preparation_of(info, cfg)
    assert preparation.orientation == info.orientation != "none"
    assert (preparation.height, preparation.width) == (info.height, info.width)
    copy = prepared(source, tmp_path / "copies", preparation)
    assert probe(copy.path).orientation == "none"
    with open_reader(copy.path, (info.height, info.width), info=copy.info) as reader:
        upright = reader.read([0, 5])
    with open_reader(source, (info.height, info.width)) as reader:
        shown = reader.read([0, 5])
    for frame, expected in zip(upright, shown):
        assert (quadrants(frame) == quadrants(expected)).all()
    with open_reader(source, decoder="pyav", autorotate=False) as reader:
        stored = reader.read([0])[0]
    assert (quadrants(upright[0]) == quadrants(displayed(stored, "90"))).all()


def test_a_file_with_dropped_frames_becomes_a_copy_with_regular_timestamps_and_its_times_recorded(tmp_path):
    """Timestamps that skip 5 frame durations at frame 200: the source can only be read sequentially; its copy
    numbers every frame one by one (random reads seek), and its record keeps each frame's original time."""
    source = write_with_dropped_frames(str(tmp_path / "dropped.mp4"), 300, dropped_at=200)
    assert not probe(source).regular_timestamps
    copy = prepared(source, tmp_path / "copies")
    assert probe(copy.path).regular_timestamps and copy.info.num_frames == 300
    times = copy.record["frame_times"]
    assert times[199] == pytest.approx(199 / 25) and times[200] == pytest.approx(205 / 25)
    with open_reader(copy.path, (HEIGHT, WIDTH), info=copy.info, decoder="pyav") as reader:
        assert [read_barcode(f) for f in reader.read([250, 10, 199, 200, 299])] == [250, 10, 199, 200, 299]
        assert reader.stats["seeks"] >= 1  # not a sequential read


def test_a_file_cut_short_keeps_the_frames_that_decode(tmp_path):
    """A copy interrupted half-way (its header lists 200 frames): the copy holds the frames the readers find,
    and a dataset of it has the copy's length."""
    whole = write_front_indexed(str(tmp_path / "whole.mp4"))
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(open(whole, "rb").read()[: int(os.path.getsize(whole) * 0.5)])
    with open_reader(str(cut), (HEIGHT, WIDTH), decoder="pyav") as reader:
        reader.read([199])  # past the real end: finds it
        real = reader.num_frames
    assert 0 < real < 200
    copy = prepared(str(cut), tmp_path / "copies")
    assert copy.info.num_frames == real
    with open_reader(copy.path, (HEIGHT, WIDTH), info=copy.info) as reader:
        assert [read_barcode(f) for f in reader.read([real - 1, 0])] == [real - 1, 0]


def test_a_copy_is_used_only_while_its_source_and_settings_are_those_it_was_made_from(barcode_videos, tmp_path):
    source = str(tmp_path / "camera.mp4")
    original = open(barcode_videos["h264_bframes_mp4"][0], "rb").read()
    with open(source, "wb") as f:
        f.write(original)
    folder = tmp_path / "copies"
    copy = prepared(source, folder)
    assert find_copy(str(folder), source, AT_SOURCE_SIZE)[0].path == copy.path
    other = Preparation(HEIGHT, WIDTH, "none", gop=8, crf=18)
    assert find_copy(str(folder), source, other) == (None, "not prepared yet")  # another key: another copy
    stat = os.stat(source)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the same bytes, written again
    assert find_copy(str(folder), source, AT_SOURCE_SIZE) == (None, "the source changed since it was prepared")
    with open(source, "r+b") as f:  # an edit of unchanged size and time
        f.seek(100)
        f.write(b"\xff" * 8)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert find_copy(str(folder), source, AT_SOURCE_SIZE)[1] == "the source changed since it was prepared"
    with open(source, "wb") as f:
        f.write(original)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert find_copy(str(folder), source, AT_SOURCE_SIZE)[0] is not None
    record_path = copy.path[: -len(".mp4")] + ".json"
    record = json.loads(open(record_path).read())
    with open(record_path, "w") as f:  # a copy made by a version that encoded otherwise
        json.dump({**record, "encoder": {**record["encoder"], "tune": "film"}}, f)
    assert find_copy(str(folder), source, AT_SOURCE_SIZE)[1].endswith(".json was made with other settings")
    os.unlink(record_path)  # a copy without its record (a preparation that stopped)
    assert find_copy(str(folder), source, AT_SOURCE_SIZE) == (None, "not prepared yet")
    assert sorted(os.listdir(folder)) == [os.path.basename(copy.path)]  # nothing temporary left


@pytest.fixture(scope="module")
def prepared_synthetic(synthetic_root, tmp_path_factory):
    """The small synthetic set's videos prepared by the command for the tests' config (32x32 frames from 32x32
    sources), in shards 0/2 and 1/2, and the command's output of each."""
    folder = str(tmp_path_factory.mktemp("prepared"))
    settings = [a for a in overrides(synthetic_root, folder)[2:]] + ["--set", f"data.prepared_dir={folder}"]
    runs = [
        run_in_process(["-m", "datasets.prepare", "--config", "configs/base.yaml", *settings, "--shard", s])
        for s in ("0/2", "1/2")
    ]
    return folder, settings, runs


def test_the_command_states_its_cost_prepares_each_shard_and_skips_what_is_done(prepared_synthetic):
    folder, settings, runs = prepared_synthetic
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    counts = [int(r.stdout.split(" videos")[0]) for r in runs]
    assert "estimated: " in runs[0].stdout and " GB in " in runs[0].stdout and " s (" in runs[0].stdout
    records = [n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith(".")]
    assert len(records) == sum(counts)  # the two shards took every video once
    again = run_in_process(["-m", "datasets.prepare", "--config", "configs/base.yaml", *settings])
    assert again.returncode == 0 and f"{sum(counts)} prepared already, 0 to prepare" in again.stdout


def test_without_a_folder_or_a_manifest_the_command_says_what_to_set(tmp_path):
    done = run_in_process(["-m", "datasets.prepare", "--config", "configs/quickstart.yaml"])
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2
    assert last.startswith(
        "error: configs/quickstart.yaml: data.prepared_dir is not set; give the folder the copies go to"
    )
    flags = ["--set", f"data.prepared_dir={tmp_path / 'copies'}", "--set", f"data.data_dir={tmp_path / 'nowhere'}"]
    nowhere = run_in_process(["-m", "datasets.prepare", "--config", "configs/quickstart.yaml", *flags])
    assert nowhere.returncode == 2 and not (tmp_path / "copies").exists()
    [line] = [x for x in nowhere.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {tmp_path / 'nowhere' / 'train.jsonl'}: not found (data.train_manifest")


def test_a_video_that_cannot_be_read_is_one_line_and_the_others_are_prepared(synthetic_root, tmp_path):
    good = read_manifest(os.path.join(synthetic_root, "train.jsonl"))[0].first_path
    missing = str(tmp_path / "gone.mp4")
    lines = [{"video": good, "label": "up"}, {"video": missing, "label": "up"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = ["--set", f"data.data_dir={tmp_path}", "--set", f"data.prepared_dir={tmp_path / 'copies'}"]
    done = run_in_process(["-m", "datasets.prepare", "--config", "configs/base.yaml", *flags])
    assert done.returncode == 1
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {missing}: file not found") and line.count(missing) == 1
    assert "2 videos: 0 prepared already, 1 to prepare" in done.stdout and "prepared 1 videos" in done.stdout


def test_training_evaluation_and_streaming_read_the_copies_and_say_so(prepared_synthetic, synthetic_root, caplog):
    folder, _, _ = prepared_synthetic
    plain = load_config(None, [f"data.data_dir={synthetic_root}", "data.img_size=32", "data.num_frames=8"])
    copies = load_config(
        None,
        [f"data.data_dir={synthetic_root}", "data.img_size=32", "data.num_frames=8", f"data.prepared_dir={folder}"],
    )
    records = read_manifest(os.path.join(synthetic_root, "val.jsonl"))
    names = ["down", "grow", "left", "right", "shrink", "up"]
    with caplog.at_level("INFO", logger="longvideo"):
        from_copies = VideoWindowDataset(records, names, copies.data, training=False)
    assert (
        f"prepared copies (data.prepared_dir: {folder}): {len(records)} of {len(records)} videos read from their copies"
        in caplog.text
    )
    from_sources = VideoWindowDataset(records, names, plain.data, training=False)
    assert all(path != source and path.startswith(folder) for source, (path, _) in from_copies.read_from.items())
    for index in range(len(from_sources)):
        a, b = from_sources[index], from_copies[index]
        assert a["label"] == b["label"] and a["frame_indices"].tolist() == b["frame_indices"].tolist()
        # the re-encode's loss at x264 quality 18 (datasets.prepared_copies.PREPARED_CRF): 2.13 of 255 on average over these textured 32x32 clips
        assert (a["video"].float() - b["video"].float()).abs().mean() < 4.0
    # streaming (infer_chunked.py, eval.py's whole windows, --features) opens the copy as well
    spec = type("Spec", (), {"chunk": 4, "overlap": 0, "aggregation": "mean", "batch": 2, "decode_threads": 1})()
    stream = ChunkStream(records[0], copies.data, spec)
    try:
        assert stream.copies.copied[records[0].first_path].startswith(folder)
        assert stream.fps == probe(records[0].first_path).fps
        assert sum(len(windows) for windows, _ in stream) == len(stream.windows)
    finally:
        stream.close()
    missing = PreparedCopies(load_config(None, [f"data.prepared_dir={folder}", "data.img_size=24"]).data)
    path = records[0].first_path
    assert missing.read_from(path, probe(path))[0] == path  # another decode size: the source
    assert "1 from their sources" in missing.summary() and "python -m datasets.prepare" in missing.summary()


def test_the_docs_commands_work_as_written(synthetic_root, tmp_path_factory):
    """docs/data.md's two commands, run as a user's shell runs them, in a fresh workspace whose data/synthetic is
    the tests' small set: the copies are written, then the training run reads them and says so."""
    from doc_commands import bash_blocks, fresh_workspace  # the docs commands run as written
    from doc_commands import run as run_as_written

    folder = fresh_workspace(tmp_path_factory)
    (folder / "data").mkdir()
    (folder / "data" / "synthetic").symlink_to(synthetic_root)
    commands = bash_blocks("docs/data.md", "## Prepared copies")
    assert len(commands) == 2 and commands[0].startswith("python -m datasets.prepare")
    results = [run_as_written(command, folder) for command in commands]
    for command, result in zip(commands, results):
        assert result.returncode == 0, (command, result.stderr[-2000:])
    videos = len(
        {
            r.first_path
            for split in ("train", "val", "test")
            for r in read_manifest(os.path.join(synthetic_root, f"{split}.jsonl"))
        }
    )
    assert f"{videos} videos: 0 prepared already, {videos} to prepare" in results[0].stdout
    log = results[1].stdout + results[1].stderr
    assert "prepared copies (data.prepared_dir: data/prepared): 18 of 18 videos read from their copies" in log
