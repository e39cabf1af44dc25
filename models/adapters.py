"""model.adapter: small trained modules on a frozen RGB backbone, so a large pretrained video model adapts to a task
without its weights' gradients and optimizer state (docs/models.md, "Adapting a frozen backbone").

- ``block``: a bottleneck after each block of the backbone, a depthwise convolution over time in its middle
  (AdaTAD's temporal-informative adapter), its output projection zero-initialized so training starts from the
  frozen model's outputs. The gradient flows back through the frozen blocks: their activations are kept, or
  recomputed under the checkpointing and the training chunks like the backbone's own.
- ``side``: modules beside the backbone (LoSA's kind) that read a few blocks' outputs, pooled over space, and add a
  correction to the backbone's feature; the backbone runs without a graph, so its activations are one forward's.
- ``lora``: peft's low-rank updates of the linear layers the forward calls (a transformer's attention and MLP
  projections) or else of its 3D convolutions (a CNN): the frozen layer's output plus a rank-``RANK`` product, zero
  at the start.

A block's output is read in its layout: ``channels_first`` ([B, C, T, H, W], a 3D CNN's stages), ``channels_last``
([B, T, H, W, C], Swin3D's) or ``tokens`` ([B, T' * S, C] in time-major order, a video transformer's tubelets). Each
backbone says which (``adapter_points``); one that cannot (frames folded into the batch, a class token) is refused
by name.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from models.registry import ModelConfigError

LAYOUTS = ("channels_first", "channels_last", "tokens")
WIDTH = 64  # the block and side adapters' bottleneck
KERNEL = 3  # frames (tokens in time) their temporal convolution spans
TAPS = 4  # the blocks side adapters read, evenly spaced, the last among them
RANK = 8  # LoRA's


class AdapterPoints:
    """Where adapters read a backbone: its blocks in order, the layout of their outputs, for ``tokens`` the number
    of time steps (tubelets) of a forward, and ``sample``: the shape of a clip it takes ([1, 3, T, H, W]), for one
    forward on the meta device that finds each block's output width and the layers a forward calls."""

    def __init__(self, blocks: list, layout: str, sample: tuple, time_steps: int = 0):
        assert layout in LAYOUTS
        self.blocks, self.layout, self.sample, self.time_steps = list(blocks), layout, sample, time_steps


def block_output(output) -> torch.Tensor:
    """A block's output tensor (transformers' layers may return a tuple, the tensor first)."""
    return output[0] if isinstance(output, tuple) else output


def to_time_space(x: torch.Tensor, layout: str, time_steps: int) -> torch.Tensor:
    """A block's output as [B, T, S, C]."""
    if layout == "channels_first":
        return x.flatten(3).permute(0, 2, 3, 1)
    if layout == "channels_last":
        return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])
    b, n, c = x.shape
    return x.view(b, time_steps, n // time_steps, c)


def from_time_space(y: torch.Tensor, like: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, T, S, C] back in ``like``'s layout and shape."""
    if layout == "channels_first":
        return y.permute(0, 3, 1, 2).reshape(like.shape)
    return y.reshape(like.shape)


class TemporalBottleneck(nn.Module):
    """Down-projection, a depthwise convolution over time for every spatial position, up-projection: [B, T, S, C] to
    [B, T, S, out_channels] (C unless given). The up-projection starts at zero: an adapter's correction starts at
    nothing, and training starts from the frozen model's outputs."""

    def __init__(self, channels: int, width: int, kernel: int, out_channels: int | None = None):
        super().__init__()
        self.down = nn.Linear(channels, width)
        self.temporal = nn.Conv1d(width, width, kernel, padding=kernel // 2, groups=width)
        self.up = nn.Linear(width, out_channels or channels)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, s, _ = x.shape
        h = F.gelu(self.down(x))
        w = h.shape[-1]
        mixed = self.temporal(h.permute(0, 2, 3, 1).reshape(b * s, w, t))[..., :t]  # even kernels pad one more
        h = h + mixed.view(b, s, w, t).permute(0, 3, 1, 2)  # the convolution as a residual: frame-wise at the start
        return self.up(h)


class BlockAdapters(nn.Module):
    """One TemporalBottleneck after each block, added to its output (forward hooks: every caller of a block, our
    checkpointing and the libraries' own, runs it with its adapter)."""

    def __init__(self, points: AdapterPoints, channels: list[int], width: int, kernel: int):
        super().__init__()
        self.layout, self.time_steps = points.layout, points.time_steps
        self.adapters = nn.ModuleList(TemporalBottleneck(c, width, kernel) for c in channels)
        for block, adapter in zip(points.blocks, self.adapters):
            block.register_forward_hook(self._hook(adapter))

    def _hook(self, adapter: TemporalBottleneck):
        def add(block, args, output):
            x = block_output(output)
            y = x + from_time_space(adapter(to_time_space(x, self.layout, self.time_steps)), x, self.layout)
            return (y, *output[1:]) if isinstance(output, tuple) else y

        return add


class SideAdapters(nn.Module):
    """Modules beside the backbone: ``taps`` blocks' outputs (evenly spaced, the last among them), pooled over space
    as the backbone runs without a graph, each through a TemporalBottleneck to the feature width, averaged over
    time and summed: a correction added to the backbone's feature, zero at the start."""

    def __init__(
        self, points: AdapterPoints, channels: list[int], feature_dim: int, width: int, kernel: int, taps: int
    ):
        super().__init__()
        count = len(points.blocks)
        chosen = sorted({round(i * (count - 1) / max(taps - 1, 1)) for i in range(min(taps, count))} | {count - 1})
        self.layout, self.time_steps = points.layout, points.time_steps
        self.norms = nn.ModuleList(nn.LayerNorm(channels[i]) for i in chosen)
        self.adapters = nn.ModuleList(
            TemporalBottleneck(channels[i], width, kernel, out_channels=feature_dim) for i in chosen
        )
        self.tapped: list[torch.Tensor] = []
        for i in chosen:
            points.blocks[i].register_forward_hook(self._record)

    def _record(self, block, args, output):
        self.tapped.append(
            to_time_space(block_output(output), self.layout, self.time_steps).mean(dim=2).detach()
        )  # [B, T, C]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """The backbone's features [B, D] corrected by the taps its forward just recorded (then released)."""
        tapped, self.tapped = self.tapped, []
        if len(tapped) != len(self.adapters):  # a forward that did not run the backbone: a bug, not an input
            raise RuntimeError(f"side adapters: {len(tapped)} block outputs recorded, {len(self.adapters)} expected")
        correction = sum(
            adapter(norm(x.to(features.dtype)).unsqueeze(2)).squeeze(2).mean(dim=1)
            for norm, adapter, x in zip(self.norms, self.adapters, tapped)
        )
        return features + correction


class Trace:
    """One forward of ``points.sample`` on the meta device (no memory, no computation; the backbone's own tensors
    left where they are): each block's output width, and the linear and 3D convolution layers called as modules."""

    def __init__(self, backbone: nn.Module, points: AdapterPoints):
        self.widths: dict[int, int] = {}
        self.called: list[tuple[str, type]] = []

        def width(i: int):
            def record(module, args, output) -> None:  # a hook that returns a value replaces the output
                self.widths.setdefault(i, self._width(output, points))

            return record

        hooks = [block.register_forward_hook(width(i)) for i, block in enumerate(points.blocks)]
        hooks += [
            module.register_forward_hook(lambda m, a, out, name=name: self.called.append((name, type(m))))
            for name, module in backbone.named_modules()
            if isinstance(module, (nn.Linear, nn.Conv3d))
        ]
        tensors = [*backbone.named_parameters(), *backbone.named_buffers()]
        meta = {name: torch.empty_like(t, device="meta") for name, t in tensors}
        try:
            with torch.no_grad():
                functional_call(backbone, meta, (torch.empty(points.sample, device="meta"),))
        finally:
            for hook in hooks:
                hook.remove()
        self.channels = [self.widths[i] for i in range(len(points.blocks))]

    @staticmethod
    def _width(output, points: AdapterPoints) -> int:
        x = block_output(output)
        return int(x.shape[1] if points.layout == "channels_first" else x.shape[-1])


def lora_targets(trace: Trace) -> list[str]:
    """The layers LoRA updates: the linear layers a forward calls (a transformer's attention and MLP projections;
    VideoMAE reads its query, key and value weights without calling their layers, which LoRA would not reach),
    else the 3D convolutions (a CNN)."""
    called = list(dict.fromkeys(trace.called))
    linear = [name for name, kind in called if kind is nn.Linear]
    return linear or [name for name, kind in called if kind is nn.Conv3d]


def add_lora(backbone: nn.Module, targets: list[str], rank: int) -> None:
    """peft's LoRA layers in place of ``targets`` (their weights kept, as ``base_layer``)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model  # an optional extra (requirements-backbones.txt)
    except ImportError:
        raise ModelConfigError("model.adapter: lora needs peft: pip install -r requirements-backbones.txt")
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), backbone)
    for name, parameter in backbone.named_parameters():
        parameter.requires_grad_(".lora_" in name)


def build_adapters(backbone: nn.Module, kind: str, feature_dim: int):
    """The adapters of ``kind`` on ``backbone``, its own weights frozen: the module holding the block or side
    adapters (None for lora, whose layers live inside the backbone)."""
    points = backbone.adapter_points() if hasattr(backbone, "adapter_points") else None
    if points is None:
        raise ModelConfigError(
            f"model.adapter: {kind}: {type(backbone).__name__} gives no block outputs in a layout of time and space "
            f"(frames folded into the batch, or a class token); use a 3D CNN, Swin3D or an hf/ video transformer"
        )
    backbone.requires_grad_(False)
    trace = Trace(backbone, points)
    if kind == "lora":
        add_lora(backbone, lora_targets(trace), RANK)
        return None
    if kind == "block":
        return BlockAdapters(points, trace.channels, WIDTH, KERNEL)
    return SideAdapters(points, trace.channels, feature_dim, WIDTH, KERNEL, TAPS)


def frozen_keys(classifier: nn.Module) -> set[str]:
    """The state-dict keys of a classifier's frozen backbone under model.adapter (its weights and buffers: what
    model.pretrained gives again), empty without adapters."""
    if getattr(classifier, "adapter_kind", None) is None:
        return set()
    trained = {id(p) for p in classifier.rgb.parameters() if p.requires_grad}
    return {f"rgb.{k}" for k, v in classifier.rgb.state_dict(keep_vars=True).items() if id(v) not in trained}


def parameter_counts(classifier: nn.Module) -> tuple[int, int]:
    """(the parameters adapters train on a classifier's RGB backbone, the backbone's own): what model.adapter costs
    against what it leaves frozen (the head's left out of both)."""
    backbone = sum(p.numel() for name, p in classifier.rgb.named_parameters() if ".lora_" not in name)
    adapted = sum(
        p.numel()
        for name, p in classifier.named_parameters()
        if p.requires_grad and name.startswith(("rgb.", "adapters."))
    )
    return adapted, backbone


def frozen_fingerprint(classifier: nn.Module) -> str:
    """sha256 of the frozen backbone's tensors (names, dtypes, shapes, values): what a checkpoint without them
    checks the weights it is loaded with against. Computed once a model: they do not change."""
    cached = getattr(classifier, "_frozen_sha256", None)
    if cached is None:
        digest = hashlib.sha256()
        state = classifier.state_dict()
        for key in sorted(frozen_keys(classifier)):
            tensor = state[key].detach().cpu().contiguous()
            digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        cached = classifier._frozen_sha256 = digest.hexdigest()
    return cached
