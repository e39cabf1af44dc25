"""What is known of a video file before reading it (``VideoInfo``), and the errors a read can end in."""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets.orientation import Orientation

REENCODE_HINT = "re-encode it, e.g. ffmpeg -i in.mkv -c:v libx264 -pix_fmt yuv420p out.mp4"


class VideoReadError(Exception):
    """A video that cannot be read as asked: the message names the file and what to do."""


class StalledFile(VideoReadError):
    """A file that did not answer within data.sample_timeout_s (a stalled network mount, a corrupt stream)."""


@dataclass
class VideoInfo:
    path: str
    num_frames: int  # the frames the file holds (its packets), which the header's count may misstate
    fps: float
    width: int  # as displayed: the container's display matrix (a phone's rotation) applied
    height: int
    codec: str
    # the packet timestamps number every frame one by one (no dropped frames, constant rate): seeking by
    # timestamp finds frame i of a sequential decode. False: the file is read sequentially (exact, slower).
    regular_timestamps: bool = True
    # every video stream of the file, in file order, as [width, height, frames]: both decoders read the first
    video_streams: list = field(default_factory=list)
    # False: OpenCV's FFmpeg build cannot decode this codec (AV1 in the pip wheel) but PyAV can: pyav only
    opencv_decodes: bool = True
    # how a stored frame is turned for display (datasets.orientation names: none, rotate90, mirror, ...)
    orientation: str = "none"
    # the frame count the container's header states; differs from num_frames when the header misstates it (a
    # file cut short, an MKV Duration written wrong)
    header_frames: int = 0

    def frame_size(self, autorotate: bool = True) -> tuple[int, int]:
        """(height, width) of the frames read: as displayed (``autorotate``), or as stored."""
        return (
            (self.height, self.width)
            if autorotate
            else Orientation.named(self.orientation).stored((self.height, self.width))
        )

    def header_note(self) -> str | None:
        """The warning for a header whose frame count is wrong, or None."""
        if abs(self.header_frames - self.num_frames) <= 1:  # a duration rounded to a frame: not worth a line
            return None
        which = (
            "cut short, or a wrong duration in its header"
            if self.header_frames > self.num_frames
            else "a wrong duration in its header"
        )
        return (
            f"{self.path}: the header says {self.header_frames} frames but the file holds {self.num_frames} "
            f"({which}); using {self.num_frames}"
        )


def several_streams_note(info: VideoInfo) -> str | None:
    """The warning for a file with more than one video stream: which one is read, and why."""
    streams = info.video_streams
    if len(streams) < 2:
        return None
    largest = max(range(len(streams)), key=lambda i: streams[i][0] * streams[i][1])
    listed = ", ".join(f"#{i} {w}x{h} ({n} frames)" for i, (w, h, n) in enumerate(streams))
    return (
        f"{info.path}: {len(streams)} video streams ({listed}); both decoders read #0, the first (OpenCV's FFmpeg "
        f"backend reads no other)"
        + (
            f"; FFmpeg's tools would pick #{largest}, the largest: extract it with "
            f"ffmpeg -i in.mp4 -map 0:v:{largest} -c copy out.mp4"
            if largest
            else ""
        )
    )
