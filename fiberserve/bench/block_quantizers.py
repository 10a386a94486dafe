"""Quantizers into every GGUF block format the product serves, for the files that tests and benchmarks write.

gguf writes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; the K formats (Q2_K to Q6_K) and IQ4_NL, which gguf can read
but not write, are quantized here plainly: each block's scale from its range, rounded to the nearest step, packed
as llama.cpp lays the bytes out (llama.cpp's own quantizer searches for better scales; the layout, and so the
work of serving the file, is what matters here).
"""

from __future__ import annotations

import numpy as np

from fiberserve.model.block_formats import IQ4_NL_VALUES

SUPER = 256


def quantize_blocks(weights: np.ndarray, type_name: str) -> np.ndarray:
    """``weights`` [N, K] as ``type_name``'s bytes [N, bytes per row], for any format the product serves."""
    if type_name.endswith("_K"):
        return quantize_k(weights, type_name)
    if type_name == "IQ4_NL":
        return quantize_iq4_nl(weights)
    import gguf
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(weights, dtype=np.float32), gguf.GGMLQuantizationType[type_name])


def quantize_iq4_nl(weights: np.ndarray) -> np.ndarray:
    """``weights`` [N, K] (K % 32 == 0) -> IQ4_NL's bytes: per 32 inputs a float16 ``d`` and 16 bytes of indices
    into :data:`IQ4_NL_VALUES` (element l in the low nibble of byte l, element l + 16 in its high nibble)."""
    rows = weights.shape[0]
    blocks = weights.astype(np.float32).reshape(rows, -1, 32)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    d = (peak / IQ4_NL_VALUES[0]).astype(np.float16)
    scaled = blocks / np.where(d != 0, d.astype(np.float32), 1)[..., None]
    q = np.abs(scaled[..., None] - IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    return np.concatenate([_f16(d), q[..., :16] | (q[..., 16:] << 4)], -1).reshape(rows, -1)


def quantize_k(weights: np.ndarray, type_name: str) -> np.ndarray:
    """``weights`` [N, K] (K % 256 == 0) -> the format's bytes [N, K / 256 * block bytes]."""
    rows = weights.shape[0]
    supers = weights.astype(np.float32).reshape(rows, -1, SUPER)
    if type_name == "Q6_K":
        return _q6_k(supers).reshape(rows, -1)
    if type_name == "Q3_K":
        return _q3_k(supers).reshape(rows, -1)
    if type_name == "Q2_K":
        return _q2_k(supers).reshape(rows, -1)
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
    tops = np.stack([((q[..., j, :] >> 4) & 3) << (2 * j) for j in range(4)])  # run j's top bits at 2j
    qh = np.bitwise_or.reduce(tops, axis=0).astype(np.uint8)
    return np.concatenate([ql.reshape(*q.shape[:2], 128), qh.reshape(*q.shape[:2], 64), sc.view(np.uint8), _f16(d)], -1)


def _two_bit_planes(low: np.ndarray) -> np.ndarray:
    """2-bit values [..., 256] as Q2_K's and Q3_K's 64 bytes: byte 32 h + l holds element 128 h + 32 j + l at
    bits 2j."""
    runs = low.reshape(*low.shape[:-1], 2, 4, 32).astype(np.uint8)
    planes = np.bitwise_or.reduce(np.stack([runs[..., j, :] << (2 * j) for j in range(4)]), axis=0)
    return planes.reshape(*low.shape[:-1], 64)


def _q2_k(supers: np.ndarray) -> np.ndarray:
    """scales[16] (a 4-bit scale and a 4-bit min per 16 inputs), qs[64] (2 bits a weight), d, dmin."""
    groups = supers.reshape(*supers.shape[:2], 16, 16)
    low = np.minimum(groups.min(-1), 0)
    scale = (groups.max(-1) - low) / 3
    d = (scale.max(-1) / 15).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 15).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), 0, 15).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)[..., None]), 0, 15).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.round((groups + (dmin[..., None] * m)[..., None]) / np.where(step > 0, step, 1)), 0, 3)
    planes = _two_bit_planes(q.reshape(*supers.shape))
    return np.concatenate([sc | (m << 4), planes, _f16(d), _f16(dmin)], -1)


def _q3_k(supers: np.ndarray) -> np.ndarray:
    """hmask[32] (bit j of byte l: element 32 j + l is not offset by -4), qs[64] (its low 2 bits), 12 bytes of
    6-bit scales (stored + 32), d; w = d * (scale - 32) * q with q in -4..3."""
    groups = supers.reshape(*supers.shape[:2], 16, 16)
    scale = np.abs(groups).max(-1) / 4
    d = (scale.max(-1) / 31).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), 0, 31).astype(np.int16)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.round(groups / np.where(step > 0, step, 1)), -4, 3).astype(np.int16).reshape(*supers.shape)
    high = (q >= 0).astype(np.uint8).reshape(*supers.shape[:2], 8, 32)
    hmask = np.bitwise_or.reduce(np.stack([high[..., j, :] << j for j in range(8)]), axis=0).astype(np.uint8)
    planes = _two_bit_planes(np.where(q >= 0, q, q + 4))
    stored = (sc + 32).astype(np.uint8)
    nibbles = (stored[..., :8] & 15) | ((stored[..., 8:] & 15) << 4)
    tops = np.bitwise_or.reduce(np.stack([((stored[..., 4 * k : 4 * k + 4] >> 4) & 3) << (2 * k) for k in range(4)]), 0)
    return np.concatenate([hmask, planes, nibbles, tops.astype(np.uint8), _f16(d)], -1)
