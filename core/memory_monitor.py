"""Where memory goes: device allocated/reserved/peak/free and host RSS of the main process and its workers."""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading

import torch

MB = 1024**2


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def trim_freed_memory() -> bool:
    """Give the C heap's freed pages back to the system (glibc's malloc_trim); False where there is none.

    Streaming inference allocates each group of decoded chunks (MBs) on its decode thread and frees it on the main
    one. glibc raises its mmap threshold after the first such frees, so later groups come from the heap, whose
    freed blocks stay resident: a 30,000-frame stream grew from 0.85 to 1.5 GB of RSS this way, while decoding alone
    and the model alone stayed flat (a VmRSS trace). Mapping every large block instead (mallopt) kept it flat but
    took 2.4x the time (page faults); trimming now and then is the cheap way."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo: what the kernel can give without swapping; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def host_rss_mb() -> float:
    """Resident memory of this process (Linux /proc; ru_maxrss peak elsewhere)."""
    rss = _rss_mb(os.getpid())
    return rss if rss > 0.0 else host_peak_rss_mb()  # no /proc: the peak is the best available figure


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def host_heap_in_use_mb() -> float | None:
    """Bytes the C allocator has handed out and not got back (glibc's mallinfo2), None elsewhere.

    RSS misses a leak that reuses memory freed earlier (freed heap pages stay resident); this does not.
    """
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / MB


def host_peak_rss_mb() -> float:
    """Peak resident memory of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


ALLOCATOR_HISTORY_ENTRIES = 100_000  # trainer.memory_snapshot: the allocator events kept (several KB each)


def record_allocator_history() -> None:
    """CUDA's caching allocator records each allocation and free with its stack, for ``allocator_snapshot``."""
    torch.cuda.memory._record_memory_history(max_entries=ALLOCATOR_HISTORY_ENTRIES)


def allocator_snapshot() -> dict:
    """The allocator's segments and recorded history (what pytorch.org/memory_viz draws)."""
    return torch.cuda.memory._snapshot()


def snapshot(device: torch.device) -> dict:
    """Plain floats in MB: host RSS of this process and of its children (DataLoader workers), and device memory."""
    children = _child_pids(os.getpid())
    result = {
        "host_rss_mb": host_rss_mb(),
        "workers_rss_mb": sum(_rss_mb(p) for p in children),
        "num_workers_alive": len(children),
    }
    heap = host_heap_in_use_mb()
    if heap is not None:
        result["host_heap_mb"] = heap
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        result.update(
            device_allocated_mb=torch.cuda.memory_allocated(device) / MB,
            device_reserved_mb=torch.cuda.memory_reserved(device) / MB,
            device_peak_mb=torch.cuda.max_memory_allocated(device) / MB,
            device_free_mb=free / MB,
            device_total_mb=total / MB,
        )
    return result


def compact(snap: dict) -> str:
    """Short form for the progress bar."""
    text = f"host {snap['host_rss_mb']:.0f}M"
    if snap.get("workers_rss_mb"):
        text += f"+{snap['workers_rss_mb']:.0f}M"
    if "device_peak_mb" in snap:
        text += f" gpu {snap['device_allocated_mb']:.0f}/{snap['device_peak_mb']:.0f}M"
    return text


class LeakDetector:
    """Flags memory that grows epoch after epoch, measured at the same point of each epoch.

    A warning when every one of the last ``epochs`` epochs grew and the growth adds up to more than
    ``tolerance_mb``, separately for the main process, the DataLoader workers and the device.
    """

    PLACES = (
        ("host_heap_mb", "the main process (allocated host heap)"),
        ("host_rss_mb", "the main process (host RSS)"),
        ("workers_rss_mb", "the DataLoader workers (host RSS)"),
        ("device_allocated_mb", "the device (allocated)"),
    )

    def __init__(self, epochs: int = 3, tolerance_mb: float = 256.0):
        self.epochs, self.tolerance_mb = epochs, tolerance_mb
        self.history: list[dict] = []

    def observe(self, snap: dict) -> str | None:
        self.history.append(snap)
        recent = self.history[-(self.epochs + 1) :]
        if len(recent) <= self.epochs:
            return None
        findings = []
        for key, place in self.PLACES:
            values = [s.get(key) for s in recent]
            if None in values or (key == "workers_rss_mb" and not all(s.get("num_workers_alive") for s in recent)):
                continue
            growth = values[-1] - values[0]
            if all(b > a for a, b in zip(values, values[1:])) and growth > self.tolerance_mb:
                findings.append(
                    f"{place} grew {growth:.0f} MB over {self.epochs} epochs "
                    f"({' -> '.join(f'{v:.0f}' for v in values)} MB)"
                )
        if not findings:
            return None
        return (
            "possible memory leak: " + "; ".join(findings) + ". Likely causes: outputs or losses kept across "
            "steps (keep loss.item() or .detach().cpu(), not the tensor), tensors kept with their graph (code "
            "outside torch.inference_mode/no_grad), caches that grow in the dataset (workers)"
        )


class PeakRssSampler:
    """Peak host RSS during a block, sampled every few ms on a thread (the kernel's peak cannot be reset)."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.peak_mb = 0.0

    def __enter__(self):
        self.baseline_mb = host_rss_mb()
        self.peak_mb = self.baseline_mb
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak_mb = max(self.peak_mb, host_rss_mb())
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, host_rss_mb())

    @property
    def increase_mb(self) -> float:
        return self.peak_mb - self.baseline_mb
