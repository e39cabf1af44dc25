"""A clip between the decoder and the DataLoader: aspect-true resize, crop, augmentation; keypoints follow.

The steps, for every view of a sample (``data.*`` keys):

1. **Decode size** (``resize``): ``short_side`` keeps the frame's aspect ratio, scaling it so that its short side
   is ``short_side`` (null: the least scale at which the ``img_size`` crop fits, so nothing is cut that need not
   be); ``stretch`` decodes straight to ``img_size`` (frames already of that shape). The reader resizes each frame
   as it is decoded, so a 1080p clip never exists at full size.
2. **Crop** to ``img_size``: at evaluation the centre (``test_crops: 3``: three crops along the long side, each an
   evaluated clip); when training, a random position, or with ``augment`` a random resized crop (area share in
   ``CROP_SCALE``, aspect ratio ``CROP_RATIO`` times the output's, log-uniform), resized to ``img_size``.
3. **Augmentation** (``augment``, training only): horizontal flip (``flip``) and colour jitter (``color_jitter``:
   brightness, contrast and saturation factors drawn in [1 - s, 1 + s]).

The pixel operations are torchvision.transforms.v2's (uint8 [T, C, H, W] tensors: every frame of a clip gets the
same parameters). The crop, resize and flip are torch's own calls made as torchvision makes them, the same pixels,
so that a process without colour jitter never imports torchvision (whose import loads torch's compiler); the
jitter is torchvision's. The parameters are drawn here from a generator seeded by (seed, epoch, sample), like the
clip placement, so a run repeats exactly whichever worker loads a sample, and resumes exactly.

Views: each camera gets its own crop (different cameras, different framing: nothing ties their pixel positions)
but one flip (and one set of colour factors) for the sample: a flip mirrors the scene, so the label's sides
(``flip_label_pairs``) and the keypoints' joints (``kpt_flip_pairs``) swap once. Keypoints follow the first
view's geometry.

Keypoint coordinates (``kpt_coords``): ``normalized`` (x / width, y / height of the frame: 0 and 1 are its edges)
or ``pixels`` (pixel indices of the stored frame, pixel (i, j)'s centre at (i, j), what ``frame[j, i]`` reads).
The output keypoints use the same convention, in the output clip's frame. Points the crop leaves out fall outside
[0, 1] (or the frame's pixels); NaN stays NaN.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as nnf

from config import DataConfig

RANDOM_CROP_ATTEMPTS = 10  # torchvision's RandomResizedCrop: then the largest centred box of the allowed ratio

# data.augment's random resized crop: the share of the decoded frame's area it covers, and its aspect ratio relative
# to data.img_size's (torchvision's RandomResizedCrop with the area of video recipes, which keep more of the frame)
CROP_SCALE = (0.35, 1.0)
CROP_RATIO = (0.75, 1.3333)


@dataclass(frozen=True)
class Box:
    """A crop of a decoded frame, in its pixels."""

    top: int
    left: int
    height: int
    width: int


@dataclass(frozen=True)
class ViewGeometry:
    """What happened to one view's frames: decoded at ``decoded`` (h, w) from ``source`` (h, w), cropped to
    ``box``, resized to ``out`` (h, w), mirrored if ``flipped``."""

    source: tuple
    decoded: tuple
    box: Box
    out: tuple
    flipped: bool = False


def output_size(data_cfg: DataConfig) -> tuple[int, int]:
    size = data_cfg.img_size
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def decode_size(height: int, width: int, data_cfg: DataConfig) -> tuple[int, int]:
    """(h, w) the reader decodes a ``height`` x ``width`` video to."""
    out_h, out_w = output_size(data_cfg)
    if data_cfg.resize == "stretch":
        return out_h, out_w
    scale = max(out_h / height, out_w / width)  # the least scale at which the crop fits
    if data_cfg.short_side is not None:
        scale = max(scale, data_cfg.short_side / min(height, width))
    # rounding can land one pixel short of the crop: never below it
    return max(out_h, round(height * scale)), max(out_w, round(width * scale))


def evaluation_boxes(decoded: tuple, out: tuple, crops: int) -> list[Box]:
    """The centre crop, or three crops along the longer free axis (start, centre, end)."""
    (h, w), (out_h, out_w) = decoded, out
    free_y, free_x = h - out_h, w - out_w
    if crops == 1 or (free_x == 0 and free_y == 0):
        offsets = [(free_y // 2, free_x // 2)] * crops
    elif free_x >= free_y:
        offsets = [(free_y // 2, x) for x in (0, free_x // 2, free_x)]
    else:
        offsets = [(y, free_x // 2) for y in (0, free_y // 2, free_y)]
    return [Box(top, left, out_h, out_w) for top, left in offsets]


def random_box(decoded: tuple, out: tuple, rng: np.random.Generator) -> Box:
    """A random position of an output-sized crop (training without augmentation)."""
    (h, w), (out_h, out_w) = decoded, out
    return Box(int(rng.integers(h - out_h + 1)), int(rng.integers(w - out_w + 1)), out_h, out_w)


def random_resized_box(decoded: tuple, out: tuple, scale, ratio, rng: np.random.Generator) -> Box:
    """torchvision's RandomResizedCrop box, with the aspect ratio relative to the output's (a 160x210 output is
    not squeezed from square crops), drawn from ``rng``."""
    (h, w), (out_h, out_w) = decoded, out
    area, out_aspect = h * w, out_w / out_h
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(RANDOM_CROP_ATTEMPTS):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = out_aspect * math.exp(rng.uniform(*log_ratio))
        box_w, box_h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < box_w <= w and 0 < box_h <= h:
            return Box(int(rng.integers(h - box_h + 1)), int(rng.integers(w - box_w + 1)), box_h, box_w)
    # the largest centred box with the output's aspect ratio
    box_h, box_w = (h, min(w, round(h * out_aspect))) if w / h >= out_aspect else (min(h, round(w / out_aspect)), w)
    return Box((h - box_h) // 2, (w - box_w) // 2, box_h, box_w)


class ClipTransform:
    """Decode sizes, crops and augmentation of one dataset (``data`` config, training or not)."""

    def __init__(self, data_cfg: DataConfig, training: bool):
        self.cfg, self.training = data_cfg, training
        self.out = output_size(data_cfg)
        self.augment = training and data_cfg.augment
        self.crops = 1 if training else data_cfg.test_crops
        pairs = data_cfg.kpt_flip_pairs or []
        self.joint_swap = [(int(a), int(b)) for a, b in pairs]

    def plan(self, sources: list[tuple], rng: np.random.Generator | None, crop: int = 0) -> list[ViewGeometry]:
        """The geometry of each view (``sources``: each view's stored (h, w)); ``rng`` for training's draws,
        ``crop``: which of the evaluation crops."""
        flipped = bool(self.augment and self.cfg.flip and rng.random() < 0.5)
        plans = []
        for source in sources:
            decoded = decode_size(*source, self.cfg)
            if not self.training:
                box = evaluation_boxes(decoded, self.out, self.crops)[crop]
            elif self.augment:
                box = random_resized_box(decoded, self.out, CROP_SCALE, CROP_RATIO, rng)
            else:
                box = random_box(decoded, self.out, rng)
            plans.append(ViewGeometry(tuple(source), decoded, box, self.out, flipped))
        return plans

    def colour_factors(self, rng: np.random.Generator | None) -> tuple | None:
        strength = self.cfg.color_jitter
        if not (self.augment and strength > 0):
            return None
        return tuple(float(rng.uniform(1 - strength, 1 + strength)) for _ in range(3))

    def frames(self, video: torch.Tensor, geometry: ViewGeometry, colour: tuple | None = None) -> torch.Tensor:
        """uint8 [T, C, H, W] decoded frames -> uint8 [T, C, out_h, out_w]."""
        box = geometry.box
        video = resize(crop(video, box), geometry.out)
        if geometry.flipped:
            video = video.flip(-1)
        if colour is not None:
            from torchvision.transforms.v2 import functional as F  # only here: see the module's docstring

            brightness, contrast, saturation = colour
            # one float pass, rounded once: on uint8 each of the three converts to float and back (1.4x slower)
            video = video.float().div_(255)
            video = F.adjust_saturation(F.adjust_contrast(F.adjust_brightness(video, brightness), contrast), saturation)
            video = video.mul_(255).round_().to(torch.uint8)
        return video

    def keypoints(self, kpt: np.ndarray, geometry: ViewGeometry) -> np.ndarray:
        """[T, J, C] keypoints (x, y first) of the stored frame -> the same points in the output frame."""
        return transform_keypoints(kpt, geometry, self.cfg.kpt_coords, self.joint_swap)


def crop(video: torch.Tensor, box: Box) -> torch.Tensor:
    """torchvision's crop of a tensor: what of ``box`` lies outside the frame is black."""
    height, width = video.shape[-2:]
    top, left, bottom, right = box.top, box.left, box.top + box.height, box.left + box.width
    inside = video[..., max(top, 0) : bottom, max(left, 0) : right]
    if top >= 0 and left >= 0 and bottom <= height and right <= width:
        return inside
    outside = [
        max(min(right, 0) - left, 0),
        max(right - max(width, left), 0),
        max(min(bottom, 0) - top, 0),
        max(bottom - max(height, top), 0),
    ]
    return nnf.pad(inside, outside, mode="constant", value=0)


def resize(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[..., C, H, W] to ``size`` (height, width): torchvision.transforms.v2.functional.resize's tensor path,
    bilinear with antialiasing, the same pixels (tests/test_clip_transform.py compares them): uint8 resized as
    uint8 where torch has that kernel (an x86 CPU with AVX2 or AVX512, or an ARM one), else in float32, rounded."""
    *lead, channels, height, width = video.shape
    if (height, width) == tuple(size) or video.numel() == 0:
        return video
    native = video.dtype in (torch.float32, torch.float64) or (video.dtype == torch.uint8 and _native_uint8(video))
    frames = video.reshape(-1, channels, height, width)
    out = nnf.interpolate(
        frames if native else frames.float(), size=list(size), mode="bilinear", align_corners=False, antialias=True
    )
    if not native:
        out = (out.round_() if not video.dtype.is_floating_point else out).to(video.dtype)
    return out.reshape(*lead, channels, *size)


def _native_uint8(video: torch.Tensor) -> bool:
    return video.device.type == "cpu" and (
        torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
    )


def transform_keypoints(kpt: np.ndarray, geometry: ViewGeometry, coords: str, joint_swap=()) -> np.ndarray:
    """The decode scale, the crop, the resize and the flip applied to x and y, in continuous coordinates (a pixel
    index i is the continuous i + 0.5): the point stays on the pixel it marks."""
    kpt = np.array(kpt, dtype=np.float32, copy=True)
    (src_h, src_w), (dec_h, dec_w), box, (out_h, out_w) = geometry.source, geometry.decoded, geometry.box, geometry.out
    x, y = kpt[..., 0].astype(np.float64), kpt[..., 1].astype(np.float64)
    if coords == "normalized":
        x, y = x * dec_w, y * dec_h
    else:
        x, y = (x + 0.5) * dec_w / src_w, (y + 0.5) * dec_h / src_h
    x = (x - box.left) * out_w / box.width
    y = (y - box.top) * out_h / box.height
    if geometry.flipped:
        x = out_w - x
    if coords == "normalized":
        x, y = x / out_w, y / out_h
    else:
        x, y = x - 0.5, y - 0.5
    kpt[..., 0], kpt[..., 1] = x, y
    if geometry.flipped:
        for a, b in joint_swap:
            kpt[:, [a, b]] = kpt[:, [b, a]]
    return kpt
