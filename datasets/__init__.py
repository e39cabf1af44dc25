"""Data: video reading, manifests, windowing, keypoints, transforms and the synthetic generator.

Kept free of imports: ``datasets.video_reader`` loads without torch (the loader benchmark measures it alone).
"""
