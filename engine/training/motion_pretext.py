"""train.objective: motion: a backbone that learns motion from videos without labels.

Each training chunk of a clip gets a patch of the clip's own footage pasted in, moving in a straight line in a
direction drawn at random over the frames it is seen; the model reads the direction back from the chunk (its two
outputs are the direction's unit vector, the loss one minus their cosine). Appearance alone cannot answer: the same
patch goes any way, and only the order of its positions across the frames tells which. The labels of the manifest
are not read, and the checkpoint is a backbone that model.pretrained gives to any preset with that backbone.
"""

from __future__ import annotations

import dataclasses
import math
import random
from functools import partial
from typing import Callable, NamedTuple

import torch
from torch import nn

from config import Config, TrainConfig, derive
from core.errors import ConfigError
from engine.data.loaders import GuardedBatches
from engine.inference.chunks import chunk_windows, clip_length
from engine.training.chunked_forward import ChunkSpec, seed_of
from engine.training.step import training_losses

DIRECTIONS = ("direction_x", "direction_y")  # the model's two outputs: the unit vector of the patch's motion
WITHIN = math.cos(math.pi / 8)  # a direction read within 22.5 degrees: the right one of 8 compass points
MIN_CHUNK_FRAMES = 4  # a direction needs positions in a few frames to be read at all
PATCH_SIDE = (0.15, 0.35)  # the patch's side, a share of the frame's shorter side
REACH = (0.3, 1.0)  # how far it travels, a share of the way the frame leaves it
GAIN = (0.6, 1.4)  # its brightness against where it was cut from: not a copy to find by matching
# what the objective sets, whatever the preset said: the chunks are the samples, each with its own direction
SETTINGS = {
    "model.temporal_head": "none",
    "model.chunk_reconstruction": 0.0,
    "model.freeze_backbone": False,
    "model.adapter": "none",
    "train.chunk_loss": "clip",
    "train.chunk_train_overlap": 0,  # a chunk's patch stays inside its chunk
    "train.feature_bank": "off",
    "train.monitor": "val_direction_acc",
    "data.class_names": list(DIRECTIONS),
    "data.flip_label_pairs": None,  # a flip turns a clip, and its patch is pasted after it
    "data.background_labels": [],
}


def motion_config(cfg: Config) -> Config:
    """``cfg`` as train.objective: motion runs it (SETTINGS); a clip or chunk too short to show motion, or inputs
    other than one camera's frames, are refused in one line."""
    if cfg.train.objective != "motion":
        return cfg
    if cfg.data.features_dir is not None:
        raise ConfigError("train.objective: motion trains a backbone on frames; set data.features_dir: null")
    if cfg.model.input_type != "rgb":
        raise ConfigError(
            f"model.input_type: {cfg.model.input_type}: train.objective: motion trains a backbone on frames alone; "
            f"set model.input_type: rgb (the backbone's weights then go to an rgb_kpt model as well)"
        )
    if cfg.model.view_fusion != "none":
        raise ConfigError(
            f"model.view_fusion: {cfg.model.view_fusion}: train.objective: motion reads one camera's frames; set "
            f'model.view_fusion: none and give each camera\'s video a manifest line of its own ({{"video": ...}})'
        )
    for key, value in (
        ("train.chunk_train_size", cfg.train.chunk_train_size),
        ("data.num_frames", cfg.data.num_frames),
    ):
        if value != -1 and value < MIN_CHUNK_FRAMES:
            raise ConfigError(
                f"{key}: {value}: train.objective: motion needs {MIN_CHUNK_FRAMES} frames at least in each training "
                f"chunk to show a motion; set {key} to {MIN_CHUNK_FRAMES} or more"
            )
    return derive(cfg, SETTINGS, "train.objective: motion")


def paste_moving_patches(video: torch.Tensor, chunks: list, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``video`` [B, C, T, H, W] uint8 with a moving patch pasted into each chunk window of each clip (a copy; the
    input is not changed), and each patch's direction [B, n, 2] (x right, y down) on ``video``'s device. ``seed``
    draws everything: a recomputed or resumed step pastes the same patches."""
    if video.dim() != 5:
        raise ConfigError("train.objective: motion reads one camera's frames; a run with several views cannot use it")
    generator = random.Random(seed)  # not torch's: the planner runs this under fake tensors
    uniform, integer = generator.uniform, generator.randint  # integer: [low, high]

    batch, _, frames, height, width = video.shape
    out = video.clone()
    directions = torch.empty(batch, len(chunks), 2)
    short = min(height, width)
    for j, (start, end) in enumerate(chunks):
        length = end - start
        for i in range(batch):
            side = integer(max(2, round(PATCH_SIDE[0] * short)), max(2, round(PATCH_SIDE[1] * short)))
            angle, reach = uniform(0, 2 * math.pi), uniform(*REACH)
            shown = integer(min(3, length), length)  # the frames the patch is seen in
            dx, dy = math.cos(angle) * reach * (width - side), math.sin(angle) * reach * (height - side)
            t, sy, sx = integer(0, frames - 1), integer(0, height - side), integer(0, width - side)
            patch = (video[i, :, t, sy : sy + side, sx : sx + side].float() * uniform(*GAIN)).clamp(0, 255)
            patch = patch.to(video.dtype)
            # a start from which the whole path stays inside the frame
            x0 = uniform(max(0.0, -dx), (width - side) - max(0.0, dx))
            y0 = uniform(max(0.0, -dy), (height - side) - max(0.0, dy))
            first = start + integer(0, length - shown)
            for k in range(shown):
                f = k / max(1, shown - 1)
                px, py = round(x0 + dx * f), round(y0 + dy * f)
                out[i, :, first + k, py : py + side, px : px + side] = patch
            directions[i, j, 0], directions[i, j, 1] = math.cos(angle), math.sin(angle)
    return out, directions.to(video.device)


class MotionOutput(NamedTuple):
    predicted: torch.Tensor  # [B, n, 2]: each chunk's direction as the model reads it (any length)
    directions: torch.Tensor  # [B, n, 2]: the pasted ones, unit vectors


class MotionPretextForward(nn.Module):
    """The training forward of train.objective: motion: ``forward`` (a ChunkedTrainingForward around a classifier
    of two outputs and no temporal head) over the clip with its patches pasted, one per training chunk. Its
    ``module`` is the classifier, as for the plain training forward: checkpoints hold the classifier alone."""

    def __init__(self, forward: nn.Module):
        super().__init__()
        self.forward_chunks = forward

    @property
    def module(self) -> nn.Module:
        return self.forward_chunks.module

    def forward(self, inputs: dict, spec: ChunkSpec, samples: torch.Tensor | None = None) -> MotionOutput:
        chunks = chunk_windows(clip_length(inputs), spec.size, 0)
        video, directions = paste_moving_patches(inputs["video"], chunks, spec.draw)
        outputs = self.forward_chunks({**inputs, "video": video}, dataclasses.replace(spec, overlap=0))
        return MotionOutput(outputs.chunks, directions)


def objective_forward(forward: nn.Module, objective: str) -> nn.Module:
    """The training forward of ``objective`` (train.objective) around ``forward``, the classifier's
    ChunkedTrainingForward: that forward itself for labels, a MotionPretextForward around it for motion."""
    return MotionPretextForward(forward) if objective == "motion" else forward


def objective_losses(train_cfg: TrainConfig, criterion: nn.Module) -> Callable:
    """The losses of train.objective, ``(outputs, piece, spec) -> (loss, auxiliary loss or None)``: the label's
    (``criterion`` as train.chunk_loss says, with the forward's auxiliary loss) or, for motion, the direction's."""
    if train_cfg.objective == "motion":
        return motion_losses
    return partial(training_losses, train_cfg=train_cfg, criterion=criterion)


def motion_losses(outputs: MotionOutput, piece: dict, spec: ChunkSpec) -> tuple[torch.Tensor, None]:
    """(one minus the cosine of each chunk's read and pasted directions, averaged; no auxiliary loss)."""
    return (1 - cosines(outputs)).mean(), None


def cosines(outputs: MotionOutput) -> torch.Tensor:
    predicted = nn.functional.normalize(outputs.predicted.float(), dim=-1)
    return (predicted * outputs.directions).sum(-1)


@torch.inference_mode()
def evaluate_motion(
    forward: MotionPretextForward, loader, inputs, runtime, chunk_size: int, seed: int, bad_inputs=None
) -> dict:
    """The objective on held-out clips, the same patches every time (drawn from ``seed`` and each batch's place):
    its loss, and the share of chunks whose direction is read within 22.5 degrees (``direction_acc``). A file that
    cannot be read is skipped or raised as data.on_bad_video says, and reported to ``bad_inputs``."""
    forward.eval()
    loss, right, chunks, clips = 0.0, 0, 0, 0
    for index, batch in enumerate(GuardedBatches(loader, bad_inputs)):
        if bad_inputs is not None:
            bad_inputs.take(batch)
        spec = ChunkSpec(chunk_size, 0, recompute=False, draw=seed_of(seed, index))
        with runtime.autocast():
            outputs = forward(inputs.transfer(batch), spec)
        cos = cosines(outputs)
        loss += float((1 - cos).sum())
        right += int((cos > WITHIN).sum())
        chunks += cos.numel()
        clips += len(cos)
    forward.train()
    if not chunks:
        return {"loss": float("nan"), "direction_acc": float("nan"), "num_clips": 0}
    return {"loss": loss / chunks, "direction_acc": right / chunks, "num_clips": clips, "num_chunks": chunks}
