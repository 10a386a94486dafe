"""A plain quantizer into llama.cpp's K formats (Q4_K, Q5_K, Q6_K), which gguf can read but not write: each block's
scale from its range, rounded to the nearest step, packed as llama.cpp lays the bytes out.  For test files only
(llama.cpp's own quantizer searches for better scales; the layout is what matters here)."""

from __future__ import annotations

import numpy as np

SUPER = 256


def quantize_k(weights: np.ndarray, type_name: str) -> np.ndarray:
    """``weights`` [N, K] (K % 256 == 0) -> the format's bytes [N, K / 256 * block bytes]."""
    rows = weights.shape[0]
    supers = weights.astype(np.float32).reshape(rows, -1, SUPER)
    if type_name == "Q6_K":
        return _q6_k(supers).reshape(rows, -1)
    return _q45_k(supers, 4 if type_name == "Q4_K" else 5).reshape(rows, -1)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def _q45_k(supers: np.ndarray, bits: int) -> np.ndarray:
    blocks = supers.reshape(*supers.shape[:2], 8, 32)
    low = np.minimum(blocks.min(-1), 0)
    scale = (blocks.max(-1) - low) / (2**bits - 1)
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.round((blocks + (dmin[..., None] * m)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(q, 0, 2**bits - 1).astype(np.uint8)
    packed = np.empty((*supers.shape[:2], 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    pairs = q.reshape(*q.shape[:2], 4, 2, 32)  # blocks 2c and 2c + 1 share 32 bytes: low and high nibbles
    quants = ((pairs[..., 0, :] & 15) | ((pairs[..., 1, :] & 15) << 4)).reshape(*q.shape[:2], 128)
    parts = [_f16(d), _f16(dmin), packed]
    if bits == 5:  # bit j of byte l: the fifth bit of element l of block j
        fifth = (q >> 4) & 1
        parts.append((fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8))
    return np.concatenate([*parts, quants], -1)


def _q6_k(supers: np.ndarray) -> np.ndarray:
    groups = supers.reshape(*supers.shape[:2], 16, 16)
    scale = np.abs(groups).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), -128, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(np.round(groups / np.where(step != 0, step, 1)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(*supers.shape[:2], 2, 4, 32)  # each 128 inputs: 4 runs of 32
    ql = (q[..., 0:2, :] & 15) | ((q[..., 2:4, :] & 15) << 4)  # runs 0, 1 in the low nibbles, 2, 3 in the high
    qh = sum(((q[..., j, :] >> 4) & 3) << (2 * j) for j in range(4)).astype(np.uint8)  # run j's top bits at 2j
    return np.concatenate([ql.reshape(*q.shape[:2], 128), qh.reshape(*q.shape[:2], 64), sc.view(np.uint8), _f16(d)], -1)
