"""A full disk, met for real (a small tmpfs filled at the moment a writer writes), by each writer beyond the run's
CSVs, log and checkpoints (tests/test_full_disk.py): TensorBoard's events, the feature bank, the allocator snapshot,
MS-TCN's layout, the timeline, training-curve and evaluation-history PNGs and cross-validation's tables. Each ends
in the project's one line naming the file (or, for the optional mirror and the snapshot, one warning while the run
goes on), leaves what was written before whole, and a rerun after space is freed finishes."""

from __future__ import annotations

import glob
import json
import logging
import os
import pickle

import numpy as np
import pytest
from conftest import fill, full_during, overrides
from test_full_disk import epochs_of

import infer_chunked
import train
from artifacts.checkpoint import load_checkpoint
from core.files import DiskFullError


def no_temporary_files(folder) -> bool:
    return not [p for p in glob.glob(os.path.join(folder, "**", ".*"), recursive=True) if p.endswith("tmp")]


def test_tensorboard_on_a_full_disk_turns_off_in_one_warning_and_the_run_finishes(
    synthetic_root, small_disk, monkeypatch, caplog
):
    """A resumed run starts a new event file: its first write needs a new page of the disk, which is full then (an
    append that fits the last page of a file already written needs none; append_whole's all-or-nothing is tested
    in test_full_disk.py)."""
    from test_tensorboard import events

    import artifacts.tensorboard

    out = small_disk / "runs"
    args = overrides(synthetic_root, out, "trainer.tensorboard=true")
    assert train.main(overrides(synthetic_root, out, "trainer.tensorboard=true", "train.max_epochs=1")) == 0
    calls = full_during(monkeypatch, small_disk, artifacts.tensorboard, "append_whole")
    with caplog.at_level(logging.INFO, logger="longvideo"):
        assert train.main(args + ["--resume", "auto"]) == 0
    assert len(calls) == 1  # turned off at its first failed write: the epoch's rows are not mirrored
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard events stop here" in r.getMessage()]
    assert len(warnings) == 1 and "cannot write it: the disk is full" in warnings[0], warnings
    assert os.path.basename(warnings[0].split(":")[0]).startswith("events.out.tfevents.")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    run = os.path.realpath(out / "e2e" / "latest")
    assert epochs_of(run) == [1, 2] and load_checkpoint(os.path.join(run, "checkpoints", "last.pt")).state.epoch == 2
    found = events(os.path.join(run, "tb"))  # the first run's events read back, the failed file added nothing
    assert [step for step, _ in found["train_loss"]] == [1]
    assert len(os.listdir(os.path.join(run, "tb"))) == 1


BANK = ["train.chunk_train_size=4", "train.chunk_train_overlap=1", "train.grad_chunks=2", "train.feature_bank=host"]


def test_the_feature_bank_on_a_full_disk_stops_the_run_in_one_line_and_the_resume_finishes(
    synthetic_root, small_disk, monkeypatch
):
    from engine.training.feature_bank import FeatureBank

    out = small_disk / "runs"
    args = overrides(synthetic_root, out, *BANK, "infer.chunk_size=4")
    full_during(monkeypatch, small_disk, FeatureBank, "save", nth=2)  # epoch 2's, beside its last.pt
    with pytest.raises(DiskFullError) as raised:
        train.main(args)
    monkeypatch.undo()
    assert ".bank.npz: cannot write it: the disk is full" in str(raised.value)
    assert str(raised.value).endswith("--resume auto") and "\n" not in str(raised.value)
    run = os.path.realpath(glob.glob(str(out / "e2e" / "2*"))[0])
    assert no_temporary_files(run)
    banks = glob.glob(os.path.join(run, "checkpoints", "*.bank.npz"))
    assert banks  # epoch 1's, whole
    for bank in banks:
        with np.load(bank) as saved:
            assert int(saved["step"]) > 0 and np.isfinite(saved["values"]).any()
    assert train.main(args + ["--resume", "auto"]) == 0
    assert epochs_of(run) == [1, 2]


def test_the_allocator_snapshot_on_a_full_disk_is_one_warning_and_the_back_off_goes_on(small_disk, monkeypatch, caplog):
    from test_training_loop import NoBatchNorm, make_run

    import train
    from engine.training import oom

    snapshots, fillers = [], []

    def snapshot():  # the disk fills while the second out-of-memory error's snapshot is taken
        snapshots.append(1)
        if len(snapshots) == 2:
            fillers.append(fill(small_disk, 0))
        return {"segments": [b"x" * 4096]}

    monkeypatch.setattr(oom.memory_monitor, "allocator_snapshot", snapshot)
    run, loader = make_run(NoBatchNorm(oom_above=2), 8, 1, small_disk, count=8, **{"trainer.memory_snapshot": "on_oom"})
    run.report.memory_history = True  # as start_memory_history leaves a CUDA run
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        train.train_one_epoch(run, loader)
    os.unlink(fillers[0])
    assert run.state.global_step > 0  # the back-off went on to 2 clips per forward and trained
    failed = [r.getMessage() for r in caplog.records if "is not kept" in r.getMessage()]
    assert failed == [
        f"{small_disk / 'memory_snapshot.pickle'}: cannot write it: the disk is full (0.0 MB free there); the "
        "allocator snapshot of this out-of-memory error is not kept, the run goes on"
    ]
    assert pickle.loads((small_disk / "memory_snapshot.pickle").read_bytes()) == {"segments": [b"x" * 4096]}
    assert no_temporary_files(small_disk)


def test_ms_tcns_layout_on_a_full_disk_stops_in_one_line_and_the_rerun_writes_it(
    trained_run, synthetic_root, small_disk, monkeypatch, capsys
):
    import engine.inference.features

    out = small_disk / "features"
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    args = ["--checkpoint", best, "--input", os.path.join(synthetic_root, "long.jsonl"), "--chunk", "12"]
    args += ["--overlap", "4", "--features", str(out), "--features-layout", "mstcn"]
    full_during(monkeypatch, small_disk, engine.inference.features, "write_video")
    with pytest.raises(DiskFullError, match=r"features/long_\w+\.npy: cannot write it: the disk is full"):
        infer_chunked.main(args)
    monkeypatch.undo()
    assert not glob.glob(str(out / "features" / "*")) and no_temporary_files(out)  # nothing half-written
    capsys.readouterr()
    assert infer_chunked.main(args) in (0, None)
    assert "1 done, 0 skipped" in capsys.readouterr().out
    assert np.load(glob.glob(str(out / "features" / "long_*.npy"))[0]).shape[1] > 0
    assert (out / "mapping.txt").read_text().splitlines()[0].startswith("0 ")


def test_the_timeline_png_on_a_full_disk_stops_in_one_line_and_the_rerun_draws_it(
    trained_run, synthetic_root, small_disk, monkeypatch
):
    import artifacts.timeline_plot

    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    plots = small_disk / "plots"
    args = ["--checkpoint", best, "--input", os.path.join(synthetic_root, "long.jsonl"), "--chunk", "12"]
    args += ["--overlap", "4", "--timeline", "--output", str(small_disk / "out.jsonl"), "--plot", str(plots)]
    full_during(monkeypatch, small_disk, artifacts.timeline_plot, "save_figure")
    with pytest.raises(DiskFullError, match=r"\.png: cannot write it: the disk is full"):
        infer_chunked.main(args)
    monkeypatch.undo()
    assert not glob.glob(str(plots / "*.png")) and no_temporary_files(small_disk)
    assert infer_chunked.main(args) == 0
    assert [os.path.getsize(p) > 1000 for p in glob.glob(str(plots / "*.png"))] == [True]


def test_the_training_curves_on_a_full_disk_stop_in_one_line_and_the_resume_draws_them(
    synthetic_root, small_disk, monkeypatch
):
    import artifacts.plots

    out = small_disk / "runs"
    args = overrides(synthetic_root, out, "train.max_epochs=1", "trainer.plots=true")
    full_during(monkeypatch, small_disk, artifacts.plots, "save_figure")
    with pytest.raises(DiskFullError, match=r"training_curves\.png: cannot write it: the disk is full"):
        train.main(args)
    monkeypatch.undo()
    run = os.path.realpath(glob.glob(str(out / "e2e" / "2*"))[0])
    assert not os.path.exists(os.path.join(run, "training_curves.png")) and no_temporary_files(run)
    assert train.main(args + ["--resume", "auto"]) == 0
    assert epochs_of(run) == [1] and os.path.getsize(os.path.join(run, "training_curves.png")) > 1000


def test_cross_validations_tables_on_a_full_disk_stop_in_one_line_and_the_rerun_writes_them(
    tmp_path, small_disk, monkeypatch, capsys
):
    import engine.evaluation.cross_validation as cross_validation
    import engine.evaluation.fold_runs as fold_runs
    from datasets.segmentation_task import generate_features

    root = str(tmp_path / "mstcn")
    generate_features(root, videos=8, frames=200, splits=2, quiet=True)
    out = small_disk / "cv"
    args = ["--root", root, "--splits", "1", "--out", str(out), "--set", "train.max_epochs=1"]
    full_during(monkeypatch, small_disk, fold_runs, "atomic_write_bytes", nth=2)  # segmentation.json
    with pytest.raises(DiskFullError, match=r"segmentation\.json: cannot write it: the disk is full"):
        cross_validation.main(args)
    monkeypatch.undo()
    assert not os.path.exists(out / "segmentation.json") and no_temporary_files(out)
    assert (out / "segmentation.md").read_text().rstrip().endswith("|")  # written before it, whole
    capsys.readouterr()
    assert cross_validation.main(args) == 0  # the split's finished run is scored again, not trained
    summary = json.loads((out / "segmentation.json").read_text())
    assert set(summary["splits"]) == {"1"} and "F1@50" in summary["mean"]


def test_the_evaluation_history_on_a_full_disk_stops_in_one_line_and_the_next_cron_run_draws_it(
    trained_run, small_disk, monkeypatch, capsys
):
    import shutil

    import artifacts.plots
    import eval as eval_script

    experiment = small_disk / "e2e"
    shutil.copytree(trained_run[0], experiment / "run", symlinks=True)
    full_during(monkeypatch, small_disk, artifacts.plots, "save_figure")
    with pytest.raises(DiskFullError, match=r"eval_history\.png: cannot write it: the disk is full"):
        eval_script.main(["--watch", str(experiment), "--settle", "0", "--plot"])
    monkeypatch.undo()
    ledger = [json.loads(line) for line in open(experiment / "eval.jsonl")]  # each evaluation recorded, whole
    assert ledger and all(entry["status"] == "ok" for entry in ledger)
    assert not os.path.exists(experiment / "eval_history.png") and no_temporary_files(experiment)
    capsys.readouterr()
    assert eval_script.main(["--watch", str(experiment), "--settle", "0", "--plot"]) == 0
    assert "0 evaluated, 0 failed, " in capsys.readouterr().out  # nothing evaluated twice; the plot drawn
    assert os.path.getsize(experiment / "eval_history.png") > 1000
