"""trainer.tensorboard: with the package installed, every scalar of metrics.csv and memory.csv is also a
TensorBoard event in <run>/tb/, read back here as TensorBoard reads it; without it (auto), nothing changes and
nothing is said; true without it is one config line."""

import csv
import logging
import os

import pytest
from conftest import overrides

import train
from artifacts import tensorboard
from config import ConfigError, load_config


def events(directory: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # the test's reader

    accumulator = EventAccumulator(directory)
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_every_metrics_and_memory_scalar_is_an_event(synthetic_root, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="longvideo"):
        assert train.main(overrides(synthetic_root, tmp_path, "trainer.tensorboard=true")) == 0
    run = os.path.realpath(tmp_path / "e2e" / "latest")
    assert f"TensorBoard events: {run}/tb (tensorboard --logdir {run})" in caplog.text
    found = events(os.path.join(run, "tb"))
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    for key in ("train_loss", "val_video_acc", "lr"):
        assert found[key] == [(int(r["epoch"]), pytest.approx(float(r[key]), rel=1e-6)) for r in rows]
    with open(os.path.join(run, "memory.csv")) as f:
        memory = list(csv.DictReader(f))
    assert [step for step, _ in found["memory/host_rss_mb"]] == [int(r["step"]) for r in memory]


def test_without_the_package_auto_changes_nothing_and_true_is_refused(synthetic_root, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(tensorboard, "available", lambda: False)
    with caplog.at_level(logging.INFO, logger="longvideo"):
        assert train.main(overrides(synthetic_root, tmp_path, "train.max_epochs=1")) == 0
    assert not os.path.exists(tmp_path / "e2e" / "latest" / "tb") and "TensorBoard" not in caplog.text
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "tensorboard" else object())
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.tensorboard=true"])
    assert str(info.value) == (
        "--set trainer.tensorboard=true: trainer.tensorboard: true needs the tensorboard package, which is not "
        "installed; pip install tensorboard, or set trainer.tensorboard: auto"
    )
