"""Frames as a viewer sees them: the container's display matrix (a phone's 90-degree rotation, a mirror) applied.

A phone filming upright stores landscape frames and a display matrix that turns them for display; players, FFmpeg's
tools (``-noautorotate`` turns it off) and OpenCV (``CAP_PROP_ORIENTATION_AUTO``) apply it. OpenCV applies only
its rotation angle (a mirrored matrix comes out rotated 180 degrees) and PyAV applies nothing, so both decoders
here decode the stored frame with OpenCV's own rotation off, and this module turns it, the same way for both:
the same pixels whatever ``data.decoder`` says (a reader opened with ``autorotate=False`` reads them as stored).

The matrix (FFmpeg's ``AV_PKT_DATA_DISPLAYMATRIX``, 16.16 fixed point ``[a b u; c d v; x y w]``) maps a stored
pixel (p, q) to the displayed one (a*p + c*q + x, b*p + d*q + y), y pointing down. Its 2x2 part, for the eight
orientations a matrix of right angles can give, is a transpose (a = d = 0) and a flip of each axis by its sign;
that is all an ``Orientation`` holds. A matrix of another angle (rare) is kept as stored, said by
``Orientation.of_matrix`` returning None.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import cv2
import numpy as np


@dataclass(frozen=True)
class Orientation:
    """Applied to the stored frame in this order: transpose (swap rows and columns), then mirror left-right
    (``flip_x``), then top-bottom (``flip_y``)."""

    transpose: bool = False
    flip_x: bool = False
    flip_y: bool = False

    @classmethod
    def of_matrix(cls, matrix) -> "Orientation | None":
        """The orientation of a display matrix (9 ints), None when it is not a multiple of 90 degrees."""
        a, b, c, d = (int(matrix[i]) for i in (0, 1, 3, 4))
        if b == 0 and c == 0 and a and d:
            return cls(False, a < 0, d < 0)
        if a == 0 and d == 0 and b and c:
            return cls(True, c < 0, b < 0)
        return None

    @classmethod
    def of_matrix_bytes(cls, data: bytes) -> "Orientation | None":
        return cls.of_matrix(struct.unpack("<9i", data[:36])) if len(data) >= 36 else None

    @classmethod
    def of_rotation(cls, clockwise_degrees: float) -> "Orientation":
        """A rotation alone (OpenCV's CAP_PROP_ORIENTATION_META: clockwise degrees): the fallback without PyAV."""
        return {90: cls(True, True, False), 180: cls(False, True, True), 270: cls(True, False, True)}.get(
            int(round(clockwise_degrees)) % 360, cls()
        )

    @classmethod
    def named(cls, name: str) -> "Orientation":
        return _BY_NAME[name]

    @property
    def name(self) -> str:
        """none, rotate90 / rotate180 / rotate270 (clockwise), mirror (left-right), or rotateN+mirror (rotated, then
        mirrored left-right): the eight EXIF orientations."""
        return _NAMES[self]

    def displayed(self, stored: tuple[int, int]) -> tuple[int, int]:
        """(height, width) on display of a stored (height, width)."""
        return (stored[1], stored[0]) if self.transpose else stored

    def stored(self, displayed: tuple[int, int]) -> tuple[int, int]:
        return self.displayed(displayed)  # a transpose is its own inverse

    def apply(self, frame: np.ndarray, dst: np.ndarray) -> None:
        """``dst`` [H, W, C] (displayed) = ``frame`` (stored) turned; ``frame`` and ``dst`` must not overlap."""
        if self.transpose:
            frame = cv2.transpose(frame)
        code = {(True, True): -1, (True, False): 1, (False, True): 0}.get((self.flip_x, self.flip_y))
        if code is None:
            dst[...] = frame
        else:
            cv2.flip(frame, code, dst=dst)


NONE = Orientation()
_NAMES = {
    Orientation(False, False, False): "none",
    Orientation(True, True, False): "rotate90",
    Orientation(False, True, True): "rotate180",
    Orientation(True, False, True): "rotate270",
    Orientation(False, True, False): "mirror",
    Orientation(True, False, False): "rotate90+mirror",
    Orientation(False, False, True): "rotate180+mirror",
    Orientation(True, True, True): "rotate270+mirror",
}
_BY_NAME = {name: orientation for orientation, name in _NAMES.items()}
