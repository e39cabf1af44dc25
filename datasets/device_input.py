"""Batches onto the device: samples stay uint8 through the DataLoader (4x less host memory and PCIe traffic than
float32); conversion to float and normalization happen on the device."""

from __future__ import annotations

import torch


class DeviceInputs:
    """A collated batch as model inputs on the device: ``{"video": float, "kpt": float}``."""

    def __init__(self, device: torch.device, mean, std, channels_last: bool = False):
        self.device = device
        self.non_blocking = device.type == "cuda"  # the host batch is pinned there
        # shaped [C, 1, 1, 1] to broadcast over [..., C, T, H, W]
        self.scale = (torch.tensor(std, device=device) * 255.0).view(3, 1, 1, 1)
        self.shift = (torch.tensor(mean, device=device) * 255.0).view(3, 1, 1, 1)
        self.channels_last = channels_last

    def __call__(self, batch: dict) -> dict:
        return self.normalize(self.transfer(batch))

    def transfer(self, batch: dict) -> dict:
        """The model inputs of ``batch`` on the device, frames still uint8 (chunked training normalizes each
        chunk when it runs, so the whole clip is never held as float)."""
        inputs = {}
        if "video" in batch:
            inputs["video"] = batch["video"].to(self.device, non_blocking=self.non_blocking)
        if "kpt" in batch:
            inputs["kpt"] = batch["kpt"].to(self.device, non_blocking=self.non_blocking).float()
        for key in ("features", "windows", "mask"):  # training on features (data.features_dir)
            if key in batch:
                inputs[key] = batch[key].to(self.device, non_blocking=self.non_blocking)
        return inputs

    def normalize(self, inputs: dict) -> dict:
        """uint8 frames -> normalized float frames (channels_last_3d where asked); keypoints pass through."""
        if "video" not in inputs:
            return dict(inputs)
        video = (inputs["video"].float() - self.shift) / self.scale
        if self.channels_last and video.dim() == 5:
            video = video.contiguous(memory_format=torch.channels_last_3d)
        return {**inputs, "video": video}
