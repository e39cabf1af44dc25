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
from conftest import overrides, run_in_process

import engine.data.loaders
import train
from config import ConfigError, load_config
from core.logs import detach_log_file
from core.runtime import setup_runtime
from engine.training import build
from engine.training.build import build_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_gpu_preset_without_cuda_stops_at_once_with_the_way_out(monkeypatch):
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        train.main(["--config", "configs/rtx5080.yaml", "--use_amp"])
    assert str(info.value) == (
        "configs/rtx5080.yaml: this machine has no CUDA device, and the preset is for a 16 GB "
        "GPU (trainer.memory_budget_gb); use configs/cpu.yaml, or add --device cpu to run it "
        "on the CPU anyway"
    )
    build.refuse_gpu_preset_without_cuda(load_config("configs/rtx5080.yaml"), "x", "cpu")  # --device cpu: allowed
    build.refuse_gpu_preset_without_cuda(load_config("configs/cpu.yaml"), "x", None)  # a CPU preset: allowed


@pytest.mark.parametrize("asked", ["cuda", "auto", None])
def test_a_single_gpu_run_sets_an_indexed_device(monkeypatch, asked):
    """torch.cuda.set_device refuses a bare "cuda" ("Expected a torch.device with a specified index"): what
    setup_runtime hands it must name the device, as "cuda", "auto" and the preset's own device all mean one GPU."""
    set_to = []
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(train.torch._C, "_cuda_setDevice", set_to.append, raising=False)  # after set_device's check
    cfg = load_config("configs/rtx5080.yaml")
    runtime = setup_runtime(cfg.trainer, device=asked)
    assert runtime.device == train.torch.device("cuda", 0) and set_to == [0]
    assert runtime.precision == "16"


def test_use_amp_without_cuda_says_what_it_does(caplog):
    from core.runtime import resolve_precision

    with caplog.at_level("WARNING", logger="longvideo"):
        assert resolve_precision("amp", train.torch.device("cpu")) == "bf16"
    assert "precision amp (--use_amp) without CUDA: bf16 autocast on the CPU" in caplog.text


def test_dataloader_workers_are_capped_to_the_cores(monkeypatch, caplog):
    monkeypatch.setattr(engine.data.loaders, "available_cores", lambda: 2)
    cfg = load_config(None, ["data.num_workers=8"])
    with caplog.at_level("INFO", logger="longvideo"):
        capped = engine.data.loaders.cap_workers(cfg)
    assert capped.data.num_workers == 2 and cfg.data.num_workers == 8  # a new config, not an edit
    assert "data.num_workers=8 but this machine has 2 CPU cores: using 2 DataLoader workers" in caplog.text


def test_ctrl_c_saves_last_pt_says_how_to_resume_and_exits_130(synthetic_root, tmp_path):
    # a terminal's Ctrl-C: SIGINT to the whole process group, the DataLoader workers included; epochs of 0.1 s,
    # so it often lands while an epoch's workers shut down (where a plain KeyboardInterrupt used to be lost)
    args = overrides(synthetic_root, tmp_path, "train.max_epochs=100000", "data.num_workers=2")
    process = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        lines = []
        for line in process.stdout:  # wait until it trains
            lines.append(line)
            if " step 3 " in line:
                break
        start = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # never leave a training run behind
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130
    assert time.monotonic() - start < 30
    output = "".join(lines) + rest
    assert "interrupted at epoch 1, step " in output and "--resume auto" in output
    last = os.path.join(tmp_path, "e2e", "latest", "checkpoints", "last.pt")
    assert os.path.exists(last)
    resumed = subprocess.run(
        [sys.executable, "train.py", *overrides(synthetic_root, tmp_path, "train.max_epochs=1"), "--resume", "auto"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_a_run_leaves_its_log_timed_metrics_and_memory_rows(synthetic_root, tmp_path):
    assert train.main(overrides(synthetic_root, tmp_path, "trainer.log_every=1000")) == 0
    run_dir = os.path.join(tmp_path, "e2e", "latest")
    log_lines = open(os.path.join(run_dir, "train.log")).read().splitlines()
    assert any(" INFO epoch 2/2: train_loss" in line for line in log_lines)
    assert all(line[:4].isdigit() and line[4] == "-" for line in log_lines)  # timestamped
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["time"] and float(r["elapsed_s"]) > 0 for r in rows), [
        (r.get("time"), r.get("elapsed_s")) for r in rows
    ]
    assert float(rows[1]["elapsed_s"]) >= float(rows[0]["elapsed_s"])
    with open(os.path.join(run_dir, "memory.csv")) as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["1", "2"]  # one a epoch though log_every is 1000


def test_a_run_without_a_checkpoint_never_becomes_latest(synthetic_root, tmp_path):
    assert train.main(overrides(synthetic_root, tmp_path) + ["--stop-after-steps", "1"]) == 0
    first = os.path.realpath(os.path.join(tmp_path, "e2e", "latest"))
    cfg = load_config(None, overrides(synthetic_root, tmp_path)[3::2])
    runtime = setup_runtime(cfg.trainer)
    run, _, _ = build_run(cfg, runtime)  # made its run directory, then "killed": no checkpoint
    assert os.path.isdir(run.directory.path) and run.directory.path != first
    assert os.path.realpath(os.path.join(tmp_path, "e2e", "latest")) == first
    detach_log_file(run.report.log_file)


def test_the_crontab_line_works_before_the_experiment_exists(tmp_path):
    runs = tmp_path / "runs" / "rtx5080"
    line = f"cd {ROOT} && mkdir -p {runs} && {sys.executable} eval.py --watch {runs} >> {runs}/eval.log 2>&1"
    result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0
    assert (
        runs / "eval.log"
    ).read_text().strip() == f"eval.py --watch {runs}: nothing to evaluate yet (no checkpoint under it)"


def test_eval_jsonl_lines_name_the_evaluated_split(trained_run, tmp_path):
    import shutil

    run_dir, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    result = run_in_process(
        ["eval.py", "--watch", str(copy), "--settle", "0", "--split", "test"],
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(t) for t in (copy / "eval.jsonl").read_text().splitlines()]
    assert lines and all(line["split"] == "test" for line in lines)


def test_a_gpu_preset_does_not_fall_back_to_the_demo_data(monkeypatch):
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as info:
        train.main(["--config", "configs/rtx5080.yaml"])
    assert str(info.value).startswith(
        "configs/rtx5080.yaml: data.data_dir is not set, and a GPU preset does not "
        "fall back to the demo's data/synthetic: add --set data.data_dir=DIR (the folder of your manifests"
    )
    assert "root/<class>/<video>" in str(info.value)
    origins = {}
    cfg = load_config("configs/rtx5080.yaml", ["data.data_dir=/data/clips"], origins=origins)
    build.refuse_demo_data_for_gpu_preset(cfg, origins, "configs/rtx5080.yaml")  # set: accepted


def test_a_missing_manifest_names_its_key_and_the_accepted_forms(tmp_path):
    from datasets.manifest import ManifestError
    from datasets.records import training_records

    data = load_config(None, [f"data.data_dir={tmp_path}"]).data
    with pytest.raises(ManifestError) as info:
        training_records(data)
    assert str(info.value) == (
        f"{tmp_path}/train.jsonl: not found (data.train_manifest, resolved against "
        f'data.data_dir={tmp_path}); give a JSONL manifest ({{"video": "videos/a.mp4", '
        f'"label": "left"}} a line), a CSV with video,label columns, or a folder '
        f"root/<class>/<video>"
    )


def test_val_fraction_splits_the_videos_the_same_way_every_run(synthetic_root, caplog):
    from datasets.records import training_records

    data = load_config(None, [f"data.data_dir={synthetic_root}", "data.val_fraction=0.3"]).data
    train_a, val_a = training_records(data)
    train_b, val_b = training_records(data)
    assert [r.first_path for r in val_a] == [r.first_path for r in val_b] and val_a and train_a
    assert not {r.first_path for r in train_a} & {r.first_path for r in val_a}
    assert len(train_a) + len(val_a) == 18
    same = load_config(None, [f"data.data_dir={synthetic_root}", "data.val_manifest=train.jsonl"]).data
    with caplog.at_level("WARNING", logger="longvideo"):
        training_records(same)
    assert "data.val_manifest and data.train_manifest are the same data" in caplog.text


def test_infer_reads_the_class_folder_layout_and_says_which_checkpoint_and_why(trained_run, synthetic_root, tmp_path):
    import shutil

    run_dir, runs = trained_run
    records = [json.loads(t) for t in open(os.path.join(synthetic_root, "test.jsonl")).read().splitlines()][:4]
    for record in records:  # root/<class>/<video>, the layout training accepts
        os.makedirs(tmp_path / "clips" / record["label"], exist_ok=True)
        shutil.copy(os.path.join(synthetic_root, record["video"]), tmp_path / "clips" / record["label"])
    (tmp_path / "preset.yaml").write_text(
        f"base: {os.path.join(ROOT, 'configs', 'base.yaml')}\nexperiment: e2e\ntrainer:\n  output_dir: {runs}\n"
    )
    result = run_in_process(
        [
            "infer_chunked.py",
            "--config",
            str(tmp_path / "preset.yaml"),
            "--input",
            str(tmp_path / "clips"),
            "--chunk",
            "8",
            "--overlap",
            "0",
        ],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        f"checkpoint: {runs}/e2e/latest/checkpoints/best.pt (the latest run of "
        f"experiment 'e2e' ({tmp_path / 'preset.yaml'}))"
    )
    assert "(true: " in result.stdout and "accuracy: " in result.stdout  # labels from the folders
