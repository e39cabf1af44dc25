"""The open readers of one process, reused across the windows a DataLoader worker reads."""

from __future__ import annotations

import os
from collections import OrderedDict

from datasets.video.choice import open_reader
from datasets.video.frame_reader import FrameReader
from datasets.video.info import VideoInfo

# Readers a forked process inherited from its parent: never used (an OpenCV capture shares its file offset with
# the parent's, so both read wrong frames and see false ends; PyAV's decoder threads do not exist in the child
# and its swscale pool hangs), and never closed (closing runs the same libraries' teardown on the copied state).
_FORKED_READERS: list = []


class ReaderCache:
    """The last few open readers of a process (a DataLoader worker reads consecutive windows of a video)."""

    def __init__(self, capacity: int = 4, threads: int | None = 1):
        self.capacity, self.threads = capacity, threads
        self._readers: OrderedDict = OrderedDict()
        self._pid = os.getpid()

    def get(
        self, path: str, size, info: VideoInfo | None = None, decoder: str = "opencv", autorotate: bool = True
    ) -> FrameReader:
        if os.getpid() != self._pid:  # a forked DataLoader worker: the parent's readers are not ours (_FORKED_READERS)
            _FORKED_READERS.extend(self._readers.values())
            self._readers.clear()
            self._pid = os.getpid()
        key = (path, None if size is None else tuple(size), decoder, autorotate)
        reader = self._readers.pop(key, None)
        if reader is None:
            reader = open_reader(path, size, threads=self.threads, info=info, decoder=decoder, autorotate=autorotate)
            while len(self._readers) >= self.capacity:
                self._readers.popitem(last=False)[1].close()
        self._readers[key] = reader
        return reader

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
