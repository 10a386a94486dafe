"""``--mlock``: the tensors an object holds, each storage counted once, locked in RAM; a refusal named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from fiberserve.runtime.memory_lock import lock_in_memory, tensor_storages


def locked_bytes() -> int:
    status = Path("/proc/self/status").read_text().splitlines()
    line = next(line for line in status if line.startswith("VmLck:"))
    return int(line.split()[1]) * 1024


class Holder:
    def __init__(self) -> None:
        self.weight = torch.ones(1024, 1024)
        self.view = self.weight[:10]  # the same storage
        self.parts = [torch.zeros(256, dtype=torch.uint8), (torch.ones(3),)]
        self.by_name = {"bias": torch.ones(4096)}
        self.empty = torch.empty(0)
        self.inner = type("Inner", (), {})()
        self.inner.scale = torch.ones(2, 8)
        self.inner.back = self  # a cycle is walked once


def test_every_storage_held_is_found_once():
    holder = Holder()
    found = tensor_storages(holder)
    expected = [holder.weight, holder.parts[0], holder.parts[1][0], holder.by_name["bias"], holder.inner.scale]
    assert found == {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in expected}


def test_locked_storages_count_in_the_process_s_locked_memory():
    holder = Holder()
    before = locked_bytes()
    total = lock_in_memory(tensor_storages(holder))
    assert total == sum(tensor_storages(holder).values()) > 4 * 2**20
    assert locked_bytes() - before >= total - 2 * 4096 * len(tensor_storages(holder))  # whole pages are locked


def test_a_refused_lock_names_the_limit_and_leaves_nothing_locked():
    """Under a locked-memory limit smaller than the weights (an unprivileged process: root's limit is not
    enforced, so a root test drops to nobody first), the error names ``ulimit -l``."""
    script = textwrap.dedent(
        """
        import os, resource
        import torch
        from fiberserve.runtime.memory_lock import lock_in_memory, tensor_storages
        weights = [torch.ones(1 << 16), torch.ones(4 << 20)]
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
        if os.getuid() == 0:  # imports done: nobody may not read this interpreter's files
            os.setgid(65534); os.setuid(65534)
        try:
            lock_in_memory(tensor_storages(weights))
        except OSError as exc:
            status = open("/proc/self/status").read()
            print(str(exc), "|", [l for l in status.splitlines() if l.startswith("VmLck")][0])
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    message, locked = out.stdout.strip().split(" | ")
    assert "--mlock: locking 16 MiB of weights failed" in message and "ulimit -l" in message
    assert locked.split()[1] == "0"
