"""The one loader of a trained model, shared by eval.py, ``eval.py --watch`` and infer_chunked.py."""
from __future__ import annotations

import dataclasses

import torch

from artifacts.checkpoint import CheckpointError, load_checkpoint
from config import saved_config
from core.errors import ConfigError
from datasets.shape import DataShape
from models import ModelConfigError, build_model


def load_trained_model(path: str, device: torch.device):
    """(model in eval mode on ``device``, the checkpoint's config, class names, the checkpoint dict)."""
    state = load_checkpoint(path)
    try:
        cfg = saved_config(state["config"])
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{path}: its config does not fit this version of the code: {e}")
    class_names = list(state["class_names"])
    # the trained weights replace any pretrained ones: do not fetch those again
    model_cfg = dataclasses.replace(cfg.model, pretrained=None)
    try:
        model = build_model(model_cfg, **DataShape.of_checkpoint(state).model_args())
    except ModelConfigError as e:
        raise CheckpointError(f"{path}: its model section cannot be built: {e}")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match model.backbone={cfg.model.backbone}: "
                              f"{str(e).splitlines()[0]}")
    return model.to(device).eval(), cfg, class_names, state
