"""``--shard i/N``: N processes or machines split one list of videos, each taking every N-th from the i-th
(``infer_chunked.py --features``, ``python -m datasets.prepare``)."""

from __future__ import annotations

from core.errors import UsageError


def parse_shard(text: str | None) -> tuple[int, int]:
    """--shard i/N -> (i, N); (0, 1) for none."""
    if text is None:
        return 0, 1
    parts = text.split("/")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) < 1:
        raise UsageError(f"--shard {text}: expected i/N with 0 <= i < N, e.g. --shard 0/4 (the first of 4 shards)")
    index, count = int(parts[0]), int(parts[1])
    if index >= count:
        raise UsageError(f"--shard {text}: i must be below N ({count} shards are numbered 0 to {count - 1})")
    return index, count


def shard(records: list, index: int, count: int) -> list:
    """Every count-th record from index: deterministic for the same input list; all shards together take each
    video once."""
    return records[index::count]
