"""Model registry: ``build_model(cfg, ...)`` turns the ``model`` section of a config into a classifier.

Every model is a :class:`models.classifier.VideoClassifier`: an RGB backbone and/or a keypoint branch,
optional fusion of camera views, and one linear classifier. All expose ``features(inputs)`` and
``classify(features)`` (so chunked inference can aggregate logits or features), ``min_frames`` and
``set_recompute_blocks()``. Inputs are dicts: ``{"video": [B, C, T, H, W] or [B, V, C, T, H, W]
float, "kpt": [B, T, J, C] float}``.
"""

from __future__ import annotations

from torch import nn

from config import ModelConfig
from core.runtime import unwrap_model
from models import tiny3d, torchvision_video, vgg3d  # noqa: F401  (importing them registers the backbones)
from models.classifier import VideoClassifier
from models.external import build_external, is_external
from models.keypoint import KeypointTCN
from models.norms import batch_norms, convert_norms
from models.pretrained import load_pretrained
from models.registry import ModelConfigError, build_registered, registered_names
from models.temporal import FeatureHead, TemporalHead

__all__ = [
    "ModelConfigError",
    "build_feature_head",
    "build_model",
    "build_rgb_backbone",
    "registered_names",
    "set_head_chunks",
    "temporal_head_of",
]


def build_rgb_backbone(name: str, width: int = 32) -> nn.Module:
    """A registered backbone (models/registry.py), or one of an optional package: timm/<name>, hf/<directory or
    hub name> (models/external.py)."""
    return build_external(name) if is_external(name) else build_registered(name, width)


def build_model(model_cfg: ModelConfig, num_classes: int, num_views: int = 1, kpt_shape: tuple[int, int] | None = None):
    """The classifier for a config's ``model`` section, its BatchNorm layers converted as model.norm says
    (``sync`` is converted by the engine, which knows whether torchrun started more than one process).

    num_views: camera views per sample (from the data); kpt_shape: (joints, channels) of the keypoints.
    """
    input_type = model_cfg.input_type
    rgb = build_rgb_backbone(model_cfg.backbone, model_cfg.width) if input_type in ("rgb", "rgb_kpt") else None
    kpt = None
    if input_type in ("kpt", "rgb_kpt"):
        if kpt_shape is None:
            raise ModelConfigError(f"model.input_type={input_type} needs keypoints, but the data has none")
        kpt = KeypointTCN(num_joints=kpt_shape[0], channels=kpt_shape[1], width=model_cfg.width * 2)
    norm, branches = model_cfg.norm, [b for b in (rgb, kpt) if b is not None]
    converted = sum(convert_norms(b, norm) for b in branches) if norm in ("frozen", "group") else 0
    if norm != "batch" and not converted and not any(batch_norms(b) for b in branches):
        raise ModelConfigError(
            f"model.norm: {norm}: {model_cfg.backbone} has no BatchNorm layer to convert (it "
            f"normalizes with LayerNorm, which the batch size does not affect); use norm: batch"
        )
    if rgb is not None and model_cfg.pretrained is not None:
        load_pretrained(rgb, model_cfg.pretrained, model_cfg.backbone, norm)
    model = VideoClassifier(
        rgb=rgb,
        kpt=kpt,
        num_classes=num_classes,
        view_fusion=model_cfg.view_fusion,
        num_views=num_views,
        temporal=None if model_cfg.temporal_head == "none" else model_cfg.temporal_head,
        freeze_backbone=model_cfg.freeze_backbone,
        reconstruction=model_cfg.chunk_reconstruction,
        adapter=None if model_cfg.adapter == "none" else model_cfg.adapter,
    )
    model.set_recompute_blocks(model_cfg.recompute_blocks)
    return model


def temporal_head_of(model: nn.Module) -> TemporalHead | None:
    """The one answer to "does this model have a temporal head?": its TemporalHead, or None. The same for a
    VideoClassifier, a FeatureHead (both hold it as ``temporal``) and either under DDP, torch.compile or the
    training forward's wrapper."""
    return getattr(unwrap_model(model), "temporal", None)


def set_head_chunks(model: nn.Module, chunks: int | str) -> str:
    """Set the most chunks ``model``'s temporal head sees at once at inference (infer.head_chunks); what it
    will do, in words ("" without a head)."""
    head = temporal_head_of(model)
    if head is None:
        return ""
    head.chunks_at_once = chunks
    reach = head.reach()
    if reach is None:
        return "whole videos at once" + (" (it has not been trained)" if chunks == "auto" else "")
    return f"spans of {reach} chunks, overlapping by half" + (
        " (its longest training clip)" if chunks == "auto" else ""
    )


def build_feature_head(model_cfg: ModelConfig, feature_dim: int, num_classes: int) -> FeatureHead:
    """The temporal head alone, for training on features (data.features_dir)."""
    if model_cfg.temporal_head == "none":
        raise ModelConfigError(
            "data.features_dir trains a temporal head on features, but model.temporal_head is "
            "none; set it to tcn, transformer or attention"
        )
    return FeatureHead(feature_dim, num_classes, model_cfg.temporal_head)
