"""Streaming inference: a video decoded and run in inference chunks, memory flat in its length (stream, chunks);
its timeline, its outputs and its feature files."""
