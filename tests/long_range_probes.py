"""What the tests of the long-range tasks and ``python -m bench.long_range`` measure with: the temporal head trained
alone on event features, the chunks of a family's videos with the kind of event each shows, and how far a backbone's
chunk features keep two kinds apart (nearest centroids and a linear probe)."""

from __future__ import annotations

import json
import os

import cv2
import numpy as np
import torch

from datasets.long_range_tasks import TASKS, task_events
from datasets.video_files import MARKER
from engine.training.optim import build_optimizer, build_scheduler, max_grad_norm
from models.temporal import clip_contrast, temporal_head


def event_features(task: str, clips: int, chunks: int, rng: np.random.Generator, scene: torch.Tensor):
    """``clips`` clips of ``task`` as chunk features, no backbone: every chunk is ``scene`` plus a little noise (a
    long video's chunks share its scene) and each event adds a unit step in feature 0, 1 or 2 (A, B, C) to one
    chunk, the events on distinct chunks in time order. Labels are indices into the family's classes."""
    classes = TASKS[task]["classes"]
    noise = torch.from_numpy(rng.standard_normal((clips, chunks, scene.numel()))).float()
    features, labels = scene + 0.05 * noise, torch.zeros(clips, dtype=torch.long)
    for i in range(clips):
        labels[i] = int(rng.integers(len(classes)))
        colours = task_events(rng, task, classes[labels[i]])
        for chunk, colour in zip(np.sort(rng.choice(chunks, size=len(colours), replace=False)), colours):
            features[i, chunk, "ABC".index(colour)] += 1.0
    return features, labels


def train_head_alone(task: str, seed: int, chunks: int, train_cfg, train_clips: int = 96, batch: int = 8) -> dict:
    """The transformer head alone (train.py's optimizer, schedule and clip, ``train_cfg``'s rate and epochs) on
    ``event_features``: is a family hard for the head itself, or for what the backbone gives it? Its best
    validation accuracy, and its accuracy and loss on its own training clips."""
    dim = 8
    rng = np.random.default_rng(seed)
    scene = torch.from_numpy(rng.standard_normal(dim)).float()
    train_x, train_y = event_features(task, train_clips, chunks, rng, scene)
    val_x, val_y = event_features(task, 400, chunks, rng, scene)
    windows = torch.stack([torch.arange(chunks) * 16, (torch.arange(chunks) + 1) * 16], dim=1)
    torch.manual_seed(seed)
    head = temporal_head(dim, len(TASKS[task]["classes"]))
    optimizer = build_optimizer(head, train_cfg)
    schedule = build_scheduler(optimizer, train_cfg, train_clips // batch, has_temporal_head=True)
    clip_norm = max_grad_norm(train_cfg, has_temporal_head=True)
    best = 0.0
    for _ in range(train_cfg.max_epochs):
        head.train()
        for order in torch.randperm(train_clips).split(batch):
            loss = torch.nn.functional.cross_entropy(head(train_x[order], windows).clip, train_y[order])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), clip_norm)
            optimizer.step()
            schedule.step()
        head.eval()
        with torch.no_grad():
            best = max(best, (head(val_x, windows).clip.argmax(1) == val_y).float().mean().item())
    with torch.no_grad():
        train_logits = head(train_x, windows).clip
    return {
        "best": best,
        "train_acc": (train_logits.argmax(1) == train_y).float().mean().item(),
        "train_loss": torch.nn.functional.cross_entropy(train_logits, train_y).item(),
    }


def event_chunks(
    task: str, data: str, frames: int, chunk: int, frame_stride: int = 4, videos: int = 48
) -> tuple[torch.Tensor, list[str]]:
    """The first ``videos`` training videos of ``task`` in ``data`` as uint8 clips [N, 3, frames, H, W] (from the
    first frame at ``frame_stride``), and for each of their chunks of ``chunk`` clip frames, clip by clip, the
    kind of the one event it shows ('-': none, 'x': more than one)."""
    with open(os.path.join(data, f"{task}_train.jsonl")) as f:
        rows = [json.loads(line) for line in f][:videos]
    with open(os.path.join(data, MARKER)) as f:
        length = json.load(f)["event_frames"]
    clips, kinds = [], []
    for row in rows:
        capture, video = cv2.VideoCapture(os.path.join(data, row["video"])), []
        while len(video) < frames * frame_stride:
            ok, frame = capture.read()
            if not ok:
                break
            video.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        clips.append(torch.from_numpy(np.stack(video[::frame_stride])).permute(3, 0, 1, 2))
        for start in range(0, frames * frame_stride, chunk * frame_stride):
            inside = [name for name, t in row["events"] if t < start + chunk * frame_stride and t + length > start]
            kinds.append(inside[0] if len(inside) == 1 else "-" if not inside else "x")
    return torch.stack(clips), kinds


def _logistic(x: torch.Tensor, y: torch.Tensor):
    """A logistic regression of labels ``y`` (0, 1) on rows ``x`` (standardized, a little L2), fitted by L-BFGS:
    the function that gives rows their logits."""
    centre, scale = x.mean(dim=0), x.std(dim=0) + 1e-6
    weight = torch.zeros(x.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=200)

    def closure():
        optimizer.zero_grad()
        logits = ((x - centre) / scale) @ weight + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + 1e-3 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return lambda rows: (((rows - centre) / scale) @ weight + bias).detach()


def linear_probe(a: torch.Tensor, b: torch.Tensor) -> float:
    """How well a linear classifier tells rows of ``a`` from rows of ``b`` on rows it did not fit: ``_logistic``
    fitted on one half of each and scored on the other, both ways, the accuracy of each class averaged."""
    halves = [(a[: len(a) // 2], b[: len(b) // 2]), (a[len(a) // 2 :], b[len(b) // 2 :])]
    scores = []
    for (fit_a, fit_b), (test_a, test_b) in (halves, halves[::-1]):
        logits = _logistic(torch.cat([fit_a, fit_b]), torch.cat([torch.zeros(len(fit_a)), torch.ones(len(fit_b))]))
        scores.append(float((logits(test_a) < 0).float().mean() + (logits(test_b) > 0).float().mean()) / 2)
    return sum(scores) / 2


def kinds_apart(model, clips: torch.Tensor, kinds: list[str], chunk: int, mean, std) -> dict:
    """How well ``model``'s chunk features (eval mode, one backbone pass), as the head sees them (``clip_contrast``),
    tell the events' kinds A and B apart: the nearest-centroid accuracy over the chunks that show one event, a
    linear probe's (``linear_probe``), the distance between the two centroids (halved) and that of their mean from
    the empty chunks' centroid."""
    model.eval()
    video = (clips.float() / 255 - torch.tensor(mean).view(3, 1, 1, 1)) / torch.tensor(std).view(3, 1, 1, 1)
    with torch.no_grad():
        features = torch.stack(
            [model.features({"video": video[:, :, i : i + chunk]}) for i in range(0, clips.shape[2], chunk)], dim=1
        )
    flat = clip_contrast(features, None).flatten(0, 1)
    groups = {name: flat[[k == name for k in kinds]] for name in "AB-"}
    centre = {name: group.mean(dim=0) for name, group in groups.items()}
    pair = torch.stack([centre["A"], centre["B"]])
    right = [(torch.cdist(groups[name], pair).argmin(dim=1) == i).float().mean() for i, name in enumerate("AB")]
    return {
        "accuracy": float(sum(right) / 2),
        "linear": linear_probe(groups["A"], groups["B"]),
        "apart": float((centre["A"] - centre["B"]).norm() / 2),
        "events": float(((centre["A"] + centre["B"]) / 2 - centre["-"]).norm()),
    }
