"""Bad videos and DataLoader workers: one line for a worker's error or a truncated file, workers forked after the
main process read, skipped files reported once per run (datasets/workers.py, datasets/bad_input.py)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import BASE_CONFIG, error_lines, overrides, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_CLIP = os.path.join(ROOT, "..", "shared", "data", "nasa_13013.mp4")


def test_an_error_in_a_dataloader_worker_is_the_same_one_line(synthetic_root, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(synthetic_root, data)
    for folder in (data / "keypoints").iterdir():  # every clip loses its keypoint frames after frame 3
        for name in sorted(os.listdir(folder))[4:] if folder.is_dir() else []:
            os.unlink(folder / name)
    result = run_python(
        [
            "train.py",
            *overrides(
                str(data), tmp_path / "runs", "data.load_kpt=true", "model.input_type=rgb_kpt", "data.num_workers=2"
            ),
        ]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Caught" not in result.stderr
    [line] = error_lines(result.stderr)
    assert "keypoint" in line and "(sample at " in line and line.count("\n") == 0


def test_a_truncated_mp4_gives_one_line_without_ffmpeg_noise(synthetic_root, tmp_path):
    video = os.path.join(synthetic_root, "videos", sorted(os.listdir(os.path.join(synthetic_root, "videos")))[0])
    (tmp_path / "cut.mp4").write_bytes(open(video, "rb").read()[:2000])  # the moov atom is gone
    (tmp_path / "train.jsonl").write_text(json.dumps({"video": "cut.mp4", "label": "up"}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCV_")}
    result = run_python(
        [
            "train.py",
            "--config",
            BASE_CONFIG,
            "--set",
            f"data.data_dir={tmp_path}",
            "--set",
            "data.val_manifest=null",
            "--set",
            f"trainer.output_dir={tmp_path / 'runs'}",
        ],
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == error_lines(result.stderr)  # nothing but the one line
    assert "cut.mp4: OpenCV cannot open this file as a video" in result.stderr


FORK_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, cv2, torch
    from datasets.manifest import VideoRecord
    from datasets.video_dataset import collate_samples, VideoWindowDataset
    from datasets.workers import before_workers_fork
    from config import load_config
    cfg = load_config(None, ["data.img_size=64", "data.num_frames=8", "data.frame_stride=3",
                             "data.max_video_frames=80", "data.decoder={decoder}", "data.index_cache=null"]).data
    cv2.cvtColor(np.zeros((720, 1280, 3), np.uint8), cv2.COLOR_BGR2GRAY)  # the parent uses OpenCV's thread pool
    dataset = VideoWindowDataset([VideoRecord({{"video": {clip!r}}}, label="a", where="clip")], ["a"], cfg,
                                 training=False)
    alone = [dataset[i]["video"] for i in range(len(dataset))]  # the main process opens a reader first
    before_workers_fork(2)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=2, timeout=60,
                                         collate_fn=collate_samples)
    forked = [batch["video"][0] for batch in loader]
    assert len(forked) == len(alone) == len(dataset) > 3
    assert all(torch.equal(a, b) for a, b in zip(alone, forked)), "workers read other frames"
    print("ok", len(forked))
""")


@pytest.mark.skipif(not os.path.exists(SHARED_CLIP), reason="../shared/data/nasa_13013.mp4 is not there")
@pytest.mark.parametrize("decoder", ["opencv", "pyav"])
def test_workers_forked_after_the_main_process_read_get_the_same_frames_and_do_not_hang(decoder):
    script = FORK_SCRIPT.format(decoder=decoder, clip=os.path.realpath(SHARED_CLIP))
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok ")


def test_skipped_files_and_data_warnings_are_reported_once_per_run(synthetic_root, tmp_path):
    from conftest import write_with_pyav

    data = tmp_path / "data"
    shutil.copytree(synthetic_root, data)
    # H.264 with B-frames whose header lists 200 frames, cut inside its last group of B-frames: the index counts
    # 190 whole packets, decoding ends at 189 (found by a worker)
    cut = write_with_pyav(str(data / "cut.mp4"), 200, "libx264", gop=50, container_options={"movflags": "faststart"})
    content = open(cut, "rb").read()
    open(cut, "wb").write(content[: int(len(content) * 0.97)])
    lines = (data / "train.jsonl").read_text().splitlines()[:8]
    lines += [json.dumps({"video": "cut.mp4", "label": "up"}), json.dumps({"video": "missing.mp4", "label": "up"})]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    result = run_python(
        [
            "train.py",
            *overrides(
                str(data),
                tmp_path / "runs",
                "data.on_bad_video=skip",
                "data.num_workers=2",
                "data.max_video_frames=40",
                "data.num_frames=-1",
                "data.frame_stride=1",
                "data.batch_size=1",
            ),
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert log.count("cut.mp4: the header says 200 frames but the file holds 190") == 1  # at indexing
    assert log.count("cut.mp4: the file says 190 frames but decoding ends at frame 189") == 1  # not once per
    for epoch in (1, 2):  # worker and epoch
        [line] = [t for t in log.splitlines() if t.startswith(f"epoch {epoch}: ") and "skipped" in t]
        # rejected while indexing
        assert (
            line == f"epoch {epoch}: 1 file(s) skipped: {data / 'missing.mp4'} ({data / 'missing.mp4'}: file not "
            f"found; check the path in the manifest (relative paths are resolved against the manifest's "
            f"folder) (sample at {data / 'train.jsonl'}:10))"
        )
    [summary] = [t for t in log.splitlines() if t.startswith("run: ")]
    assert summary.startswith("run: 1 file(s) skipped (data.on_bad_video: skip): ")
