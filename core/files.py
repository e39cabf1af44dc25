"""Writes that a kill at any moment cannot tear: a temporary file beside the target, flushed and fsynced, then
renamed over it. Readers see the old file or the new one, never a part. Every write that matters in the project
goes through this module (checkpoints, CSV logs, plots, the cron ledger, the video index cache, the synthetic
videos, the ``latest`` link). Torch-free (the video index cache uses it).

Temporary files are named ``.<target>.<writer pid>.<random>.tmp``, so a later run can tell one whose writer was
killed (its process is gone) from one being written now, and remove it (``remove_stale_temp_files``). Files get
the mode a plain ``open()`` would give under the user's umask (a temporary file's own mode is 0600, which would
hide checkpoints and results from colleagues sharing a runs folder).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile

_TEMP_NAME = re.compile(r"^\..+\.(\d+)\.[^.]+\.tmp(\.[^.]+)?$")  # atomic_path keeps the extension after .tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_prefix(path: str) -> str:
    """The start of a temporary file's name for ``path``: hidden, then the writer's pid (``_TEMP_NAME``)."""
    return f".{os.path.basename(path)}.{os.getpid()}."


@contextlib.contextmanager
def _replacing(path: str, suffix: str):
    """A new temporary path beside ``path`` (``_TEMP_NAME``, ending in ``suffix``), renamed over ``path`` when the
    block ends without an error (with the umask's mode, the rename itself made durable), removed otherwise."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=suffix, dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


@contextlib.contextmanager
def atomic_open(path: str):
    """A binary file object whose content replaces ``path`` when the block ends without an error."""
    with _replacing(path, ".tmp") as tmp, open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_path(path: str):
    """A temporary path (same directory, same extension) for writers that take a file name, not a file object
    (matplotlib's savefig, PyAV's container): renamed over ``path`` when the block ends without an error."""
    with _replacing(path, ".tmp" + os.path.splitext(path)[1]) as tmp:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())


def atomic_symlink(target: str, link: str) -> None:
    """``link`` -> ``target`` (a relative target stays relative), replaced at once: readers see the old or the
    new target."""
    if os.path.islink(link) and os.readlink(link) == target:
        return
    tmp = os.path.join(os.path.dirname(os.path.abspath(link)), _temp_prefix(link) + "symlink.tmp")
    os.symlink(target, tmp)
    os.replace(tmp, link)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_link(source: str, target: str) -> None:
    """``target`` becomes the same file as ``source`` (a hard link; a copy where links fail), replaced at once.
    A later atomic write of ``source`` makes a new file, so ``target`` keeps the content it was linked to."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(target)), _temp_prefix(target) + "link.tmp")
    try:
        os.link(source, tmp)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temp_files(directory: str, recursive: bool = False) -> list[str]:
    """Remove this writer's temporary files in ``directory`` whose writing process no longer exists (a run
    killed during a write); returns their paths. Files being written by a live process are left alone."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    walker = os.walk(directory) if recursive else [(directory, [], os.listdir(directory))]
    for folder, _, names in walker:
        for name in names:
            match = _TEMP_NAME.match(name)
            if match and int(match.group(1)) != os.getpid() and not _process_alive(int(match.group(1))):
                path = os.path.join(folder, name)
                try:
                    os.unlink(path)
                    removed.append(path)
                except FileNotFoundError:
                    pass
    return removed
