"""python -m models --list | --profile

--list: the registered backbones with their parameter counts.
--profile: for each backbone at a preset's clip shape (default configs/rtx5080.yaml: 40 frames at 160x210,
batch 1): parameters and forward GFLOPs (torch.utils.flop_counter, counted on the meta device, so no compute). The
memory of a training step with one: python train.py --config CONFIG --probe-memory --set model.backbone=NAME.
"""

import argparse
import importlib.util
import os

import torch
from torch.utils.flop_counter import FlopCounterMode

from config import EXTERNAL_BACKBONES, ModelConfig, derive, load_config
from models import build_model, build_rgb_backbone, registered_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clip_shape_for(name: str, frames: int, size: list) -> tuple[int, int, int]:
    """The preset's shape, or the one a backbone insists on (mvit_v2_s) / its minimum (s3d)."""
    backbone = build_rgb_backbone(name, width=32)
    if hasattr(backbone, "shape"):
        return backbone.shape
    return max(frames, backbone.min_frames), size[0], size[1]


def forward_gflops(model_cfg: ModelConfig, shape) -> float:
    with torch.device("meta"):
        model = build_model(model_cfg, num_classes=10).eval()
        clip = {"video": torch.empty(1, 3, *shape)}
    with FlopCounterMode(display=False) as counter:
        model(clip)
    return counter.get_total_flops() / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m models", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="print the registered backbones")
    parser.add_argument("--profile", action="store_true", help="parameters and forward GFLOPs at a preset's clip")
    parser.add_argument(
        "--config", default=os.path.join(ROOT, "configs", "rtx5080.yaml"), help="preset whose clip shape --profile uses"
    )
    args = parser.parse_args()
    if not args.profile:
        for name in registered_names():
            params = sum(p.numel() for p in build_rgb_backbone(name).parameters())
            print(f"{name:14s} {params / 1e6:8.2f} M parameters (backbone, without the head)")
        for prefix, package in EXTERNAL_BACKBONES.items():
            found = importlib.util.find_spec(package) is not None
            what = "a timm image model on every frame" if package == "timm" else "a transformers video model"
            print(f"{prefix}<name>{'':6s} {what} ({package} {'installed' if found else 'not installed'})")
        return
    cfg = load_config(args.config)
    print(
        f"clip shape of {os.path.relpath(args.config, ROOT)}: {cfg.data.num_frames} frames at {cfg.data.img_size}, "
        f"batch 1, 10 classes (the memory of a training step: train.py --probe-memory --set model.backbone=NAME)"
    )
    print(f"{'model':12s} {'params M':>9s} {'GFLOPs':>8s} {'T x H x W':>13s}")
    for name in registered_names():
        model_cfg = derive(
            cfg,
            {
                "model.backbone": name,
                "model.recompute_blocks": False,
                "model.pretrained": None,
                "model.input_type": "rgb",
                "model.view_fusion": "none",
            },
            "python -m models --profile",
        ).model
        shape = clip_shape_for(name, cfg.data.num_frames, cfg.data.img_size)
        params = sum(p.numel() for p in build_model(model_cfg, num_classes=10).parameters())
        line = (
            f"{name:12s} {params / 1e6:9.2f} {forward_gflops(model_cfg, shape):8.1f} {'x'.join(map(str, shape)):>13s}"
        )
        print(line, flush=True)


if __name__ == "__main__":
    main()
