"""The long-range task families driven for measurement: each family's shape, the temporal head trained alone on
event features, and how far a backbone's chunk features keep two events' kinds apart. ``python -m bench.long_range``
prints them; tests/test_head_learning.py checks them at small sizes."""

from __future__ import annotations

import json
import os

import cv2
import numpy as np
import torch

from config import load_config
from datasets.long_range_tasks import TASKS, task_events
from datasets.video_files import MARKER
from engine.training.optim import build_optimizer, build_scheduler, max_grad_norm
from models import build_feature_head
from models.temporal import clip_contrast, clip_event_contrast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG_RANGE_PRESET = os.path.join(ROOT, "configs", "long-range.yaml")

# Each family at its own shape: (clip frames at stride 4, training/inference chunk in clip frames)
FAMILY_SHAPES = {
    "order": (256, 32),
    "middle": (96, 16),
    "last": (160, 8),
    "distractors": (256, 4),
    "twice": (128, 16),
    "more": (192, 8),
    "match": (160, 16),
}


def event_features(
    task: str, clips: int, chunks: int, rng: np.random.Generator, scene: torch.Tensor, event_step: float = 0.0
):
    """``clips`` clips of ``task`` as chunk features, no backbone: every chunk is ``scene`` plus a little noise (a
    long video's chunks share its scene) and each event adds a unit step in feature 0, 1 or 2 (A, B, C) to one chunk,
    the events on distinct chunks in time order, and ``event_step`` in feature 3, whatever its kind: how far an event
    lies from the background beside how far its kinds lie apart (|A - B| / 2 is 0.71, an event's mean lies
    sqrt(0.5 + event_step^2) from the background: 5.7 times as far at event_step 4, as a backbone trained on
    motion holds two directions, 5.8). Labels are indices into the family's classes."""
    classes = TASKS[task]["classes"]
    noise = torch.from_numpy(rng.standard_normal((clips, chunks, scene.numel()))).float()
    features, labels = scene + 0.05 * noise, torch.zeros(clips, dtype=torch.long)
    for i in range(clips):
        labels[i] = int(rng.integers(len(classes)))
        colours = task_events(rng, task, classes[labels[i]])
        for chunk, colour in zip(np.sort(rng.choice(chunks, size=len(colours), replace=False)), colours):
            features[i, chunk, "ABC".index(colour)] += 1.0
            features[i, chunk, 3] += event_step
    return features, labels


def train_head_alone(
    task: str, seed: int, train_clips: int = 96, epochs: int = 20, changes: tuple = (), event_step: float = 0.0
) -> dict:
    """The temporal head alone (data.features_dir's model, train.py's optimizer, schedule and clipping at the
    long-range preset's rate) on ``event_features`` (``event_step`` its): is a family hard for the head itself, or
    for what the backbone gives it?"""

    frames, chunk = FAMILY_SHAPES[task]
    chunks, dim, batch = frames // chunk, 8, 8
    rng = np.random.default_rng(seed)
    scene = torch.from_numpy(rng.standard_normal(dim)).float()
    train_x, train_y = event_features(task, train_clips, chunks, rng, scene, event_step)
    val_x, val_y = event_features(task, 400, chunks, rng, scene, event_step)
    windows = torch.stack([torch.arange(chunks) * chunk * 4, (torch.arange(chunks) + 1) * chunk * 4], dim=1)
    cfg = load_config(LONG_RANGE_PRESET, ["model.temporal_head=transformer", *changes])
    torch.manual_seed(seed)
    head = build_feature_head(cfg.model, dim, len(TASKS[task]["classes"]))
    optimizer = build_optimizer(head, cfg.train)
    steps_per_epoch = train_clips // batch
    schedule = build_scheduler(optimizer, cfg.train, steps_per_epoch, epochs, has_temporal_head=True)
    clip_norm = max_grad_norm(cfg.train, has_temporal_head=True)
    best = 0.0
    for _ in range(epochs):
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
    colour of the one event it shows ('-': none, 'x': more than one)."""

    with open(os.path.join(data, f"{task}_train.jsonl")) as f:
        rows = [json.loads(line) for line in f][:videos]
    with open(os.path.join(data, MARKER)) as f:
        length = json.load(f)["event_frames"]
    clips, colours = [], []
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
            colours.append(inside[0] if len(inside) == 1 else "-" if not inside else "x")
    return torch.stack(clips), colours


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


def colours_apart(
    model, clips: torch.Tensor, colours: list[str], chunk: int, mean, std, spaces: tuple = ("contrast",)
) -> dict:
    """How well ``model``'s chunk features (eval mode, one backbone pass) tell the events' colours A and B apart in
    each of ``spaces``: "contrast" (``clip_contrast``, as the head sees them), "event contrast"
    (``clip_event_contrast``, model.temporal_event_contrast's). For each, keyed by its name: the nearest-centroid
    accuracy over the chunks that show one event, a linear probe's (``linear_probe``), the distance between the two
    centroids (halved) and that of their mean from the empty chunks' centroid."""

    model.eval()
    video = (clips.float() / 255 - torch.tensor(mean).view(3, 1, 1, 1)) / torch.tensor(std).view(3, 1, 1, 1)
    with torch.no_grad():
        features = torch.stack(
            [model.features({"video": video[:, :, i : i + chunk]}) for i in range(0, clips.shape[2], chunk)], dim=1
        )
    contrast = clip_contrast(features, None)
    found = {}
    for space in spaces:
        flat = (contrast if space == "contrast" else clip_event_contrast(contrast, None)).flatten(0, 1)
        groups = {name: flat[[k == name for k in colours]] for name in "AB-"}
        centre = {name: group.mean(dim=0) for name, group in groups.items()}
        pair = torch.stack([centre["A"], centre["B"]])
        right = [(torch.cdist(groups[name], pair).argmin(dim=1) == i).float().mean() for i, name in enumerate("AB")]
        found[space] = {
            "accuracy": float(sum(right) / 2),
            "linear": linear_probe(groups["A"], groups["B"]),
            "apart": float((centre["A"] - centre["B"]).norm() / 2),
            "events": float(((centre["A"] + centre["B"]) / 2 - centre["-"]).norm()),
        }
    return found
