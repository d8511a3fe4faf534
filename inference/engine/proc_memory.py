"""A process's memory as Linux counts it, read from ``/proc`` (no psutil), and glibc's allocator
told to give large buffers back.

- ``ProcessMemory.read(pid)``: RSS and its peak (``/proc/PID/status``), PSS and private dirty
  (``/proc/PID/smaps_rollup``). A few hundred microseconds; no effect on the process read.
- ``rss_bytes()``: this process's resident set now, cheaply (the RAM tier reads it as it fills).
- ``mapped_files(pid)``: resident MB per mapped file (``/proc/PID/smaps``), to tell the model's
  mapped weights from shared libraries and anonymous memory. A few milliseconds.
- ``tune_malloc()``: a board moves megabyte states all day; glibc would otherwise raise its
  mmap threshold after the first such buffer is freed and serve the next ones from heaps it
  never returns, so the RSS creeps up run after run.

Linux only; elsewhere ``read`` returns zeros and ``tune_malloc`` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import asdict, dataclass
from pathlib import Path

MB = 1024 * 1024


def _kb_fields(path: Path, names: tuple[str, ...]) -> dict[str, int]:
    """``Name: N kB`` lines of a /proc file, in kB (missing names are absent)."""
    found: dict[str, int] = {}
    try:
        with open(path) as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in names:
                    found[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return found


@dataclass(frozen=True)
class ProcessMemory:
    rss_mb: float = 0.0  # resident now (VmRSS): anonymous + file pages + shared memory
    peak_rss_mb: float = 0.0  # highest RSS since the process started (VmHWM)
    anon_mb: float = 0.0  # resident anonymous pages (RssAnon): the process's own data
    file_mb: float = 0.0  # resident file pages (RssFile): the mapped model, shared libraries
    pss_mb: float = 0.0  # proportional set size: pages shared with k processes count 1/k
    private_dirty_mb: float = 0.0  # pages no other process has and nothing on disk backs

    @classmethod
    def read(cls, pid: int | str = "self") -> "ProcessMemory":
        status = _kb_fields(Path(f"/proc/{pid}/status"), ("VmRSS", "VmHWM", "RssAnon", "RssFile"))
        rollup = _kb_fields(Path(f"/proc/{pid}/smaps_rollup"), ("Pss", "Private_Dirty"))

        def mb(fields: dict, key: str) -> float:
            return round(fields.get(key, 0) / 1024, 1)

        return cls(
            rss_mb=mb(status, "VmRSS"),
            peak_rss_mb=mb(status, "VmHWM"),
            anon_mb=mb(status, "RssAnon"),
            file_mb=mb(status, "RssFile"),
            pss_mb=mb(rollup, "Pss"),
            private_dirty_mb=mb(rollup, "Private_Dirty"),
        )

    def as_dict(self) -> dict:
        return asdict(self)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set now, in bytes (``/proc/self/statm``: one small read, a few
    microseconds); 0 where there is no /proc."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def mapped_files(pid: int | str = "self") -> dict[str, float]:
    """Resident MB of each file mapped into the process (its path -> MB), largest first."""
    sizes: dict[str, int] = {}
    current: str | None = None
    try:
        with open(f"/proc/{pid}/smaps") as handle:
            for line in handle:
                first = line.split(None, 5)
                if len(first) >= 5 and "-" in first[0] and ":" not in first[0]:  # a mapping's header line
                    path = first[5].strip() if len(first) == 6 else ""
                    current = path if path.startswith("/") else None
                elif current is not None and line.startswith("Rss:"):
                    sizes[current] = sizes.get(current, 0) + int(line.split()[1])
    except (OSError, ValueError):
        return {}
    return {path: round(kb / 1024, 1) for path, kb in sorted(sizes.items(), key=lambda item: -item[1]) if kb}


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_malloc(mmap_threshold: int = 256 * 1024, trim_threshold: int = 1 * MB, arenas: int = 2) -> bool:
    """Have glibc map every buffer of ``mmap_threshold`` bytes or more on its own (and unmap it
    when freed), trim the heap above ``trim_threshold``, and keep at most ``arenas`` heaps.

    Setting the threshold explicitly turns off glibc's dynamic threshold, which otherwise rises
    to the largest buffer freed (up to 32 MB), after which every state of a few MB lands in a
    heap that keeps its pages. Cost: one mmap/munmap pair per large buffer (microseconds next to
    the milliseconds a state takes to move). False where glibc is not the allocator.
    """
    name = ctypes.util.find_library("c")
    if os.name != "posix" or not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold),
            (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_ARENA_MAX, arenas),
        )
    )
