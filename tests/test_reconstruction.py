"""model.chunk_reconstruction: the thumbnail target, which models get the decoder, and its loss in the training step."""

from __future__ import annotations

import pytest
import torch
from test_chunked_training import MEAN, STD, clip_batch, small_model

from config import load_config, saved_config
from datasets.device_input import DeviceInputs
from engine.training.chunked_forward import ChunkedTrainingForward, ChunkSpec
from engine.training.step import label_loss, training_losses
from models.reconstruction import THUMBNAIL, chunk_thumbnail, thumbnail_size
from models.temporal import clip_contrast


def test_a_thumbnail_is_the_mean_colour_of_each_bin_of_time_height_and_width():
    video = torch.randint(0, 256, (2, 3, 8, 6, 4), dtype=torch.uint8)
    thumb = chunk_thumbnail(video).view(2, 3, *THUMBNAIL)
    x = video.float() / 255
    # bin (t, h, w) of 4 x 2 x 2 over 8 x 6 x 4: frames 2t, 2t + 1, rows 3h .. 3h + 2, columns 2w, 2w + 1
    for t, h, w in [(0, 0, 0), (3, 1, 1), (2, 0, 1)]:
        expected = x[:, :, 2 * t : 2 * t + 2, 3 * h : 3 * h + 3, 2 * w : 2 * w + 2].mean(dim=(2, 3, 4))
        assert torch.allclose(thumb[:, :, t, h, w], expected, atol=1e-6)
    views = torch.stack([video, torch.zeros_like(video)], dim=1)  # [B, V, C, T, H, W]: the views averaged
    assert torch.allclose(chunk_thumbnail(views), chunk_thumbnail(video) / 2, atol=1e-6)
    assert chunk_thumbnail(video[:, :, :2]).shape == (2, thumbnail_size())  # fewer frames than bins


def test_the_target_is_each_chunk_against_its_clip_at_one_scale_a_clip():
    thumbs = torch.rand(3, 5, thumbnail_size())
    relative = clip_contrast(thumbs, None)
    assert torch.allclose(relative.mean(dim=1), torch.zeros(3, thumbnail_size()), atol=1e-5)
    assert torch.allclose(relative.pow(2).mean(dim=(1, 2)), torch.ones(3), atol=1e-3)
    # a brighter copy of a clip differs from its mean chunk by as much, relatively: the same target
    assert torch.allclose(clip_contrast(2 * thumbs + 0.1, None), relative, atol=1e-4)
    alike = thumbs[:, :1].expand(-1, 5, -1)  # every chunk the same: nothing to reconstruct
    assert clip_contrast(alike, None).abs().max() < 1e-3  # rounding is not blown up to unit size


@pytest.mark.parametrize(
    "changes, has_decoder",
    [
        ({"temporal_head": "transformer", "chunk_reconstruction": 1}, True),
        ({"temporal_head": "tcn", "chunk_reconstruction": 0.5}, True),
        ({"temporal_head": "transformer"}, False),  # the default: 0
        ({"temporal_head": "transformer", "chunk_reconstruction": 0}, False),
        ({"temporal_head": "none", "chunk_reconstruction": 1}, False),  # no chunk features reach a head
        ({"temporal_head": "transformer", "chunk_reconstruction": 1, "freeze_backbone": "true"}, False),
    ],
)
def test_the_decoder_is_built_where_a_trained_backbone_feeds_a_head(changes, has_decoder):
    assert (small_model(**changes).reconstruction is not None) == has_decoder


def test_a_checkpoint_keeps_the_weight_it_trained_with_whatever_the_default():
    saved = load_config(None, ["model.temporal_head=transformer", "model.chunk_reconstruction=1"]).to_dict()
    assert saved_config(saved).model.chunk_reconstruction == 1.0
    assert (
        load_config(None, []).model.chunk_reconstruction == 0.0
    )  # a new run has none unless asked (docs/long-videos.md)


def test_the_decoder_leaves_every_other_layer_initialized_as_without_it():
    with_decoder = small_model(temporal_head="transformer", chunk_reconstruction=1)
    without = small_model(temporal_head="transformer", chunk_reconstruction=0)
    for name, tensor in without.state_dict().items():
        assert torch.equal(with_decoder.state_dict()[name], tensor), name
    assert {n for n in with_decoder.state_dict() if n not in without.state_dict()} == {
        "reconstruction.decode.weight",
        "reconstruction.decode.bias",
    }


def test_the_training_step_adds_the_weighted_reconstruction_loss_and_trains_the_backbone_by_it():
    model = small_model(temporal_head="transformer", chunk_reconstruction=0.5)
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize).train()
    inputs, spec = device_inputs.transfer(clip_batch(length=24)), ChunkSpec(size=8, overlap=0)
    piece = {"label": torch.tensor([0, 2])}
    cfg = load_config(None, []).train
    torch.manual_seed(0)
    outputs = forward(inputs, spec)
    assert outputs.auxiliary is not None and outputs.auxiliary.dim() == 0
    label, auxiliary = training_losses(outputs, piece, spec, cfg, torch.nn.CrossEntropyLoss())
    assert torch.equal(label, label_loss(outputs, piece, spec, cfg, torch.nn.CrossEntropyLoss()))
    assert auxiliary is outputs.auxiliary

    # by hand: the decoder over the head's input features against each chunk's thumbnail relative to its clip
    features = torch.stack(
        [model.features(device_inputs.normalize({"video": inputs["video"][:, :, s : s + 8]})) for s in (0, 8, 16)], 1
    )
    thumbs = torch.stack([chunk_thumbnail(inputs["video"][:, :, s : s + 8]) for s in (0, 8, 16)], 1)
    centred = thumbs - thumbs.mean(dim=1, keepdim=True)
    target = centred / centred.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
    by_hand = 0.5 * torch.nn.functional.mse_loss(model.reconstruction.decode(features), target)
    assert torch.allclose(outputs.auxiliary, by_hand, atol=1e-4)  # the target divides by its scale + 1e-6

    # its gradient reaches the backbone (the point of it), and without a graph it is not computed
    model.zero_grad(set_to_none=True)
    outputs.auxiliary.backward()
    assert model.rgb.stages[0][0].weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert forward(inputs, spec).auxiliary is None


@pytest.mark.parametrize("weight", [0.5, 0])
def test_an_epoch_s_row_gives_the_label_s_loss_apart_from_the_reconstruction_s(tmp_path, weight):
    """train_loss is what the optimizer minimizes, the label's loss and the reconstruction's together; with the
    reconstruction on, train_label_loss is the label's alone (the at-chance warning judges a head by it), measured
    here against the same forward by hand; without it, the row has no such column."""
    import copy

    from test_training_loop import make_run

    import train

    model = small_model(temporal_head="transformer", chunk_reconstruction=weight)
    run, loader = make_run(model, 4, 1, tmp_path, count=4, **{"train.chunk_train_size": 2})
    batch = next(iter(loader))
    by_hand = ChunkedTrainingForward(copy.deepcopy(model), run.inputs.normalize).train()
    spec = run.chunk_spec()
    outputs = by_hand(run.inputs.transfer({"video": batch["video"]}), spec)  # with a graph: the decoder runs
    label, auxiliary = run.losses(outputs, {"label": batch["label"]}, spec)
    row = train.train_one_epoch(run, loader)  # one batch: the epoch's mean is that batch's
    if weight == 0:
        assert auxiliary is None and "train_label_loss" not in row
        assert row["train_loss"] == pytest.approx(label.item(), rel=1e-5)
        return
    assert auxiliary.item() > 0.1
    assert row["train_label_loss"] == pytest.approx(label.item(), rel=1e-5)
    assert row["train_loss"] == pytest.approx((label + auxiliary).item(), rel=1e-5)


def test_a_clip_of_one_chunk_trains_the_decoder_towards_nothing_so_no_parameter_lacks_a_gradient():
    model = small_model(temporal_head="transformer", chunk_reconstruction=1)
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize).train()
    inputs = device_inputs.transfer(clip_batch(length=8))
    outputs = forward(inputs, ChunkSpec(size=8, overlap=0))
    features = model.features(device_inputs.normalize(inputs))
    assert torch.allclose(outputs.auxiliary, model.reconstruction.decode(features).pow(2).mean(), atol=1e-6)
    outputs.auxiliary.backward()
    assert all(p.grad is not None for p in model.reconstruction.parameters())  # DDP needs every one


def test_evaluation_loads_a_checkpoint_with_a_decoder_as_a_model_without_one(tmp_path):
    """The decoder trains beside the backbone and evaluation never runs it: a checkpoint that holds it loads for
    eval.py and infer_chunked.py as the same model without it (a head trained on features, paired with its
    backbone, never had one: tests/test_two_stage.py runs that pairing)."""
    from artifacts.checkpoint import Checkpoint, save_checkpoint
    from artifacts.trained_model import load_trained_model
    from datasets.shape import DataShape
    from models import build_model

    changes = ["model.width=4", "model.temporal_head=transformer"]
    cfg = load_config(None, [*changes, "model.chunk_reconstruction=1"])
    torch.manual_seed(0)
    trained = build_model(cfg.model, num_classes=3, num_views=1)
    assert trained.reconstruction is not None
    path = str(tmp_path / "best.pt")
    state = trained.state_dict()
    save_checkpoint(Checkpoint(state, cfg.to_dict(), ["a", "b", "c"], DataShape(3)), path)
    loaded = load_trained_model(path, torch.device("cpu")).model
    assert loaded.reconstruction is None
    kept = {k: v for k, v in state.items() if not k.startswith("reconstruction.")}
    assert loaded.state_dict().keys() == kept.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in kept.items())
