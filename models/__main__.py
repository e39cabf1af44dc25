"""python -m models --list | --profile

--list: the registered backbones with their parameter counts.
--profile: for each backbone at a preset's clip shape (default configs/rtx5080.yaml: 40 frames at 160x210,
batch 1): parameters, forward GFLOPs (torch.utils.flop_counter, counted on the meta device, so no compute), and
with CUDA the peak training memory (forward + backward + step) for fp32 and fp16, without and with gradient
checkpointing.
"""
import argparse
import math
import os

import torch

from models import build_model, build_rgb_backbone, registered_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clip_shape_for(name: str, frames: int, size: list) -> tuple[int, int, int]:
    """The preset's shape, or the one a backbone insists on (mvit_v2_s) / its minimum (s3d)."""
    backbone = build_rgb_backbone(name, width=32)
    if hasattr(backbone, "shape"):
        return backbone.shape
    return max(frames, backbone.min_frames), size[0], size[1]


def forward_gflops(model_cfg: dict, shape) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device("meta"):
        model = build_model(model_cfg, num_classes=10).eval()
        clip = {"video": torch.empty(1, 3, *shape)}
    with FlopCounterMode(display=False) as counter:
        model(clip)
    return counter.get_total_flops() / 1e9


def peak_training_mb(model_cfg: dict, shape, precision: str, checkpointing: bool) -> float:
    model = build_model({**model_cfg, "grad_checkpointing": checkpointing}, num_classes=10).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "16")
    clip = {"video": torch.randn(1, 3, *shape, device="cuda")}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        with torch.autocast("cuda", dtype=torch.float16, enabled=precision == "16"):
            loss = model(clip).float().logsumexp(dim=1).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2 ** 20
    except torch.cuda.OutOfMemoryError:
        return math.inf
    finally:
        del model, optimizer
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the registered backbones")
    parser.add_argument("--profile", action="store_true", help="parameters, GFLOPs and (CUDA) training memory")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "rtx5080.yaml"),
                        help="preset whose clip shape --profile uses")
    args = parser.parse_args()
    if not args.profile:
        for name in registered_names():
            params = sum(p.numel() for p in build_rgb_backbone(name).parameters())
            print(f"{name:14s} {params / 1e6:8.2f} M parameters (backbone, without the head)")
        return
    from config import load_config
    cfg = load_config(args.config)
    cuda = torch.cuda.is_available()
    print(f"clip shape of {os.path.relpath(args.config, ROOT)}: {cfg['data']['num_frames']} frames at "
          f"{cfg['data']['img_size']}, batch 1, 10 classes" + ("" if cuda else "; no CUDA: memory columns skipped"))
    header = f"{'model':12s} {'params M':>9s} {'GFLOPs':>8s} {'T x H x W':>13s}"
    if cuda:
        header += "".join(f" {c:>14s}" for c in ("fp32 MB", "fp32+ckpt MB", "fp16 MB", "fp16+ckpt MB"))
    print(header)
    for name in registered_names():
        model_cfg = {**cfg["model"], "backbone": name, "grad_checkpointing": False, "pretrained": None,
                     "input_type": "rgb", "view_fusion": "none"}
        shape = clip_shape_for(name, cfg["data"]["num_frames"], cfg["data"]["img_size"])
        params = sum(p.numel() for p in build_model(model_cfg, num_classes=10).parameters())
        line = f"{name:12s} {params / 1e6:9.2f} {forward_gflops(model_cfg, shape):8.1f} {'x'.join(map(str, shape)):>13s}"
        if cuda:
            for precision, ckpt in (("32", False), ("32", True), ("16", False), ("16", True)):
                peak = peak_training_mb(model_cfg, shape, precision, ckpt)
                line += f" {'OOM' if math.isinf(peak) else f'{peak:.0f}':>14s}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
