"""A benchmark process's resident memory as the kernel counts it: one step's growth is the high-water mark after
the step over the resident size before it, the mark reset to that size just before (/proc/self/clear_refs)."""

from __future__ import annotations


def status_bytes(field: str) -> int:
    """/proc/self/status's ``field`` (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def reset_high_water_mark() -> int:
    """The high-water mark back to the current resident size; that size in bytes (what a step's growth is from)."""
    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return before


def growth_since(before: int) -> int:
    """Bytes the high-water mark rose above ``before`` (``reset_high_water_mark``'s)."""
    return status_bytes("VmHWM") - before
