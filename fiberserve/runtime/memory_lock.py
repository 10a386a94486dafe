"""Keeping a model's weights in RAM: ``--mlock``, as llama.cpp's flag of that name does for its model buffers.

The weights are the tensors an object holds (found by :func:`tensor_storages`), each storage locked once with
``mlock(2)``, so that memory pressure pages none of them out.  The KV cache is not locked: most of its address
space is never written (see ``engine.kvcache``), and locking would make all of it resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

#: How deep :func:`tensor_storages` follows attributes from the object it is given.
MAX_DEPTH = 6


def tensor_storages(root: object) -> dict[int, int]:
    """Every tensor storage that ``root`` holds through attributes, lists, tuples and dicts (up to
    :data:`MAX_DEPTH` attributes deep), as {address: bytes}; a storage shared by several tensors counts once."""
    storages: dict[int, int] = {}
    seen: set[int] = set()

    def walk(x: object, depth: int) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.nbytes() and x.device.type == "cpu":
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item, depth)
        elif isinstance(x, dict):
            for item in x.values():
                walk(item, depth)
        elif depth < MAX_DEPTH and hasattr(x, "__dict__"):
            for item in vars(x).values():
                walk(item, depth + 1)

    walk(root, 0)
    return storages


def lock_in_memory(storages: dict[int, int]) -> int:
    """``mlock(2)`` each {address: bytes} span; returns the bytes locked.  Raises OSError naming the limit to
    raise where the system refuses (RLIMIT_MEMLOCK, ``ulimit -l``), having unlocked what it had locked."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    locked: list[tuple[int, int]] = []
    for address, size in storages.items():
        if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) != 0:
            errno = ctypes.get_errno()
            for done in locked:
                libc.munlock(ctypes.c_void_p(done[0]), ctypes.c_size_t(done[1]))
            total = sum(storages.values())
            raise OSError(
                errno,
                f"--mlock: locking {total / 2**20:.0f} MiB of weights failed ({os.strerror(errno)}); raise the "
                "locked-memory limit (ulimit -l, or LimitMEMLOCK for a service) or run without --mlock",
            )
        locked.append((address, size))
    return sum(size for _, size in locked)
