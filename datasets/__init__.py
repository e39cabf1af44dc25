"""Data: video reading, manifests, windowing, keypoints, transforms and the synthetic generator.

Kept free of imports: ``datasets.video_reader`` loads without torch (the loader benchmark measures it alone).
"""

import os as _os
import sys as _sys

# FFmpeg's and OpenCV's own log lines ("[mov,mp4,...] moov atom not found", "[ WARN:0@...] cap.cpp") surround
# the one-line error the scripts print for a bad file. Quiet before cv2 is first imported, unless the user set
# these variables or asked for -v / --verbose.
if not {"-v", "--verbose"} & set(_sys.argv[1:]):
    _os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")
    _os.environ.setdefault("OPENCV_LOG_LEVEL", "ERROR")
