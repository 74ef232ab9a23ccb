"""Process memory policy for the torch engine.

Loading repacks every weight through short-lived temporaries of a few MB. With glibc's
default, such blocks come from the heap and freed ones between live ones are never returned,
which left peak RSS ~200 MB above what the engine holds. Serving every allocation of 1 MiB
or more with its own mapping returns it to the OS on free; decode-step tensors stay below it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1024 * 1024
TRIM_THRESHOLD_BYTES = 4 * 1024 * 1024

_applied = False


def limit_heap_fragmentation() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("mallopt unavailable (not glibc); keeping the default allocator policy")
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def return_free_memory() -> None:
    """Give the allocator's free pages back to the OS, in every thread's arena (after a
    model is let go: its many small blocks were spread over the threads that made them)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def available_memory_bytes() -> int | None:
    """Memory the OS could give this process now (free and reclaimable), or None if unknown."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
