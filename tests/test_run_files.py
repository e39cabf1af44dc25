"""The files of a run directory: temporary files of killed writers, the user's umask, metrics.csv across a resume
(core/files.py, artifacts/csv_log.py)."""

import csv
import os
import shutil

import pytest
from conftest import overrides, run_in_process

import train
from artifacts.checkpoint import Checkpoint, save_checkpoint
from datasets.shape import DataShape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GONE_PID = 4_194_304 + 17  # above Linux's largest pid_max: no process has it


def test_stale_temporary_files_of_killed_writers_are_removed_on_start(trained_run, synthetic_root, tmp_path, caplog):
    run_dir, _ = trained_run
    copy = tmp_path / "runs" / "e2e" / "run"
    shutil.copytree(run_dir, copy)
    os.symlink("run", tmp_path / "runs" / "e2e" / "latest")
    stale = copy / "checkpoints" / f".last.pt.{GONE_PID}.abcd1234.tmp"
    live = copy / "checkpoints" / f".last.pt.{os.getppid()}.efgh5678.tmp"  # a writer still running
    stale.write_bytes(b"x" * 1000)
    live.write_bytes(b"x" * 1000)
    args = overrides(synthetic_root, tmp_path / "runs", "infer.chunk_size=4", "infer.chunk_overlap=1")
    with caplog.at_level("WARNING", logger="longvideo"):
        assert train.main(args + ["--resume", "auto"]) == 0
    assert not stale.exists() and live.exists()
    assert "removed 1 temporary file(s) left by writers that were killed: " in caplog.text
    assert caplog.text.strip().endswith(os.path.join("checkpoints", stale.name))
    ledger_tmp = tmp_path / "runs" / "e2e" / f".eval.jsonl.{GONE_PID}.zzzz0000.tmp"
    ledger_tmp.write_text("{")
    result = run_in_process(["eval.py", "--watch", str(tmp_path / "runs" / "e2e"), "--settle", "0"])
    assert result.returncode == 0, result.stderr
    assert not ledger_tmp.exists() and "removed 1 temporary file(s)" in result.stderr


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_get_the_mode_of_the_users_umask(tmp_path, umask, mode):
    from core.files import atomic_write_bytes

    previous = os.umask(umask)
    try:
        save_checkpoint(Checkpoint({}, {}, ["a", "b"], DataShape(2)), str(tmp_path / "c.pt"))
        atomic_write_bytes(str(tmp_path / "eval.jsonl"), b"{}\n")
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "c.pt").st_mode & 0o777 == mode
    assert os.stat(tmp_path / "eval.jsonl").st_mode & 0o777 == mode


@pytest.mark.parametrize("stop_after", [3, 5])  # mid-epoch, and exactly at the end of epoch 1 (5 steps)
def test_metrics_csv_after_a_resume_equals_the_uninterrupted_run(trained_run, synthetic_root, tmp_path, stop_after):
    run_dir, _ = trained_run
    args = overrides(synthetic_root, tmp_path, "infer.chunk_size=4", "infer.chunk_overlap=1")
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
        assert list(csv.DictReader(f)) == [
            {"epoch": "1", "train_loss": "1.5", "val_top1": ""},
            {"epoch": "2", "train_loss": "1.2", "val_top1": "0.5"},
        ]
