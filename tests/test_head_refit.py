"""train.temporal_refit_epochs: the last epochs of a run train a new temporal head on the backbone, frozen; the
schedule starts again for them; a run resumed before or within them ends where the uninterrupted one does; the
settings it cannot go with are refused in one line."""

import csv
import logging
import os
import shutil

import pytest
import torch
from conftest import overrides, quickstart_config

import train
from artifacts.checkpoint import load_checkpoint
from config import ConfigError
from engine.training.optim import build_scheduler
from models import build_model

REFIT_RUN = (  # a small transformer head over chunks of 4 frames, the chunk reconstruction on: 1 epoch, then 2 of refit
    "model.temporal_head=transformer",
    "model.temporal_width=16",
    "model.temporal_dropout=0.3",
    "model.chunk_reconstruction=1.0",
    "train.chunk_train_size=4",
    "infer.chunk_size=4",
    "trainer.max_epochs=3",
    "train.temporal_refit_epochs=2",
    "train.keep_last_k=3",
)


@pytest.fixture(scope="module")
def refit_run(synthetic_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("refit")
    assert train.main(overrides(synthetic_root, out, *REFIT_RUN)) == 0
    run = os.path.join(out, "e2e", "latest")
    epochs = [load_checkpoint(os.path.join(run, "checkpoints", f"epoch_{e:04d}.pt")) for e in (1, 2, 3)]
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    with open(os.path.join(run, "train.log")) as f:
        log = f.read()
    return run, epochs, rows, log


def _part(weights: dict, prefix: str) -> dict:
    return {k: v for k, v in weights.items() if k.startswith(prefix)}


def test_the_refit_epochs_keep_the_backbone_and_train_a_new_head_without_the_reconstruction(refit_run):
    run, (first, second, third), rows, log = refit_run
    assert [c.state.head_refit for c in (first, second, third)] == [False, True, True]
    backbone = _part(first.model, "rgb.")
    assert any(k.endswith("running_mean") for k in backbone)  # BatchNorm statistics are kept too
    for later in (second, third):
        for key, value in backbone.items():
            torch.testing.assert_close(later.model[key], value, rtol=0, atol=0, msg=key)
    # the head trains on: it differs from epoch 1's at epoch 2, and from epoch 2's at epoch 3
    for before, after in ((first, second), (second, third)):
        head = _part(before.model, "temporal.")
        assert any(not torch.equal(after.model[k], v) for k, v in head.items() if v.is_floating_point())
    # the reconstruction shapes the backbone's features: on in the end-to-end epoch, skipped once they are frozen
    losses = [(float(r["train_loss"]), float(r["train_label_loss"])) for r in rows]
    assert losses[0][0] > losses[0][1]
    assert all(total == label for total, label in losses[1:])
    assert "epoch 2: train.temporal_refit_epochs: the backbone frozen as it is" in log


def test_the_new_head_is_a_seeded_new_one_and_the_run_s_random_state_is_left_alone():
    cfg = quickstart_config("model.temporal_head=transformer", "model.temporal_width=16")
    model = build_model(cfg.model, 4)
    with torch.no_grad():
        for p in model.temporal.parameters():
            p.add_(1.0)  # a head that trained
    trained = {k: v.clone() for k, v in model.temporal.state_dict().items()}
    torch.manual_seed(5)
    model.new_temporal_head(seed=0)
    after_first = torch.rand(3)
    first = {k: v.clone() for k, v in model.temporal.state_dict().items()}
    torch.manual_seed(5)
    model.new_temporal_head(seed=0)
    assert torch.equal(torch.rand(3), after_first)  # the global random state as it was
    assert all(torch.equal(model.temporal.state_dict()[k], v) for k, v in first.items())  # the same seed, the same head
    assert any(not torch.equal(first[k], v) for k, v in trained.items() if v.is_floating_point())
    model.freeze_backbone()
    model.train()
    assert not any(p.requires_grad for p in model.rgb.parameters()) and not model.rgb.training
    assert all(p.requires_grad for p in model.temporal.parameters())


def _rates(cfg, steps: int, epochs: int, refit: int = 0) -> list[float]:
    """The learning rate of each step of a run of ``epochs`` of ``steps`` with ``refit`` of them refitting."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    scheduler = build_scheduler(optimizer, cfg.train, steps, epochs, True, refit_epochs=refit)
    seen = []
    for _ in range(steps * epochs):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_the_run_s_first_lines_say_from_which_epoch_the_new_head_trains(caplog):
    from engine.training.build import _log_temporal_head_settings
    from engine.training.optim import build_optimizer

    cfg = quickstart_config("model.temporal_head=transformer", "train.temporal_refit_epochs=4")
    model = build_model(cfg.model, 4)
    with caplog.at_level(logging.INFO, logger="longvideo"):
        _log_temporal_head_settings(build_optimizer(model, cfg.train), cfg.train, 10)
    assert (
        "; from epoch 7 a new head trains on the backbone, frozen, with the warm-up and the schedule again "
        "(train.temporal_refit_epochs 4)\n"
    ) in caplog.text


def test_the_schedule_starts_again_for_the_refit_epochs():
    cfg = quickstart_config("model.temporal_head=transformer", "train.temporal_warmup_epochs=1")
    steps, epochs, refit = 4, 5, 2
    plain, twice = _rates(cfg, steps, epochs), _rates(cfg, steps, epochs, refit)
    start = steps * (epochs - refit)
    assert twice[:steps] == pytest.approx(plain[:steps])  # the same warm-up
    assert twice[:start] == pytest.approx(_rates(cfg, steps, epochs - refit))  # a run of the epochs before
    assert twice[start:] == pytest.approx(_rates(cfg, steps, refit))  # then the whole schedule again


@pytest.mark.parametrize("epoch", [1, 2], ids=["before-the-refit", "within-it"])
def test_a_run_resumed_before_or_within_the_refit_ends_as_the_uninterrupted_one(
    refit_run, synthetic_root, tmp_path, epoch
):
    run, epochs, rows, log = refit_run
    resumed_dir = tmp_path / "e2e" / "run"
    os.makedirs(resumed_dir / "checkpoints")
    shutil.copy(os.path.join(run, "checkpoints", f"epoch_{epoch:04d}.pt"), resumed_dir / "checkpoints" / "last.pt")
    shutil.copy(os.path.join(run, "config.yaml"), resumed_dir / "config.yaml")
    os.symlink("run", tmp_path / "e2e" / "latest")
    assert train.main(overrides(synthetic_root, tmp_path, *REFIT_RUN) + ["--resume", "auto"]) == 0
    resumed = load_checkpoint(str(resumed_dir / "checkpoints" / "last.pt"))
    reference = epochs[-1]
    assert resumed.state.global_step == reference.state.global_step and resumed.state.head_refit
    for key, value in reference.model.items():
        torch.testing.assert_close(resumed.model[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(
    "changes, named",
    [
        (["train.temporal_refit_epochs=2"], "model.temporal_head is none"),
        (["model.temporal_head=transformer", "train.temporal_refit_epochs=2", "model.freeze_backbone=true"], "freeze"),
        (["model.temporal_head=transformer", "train.temporal_refit_epochs=2", "model.adapter=side"], "adapter"),
        (["model.temporal_head=transformer", "train.temporal_refit_epochs=40"], "smaller than trainer.max_epochs"),
        (
            [
                "model.temporal_head=transformer",
                "train.temporal_refit_epochs=2",
                "train.feature_bank=host",
                "train.grad_chunks=2",
                "train.chunk_train_size=8",
                "data.augment=false",
            ],
            "train.feature_bank",
        ),
    ],
)
def test_settings_a_refit_cannot_go_with_are_refused_in_one_line(changes, named):
    with pytest.raises(ConfigError) as info:
        quickstart_config(*changes)
    message = str(info.value)
    assert "train.temporal_refit_epochs" in message and named in message and "\n" not in message


def test_a_refit_under_torchrun_with_the_all_reduce_in_backward_is_refused_before_anything_starts():
    from core.runtime import Runtime
    from engine.training.build import build_trainer

    cfg = quickstart_config(
        "model.temporal_head=transformer", "train.temporal_refit_epochs=2", "train.ddp_sync=during_backward"
    )
    with pytest.raises(ConfigError, match=r"train.temporal_refit_epochs .*; set train.ddp_sync: agreed$"):
        build_trainer(cfg, Runtime(torch.device("cpu"), "32", rank=0, world_size=2))


def test_precise_bn_leaves_the_statistics_of_a_frozen_backbone_alone():
    from engine.training.precise_bn import recomputable_norms

    cfg = quickstart_config("model.temporal_head=transformer")
    model = build_model(cfg.model, 4)
    backbone = {id(m) for m in model.rgb.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    assert backbone and backbone <= {id(m) for m in recomputable_norms(model)}
    model.freeze_backbone()  # as the refit epochs begin; model.freeze_backbone builds it so
    assert not backbone & {id(m) for m in recomputable_norms(model)}
