"""1-D CPU tensors from short Python lists, as a step builds its inputs each time (tokens, positions, slots, page
tables, the race's parameters): through an ``array.array`` the tensor takes the list's values in one copy,
where ``torch.tensor`` converts them one Python object at a time."""

from __future__ import annotations

import array
from collections.abc import Iterable

import torch

#: The array typecode of each dtype, its items as wide as the dtype's elements (checked below).
_TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f"}
assert all(array.array(code).itemsize == dtype.itemsize for dtype, code in _TYPECODES.items())


def tensor_of(values: Iterable[int] | Iterable[float], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``values`` in ``dtype`` (int64, int32 or float32): the values ``torch.tensor(values,
    dtype=dtype)`` gives (floats rounded to float32 to nearest); an integer out of range raises OverflowError."""
    buffer = array.array(_TYPECODES[dtype], values)
    return torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
