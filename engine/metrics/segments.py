"""The metrics of temporal action segmentation, as MS-TCN's evaluation (and ASFormer's, DiffAct's) computes them on
Breakfast, 50Salads and GTEA, so a timeline here scores as a published one does:

- frame accuracy: the share of frames with the true label;
- the segmental edit score: 100 x (1 - the Levenshtein distance between the predicted and the true sequences of
  segment labels / the longer one's length), averaged over videos;
- F1@{10,25,50}: a predicted segment is a true positive when its IoU with a true segment of the same label, the one
  it overlaps most, reaches the threshold and that true segment was not matched before; tp, fp and fn are summed
  over the videos, then F1 = 2PR / (P + R), x100.

Background labels (``background``) are left out of the segments of both sides for edit and F1, as the reference
implementations' ``bg_class``; frame accuracy counts every frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from core.errors import ConfigError

F1_THRESHOLDS = (0.10, 0.25, 0.50)


def segments_of(labels: Sequence[Hashable], background: Sequence[Hashable] = ()) -> list[tuple[Hashable, int, int]]:
    """The runs of equal labels of a per-frame sequence as (label, start, end) with end exclusive; runs of a
    background label left out."""
    runs: list[tuple[Hashable, int, int]] = []
    start = 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            if labels[start] not in background:
                runs.append((labels[start], start, i))
            start = i
    return runs


def levenshtein(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def edit_score(predicted: Sequence[Hashable], truth: Sequence[Hashable], background: Sequence[Hashable] = ()) -> float:
    """100 x (1 - edit distance of the segment label sequences / the longer one's length); 100 when both have no
    segment."""
    p = [label for label, _, _ in segments_of(predicted, background)]
    t = [label for label, _, _ in segments_of(truth, background)]
    longest = max(len(p), len(t))
    return 100.0 if longest == 0 else (1 - levenshtein(p, t) / longest) * 100


def f1_counts(
    predicted: Sequence[Hashable], truth: Sequence[Hashable], threshold: float, background: Sequence[Hashable] = ()
) -> tuple[int, int, int]:
    """(tp, fp, fn) at an IoU ``threshold``: each predicted segment against the true segment of its label it
    overlaps most; a true segment matched once already makes a second match a false positive."""
    truth_segments = segments_of(truth, background)
    matched = [False] * len(truth_segments)
    tp = fp = 0
    for label, start, end in segments_of(predicted, background):
        best, best_iou = -1, 0.0
        for k, (true_label, true_start, true_end) in enumerate(truth_segments):
            if true_label != label:
                continue
            intersection = min(end, true_end) - max(start, true_start)
            union = max(end, true_end) - min(start, true_start)
            iou = max(intersection, 0) / union
            if iou > best_iou:
                best, best_iou = k, iou
        if best >= 0 and best_iou >= threshold and not matched[best]:
            tp += 1
            matched[best] = True
        else:
            fp += 1
    return tp, fp, len(truth_segments) - sum(matched)


@dataclass
class SegmentationScores:
    """The metrics over a split: ``add`` each video's per-frame predicted and true labels, then ``result``."""

    background: tuple = ()
    frames: int = 0
    correct: int = 0
    edits: list = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {t: [0, 0, 0] for t in F1_THRESHOLDS})

    def add(self, predicted: Sequence[Hashable], truth: Sequence[Hashable]) -> dict:
        """One video's scores ({"frame_acc", "edit", "f1@10", ...}), added to the split's."""
        return self.add_counts(self.counts_of(predicted, truth))

    def counts_of(self, predicted: Sequence[Hashable], truth: Sequence[Hashable]) -> dict:
        """What one video adds to the split's scores, as plain numbers (a resumed run adds them back)."""
        if len(predicted) != len(truth):
            raise ValueError(f"{len(predicted)} predicted frame labels for {len(truth)} true ones")
        return {
            "frames": len(truth),
            "correct": int(sum(p == t for p, t in zip(predicted, truth))),
            "edit": edit_score(predicted, truth, self.background),
            "f1": {str(round(t * 100)): list(f1_counts(predicted, truth, t, self.background)) for t in F1_THRESHOLDS},
        }

    def add_counts(self, counts: dict) -> dict:
        """One video's ``counts_of`` added to the split's; its own scores."""
        self.frames, self.correct = self.frames + counts["frames"], self.correct + counts["correct"]
        self.edits.append(counts["edit"])
        video = {"frame_acc": counts["correct"] / counts["frames"] if counts["frames"] else 0.0, "edit": counts["edit"]}
        for threshold in F1_THRESHOLDS:
            tp, fp, fn = counts["f1"][str(round(threshold * 100))]
            self.counts[threshold] = [a + b for a, b in zip(self.counts[threshold], (tp, fp, fn))]
            video[f"f1@{round(threshold * 100)}"] = f1_from_counts(tp, fp, fn)
        return video

    @classmethod
    def merged(cls, parts: list["SegmentationScores"]) -> "SegmentationScores":
        """One split's scores from the parts several processes scored (each a shard of the videos)."""
        total = cls(parts[0].background)
        for part in parts:
            total.frames, total.correct = total.frames + part.frames, total.correct + part.correct
            total.edits.extend(part.edits)
            for threshold, counts in part.counts.items():
                total.counts[threshold] = [a + b for a, b in zip(total.counts[threshold], counts)]
        return total

    @property
    def videos(self) -> int:
        return len(self.edits)

    def result(self) -> dict:
        """Frame accuracy over all frames, the mean edit score over videos, F1 from the summed counts (x100)."""
        scores = {
            "frame_acc": self.correct / self.frames if self.frames else 0.0,
            "edit": sum(self.edits) / len(self.edits) if self.edits else 0.0,
        }
        for threshold, (tp, fp, fn) in self.counts.items():
            scores[f"f1@{round(threshold * 100)}"] = f1_from_counts(tp, fp, fn)
        return scores


def f1_from_counts(tp: int, fp: int, fn: int) -> float:
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall) * 100


def background_indices(background_labels: list, class_names: list[str]) -> tuple[int, ...]:
    """data.background_labels as class indices (the per-frame labels scored are indices)."""
    unknown = [str(name) for name in background_labels if str(name) not in class_names]
    if unknown:
        raise ConfigError(
            f"data.background_labels names {', '.join(unknown)}, not a class of this model "
            f"({', '.join(class_names)}); give labels from that list, or [] for none"
        )
    return tuple(class_names.index(str(name)) for name in background_labels)


def format_scores(scores: dict) -> str:
    """One line: frame accuracy, edit, F1@{10,25,50}."""
    return (
        f"frame acc {scores['frame_acc']:.4f}  edit {scores['edit']:.1f}  F1@10 {scores['f1@10']:.1f}  "
        f"F1@25 {scores['f1@25']:.1f}  F1@50 {scores['f1@50']:.1f}"
    )
