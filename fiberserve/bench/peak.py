"""The compute bound, measured: the CPU's dot-product peak and the linear-layer work per token.

A serving benchmark says "x tokens/s"; this module says what fraction of the machine that is.
:func:`measure_peaks` times the dot-product instructions a matrix kernel is made of (``peak.cpp``) on
every core at once, and :func:`linear_flops` counts a model's multiply-adds per token, so that

    tokens/s bound = peak / FLOP per token,

where a generated token costs the decoder's linear layers plus the output head, and a prompt token the
decoder's alone (only the last prompt row needs logits).  Attention and elementwise work are left out of
the count, so the bound is optimistic.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from fiberserve.model.config import ModelConfig

_lock = threading.Lock()
_module = None


def _extension():
    global _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import load

            source = Path(__file__).with_name("peak.cpp")
            digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]  # one build per version, as the kernels
            _module = load(
                name=f"fiberserve_peak_{digest}", sources=[str(source)], extra_cflags=["-O3", "-march=native"]
            )
        return _module


@dataclass(frozen=True)
class Peaks:
    """Operations per second on all cores at once, per instruction kind (0: the CPU lacks it)."""

    threads: int
    fp32: float  # vfmadd231ps
    bf16: float  # vdpbf16ps
    int8: float  # vpdpbusd
    #: vpdpbusd's ops/s inside llama.cpp's Q4_1 x Q8_1 block arithmetic (each block of 32 inputs scaled in
    #: float): the most any exact Q4_1 product can reach here.
    q4_1: float

    def describe(self) -> str:
        def rate(ops: float, unit: str) -> str:
            return f"{ops / 1e9:.0f} {unit}" if ops else "- (the CPU lacks it)"

        q4_1 = f"{self.q4_1 / 1e9:.0f} GOP/s ({self.q4_1 / self.int8:.0%} of int8)" if self.int8 else "-"
        return (
            f"{self.threads} threads: bf16 {rate(self.bf16, 'GFLOP/s')} (vdpbf16ps), int8 {rate(self.int8, 'GOP/s')} "
            f"(vpdpbusd), int8 in Q4_1 blocks {q4_1}, fp32 {rate(self.fp32, 'GFLOP/s')} (vfmadd231ps)"
        )


def measure_peaks(threads: int | None = None, iterations: int = 50_000_000) -> Peaks:
    """Time each instruction kind on ``threads`` threads (default: every CPU); ~0.3 s per kind."""
    threads = threads or os.cpu_count() or 1
    ext = _extension()
    rate = {kind: ext.peak_ops_per_second(kind, threads, iterations) for kind in ("fp32", "bf16", "int8", "q4_1")}
    return Peaks(threads=threads, **rate)


@dataclass(frozen=True)
class TokenFlops:
    """Linear-layer FLOP (2 per multiply-add) per token of ``config``'s model."""

    decoder: float  # every layer's qkv, o, gate/up and down products
    head: float  # the output projection to the vocabulary

    @property
    def generated(self) -> float:
        return self.decoder + self.head

    @property
    def prompt(self) -> float:
        return self.decoder


def linear_flops(config: ModelConfig) -> TokenFlops:
    h, heads, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (heads + 2 * kv) + heads * h + 3 * h * config.intermediate_size
    return TokenFlops(decoder=2.0 * config.num_layers * per_layer, head=2.0 * h * config.vocab_size)


def bound_tokens_per_s(peak: float, flops: TokenFlops) -> float:
    """Generated tokens/s that ``peak`` operations/s allow when no prompt needs computing (decode only);
    0 where the peak is 0 (the CPU lacks that instruction)."""
    return peak / flops.generated
