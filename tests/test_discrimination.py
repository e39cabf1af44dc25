"""model.chunk_discrimination: the half-frame-rate pairs, the loss, which models get it, and its part in the
training step (recomputed, sampled chunks, BatchNorm statistics, the planner)."""

from __future__ import annotations

import pytest
import torch
from test_chunked_training import MEAN, STD, clip_batch, small_model

from config import ConfigError, load_config
from datasets.device_input import InputPreparer
from engine.inference.chunks import half_frame_rate
from engine.training.chunked_forward import ChunkedTrainingForward, ChunkSpec
from models.discrimination import pair_discrimination


def test_the_halves_are_the_even_and_the_odd_frames_of_every_input():
    video = torch.arange(2 * 3 * 5 * 2 * 2).view(2, 3, 5, 2, 2)
    views = torch.stack([video, video + 1000], dim=1)  # [B, V, C, T, H, W]
    kpt = torch.arange(2 * 5 * 4 * 2).view(2, 5, 4, 2).float()
    even = half_frame_rate({"video": video, "kpt": kpt}, 0)
    odd = half_frame_rate({"video": views, "kpt": kpt}, 1)
    assert torch.equal(even["video"], video[:, :, [0, 2, 4]]) and torch.equal(even["kpt"], kpt[:, [0, 2, 4]])
    assert torch.equal(odd["video"], views[:, :, :, [1, 3]]) and torch.equal(odd["kpt"], kpt[:, [1, 3]])
    # a backbone that needs more frames gets the last one repeated, as slice_time pads a short chunk
    padded = half_frame_rate({"video": video}, 1, min_frames=4)["video"]
    assert torch.equal(padded, video[:, :, [1, 3, 3, 3]])


def test_the_loss_is_low_for_true_pairs_high_for_shuffled_ones_and_zero_without_negatives():
    generator = torch.Generator().manual_seed(0)
    first = torch.randn(6, 16, generator=generator)
    second = first + 0.1 * torch.randn(6, 16, generator=generator)
    matched = pair_discrimination(first, second, 0.2)
    shuffled = pair_discrimination(first, second[[1, 2, 3, 4, 5, 0]], 0.2)
    assert matched < 0.05 < 3 < shuffled
    # by hand: the cross-entropy of each row's pair among the cosine similarities over the temperature, both ways
    a, b = torch.nn.functional.normalize(first, dim=1), torch.nn.functional.normalize(second, dim=1)
    similarity = a @ b.T / 0.5
    by_hand = (
        -(similarity.diag() - similarity.logsumexp(1)).mean() / 2
        - (similarity.diag() - similarity.logsumexp(0)).mean() / 2
    )
    assert torch.allclose(pair_discrimination(first, second, 0.5), by_hand, atol=1e-5)
    assert pair_discrimination(first[:1], second[:1] * 3, 0.2) == 0  # one chunk: nothing to tell it from


@pytest.mark.parametrize(
    "changes, has_it",
    [
        ({"temporal_head": "transformer", "chunk_discrimination": 1}, True),
        ({"temporal_head": "tcn", "chunk_discrimination": 0.5}, True),
        ({"temporal_head": "transformer"}, False),  # the default: 0
        ({"temporal_head": "none", "chunk_discrimination": 1}, False),  # no chunk features reach a head
        ({"temporal_head": "transformer", "chunk_discrimination": 1, "freeze_backbone": "true"}, False),
    ],
)
def test_it_is_built_where_features_that_train_feed_a_head(changes, has_it):
    model = small_model(**changes)
    assert (model.discrimination is not None) == has_it
    assert not [n for n in model.state_dict() if n.startswith("discrimination")]  # no weights to save


def test_a_temperature_of_zero_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match="model.chunk_discrimination_temperature.*above 0"):
        load_config(None, ["model.chunk_discrimination_temperature=0"])


def _forward(model, spec, length=24):
    prepare = InputPreparer(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, prepare.normalize).train()
    inputs = prepare.transfer(clip_batch(length=length))
    torch.manual_seed(3)
    return forward(inputs, spec), inputs, prepare


def test_the_training_step_adds_the_weighted_loss_of_each_chunk_s_halves_and_trains_the_backbone_by_it():
    model = small_model(temporal_head="transformer", chunk_discrimination=0.5)
    outputs, inputs, prepare = _forward(model, ChunkSpec(size=8, overlap=0))
    assert outputs.auxiliary is not None and outputs.auxiliary.dim() == 0

    # by hand: six pairs (2 clips x 3 chunks), each chunk's even frames against its odd frames, a chunk's two
    # clips a batch as in the forward (train-mode BatchNorm normalizes by the batch)
    def features(first):
        return torch.cat(
            [
                model.features(prepare.normalize({"video": inputs["video"][:, :, s + first : s + 8 : 2]}))
                for s in (0, 8, 16)
            ]
        )

    by_hand = 0.5 * pair_discrimination(features(0), features(1), 0.2)
    assert torch.allclose(outputs.auxiliary, by_hand, atol=1e-4)

    # its gradient reaches the backbone, and without a graph it is not computed
    model.zero_grad(set_to_none=True)
    outputs.auxiliary.backward()
    assert model.rgb.stages[0][0].weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert ChunkedTrainingForward(model, prepare.normalize)(inputs, ChunkSpec(size=8)).auxiliary is None


def test_the_halves_leave_the_batchnorm_statistics_to_the_whole_chunks():
    with_it = small_model(temporal_head="transformer", chunk_discrimination=1)
    without = small_model(temporal_head="transformer")
    for model in (with_it, without):
        outputs, _, _ = _forward(model, ChunkSpec(size=8, overlap=0))
        (outputs.clip.sum() + (outputs.auxiliary if outputs.auxiliary is not None else 0)).backward()
    buffers = dict(without.named_buffers())
    for name, tensor in with_it.named_buffers():
        assert torch.allclose(tensor, buffers[name], atol=1e-6), name


def test_recomputed_or_kept_the_chunks_give_the_same_loss_and_gradients():
    """The halves run inside the chunk's recomputed function: recomputing them in backward changes nothing."""
    results = []
    for kept in (0, 3):
        model = small_model(temporal_head="transformer", chunk_discrimination=1)
        outputs, _, _ = _forward(model, ChunkSpec(size=8, overlap=0, kept=kept))
        (outputs.clip.sum() + outputs.auxiliary).backward()
        results.append((outputs.auxiliary.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-6) and len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.allclose(a, b, atol=1e-5)


def test_only_the_chunks_with_a_gradient_are_paired():
    """With train.grad_chunks the chunks run without a graph give nothing to shape: only the drawn ones pair."""
    model = small_model(temporal_head="transformer", chunk_discrimination=1)
    prepare = InputPreparer(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, prepare.normalize).train()
    inputs = prepare.transfer(clip_batch(length=32))
    spec = ChunkSpec(size=8, overlap=0, grad_chunks=2, draw=1)
    _, halves = forward._chunk_outputs(
        inputs, [(s, s + 8) for s in (0, 8, 16, 24)], spec, True, None, None, model.discrimination
    )
    assert len(halves) == 2 and all(even.requires_grad and odd.requires_grad for even, odd in halves)
    # a chunk of one frame has no odd frames: it is not paired
    _, halves = forward._chunk_outputs(
        inputs, [(0, 1), (1, 9)], ChunkSpec(size=8), True, None, None, model.discrimination
    )
    assert len(halves) == 1


def test_with_the_reconstruction_the_auxiliary_is_both_losses():
    both = small_model(temporal_head="transformer", chunk_discrimination=1, chunk_reconstruction=1)
    outputs, _, _ = _forward(both, ChunkSpec(size=8))
    alone = small_model(temporal_head="transformer", chunk_discrimination=1)
    discrimination, _, _ = _forward(alone, ChunkSpec(size=8))
    reconstruction, _, _ = _forward(small_model(temporal_head="transformer", chunk_reconstruction=1), ChunkSpec(size=8))
    assert torch.allclose(outputs.auxiliary, discrimination.auxiliary + reconstruction.auxiliary, atol=1e-4)


def test_the_planner_counts_the_halves():
    from planner.project import config_training_estimate

    shape = ["model.width=8", "data.num_frames=32", "data.batch_size=2", "train.chunk_train_size=8"]
    head = [*shape, "model.temporal_head=transformer"]
    without, with_it = load_config(None, head), load_config(None, [*head, "model.chunk_discrimination=1"])
    for kept in (0, 4):
        plain = config_training_estimate(without, 32, 2, kept_chunks=kept).peak
        paired = config_training_estimate(with_it, 32, 2, kept_chunks=kept).peak
        assert paired > 1.2 * plain, kept  # each chunk's halves hold about as much as the chunk again


def test_an_epoch_s_row_gives_the_label_s_loss_apart(tmp_path):
    from test_training_loop import make_trainer

    from engine.training import loop

    model = small_model(temporal_head="transformer", chunk_discrimination=1)
    trainer, loader = make_trainer(model, 4, 1, tmp_path, count=4, **{"train.chunk_train_size": 4})
    assert trainer.has_auxiliary_loss
    row = loop.train_one_epoch(trainer, loader)
    assert row["train_loss"] > row["train_label_loss"] + 0.1  # four chunks a batch to tell apart: log 4 at first
