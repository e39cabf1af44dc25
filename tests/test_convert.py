"""python -m datasets.convert: each format on a small hand-written example, the exact manifest expected; what does
not map is summarized and nothing is written."""

import json
import os
import subprocess
import sys

import pytest

from datasets.convert import main
from datasets.manifest import read_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def touch(*paths):
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0")


def manifest_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def ucf(tmp_path):
    videos = tmp_path / "UCF-101"
    touch(
        videos / "ApplyEyeMakeup" / "v_ApplyEyeMakeup_g08_c01.avi",
        videos / "Archery" / "v_Archery_g01_c02.avi",
        videos / "ApplyEyeMakeup" / "v_ApplyEyeMakeup_g01_c01.avi",
    )
    lists = tmp_path / "ucfTrainTestlist"
    write(lists / "classInd.txt", "1 ApplyEyeMakeup\n2 Archery\n")
    write(lists / "trainlist01.txt", "ApplyEyeMakeup/v_ApplyEyeMakeup_g08_c01.avi 1\nArchery/v_Archery_g01_c02.avi 2\n")
    write(lists / "testlist01.txt", "ApplyEyeMakeup/v_ApplyEyeMakeup_g01_c01.avi\n")
    return tmp_path


def test_ucf101_train_and_test_lists(ucf):
    out = ucf / "manifests" / "train.jsonl"
    assert (
        main(
            [
                "ucf101",
                str(ucf / "ucfTrainTestlist"),
                "--videos",
                str(ucf / "UCF-101"),
                "--subset",
                "train",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert manifest_lines(out) == [
        {"video": "../UCF-101/ApplyEyeMakeup/v_ApplyEyeMakeup_g08_c01.avi", "label": "ApplyEyeMakeup"},
        {"video": "../UCF-101/Archery/v_Archery_g01_c02.avi", "label": "Archery"},
    ]
    assert [r.first_path for r in read_manifest(str(out))] == [  # the project reads it back to the files
        str(ucf / "UCF-101" / "ApplyEyeMakeup" / "v_ApplyEyeMakeup_g08_c01.avi"),
        str(ucf / "UCF-101" / "Archery" / "v_Archery_g01_c02.avi"),
    ]
    test = ucf / "test.jsonl"
    assert (
        main(
            [
                "ucf101",
                str(ucf / "ucfTrainTestlist"),
                "--videos",
                str(ucf / "UCF-101"),
                "--subset",
                "test",
                "--out",
                str(test),
            ]
        )
        == 0
    )
    assert manifest_lines(test) == [
        {"video": "UCF-101/ApplyEyeMakeup/v_ApplyEyeMakeup_g01_c01.avi", "label": "ApplyEyeMakeup"}
    ]


def test_missing_videos_and_unknown_labels_are_summarized_and_nothing_is_written(ucf, capsys):
    with open(ucf / "ucfTrainTestlist" / "trainlist01.txt", "a") as f:
        f.write("Archery/v_Archery_g99_c01.avi 2\nBowling/v_Bowling_g01_c01.avi 7\n")
    out = ucf / "train.jsonl"
    args = [
        "ucf101",
        str(ucf / "ucfTrainTestlist"),
        "--videos",
        str(ucf / "UCF-101"),
        "--subset",
        "train",
        "--out",
        str(out),
    ]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert error == (
        f"error: 2 of 4 entries not mapped: 1 missing video files (first: "
        f"{ucf / 'ucfTrainTestlist' / 'trainlist01.txt'}:3: {ucf / 'UCF-101' / 'Archery' / 'v_Archery_g99_c01.avi'}); "
        f"1 unknown labels (first: {ucf / 'ucfTrainTestlist' / 'trainlist01.txt'}:4: 7); nothing written "
        f"(fix them, or --skip-missing to write the 2 that map)\n"
    )
    assert not out.exists()
    assert not any(name.startswith("train.jsonl") or name.endswith(".tmp") for name in os.listdir(ucf))
    assert main(args + ["--skip-missing"]) == 0
    assert len(manifest_lines(out)) == 2 and "2 of 4 entries not mapped" in capsys.readouterr().err


def test_hmdb51_split_files(tmp_path):
    videos = tmp_path / "hmdb51"
    touch(videos / "brush_hair" / "a.avi", videos / "brush_hair" / "b.avi", videos / "cartwheel" / "c.avi")
    splits = tmp_path / "splits"
    write(splits / "brush_hair_test_split1.txt", "a.avi 1 \nb.avi 2 \n")
    write(splits / "cartwheel_test_split1.txt", "c.avi 1 \nd.avi 0 \n")
    write(splits / "cartwheel_test_split2.txt", "c.avi 2 \n")
    out = tmp_path / "hmdb_train.jsonl"
    assert main(["hmdb51", str(splits), "--videos", str(videos), "--subset", "train", "--out", str(out)]) == 0
    assert manifest_lines(out) == [
        {"video": "hmdb51/brush_hair/a.avi", "label": "brush_hair"},
        {"video": "hmdb51/cartwheel/c.avi", "label": "cartwheel"},
    ]
    assert (
        main(["hmdb51", str(splits), "--videos", str(videos), "--subset", "test", "--split", "2", "--out", str(out)])
        == 0
    )
    assert manifest_lines(out) == [{"video": "hmdb51/cartwheel/c.avi", "label": "cartwheel"}]


def test_kinetics_csv_with_the_clips_on_disk(tmp_path):
    videos = tmp_path / "k400" / "train"
    touch(videos / "abseiling" / "abc123_000010_000020.mp4", videos / "zumba" / "xyz789_000000_000010.webm")
    write(
        tmp_path / "k400" / "train.csv",
        "label,youtube_id,time_start,time_end,split\n"
        "abseiling,abc123,10,20,train\nzumba,xyz789,0,10,train\n"
        "zumba,val000,5,15,val\n",
    )
    out = tmp_path / "k400_train.jsonl"
    assert (
        main(
            [
                "kinetics",
                str(tmp_path / "k400" / "train.csv"),
                "--videos",
                str(videos),
                "--subset",
                "train",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert manifest_lines(out) == [
        {"video": "k400/train/abseiling/abc123_000010_000020.mp4", "label": "abseiling"},
        {"video": "k400/train/zumba/xyz789_000000_000010.webm", "label": "zumba"},
    ]


def test_activitynet_and_thumos_json_become_timelines_in_seconds(tmp_path):
    touch(tmp_path / "videos" / "v_abc.mp4", tmp_path / "videos" / "video_test_0000004.mp4")
    write(
        tmp_path / "anet.json",
        json.dumps(
            {
                "version": "1.3",
                "database": {
                    "abc": {
                        "subset": "validation",
                        "duration": 80.0,
                        "annotations": [
                            {"segment": [30.5, 41.0], "label": "Long jump"},
                            {"segment": [2.0, 9.25], "label": "Running"},
                        ],
                    },
                    "def": {"subset": "training", "annotations": [{"segment": [1, 2], "label": "Running"}]},
                },
            }
        ),
    )
    out = tmp_path / "anet_val.jsonl"
    assert (
        main(
            [
                "activitynet",
                str(tmp_path / "anet.json"),
                "--videos",
                str(tmp_path / "videos"),
                "--subset",
                "validation",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert manifest_lines(out) == [
        {
            "video": "videos/v_abc.mp4",
            "segments": [
                {"start_sec": 2.0, "end_sec": 9.25, "label": "Running"},
                {"start_sec": 30.5, "end_sec": 41.0, "label": "Long jump"},
            ],
        }
    ]
    [record] = read_manifest(str(out))
    assert [s.in_frames(10.0) for s in record.segments] == [(20, 92), (305, 410)]
    write(
        tmp_path / "thumos.json",
        json.dumps(
            {
                "database": {
                    "video_test_0000004": {
                        "subset": "Test",
                        "annotations": [{"segment": ["0.2", "1.1"], "label": "CricketBowling"}],
                    }
                }
            }
        ),
    )
    assert (
        main(
            [
                "thumos",
                str(tmp_path / "thumos.json"),
                "--videos",
                str(tmp_path / "videos"),
                "--subset",
                "test",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert manifest_lines(out) == [
        {
            "video": "videos/video_test_0000004.mp4",
            "segments": [{"start_sec": 0.2, "end_sec": 1.1, "label": "CricketBowling"}],
        }
    ]


def test_mmaction_lists_with_and_without_frame_counts(tmp_path):
    touch(tmp_path / "data" / "a.mp4", tmp_path / "data" / "sub" / "b.mp4")
    write(tmp_path / "classes.txt", "walk\nrun\n")
    write(tmp_path / "list.txt", "a.mp4 1\nsub/b.mp4 120 0\n")
    out = tmp_path / "mm.jsonl"
    assert (
        main(
            [
                "mmaction",
                str(tmp_path / "list.txt"),
                "--videos",
                str(tmp_path / "data"),
                "--classes",
                str(tmp_path / "classes.txt"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert manifest_lines(out) == [
        {"video": "data/a.mp4", "label": "run"},
        {"video": "data/sub/b.mp4", "label": "walk"},
    ]
    assert main(["mmaction", str(tmp_path / "list.txt"), "--videos", str(tmp_path / "data"), "--out", str(out)]) == 0
    assert manifest_lines(out) == [{"video": "data/a.mp4", "label": "1"}, {"video": "data/sub/b.mp4", "label": "0"}]


def test_a_bad_source_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "datasets.convert",
            "kinetics",
            str(tmp_path / "nope.csv"),
            "--videos",
            str(tmp_path),
            "--out",
            str(tmp_path / "k.jsonl"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr == f"error: {tmp_path / 'nope.csv'}: not found\n"
    write(tmp_path / "bad.csv", "youtube_id,label\nx,y\n")
    assert main(["kinetics", str(tmp_path / "bad.csv"), "--out", str(tmp_path / "k.jsonl")]) == 2
    assert not (tmp_path / "k.jsonl").exists()
