"""Checkpoints a user hands us: refused in one line of our own words with the way out (artifacts/checkpoint.py,
artifacts/trained_model.py), and a --resume from outside a run directory (artifacts/run_dir.py)."""

import os
import shutil

import numpy as np
import pytest
import torch
from conftest import overrides, run_in_process

import train
from artifacts.checkpoint import CHECKPOINT_FORMAT, CheckpointError, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resume_from_a_checkpoint_outside_a_run_directory_starts_a_new_one(trained_run, synthetic_root, tmp_path):
    run_dir, _ = trained_run
    users = tmp_path / "somewhere" / "models"
    users.mkdir(parents=True)
    shutil.copy(os.path.join(run_dir, "checkpoints", "epoch_0001.pt"), users / "best.pt")
    before = sorted(os.listdir(tmp_path / "somewhere"))
    args = overrides(synthetic_root, tmp_path / "runs", "infer.chunk_size=4", "infer.chunk_overlap=1")
    assert train.main(args + ["--resume", str(users / "best.pt")]) == 0
    assert sorted(os.listdir(tmp_path / "somewhere")) == before == ["models"]  # nothing written beside it
    assert os.listdir(users) == ["best.pt"]
    new_run = os.path.realpath(tmp_path / "runs" / "e2e" / "latest")
    assert load_checkpoint(os.path.join(new_run, "checkpoints", "last.pt")).state.epoch == 2


def test_a_pickled_checkpoint_refusal_gives_no_unsafe_advice_and_no_colour_codes(tmp_path):
    import argparse

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": argparse.Namespace(run="code")}, path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(path))
    message = str(info.value)
    assert "weights_only=False" not in message and "\x1b" not in message and "\n" not in message
    assert "argparse.Namespace" in message  # the reason: which global it would have had to import


def test_checkpoint_and_pretrained_messages_say_what_to_do(trained_run, tmp_path):
    run_dir, _ = trained_run
    data = open(os.path.join(run_dir, "checkpoints", "last.pt"), "rb").read()
    (tmp_path / "torn.pt").write_bytes(data[: len(data) // 3])
    with pytest.raises(
        CheckpointError,
        match=r"; use another checkpoint of the run \(last\.pt, best\.pt, "
        r"epoch_N\.pt\)$",
    ):
        load_checkpoint(str(tmp_path / "torn.pt"))
    from models.pretrained import PretrainedError, _read

    with pytest.raises(
        PretrainedError,
        match=r"file not found; give a weights file that exists, true for "
        r"torchvision's download, or null$",
    ):
        _read(str(tmp_path / "nothing.pth"))
    (tmp_path / "text.pth").write_text("not weights")
    with pytest.raises(PretrainedError, match=r"; give a state dict of tensors .*, or null$"):
        _read(str(tmp_path / "text.pth"))


@pytest.mark.parametrize("found, age", [(99, "a newer"), (1, "an older"), (None, "an older")])
def test_a_checkpoint_of_another_format_is_refused_with_the_way_out(tmp_path, found, age):
    saved = {"model": {}} if found is None else {"format": found, "model": {}}
    torch.save(saved, str(tmp_path / "other.pt"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(tmp_path / "other.pt"))
    assert str(info.value) == (
        f"{tmp_path / 'other.pt'}: checkpoint format {found or 0}, written by {age} version of this project "
        f"(this one reads format {CHECKPOINT_FORMAT}); evaluate or resume it with the version that wrote it, "
        f"or train again with this one"
    )


def bad_checkpoint(tmp_path, kind: str) -> str:
    path = str(tmp_path / f"{kind}.pt")
    if kind == "pickled":  # a class no safe loader allows
        torch.save({"format": CHECKPOINT_FORMAT, "model": {}, "dtype": np.float64}, path)
    elif kind == "protocol4":  # torch 2.15 warns on it (a UserWarning with a site-packages path), then refuses it
        torch.save({"format": CHECKPOINT_FORMAT, "model": {"w": torch.zeros(2)}}, path, pickle_protocol=4)
    elif kind == "truncated":
        torch.save({"format": CHECKPOINT_FORMAT, "model": {"w": torch.zeros(1000)}}, path)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 3])
    else:  # a torch file, but not a checkpoint of this project
        torch.save({"weights": torch.zeros(2)}, path)
    return path


@pytest.mark.parametrize(
    "kind, words",
    [
        (
            "pickled",
            "refused: the file needs pickled code to load (it names numpy.float64, which is not a tensor or a "
            "plain value)",
        ),
        ("protocol4", "refused: the file needs pickled code to load"),
        ("truncated", "not a readable checkpoint (truncated or corrupt?): not a complete zip archive"),
        ("wrong-format", "not a checkpoint of this project (no 'model' entry)"),
    ],
)
def test_a_bad_checkpoint_is_one_line_of_our_own_words_on_stderr(tmp_path, kind, words):
    path = bad_checkpoint(tmp_path, kind)
    result = run_in_process(["eval.py", "--checkpoint", path])
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {path}: {words}")
    for torch_text in (
        "Please file an issue",
        "WeightsUnpickler",
        "site-packages",
        "Warning",
        "weights_only` ",
        "PytorchStreamReader",
        "miniz",
        "add_safe_globals",
    ):
        assert torch_text not in result.stderr
