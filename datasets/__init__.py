"""Data: video reading, manifests, windowing, keypoints, transforms and the synthetic generator.

Kept free of imports and of work: ``datasets.video`` loads without torch (the loader benchmark measures
it alone), and the scripts' main() quiets FFmpeg's and OpenCV's logs (core.logs.setup_logging).
"""
