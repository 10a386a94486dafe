"""The C allocator's settings for a process that allocates the same large tensors every step."""

from __future__ import annotations

import ctypes
import ctypes.util

#: glibc's ``mallopt`` parameters (malloc.h) and their values here: blocks up to MMAP_THRESHOLD come from the heap
#: rather than fresh mappings, and the heap keeps up to TRIM_THRESHOLD of freed memory instead of returning it.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest
TRIM_THRESHOLD = 512 << 20


def keep_freed_buffers() -> bool:
    """Make freed tensor buffers reusable by the next allocation of their size (glibc only; False elsewhere).

    A step allocates several vocabulary-wide buffers (logits, probabilities, cumulative sums: ~12 MB each for 64
    rows); by default glibc maps each afresh and unmaps it when freed, so every step pays a page fault per 4 KB
    touched.  Kept on the heap, the pages stay mapped and warm.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
