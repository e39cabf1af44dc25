"""Defects found by trying bad input and kills as a user would: each test failed before its fix."""
import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import BASE_CONFIG, overrides

import train
from artifacts.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_CLIP = os.path.join(ROOT, "..", "shared", "data", "nasa_13013.mp4")
GONE_PID = 4_194_304 + 17  # above Linux's largest pid_max: no process has it


def run(args, **kwargs):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, **kwargs)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------------------- 2. --resume PATH elsewhere

def test_resume_from_a_checkpoint_outside_a_run_directory_starts_a_new_one(trained_run, synthetic_root, tmp_path):
    run_dir, _ = trained_run
    users = tmp_path / "somewhere" / "models"
    users.mkdir(parents=True)
    shutil.copy(os.path.join(run_dir, "checkpoints", "epoch_0001.pt"), users / "best.pt")
    before = sorted(os.listdir(tmp_path / "somewhere"))
    args = overrides(synthetic_root, tmp_path / "runs", "train.chunk_infer_size=4", "train.chunk_overlap=1")
    assert train.main(args + ["--resume", str(users / "best.pt")]) == 0
    assert sorted(os.listdir(tmp_path / "somewhere")) == before == ["models"]  # nothing written beside it
    assert os.listdir(users) == ["best.pt"]
    new_run = os.path.realpath(tmp_path / "runs" / "e2e" / "latest")
    assert load_checkpoint(os.path.join(new_run, "checkpoints", "last.pt"))["epoch"] == 2


# ------------------------------------------------------------------ 3. errors raised in DataLoader workers

def test_an_error_in_a_dataloader_worker_is_the_same_one_line(synthetic_root, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(synthetic_root, data)
    for folder in (data / "keypoints").iterdir():  # every clip loses its keypoint frames after frame 3
        for name in sorted(os.listdir(folder))[4:] if folder.is_dir() else []:
            os.unlink(folder / name)
    result = run(["train.py", *overrides(str(data), tmp_path / "runs", "data.load_kpt=true",
                                         "model.input_type=rgb_kpt", "data.num_workers=2")])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Caught" not in result.stderr
    [line] = error_lines(result.stderr)
    assert "keypoint" in line and "(sample at " in line and line.count("\n") == 0


# ----------------------------------------------------------------------------- 6. noise around the line

def test_a_truncated_mp4_gives_one_line_without_ffmpeg_noise(synthetic_root, tmp_path):
    video = os.path.join(synthetic_root, "videos", sorted(os.listdir(os.path.join(synthetic_root, "videos")))[0])
    (tmp_path / "cut.mp4").write_bytes(open(video, "rb").read()[:2000])  # the moov atom is gone
    (tmp_path / "train.jsonl").write_text(json.dumps({"video": "cut.mp4", "label": "up"}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCV_")}
    result = run(["train.py", "--config", BASE_CONFIG, "--set", f"data.data_dir={tmp_path}", "--set",
                  "data.val_manifest=null", "--set", f"trainer.output_dir={tmp_path / 'runs'}"], env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == error_lines(result.stderr)  # nothing but the one line
    assert "cut.mp4: OpenCV cannot open this file as a video" in result.stderr


def test_a_pickled_checkpoint_refusal_gives_no_unsafe_advice_and_no_colour_codes(tmp_path):
    import argparse
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": argparse.Namespace(run="code")}, path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(path))
    message = str(info.value)
    assert "weights_only=False" not in message and "\x1b" not in message and "\n" not in message
    assert "argparse.Namespace" in message  # the reason: which global it would have had to import


# ------------------------------------------------------------------------------ 7. messages with a fix

def test_config_messages_say_how_to_fix(tmp_path):
    (tmp_path / "child.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "child.yaml"))
    assert str(info.value) == (f"{tmp_path / 'child.yaml'}: base: missing.yaml not found ({tmp_path / 'missing.yaml'}); "
                               f"a base is resolved relative to the file that names it: fix the 'base:' line, e.g. "
                               f"base: base.yaml")
    (tmp_path / "tabs.yaml").write_text("data:\n\tbatch_size: 4\n")
    with pytest.raises(ConfigError, match=r"tabs\.yaml: line 2 is not valid YAML .*; indent with spaces, not tabs$"):
        load_config(str(tmp_path / "tabs.yaml"))


def test_checkpoint_and_pretrained_messages_say_what_to_do(trained_run, tmp_path):
    run_dir, _ = trained_run
    data = open(os.path.join(run_dir, "checkpoints", "last.pt"), "rb").read()
    (tmp_path / "torn.pt").write_bytes(data[:len(data) // 3])
    with pytest.raises(CheckpointError, match=r"; use another checkpoint of the run \(last\.pt, best\.pt, "
                                              r"epoch_N\.pt\)$"):
        load_checkpoint(str(tmp_path / "torn.pt"))
    from models.pretrained import PretrainedError, _read
    with pytest.raises(PretrainedError, match=r"file not found; give a weights file that exists, true for "
                                              r"torchvision's download, or null$"):
        _read(str(tmp_path / "nothing.pth"))
    (tmp_path / "text.pth").write_text("not weights")
    with pytest.raises(PretrainedError, match=r"; give a state dict of tensors .*, or null$"):
        _read(str(tmp_path / "text.pth"))


# ------------------------------------------------------------------------ 9. temporary files left behind

def test_stale_temporary_files_of_killed_writers_are_removed_on_start(trained_run, synthetic_root, tmp_path, caplog):
    run_dir, _ = trained_run
    copy = tmp_path / "runs" / "e2e" / "run"
    shutil.copytree(run_dir, copy)
    os.symlink("run", tmp_path / "runs" / "e2e" / "latest")
    stale = copy / "checkpoints" / f".last.pt.{GONE_PID}.abcd1234.tmp"
    live = copy / "checkpoints" / f".last.pt.{os.getppid()}.efgh5678.tmp"  # a writer still running
    stale.write_bytes(b"x" * 1000)
    live.write_bytes(b"x" * 1000)
    args = overrides(synthetic_root, tmp_path / "runs", "train.chunk_infer_size=4", "train.chunk_overlap=1")
    with caplog.at_level("WARNING", logger="longvideo"):
        assert train.main(args + ["--resume", "auto"]) == 0
    assert not stale.exists() and live.exists()
    assert "removed 1 temporary file(s) left by writers that were killed: " in caplog.text
    assert caplog.text.strip().endswith(os.path.join("checkpoints", stale.name))
    ledger_tmp = tmp_path / "runs" / "e2e" / f".eval.jsonl.{GONE_PID}.zzzz0000.tmp"
    ledger_tmp.write_text("{")
    result = run(["eval.py", "--watch", str(tmp_path / "runs" / "e2e"), "--settle", "0"])
    assert result.returncode == 0, result.stderr
    assert not ledger_tmp.exists() and "removed 1 temporary file(s)" in result.stderr


# ------------------------------------------------------------------------------------------ 10. modes

@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_get_the_mode_of_the_users_umask(tmp_path, umask, mode):
    from core.files import atomic_write_bytes
    previous = os.umask(umask)
    try:
        save_checkpoint({"model": {}}, str(tmp_path / "c.pt"))
        atomic_write_bytes(str(tmp_path / "eval.jsonl"), b"{}\n")
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "c.pt").st_mode & 0o777 == mode
    assert os.stat(tmp_path / "eval.jsonl").st_mode & 0o777 == mode


# ------------------------------------------------------------------------------- 11. metrics.csv on resume

@pytest.mark.parametrize("stop_after", [3, 5])  # mid-epoch, and exactly at the end of epoch 1 (5 steps)
def test_metrics_csv_after_a_resume_equals_the_uninterrupted_run(trained_run, synthetic_root, tmp_path, stop_after):
    run_dir, _ = trained_run
    args = overrides(synthetic_root, tmp_path, "train.chunk_infer_size=4", "train.chunk_overlap=1")
    assert train.main(args + ["--stop-after-steps", str(stop_after)]) == 0
    assert train.main(args + ["--resume", "auto"]) == 0

    def rows(directory):
        with open(os.path.join(directory, "metrics.csv")) as f:
            return [(r["epoch"], r["train_loss"], r.get("val_video_acc")) for r in csv.DictReader(f)]
    assert rows(os.path.join(tmp_path, "e2e", "latest")) == rows(run_dir)


def test_a_column_that_appears_later_is_kept(tmp_path):
    from artifacts.csv_log import CsvLog
    log = CsvLog(str(tmp_path / "metrics.csv"))
    log.write({"epoch": 1, "train_loss": 1.5})
    log.write({"epoch": 2, "train_loss": 1.2, "val_top1": 0.5})  # validation every second epoch
    with open(tmp_path / "metrics.csv") as f:
        assert list(csv.DictReader(f)) == [{"epoch": "1", "train_loss": "1.5", "val_top1": ""},
                                           {"epoch": "2", "train_loss": "1.2", "val_top1": "0.5"}]


# ------------------------------------------------------------- 12, 13. readers and threads across fork

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


# ------------------------------------------------------------------------ 8. data.on_bad_video: skip

def test_skipped_files_and_data_warnings_are_reported_once_per_run(synthetic_root, tmp_path):
    from conftest import write_with_pyav
    data = tmp_path / "data"
    shutil.copytree(synthetic_root, data)
    # H.264 with B-frames whose header lists 200 frames, cut inside its last group of B-frames: the index counts
    # 190 whole packets, decoding ends at 189 (found by a worker)
    cut = write_with_pyav(str(data / "cut.mp4"), 200, "libx264", gop=50, container_options={"movflags": "faststart"})
    content = open(cut, "rb").read()
    open(cut, "wb").write(content[:int(len(content) * 0.97)])
    lines = (data / "train.jsonl").read_text().splitlines()[:8]
    lines += [json.dumps({"video": "cut.mp4", "label": "up"}), json.dumps({"video": "missing.mp4", "label": "up"})]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    result = run(["train.py", *overrides(str(data), tmp_path / "runs", "data.on_bad_video=skip",
                                         "data.num_workers=2", "data.max_video_frames=40", "data.num_frames=-1",
                                         "data.frame_stride=1", "data.batch_size=1")])
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert log.count("cut.mp4: the header says 200 frames but the file holds 190") == 1  # at indexing
    assert log.count("cut.mp4: the file says 190 frames but decoding ends at frame 189") == 1  # not once per
    for epoch in (1, 2):  # worker and epoch
        [line] = [t for t in log.splitlines() if t.startswith(f"epoch {epoch}: ") and "skipped" in t]
        # rejected while indexing
        assert line == f"epoch {epoch}: 1 file(s) skipped: {data / 'missing.mp4'} ({data / 'missing.mp4'}: file not " \
                       f"found; check the path in the manifest (relative paths are resolved against the manifest's " \
                       f"folder) (sample at {data / 'train.jsonl'}:10))"
    [summary] = [t for t in log.splitlines() if t.startswith("run: ")]
    assert summary.startswith("run: 1 file(s) skipped (data.on_bad_video: skip): ")


# ------------------------------------------------------------------------- 4, 5. infer_chunked.py input

def test_infer_counts_only_the_frames_that_exist(trained_run, tmp_path):
    import cv2
    from conftest import write_with_opencv
    cut = write_with_opencv(str(tmp_path / "cut.avi"), 200, "MJPG")
    content = open(cut, "rb").read()
    open(cut, "wb").write(content[:len(content) // 2])
    capture, decoded = cv2.VideoCapture(cut), 0
    while capture.grab():
        decoded += 1
    real = decoded - 1  # the frame the cut halves: decoders conceal its missing half, the index does not count it
    assert 10 < real < 200
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    result = run(["infer_chunked.py", "--checkpoint", best, "--input", cut, "--chunk", "12", "--overlap", "0",
                  "--output", str(tmp_path / "out.jsonl")])
    assert result.returncode == 0, result.stderr
    [line] = [json.loads(t) for t in (tmp_path / "out.jsonl").read_text().splitlines()]
    stride = load_checkpoint(best)["config"]["data"]["frame_stride"]
    clip_frames = len(range(0, real, stride))
    assert line["num_frames"] == real and line["chunks"] == -(-clip_frames // 12)  # no chunk past the real end
    assert f"{cut}: {real} frames" in result.stdout  # the console summary as well


def test_infer_refuses_the_manifest_lines_that_train_and_eval_refuse(trained_run, synthetic_root, tmp_path):
    long = json.loads(open(os.path.join(synthetic_root, "long.jsonl")).readline())
    video = os.path.join(synthetic_root, long["video"])
    lines = [{"video": video, "segments": [{"start": 0, "end": 100, "label": "up"},
                                           {"start": 5000, "end": 5100, "label": "up"}]},  # past the end
             {"video": video, "label": "zebra"},  # not a class of the model
             {"video": video, "label": "up"}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    result = run(["infer_chunked.py", "--checkpoint", best, "--input", str(tmp_path / "m.jsonl"), "--chunk", "8",
                  "--overlap", "0"])
    assert result.returncode == 1
    errors = error_lines(result.stderr)
    assert errors == [f"error: {tmp_path / 'm.jsonl'}:1: segment [5000, 5100) 'up' starts after the video's 300 "
                      f"frames",
                      f"error: {tmp_path / 'm.jsonl'}:2: label 'zebra' is not a known class (down, grow, left, "
                      f"right, shrink, up)"]
    assert "(true: up)" in result.stdout  # the good line ran


# ------------------------------------------------------------- the other new failure paths, one line each

def test_a_checkpoint_of_another_format_is_refused_with_the_way_out(tmp_path):
    save_checkpoint({"format": 99, "model": {}}, str(tmp_path / "new.pt"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(tmp_path / "new.pt"))
    assert str(info.value) == (f"{tmp_path / 'new.pt'}: checkpoint format 99, but this code reads format 1; use "
                               f"the version of this project that wrote it")


def test_a_val_fraction_that_empties_a_side_is_refused(synthetic_root):
    from datasets.manifest import ManifestError
    from datasets.records import training_records
    data = load_config(None, [f"data.data_dir={synthetic_root}", "data.val_fraction=0.0001"]).data
    with pytest.raises(ManifestError) as info:
        training_records(data)
    assert str(info.value) == ("data.val_fraction=0.0001 leaves 18 training and 0 validation videos of 18; choose a "
                               "fraction that leaves both")


def test_a_global_batch_that_the_processes_cannot_share_is_refused():
    from core.runtime import Runtime
    from datasets.shape import DataShape
    from planner.batch_size import fit_budget
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"),
                      ["trainer.memory_budget_gb=1", "data.batch_size=auto", "train.global_batch_size=15"])
    with pytest.raises(ConfigError) as info:
        fit_budget(cfg, Runtime(torch.device("cpu"), "32", 0, 2), DataShape(6))
    assert str(info.value) == "train.global_batch_size=15 must be a multiple of the 2 processes"


def test_infer_flag_and_checkpoint_choice_errors(trained_run, tmp_path):
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    result = run(["infer_chunked.py", "--checkpoint", best, "--batch", "many"])
    assert (result.returncode, result.stderr) == (2, "error: --batch many: expected a number of chunks, or auto\n")
    result = run(["infer_chunked.py", "--checkpoint", best, "--topk", "0"])
    assert (result.returncode, result.stderr) == (2, "error: --topk 0: must be >= 1\n")
    (tmp_path / "p.yaml").write_text(f"base: {os.path.join(ROOT, 'configs', 'base.yaml')}\nexperiment: nothing\n"
                                     f"trainer:\n  output_dir: {tmp_path}\n")
    result = run(["infer_chunked.py", "--config", str(tmp_path / "p.yaml")])
    assert (result.returncode, result.stderr) == (
        2, f"error: --config {tmp_path / 'p.yaml'}: no {tmp_path}/nothing/latest/checkpoints/best.pt (experiment "
           f"'nothing' has no trained run here); train it first or pass --checkpoint PATH\n")
    result = run(["infer_chunked.py", "--checkpoint", best, "--chunk", "16", "--batch", "auto",
                  "--memory-budget-gb", "0.000001", "--device", "cpu"])
    assert result.returncode == 2
    assert result.stderr.startswith("error: --batch auto: even 1 chunk of 16 frames does not fit the ")
    assert result.stderr.endswith("; use a shorter --chunk\n")


# ------------------------------------------------------- our words whatever the torch version (issue: unattended)

def bad_checkpoint(tmp_path, kind: str) -> str:
    path = str(tmp_path / f"{kind}.pt")
    if kind == "pickled":  # a class no safe loader allows
        torch.save({"format": 1, "model": {}, "dtype": np.float64}, path)
    elif kind == "protocol4":  # torch 2.15 warns on it (a UserWarning with a site-packages path), then refuses it
        torch.save({"format": 1, "model": {"w": torch.zeros(2)}}, path, pickle_protocol=4)
    elif kind == "truncated":
        torch.save({"format": 1, "model": {"w": torch.zeros(1000)}}, path)
        data = open(path, "rb").read()
        open(path, "wb").write(data[:len(data) // 3])
    else:  # a torch file, but not a checkpoint of this project
        torch.save({"weights": torch.zeros(2)}, path)
    return path


@pytest.mark.parametrize("kind, words", [
    ("pickled", "refused: the file needs pickled code to load (it names numpy.float64, which is not a tensor or a "
                "plain value)"),
    ("protocol4", "refused: the file needs pickled code to load"),
    ("truncated", "not a readable checkpoint (truncated or corrupt?): not a complete zip archive"),
    ("wrong-format", "not a checkpoint of this project (no 'model' entry)"),
])
def test_a_bad_checkpoint_is_one_line_of_our_own_words_on_stderr(tmp_path, kind, words):
    path = bad_checkpoint(tmp_path, kind)
    result = run(["eval.py", "--checkpoint", path])
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {path}: {words}")
    for torch_text in ("Please file an issue", "WeightsUnpickler", "site-packages", "Warning", "weights_only` ",
                       "PytorchStreamReader", "miniz", "add_safe_globals"):
        assert torch_text not in result.stderr
