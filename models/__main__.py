"""python -m models --list | --profile

--list: the registered backbones with their parameter counts.
--profile: for each backbone at a preset's clip shape (default configs/rtx5080.yaml: 40 frames at 160x210,
batch 1): parameters, forward GFLOPs (torch.utils.flop_counter, counted on the meta device, so no compute), and
the peak training memory (forward + backward + AdamW step) for fp32 and fp16, without and with gradient
checkpointing: estimated on any machine (the memory planner), and with CUDA measured beside it.
"""

import argparse
import importlib.util
import os

import torch
from torch.utils.flop_counter import FlopCounterMode

from config import EXTERNAL_BACKBONES, Config, ModelConfig, derive, load_config
from models import build_model, build_rgb_backbone, registered_names
from planner import project  # python -m models is an entry point, like the scripts: it may use the planner

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


def training_memory_mb(cfg: Config, name: str, shape, cuda: bool) -> list[str]:
    """Estimated (and with CUDA measured) peak MiB of one training step at batch 1, for fp32 / fp16 x gradient
    checkpointing off / on: the planner's estimate, the one train.py --probe-memory uses."""
    cells = []
    for precision, ckpt in (("32", False), ("32", True), ("16", False), ("16", True)):
        changed = derive(
            cfg,
            {
                "model.backbone": name,
                "model.grad_checkpointing": ckpt,
                "model.pretrained": None,
                "model.input_type": "rgb",
                "model.view_fusion": "none",
                "data.img_size": list(shape[1:]),
                "train.accumulate_grad_batches": 1,
            },
            "python -m models --profile",
        )
        estimate = project.config_training_estimate(changed, shape[0], 1, precision=precision)
        cells.append(f"{estimate.peak / 2**20:.0f}")
        if cuda:
            measured = project.measure_training_step_cuda(changed, shape[0], 1, precision=precision)
            cells[-1] += "/" + ("OOM" if measured is None else f"{measured['allocated'] / 2**20:.0f}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m models", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="print the registered backbones")
    parser.add_argument("--profile", action="store_true", help="parameters, GFLOPs and training memory")
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
    cuda = torch.cuda.is_available()
    print(
        f"clip shape of {os.path.relpath(args.config, ROOT)}: {cfg.data.num_frames} frames at "
        f"{cfg.data.img_size}, batch 1, 10 classes; training memory: peak MiB of one step (AdamW), "
        + ("estimated/measured allocated" if cuda else "estimated (no GPU)")
    )
    header = f"{'model':12s} {'params M':>9s} {'GFLOPs':>8s} {'T x H x W':>13s}"
    header += "".join(f" {c:>14s}" for c in ("fp32", "fp32+ckpt", "fp16", "fp16+ckpt"))
    print(header)
    for name in registered_names():
        model_cfg = derive(
            cfg,
            {
                "model.backbone": name,
                "model.grad_checkpointing": False,
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
        line += "".join(f" {cell:>14s}" for cell in training_memory_mb(cfg, name, shape, cuda))
        print(line, flush=True)


if __name__ == "__main__":
    main()
