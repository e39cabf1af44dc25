"""Scores: of clips and videos (clips), of timelines in the papers' columns (segments)."""
