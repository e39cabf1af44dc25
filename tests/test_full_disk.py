"""A full disk (ENOSPC; EDQUOT and EIO alike): the run stops at its first failed write with one line naming the file,
nothing it wrote before is torn, and after space is freed the run, the next cron evaluation and a rerun of
--features continue with nothing lost and nothing done twice.

Where the test runs as root it fills a real filesystem (a small tmpfs); each writer is also covered by making the
write itself fail (os.write for appends, os.fsync for atomic writes: where a filesystem with delayed allocation
reports a full disk), which runs anywhere."""

from __future__ import annotations

import csv
import errno
import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import fill, overrides

import eval as eval_script
import infer_chunked
import train
from artifacts.checkpoint import load_checkpoint
from core.files import DiskFullError, append_whole, atomic_open, process_temp_dir, repair_torn_tail
from core.logs import WholeLineFileHandler
from core.tensor_files import load_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------------- helpers
class FailingWrites:
    """os.write and os.fsync fail with ENOSPC for files whose name contains ``name``, from its ``nth`` write on."""

    def __init__(self, monkeypatch, name: str, nth: int = 1, code: int = errno.ENOSPC):
        self.name, self.nth, self.code, self.count = name, nth, code, 0
        real_write, real_fsync = os.write, os.fsync

        def write(fd, data):
            self._check(fd)
            return real_write(fd, data)

        def fsync(fd):
            self._check(fd)
            return real_fsync(fd)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fsync", fsync)

    def _check(self, fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if self.name in os.path.basename(path):
            self.count += 1
            if self.count >= self.nth:
                raise OSError(self.code, os.strerror(self.code))


def assert_whole_rows(run_dir: str) -> None:
    """Every CSV of the run: rows of the header's width, the file ending in a newline; every log line whole."""
    for path in glob.glob(os.path.join(run_dir, "*.csv")):
        text = open(path).read()
        assert text.endswith("\n"), path
        rows = list(csv.reader(text.splitlines()))
        assert all(len(row) == len(rows[0]) for row in rows), path
    log = open(os.path.join(run_dir, "train.log")).read()
    assert log.endswith("\n") and all(line[:4].isdigit() for line in log.splitlines())


def epochs_of(run_dir: str) -> list[int]:
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        return [int(row["epoch"]) for row in csv.DictReader(f)]


# ------------------------------------------------------------------------------------------------ the primitives
def test_a_failed_append_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = str(tmp_path / "rows.csv")
    append_whole(path, b"a,b\n1,2\n")
    real_write, calls = os.write, []

    def half_then_full(fd, data):  # the disk fills in the middle of the row
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(DiskFullError, match=r"rows\.csv: cannot write it: the disk is full \(.* MB free there\)"):
        append_whole(path, b"3,4,5,6,7,8\n")
    monkeypatch.undo()
    assert len(calls) == 2 and open(path, "rb").read() == b"a,b\n1,2\n"


def test_a_torn_tail_is_cut_back_to_the_last_whole_row(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_bytes(b"a,b\n1,2\n3,")
    assert repair_torn_tail(str(path)) == 2 and path.read_bytes() == b"a,b\n1,2\n"
    assert repair_torn_tail(str(path)) == 0
    path.write_bytes(b"a,b")
    assert repair_torn_tail(str(path)) == 3 and path.read_bytes() == b""
    assert repair_torn_tail(str(tmp_path / "missing.csv")) == 0


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_torch_save_on_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch, code):
    path = str(tmp_path / "last.pt")
    with atomic_open(path) as f:
        torch.save({"step": 1}, f)

    class Full:  # the file object torch.save writes into fails as a full disk makes it fail
        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(code, os.strerror(code))

        def __getattr__(self, name):
            return getattr(self.file, name)

    import core.files

    real_recorder = core.files._WriteRecorder.__init__
    monkeypatch.setattr(core.files._WriteRecorder, "__init__", lambda self, file: real_recorder(self, Full(file)))
    reason = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is reached",
        errno.EIO: "the device failed to write",
    }[code]
    with pytest.raises(DiskFullError, match=rf"last\.pt: cannot write it: {reason}"):
        with atomic_open(path) as f:
            torch.save({"step": 2, "weights": torch.zeros(1000)}, f)
    assert load_tensors(path)["step"] == 1 and os.listdir(tmp_path) == ["last.pt"]  # no temporary left


def test_the_log_file_raises_once_then_writes_nothing(tmp_path, monkeypatch, capsys):
    import logging

    logger = logging.getLogger("longvideo.test_full_disk")
    handler = WholeLineFileHandler(str(tmp_path / "train.log"))
    logger.addHandler(handler)
    try:
        logger.warning("first")
        FailingWrites(monkeypatch, "train.log")
        with pytest.raises(DiskFullError, match="train.log: cannot write it"):
            logger.warning("second")
        logger.warning("third")  # after the failure: nothing, and no "--- Logging error ---"
    finally:
        logger.removeHandler(handler)
    assert "Logging error" not in capsys.readouterr().err
    assert open(tmp_path / "train.log").read() == "first\n"


# --------------------------------------------------------------------------------------- every writer of a run
# (the file, the write that fails: later ones leave whole rows before them, and a checkpoint written before)
WRITERS = [
    ("config.yaml", 1),
    ("train.log", 6),
    ("memory.csv", 4),
    ("last.pt", 2),
    ("metrics.csv", 2),
    ("training_curves.png", 1),
]


@pytest.mark.parametrize("name,nth", WRITERS)
def test_every_writer_of_a_run_stops_it_with_one_line_and_resume_continues(
    synthetic_root, tmp_path, monkeypatch, capsys, name, nth
):
    out = tmp_path / "runs"
    args = overrides(synthetic_root, out, "trainer.plots=true")
    failing = FailingWrites(monkeypatch, name, nth)
    with pytest.raises(DiskFullError) as raised:
        train.main(args)
    monkeypatch.undo()
    message = str(raised.value)
    assert f"{name}: cannot write it: the disk is full" in message and "Traceback" not in message
    assert failing.count == nth
    run_dir = os.path.realpath(glob.glob(str(out / "e2e" / "2*"))[0])
    assert "No space left" not in capsys.readouterr().err  # no "--- Logging error ---" of a failed log write
    last = os.path.join(run_dir, "checkpoints", "last.pt")
    if os.path.exists(last):  # the checkpoint from before the failure loads
        assert message.endswith(
            "the last checkpoint written is intact: free space there, then continue with: "
            f"python train.py --config {args[1]} " + " ".join(f"--set {a}" for a in args[3::2]) + " --resume auto"
        )
        assert load_checkpoint(last).state.epoch >= 1
        assert_whole_rows(run_dir)
        assert train.main(args + ["--resume", "auto"]) == 0
    else:  # failed before its first checkpoint: started again
        assert message.endswith("free space there, then run the same command again")
        assert train.main(args) == 0
        run_dir = os.path.realpath(str(out / "e2e" / "latest"))
    assert_whole_rows(run_dir)
    assert epochs_of(run_dir) == [1, 2]  # nothing lost, nothing twice
    assert load_checkpoint(os.path.join(run_dir, "checkpoints", "last.pt")).state.epoch == 2


# ------------------------------------------------------------------------------------------------ a real disk
def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr and "Logging error" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_a_real_full_disk_training_evaluation_and_features(synthetic_root, small_disk, capsys):
    out = small_disk / "runs"
    args = overrides(synthetic_root, out)
    assert train.main(overrides(synthetic_root, out, "train.max_epochs=1")) == 0
    run_dir = os.path.realpath(str(out / "e2e" / "latest"))
    filler = fill(small_disk, 48 * 1024)
    result = run("train.py", *args, "--resume", "auto")
    line = one_error_line(result)
    assert result.returncode == 1 and "cannot write it: the disk is full" in line and "--resume auto" in line
    assert load_checkpoint(os.path.join(run_dir, "checkpoints", "last.pt")).state.epoch == 1
    assert_whole_rows(run_dir)
    os.unlink(filler)
    assert run("train.py", *args, "--resume", "auto").returncode == 0
    assert epochs_of(run_dir) == [1, 2]
    assert_whole_rows(run_dir)

    # eval.py --watch from cron (in this process: the one-line edge is the same as train.py's, tried above): the
    # lock's or the ledger's write fails, the next run evaluates what is missing, once
    experiment = str(out / "e2e")
    for leave, failing in ((0, ".eval.lock"), (4096, "eval.jsonl")):  # a page left: the lock takes it
        filler = fill(small_disk, leave)
        with pytest.raises(DiskFullError, match=rf"{failing}: cannot write it: the disk is full"):
            eval_script.main(["--watch", experiment, "--settle", "0"])
        os.unlink(filler)
    assert eval_script.main(["--watch", experiment, "--settle", "0"]) == 0
    ledger = [json.loads(line) for line in open(os.path.join(experiment, "eval.jsonl"))]
    assert len({entry["sha256"] for entry in ledger}) == len(ledger) >= 2
    assert eval_script.main(["--watch", experiment, "--settle", "0"]) == 0
    assert "0 evaluated, 0 failed, " in capsys.readouterr().out

    # --features: a file that cannot be written is not taken as done; the rerun writes it, the next skips it
    features = str(small_disk / "features")
    command = [
        "--checkpoint",
        os.path.join(run_dir, "checkpoints", "best.pt"),
        "--input",
        os.path.join(synthetic_root, "long.jsonl"),
        "--chunk",
        "4",
        "--overlap",
        "0",
        "--features",
        features,
    ]
    filler = fill(small_disk, 0)
    with pytest.raises(DiskFullError, match=r"\.npz: cannot write it: the disk is full"):
        infer_chunked.main(command)
    assert not os.listdir(features)  # no partial file, no temporary
    os.unlink(filler)
    capsys.readouterr()
    infer_chunked.main(command)
    assert "1 done, 0 skipped" in capsys.readouterr().out
    infer_chunked.main(command)
    assert "0 done, 1 skipped" in capsys.readouterr().out


def test_loaders_leave_no_stall_folder_behind(synthetic_root, tmp_path, monkeypatch):
    """Loaders with a sample deadline make a folder for the workers' stall reports: the run removes it when its
    loaders go (and at exit, errors included), and removes those that dead runs left."""
    import gc
    import tempfile

    stale = os.path.join(tempfile.gettempdir(), "longvideo-stalls-999999999-abcdefgh")  # a pid no process has
    os.makedirs(stale, exist_ok=True)
    # this process's folders only: other test processes running at the same time make their own
    mine = os.path.join(tempfile.gettempdir(), f"longvideo-stalls-{os.getpid()}-*")
    before = set(glob.glob(mine))
    import engine.data.loaders

    made = []
    monkeypatch.setattr(
        engine.data.loaders, "process_temp_dir", lambda prefix: made.append(process_temp_dir(prefix)) or made[-1]
    )
    args = overrides(synthetic_root, tmp_path / "runs", "train.max_epochs=1", "data.sample_timeout_s=60")
    assert train.main(args + ["--stop-after-steps", "1"]) == 0
    assert len(made) == 2 and not os.path.exists(stale)  # the training and the validation loader's
    gc.collect()
    after = set(glob.glob(mine))
    assert not any(os.path.exists(path) for path in made) and after <= before


# ------------------------------------------------------------------------------------------------ the disk plan
def test_training_states_the_disk_it_needs_and_warns_when_it_is_short(
    synthetic_root, tmp_path, monkeypatch, caplog, capsys
):
    import logging
    import re

    import planner.disk

    args = overrides(synthetic_root, tmp_path / "runs", "train.max_epochs=1", "train.keep_last_k=4")
    monkeypatch.setattr(planner.disk, "free_bytes", lambda path: 2**20)  # 1 MB free
    with caplog.at_level(logging.INFO, logger="longvideo"):
        assert train.main(args + ["--stop-after-steps", "1"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("disk: ")]
    planned = re.match(
        r"disk: the run needs about (\d+) MB \(7 checkpoints of ([\d.]+) MB, the one being written "
        r"included, and ([\d.]+) MB of logs and plots\) under .*runs \(1 MB free\)$",
        lines[0],
    )
    assert planned, lines
    saved = os.path.getsize(glob.glob(str(tmp_path / "runs" / "e2e" / "2*" / "checkpoints" / "last.pt"))[0])
    assert saved / 2**20 <= float(planned.group(2)) <= saved / 2**20 + 0.3  # the estimate holds the real one
    assert lines[1] == (
        f"disk: {tmp_path / 'runs'} has 1 MB free, less than the {planned.group(1)} MB this run "
        f"still needs: free space there, lower train.keep_last_k (4), or set trainer.output_dir to "
        f"a larger disk"
    )
    assert train.main(args + ["--probe-memory"]) == 0
    assert re.search(r"^disk: the run needs about \d+ MB \(7 checkpoints", capsys.readouterr().out, re.M)
