"""eval.py --watch: each checkpoint once, a lock against concurrent runs, half-written and corrupt files."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import run_in_process

import core.files
import eval as eval_script
from artifacts.ledger import append_ledger

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def experiment(trained_run, tmp_path):
    """runs/<experiment>/<run>/checkpoints/ with the trained run's epoch checkpoints, settled in the past."""
    run_dir, _ = trained_run
    checkpoints = tmp_path / "exp" / "run1" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in ("epoch_0001.pt", "epoch_0002.pt"):
        shutil.copy(os.path.join(run_dir, "checkpoints", name), checkpoints / name)
    os.symlink("run1", tmp_path / "exp" / "latest")
    age(checkpoints / "epoch_0001.pt", 120)
    age(checkpoints / "epoch_0002.pt", 60)
    return tmp_path / "exp"


def age(path, seconds):
    past = time.time() - seconds
    os.utime(path, (past, past))


def watch(experiment, *flags):
    return eval_script.main(["--watch", str(experiment), "--split", "val", "--chunk", "4", "--overlap", "1", *flags])


def ledger(experiment):
    return [json.loads(line) for line in (experiment / "eval.jsonl").read_text().splitlines()]


def test_each_checkpoint_is_evaluated_once_oldest_first(experiment, capsys):
    assert watch(experiment) == 0
    assert capsys.readouterr().out.strip().endswith("2 evaluated, 0 failed, 0 already done, 0 left for the next run")
    first = ledger(experiment)
    assert [e["checkpoint"] for e in first] == ["run1/checkpoints/epoch_0001.pt", "run1/checkpoints/epoch_0002.pt"]
    assert [e["epoch"] for e in first] == [1, 2] and all(e["status"] == "ok" for e in first)
    assert {"sha256", "metrics", "seconds", "time", "global_step"} <= set(first[0])
    metrics = first[0]["metrics"]
    clips, accuracy = metrics["num_clips"], metrics["clip_acc"]
    assert clips > 0 and abs(round(accuracy * clips) - accuracy * clips) < 1e-3  # k of n clips
    assert watch(experiment) == 0  # the latest link does not make them count twice
    assert capsys.readouterr().out.strip().endswith("0 evaluated, 0 failed, 2 already done, 0 left for the next run")
    assert ledger(experiment) == first


def test_a_rewritten_checkpoint_is_evaluated_again(experiment):
    assert watch(experiment) == 0
    target = experiment / "run1" / "checkpoints" / "epoch_0001.pt"
    shutil.copy(experiment / "run1" / "checkpoints" / "epoch_0002.pt", target)
    data = bytearray(target.read_bytes())
    shutil.copy(experiment / "run1" / "checkpoints" / "epoch_0002.pt", experiment / "run1" / "checkpoints" / "last.pt")
    age(target, 30)
    age(experiment / "run1" / "checkpoints" / "last.pt", 30)
    assert watch(experiment) == 0
    # epoch_0001.pt now holds epoch 2's bytes, already evaluated; last.pt likewise: no new evaluation
    assert len(ledger(experiment)) == 2
    from artifacts.checkpoint import load_checkpoint, save_checkpoint

    ckpt = load_checkpoint(str(target))
    ckpt.state.global_step = 999  # new content under an old name
    save_checkpoint(ckpt, str(target))
    age(target, 30)
    assert bytes(data) != target.read_bytes()
    assert watch(experiment) == 0
    assert [e["global_step"] for e in ledger(experiment)][-1] == 999


def test_half_written_and_temporary_files_are_left_for_later(experiment, capsys):
    checkpoints = experiment / "run1" / "checkpoints"
    shutil.copy(checkpoints / "epoch_0002.pt", checkpoints / "last.pt")  # just written: mtime now
    (checkpoints / ".last.pt.x1y2.tmp").write_bytes(b"partial")
    assert watch(experiment, "--settle", "30") == 0
    assert capsys.readouterr().out.strip().endswith("2 evaluated, 0 failed, 0 already done, 1 left for the next run")
    assert [e["checkpoint"] for e in ledger(experiment)] == [
        "run1/checkpoints/epoch_0001.pt",
        "run1/checkpoints/epoch_0002.pt",
    ]


def test_corrupt_and_pickled_checkpoints_are_recorded_as_failed_once(experiment, capsys):
    checkpoints = experiment / "run1" / "checkpoints"
    data = (checkpoints / "epoch_0002.pt").read_bytes()
    (checkpoints / "torn.pt").write_bytes(data[: len(data) // 2])
    import argparse

    import torch

    torch.save({"model": {}, "payload": argparse.Namespace(x=1)}, checkpoints / "evil.pt")
    for name in ("torn.pt", "evil.pt"):
        age(checkpoints / name, 10)
    assert watch(experiment) == 1
    failed = {e["checkpoint"]: e["error"] for e in ledger(experiment) if e["status"] == "failed"}
    assert "not a readable checkpoint (truncated or corrupt?)" in failed["run1/checkpoints/torn.pt"]
    assert "refused: the file needs pickled code to load" in failed["run1/checkpoints/evil.pt"]
    capsys.readouterr()
    assert watch(experiment) == 0  # not retried until they change
    assert capsys.readouterr().out.strip().endswith("0 evaluated, 0 failed, 4 already done, 0 left for the next run")


HOLD_LOCK = """
import sys, time
from artifacts.ledger import DirectoryLock
lock = DirectoryLock({directory!r} + "/.eval.lock")
assert lock.acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_concurrent_run_exits_at_once_with_code_0(experiment):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK.format(directory=str(experiment))], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = subprocess.run(
            [sys.executable, "eval.py", "--watch", str(experiment)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0
        assert "another evaluation holds" in result.stdout and f"pid {holder.pid}" in result.stdout
        assert not (experiment / "eval.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # its process is gone: the kernel dropped the lock, the next run takes it over and says so with -v
    assert watch(experiment, "-v") == 0
    assert len(ledger(experiment)) == 2


def test_a_lock_held_past_the_limit_says_who_since_when_and_how_to_clear_it(experiment):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK.format(directory=str(experiment))], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )  # an evaluation stuck for good
    try:
        assert holder.stdout.readline().strip() == "locked"
        time.sleep(1.5)
        command = [sys.executable, "eval.py", "--watch", str(experiment), "--lock-limit", "1"]
        for _ in range(2):  # every run says it, not only the first
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert result.returncode == 1
            line = result.stdout.strip()
            assert (
                f"{experiment / '.eval.lock'} has been held for 0.0 h, longer than --lock-limit 1 s, by pid "
                f"{holder.pid} on " in line
            )
            assert " since 20" in line and f"stuck, stop it (kill {holder.pid})" in line
        # within the limit it is the ordinary overlap of two cron runs: one line, exit 0
        assert subprocess.run(command[:-2], cwd=ROOT, capture_output=True, text=True, timeout=120).returncode == 0
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_file_is_taken_over(experiment, caplog):
    (experiment / ".eval.lock").write_text("pid 999999 on somewhere\n")
    import logging

    with caplog.at_level(logging.INFO, logger="longvideo"):
        assert watch(experiment, "-v") == 0
    assert "took over the lock left by pid 999999 on somewhere" in caplog.text
    assert len(ledger(experiment)) == 2


def test_an_append_interrupted_at_any_point_leaves_the_ledger_valid(experiment, monkeypatch):
    assert watch(experiment) == 0
    before = (experiment / "eval.jsonl").read_bytes()

    def killed(*args):
        raise KeyboardInterrupt  # as if the process died between writing the temp file and renaming it

    monkeypatch.setattr(core.files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        append_ledger(str(experiment / "eval.jsonl"), {"checkpoint": "x", "sha256": "y"})
    assert (experiment / "eval.jsonl").read_bytes() == before
    assert [json.loads(line) for line in before.decode().splitlines()]
    assert not [n for n in os.listdir(experiment) if n.endswith(".tmp")]


def test_watch_a_missing_directory_is_a_usage_error(tmp_path):
    result = run_in_process(
        ["eval.py", "--watch", str(tmp_path / "nope")],
    )
    assert (result.returncode, result.stderr) == (
        2,
        f"error: --watch {tmp_path / 'nope'}: not a directory (expected runs/<experiment> or one run)\n",
    )
