"""tensor_of: the tensors torch.tensor builds from the same lists."""

from __future__ import annotations

import random

import pytest
import torch

from fiberserve.model.small_tensors import tensor_of


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32])
def test_tensor_of_gives_what_torch_tensor_gives(dtype):
    rng = random.Random(0)
    info = torch.iinfo(dtype) if dtype != torch.float32 else None
    if info is not None:
        values = [info.min, info.max, 0, -1, *(rng.randint(info.min, info.max) for _ in range(60))]
    else:  # doubles that round to float32 in every direction, and the extremes
        values = [1 / 0.7, -1 / 3, 1e-45, 3.4e38, float("inf"), *(rng.uniform(-1e6, 1e6) for _ in range(59))]
    built = tensor_of(values, dtype)
    expected = torch.tensor(values, dtype=dtype)
    assert built.dtype == dtype and built.shape == (64,) and built.device.type == "cpu"
    assert torch.equal(built, expected)
    assert tensor_of([], dtype).shape == (0,) and tensor_of([], dtype).dtype == dtype


def test_tensor_of_refuses_an_integer_out_of_range():
    with pytest.raises(OverflowError):
        tensor_of([2**63], torch.long)
    with pytest.raises(OverflowError):
        tensor_of([2**31], torch.int32)


def test_a_tensor_of_a_list_outlives_the_list_and_its_buffer():
    built = tensor_of(list(range(1000)), torch.long)
    torch.ones(10_000)  # the allocator reuses freed memory, were the buffer freed
    assert built.tolist() == list(range(1000))
