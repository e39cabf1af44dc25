"""Writes that a kill at any moment cannot tear: a temporary file beside the target, flushed and fsynced, then
renamed over it. Readers see the old file or the new one, never a part. Every write that matters in the project
goes through this module (checkpoints, CSV logs, plots, the cron ledger, the video index cache, the synthetic
videos, the ``latest`` link). Torch-free (the video index cache uses it).

A write that fails because the disk is full (ENOSPC), a quota is reached (EDQUOT) or the device fails (EIO) raises
``DiskFullError``, one line naming the file and the space left there, whatever the writer (torch.save reports a
failed write as its own RuntimeError); the scripts print it and exit 1. Appends (``append_whole``) are whole rows or
nothing, and a row torn by a kill is cut off when the file is next opened (``repair_torn_tail``).

Temporary files are named ``.<target>.<writer pid>.<random>.tmp``, so a later run can tell one whose writer was
killed (its process is gone) from one being written now, and remove it (``remove_stale_temp_files``). Files get
the mode a plain ``open()`` would give under the user's umask (a temporary file's own mode is 0600, which would
hide checkpoints and results from colleagues sharing a runs folder).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile

_TEMP_NAME = re.compile(r"^\..+\.(\d+)\.[^.]+\.tmp(\.[^.]+)?$")  # atomic_path keeps the extension after .tmp


DISK_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is reached",
    errno.EIO: "the device failed to write (EIO)",
}


class DiskFullError(Exception):
    """A write that failed for lack of space (or a failing device): the message names the file, why, and the free
    space there. Built from one string, so a DataLoader worker's can be raised again in the main process."""


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem that holds ``path`` (or would: its nearest existing parent); None if unknown."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def free_space_text(path: str) -> str:
    """e.g. '12.5 MB free', of the filesystem holding ``path``."""
    free = free_bytes(path)
    return "free space unknown" if free is None else f"{free / 2**20:.1f} MB free"


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_ERRNOS


@contextlib.contextmanager
def naming_disk_errors(path: str):
    """A disk-full OSError raised in the block becomes DiskFullError naming ``path``; others pass unchanged."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise DiskFullError(
                f"{path}: cannot write it: {DISK_ERRNOS[e.errno]} ({free_space_text(path)} there)"
            ) from None
        raise


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
    with naming_disk_errors(path):
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=suffix, dir=directory)
    os.close(fd)
    try:
        with naming_disk_errors(path):
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


class _WriteRecorder:
    """The file object ``atomic_open`` yields: every call goes to the file, and the OSError of a failed write is
    kept, because some writers raise their own error instead of it (torch.save: "unexpected pos")."""

    def __init__(self, file):
        self._file, self.write_error = file, None

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except OSError as e:
            self.write_error = e
            raise

    def __getattr__(self, name):
        return getattr(self._file, name)


@contextlib.contextmanager
def atomic_open(path: str):
    """A binary file object whose content replaces ``path`` when the block ends without an error."""
    with _replacing(path, ".tmp") as tmp, open(tmp, "wb") as f:
        recorder = _WriteRecorder(f)
        try:
            yield recorder
        except Exception as e:
            if recorder.write_error is not None and not isinstance(e, OSError):
                raise recorder.write_error from None  # the writer's own error hid why the write failed
            raise
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
    with naming_disk_errors(link):
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
    with naming_disk_errors(target):
        try:
            os.link(source, tmp)
        except OSError as e:  # a filesystem without hard links
            if is_disk_full(e):
                raise
            try:
                shutil.copyfile(source, tmp)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        os.replace(tmp, target)


def append_whole(path: str, data: bytes) -> None:
    """Append ``data`` (whole rows) to ``path``: all of it, or, when a write fails (a full disk), nothing: the file
    is cut back to its length before the call, so no row is left half-written."""
    with naming_disk_errors(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except BaseException:
                os.ftruncate(fd, size)  # needs no space
                raise
        finally:
            os.close(fd)


def repair_torn_tail(path: str) -> int:
    """Cut a text file of rows back to its last whole row (a row torn by a kill mid-write or by a full disk before
    whole-row appends); returns the bytes removed (0: the file was whole, or does not exist)."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            step, end = 4096, size
            while end > 0:  # the last newline, reading backwards
                start = max(0, end - step)
                f.seek(start)
                block = f.read(end - start)
                newline = block.rfind(b"\n")
                if newline >= 0:
                    keep = start + newline + 1
                    break
                end = start
            else:
                keep = 0
            f.truncate(keep)
            return size - keep
    except FileNotFoundError:
        return 0


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _writer_gone(pid: int) -> bool:
    """Whether the process that named a temporary file or folder after its pid has ended (not this one)."""
    return pid != os.getpid() and not _process_alive(pid)


def process_temp_dir(prefix: str) -> str:
    """A new folder ``<prefix><pid>-<random>`` in the system's temp directory, removed when this process exits
    (errors included); folders of the same prefix whose process is gone (killed before it could remove them) are
    removed first."""
    base = tempfile.gettempdir()
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    for name in os.listdir(base):
        match = pattern.match(name)
        if match and _writer_gone(int(match.group(1))):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    with naming_disk_errors(base):
        path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)
    atexit.register(remove_own_temp_dir, path)
    return path


def remove_own_temp_dir(path: str) -> None:
    """Remove a ``process_temp_dir`` folder, from the process that made it only (a forked child that inherited the
    exit handler leaves its parent's folder alone)."""
    if os.path.basename(path).split("-")[-2] == str(os.getpid()):
        shutil.rmtree(path, ignore_errors=True)


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
            if match and _writer_gone(int(match.group(1))):
                path = os.path.join(folder, name)
                try:
                    os.unlink(path)
                    removed.append(path)
                except FileNotFoundError:
                    pass
    return removed
