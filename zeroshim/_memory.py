"""Host-memory helpers shared by the memory patches (no heavy imports).

* :func:`malloc_trim`: glibc ``malloc_trim(0)``, which returns the free pages
  of every malloc arena to the OS (``MADV_DONTNEED`` on whole free pages, and
  the top of the heap).
* :func:`pss_mb` / :func:`tree_pss_mb`: proportional set size of a process and
  of a process with its children.  PSS, not RSS: pages a fork shares are
  split between the sharers, pages copied on write are counted in full.
* :func:`system_used_mb`: MemTotal - MemAvailable, the whole machine.
"""

from __future__ import annotations

import os
import sys

_malloc_trim = None


def malloc_trim() -> bool:
    """glibc ``malloc_trim(0)``: give freed heap back to the OS.  False where the
    C library has none (musl, macOS, Windows) or nothing was returned."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                _malloc_trim = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):
                pass
    return bool(_malloc_trim and _malloc_trim(0))


def pss_mb(pid: "int | None" = None) -> "float | None":
    """PSS of one process in MiB (None where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def children(pid: "int | None" = None) -> "list":
    """PIDs of the descendants of ``pid`` (default: this process), from /proc."""
    parent_of = {}
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as fh:
                        stat = fh.read()
                    parent_of[int(entry)] = int(stat[stat.rfind(")") + 2:].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
    except OSError:
        return []
    found, todo = [], [pid or os.getpid()]
    while todo:
        current = todo.pop()
        kids = [p for p, parent in parent_of.items() if parent == current]
        found.extend(kids)
        todo.extend(kids)
    return found


def tree_pss_mb(pid: "int | None" = None) -> "float | None":
    """PSS of a process and all its descendants (DataLoader workers), in MiB."""
    own = pss_mb(pid)
    if own is None:
        return None
    return own + sum(pss_mb(child) or 0.0 for child in children(pid))


def system_used_mb() -> "float | None":
    """MemTotal - MemAvailable in MiB (None where /proc/meminfo cannot be read)."""
    info = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0])
        return (info["MemTotal"] - info["MemAvailable"]) / 1024
    except (OSError, KeyError, ValueError):
        return None
