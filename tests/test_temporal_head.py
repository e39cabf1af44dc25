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
from test_training_loop import make_trainer, weights
from torch import nn

import train
from artifacts.checkpoint import TrainState, load_checkpoint
from config import ConfigError, load_config
from core.runtime import Runtime
from datasets.device_input import InputPreparer
from datasets.long_range_tasks import ORDER_CLASSES, order_video
from datasets.manifest import VideoRecord
from datasets.shape import DataShape
from datasets.video.choice import open_reader
from engine.inference.chunks import chunk_positions, chunk_windows, forward_chunked
from engine.inference.stream import InferenceSpec, classify_video
from engine.training import at_chance, loop
from engine.training.chunked_forward import ChunkedTrainingForward, ChunkSpec
from engine.training.oom import OutOfMemoryError
from engine.training.step import training_loss
from models import build_model, chunk_attention, temporal
from models import set_head_chunks as models_window
from models.chunk_attention import attention_block, attention_with_dropout, directional_attention
from models.temporal import TemporalHead, clip_contrast, clip_event_contrast, running_contrast, temporal_head
from planner import project

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEAN, STD = [0.45] * 3, [0.225] * 3


def head_model(head="transformer", seed=0, views=1, dropout=0.0, **changes):
    torch.manual_seed(seed)
    cfg = load_config(
        None,
        [
            "model.width=4",
            f"model.temporal_head={head}",
            "model.temporal_width=16",
            "model.temporal_attention_heads=2",
            f"model.temporal_dropout={dropout}",
            *[f"model.{k}={v}" for k, v in changes.items()],
        ],
    ).model
    return build_model(cfg, num_classes=3, num_views=views)


def clip_batch(length=24, batch=3, views=1, seed=7):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, 3, length, 16, 16) if views == 1 else (batch, views, 3, length, 16, 16)
    return {"video": torch.randint(0, 255, shape, generator=generator, dtype=torch.uint8)}


def test_the_head_sees_order_a_bag_of_chunks_does_not():
    head = temporal_head(8, 2, kind="transformer", width=16, layers=1, heads=2, dropout=0.0).eval()
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
    with a built [B * H, n, n] mask (directional) or a key padding mask (bidirectional)."""
    reference = copy.deepcopy(head)
    width, heads = head.width, head.heads
    layer = nn.TransformerEncoderLayer(
        width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True, norm_first=True
    )
    encoder = nn.TransformerEncoder(layer, len(head.encoder.layers), enable_nested_tensor=False)
    encoder.load_state_dict(head.encoder.state_dict())

    class Reference(nn.Module):
        def forward(self, tokens, real, directional):
            return run(tokens, real, directional)

    def run(tokens, real, directional):
        n = tokens.shape[1]
        padding = None if real is None else ~real
        if not directional:
            return encoder(tokens, src_key_padding_mask=padding)
        index = torch.arange(n)
        earlier, later = index[None, :] <= index[:, None], index[None, :] >= index[:, None]
        allowed = torch.stack([earlier if h < (heads + 1) // 2 else later for h in range(heads)]).unsqueeze(0)
        if padding is not None:
            allowed = (allowed & ~padding[:, None, None, :]) | torch.eye(n, dtype=torch.bool)
        return encoder(tokens, mask=~allowed.expand(len(tokens), heads, n, n).reshape(-1, n, n))

    reference.encoder = Reference()
    return reference.eval()


@pytest.mark.parametrize("attention,heads", [("directional", 4), ("directional", 3), ("bidirectional", 4)])
def test_the_encoder_gives_the_outputs_of_the_nn_transformer_encoder_it_replaced(attention, heads):
    """Checkpoints trained with nn.TransformerEncoder load into the linear-memory encoder (the same parameter
    names) and give its outputs, on padded clips too; every layer starts as a copy of the first, as there."""
    torch.manual_seed(0)
    head = temporal_head(8, 3, width=24, layers=2, heads=heads, attention=attention).eval()
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


@pytest.mark.parametrize("causal,padded", [(True, False), (False, True), (False, False)])
def test_attention_in_recomputed_query_blocks_equals_the_fused_kernel(monkeypatch, causal, padded):
    """The CPU's path for dropped attention probabilities (no fused kernel drops them there), in blocks of a few
    queries: without dropout, the outputs and gradients of F.scaled_dot_product_attention."""
    monkeypatch.setattr(chunk_attention, "BLOCK_BYTES", 2 * 4 * 11 * 4 * 3)  # blocks of 3 queries of 11
    q, k, v = (torch.randn(2, 4, 11, 8, requires_grad=True) for _ in range(3))
    keys = (torch.arange(11) < torch.tensor([[11], [6]])) if padded else None
    ours = attention_with_dropout(q, k, v, causal, keys, 0.0)
    fused = nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, attn_mask=None if keys is None else keys[:, None, None]
    )
    torch.testing.assert_close(ours, fused)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    for ours_grad, fused_grad in zip(grads, torch.autograd.grad(fused.square().sum(), (q, k, v))):
        torch.testing.assert_close(ours_grad, fused_grad)


def test_dropped_attention_blocks_recomputed_in_backward_give_the_gradients_of_blocks_kept(monkeypatch):
    """Each block's dropout mask is drawn again from the same RNG state when it is recomputed in backward."""
    monkeypatch.setattr(chunk_attention, "BLOCK_BYTES", 1 * 2 * 9 * 4 * 4)  # blocks of 4 queries of 9
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    torch.manual_seed(5)
    ours = attention_with_dropout(q, k, v, True, None, 0.5)
    torch.manual_seed(5)
    kept = torch.cat([attention_block(q[:, :, s : s + 4], k, v, s, True, None, 0.5) for s in (0, 4, 8)], 2)
    torch.testing.assert_close(ours, kept)
    assert not torch.allclose(ours, attention_with_dropout(q, k, v, True, None, 0.0))  # it did drop
    for a, b in zip(torch.autograd.grad(ours.sum(), (q, k, v)), torch.autograd.grad(kept.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("running, events", [(False, False), (True, False), (True, True)])
def test_a_padded_chunk_anywhere_changes_nothing_in_the_real_ones(running, events):
    """Padding is not only at the end: a clip whose third chunk is padding gives its other chunks the outputs of
    the same clip without that chunk (positions kept), in both directions, with the running sum and the event
    contrast too."""
    torch.manual_seed(0)
    head = temporal_head(8, 3, width=16, heads=2, running=running, event_contrast=events).eval()
    features, windows = torch.randn(1, 5, 8), torch.rand(1, 5, 2).cumsum(dim=1) * 40
    mask = torch.tensor([[True, True, False, True, True]])
    keep = [0, 1, 3, 4]
    with torch.no_grad():
        padded, without = head(features, windows, mask), head(features[:, keep], windows[:, keep])
    torch.testing.assert_close(padded.chunks[:, keep], without.chunks, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(padded.clip, without.clip, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("attention", ["directional", "bidirectional"])
def test_the_forward_heads_of_directional_attention_see_no_later_chunk(attention):
    """The directions reach the encoder the right way round: with the backward head's share of each layer's
    output projection zeroed, a chunk's logits do not move when later chunks change (they do, bidirectionally).
    Without the contrast, whose clip mean sees every chunk by design."""
    torch.manual_seed(0)
    head = temporal_head(
        8,
        2,
        kind="transformer",
        width=16,
        layers=2,
        heads=2,
        dropout=0.0,
        attention=attention,
        contrast=False,
        running=False,
    ).eval()
    with torch.no_grad():
        for layer in head.encoder.layers:
            layer.self_attn.out_proj.weight[:, 8:] = 0  # head 1 (the backward one when directional) silenced
    features = torch.randn(1, 6, 8)
    later_changed = features.clone()
    later_changed[:, 4:] = torch.randn(1, 2, 8)  # not a shift or a scale, which the input norm takes away
    windows = chunk_positions(chunk_windows(48, 8))
    with torch.no_grad():
        before, after = head(features, windows).chunks, head(later_changed, windows).chunks
    assert not torch.allclose(before[:, 4:], after[:, 4:], atol=1e-4)
    assert torch.allclose(before[:, :4], after[:, :4], atol=1e-6) == (attention == "directional")


def test_with_its_input_norm_the_transformer_head_ignores_a_clip_wide_shift_and_scale_of_the_features():
    """A brighter or more contrasted clip moves all its chunk features alike: with model.temporal_input_norm the
    transformer's tokens do not move (without it they do); the attention head has no input norm."""
    features = torch.randn(2, 6, 8)
    shifted = features * torch.tensor([1.7, 0.6]).view(2, 1, 1) + torch.tensor([3.0, -1.0]).view(2, 1, 1)
    windows = chunk_positions(chunk_windows(48, 8))
    for input_norm in (True, False):
        torch.manual_seed(0)
        head = temporal_head(8, 2, width=16, layers=1, heads=2, dropout=0.0, input_norm=input_norm).eval()
        with torch.no_grad():
            same = torch.allclose(head(features, windows).clip, head(shifted, windows).clip, atol=1e-4)
        assert same == input_norm
    assert temporal_head(8, 2, kind="attention", input_norm=True).input_norm is None


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
    """model.temporal_contrast: a chunk's difference from its clip's mean chunk over one scale a clip. What every
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
    assert temporal_head(8, 2, kind="attention").contrast is False
    assert temporal_head(8, 2, contrast=False, running=False).project.in_features == 8
    assert temporal_head(8, 2, running=False).project.in_features == 16  # the chunk's own features, its contrast
    assert temporal_head(8, 2).project.in_features == 24  # the config's defaults: the running sum too


def test_the_running_contrast_counts_what_came_before_each_chunk_at_one_scale_a_clip():
    """model.temporal_running: each chunk's running sum of the clip's contrast, in time order: zero before the
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
    assert temporal_head(8, 2, running=True).project.in_features == 24  # features, contrast, running sum
    assert temporal_head(8, 2, running=True, contrast=False).project.in_features == 16


def close_kinds(kinds="ABAB", at=(2, 5, 7, 9), chunks=12):
    """One clip's features: a shared scene; at each chunk of ``at`` an event, a step of 6 in feature 3 whatever its
    kind and of 1 in feature 0 (A) or 1 (B): kinds that lie close together beside how far an event lies from the
    background."""
    features = torch.ones(1, chunks, 4) * torch.tensor([0.5, -1.0, 2.0, 0.3])
    for chunk, kind in zip(at, kinds):
        features[0, chunk, 3] += 6.0
        features[0, chunk, "AB".index(kind)] += 1.0
    return features


def test_the_event_contrast_keeps_what_sets_the_events_apart_and_drops_what_they_share():
    """model.temporal_event_contrast: each chunk's contrast against the mean of its clip's events (the chunks that
    differ from it more than its median chunk): the background is zero, the step every event shares is gone, the
    kinds stand apart at one scale a clip, whatever the clip's offset and scale; padded chunks neither count nor
    show; a clip whose events are all of one kind gives (nearly) zeros."""
    features = close_kinds()
    events = clip_event_contrast(clip_contrast(features, None), None)[0]
    background = [i for i in range(12) if i not in (2, 5, 7, 9)]
    assert events[background].abs().max() == 0
    assert events[[2, 5, 7, 9], 3].abs().max() < 1e-4  # the step every event shares
    torch.testing.assert_close(events[2], events[7])
    torch.testing.assert_close(events[2], -events[5])  # A and B on either side of their mean
    assert events[2, 0] > 0 > events[2, 1]
    torch.testing.assert_close(events.pow(2).mean(), torch.tensor(1.0), atol=1e-4, rtol=0)  # one scale a clip
    # the plain contrast keeps the step the events share: the kinds lie close beside it there
    contrast = clip_contrast(features, None)[0]
    assert (contrast[2] - contrast[5]).norm() / 2 < 0.2 * contrast[2].norm()
    torch.testing.assert_close(
        clip_event_contrast(clip_contrast(features * 3 - 7, None), None)[0], events, atol=1e-5, rtol=1e-4
    )
    padded = torch.cat([features[:, :4], torch.full((1, 2, 4), 50.0), features[:, 4:]], dim=1)
    mask = torch.tensor([[True] * 4 + [False] * 2 + [True] * 8])
    with_padding = clip_event_contrast(clip_contrast(padded, mask), mask)[0]
    torch.testing.assert_close(with_padding[[*range(4), *range(6, 14)]], events, atol=1e-5, rtol=1e-4)
    assert (with_padding[4:6] == 0).all()
    alike = clip_event_contrast(clip_contrast(close_kinds("AAAA"), None), None)
    assert torch.isfinite(alike).all() and alike.abs().max() < 1e-3
    assert temporal_head(8, 2, event_contrast=True).project.in_features == 32  # features, contrast, both sums
    assert temporal_head(8, 2).project.in_features == 24  # the config's default: off


def test_the_head_output_does_not_depend_on_the_micro_batch_split():
    model = head_model().eval()
    prepare = InputPreparer(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, prepare.normalize, frame_stride=2).eval()
    inputs, spec = prepare.transfer(clip_batch(batch=4)), ChunkSpec(8, 2)
    with torch.no_grad():
        whole = forward(inputs, spec)
        pieces = [forward({"video": part}, spec) for part in torch.tensor_split(inputs["video"], 3)]
    torch.testing.assert_close(torch.cat([p.clip for p in pieces]), whole.clip, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([p.chunks for p in pieces]), whole.chunks, rtol=1e-5, atol=1e-6)


def gradients(model, inputs, spec, loss="clip", seed=5):
    prepare = InputPreparer(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, prepare.normalize, frame_stride=2).train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs
    outputs = forward(prepare.transfer(inputs), spec)
    piece = {**inputs, "label": torch.tensor([0, 2, 1]), "frame_labels": torch.tensor([[0] * 12 + [1] * 12] * 3)}
    train_cfg = load_config(None, [f"train.chunk_loss={loss}"]).train
    training_loss(outputs, piece, spec, train_cfg, nn.CrossEntropyLoss()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "head, loss, changes",
    [
        ("transformer", "clip", {}),
        ("attention", "clip", {"dropout": 0.5}),
        ("transformer", "dense", {"grad_checkpointing": True}),  # both recomputations nested
    ],
)
def test_recomputed_chunks_with_a_head_give_the_gradients_of_chunks_kept_in_memory(head, loss, changes):
    dropout = changes.pop("dropout", 0.0)
    inputs = clip_batch()
    recomputed = gradients(head_model(head, dropout=dropout, **changes), inputs, ChunkSpec(8, 2, recompute=True), loss)
    kept = gradients(head_model(head, dropout=dropout, **changes), inputs, ChunkSpec(8, 2, recompute=False), loss)
    assert recomputed.keys() == kept.keys()
    assert any(name.startswith("temporal.") for name in recomputed) and any(n.startswith("rgb.") for n in recomputed)
    for name, grad in recomputed.items():
        torch.testing.assert_close(grad, kept[name], rtol=1e-5, atol=1e-7, msg=name)


def test_views_are_fused_per_chunk_before_the_head_and_one_chunk_is_one_token():
    model = head_model(views=3, view_fusion="concat").eval()
    prepare = InputPreparer(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, prepare.normalize)
    inputs = prepare.transfer(clip_batch(views=3))
    with torch.no_grad():
        chunked = forward(inputs, ChunkSpec(8, 0))
        whole = forward(inputs, ChunkSpec(-1))
    assert chunked.chunks.shape == (3, 3, 3) and whole.chunks.shape == (3, 1, 3)  # [B, n, K]
    torch.testing.assert_close(whole.clip, model(prepare.normalize(inputs)))  # one chunk: the plain forward


def test_a_head_trained_on_short_windows_runs_on_a_video_ten_times_longer():
    model = head_model()
    prepare = InputPreparer(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, prepare.normalize).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_cfg = load_config(None).train
    for step in range(3):  # chunks of 32 frames, windows of 64
        inputs = prepare.transfer(clip_batch(length=64, batch=2, seed=step))
        loss = training_loss(
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
    long_clip = prepare(clip_batch(length=64 * 10 + 13, batch=1))  # 21 chunks where training saw 2
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
def test_a_head_counts_its_training_chunks_and_runs_longer_clips_in_windows_of_that_many(kind):
    torch.manual_seed(0)
    head = temporal_head(16, 5, kind=kind, layers=1, stages=2, tcn_layers=3)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, 12:] = False
    head.train()(torch.randn(2, 14, 16), positions_of(14), mask)
    head(torch.randn(1, 9, 16), positions_of(9))
    assert int(head.trained_chunks) == 14 and head.eval().reach() == 14  # the longest real clip, not the last
    video, at = torch.randn(1, 45, 16), positions_of(45)
    with torch.no_grad():
        out = head(video, at)
        starts = temporal.window_starts(45, 14)
        assert starts == [0, 7, 14, 21, 28, 31]  # overlapping by half, the last ending with the video
        windows = [head._forward(video[:, s : s + 14], at[s : s + 14] - at[s, 0]) for s in starts]
        # a chunk's outputs are those of the window it is most central in, that window's positions from its start
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


def test_windows_are_per_clip_so_a_padded_batch_gives_each_clip_its_own_outputs():
    torch.manual_seed(0)
    head = temporal_head(16, 5, layers=1)
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


def test_the_heads_training_length_is_saved_with_its_weights_and_sets_its_inference_windows():
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
    assert models_window(model, "auto") == "windows of 38 chunks, overlapping by half (its longest training clip)"
    assert models_window(model, 100) == "windows of 100 chunks, overlapping by half"
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
            "model.temporal_width=16",
            "model.temporal_attention_heads=2",
        ],
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes=2).eval()
    prepare = InputPreparer(torch.device("cpu"), cfg.data.mean, cfg.data.std)
    runtime = Runtime(torch.device("cpu"), "32")
    spec = InferenceSpec(chunk=8, overlap=2, batch=3, timeline=True)
    streamed = classify_video(
        model, VideoRecord({"video": path}, where=path), cfg.data, spec, runtime, prepare, list(ORDER_CLASSES)
    )
    # the same frames read at once: every second frame, the whole clip through forward_chunked
    reader = open_reader(path, (32, 32))
    clip = torch.from_numpy(reader.read(range(0, reader.num_frames, 2))).permute(3, 0, 1, 2).unsqueeze(0)
    with torch.no_grad():
        whole = forward_chunked(model, prepare({"video": clip}), 8, 2, frame_stride=2)
    probs = whole.logits.softmax(dim=1)[0]
    assert [t["label"] for t in streamed.topk] == [ORDER_CLASSES[int(i)] for i in probs.argsort(descending=True)]
    assert streamed.topk[0]["prob"] == pytest.approx(float(probs.max()), abs=1e-4)
    assert len(streamed.chunk_results) == len(whole.windows) > 5
    for row, chunk_logits in zip(streamed.chunk_results, whole.chunk_logits):
        assert row["prob"] == pytest.approx(float(chunk_logits.softmax(dim=-1).max()), abs=1e-4)


def test_the_planner_counts_the_head():
    base = ["data.img_size=32", "data.num_frames=64", "train.chunk_train_size=16", "train.chunk_train_overlap=0"]
    without = project.config_training_estimate(load_config(None, base), 64, 2)
    cfg = load_config(None, base + ["model.temporal_head=transformer"])
    with_head = project.config_training_estimate(cfg, 64, 2)
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
    accumulated, loader = make_trainer(group_norm_head_model(), 2, 4, tmp_path / "a", **{"train.chunk_train_size": 2})
    loop.train_one_epoch(accumulated, loader)
    whole, loader = make_trainer(group_norm_head_model(), 8, 1, tmp_path / "b", **{"train.chunk_train_size": 2})
    loop.train_one_epoch(whole, loader)
    assert accumulated.state.global_step == whole.state.global_step == 1
    for a, b in zip(weights(accumulated.model), weights(whole.model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_oom_back_off_halves_the_chunks_under_a_head(tmp_path, caplog):
    model = group_norm_head_model()
    features = model.features

    def features_that_fit_two_frames(inputs):
        if inputs["video"].shape[2] > 2:
            raise OutOfMemoryError("CUDA out of memory (simulated)")
        return features(inputs)

    model.features = features_that_fit_two_frames  # clips of 4 frames: only chunks of 2 fit
    backed_off, loader = make_trainer(model, 2, 1, tmp_path / "a", count=8)
    with caplog.at_level("WARNING", logger="longvideo"):
        loop.train_one_epoch(backed_off, loader)
    assert "now chunks of 2 frames" in caplog.text and backed_off.state.chunk_train_size == 2
    reference, loader = make_trainer(
        group_norm_head_model(), 2, 1, tmp_path / "b", count=8, **{"train.chunk_train_size": 2}
    )
    reference.state.micro_splits = 2  # where the back-off went first: 1 clip per forward
    loop.train_one_epoch(reference, loader)
    for a, b in zip(weights(backed_off.model), weights(reference.model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_head_trains_under_autocast():
    model = head_model()
    prepare = InputPreparer(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, prepare.normalize).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = forward(prepare.transfer(clip_batch()), ChunkSpec(8, 0))
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
    with pytest.raises(ConfigError, match="model.temporal_attention_heads=3 must divide model.temporal_width=64"):
        load_config(None, ["model.temporal_head=transformer", "model.temporal_attention_heads=3"])
    with pytest.raises(
        ConfigError,
        match="model.temporal_attention: directional gives half the attention heads "
        "to earlier chunks and half to later ones, but model.temporal_attention_heads is 1",
    ):
        load_config(None, ["model.temporal_head=transformer", "model.temporal_attention_heads=1"])
    assert (
        load_config(
            None,
            [
                "model.temporal_head=transformer",
                "model.temporal_attention_heads=1",
                "model.temporal_attention=bidirectional",
            ],
        ).model.temporal_attention_heads
        == 1
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.temporal_head=transformer", "infer.head_chunks=0"])
    assert str(info.value) == (
        "--set infer.head_chunks=0: infer.head_chunks: 0 chunks cannot hold a chunk; "
        "give a number of chunks, -1 (the whole video) or auto (the head's longest training "
        "clip)"
    )


def test_a_saved_config_keeps_every_value_it_was_trained_with_and_a_key_it_lacks_takes_its_default():
    from config import defaults, saved_config

    saved = defaults()
    saved["model"]["temporal_attention"] = "bidirectional"
    saved["model"]["temporal_contrast"] = False
    saved["train"]["temporal_warmup_epochs"] = 0.0
    del saved["model"]["temporal_running"]
    cfg = saved_config(saved)
    assert cfg.model.temporal_attention == "bidirectional" and cfg.model.temporal_contrast is False
    assert cfg.train.temporal_warmup_epochs == 0.0
    assert cfg.model.temporal_running is defaults()["model"]["temporal_running"]


SHAPE = DataShape(3)  # the checkpoints of these tests: 3 classes, one view


def training_parts(cfg):
    """(model, optimizer, scheduler, scaler) of a 3-class run of ``cfg``, as train.py builds them, seeded."""
    from engine.training.optim import build_optimizer, build_scheduler

    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes=3, num_views=1)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train, 4, 3, has_temporal_head=True)
    return model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False)


def test_resuming_with_settings_other_than_the_checkpoints_names_the_settings_that_changed(tmp_path, caplog):
    """A run started with model.temporal_contrast and train.temporal_warmup_epochs other than the defaults and
    resumed without them: its head no longer fits (one line naming the key and the --set that resumes it, no
    traceback), and a warm-up that would change its schedule is a warning with the --set that keeps it."""
    from artifacts.checkpoint import Checkpoint, CheckpointError, restore_training, save_checkpoint

    head = [
        "model.width=4",
        "model.temporal_head=transformer",
        "model.temporal_width=16",
        "model.temporal_attention_heads=2",
    ]
    then = load_config(None, [*head, "model.temporal_contrast=false", "train.temporal_warmup_epochs=0"])

    model, optimizer, scheduler, scaler = training_parts(then)
    path = str(tmp_path / "last.pt")
    save_checkpoint(
        Checkpoint.of_training(model, optimizer, scheduler, scaler, TrainState(), then, ["a"] * 3, SHAPE), path
    )
    with pytest.raises(CheckpointError) as error:
        restore_training(path, *training_parts(load_config(None, head)), load_config(None, head))
    assert (
        "its model does not fit this config's (model.temporal_contrast); resume with the checkpoint's settings: "
        "--set model.temporal_contrast=false"
        in str(error.value)
        and "\n" not in str(error.value)
    )
    now = load_config(None, [*head, "model.temporal_contrast=false"])
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        restore_training(path, *training_parts(now), now)
    assert "train.temporal_warmup_epochs 0.0 then, 2.0 now" in caplog.text
    assert "--set train.temporal_warmup_epochs=0.0" in caplog.text and "model.temporal_contrast" not in caplog.text


HEAD_RUN = (  # head_run's settings: a small transformer head over chunks of 8 frames
    "model.temporal_head=transformer",
    "model.temporal_width=32",
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
    assert "temporal head transformer, windows of " in result.stdout.splitlines()[0]
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
        "trainer.max_epochs=1",
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


def test_the_refit_bench_trains_a_new_head_on_each_run_s_last_backbone_frozen(monkeypatch, capsys):
    """--part refit: after each run, one with the same settings from the backbone that run ended with (its
    last.pt, kept before its folder goes), frozen; both rows printed."""
    from bench import long_range

    calls = []

    def train_variant(overrides, data, epochs, seed, config, keep=None, kept="best.pt"):
        calls.append({"overrides": overrides, "seed": seed, "keep": keep, "kept": kept})
        if keep:  # what the bench hands on must exist while the second run reads it
            open(keep, "wb").close()
        else:
            pretrained = next(o.split("=", 1)[1] for o in overrides if o.startswith("model.pretrained="))
            assert os.path.exists(pretrained)
        best = 0.5 if keep else 0.75 + seed / 100
        return {"best": best, "last": best, "train_loss": 0.7, "to_0.9": None, "epoch_s": 1.0}

    monkeypatch.setattr(long_range, "train_variant", train_variant)
    monkeypatch.setattr(long_range, "family_data", lambda family, root, modality, n: ("data", ["shape=1"]))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "long_range",
            "--part",
            "refit",
            "--families",
            "match",
            "--modalities",
            "texture",
            "--presets",
            "long-range",
            "--seeds",
            "0,1",
            "--set",
            "a=1",
        ],
    )
    long_range.main()
    assert [c["seed"] for c in calls] == [0, 0, 1, 1]
    for first, again in (calls[:2], calls[2:]):
        assert first["kept"] == "last.pt" and first["overrides"] == ["shape=1", "a=1"]
        assert again["keep"] is None
        assert again["overrides"] == [
            "shape=1",
            "a=1",
            f"model.pretrained={first['keep']}",
            "model.freeze_backbone=true",
        ]
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("match/texture")]
    assert [r[2:] for r in rows] == [
        ["long-range", "0.500", "0.500", "-", "1.0", "0.500,0.500", "0.500,0.500"],
        ["long-range,", "head", "again", "0.755", "0.755", "-", "1.0", "0.750,0.750", "0.760,0.760"],
    ]


def test_the_length_bench_names_an_unknown_family_and_the_scale_bench_measures_a_head_step_alone():
    done = run_in_process(
        ["-m", "bench.length", "--families", "order,odrer"],
    )
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "python -m bench.length: error: --families: unknown odrer; choose from order, middle, last, distractors, twice, "
        "more, match"
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
def test_the_head_trains_in_parameter_groups_of_its_own_at_the_configured_rate():
    from engine.training.optim import build_optimizer, build_scheduler, max_grad_norm

    model = head_model()
    train_cfg = load_config(
        None, ["train.lr=0.004", "train.temporal_lr_scale=0.25", "train.warmup_epochs=1", "train.weight_decay=0.02"]
    ).train
    optimizer = build_optimizer(model, train_cfg)
    head_ids = {id(p) for p in model.temporal.parameters()}
    by_name = {}
    for group in optimizer.param_groups:
        by_name.setdefault(group["name"], []).append(group)
        assert all((id(p) in head_ids) == (group["name"] == "temporal head") for p in group["params"])
        assert group["weight_decay"] == (0.02 if group["params"][0].dim() > 1 else 0.0)
    assert [g["lr"] for g in by_name["model"]] == [0.004, 0.004]
    assert [g["lr"] for g in by_name["temporal head"]] == [0.001, 0.001]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    scheduler = build_scheduler(optimizer, train_cfg, steps_per_epoch=4, max_epochs=3)
    for _ in range(6):  # into the cosine part: the ratio holds
        optimizer.step()
        scheduler.step()
    rates = [g["lr"] for g in optimizer.param_groups]
    assert rates[2] == pytest.approx(rates[0] * 0.25) and 0 < rates[0] < 0.004
    assert max_grad_norm(dataclasses.replace(train_cfg, temporal_grad_clip=1.5), True) == 1.5
    assert max_grad_norm(dataclasses.replace(train_cfg, temporal_grad_clip=1.5), False) is None
    assert max_grad_norm(dataclasses.replace(train_cfg, temporal_grad_clip=1.5, grad_clip=3.0), True) == 3.0


def test_with_a_head_the_warm_up_lasts_at_least_its_own_epochs_and_the_run_says_so(caplog):
    """train.temporal_warmup_epochs: with a head the linear warm-up lasts max(train.warmup_epochs, it) epochs;
    without one train.warmup_epochs as written. The run's first lines give the rates, the clip and the warm-up, and
    say where the head's keys reach the whole model."""
    from engine.training.build import _log_temporal_head_settings
    from engine.training.optim import build_optimizer, build_scheduler

    def rates(train_cfg, has_head: bool, steps: int = 9) -> list[float]:
        model = nn.Linear(2, 2)
        optimizer = build_optimizer(model, train_cfg)
        scheduler = build_scheduler(optimizer, train_cfg, steps_per_epoch=4, max_epochs=20, has_temporal_head=has_head)
        seen = []
        for _ in range(steps):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    short = load_config(None, ["train.lr=0.008", "train.warmup_epochs=0.5"]).train  # temporal_warmup_epochs: 2
    assert rates(short, has_head=False)[:3] == pytest.approx([0.004, 0.008, 0.008], rel=1e-3)
    with_head = rates(short, has_head=True)
    assert with_head[:8] == pytest.approx([0.001 * (i + 1) for i in range(8)])  # 2 epochs of 4 steps
    assert with_head[8] == pytest.approx(0.008, rel=1e-3)
    longer = load_config(None, ["train.lr=0.008", "train.warmup_epochs=3"]).train
    assert rates(longer, True, 12) == pytest.approx([0.008 * (i + 1) / 12 for i in range(12)])
    off = load_config(None, ["train.lr=0.008", "train.warmup_epochs=0", "train.temporal_warmup_epochs=0"]).train
    assert rates(off, True, 2) == pytest.approx([0.008, 0.008], rel=1e-3)

    model = head_model()
    train_cfg = load_config(None, ["train.lr=0.004", "train.temporal_lr_scale=0.25", "train.warmup_epochs=0.5"]).train
    with caplog.at_level(logging.INFO, logger="longvideo"):
        _log_temporal_head_settings(build_optimizer(model, train_cfg), train_cfg, 10)
    assert (
        "learning rates: backbone 4.00e-03, temporal head 1.00e-03 (train.temporal_lr_scale 0.25); gradient "
        "norm clip 1 (train.temporal_grad_clip: the whole model's gradient, the backbone's too; train.grad_clip "
        "unset); warm-up 2 epochs (train.temporal_warmup_epochs, above train.warmup_epochs 0.5: the whole model)"
    ) in caplog.text
    caplog.clear()
    own = load_config(None, ["train.grad_clip=5", "train.warmup_epochs=3"]).train  # the preset's own win: said plainly
    with caplog.at_level(logging.INFO, logger="longvideo"):
        _log_temporal_head_settings(build_optimizer(model, own), own, 10)
    assert "gradient norm clip 5; warm-up 3 epochs\n" in caplog.text


def test_without_a_head_the_optimizer_is_the_one_of_before():
    """model.temporal_head: none (and a scale of 1) gives the two groups the optimizer always had, so training is
    unchanged bit for bit: the same parameters in the same order, the same rates and decays."""
    from engine.training.optim import build_optimizer

    for model, scale in ((head_model("none"), 0.25), (head_model("transformer"), 1.0)):
        train_cfg = load_config(None, [f"train.temporal_lr_scale={scale}"]).train
        groups = build_optimizer(model, train_cfg).param_groups
        before = [[p for p in model.parameters() if p.dim() > 1], [p for p in model.parameters() if p.dim() <= 1]]
        assert [g["params"] for g in groups] == before
        assert [(g["lr"], g["weight_decay"]) for g in groups] == [
            (train_cfg.lr, train_cfg.weight_decay),
            (train_cfg.lr, 0.0),
        ]


def _trainer_at(history, classes=("a", "b", "c"), overrides=("train.temporal_lr_scale=0.5",)):
    from types import SimpleNamespace

    from engine.training.trainer import RunReport

    return SimpleNamespace(
        report=RunReport(),
        has_temporal_head=True,
        runtime=SimpleNamespace(is_main=True),
        class_names=list(classes),
        state=SimpleNamespace(history=history, epoch=len(history), head_refit=False),
        cfg=load_config(None, list(overrides)),
    )


def _head_warnings(caplog, trainer, histories) -> list[str]:
    import logging

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        for history in histories:
            trainer.state.history, trainer.state.epoch = history, history[-1]["epoch"]
            at_chance.warn_if_head_at_chance(trainer)
    return [r.getMessage() for r in caplog.records]


def test_a_head_at_chance_is_said_once_with_the_switches(caplog):
    history = [
        {"epoch": e, "val_clip_acc": acc, "train_loss": 1.1}
        for e, acc in enumerate([0.34, 0.333, 0.36, 0.333], start=1)
    ]
    trainer = _trainer_at(history[:2])
    # two validations: not yet; three: said; four: not again
    warnings = _head_warnings(caplog, trainer, [history[:2], history[:3], history])
    assert len(warnings) == 1 and warnings[0].startswith(
        "epoch 3: validation accuracy has stayed at chance (0.333) "
        "for 3 validations with the temporal head on; a head that "
        "does not learn usually trains too fast"
    )
    assert "train.temporal_lr_scale (now 0.5)" in warnings[0] and "model.temporal_width (now 64" in warnings[0]
    assert "train.temporal_warmup_epochs (now 2)" in warnings[0]
    again = "a new head on this run's last backbone, frozen, can find what this one misses"
    assert again in warnings[0] and "model.freeze_backbone: true" in warnings[0]
    events, head = "model.temporal_event_contrast: true", "model.temporal_head=transformer"
    trains = _trainer_at(history, overrides=("train.temporal_lr_scale=0.5", head))
    assert events not in _head_warnings(caplog, trains, [history])[0]  # the event contrast did not help there
    for elsewhere in ("model.freeze_backbone=true", "data.features_dir=features", "model.adapter=side"):
        # no backbone trains here: there is no run's backbone to start a new head on, and the head's inputs are
        # fixed features, where the event contrast gives it kinds of event that lie close together
        frozen = _trainer_at(history, overrides=("train.temporal_lr_scale=0.5", head, elsewhere))
        said = _head_warnings(caplog, frozen, [history])[0]
        assert again not in said and (events in said) == (elsewhere != "model.adapter=side")  # adapters move them
    with_it = ("model.temporal_head=transformer", "model.freeze_backbone=true", "model.temporal_event_contrast=true")
    assert events not in _head_warnings(caplog, _trainer_at(history, overrides=with_it), [history])[0]
    learning = history[:2] + [{"epoch": 3, "val_clip_acc": 0.5, "train_loss": 1.0}]
    assert not _head_warnings(caplog, _trainer_at(learning), [learning])


def test_a_timeline_head_is_judged_by_its_frames_not_its_clips_majority_label(caplog):
    """With dense chunk labels a clip's one label is only its majority's: a head whose frames are right is not at
    chance when that label is, and one whose frames are at chance is, said of its frame accuracy."""
    learning = [{"epoch": e, "val_clip_acc": 0.333, "val_seg_frame_acc": 0.75, "train_loss": 1.1} for e in (1, 2, 3)]
    assert not _head_warnings(caplog, _trainer_at(learning, overrides=["train.chunk_loss=dense"]), [learning])
    blind = [{**row, "val_clip_acc": 0.9, "val_seg_frame_acc": 0.35} for row in learning]
    warnings = _head_warnings(caplog, _trainer_at(blind, overrides=["train.chunk_loss=dense"]), [blind])
    assert len(warnings) == 1 and warnings[0].startswith("epoch 3: validation frame accuracy has stayed at chance")


def test_a_head_that_fits_its_training_clips_at_chance_is_told_so_once_more(caplog):
    """Training loss under half of chance's (ln classes) while validation stays at chance: the head fits the
    training clips, and the advice is data and chunking, not the learning rate; said once, after the first."""
    rows = [
        {"epoch": e, "val_clip_acc": 0.333, "train_loss": loss}
        for e, loss in enumerate([1.1, 1.1, 1.05, 0.8, 0.5, 0.3, 0.2], start=1)
    ]
    trainer = _trainer_at(rows[:3], overrides=["train.chunk_train_size=4"])
    warnings = _head_warnings(caplog, trainer, [rows[:k] for k in range(3, 8)])
    assert len(warnings) == 2
    assert "trains too fast" in warnings[0] and "fits the training clips" not in warnings[0]
    assert warnings[1].startswith(
        "epoch 5: validation accuracy has stayed at chance (0.333) for 3 validations with "
        "the temporal head on while the label's training loss fell to 0.500 (chance: 1.099): it "
        "fits the training clips, not the task"
    )
    assert "more training videos" in warnings[1] and "train.chunk_train_size, now 4" in warnings[1]
    assert "model.chunk_reconstruction: 1.0 (configs/long-range-relations.yaml)" in warnings[1]
    # a head on features: its chunks are the ones the features were written with, not train.chunk_train_size
    on_features = _trainer_at(rows, overrides=["data.features_dir=feats"])
    fitting = _head_warnings(caplog, on_features, [rows])
    assert len(fitting) == 1 and "fewer, longer chunks (infer_chunked.py --features --chunk)" in fitting[0]
    assert "train.chunk_train_size" not in fitting[0] and "temporal_attention" not in fitting[0]
    assert "chunk_reconstruction" not in fitting[0]  # no backbone trains on features
    # with the chunk reconstruction, the label's loss alone tells fitting from not learning: its own part is no
    # measure of the label (3.4-3.9 on the task families with the colour_edges_motion target)
    reconstructed = [
        {**row, "train_loss": row["train_loss"] + 3.0, "train_label_loss": row["train_loss"]} for row in rows
    ]
    told = _head_warnings(
        caplog, _trainer_at(reconstructed, overrides=["model.chunk_reconstruction=1"]), [reconstructed]
    )
    assert len(told) == 1 and "the label's training loss fell to 0.200" in told[0]


def test_a_transformer_head_at_chance_is_told_to_make_its_attention_directional_and_contrasted(caplog):
    rows = [{"epoch": e, "val_clip_acc": 0.5, "train_loss": loss} for e, loss in enumerate([0.7, 0.7, 0.69], 1)]
    for attention, told in (("bidirectional", True), ("directional", False)):
        trainer = _trainer_at(
            rows, ("a", "b"), ["model.temporal_head=transformer", f"model.temporal_attention={attention}"]
        )
        warnings = _head_warnings(caplog, trainer, [rows])
        assert len(warnings) == 1 and "trains too fast" in warnings[0]
        assert ("first set model.temporal_attention: directional (now bidirectional" in warnings[0]) == told
    # a transformer without its contrast is told to turn it on first, beside the attention when both are off
    for changes, first in (
        (["model.temporal_contrast=false"], "first set model.temporal_contrast: true (now false"),
        (
            ["model.temporal_contrast=false", "model.temporal_attention=bidirectional"],
            "first set model.temporal_attention: directional (now bidirectional) and "
            "model.temporal_contrast: true (now false) (docs/long-videos.md, Temporal context across "
            "chunks)",
        ),
    ):
        warnings = _head_warnings(
            caplog, _trainer_at(rows, ("a", "b"), ["model.temporal_head=transformer", *changes]), [rows]
        )
        assert len(warnings) == 1 and first in warnings[0]
    attention_head = _head_warnings(
        caplog,
        _trainer_at(rows, ("a", "b"), ["model.temporal_head=attention", "model.temporal_contrast=false"]),
        [rows],
    )
    assert "temporal_contrast" not in attention_head[0]  # the transformer's only


def test_chance_allows_for_the_luck_of_a_small_validation_set(caplog):
    """48 clips of 2 classes: two standard errors of a guess are 0.144, so 0.58 is chance and 0.66 is not; with
    4,800 clips the 0.05 floor holds (0.58 is learning)."""

    def history(acc, clips):
        return [{"epoch": e, "val_clip_acc": acc, "val_num_clips": clips, "train_loss": 0.69} for e in (1, 2, 3)]

    said = {
        (acc, clips): bool(_head_warnings(caplog, _trainer_at(history(acc, clips), ("a", "b")), [history(acc, clips)]))
        for acc, clips in [(0.58, 48), (0.66, 48), (0.54, 4800), (0.58, 4800)]
    }
    assert said == {(0.58, 48): True, (0.66, 48): False, (0.54, 4800): True, (0.58, 4800): False}


def test_resuming_with_the_other_group_layout_says_which_setting_to_use(tmp_path):
    """A checkpoint whose head trained at the backbone's rate (one pair of groups), resumed with a scale of its
    own (the head's own groups), and the other way round: one clear error naming the key, not torch's "different
    number of parameter groups" (without the checkpoint's config, the scale it needs cannot be named: the line
    says what goes there)."""
    from artifacts.checkpoint import Checkpoint, CheckpointError, restore_training, save_checkpoint
    from engine.training.optim import build_optimizer

    model = head_model()
    one_rate = build_optimizer(model, load_config(None, []).train)  # the default: 1
    path = str(tmp_path / "last.pt")
    save_checkpoint(Checkpoint(model.state_dict(), {}, [], SHAPE, optimizer=one_rate.state_dict()), path)
    own_rate = build_optimizer(model, load_config(None, ["train.temporal_lr_scale=0.3"]).train)
    with pytest.raises(
        CheckpointError,
        match=r"last\.pt: its optimizer has 2 parameter groups, this config's has 4 "
        r"\(.*\); resume with the checkpoint's setting: --set train\.temporal_lr_scale=1$",
    ):
        restore_training(path, model, own_rate, None, None)
    save_checkpoint(Checkpoint(model.state_dict(), {}, [], SHAPE, optimizer=own_rate.state_dict()), path)
    with pytest.raises(
        CheckpointError,
        match=r"its optimizer has 4 parameter groups, this config's has 2 \(.*\); resume with the checkpoint's "
        r"setting: --set train\.temporal_lr_scale=<the scale it trained with, not 1: the config\.yaml of its run "
        r"says it>$",
    ):
        restore_training(path, model, one_rate, None, None)


def test_a_run_from_before_the_relation_defaults_resumes_with_the_settings_the_errors_name(tmp_path):
    """A run begun with the head's defaults before 2026-11-26 (no running sum, dropout 0.1, the head at 0.3 of the
    backbone's rate) resumed with today's: its model no longer fits, and the one line says every setting that
    resumes it; given only the model's, the optimizer's groups name the rate the run had. A run begun with the
    chunk reconstruction (a default from 2026-11-26 to 2026-11-27) is named its weight the same way."""
    from artifacts.checkpoint import Checkpoint, CheckpointError, restore_training, save_checkpoint

    head = ["model.width=4", "model.temporal_head=transformer", "model.temporal_width=16"]
    before = ["model.temporal_running=false", "model.temporal_dropout=0.1", "train.temporal_lr_scale=0.3"]

    then = load_config(None, head + before)
    path = str(tmp_path / "last.pt")
    save_checkpoint(Checkpoint.of_training(*training_parts(then), TrainState(), then, ["a", "b", "c"], SHAPE), path)
    today = load_config(None, head)
    with pytest.raises(CheckpointError) as error:
        restore_training(path, *training_parts(today), today)
    message = str(error.value)
    assert "its model does not fit this config's (model.temporal_running, model.temporal_dropout); " in message
    assert "resume with the checkpoint's settings: " + " ".join(f"--set {s}" for s in before) in message
    assert "\n" not in message

    model_only = load_config(None, head + before[:2])
    with pytest.raises(
        CheckpointError, match=r"resume with the checkpoint's setting: --set train\.temporal_lr_scale=0\.3$"
    ):
        restore_training(path, *training_parts(model_only), model_only)
    resumed = load_config(None, head + before)
    state, _ = restore_training(path, *training_parts(resumed), resumed)  # the settings named resume it
    assert state.epoch == TrainState().epoch

    with_decoder = load_config(None, head + ["model.chunk_reconstruction=1.0"])
    save_checkpoint(
        Checkpoint.of_training(*training_parts(with_decoder), TrainState(), with_decoder, ["a", "b", "c"], SHAPE), path
    )
    with pytest.raises(
        CheckpointError,
        match=r"\(model\.chunk_reconstruction\); resume with the checkpoint's settings: --set model\.chunk_reconstruction=1\.0: ",
    ):
        restore_training(path, *training_parts(today), today)
