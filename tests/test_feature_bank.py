"""train.feature_bank: the training samples' chunk outputs kept between epochs, so a step computes only the chunks
drawn for the gradient (train.grad_chunks); part of the run's state, restored exactly on resume."""

import logging
import os
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import overrides
from test_chunked_training import MEAN, STD, clip_batch
from test_training_loop import NoBatchNorm

import train
from artifacts.checkpoint import load_checkpoint
from config import ConfigError, load_config
from datasets.device_input import DeviceInputs
from engine.inference.chunks import chunk_windows
from engine.training.chunked_forward import ChunkedTrainingForward, ChunkSpec
from engine.training.feature_bank import FeatureBank, bank_file

# 8-frame clips at stride 2 (15 frames) from the 20-frame videos, in 3 chunks, 2 drawn a step
BANK = [
    "train.chunk_train_size=4",
    "train.chunk_train_overlap=1",
    "train.grad_chunks=2",
    "train.feature_bank=host",
    "infer.chunk_size=4",
]


def test_the_bank_gives_a_chunk_only_when_it_holds_it_for_every_clip_of_the_batch(tmp_path):
    bank = FeatureBank(5, [(0, 4), (3, 7)], "host")
    assert bank.read(torch.tensor([0, 1]), 0) is None  # nothing yet
    bank.write(torch.tensor([0, 1]), 0, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(bank.read(torch.tensor([1, 0]), 0), torch.tensor([[3.0, 4.0], [1.0, 2.0]]))
    assert bank.read(torch.tensor([0, 2]), 0) is None  # sample 2 is not in it
    assert bank.read(torch.tensor([0, 1]), 1) is None  # nor chunk 1
    disk = FeatureBank(5, [(0, 4), (3, 7)], "disk", str(tmp_path / "live.npy"))
    disk.write(torch.tensor([4]), 1, torch.tensor([[5.0, 6.0]]))
    assert np.load(tmp_path / "live.npy", mmap_mode="r")[4, 1].tolist() == [5.0, 6.0]  # memory-mapped on disk


def test_a_saved_bank_comes_back_only_with_its_own_step(tmp_path, caplog):
    checkpoint = str(tmp_path / "last.pt")
    bank = FeatureBank(3, [(0, 4)], "host")
    bank.write(torch.tensor([0, 2]), 0, torch.tensor([[1.0], [2.0]]))
    bank.save(checkpoint, step=7)
    assert os.path.exists(bank_file(checkpoint)) and bank_file(checkpoint).endswith("last.bank.npz")
    restored = FeatureBank(3, [(0, 4)], "host")
    restored.restore(checkpoint, step=7)
    np.testing.assert_array_equal(restored.values, bank.values)  # NaN where nothing was written, too
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        for step, windows, name in ((8, [(0, 4)], "last.pt"), (7, [(0, 4), (3, 7)], "last.pt"), (7, [(0, 4)], "x.pt")):
            other = FeatureBank(3, windows, "host")
            other.restore(str(tmp_path / name), step)
            assert other.values is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(line.endswith("so this resume is not bit-exact") for line in lines)
    assert "its bank is of step 7, not 8" in lines[0]
    assert "its bank holds 3 samples x 1 chunks, this run 3 x 2" in lines[1]
    assert "x.bank.npz is missing" in lines[2]


def test_with_the_bank_a_step_computes_only_the_drawn_chunks_once_the_bank_holds_the_others():
    """4 chunks, 2 drawn, every chunk recomputed: the first step computes all 4 (the bank is empty) and
    recomputes the 2 drawn ones; the next step on the same clips reads the other 2 and runs 2 + 2 forwards. The
    outputs read are those written."""
    model = NoBatchNorm()
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    inputs, samples = device_inputs.transfer(clip_batch(length=16)), torch.tensor([3, 0])
    bank = FeatureBank(4, chunk_windows(16, 4, 0), "host")
    forward = ChunkedTrainingForward(model, device_inputs.normalize, bank=bank).train()
    first = forward(inputs, ChunkSpec(4, 0, grad_chunks=2, draw=1), samples)
    first.chunks.mean().backward()
    assert len(model.chunk_lengths) == 4 + 2 and bank.reads == 0 and bank.writes == 4
    model.chunk_lengths.clear()
    spec = ChunkSpec(4, 0, grad_chunks=2, draw=2)
    second = forward(inputs, spec, samples)
    second.chunks.mean().backward()
    assert len(model.chunk_lengths) == 2 + 2 and bank.reads == 2
    for chunk in set(range(4)) - set(spec.graph_chunks(4)):  # read: the first step's outputs (the weights unchanged)
        torch.testing.assert_close(second.chunks[:, chunk], first.chunks[:, chunk])


def test_a_shorter_chunk_from_the_back_off_starts_the_bank_again(caplog):
    model = NoBatchNorm()
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    inputs, samples = device_inputs.transfer(clip_batch(length=16)), torch.tensor([0, 1])
    bank = FeatureBank(2, chunk_windows(16, 8, 0), "host")
    forward = ChunkedTrainingForward(model, device_inputs.normalize, bank=bank).train()
    forward(inputs, ChunkSpec(8, 0, grad_chunks=1), samples)
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        forward(inputs, ChunkSpec(4, 0, grad_chunks=1), samples)
    assert "the chunk grid changed (4 chunks a clip, was 2), so the bank starts empty" in caplog.text
    assert bank.chunks == 4 and bank.values.shape[:2] == (2, 4)


@pytest.mark.parametrize(
    "change, message",
    [
        (["train.grad_chunks=all"], "train.feature_bank serves the chunks without a gradient"),
        (["data.features_dir=/nowhere"], "data.features_dir trains on features already written"),
        (["data.augment=true"], "but data.augment is on (random crop, flip, colour jitter); set data.augment: false"),
        (["data.num_frames=-1"], "but data.num_frames is -1 (clips as long as their windows)"),
    ],
)
def test_a_bank_that_cannot_serve_is_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        load_config(None, [*BANK, *change])
    assert "\n" not in str(error.value) and "train.feature_bank" in str(error.value)


def test_with_the_bank_each_training_clip_is_the_same_frames_every_epoch(synthetic_root, tmp_path):
    """20-frame videos, clips spanning 15 frames: without the bank each epoch places the clip anywhere in its
    window; with it, where evaluation places it (centred)."""
    from engine.data.loaders import build_data

    placed = {}
    for bank in (False, True):
        cfg = load_config(None, overrides(synthetic_root, tmp_path, *BANK)[3::2])
        train_set = build_data(cfg)[0]
        train_set.fixed_clips = bank
        placed[bank] = []
        for epoch in range(4):
            train_set.set_epoch(epoch)
            placed[bank].append(tuple(int(train_set[i]["frame_indices"][0]) for i in range(6)))
    assert len(set(placed[False])) > 1  # at random, epoch by epoch
    assert len(set(placed[True])) == 1 and placed[True][0] == (2,) * 6  # centred: (20 - 15) // 2


def test_resume_with_the_bank_is_exact_and_without_it_says_it_is_not(synthetic_root, tmp_path, caplog):
    """From epoch_0001.pt and its bank, put in a fresh run: the same final weights as the uninterrupted run (a
    temporal head over the chunks). The same without the bank's copy: one line says this resume is not
    bit-exact, and the bank is rebuilt."""
    extra = [*BANK, "train.max_epochs=3", "train.keep_last_k=3", "model.temporal_head=transformer"]
    assert train.main(overrides(synthetic_root, tmp_path / "reference", *extra)) == 0
    checkpoints = os.path.join(tmp_path, "reference", "e2e", "latest", "checkpoints")
    reference = load_checkpoint(os.path.join(checkpoints, "last.pt"))
    for with_bank in (True, False):
        resumed_dir = tmp_path / f"resumed_{with_bank}" / "e2e" / "run"
        os.makedirs(resumed_dir / "checkpoints")
        shutil.copy(os.path.join(checkpoints, "epoch_0001.pt"), resumed_dir / "checkpoints" / "last.pt")
        if with_bank:
            shutil.copy(os.path.join(checkpoints, "epoch_0001.bank.npz"), resumed_dir / "checkpoints" / "last.bank.npz")
        shutil.copy(os.path.join(checkpoints, "..", "config.yaml"), resumed_dir / "config.yaml")
        os.symlink("run", tmp_path / f"resumed_{with_bank}" / "e2e" / "latest")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="longvideo"):
            args = overrides(synthetic_root, tmp_path / f"resumed_{with_bank}", *extra) + ["--resume", "auto"]
            assert train.main(args) == 0
        resumed = load_checkpoint(str(resumed_dir / "checkpoints" / "last.pt"))
        assert resumed.state.global_step == reference.state.global_step
        same = all(torch.equal(resumed.model[k], v) for k, v in reference.model.items())
        assert same == with_bank
        assert ("so this resume is not bit-exact" in caplog.text) == (not with_bank)


def test_disk_storage_trains_exactly_as_host_storage(synthetic_root, tmp_path):
    runs = {}
    for storage in ("host", "disk"):
        assert train.main(overrides(synthetic_root, tmp_path / storage, *BANK, f"train.feature_bank={storage}")) == 0
        run = os.path.join(tmp_path, storage, "e2e", "latest")
        runs[storage] = load_checkpoint(os.path.join(run, "checkpoints", "last.pt")).model
        assert os.path.exists(os.path.join(run, "feature_bank.npy")) == (storage == "disk")
        assert os.path.exists(os.path.join(run, "checkpoints", "epoch_0002.bank.npz"))
    for key, value in runs["host"].items():
        assert torch.equal(runs["disk"][key], value), key
