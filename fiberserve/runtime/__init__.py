"""The execution model: workers, fibers, the fiber pool and program isolation.

Knows nothing about language models.  See each module's docstring for its
contract.
"""

from fiberserve.runtime.fiber import Fiber, new_fiber
from fiberserve.runtime.pool import FiberPool, PoolStats
from fiberserve.runtime.program import (
    ConcurrentInvocationError,
    InvocationTimeout,
    Isolation,
    Program,
)
from fiberserve.runtime.worker import Worker

__all__ = [
    "ConcurrentInvocationError",
    "Fiber",
    "FiberPool",
    "InvocationTimeout",
    "Isolation",
    "PoolStats",
    "Program",
    "Worker",
    "new_fiber",
]
