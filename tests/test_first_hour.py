"""The first hour of a new user: the headline commands fail fast where they cannot work, and a run leaves what a
researcher looks at (train.log, timed metrics, memory rows, the split in eval.jsonl)."""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import train
from config import ConfigError, load_config
from conftest import overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_gpu_preset_without_cuda_stops_at_once_with_the_way_out(monkeypatch):
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        train.main(["--config", "configs/rtx5080.yaml", "--use_amp"])
    assert str(info.value) == ("configs/rtx5080.yaml: this machine has no CUDA device, and the preset is for a 16 GB "
                               "GPU (trainer.memory_budget_gb); use configs/cpu.yaml, or add --device cpu to run it "
                               "on the CPU anyway")
    train.refuse_gpu_preset_without_cuda(load_config("configs/rtx5080.yaml"), "x", "cpu")  # --device cpu: allowed
    train.refuse_gpu_preset_without_cuda(load_config("configs/cpu.yaml"), "x", None)  # a CPU preset: allowed


def test_use_amp_without_cuda_says_what_it_does(caplog):
    from runtime import resolve_precision
    with caplog.at_level("WARNING", logger="longvideo"):
        assert resolve_precision("amp", train.torch.device("cpu")) == "bf16"
    assert "precision amp (--use_amp) without CUDA: bf16 autocast on the CPU" in caplog.text


def test_dataloader_workers_are_capped_to_the_cores(monkeypatch, caplog):
    monkeypatch.setattr(train, "available_cores", lambda: 2)
    data = {"num_workers": 8}
    with caplog.at_level("INFO", logger="longvideo"):
        train.cap_workers(data)
    assert data["num_workers"] == 2
    assert "data.num_workers=8 but this machine has 2 CPU cores: using 2 DataLoader workers" in caplog.text


def test_ctrl_c_saves_last_pt_says_how_to_resume_and_exits_130(synthetic_root, tmp_path):
    args = overrides(synthetic_root, tmp_path, "trainer.max_epochs=200", "data.num_workers=2")
    process = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:  # wait until it trains
        lines.append(line)
        if " step 3 " in line:
            break
    start = time.monotonic()
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 130
    assert time.monotonic() - start < 20
    output = "".join(lines) + rest
    assert "interrupted at epoch 1, step " in output and "--resume auto" in output
    last = os.path.join(tmp_path, "e2e", "latest", "checkpoints", "last.pt")
    assert os.path.exists(last)
    resumed = subprocess.run([sys.executable, "train.py", *overrides(synthetic_root, tmp_path, "trainer.max_epochs=1"),
                              "--resume", "auto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_a_run_leaves_its_log_timed_metrics_and_memory_rows(synthetic_root, tmp_path):
    assert train.main(overrides(synthetic_root, tmp_path, "train.log_every=1000")) == 0
    run_dir = os.path.join(tmp_path, "e2e", "latest")
    log_lines = open(os.path.join(run_dir, "train.log")).read().splitlines()
    assert any(" INFO epoch 2/2: train_loss" in line for line in log_lines)
    assert all(line[:4].isdigit() and line[4] == "-" for line in log_lines)  # timestamped
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["time"] and float(r["elapsed_s"]) > 0 for r in rows), [(r.get("time"), r.get("elapsed_s")) for r in rows]
    assert float(rows[1]["elapsed_s"]) >= float(rows[0]["elapsed_s"])
    with open(os.path.join(run_dir, "memory.csv")) as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["1", "2"]  # one a epoch though log_every is 1000


def test_a_run_without_a_checkpoint_never_becomes_latest(synthetic_root, tmp_path):
    assert train.main(overrides(synthetic_root, tmp_path) + ["--stop-after-steps", "1"]) == 0
    first = os.path.realpath(os.path.join(tmp_path, "e2e", "latest"))
    cfg = load_config(None, overrides(synthetic_root, tmp_path)[3::2])
    runtime = train.setup_runtime(cfg["trainer"])
    trainer, _, _ = train.build_trainer(cfg, runtime)  # made its run directory, then "killed": no checkpoint
    assert os.path.isdir(trainer.run_dir) and trainer.run_dir != first
    assert os.path.realpath(os.path.join(tmp_path, "e2e", "latest")) == first
    train.log.removeHandler(trainer.log_file)


def test_the_crontab_line_works_before_the_experiment_exists(tmp_path):
    runs = tmp_path / "runs" / "rtx5080"
    line = (f"cd {ROOT} && mkdir -p {runs} && {sys.executable} eval.py --watch {runs} >> {runs}/eval.log 2>&1")
    result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0
    assert (runs / "eval.log").read_text().strip() == f"eval.py --watch {runs}: nothing to evaluate yet (no checkpoint under it)"


def test_eval_jsonl_lines_name_the_evaluated_split(trained_run, tmp_path):
    import shutil
    run_dir, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    result = subprocess.run([sys.executable, "eval.py", "--watch", str(copy), "--settle", "0", "--split", "test"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(t) for t in (copy / "eval.jsonl").read_text().splitlines()]
    assert lines and all(line["split"] == "test" for line in lines)
