"""The one loader of a trained model, shared by eval.py, ``eval.py --watch`` and infer_chunked.py.

A checkpoint of a temporal head trained on features (``data.features_dir``) is one half of a model: it records the
backbone checkpoint its features came from (path and sha256), and is loaded paired with it: the backbone's network,
data settings and chunking, the head's weights, classes and timeline settings.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import torch

from artifacts.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from config import Config, derive, saved_config
from core.errors import ConfigError
from core.files import file_sha256
from datasets.shape import DataShape
from models import ModelConfigError, build_feature_head, build_model

HEAD_DATA_KEYS = (
    "data_dir",
    "train_manifest",
    "val_manifest",
    "test_manifest",
    "val_fraction",
    "class_names",
    "background_labels",
)


class CheckpointSummary(NamedTuple):
    """What the scripts read of a checkpoint besides its weights, config and classes."""

    epoch: int | None
    global_step: int | None
    shape: DataShape  # the data it trained on: classes, camera views, keypoints
    backbone: str | None = None  # a head trained on features: the backbone checkpoint it runs with
    # a head trained on features that came with their dataset (MS-TCN's layout): where they are, no backbone
    features: dict | None = None

    @classmethod
    def of(
        cls, ckpt: Checkpoint, shape: DataShape | None = None, backbone: str | None = None, features: dict | None = None
    ) -> CheckpointSummary:
        return cls(ckpt.state.epoch, ckpt.state.global_step, shape or ckpt.shape, backbone, features)


class TrainedModel(NamedTuple):
    """A checkpoint made a model for evaluation."""

    model: torch.nn.Module  # in eval mode, on the device asked for
    cfg: Config  # the checkpoint's config
    class_names: list
    checkpoint: CheckpointSummary


def load_trained_model(path: str, device: torch.device, backbone: str | None = None) -> TrainedModel:
    """The checkpoint at ``path`` as a model in eval mode on ``device``, with its config, class names and summary. A
    head trained on features is paired with its backbone: ``backbone`` (--backbone), else the checkpoint it
    records."""
    ckpt = load_checkpoint(path)
    cfg = _config_of(path, ckpt)
    if ckpt.features_source is not None and ckpt.features_source.get("format") == "mstcn":
        return _head_alone(path, ckpt, cfg, device, backbone)
    if ckpt.features_source is not None:
        return _paired(path, ckpt, cfg, device, backbone)
    if backbone is not None:
        raise CheckpointError(
            f"{path}: --backbone {backbone} pairs a temporal head trained on features with its "
            f"backbone, but this checkpoint is a whole model; leave --backbone out"
        )
    summary = CheckpointSummary.of(ckpt)
    model = _built(path, cfg, summary.shape, ckpt.frozen_weights is not None)
    try:
        dataclasses.replace(ckpt, model=_without_decoder(ckpt.model)).load_into(model, path)
    except RuntimeError as e:
        raise CheckpointError(
            f"{path}: weights do not match model.backbone={cfg.model.backbone}: {str(e).splitlines()[0]}"
        )
    return TrainedModel(model.to(device).eval(), cfg, list(ckpt.class_names), summary)


def _config_of(path: str, ckpt: Checkpoint) -> Config:
    try:
        return saved_config(ckpt.config)
    except ConfigError as e:
        raise CheckpointError(f"{path}: its config does not fit this version of the code: {e}")


def _built(path: str, cfg: Config, shape: DataShape, frozen_elsewhere: bool = False):
    # the trained weights replace any pretrained ones: do not fetch those again (the arguments of the build, not a
    # config: model.norm: frozen without pretrained weights is refused as a config, rightly), unless the checkpoint
    # holds adapters without the frozen backbone they adapt (``frozen_elsewhere``: model.pretrained gives it); and
    # no chunk reconstruction decoder: it trains beside the backbone and evaluation never runs it (a head trained on
    # features, paired with its backbone, never had one)
    pretrained = cfg.model.pretrained if frozen_elsewhere else None
    try:
        return build_model(
            dataclasses.replace(cfg.model, pretrained=pretrained, chunk_reconstruction=0.0),
            **shape.model_args(),
        )
    except ModelConfigError as e:
        raise CheckpointError(f"{path}: its model section cannot be built: {e}")


def _paired(
    path: str, head_state: Checkpoint, head_cfg: Config, device: torch.device, backbone: str | None
) -> TrainedModel:
    """The backbone checkpoint the head's features came from, its sha256 checked, with the head in place of its
    classifier; the config: the backbone's, with the head's model.temporal_* and timeline settings, and the
    features' chunking (what the head was trained on)."""
    source = head_state.features_source
    wanted = source["checkpoint_sha256"]
    backbone_path = backbone or source.get("checkpoint") or ""
    if not backbone_path or not os.path.exists(backbone_path):
        where = f"it was at {backbone_path}, now missing" if backbone_path else "its path was not recorded"
        raise CheckpointError(
            f"{path}: a temporal head trained on the features of backbone checkpoint sha256 "
            f"{wanted[:12]}... ({where}); give that checkpoint with --backbone PATH"
        )
    actual = file_sha256(backbone_path)
    if actual != wanted:
        raise CheckpointError(
            f"{path}: refused: its temporal head was trained on the features of backbone sha256 "
            f"{wanted[:12]}..., but {backbone_path} is sha256 {actual[:12]}... (another backbone, "
            f"or one trained further); give the checkpoint that wrote the features with --backbone, "
            f"or train the head again on this one's features"
        )
    backbone_state = load_checkpoint(backbone_path)
    backbone_cfg = _config_of(backbone_path, backbone_state)
    # decoding and geometry as the features were made; the videos, labels and timeline settings of the head's run,
    # each video whole (the head was trained over whole videos), which evaluation streams from the file
    changes = {
        f"model.{f.name}": getattr(head_cfg.model, f.name)
        for f in dataclasses.fields(head_cfg.model)
        if f.name.startswith("temporal_")
    }
    changes.update(
        {
            "infer.chunk_size": int(source["chunk"]),
            "infer.chunk_overlap": int(source["overlap"]),
            "infer.head_chunks": head_cfg.infer.head_chunks,
            "data.num_frames": -1,
            "data.max_video_frames": None,
            **{f"data.{key}": getattr(head_cfg.data, key) for key in HEAD_DATA_KEYS},
        }
    )
    try:
        cfg = derive(backbone_cfg, changes, f"{path}: its head on the backbone {backbone_path}")
    except ConfigError as e:
        raise CheckpointError(str(e))
    class_names = list(head_state.class_names)
    shape = dataclasses.replace(backbone_state.shape, num_classes=len(class_names))
    model = _built(path, cfg, shape, backbone_state.frozen_weights is not None)
    weights = {
        k: v
        for k, v in _without_decoder(backbone_state.model).items()
        if not k.startswith(("classifier.", "temporal."))
    }
    weights.update(head_state.model)  # the head's "temporal.*"
    try:
        dataclasses.replace(backbone_state, model=weights).load_into(model, backbone_path)
    except RuntimeError as e:
        raise CheckpointError(
            f"{path} with {backbone_path}: the head does not fit the backbone: {str(e).splitlines()[0]}"
        )
    summary = CheckpointSummary.of(head_state, shape, backbone_path)
    return TrainedModel(model.to(device).eval(), cfg, class_names, summary)


def _without_decoder(weights: dict) -> dict:
    """A training checkpoint's weights less the chunk reconstruction's decoder (``_built`` builds none)."""
    return {k: v for k, v in weights.items() if not k.startswith("reconstruction.")}


def _head_alone(path: str, ckpt: Checkpoint, cfg: Config, device: torch.device, backbone: str | None) -> TrainedModel:
    """A head trained on the features MS-TCN's layout came with: no backbone to pair, it runs on those features
    (eval.py scores it on its split's test videos)."""
    source = ckpt.features_source
    if backbone is not None:
        raise CheckpointError(
            f"{path}: --backbone {backbone}: this head was trained on the features of an MS-TCN dataset "
            f"({source['dataset']}), not on a backbone's of this project; leave --backbone out"
        )
    class_names = list(ckpt.class_names)
    try:
        model = build_feature_head(cfg.model, int(source["feature_dim"]), len(class_names))
        model.load_state_dict(ckpt.model)
    except (ModelConfigError, RuntimeError) as e:
        raise CheckpointError(f"{path}: its head cannot be rebuilt: {str(e).splitlines()[0]}")
    summary = CheckpointSummary.of(ckpt, DataShape(len(class_names)), features=source)
    return TrainedModel(model.to(device).eval(), cfg, class_names, summary)
