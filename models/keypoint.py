"""A temporal convolution network over keypoint sequences [B, T, J, C] (C = x, y[, confidence])."""

import torch
from torch import nn

from models.classifier import StagedBackbone, batch_norm


class KeypointTCN(StagedBackbone):
    min_frames = 1

    def __init__(self, num_joints: int, channels: int, width: int = 64):
        super().__init__()
        self.num_joints, self.channels = num_joints, channels
        coords = min(channels, 2)
        # per joint: its coordinates and a 0/1 "seen" flag, so a missing joint is not read as (0, 0)
        self.embed = nn.Linear(num_joints * (coords + 1), width)
        self.stages = nn.ModuleList(
            [
                nn.Sequential(nn.Conv1d(width, width, 3, padding=1), batch_norm(width, 1), nn.ReLU(inplace=True)),
                nn.Sequential(
                    nn.Conv1d(width, 2 * width, 3, padding=1, stride=2), batch_norm(2 * width, 1), nn.ReLU(inplace=True)
                ),
                nn.Sequential(
                    nn.Conv1d(2 * width, 2 * width, 3, padding=1), batch_norm(2 * width, 1), nn.ReLU(inplace=True)
                ),
            ]
        )
        self.feature_dim = 2 * width

    def forward(self, kpt: torch.Tensor) -> torch.Tensor:
        b, t, j, c = kpt.shape
        if (j, c) != (self.num_joints, self.channels):
            raise ValueError(
                f"keypoints of shape [J={j}, C={c}] given to a model built for [J={self.num_joints}, C={self.channels}]"
            )
        xy = kpt[..., :2]
        seen = torch.isfinite(xy).all(dim=-1)
        if c > 2:
            seen = seen & (kpt[..., 2] > 0)
        xy = torch.where(seen.unsqueeze(-1), torch.nan_to_num(xy), torch.zeros_like(xy))
        x = torch.cat([xy, seen.unsqueeze(-1).to(xy.dtype)], dim=-1).flatten(2)
        x = self.embed(x).transpose(1, 2)  # [B, width, T]
        return self.pool(self.run_stages(x))
