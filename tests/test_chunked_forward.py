import pytest
import torch
from torch import nn

from config import load_config
from engine.inference.chunks import LogitAggregator, forward_chunked, inference_windows
from models import build_model


class WindowProbe(nn.Module):
    """Known outputs: the logits of a window are a fixed function of the frame indices it holds."""

    min_frames = 1

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, inputs):
        video = inputs["video"]  # [n, C, L, H, W]; channel 0 of pixel (0, 0) holds the frame index
        frames = video[:, 0, :, 0, 0]
        self.calls.append(frames[:, 0].tolist())
        # small enough that no softmax probability underflows to 0
        return torch.stack(
            [frames.mean(dim=1) / 20, frames.max(dim=1).values / 30, -frames.min(dim=1).values / 25], dim=1
        )


def indexed_clip(batch: int, length: int) -> dict:
    video = torch.zeros(batch, 3, length, 2, 2)
    video[:, 0, :, 0, 0] = torch.arange(length, dtype=torch.float32) + 100 * torch.arange(batch)[:, None]
    return {"video": video}


def expected_windows(length, chunk, overlap):
    return [(s, e) for s, e in inference_windows(length, chunk, overlap, "mean")]


@pytest.mark.parametrize("aggregation", ["mean", "max", "last", "prob"])
def test_aggregations_equal_a_hand_computation(aggregation):
    model, clip = WindowProbe(), indexed_clip(2, 50)
    windows = expected_windows(50, 16, 4)
    assert windows == [(0, 16), (12, 28), (24, 40), (34, 50)]
    per_window = torch.stack([model({"video": clip["video"][:, :, s:e]}) for s, e in windows])  # [n, B, K]
    model.calls.clear()
    out = forward_chunked(model, clip, 16, 4, aggregation, chunks_per_forward=3)
    got = out.logits
    if aggregation == "mean":
        want = per_window.mean(dim=0)
    elif aggregation == "max":
        want = per_window.max(dim=0).values
    elif aggregation == "last":
        want = per_window[-1]
    else:
        want = per_window.softmax(dim=-1).mean(dim=0).log()
    torch.testing.assert_close(got, want)
    if aggregation == "last":  # only the last window is computed
        assert model.calls == [[34.0, 134.0]]
    else:  # 4 windows in forward calls of at most 3 windows x 2 clips
        assert [len(c) for c in model.calls] == [6, 2]


def test_chunk_at_least_the_clip_length_is_exactly_the_plain_forward():
    torch.manual_seed(0)
    cfg = load_config(None, ["model.width=4"])
    model = build_model(cfg.model, num_classes=5).eval()
    clip = {"video": torch.randn(2, 3, 12, 16, 16)}
    with torch.no_grad():
        plain = model(clip)
        for chunk in (-1, 12, 40):
            assert torch.equal(forward_chunked(model, clip, chunk, 0, "mean").logits, plain)


def test_keypoints_and_views_are_windowed_with_the_frames():
    seen = []

    class Recorder(nn.Module):
        min_frames = 1

        def forward(self, inputs):
            seen.append((inputs["video"].shape, inputs["kpt"][:, 0, 0, 0].tolist()))
            return torch.zeros(inputs["kpt"].shape[0], 2)

    kpt = torch.arange(20, dtype=torch.float32).view(1, 20, 1, 1).expand(1, 20, 3, 2).contiguous()
    forward_chunked(Recorder(), {"video": torch.zeros(1, 3, 3, 20, 4, 4), "kpt": kpt}, 8, 2, "mean", 2)
    assert seen[0] == (torch.Size([2, 3, 3, 8, 4, 4]), [0.0, 6.0])
    assert seen[1] == (torch.Size([1, 3, 3, 8, 4, 4]), [12.0])


def test_short_windows_are_padded_to_the_model_minimum():
    class NeedsFour(nn.Module):
        min_frames = 4

        def forward(self, inputs):
            assert inputs["video"].shape[2] == 4
            return inputs["video"][:, 0, :, 0, 0].sum(dim=1, keepdim=True)

    clip = indexed_clip(1, 2)  # frames 0, 1 -> padded with the last frame: 0 + 1 + 1 + 1
    assert forward_chunked(NeedsFour(), clip, -1).logits.item() == 3.0


def test_unknown_aggregation_is_an_error():
    with pytest.raises(ValueError, match="unknown aggregation 'avg'; expected one of mean, max, last, prob"):
        LogitAggregator("avg")
