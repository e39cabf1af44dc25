"""Adapters on large frozen video transformers: the planner's estimate of one training step for each way of training
(the whole backbone, the head alone on a frozen backbone, block, side and LoRA adapters) at a clip of a long video.

    python -m bench.adapters                                    # every row (about 35 minutes on 2 CPU cores)
    python -m bench.adapters --models vit-b --frames 1024       # one model, another clip length
    python -m bench.adapters --models v-jepa-2-g --ways block --batch 4   # the preset's own step

Each row is ``project.config_training_estimate`` (fake tensors: no weights, no GPU; estimated, not measured on a
card) of configs/vit-g-adapters-24gb.yaml's step with the model and the way of training changed: batch 1 (--batch),
the clip in training chunks of the model's own length (16 frames for VideoMAE, 64 for V-JEPA 2), each recomputed in
backward, blocks recomputed, fp16 autocast (bf16 has the same sizes), AdamW. Printed: the peak and its parts in
GiB, the trained parameters (the head's included) as a share of the backbone's, and whether it fits the usable part
of a 24, 16 and 8 GB budget (``planner.estimate.usable_bytes``).
"""

from __future__ import annotations

import argparse
import os
import time

import train
from config import load_config
from models.adapters import parameter_counts
from planner import project
from planner.estimate import GiB, usable_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "configs", "vit-g-adapters-24gb.yaml")
MODELS = {  # name: (the backbone's config directory, frames a chunk, frame size)
    "videomae-v2-g": ("configs/backbones/videomae-v2-giant", 16, 224),
    "v-jepa-2-g": ("configs/backbones/vjepa2-vitg-fpc64-256", 64, 256),
    "vit-b": ("configs/backbones/videomae-base", 16, 224),
}
WAYS = {  # name: the config changes (the head trains in each)
    "fine-tuned": ["model.adapter=none"],
    "frozen": ["model.adapter=none", "model.freeze_backbone=true"],
    "block": ["model.adapter=block"],
    "side": ["model.adapter=side"],
    "lora": ["model.adapter=lora"],
}


def estimate(model: str, way: str, frames: int, batch: int, precision: str) -> dict:
    folder, chunk, size = MODELS[model]
    changes = [
        f"model.backbone=hf/{folder}",
        f"data.img_size={size}",
        f"train.chunk_train_size={chunk}",
        f"infer.chunk_size={chunk}",
        *WAYS[way],
    ]
    cfg = load_config(PRESET, changes)
    start = time.perf_counter()
    step = project.config_training_estimate(cfg, train.STEP, frames, batch, precision=precision)
    built = project.ProjectStep(cfg, train.STEP, 10, 1, None, 0).classifier()
    backbone = parameter_counts(built)[1]
    trained = sum(p.numel() for p in built.parameters() if p.requires_grad)
    return {"step": step, "backbone": backbone, "trained": trained, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="which, comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--ways", default=",".join(WAYS), help="which, comma-separated: " + ", ".join(WAYS))
    parser.add_argument("--frames", type=int, default=1536, help="the clip's frames (every frame of the video)")
    parser.add_argument("--batch", type=int, default=1, help="clips a step")
    parser.add_argument("--precision", default="16", choices=("16", "bf16"), help="the autocast dtype")
    args = parser.parse_args()
    print(
        f"one training step at a {args.frames}-frame clip, batch {args.batch}, precision {args.precision}; GiB estimated on fake tensors "
        f"(no GPU); usable: 24 GB {usable_bytes(24) / GiB:.2f}, 16 GB {usable_bytes(16) / GiB:.2f}, "
        f"8 GB {usable_bytes(8) / GiB:.2f} GiB"
    )
    print(
        f"{'model':14s} {'training':10s} {'peak':>6s} {'params':>6s} {'grads':>6s} {'optim':>6s} {'activ':>6s} "
        f"{'trained':>9s} {'of backbone':>11s}  fits"
    )
    for model in args.models.split(","):
        for way in args.ways.split(","):
            row = estimate(model, way, args.frames, args.batch, args.precision)
            step = row["step"]
            fits = [f"{gb}" for gb in (24, 16, 8) if step.peak <= usable_bytes(gb)]
            print(
                f"{model:14s} {way:10s} {step.peak / GiB:6.2f} {step.parameters / GiB:6.2f} "
                f"{step.gradients / GiB:6.2f} {step.optimizer_state / GiB:6.2f} {step.activations / GiB:6.2f} "
                f"{row['trained'] / 1e6:8.2f}M {row['trained'] / row['backbone']:11.2%}  "
                f"{','.join(fits) or '-'} GB   ({row['seconds']:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
