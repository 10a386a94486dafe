"""The machine's bounds, measured: the CPU's dot-product peak, the memory's read bandwidth, and a model's work per
token.

A serving benchmark says "x tokens/s"; this module says what fraction of the machine that is.
:func:`measure_peaks` times the dot-product instructions a matrix kernel is made of (``peak.cpp``) on
every core at once, and :func:`linear_flops` counts a model's multiply-adds per token, so that

    tokens/s bound = peak / FLOP per token,

where a generated token costs the decoder's linear layers plus the output head, and a prompt token the
decoder's alone (only the last prompt row needs logits).  Attention and elementwise work are left out of
the count, so the bound is optimistic.  One sequence's decode reads every weight once per token instead, so

    tokens/s bound = read bandwidth / weight bytes per token (:func:`weight_bytes_per_token`),

the memory-bound decode bound, again optimistic (the KV cache's reads are left out).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from fiberserve.config import default_cache_dir
from fiberserve.model.config import ModelConfig

_lock = threading.Lock()
_SOURCE = Path(__file__).with_name("peak.cpp")

#: What a report shows for a peak the CPU lacks (an instruction it does not have), in place of a figure.
LACKING = "- (the CPU lacks it)"


def _library(build_dir: Path) -> ctypes.CDLL:
    """``peak.cpp`` built (once per version and machine: the file is named after the source's hash, and
    ``-march=native`` targets this CPU) into ``build_dir`` and loaded."""
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    path = build_dir / f"fiberserve_peak_{digest}.so"
    with _lock:
        if not path.exists():
            compiler = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
            if compiler is None:
                raise RuntimeError("fiberserve bench peak needs a C++ compiler (c++, g++ or clang++)")
            build_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=build_dir) as tmp:  # built aside, then renamed: atomic
                built = Path(tmp) / path.name
                command = [compiler, "-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-pthread"]
                done = subprocess.run([*command, str(_SOURCE), "-o", str(built)], capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"building {_SOURCE.name} failed ({' '.join(command)}):\n{done.stderr}")
                os.replace(built, path)
        library = ctypes.CDLL(str(path))
    library.fiberserve_peak_ops_per_second.restype = ctypes.c_double
    library.fiberserve_peak_ops_per_second.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64]
    library.fiberserve_peak_read_bytes_per_second.restype = ctypes.c_double
    library.fiberserve_peak_read_bytes_per_second.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return library


#: The buffer the read bandwidth is measured on: far larger than any CPU's last-level cache.
READ_BUFFER_BYTES = 1 << 30
#: Passes over it; the best one counts.
READ_PASSES = 5


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
    amx_bf16: float  # tdpbf16ps on AMX tiles (Intel Xeon from Sapphire Rapids on)
    read_bytes: float = 0.0  # bytes/s read from memory (a buffer beyond the last-level cache) by all threads

    @property
    def vector(self) -> tuple[str, float]:
        """The vector peak a throughput is judged against: bf16 (``vdpbf16ps``) where the CPU has it, else fp32
        multiply-adds (``vfmadd231ps``); its name and ops/s."""
        return ("bf16", self.bf16) if self.bf16 else ("fp32", self.fp32)

    def describe(self) -> str:
        def rate(ops: float, unit: str) -> str:
            return f"{ops / 1e9:.0f} {unit}" if ops else LACKING

        q4_1 = f"{self.q4_1 / 1e9:.0f} GOP/s ({self.q4_1 / self.int8:.0%} of int8)" if self.int8 else "-"
        return (
            f"{self.threads} threads: bf16 {rate(self.bf16, 'GFLOP/s')} (vdpbf16ps), bf16 on AMX tiles "
            f"{rate(self.amx_bf16, 'GFLOP/s')} (tdpbf16ps), int8 {rate(self.int8, 'GOP/s')} (vpdpbusd), int8 in "
            f"Q4_1 blocks {q4_1}, fp32 {rate(self.fp32, 'GFLOP/s')} (vfmadd231ps); memory read "
            f"{self.read_bytes / 1e9:.1f} GB/s"
        )


def measure_peaks(threads: int | None = None, iterations: int = 50_000_000, build_dir: Path | None = None) -> Peaks:
    """Time each instruction kind on ``threads`` threads (default: every CPU); ~0.3 s per kind.  The timing code
    is compiled on first use into ``build_dir`` (default: ``build`` in the cache directory)."""
    threads = threads or os.cpu_count() or 1
    library = _library(build_dir or default_cache_dir() / "build")
    rate = {
        kind: library.fiberserve_peak_ops_per_second(kind.encode(), threads, iterations)
        for kind in ("fp32", "bf16", "int8", "q4_1", "amx_bf16")
    }
    read = library.fiberserve_peak_read_bytes_per_second(threads, READ_BUFFER_BYTES, READ_PASSES)
    return Peaks(threads=threads, read_bytes=read, **rate)


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
    return TokenFlops(decoder=2.0 * config.decoder_weights, head=2.0 * config.hidden_size * config.vocab_size)


def weight_bytes_per_token(model: str | Path, config: ModelConfig) -> float:
    """The weight bytes one sequence's decode step reads: a GGUF file's tensors as stored (the token embedding's
    one row aside, unless the output head reads it), or bf16 values of every linear weight for a Hugging Face
    directory (served in bf16)."""
    if Path(model).is_dir():
        return linear_flops(config).generated  # 2 FLOP per multiply-add, 2 bytes per bf16 weight
    from fiberserve.model.gguf_file import GgufFile

    tensors = {t.name: t.data.nbytes for t in GgufFile(model).tensors}
    embedding = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
    return float(sum(tensors.values()) - embedding)


def bound_tokens_per_s(peak: float, flops: TokenFlops) -> float:
    """Generated tokens/s that ``peak`` operations/s allow when no prompt needs computing (decode only);
    0 where the peak is 0 (the CPU lacks that instruction)."""
    return peak / flops.generated


def memory_bound_tokens_per_s(read_bytes: float, weight_bytes: float) -> float:
    """Generated tokens/s of one sequence when every step reads ``weight_bytes`` at ``read_bytes`` bytes/s."""
    return read_bytes / weight_bytes
