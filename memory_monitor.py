"""Where memory goes: device allocated/reserved/peak/free and host RSS of the main process and its workers."""
from __future__ import annotations

import csv
import os
import sys

import torch

MB = 1024 ** 2


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


def host_rss_mb() -> float:
    """Resident memory of this process (Linux /proc; ru_maxrss peak elsewhere)."""
    rss = _rss_mb(os.getpid())
    return rss if rss > 0.0 else host_peak_rss_mb()  # no /proc: the peak is the best available figure


def host_peak_rss_mb() -> float:
    """Peak resident memory of this process so far."""
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def snapshot(device: torch.device) -> dict:
    """Plain floats in MB: host RSS of this process and of its children (DataLoader workers), and device memory."""
    children = _child_pids(os.getpid())
    result = {"host_rss_mb": host_rss_mb(), "workers_rss_mb": sum(_rss_mb(p) for p in children),
              "num_workers_alive": len(children)}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        result.update(device_allocated_mb=torch.cuda.memory_allocated(device) / MB,
                      device_reserved_mb=torch.cuda.memory_reserved(device) / MB,
                      device_peak_mb=torch.cuda.max_memory_allocated(device) / MB,
                      device_free_mb=free / MB, device_total_mb=total / MB)
    return result


def compact(snap: dict) -> str:
    """Short form for the progress bar."""
    text = f"host {snap['host_rss_mb']:.0f}M"
    if snap.get("workers_rss_mb"):
        text += f"+{snap['workers_rss_mb']:.0f}M"
    if "device_peak_mb" in snap:
        text += f" gpu {snap['device_allocated_mb']:.0f}/{snap['device_peak_mb']:.0f}M"
    return text


class CsvLog:
    """Appends rows of plain values to a CSV file; the header comes from the first row."""

    def __init__(self, path: str):
        self.path = path
        self.fields: list[str] | None = None
        if os.path.exists(path):
            with open(path, newline="") as f:
                self.fields = next(csv.reader(f), None)

    def write(self, row: dict) -> None:
        new = self.fields is None
        if new:
            self.fields = list(row)
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)
