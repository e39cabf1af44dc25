"""model.norm: how the BatchNorm layers of any backbone normalize, chosen after the model is built.

Every backbone is built with BatchNorm (ours and torchvision's); :func:`convert_norms` then swaps each
``nn.BatchNorm1d/2d/3d`` in place, keeping its name in the module tree, so no backbone file is copied:

- ``batch``: left as is (statistics of each micro-batch, or of each training chunk).
- ``frozen``: :class:`FrozenBatchNorm`, which normalizes with the running statistics in training too and never
  updates them (MMAction2's ``norm_eval``); its scale and shift train. The state dict
  keys are BatchNorm's, so pretrained weights load into it and checkpoints move between modes.
- ``sync``: :class:`SyncBatchNorm`, the statistics of the batch over every DDP process (``convert_norms`` is
  called with it only when torchrun started more than one; on one process ``sync`` is BatchNorm).
- ``group``: ``nn.GroupNorm`` with :func:`group_count` groups (``GROUPS`` where the channels allow): per sample,
  so any micro-batch or chunk gives the same result; for training from scratch (it has no running statistics to
  take from pretrained weights).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from config import NORMS

GROUPS = 32  # model.norm: group's groups a layer, as GroupNorm's paper
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)  # and subclasses: torchvision's are these


def batch_norms(module: nn.Module) -> list[_BatchNorm]:
    """Every BatchNorm-like layer (BatchNorm, FrozenBatchNorm, SyncBatchNorm) of ``module``."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


def group_count(channels: int, wanted: int) -> int:
    """The group count nearest ``wanted`` from below that divides ``channels`` (GroupNorm needs a divisor) and
    leaves at least 2 channels per group: 32 for 64-512 channels, 24 for r2plus1d's 144, 8 for 16. One channel per
    group would be InstanceNorm, which cannot normalize a 1-value map (1 clip, a last stage pooled to 1x1x1)."""
    ceiling = max(1, min(wanted, channels // 2))
    return max(g for g in range(1, ceiling + 1) if channels % g == 0)


def channel_moments(x: torch.Tensor) -> torch.Tensor:
    """Per-channel sums of ``x`` [N, C, ...] that add up across calls and ranks: [count x mean (C), count x (variance
    + mean^2) (C), count], float64. The variance is centred per call, so pooling them loses nothing to
    cancellation; an empty ``x`` gives zeros (it still joins a collective)."""
    channels = x.shape[1]
    count = x.numel() // channels
    if not count:
        return torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
    var, mean = torch.var_mean(x.float(), dim=[0] + list(range(2, x.dim())), correction=0)
    mean, var = mean.double(), var.double()
    return torch.cat([mean * count, (var + mean**2) * count, mean.new_tensor([float(count)])])


def pooled_statistics(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(mean, biased variance, count) of everything whose :func:`channel_moments` were summed into ``sums``."""
    channels, total = (sums.numel() - 1) // 2, float(sums[-1])
    mean = sums[:channels] / total
    return mean, (sums[channels : 2 * channels] / total - mean**2).clamp_min(0), total


class _AnyRankBatchNorm(_BatchNorm):
    """A _BatchNorm that takes inputs of any rank from 2 up ([N, C], [N, C, T], [N, C, T, H, W])."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


class FrozenBatchNorm(_AnyRankBatchNorm):
    """BatchNorm that always normalizes with its running statistics and never updates them, in training too.

    Unlike torchvision's FrozenBatchNorm2d (buffers only, 2D only) the scale and shift stay parameters, trained
    or not as their ``requires_grad`` says, and any input of 2 to 5 dimensions works. Being a ``_BatchNorm``
    with the same state dict keys, it loads BatchNorm weights and is found wherever BatchNorm layers are.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        return nn.functional.batch_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            training=False,
            momentum=0.0,
            eps=self.eps,
        )


class SyncBatchNorm(_AnyRankBatchNorm):
    """BatchNorm whose training statistics are those of the batch over every process of the group (DDP).

    Ours rather than ``nn.SyncBatchNorm``: torch's runs on CUDA only and DDP refuses it in a CPU module, so runs
    and tests with gloo on the CPU could not use it. One implementation on every device
    (:class:`_SyncBatchNormFunction`); the state dict keys are BatchNorm's. Outside training, or on one
    process, it is BatchNorm.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not (self.training and group is not None and dist.get_world_size(group) > 1):
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative average
                factor = 1.0 / float(self.num_batches_tracked)
        tracked = self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if tracked else None,
            self.running_var if tracked else None,
            self.eps,
            factor,
            group,
        )


class _SyncBatchNormFunction(torch.autograd.Function):
    """Synchronized BatchNorm over a process group, any device: what torch's CUDA sync_batch_norm computes.

    Forward: each rank's count, sum and centred sum of squares per channel, all-reduced (float64), give the mean
    and biased variance of the concatenated batch. Backward: the two per-channel sums the input gradient needs,
    all-reduced; the scale's and shift's gradients stay local (DDP averages them with every other gradient).
    Saves the input, the statistics and the scale, as BatchNorm does.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, group):
        shape = [1, -1] + [1] * (input.dim() - 2)
        moments = channel_moments(input)
        dist.all_reduce(moments, group=group)
        if float(moments[-1]) <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {int(moments[-1])} over all processes"
            )
        mean64, var64, total = pooled_statistics(moments)
        mean, var = mean64.float(), var64.float()
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((var * total / (total - 1)).to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total, ctx.group = total, group
        out = (input.float() - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.float().view(shape) + bias.float().view(shape)
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        grad = grad_output.float()
        normalized = (input.float() - mean.view(shape)) * invstd.view(shape)
        sum_dy = grad.sum(dims)
        sum_dy_xhat = (grad * normalized).sum(dims)
        grad_weight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.clone() if weight is not None and ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(both, group=ctx.group)
            channels = sum_dy.shape[0]
            mean_dy = (both[:channels] / ctx.total).view(shape)
            mean_dy_xhat = (both[channels:] / ctx.total).view(shape)
            scale = invstd if weight is None else invstd * weight.float()
            grad_input = ((grad - mean_dy - normalized * mean_dy_xhat) * scale.view(shape)).to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _replace(module: nn.Module, make) -> int:
    """Swap every plain BatchNorm child of ``module`` (recursively) for ``make(bn)``; returns how many."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, BATCH_NORMS):  # ours (frozen, sync) are not among them
            setattr(module, name, make(child))
            count += 1
        else:
            count += _replace(child, make)
    return count


def _frozen(bn: _BatchNorm) -> FrozenBatchNorm:
    frozen = FrozenBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, track_running_stats=True)
    frozen.load_state_dict(bn.state_dict())
    return frozen


def _sync(bn: _BatchNorm) -> SyncBatchNorm:
    sync = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    sync.load_state_dict(bn.state_dict())
    return sync


def _group(bn: _BatchNorm) -> nn.GroupNorm:
    return nn.GroupNorm(group_count(bn.num_features, GROUPS), bn.num_features, eps=bn.eps, affine=bn.affine)


def convert_norms(model: nn.Module, norm: str) -> int:
    """Swap the BatchNorm layers of ``model`` in place for model.norm's kind; returns how many were swapped."""
    if norm not in NORMS:
        raise ValueError(f"unknown norm '{norm}'; expected one of {', '.join(NORMS)}")
    if norm == "batch":
        return 0
    return _replace(model, {"frozen": _frozen, "sync": _sync, "group": _group}[norm])
