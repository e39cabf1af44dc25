"""A checkpoint scored on a split (evaluate), eval.py --watch's unattended loop (watch), MS-TCN's cross-validation
(``python -m engine.evaluation.cross_validation``)."""
