"""Backbones users already have, beside torchvision's video models: a timm image model applied to every frame of
a chunk (``model.backbone: timm/<name>``), and a Hugging Face ``transformers`` video model (``hf/<name or local
directory>``: VideoMAE, V-JEPA 2). Both are optional extras (requirements-backbones.txt): importing this module
needs neither; building one without its package is a one-line error.

Each takes the chunk as every backbone here does ([B, C, T, H, W], normalized) and returns one feature vector a
chunk [B, D], so the chunked forwards, the temporal head, the planner and ``--features`` treat them alike.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from config import EXTERNAL_BACKBONES, external_package_missing
from models.adapters import AdapterPoints
from models.registry import ModelConfigError


def is_external(name: str) -> bool:
    return name.startswith(tuple(EXTERNAL_BACKBONES))


def in_recomputation() -> bool:
    """Is this forward a recomputation in backward (gradient checkpointing)? Autograd runs it inside a graph task."""
    return torch._C._current_graph_task_id() != -1


def keep_statistics_in_recomputation(module: nn.Module) -> None:
    """BatchNorm layers of ``module`` leave their running statistics as they were when a library's own gradient
    checkpointing (timm's, transformers') recomputes them in backward: otherwise each step counts twice and moves
    the running mean twice as far (models.classifier.running_stats_frozen does the same for our checkpointing).
    Called on every forward: model.norm (sync under torchrun) may have swapped the layers since the last; a layer
    has its hooks once."""

    def before(norm, args):
        if norm.training and norm.track_running_stats and in_recomputation():
            norm._kept = (norm.momentum, norm.num_batches_tracked.clone())
            norm.momentum = 0.0

    def after(norm, args, output):
        kept = norm.__dict__.pop("_kept", None)
        if kept is not None:
            norm.momentum = kept[0]
            norm.num_batches_tracked.copy_(kept[1])

    for norm in module.modules():
        if isinstance(norm, nn.modules.batchnorm._BatchNorm) and not getattr(norm, "_keeps_statistics", False):
            norm.register_forward_pre_hook(before)
            norm.register_forward_hook(after)
            norm._keeps_statistics = True


class TimmFrames(nn.Module):
    """A timm image model over every frame of a chunk: the frames folded into the batch ([B * T, C, H, W]), its
    pooled features ([B * T, D], timm's own global pool) averaged over the chunk's frames. Per-frame features for
    the temporal head and per-frame timelines: chunks of one frame (docs/models.md)."""

    min_frames = 1

    def __init__(self, name: str):
        super().__init__()
        import timm  # an optional extra (requirements-backbones.txt): imported when one is built

        if not timm.is_model(name):
            raise ModelConfigError(
                f"model.backbone: timm/{name}: timm {timm.__version__} has no model '{name}'; list them with "
                f"python -c \"import timm; print(timm.list_models('*{name.split('_')[0]}*'))\""
            )
        self.name = name
        self.net = timm.create_model(name, pretrained=False, num_classes=0)
        self.feature_dim = self.net.num_features
        self._checkpointing = False

    @property
    def recompute_blocks(self) -> bool:
        return self._checkpointing

    @recompute_blocks.setter
    def recompute_blocks(self, enabled: bool) -> None:
        self._checkpointing = enabled
        self.net.set_grad_checkpointing(enabled)  # timm's: one block (or stage) at a time, recomputed in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep_statistics_in_recomputation(self.net)
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        return self.net(frames).view(b, t, -1).mean(dim=1)

    def load_hub_weights(self) -> dict:
        """timm's pretrained weights for this model, from its hub (the network): the state dict."""
        import timm  # as in __init__

        return timm.create_model(self.name, pretrained=True, num_classes=0).state_dict()


class HFVideo(nn.Module):
    """A Hugging Face ``transformers`` video model built from its config (``hf/<local directory with
    config.json>`` or a hub name already in the local cache), its last hidden state averaged over tokens (VideoMAE's
    own pooling for classification). It takes a fixed number of frames (``config.num_frames``, V-JEPA 2's
    ``frames_per_clip``): a chunk of another length is resampled to it, nearest frame, evenly over the chunk
    (docs/models.md)."""

    min_frames = 1

    def __init__(self, source: str):
        super().__init__()
        import transformers  # an optional extra (requirements-backbones.txt): imported when one is built

        try:
            config = transformers.AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise ModelConfigError(
                f"model.backbone: hf/{source}: no config there ({str(e).splitlines()[0]}); give a local "
                f"directory with config.json (save_pretrained's), or a hub name downloaded before"
            )
        try:
            self.net = transformers.AutoModel.from_config(config)
        except ValueError as e:
            raise ModelConfigError(f"model.backbone: hf/{source}: {str(e).splitlines()[0]}")
        _tensors_as_buffers(self.net)
        self.source, self.config = source, config
        self.frames = int(getattr(config, "num_frames", None) or getattr(config, "frames_per_clip", 0))
        if not self.frames:
            raise ModelConfigError(
                f"model.backbone: hf/{source}: a {config.model_type} config has no num_frames or frames_per_clip: "
                f"not a video model this project can chunk"
            )
        self.size = getattr(config, "image_size", None) or getattr(config, "crop_size", None)
        self.feature_dim = int(config.hidden_size)
        parameters = inspect.signature(self.net.forward).parameters
        self.input_name = "pixel_values_videos" if "pixel_values_videos" in parameters else "pixel_values"
        # V-JEPA 2's predictor serves its pretraining, not its features: skipped, and dropped (an unused
        # parameter would stall DDP and hold optimizer state)
        self.options = {"skip_predictor": True} if "skip_predictor" in parameters else {}
        if self.options and getattr(self.net, "predictor", None) is not None:
            self.net.predictor = None
        self._checkpointing = False

    @property
    def recompute_blocks(self) -> bool:
        return self._checkpointing

    @recompute_blocks.setter
    def recompute_blocks(self, enabled: bool) -> None:
        self._checkpointing = enabled
        if enabled:
            self.net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self.net.is_gradient_checkpointing:
            self.net.gradient_checkpointing_disable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep_statistics_in_recomputation(self.net)
        b, c, t, h, w = x.shape
        if self.size is not None and (h, w) != (self.size, self.size):
            raise ValueError(
                f"hf/{self.source} takes {self.size}x{self.size} frames (its config's image size), got {h}x{w}; "
                f"set data.img_size: {self.size}"
            )
        if t != self.frames:  # resampled to the model's clip length: nearest frame, evenly over the chunk
            x = x[:, :, torch.linspace(0, t - 1, self.frames, device=x.device).round().long()]
        out = self.net(**{self.input_name: x.transpose(1, 2)}, **self.options)  # [B, T, C, H, W] in transformers
        return out.last_hidden_state.mean(dim=1)

    def adapter_points(self) -> AdapterPoints | None:
        """Where model.adapter reads it: each encoder layer's tokens, time-major over its tubelets."""
        layers = getattr(getattr(self.net, "encoder", None), "layer", None)
        tubelet = int(getattr(self.config, "tubelet_size", 0) or 0)
        if layers is None or not tubelet or self.size is None:
            return None
        return AdapterPoints(layers, "tokens", (1, 3, self.frames, self.size, self.size), self.frames // tubelet)

    def load_hub_weights(self) -> dict:
        """The pretrained weights of ``source`` (a local directory's, or the hub's cache): the state dict."""
        import transformers  # as in __init__

        return transformers.AutoModel.from_pretrained(self.source).state_dict()


def _tensors_as_buffers(net: nn.Module) -> None:
    """Plain tensor attributes (VideoMAE's sinusoidal position table) as non-persistent buffers: so they move with
    the model and the planner's fake tensors replace them like any buffer (a real tensor in a fake step fails)."""
    for module in net.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                delattr(module, key)
                module.register_buffer(key, value, persistent=False)


def build_external(name: str) -> nn.Module:
    missing = external_package_missing(name)
    if missing:
        raise ModelConfigError(missing)
    return TimmFrames(name[len("timm/") :]) if name.startswith("timm/") else HFVideo(name[len("hf/") :])
