"""The C allocator's settings: while a model loads (temporaries freed at once), then while it serves (the same
large tensors allocated every step)."""

from __future__ import annotations

import ctypes
import ctypes.util

#: glibc's ``mallopt`` parameters (malloc.h) and their values here: blocks up to MMAP_THRESHOLD come from the heap
#: rather than fresh mappings, and the heap keeps up to TRIM_THRESHOLD of freed memory instead of returning it.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest
TRIM_THRESHOLD = 512 << 20
#: While loading: blocks from this size on are mappings of their own, and the heap keeps little freed memory.
LOADING_THRESHOLD = 1 << 20


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h): every field a ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def heap_figures() -> dict[str, int] | None:
    """The C heaps' bytes over all arenas (glibc's ``mallinfo2``; None elsewhere): ``in_use`` by live blocks,
    ``free`` kept by the heaps for reuse, ``mapped`` in blocks that are mappings of their own."""
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use": info.uordblks, "free": info.fordblks, "mapped": info.hblkhd}


def trim_freed_memory() -> bool:
    """Return the heaps' free memory to the system now (glibc's ``malloc_trim``; False elsewhere): what a load's
    small temporaries leave in the heaps of the threads that made them, which the thresholds above do not."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def return_freed_buffers() -> bool:
    """Give freed memory back to the system at once (glibc only; False elsewhere): for loading a model, whose
    temporaries (a tensor dequantized, packed, then dropped) would otherwise stay resident in the heap."""
    return _mallopt(LOADING_THRESHOLD, LOADING_THRESHOLD)


def keep_freed_buffers() -> bool:
    """Make freed tensor buffers reusable by the next allocation of their size (glibc only; False elsewhere).

    A step allocates several vocabulary-wide buffers (logits, probabilities, cumulative sums: ~12 MB each for 64
    rows); by default glibc maps each afresh and unmaps it when freed, so every step pays a page fault per 4 KB
    touched.  Kept on the heap, the pages stay mapped and warm.
    """
    return _mallopt(MMAP_THRESHOLD, TRIM_THRESHOLD)
