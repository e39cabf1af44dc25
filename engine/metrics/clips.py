"""Classification metrics from predictions kept on the CPU: bounded state, plain floats out.

Clip-level metrics score every sample (a window's clip); video-level metrics sum the softmax of all clips
of a video (``video_index``) before the argmax, as torchvision's video references do.
"""

from __future__ import annotations

import torch


class ClassificationMeter:
    def __init__(self, num_classes: int):
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)  # [true, predicted]
        self.top5_hits = 0
        self.count = 0
        self.video_probs: dict[int, torch.Tensor] = {}
        self.video_clips: dict[int, list] = {}

    def update(self, logits: torch.Tensor, labels: torch.Tensor, video_index: torch.Tensor | None = None) -> None:
        logits, labels = logits.detach().float().cpu(), labels.detach().cpu().long()
        predicted = logits.argmax(dim=1)
        self.confusion += torch.bincount(labels * self.num_classes + predicted, minlength=self.num_classes**2).view(
            self.num_classes, self.num_classes
        )
        k = min(5, self.num_classes)
        self.top5_hits += int((logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum())
        self.count += len(labels)
        if video_index is None:
            return
        probs = logits.softmax(dim=1)
        for row, video, label in zip(probs, video_index.tolist(), labels.tolist()):
            self.video_probs[video] = self.video_probs.get(video, 0) + row
            self.video_clips.setdefault(video, []).append(label)

    @classmethod
    def merged(cls, meters: list) -> "ClassificationMeter":
        """One meter from the meters of several processes (each saw a shard of the samples)."""
        total = cls(meters[0].num_classes)
        for meter in meters:
            total.confusion += meter.confusion
            total.top5_hits += meter.top5_hits
            total.count += meter.count
            for video, probs in meter.video_probs.items():
                total.video_probs[video] = total.video_probs.get(video, 0) + probs
                total.video_clips.setdefault(video, []).extend(meter.video_clips[video])
        return total

    def compute(self) -> dict:
        confusion = self.confusion.double()
        support = confusion.sum(dim=1)
        predicted_count = confusion.sum(dim=0)
        correct = confusion.diag()
        recall = torch.where(support > 0, correct / support.clamp_min(1), torch.zeros_like(correct))
        precision = torch.where(predicted_count > 0, correct / predicted_count.clamp_min(1), torch.zeros_like(correct))
        f1 = torch.where(
            precision + recall > 0,
            2 * precision * recall / (precision + recall).clamp_min(1e-12),
            torch.zeros_like(correct),
        )
        present = support > 0
        result = {
            "clip_acc": float(correct.sum() / max(self.count, 1)),
            "top5": self.top5_hits / max(self.count, 1),
            "mean_class_acc": float(recall[present].mean()) if present.any() else 0.0,
            "precision": [float(v) for v in precision],
            "recall": [float(v) for v in recall],
            "f1": [float(v) for v in f1],
            "confusion": self.confusion.tolist(),
            "num_clips": self.count,
        }
        videos = self.video_predictions()
        if videos:
            result["video_acc"] = sum(v["predicted"] == v["label"] for v in videos) / len(videos)
            by_class: dict[int, list[bool]] = {}
            for v in videos:
                by_class.setdefault(v["label"], []).append(v["predicted"] == v["label"])
            recalls = [sum(hits) / len(hits) for hits in by_class.values()]
            result["video_mean_class_acc"] = sum(recalls) / len(recalls)  # each class alike, each video once
            result["num_videos"] = len(videos)
        return result

    def video_predictions(self) -> list[dict]:
        """Per video: its label (the one most of its clips carry), the argmax of its summed clip softmax, the
        mean probability of that class, and the number of clips."""
        rows = []
        for video, probs in self.video_probs.items():
            labels = self.video_clips[video]
            predicted = int(probs.argmax())
            rows.append(
                {
                    "video_index": video,
                    "label": max(set(labels), key=labels.count),
                    "predicted": predicted,
                    "probability": float(probs[predicted]) / len(labels),
                    "clips": len(labels),
                }
            )
        return rows
