"""Parity with MS-TCN's own training recipe, where the scores are far from the ceiling.

    python -m bench.mstcn_parity                          # 2 seeds, 2 splits, 50 epochs (about 10 minutes)
    python -m bench.mstcn_parity --separation 0.15 --epochs 20 --seeds 0   # an easier set, shorter

A generated set in MS-TCN's layout (datasets/segmentation_task.py's timeline task as features, made hard: looks
close together under strong per-frame noise, long videos) is cross-validated twice over the same splits and seeds:

- "MS-TCN": a re-implementation of MS-TCN's training loop written here from its paper (Farha and Gall, CVPR 2019)
  and its released code's behaviour: 4 stages of 10 dilated residual layers, 64 wide, dropout 0.5, each stage after
  the first fed the softmax of the one before; Adam at 0.0005, one video a step, the videos in a shuffled order each
  epoch; cross-entropy on every stage plus 0.15 x the mean over frames of the squared differences of neighbouring
  log-probabilities (the earlier frame's detached) clamped at 16; the model of the last epoch scored.
- "project": ``python -m engine.evaluation.cross_validation --config configs/mstcn.yaml`` (train.py, then eval.py's scoring of
  last.pt).

Both are scored by the project's metrics (engine/metrics/segments.py: MS-TCN's definitions of F1@{10,25,50}, edit
and frame accuracy), nothing left out of edit and F1. Printed: each system's mean over splits and seeds, each
seed's, and its training seconds per epoch: the mean, the median and the fastest of every epoch of every run (the
project's from its metrics.csv: the training part of an epoch, without its validation or checkpoint); the median
and the fastest are the figures another process on the machine disturbs least.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from datasets.mstcn import bundle_names, read_ground_truth, read_mapping
from datasets.segmentation_task import generate_features
from engine.metrics.segments import SegmentationScores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ("f1@10", "f1@25", "f1@50", "edit", "frame_acc")


# ------------------------------------------------------------------------------------------- the reference
class DilatedResidualLayer(nn.Module):
    def __init__(self, dilation: int, channels: int):
        super().__init__()
        self.conv_dilated = nn.Conv1d(channels, channels, 3, padding=dilation, dilation=dilation)
        self.conv_1x1 = nn.Conv1d(channels, channels, 1)
        self.dropout = nn.Dropout()

    def forward(self, x, mask):
        out = self.dropout(self.conv_1x1(F.relu(self.conv_dilated(x))))
        return (x + out) * mask[:, 0:1, :]


class SingleStageModel(nn.Module):
    def __init__(self, num_layers: int, channels: int, dim: int, num_classes: int):
        super().__init__()
        self.conv_1x1 = nn.Conv1d(dim, channels, 1)
        self.layers = nn.ModuleList([DilatedResidualLayer(2**i, channels) for i in range(num_layers)])
        self.conv_out = nn.Conv1d(channels, num_classes, 1)

    def forward(self, x, mask):
        out = self.conv_1x1(x)
        for layer in self.layers:
            out = layer(out, mask)
        return self.conv_out(out) * mask[:, 0:1, :]


class MultiStageModel(nn.Module):
    def __init__(self, num_stages: int, num_layers: int, channels: int, dim: int, num_classes: int):
        super().__init__()
        self.stage1 = SingleStageModel(num_layers, channels, dim, num_classes)
        self.stages = nn.ModuleList(
            [SingleStageModel(num_layers, channels, num_classes, num_classes) for _ in range(num_stages - 1)]
        )

    def forward(self, x, mask):
        out = self.stage1(x, mask)
        outputs = out.unsqueeze(0)
        for stage in self.stages:
            out = stage(F.softmax(out, dim=1) * mask[:, 0:1, :], mask)
            outputs = torch.cat((outputs, out.unsqueeze(0)), dim=0)
        return outputs


def ms_tcn_batch(root: str, name: str, index: dict, num_classes: int, sample_rate: int):
    """One video as MS-TCN's BatchGenerator.next_batch reads it at batch size 1, every time it is drawn: the
    features from their .npy, the ground truth parsed line by line, the padded input, target and mask."""
    features = np.load(os.path.join(root, "features", f"{name}.npy"))
    with open(os.path.join(root, "groundTruth", f"{name}.txt")) as f:
        content = f.read().split("\n")[:-1]
    classes = np.zeros(min(np.shape(features)[1], len(content)))
    for i in range(len(classes)):
        classes[i] = index[content[i]]
    features, classes = features[:, ::sample_rate], classes[::sample_rate]
    inputs = torch.zeros(1, np.shape(features)[0], len(classes), dtype=torch.float)
    target = torch.ones(1, len(classes), dtype=torch.long) * (-100)
    mask = torch.zeros(1, num_classes, len(classes), dtype=torch.float)
    inputs[0, :, : np.shape(features)[1]] = torch.from_numpy(features)
    target[0, : len(classes)] = torch.from_numpy(classes)
    mask[0, :, : len(classes)] = torch.ones(num_classes, len(classes))
    return inputs, target, mask


def reference_split(root: str, split: int, epochs: int, seed: int, sample_rate: int) -> tuple[dict, list[float]]:
    """MS-TCN's recipe on split ``split``: (the last epoch's scores on the split's test videos, each epoch's s). Timed
    as MS-TCN's train() runs an epoch (each video read from its files when drawn, the loss and accuracy summed
    per step), without the model and optimizer it saves after each epoch: the project's time leaves its
    checkpoint out too."""
    torch.manual_seed(seed)
    random.seed(seed)
    classes = read_mapping(root)
    index = {name: i for i, name in enumerate(classes)}
    train = bundle_names(root, "train", split)
    dim = np.load(os.path.join(root, "features", f"{train[0]}.npy"), mmap_mode="r").shape[0]
    model = MultiStageModel(4, 10, 64, dim, len(classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0005)
    seconds = []
    for _ in range(epochs):
        start = time.perf_counter()
        model.train()
        epoch_loss, correct, total = 0.0, 0.0, 0.0
        for name in random.sample(train, len(train)):  # MS-TCN's batch generator shuffles, batch 1
            inputs, target, mask = ms_tcn_batch(root, name, index, len(classes), sample_rate)
            optimizer.zero_grad()
            outputs = model(inputs, mask)
            loss = 0.0
            for p in outputs:
                loss = loss + F.cross_entropy(
                    p.transpose(2, 1).contiguous().view(-1, len(classes)), target.view(-1), ignore_index=-100
                )
                smooth = F.mse_loss(
                    F.log_softmax(p[:, :, 1:], dim=1), F.log_softmax(p.detach()[:, :, :-1], dim=1), reduction="none"
                )
                loss = loss + 0.15 * torch.mean(torch.clamp(smooth, min=0, max=16) * mask[:, :, 1:])
            epoch_loss += loss.item()
            loss.backward()
            optimizer.step()
            predicted = outputs[-1].data.argmax(dim=1)
            correct += ((predicted == target).float() * mask[:, 0, :].squeeze(1)).sum().item()
            total += torch.sum(mask[:, 0, :]).item()
        seconds.append(time.perf_counter() - start)
    scores = SegmentationScores()
    model.eval()
    with torch.no_grad():
        for name in bundle_names(root, "test", split):
            features = np.load(os.path.join(root, "features", f"{name}.npy"))[:, ::sample_rate]
            features = torch.from_numpy(features.copy()).float()
            labels = torch.from_numpy(read_ground_truth(root, name, index))
            mask = torch.ones(1, len(classes), features.shape[1])
            predicted = model(features.unsqueeze(0), mask)[-1].argmax(dim=1)[0]
            frames = predicted.repeat_interleave(sample_rate)[: len(labels)]  # each prediction stands for its rate
            scores.add(frames.tolist(), labels.tolist())
    result = scores.result()
    result["frame_acc"] *= 100
    return result, seconds


# ---------------------------------------------------------------------------------------------- the project
def project_splits(root: str, splits: list[int], epochs: int, seed: int, out: str) -> tuple[dict, list[float]]:
    """engine.evaluation.cross_validation with configs/mstcn.yaml: (each split's scores, each training epoch's s)."""
    command = [
        sys.executable,
        "-m",
        "engine.evaluation.cross_validation",
        "--config",
        os.path.join(ROOT, "configs", "mstcn.yaml"),
    ]
    command += ["--root", root, "--splits", ",".join(map(str, splits)), "--out", out]
    command += ["--set", f"train.max_epochs={epochs}", "--set", f"train.seed={seed}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one compute thread, as the reference here
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(
            f"engine.evaluation.cross_validation failed: {(done.stderr or done.stdout).strip().splitlines()[-1]}"
        )
    summary = json.loads(open(os.path.join(out, "segmentation.json")).read())
    names = {"F1@10": "f1@10", "F1@25": "f1@25", "F1@50": "f1@50", "Edit": "edit", "Acc": "frame_acc"}
    rows = {int(k): {names[c]: v for c, v in row.items()} for k, row in summary["splits"].items()}
    seconds = []
    for split in splits:
        with open(os.path.join(out, "runs", f"split{split}", "latest", "metrics.csv"), newline="") as f:
            metrics = list(csv.DictReader(f))
        videos = len(bundle_names(root, "train", split))
        seconds += [videos / float(row["train_clips_per_s"]) for row in metrics]
    return rows, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", type=int, default=16)
    parser.add_argument("--frames", type=int, default=1200, help="frames a video")
    parser.add_argument("--dim", type=int, default=32, help="features a frame")
    parser.add_argument("--noise", type=float, default=1.0, help="each frame's noise (std)")
    parser.add_argument("--separation", type=float, default=0.1, help="the scale of the looks' feature vectors")
    parser.add_argument("--splits", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "mstcn_parity"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as each process of the project's runs in make test's workers: the same budget
    root = os.path.join(args.out, "data")
    generate_features(
        root, 0, args.videos, args.frames, args.dim, args.splits, True, noise=args.noise, separation=args.separation
    )
    splits = list(range(1, args.splits + 1))
    print(
        f"MS-TCN parity: {args.videos} videos of {args.frames} frames x {args.dim} features (noise {args.noise}, "
        f"looks {args.separation} apart), {args.splits} splits, {args.epochs} epochs, seeds {args.seeds}; "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    results = {"MS-TCN": [], "project": []}
    times = {"MS-TCN": [], "project": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        for split in splits:
            scores, seconds = reference_split(root, split, args.epochs, seed, 1)
            results["MS-TCN"].append((seed, split, scores))
            times["MS-TCN"] += seconds
        rows, seconds = project_splits(root, splits, args.epochs, seed, os.path.join(args.out, f"project_{seed}"))
        results["project"] += [(seed, split, rows[split]) for split in splits]
        times["project"] += seconds
    print(
        f"{'system':8s} " + " ".join(f"{c:>9s}" for c in COLUMNS) + f" {'s/epoch':>8s} {'median':>7s} {'fastest':>7s}"
        "  each seed's F1@50 (split mean)"
    )
    for system, rows in results.items():
        mean = {c: float(np.mean([r[2][c] for r in rows])) for c in COLUMNS}
        per_seed = {}
        for seed, _, row in rows:
            per_seed.setdefault(seed, []).append(row["f1@50"])
        each = ", ".join(f"{np.mean(v):.1f}" for v in per_seed.values())
        epoch = times[system]
        print(
            f"{system:8s} " + " ".join(f"{mean[c]:9.1f}" for c in COLUMNS)
            + f" {np.mean(epoch):8.2f} {np.median(epoch):7.2f} {min(epoch):7.2f}  {each}"
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
