"""The temporal head: a model over a clip's chunk features, trained end to end through the recomputed chunks."""

import copy
import dataclasses
import json
import logging
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
from conftest import overrides, run_in_process
from test_training_loop import make_run, weights
from torch import nn

import train
from artifacts.checkpoint import TrainState, load_checkpoint
from config import ConfigError, load_config
from core.runtime import Runtime
from datasets.device_input import DeviceInputs
from datasets.long_range_tasks import ORDER_CLASSES, order_video
from datasets.manifest import VideoRecord
from datasets.shape import DataShape
from datasets.video.choice import open_reader
from engine.inference.chunks import chunk_positions, chunk_windows, forward_chunked
from engine.inference.stream import InferenceSpec
from engine.training import at_chance
from engine.training.chunked_forward import ChunkedTrainingForward, ChunkSpec
from engine.training.oom import OutOfMemoryError
from engine.training.step import label_loss, training_losses
from infer_chunked import classify_video
from models import build_model, temporal
from models import set_head_chunks as models_window
from models.chunk_attention import directional_attention
from models.temporal import TemporalHead, clip_contrast, running_contrast, temporal_head
from planner import project

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEAN, STD = [0.45] * 3, [0.225] * 3


def head_model(head="transformer", seed=0, views=1, **changes):
    torch.manual_seed(seed)
    cfg = load_config(
        None, ["model.width=4", f"model.temporal_head={head}", *[f"model.{k}={v}" for k, v in changes.items()]]
    ).model
    return build_model(cfg, num_classes=3, num_views=views)


def clip_batch(length=24, batch=3, views=1, seed=7):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, 3, length, 16, 16) if views == 1 else (batch, views, 3, length, 16, 16)
    return {"video": torch.randint(0, 255, shape, generator=generator, dtype=torch.uint8)}


def test_the_head_sees_order_a_bag_of_chunks_does_not():
    head = temporal_head(8, 2, kind="transformer").eval()
    features = torch.randn(1, 4, 8)
    windows = chunk_positions(chunk_windows(32, 8), frame_stride=4)
    reordered = features[:, [3, 1, 2, 0]]  # the same chunks, the first and last swapped
    with torch.no_grad():
        clip, per_chunk = head(features, windows)[:2]
        swapped = head(reordered, windows).clip
    assert clip.shape == (1, 2) and per_chunk.shape == (1, 4, 2)
    assert not torch.allclose(clip, swapped, atol=1e-4)  # the mean of chunk logits would be equal


def seen_keys(lengths, heads=4, n=5):
    """[B, H, query, key]: does a query chunk's output move when a key chunk's value does (directional_attention)."""
    q, k = torch.randn(2, len(lengths) if lengths is not None else 1, heads, n, 4).unbind(0)
    v = torch.randn(q.shape, requires_grad=True)
    real = None if lengths is None else torch.arange(n) < torch.tensor(lengths)[:, None]
    out = directional_attention(q, k, v, real)
    seen = torch.zeros(q.shape[0], heads, n, n, dtype=torch.bool)
    for query in range(n):
        (grad,) = torch.autograd.grad(out[:, :, query].sum(), v, retain_graph=True)
        seen[:, :, query] = grad.abs().sum(dim=-1) > 0  # [B, H, key]
    return seen


def test_directional_attention_gives_half_the_heads_the_chunks_before_and_half_those_after():
    query, key = torch.meshgrid(torch.arange(5), torch.arange(5), indexing="ij")
    seen = seen_keys(None)[0]
    for h in (0, 1):
        assert torch.equal(seen[h], key <= query)
    for h in (2, 3):
        assert torch.equal(seen[h], key >= query)
    padded = seen_keys([5, 3])  # the second clip: 3 real chunks, then 2 padded
    assert torch.equal(padded[0], seen)
    assert torch.equal(padded[1, :2, :3, :3], (key <= query)[:3, :3].expand(2, 3, 3))
    assert torch.equal(padded[1, 2:, :3, :3], (key >= query)[:3, :3].expand(2, 3, 3))
    assert not padded[1, :, :3, 3:].any()  # a real chunk never sees a padded one


def reference_encoder_head(head: TemporalHead) -> TemporalHead:
    """The head as it ran before its attention went through F.scaled_dot_product_attention: nn.TransformerEncoder
    with a built [B * H, n, n] directional mask."""
    reference = copy.deepcopy(head)
    width, heads = temporal.WIDTH, temporal.ATTENTION_HEADS
    layer = nn.TransformerEncoderLayer(
        width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True, norm_first=True
    )
    encoder = nn.TransformerEncoder(layer, len(head.encoder.layers), enable_nested_tensor=False)
    encoder.load_state_dict(head.encoder.state_dict())

    class Reference(nn.Module):
        def forward(self, tokens, real):
            return run(tokens, real)

    def run(tokens, real):
        n = tokens.shape[1]
        padding = None if real is None else ~real
        index = torch.arange(n)
        earlier, later = index[None, :] <= index[:, None], index[None, :] >= index[:, None]
        allowed = torch.stack([earlier if h < (heads + 1) // 2 else later for h in range(heads)]).unsqueeze(0)
        if padding is not None:
            allowed = (allowed & ~padding[:, None, None, :]) | torch.eye(n, dtype=torch.bool)
        return encoder(tokens, mask=~allowed.expand(len(tokens), heads, n, n).reshape(-1, n, n))

    reference.encoder = Reference()
    return reference.eval()


def test_the_encoder_gives_the_outputs_of_the_nn_transformer_encoder_it_replaced():
    """Checkpoints trained with nn.TransformerEncoder load into the linear-memory encoder (the same parameter
    names) and give its outputs, on padded clips too; every layer starts as a copy of the first, as there."""
    torch.manual_seed(0)
    head = temporal_head(8, 3).eval()
    first, second = (layer.state_dict() for layer in head.encoder.layers)
    assert all(torch.equal(first[name], second[name]) for name in first)
    reference = reference_encoder_head(head)
    features, windows = torch.randn(3, 10, 8), torch.rand(3, 10, 2).cumsum(dim=1) * 50
    mask = torch.arange(10) < torch.tensor([10, 7, 3])[:, None]
    with torch.no_grad():
        ours, theirs = head(features, windows, mask), reference(features, windows, mask)
    torch.testing.assert_close(ours.clip, theirs.clip, atol=2e-6, rtol=1e-5)
    for clip, real in enumerate((10, 7, 3)):
        torch.testing.assert_close(ours.chunks[clip, :real], theirs.chunks[clip, :real], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["transformer", "attention"])
def test_a_padded_chunk_anywhere_changes_nothing_in_the_real_ones(kind):
    """Padding is not only at the end: a clip whose third chunk is padding gives its other chunks the outputs of
    the same clip without that chunk (positions kept), in both directions, with the contrast and its running sum."""
    torch.manual_seed(0)
    head = temporal_head(8, 3, kind).eval()
    features, windows = torch.randn(1, 5, 8), torch.rand(1, 5, 2).cumsum(dim=1) * 40
    mask = torch.tensor([[True, True, False, True, True]])
    keep = [0, 1, 3, 4]
    with torch.no_grad():
        padded, without = head(features, windows, mask), head(features[:, keep], windows[:, keep])
    torch.testing.assert_close(padded.chunks[:, keep], without.chunks, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(padded.clip, without.clip, atol=2e-6, rtol=1e-5)


def test_the_forward_heads_of_directional_attention_see_no_later_chunk():
    """The directions reach the encoder the right way round: with the backward heads' share of each layer's
    output projection zeroed, and the contrast's and its running sum's part of the tokens (whose clip mean sees
    every chunk by design) zeroed too, a chunk's logits do not move when later chunks change."""
    torch.manual_seed(0)
    head = temporal_head(8, 2, kind="transformer").eval()
    backward = slice(temporal.WIDTH // 2, None)  # heads 2 and 3 of 4
    with torch.no_grad():
        head.project.weight[:, 8:] = 0  # the contrast and the running sum
        for layer in head.encoder.layers:
            layer.self_attn.out_proj.weight[:, backward] = 0
    features = torch.randn(1, 6, 8)
    later_changed = features.clone()
    later_changed[:, 4:] = torch.randn(1, 2, 8)  # not a shift or a scale, which the input norm takes away
    windows = chunk_positions(chunk_windows(48, 8))
    with torch.no_grad():
        before, after = head(features, windows).chunks, head(later_changed, windows).chunks
    assert not torch.allclose(before[:, 4:], after[:, 4:], atol=1e-4)
    assert torch.allclose(before[:, :4], after[:, :4], atol=1e-6)


def test_the_transformer_head_ignores_a_clip_wide_shift_and_scale_of_the_features():
    """A brighter or more contrasted clip moves all its chunk features alike: the transformer's tokens do not move
    (its input norm, the contrast and its running sum are each invariant to it)."""
    features = torch.randn(2, 6, 8)
    shifted = features * torch.tensor([1.7, 0.6]).view(2, 1, 1) + torch.tensor([3.0, -1.0]).view(2, 1, 1)
    windows = chunk_positions(chunk_windows(48, 8))
    torch.manual_seed(0)
    head = temporal_head(8, 2).eval()
    with torch.no_grad():
        assert torch.allclose(head(features, windows).clip, head(shifted, windows).clip, atol=1e-4)


def test_a_clip_whose_chunks_are_all_alike_gives_finite_gradients():
    """A still scene (or a clip of black frames) gives every chunk the same features: the contrast is zero there,
    and its scale's square root must not make every gradient of the step NaN."""
    windows = chunk_positions(chunk_windows(32, 8))
    for chunk in (torch.zeros(2, 1, 8), torch.randint(-4, 4, (2, 1, 8)).float()):
        features = chunk.expand(2, 4, 8).clone().requires_grad_()
        head = temporal_head(8, 2)
        head(features, windows).clip.sum().backward()
        gradients = [features.grad, *(p.grad for p in head.parameters() if p.grad is not None)]
        assert all(torch.isfinite(g).all() for g in gradients)


def test_the_clip_contrast_is_each_chunk_against_its_clip_and_ignores_what_every_chunk_shares():
    """The transformer's contrast: a chunk's difference from its clip's mean chunk over one scale a clip. What every
    chunk of a clip shares (a per-channel offset: the background, the scene) and a clip-wide scale do not move it;
    a chunk that differs little stays small beside one that differs much; padded chunks neither count nor show."""
    features = torch.zeros(1, 16, 4)
    features[0, 2, 0], features[0, 5, 1] = 4.0, 1.0  # an event at chunk 2, a faint one at chunk 5
    contrast = clip_contrast(features, None)
    scene = features * 3.0 + torch.tensor([5.0, -2.0, 0.5, 9.0])
    assert torch.allclose(clip_contrast(scene, None), contrast, atol=1e-4)
    assert contrast[0, 2].norm() > 3 * contrast[0, 5].norm() > 3 * contrast[0, 0].norm()
    assert torch.allclose(contrast.pow(2).mean(), torch.tensor(1.0), atol=1e-4)  # unit scale, whatever the input's
    padded = torch.cat([features, torch.full((1, 3, 4), 50.0)], dim=1)
    mask = torch.tensor([[True] * 16 + [False] * 3])
    with_padding = clip_contrast(padded, mask)
    assert torch.allclose(with_padding[:, :16], contrast, atol=1e-5) and (with_padding[:, 16:] == 0).all()
    still = clip_contrast(torch.ones(2, 5, 4) * torch.randn(2, 1, 4), None)  # nothing changes within the clip
    assert torch.isfinite(still).all() and still.abs().max() < 1e-3
    assert temporal_head(8, 2).project.in_features == 24  # the chunk's own features, its contrast, the running sum
    assert temporal_head(8, 2, kind="attention").project.in_features == 8


def test_the_running_contrast_counts_what_came_before_each_chunk_at_one_scale_a_clip():
    """The transformer's running sum: each chunk's running sum of the clip's contrast, in time order: zero before the
    first event, a step at each event (so which came first and how many of each so far are in every token), one
    scale a clip, padded chunks adding nothing and shown as zeros."""
    features = torch.zeros(1, 12, 3)
    features[0, 3, 0], features[0, 7, 1], features[0, 9, 0] = 1.0, 1.0, 1.0  # A at 3, B at 7, A again at 9
    contrast = clip_contrast(features, None)
    running = running_contrast(contrast, None)
    expected = contrast.cumsum(dim=1)
    torch.testing.assert_close(running, expected / expected.pow(2).mean().sqrt(), atol=1e-5, rtol=1e-5)
    steps = running[0, 1:] - running[0, :-1]
    assert steps[2, 0] > 0.5 and steps[8, 0] > 0.5 and steps[6, 1] > 0.5  # the events, in their channels
    assert running[0, 8, 0] < running[0, 10, 0] and running[0, 10, 0] > running[0, 10, 1]  # two A's, then one B
    padded = torch.cat([features[:, :5], torch.full((1, 2, 3), 9.0), features[:, 5:]], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 2 + [True] * 7])
    with_padding = running_contrast(clip_contrast(padded, mask), mask)
    keep = [*range(5), *range(7, 14)]
    torch.testing.assert_close(with_padding[:, keep], running, atol=1e-5, rtol=1e-5)
    assert (with_padding[:, 5:7] == 0).all()


def test_the_head_output_does_not_depend_on_the_micro_batch_split():
    model = head_model().eval()
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize, frame_stride=2).eval()
    inputs, spec = device_inputs.transfer(clip_batch(batch=4)), ChunkSpec(8, 2)
    with torch.no_grad():
        whole = forward(inputs, spec)
        pieces = [forward({"video": part}, spec) for part in torch.tensor_split(inputs["video"], 3)]
    torch.testing.assert_close(torch.cat([p.clip for p in pieces]), whole.clip, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([p.chunks for p in pieces]), whole.chunks, rtol=1e-5, atol=1e-6)


def gradients(model, inputs, spec, loss="clip", seed=5):
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize, frame_stride=2).train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs (the tcn head's)
    outputs = forward(device_inputs.transfer(inputs), spec)
    piece = {**inputs, "label": torch.tensor([0, 2, 1]), "frame_labels": torch.tensor([[0] * 12 + [1] * 12] * 3)}
    train_cfg = load_config(None, [f"train.chunk_loss={loss}"]).train
    label, auxiliary = training_losses(outputs, piece, spec, train_cfg, nn.CrossEntropyLoss())
    (label if auxiliary is None else label + auxiliary).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "head, loss, changes",
    [
        ("transformer", "clip", {}),
        ("attention", "clip", {}),
        ("tcn", "dense", {}),
        ("transformer", "dense", {"recompute_blocks": True}),  # both recomputations nested
    ],
)
def test_recomputed_chunks_with_a_head_give_the_gradients_of_chunks_kept_in_memory(head, loss, changes):
    inputs = clip_batch()
    recomputed = gradients(head_model(head, **changes), inputs, ChunkSpec(8, 2, recompute=True), loss)
    kept = gradients(head_model(head, **changes), inputs, ChunkSpec(8, 2, recompute=False), loss)
    assert recomputed.keys() == kept.keys()
    assert any(name.startswith("temporal.") for name in recomputed) and any(n.startswith("rgb.") for n in recomputed)
    for name, grad in recomputed.items():
        torch.testing.assert_close(grad, kept[name], rtol=1e-5, atol=1e-7, msg=name)


def test_views_are_fused_per_chunk_before_the_head_and_one_chunk_is_one_token():
    model = head_model(views=3, view_fusion="concat").eval()
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize)
    inputs = device_inputs.transfer(clip_batch(views=3))
    with torch.no_grad():
        chunked = forward(inputs, ChunkSpec(8, 0))
        whole = forward(inputs, ChunkSpec(-1))
    assert chunked.chunks.shape == (3, 3, 3) and whole.chunks.shape == (3, 1, 3)  # [B, n, K]
    torch.testing.assert_close(whole.clip, model(device_inputs.normalize(inputs)))  # one chunk: the plain forward


def test_a_head_trained_on_short_windows_runs_on_a_video_ten_times_longer():
    model = head_model()
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_cfg = load_config(None).train
    for step in range(3):  # chunks of 32 frames, windows of 64
        inputs = device_inputs.transfer(clip_batch(length=64, batch=2, seed=step))
        loss = label_loss(
            forward(inputs, ChunkSpec(32, 0)),
            {"label": torch.tensor([0, 1])},
            ChunkSpec(32, 0),
            train_cfg,
            nn.CrossEntropyLoss(),
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    long_clip = device_inputs(clip_batch(length=64 * 10 + 13, batch=1))  # 21 chunks where training saw 2
    with torch.no_grad():
        out = forward_chunked(model, long_clip, 32, 0, chunks_per_forward=4)
    assert out.logits.shape == (1, 3) and torch.isfinite(out.logits).all()
    assert len(out.windows) == 21 and out.chunk_logits.shape == (21, 1, 3) and torch.isfinite(out.chunk_logits).all()
    far = chunk_positions([(0, 32), (99_968, 100_000)])  # a 100,000-frame video's first and last chunk
    with torch.no_grad():
        clip = model.temporal(torch.randn(1, 2, model.feature_dim), far).clip
    assert torch.isfinite(clip).all()


def positions_of(n: int, length: int = 8) -> torch.Tensor:
    starts = torch.arange(n, dtype=torch.float32) * length
    return torch.stack([starts, starts + length], dim=-1)


@pytest.mark.parametrize("kind", ["transformer", "tcn", "attention"])
def test_a_head_counts_its_training_chunks_and_runs_longer_clips_in_spans_of_that_many(kind):
    torch.manual_seed(0)
    head = temporal_head(16, 5, kind=kind)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, 12:] = False
    head.train()(torch.randn(2, 14, 16), positions_of(14), mask)
    head(torch.randn(1, 9, 16), positions_of(9))
    assert int(head.trained_chunks) == 14 and head.eval().reach() == 14  # the longest real clip, not the last
    video, at = torch.randn(1, 45, 16), positions_of(45)
    with torch.no_grad():
        out = head(video, at)
        starts = temporal.span_starts(45, 14)
        assert starts == [0, 7, 14, 21, 28, 31]  # overlapping by half, the last ending with the video
        windows = [head._forward(video[:, s : s + 14], at[s : s + 14] - at[s, 0]) for s in starts]
        # a chunk's outputs are those of the span it is most central in, that span's positions from its start
        for chunk, window in ((0, 0), (3, 0), (10, 0), (11, 1), (20, 2), (25, 3), (38, 5), (44, 5)):  # ties: the first
            expected = windows[window].chunks[0, chunk - starts[window]]
            assert torch.allclose(out.chunks[0, chunk], expected, atol=1e-5), (chunk, window)
        whole = head._forward(video, at)
        assert torch.allclose(out.clip, whole.clip, atol=1e-6)  # the video's label: one pass over all of it
        if kind == "tcn":
            assert out.stages[-1] is not None and torch.allclose(out.stages[-1], out.chunks)
        assert not torch.allclose(out.chunks, whole.chunks, atol=1e-3)
        head.chunks_at_once = -1  # --head-chunks -1: the whole video at once, as before the count
        assert torch.allclose(head(video, at).chunks, whole.chunks)
        head.chunks_at_once = "auto"
        short = video[:, :14]
        assert torch.allclose(head(short, at[:14]).chunks, head._forward(short, at[:14]).chunks)  # fits: one pass


def test_spans_are_per_clip_so_a_padded_batch_gives_each_clip_its_own_outputs():
    torch.manual_seed(0)
    head = temporal_head(16, 5)
    head.train()(torch.randn(1, 10, 16), positions_of(10))
    head.eval()
    videos, at = torch.randn(2, 37, 16), positions_of(37)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, 8:] = False  # the second clip: 8 chunks, shorter than the reach
    with torch.no_grad():
        batched = head(videos, at, mask)
        alone = [head(videos[:1], at), head(videos[1:, :8], at[:8])]
    assert torch.allclose(batched.chunks[0], alone[0].chunks[0], atol=1e-5)
    assert torch.allclose(batched.chunks[1, :8], alone[1].chunks[0], atol=1e-5)
    assert torch.allclose(batched.clip, torch.cat([alone[0].clip, alone[1].clip]), atol=1e-5)


def test_the_heads_training_length_is_saved_with_its_weights_and_sets_its_inference_spans():
    torch.manual_seed(0)
    head = temporal_head(16, 5)
    head.train()(torch.randn(2, 9, 16), positions_of(9))
    loaded = temporal_head(16, 5)
    loaded.load_state_dict(head.state_dict())
    assert int(loaded.trained_chunks) == 9 and loaded.eval().reach() == 9
    assert temporal_head(16, 5).eval().reach() is None  # never trained: whole videos
    model = build_model(load_config(None, ["model.temporal_head=transformer", "model.width=4"]).model, 3)
    assert models_window(model, "auto") == "whole videos at once (it has not been trained)"
    model.temporal.trained_chunks.fill_(38)
    assert models_window(model, "auto") == "spans of 38 chunks, overlapping by half (its longest training clip)"
    assert models_window(model, 100) == "spans of 100 chunks, overlapping by half"
    assert models_window(model, -1) == "whole videos at once"
    assert models_window(build_model(load_config(None, ["model.width=4"]).model, 3), "auto") == ""


def test_streaming_inference_with_a_head_equals_the_whole_forward(tmp_path):
    frames, _ = order_video(np.random.default_rng(3), ORDER_CLASSES[0], 120, 32, 6, 40)
    path = str(tmp_path / "v.avi")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 25, (32, 32))
    for frame in frames:
        writer.write(frame)
    writer.release()
    cfg = load_config(
        None,
        [
            "data.img_size=32",
            "data.frame_stride=2",
            "model.width=4",
            "model.temporal_head=transformer",
        ],
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes=2).eval()
    device_inputs = DeviceInputs(torch.device("cpu"), cfg.data.mean, cfg.data.std)
    runtime = Runtime(torch.device("cpu"), "32")
    spec = InferenceSpec(chunk=8, overlap=2, batch=3, timeline=True)
    streamed = classify_video(
        model, VideoRecord({"video": path}, where=path), cfg.data, spec, runtime, device_inputs, list(ORDER_CLASSES)
    )
    # the same frames read at once: every second frame, the whole clip through forward_chunked
    reader = open_reader(path, (32, 32))
    clip = torch.from_numpy(reader.read(range(0, reader.num_frames, 2))).permute(3, 0, 1, 2).unsqueeze(0)
    with torch.no_grad():
        whole = forward_chunked(model, device_inputs({"video": clip}), 8, 2, frame_stride=2)
    probs = whole.logits.softmax(dim=1)[0]
    assert [t["label"] for t in streamed.topk] == [ORDER_CLASSES[int(i)] for i in probs.argsort(descending=True)]
    assert streamed.topk[0]["prob"] == pytest.approx(float(probs.max()), abs=1e-4)
    assert len(streamed.chunk_results) == len(whole.windows) > 5
    for row, chunk_logits in zip(streamed.chunk_results, whole.chunk_logits):
        assert row["prob"] == pytest.approx(float(chunk_logits.softmax(dim=-1).max()), abs=1e-4)


def test_the_planner_counts_the_head():
    base = ["data.img_size=32", "data.num_frames=64", "train.chunk_train_size=16", "train.chunk_train_overlap=0"]
    without = project.config_training_estimate(load_config(None, base), train.STEP, 64, 2)
    cfg = load_config(None, base + ["model.temporal_head=transformer"])
    with_head = project.config_training_estimate(cfg, train.STEP, 64, 2)
    head = build_model(cfg.model, num_classes=10).temporal
    linear = nn.Linear(build_model(load_config(None, base).model, num_classes=10).feature_dim, 10)
    head_bytes = sum(p.numel() for p in head.parameters()) * 4
    linear_bytes = sum(p.numel() for p in linear.parameters()) * 4
    # at least the head's parameters and AdamW's two states (less the linear classifier the head replaces)
    assert with_head.peak - without.peak >= 3 * (head_bytes - linear_bytes)
    assert with_head.parameters - without.parameters >= head_bytes - linear_bytes


def group_norm_head_model(**changes):
    """A head over tiny3d with GroupNorm: every computation per clip, so micro-batching cannot change a gradient."""
    return head_model(norm="group", **changes)


def test_accumulating_micro_batches_with_a_head_equals_one_batch(tmp_path):
    accumulated, loader = make_run(group_norm_head_model(), 2, 4, tmp_path / "a", **{"train.chunk_train_size": 2})
    train.train_one_epoch(accumulated, loader)
    whole, loader = make_run(group_norm_head_model(), 8, 1, tmp_path / "b", **{"train.chunk_train_size": 2})
    train.train_one_epoch(whole, loader)
    assert accumulated.state.global_step == whole.state.global_step == 1
    for a, b in zip(weights(accumulated.model), weights(whole.model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # float sums in another order


def test_the_oom_back_off_halves_the_chunks_under_a_head(tmp_path, caplog):
    model = group_norm_head_model()
    features = model.features

    def features_that_fit_two_frames(inputs):
        if inputs["video"].shape[2] > 2:
            raise OutOfMemoryError("CUDA out of memory (simulated)")
        return features(inputs)

    model.features = features_that_fit_two_frames  # clips of 4 frames: only chunks of 2 fit
    backed_off, loader = make_run(model, 2, 1, tmp_path / "a", count=8)
    with caplog.at_level("WARNING", logger="longvideo"):
        train.train_one_epoch(backed_off, loader)
    assert "now chunks of 2 frames" in caplog.text and backed_off.state.chunk_train_size == 2
    reference, loader = make_run(
        group_norm_head_model(), 2, 1, tmp_path / "b", count=8, **{"train.chunk_train_size": 2}
    )
    reference.state.micro_splits = 2  # where the back-off went first: 1 clip per forward
    train.train_one_epoch(reference, loader)
    for a, b in zip(weights(backed_off.model), weights(reference.model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_head_trains_under_autocast():
    model = head_model()
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = forward(device_inputs.transfer(clip_batch()), ChunkSpec(8, 0))
        loss = nn.functional.cross_entropy(outputs.clip.float(), torch.tensor([0, 1, 2]))
    assert outputs.clip.dtype == torch.bfloat16  # the head's linear layers ran in the lower precision
    loss.backward()
    grads = [p.grad for p in model.temporal.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_a_head_with_last_aggregation_or_late_fusion_is_refused_with_the_reason():
    with pytest.raises(
        ConfigError,
        match="infer.chunk_aggregation: last runs only the last chunk, but "
        "model.temporal_head=attention needs every chunk's features",
    ):
        load_config(None, ["model.temporal_head=attention", "infer.chunk_aggregation=last"])
    with pytest.raises(ConfigError, match="model.view_fusion: late keeps one feature vector per view"):
        load_config(None, ["model.temporal_head=transformer", "model.view_fusion=late"])
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.temporal_head=transformer", "infer.head_chunks=0"])
    assert str(info.value) == (
        "--set infer.head_chunks=0: infer.head_chunks: 0 chunks cannot hold a chunk; "
        "give a number of chunks, -1 (the whole video) or auto (the head's longest training "
        "clip)"
    )


def test_a_saved_config_reads_removed_keys_at_their_fixed_values_and_names_any_other():
    """A checkpoint's config from before the head's options were removed: at the values every run now has, it loads
    as today's; at another value, one line names the setting this version no longer has. A key it lacks takes its
    default."""
    from config import defaults, saved_config

    saved = defaults()
    saved["model"].update(temporal_attention="directional", temporal_contrast=True, temporal_width=64)
    saved["train"]["temporal_warmup_epochs"] = 0.0
    del saved["model"]["chunk_reconstruction"]
    cfg = saved_config(saved)
    assert cfg.train.temporal_warmup_epochs == 0.0
    assert cfg.model.chunk_reconstruction == defaults()["model"]["chunk_reconstruction"]
    saved["model"]["temporal_running"] = False
    with pytest.raises(ConfigError) as info:
        saved_config(saved)
    assert str(info.value) == (
        "trained with model.temporal_running: False, a setting this version no longer has (the transformer head "
        "always sees the running sum of the contrast)"
    )


SHAPE = DataShape(3)  # the checkpoints of these tests: 3 classes, one view


def training_parts(cfg):
    """(model, optimizer, scheduler, scaler) of a 3-class run of ``cfg``, as train.py builds them, seeded."""
    from engine.training.optim import build_optimizer, build_scheduler

    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes=3, num_views=1)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train, 4, has_temporal_head=True)
    return model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False)


def test_resuming_with_settings_other_than_the_checkpoints_names_the_settings_that_changed(tmp_path, caplog):
    """A run started with a model setting and train.temporal_warmup_epochs other than the defaults, resumed
    without them: its model no longer fits (one line naming the key and the --set that resumes it, no traceback),
    and a warm-up that would change its schedule is a warning with the --set that keeps it."""
    from artifacts.checkpoint import Checkpoint, CheckpointError, restore_training, save_checkpoint

    head = ["model.width=4", "model.temporal_head=transformer"]
    then = load_config(None, [*head, "model.chunk_reconstruction=1.0", "train.temporal_warmup_epochs=0"])

    model, optimizer, scheduler, scaler = training_parts(then)
    path = str(tmp_path / "last.pt")
    save_checkpoint(
        Checkpoint.of_training(model, optimizer, scheduler, scaler, TrainState(), then, ["a"] * 3, SHAPE), path
    )
    with pytest.raises(CheckpointError) as error:
        restore_training(path, *training_parts(load_config(None, head)), load_config(None, head))
    assert (
        "its model does not fit this config's (model.chunk_reconstruction); resume with the checkpoint's settings: "
        "--set model.chunk_reconstruction=1.0"
        in str(error.value)
        and "\n" not in str(error.value)
    )
    now = load_config(None, [*head, "model.chunk_reconstruction=1.0"])
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        restore_training(path, *training_parts(now), now)
    assert "train.temporal_warmup_epochs 0.0 then, 2.0 now" in caplog.text
    assert "--set train.temporal_warmup_epochs=0.0" in caplog.text and "model.chunk_reconstruction" not in caplog.text


def test_a_checkpoint_trained_with_a_removed_setting_is_one_line(tmp_path):
    """A checkpoint whose config holds a head option this version no longer has, at another value than the one every
    run now has: resuming it is one line naming the setting, not a traceback of mismatched tensors."""
    from artifacts.checkpoint import Checkpoint, CheckpointError, restore_training, save_checkpoint

    cfg = load_config(None, ["model.width=4", "model.temporal_head=transformer"])
    model, optimizer, scheduler, scaler = training_parts(cfg)
    saved = cfg.to_dict()
    saved["model"]["temporal_running"] = False  # a run from before the option was removed
    path = str(tmp_path / "last.pt")
    ckpt = Checkpoint.of_training(model, optimizer, scheduler, scaler, TrainState(), cfg, ["a"] * 3, SHAPE)
    ckpt.config = saved
    save_checkpoint(ckpt, path)
    with pytest.raises(CheckpointError) as error:
        restore_training(path, *training_parts(cfg), cfg)
    assert str(error.value) == (
        f"{path}: trained with model.temporal_running: False, a setting this version no longer has (the transformer "
        f"head always sees the running sum of the contrast); it cannot be resumed with this version (eval.py cannot "
        f"use it either)"
    )


HEAD_RUN = (  # head_run's settings: a transformer head over chunks of 8 frames
    "model.temporal_head=transformer",
    "train.chunk_train_size=8",
    "train.chunk_train_overlap=0",
    "infer.chunk_size=8",
    "infer.chunk_overlap=0",
)


@pytest.fixture(scope="module")
def head_run(synthetic_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("head_runs")
    args = overrides(synthetic_root, out, *HEAD_RUN)
    assert train.main(args) == 0
    return os.path.join(out, "e2e", "latest", "checkpoints", "best.pt")


def test_eval_and_infer_load_the_head_with_no_flags_and_refuse_agg(head_run, synthetic_root):
    state = load_checkpoint(head_run)
    assert any(key.startswith("temporal.") for key in state.model)
    run = ["eval.py", "--checkpoint", head_run, "--split", "val"]
    result = run_in_process(run)
    assert result.returncode == 0, result.stderr
    assert "temporal head transformer, spans of " in result.stdout.splitlines()[0]
    whole = run_in_process(run + ["--head-chunks", "-1"])
    assert whole.returncode == 0 and "temporal head transformer, whole videos at once" in whole.stdout
    bad = run_in_process(run + ["--head-chunks", "half"])
    assert bad.returncode == 2
    assert bad.stderr == "error: --head-chunks half: expected a number of chunks, -1 (the whole video) or auto\n"
    refused = run_in_process(run + ["--agg", "max"])
    assert refused.returncode == 2
    assert refused.stderr == (
        "error: --agg max: this model has a temporal head (model.temporal_head: transformer), "
        "which is the aggregation over its chunks; leave --agg out\n"
    )
    infer = [
        "infer_chunked.py",
        "--checkpoint",
        head_run,
        "--input",
        os.path.join(synthetic_root, "long.jsonl"),
        "--chunk",
        "16",
        "--max-videos",
        "1",
    ]
    result = run_in_process(infer + ["--timeline"])
    assert result.returncode == 0, result.stderr
    assert "temporal head transformer" in result.stdout
    refused = run_in_process(infer + ["--agg", "prob"])
    assert refused.returncode == 2 and "leave --agg out" in refused.stderr


def test_a_new_head_trains_on_a_run_s_last_backbone_frozen_and_evaluates_without_that_file(
    head_run, synthetic_root, tmp_path
):
    """docs/long-videos.md, a new head on the trained backbone: model.pretrained names a run's last.pt and
    model.freeze_backbone keeps its backbone as it was (weights and BatchNorm statistics); the new run's checkpoint
    holds it, so evaluation runs with the first file gone."""
    import shutil

    weights = str(tmp_path / "first_last.pt")
    shutil.copyfile(os.path.join(os.path.dirname(head_run), "last.pt"), weights)
    first = load_checkpoint(weights)
    args = overrides(
        synthetic_root,
        tmp_path,
        *HEAD_RUN,
        "experiment=again",
        "train.max_epochs=1",
        f"model.pretrained={weights}",
        "model.freeze_backbone=true",
    )
    assert train.main(args) == 0
    checkpoints = tmp_path / "again" / "latest" / "checkpoints"
    again = load_checkpoint(str(checkpoints / "last.pt"))
    backbone = [k for k in first.model if k.startswith("rgb.")]
    assert backbone and all(torch.equal(again.model[k], first.model[k]) for k in backbone)
    assert any(not torch.equal(again.model[k], first.model[k]) for k in first.model if k.startswith("temporal."))
    os.unlink(weights)
    result = run_in_process(["eval.py", "--checkpoint", str(checkpoints / "best.pt"), "--split", "val"])
    assert result.returncode == 0, result.stderr


def test_the_cron_evaluator_uses_the_head(head_run):
    experiment = os.path.dirname(os.path.dirname(os.path.dirname(head_run)))
    result = run_in_process(
        ["eval.py", "--watch", experiment, "--settle", "0"],
    )
    assert result.returncode == 0, result.stderr
    entries = [json.loads(line) for line in open(os.path.join(experiment, "eval.jsonl"))]
    assert entries and all(e["status"] == "ok" for e in entries)


def test_the_order_task_puts_two_events_far_apart_the_same_way_for_both_labels():
    rng_a, rng_b = np.random.default_rng(11), np.random.default_rng(11)
    frames_ab, events_ab = order_video(rng_a, "A_then_B", 200, 16, 5, 60)
    frames_ba, events_ba = order_video(rng_b, "B_then_A", 200, 16, 5, 60)
    # the same draws: the label only swaps which event comes first
    assert (events_ab["A"], events_ab["B"]) == (events_ba["B"], events_ba["A"])
    assert events_ab["B"] - events_ab["A"] >= 60 + 5
    for frames, events in ((frames_ab, events_ab), (frames_ba, events_ba)):
        red = [t for t, f in enumerate(frames) if f[..., 2].mean() > f[..., 1].mean() + 40]
        green = [t for t, f in enumerate(frames) if f[..., 1].mean() > f[..., 2].mean() + 40]
        assert red == list(range(events["A"], events["A"] + 5))
        assert green == list(range(events["B"], events["B"] + 5))


def test_the_long_range_bench_names_an_unknown_family_or_preset():
    for option, value in (("--families", "middle,midle"), ("--presets", "quickstart")):
        done = run_in_process(
            ["-m", "bench.long_range", "--part", "families", option, value],
        )
        assert done.returncode == 2 and done.stderr.splitlines()[-1].startswith(
            f"python -m bench.long_range: error: {option}: unknown "
        ), done.stderr
    for count in ("0", "480"):  # the order task's data has its own generator: its 96 videos only
        done = run_in_process(
            ["-m", "bench.long_range", "--part", "families", "--families", "order", "--num-train", count]
        )
        assert done.returncode == 2 and "error: --num-train: at least 1" in done.stderr.splitlines()[-1], done.stderr


def test_the_length_bench_names_an_unknown_family_and_the_scale_bench_measures_a_head_step_alone():
    done = run_in_process(
        ["-m", "bench.length", "--families", "order,odrer"],
    )
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "python -m bench.length: error: --families: unknown odrer; choose from order, middle, last, distractors, twice, "
        "more, match, match3"
    )
    step = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--step-worker", "transformer", "11250", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    assert step.returncode == 0, step.stderr
    measured = json.loads(step.stdout.strip().splitlines()[-1])
    # the planner's estimate of the step against the step's own resident growth (bench/RESULTS.md: 1.00 at an
    # hour's 11,250 chunks, 106 MiB)
    assert measured["measured"] > 50 and 0.85 <= measured["estimated"] / measured["measured"] <= 1.15, measured


def test_the_long_range_bench_names_an_unknown_modality_before_it_trains():
    done = run_in_process(["-m", "bench.long_range", "--part", "families", "--modalities", "colour,pulses"])
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "python -m bench.long_range: error: --modalities: unknown 'pulses'; choose from colour, motion, texture, "
        "repetition"
    )


# ------------------------------------------------------------------------------- the head's training defaults
def test_the_head_trains_at_the_model_s_rate_in_the_optimizer_s_two_groups():
    """With a head or without one, the optimizer has the two groups it always had (weight decay on matrices, not
    on norms and biases), every parameter once, in model order, at train.lr; the head's clip applies to the model."""
    from engine.training.optim import build_optimizer, max_grad_norm

    for model in (head_model("none"), head_model("transformer")):
        train_cfg = load_config(None, ["train.lr=0.004", "train.weight_decay=0.02"]).train
        groups = build_optimizer(model, train_cfg).param_groups
        before = [[p for p in model.parameters() if p.dim() > 1], [p for p in model.parameters() if p.dim() <= 1]]
        assert [g["params"] for g in groups] == before
        assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.004, 0.02), (0.004, 0.0)]
    train_cfg = load_config(None, ["train.temporal_grad_clip=1.5"]).train
    assert max_grad_norm(train_cfg, True) == 1.5 and max_grad_norm(train_cfg, False) is None
    assert max_grad_norm(dataclasses.replace(train_cfg, grad_clip=3.0), True) == 3.0


def test_with_a_head_the_warm_up_lasts_at_least_its_own_epochs():
    """train.temporal_warmup_epochs: with a head the linear warm-up lasts max(train.warmup_epochs, it) epochs;
    without one train.warmup_epochs as written."""
    from engine.training.optim import build_optimizer, build_scheduler

    def rates(train_cfg, has_head: bool, steps: int = 9) -> list[float]:
        model = nn.Linear(2, 2)
        optimizer = build_optimizer(model, train_cfg)
        scheduler = build_scheduler(optimizer, train_cfg, steps_per_epoch=4, has_temporal_head=has_head)
        seen = []
        for _ in range(steps):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    epochs = "train.max_epochs=20"
    short = load_config(None, [epochs, "train.lr=0.008", "train.warmup_epochs=0.5"]).train  # the head's: 2
    assert rates(short, has_head=False)[:3] == pytest.approx([0.004, 0.008, 0.008], rel=1e-3)
    with_head = rates(short, has_head=True)
    assert with_head[:8] == pytest.approx([0.001 * (i + 1) for i in range(8)])  # 2 epochs of 4 steps
    assert with_head[8] == pytest.approx(0.008, rel=1e-3)
    longer = load_config(None, [epochs, "train.lr=0.008", "train.warmup_epochs=3"]).train
    assert rates(longer, True, 12) == pytest.approx([0.008 * (i + 1) / 12 for i in range(12)])
    off = load_config(None, [epochs, "train.lr=0.008", "train.warmup_epochs=0", "train.temporal_warmup_epochs=0"])
    assert rates(off.train, True, 2) == pytest.approx([0.008, 0.008], rel=1e-3)


def _run_at(history, classes=("a", "b", "c"), overrides=()):
    from types import SimpleNamespace

    from engine.training.run import RunReport

    return SimpleNamespace(
        report=RunReport(),
        has_temporal_head=True,
        runtime=SimpleNamespace(is_main=True),
        class_names=list(classes),
        state=SimpleNamespace(history=history, epoch=len(history)),
        cfg=load_config(None, list(overrides)),
    )


def _head_warnings(caplog, run, histories) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        for history in histories:
            run.state.history, run.state.epoch = history, history[-1]["epoch"]
            at_chance.warn_if_at_chance(run)
    return [r.getMessage() for r in caplog.records]


def test_a_head_at_chance_is_said_once_with_where_to_read_what_helps(caplog):
    history = [
        {"epoch": e, "val_clip_acc": acc, "train_loss": 1.1}
        for e, acc in enumerate([0.34, 0.333, 0.36, 0.333], start=1)
    ]
    # two validations: not yet; three: said; four: not again
    warnings = _head_warnings(caplog, _run_at(history[:2]), [history[:2], history[:3], history])
    assert warnings == [
        "epoch 3: validation accuracy has stayed at chance (0.333) for 3 validations with the temporal head on, "
        "while the label's training loss is 1.100 (chance: 1.099): the head is not learning; docs/long-videos.md, "
        '"When the head does not learn", says what to try'
    ]
    fitting = [{**row, "train_loss": 0.3} for row in history]
    said = _head_warnings(caplog, _run_at(fitting), [fitting])
    assert len(said) == 1 and "loss is 0.300 (chance: 1.099): it fits the training clips, not the task" in said[0]
    # with the chunk reconstruction the label's loss alone tells fitting from not learning
    reconstructed = [{**row, "train_loss": 3.3, "train_label_loss": 0.3} for row in history]
    said = _head_warnings(caplog, _run_at(reconstructed), [reconstructed])
    assert "loss is 0.300" in said[0]
    learning = history[:2] + [{"epoch": 3, "val_clip_acc": 0.5, "train_loss": 1.0}]
    assert not _head_warnings(caplog, _run_at(learning), [learning])


def test_a_timeline_head_is_judged_by_its_frames_not_its_clips_majority_label(caplog):
    """With dense chunk labels a clip's one label is only its majority's: a head whose frames are right is not at
    chance when that label is, and one whose frames are at chance is, said of its frame accuracy."""
    learning = [{"epoch": e, "val_clip_acc": 0.333, "val_seg_frame_acc": 0.75, "train_loss": 1.1} for e in (1, 2, 3)]
    assert not _head_warnings(caplog, _run_at(learning, overrides=["train.chunk_loss=dense"]), [learning])
    blind = [{**row, "val_clip_acc": 0.9, "val_seg_frame_acc": 0.35} for row in learning]
    warnings = _head_warnings(caplog, _run_at(blind, overrides=["train.chunk_loss=dense"]), [blind])
    assert len(warnings) == 1 and warnings[0].startswith("epoch 3: validation frame accuracy has stayed at chance")


def test_chance_allows_for_the_luck_of_a_small_validation_set(caplog):
    """48 clips of 2 classes: two standard errors of a guess are 0.144, so 0.58 is chance and 0.66 is not; with
    4,800 clips the 0.05 floor holds (0.58 is learning)."""

    def history(acc, clips):
        return [{"epoch": e, "val_clip_acc": acc, "val_num_clips": clips, "train_loss": 0.69} for e in (1, 2, 3)]

    said = {
        (acc, clips): bool(_head_warnings(caplog, _run_at(history(acc, clips), ("a", "b")), [history(acc, clips)]))
        for acc, clips in [(0.58, 48), (0.66, 48), (0.54, 4800), (0.58, 4800)]
    }
    assert said == {(0.58, 48): True, (0.66, 48): False, (0.54, 4800): True, (0.58, 4800): False}


def test_a_checkpoint_whose_head_had_a_rate_of_its_own_is_one_line(tmp_path):
    """A checkpoint from when the head trained at a rate of its own (two more parameter groups): resuming it is one
    clear error, not torch's "different number of parameter groups"."""
    from artifacts.checkpoint import Checkpoint, CheckpointError, restore_training, save_checkpoint
    from engine.training.optim import build_optimizer

    model = head_model()
    optimizer = build_optimizer(model, load_config(None, []).train)
    head = {id(p) for p in model.temporal.parameters()}
    own_rate = torch.optim.AdamW(
        [
            {"params": [p for p in g["params"] if id(p) in wanted]}
            for g in optimizer.param_groups
            for wanted in ({id(p) for p in model.parameters()} - head, head)
        ]
    )
    path = str(tmp_path / "last.pt")
    save_checkpoint(Checkpoint(model.state_dict(), {}, [], SHAPE, optimizer=own_rate.state_dict()), path)
    with pytest.raises(CheckpointError, match=r"last\.pt: its optimizer has 4 parameter groups, this version's has 2"):
        restore_training(path, model, optimizer, None, None)
