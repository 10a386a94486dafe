"""`fiberserve bench peak`: the FLOP count and weight bytes per token, the measured dot-product peaks and read
bandwidth."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fiberserve.bench.cli import main as bench_main
from fiberserve.bench.peak import (
    LACKING,
    Peaks,
    bound_tokens_per_s,
    linear_flops,
    measure_peaks,
    memory_bound_tokens_per_s,
    weight_bytes_per_token,
)
from fiberserve.model.config import ModelConfig, read_config
from fiberserve.model.gguf_file import GgufFile

SMOLLM2_135M = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
)


def test_linear_flops_of_smollm2_135m():
    flops = linear_flops(SMOLLM2_135M)
    # per layer: qkv 576 x (576 + 2 x 192), o 576 x 576, gate and up 2 x 576 x 1536, down 1536 x 576
    assert flops.decoder == 2 * 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    assert flops.head == 2 * 576 * 49152 and flops.prompt == flops.decoder
    assert round(flops.generated / 1e9, 2) == 0.27  # the "~0.27 GFLOP per token"
    assert bound_tokens_per_s(2 * 0.269e12, flops) == pytest.approx(2 * 0.269e12 / flops.generated)


def test_peaks_exist_exactly_where_the_cpu_has_the_instructions(tmp_path):
    flags = set(Path("/proc/cpuinfo").read_text().split())
    peaks = measure_peaks(threads=1, iterations=2_000_000, build_dir=tmp_path)
    assert isinstance(peaks, Peaks) and peaks.threads == 1
    assert (peaks.fp32 > 0) == ("avx512f" in flags or "fma" in flags)
    assert (peaks.bf16 > 0) == ("avx512_bf16" in flags)
    assert (peaks.int8 > 0) == ("avx512_vnni" in flags) == (peaks.q4_1 > 0)
    assert (peaks.amx_bf16 > 0) == ("amx_bf16" in flags)  # Linux grants the tiles wherever the CPU has them
    assert 1e9 < peaks.read_bytes < 1e12  # one core reads memory at some GB/s, never a TB/s (nothing cached)
    assert [p.name for p in tmp_path.iterdir()] == [next(tmp_path.glob("fiberserve_peak_*.so")).name]  # built once


def test_measuring_the_peaks_needs_no_torch(tmp_path):
    """The timing code is plain C++ behind ctypes: ``fiberserve bench`` runs without PyTorch."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from fiberserve.bench.peak import measure_peaks\n"
        f"peaks = measure_peaks(threads=2, iterations=100_000, build_dir=Path({str(tmp_path)!r}))\n"
        f"assert peaks.threads == 2 and (peaks.fp32 > 0) == {'avx512f' in flags or 'fma' in flags}\n"
        "assert 'torch' not in sys.modules, 'measuring the peaks loaded torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_bench_peak_command_prints_the_peaks_and_bounds(model_path, cache_dir, capsys):
    assert bench_main(["peak", "--model", str(model_path), "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert "GFLOP per generated token 0.269, per prompt token 0.212" in out
    assert "decode-only bound at the bf16 peak" in out and "vdpbf16ps" in out
    assert "decode-only bound at the amx_bf16 peak" in out and "tdpbf16ps" in out
    assert "decode-only bound at the q4_1 peak" in out and "int8 in Q4_1 blocks" in out
    assert "decode-only bound at the fp32 peak" in out
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    assert f"decode-only bound at the vector peak ({'bf16' if bf16 else 'fp32'})" in out
    assert (f"decode-only bound at the bf16 peak: {LACKING}" in out) == (not bf16)
    assert ": 0 tokens/s" not in out  # a peak the CPU lacks is said so, not a bound of 0
    # the embedded file's tensors, its tied embedding read as the head: every byte but the metadata's
    assert "weight bytes read per generated token: 96.6 MB" in out
    assert "memory read bandwidth: " in out and "memory-bound decode bound (one sequence): " in out


def test_weight_bytes_per_token_are_the_files_tensors_but_an_untied_embedding(tiny_dirs):
    gguf_path, hf_dir = tiny_dirs["gguf"], tiny_dirs["hf"]
    tensors = {t.name: t.data.nbytes for t in GgufFile(gguf_path).tensors}
    assert "output.weight" in tensors  # the tiny model's head is its own: the embedding reads one row a token
    expected = sum(tensors.values()) - tensors["token_embd.weight"]
    assert weight_bytes_per_token(gguf_path, read_config(gguf_path)) == expected
    # a Hugging Face directory is served in bf16: 2 bytes per multiply-add of the linear layers
    assert weight_bytes_per_token(hf_dir, read_config(hf_dir)) == linear_flops(read_config(hf_dir)).generated
    assert memory_bound_tokens_per_s(20e9, 500e6) == 40.0


def test_the_vector_peak_is_bf16_where_the_cpu_has_it_else_fp32():
    assert Peaks(threads=2, fp32=203e9, bf16=0, int8=0, q4_1=0, amx_bf16=0).vector == ("fp32", 203e9)
    assert Peaks(threads=2, fp32=203e9, bf16=700e9, int8=0, q4_1=0, amx_bf16=0).vector == ("bf16", 700e9)


def test_a_peak_the_cpu_lacks_is_said_so_not_zero():
    lacking = Peaks(threads=2, fp32=203e9, bf16=0, int8=0, q4_1=0, amx_bf16=0, read_bytes=21.44e9).describe()
    assert lacking == (
        "2 threads: bf16 - (the CPU lacks it) (vdpbf16ps), bf16 on AMX tiles - (the CPU lacks it) (tdpbf16ps), "
        "int8 - (the CPU lacks it) (vpdpbusd), int8 in Q4_1 blocks -, fp32 203 GFLOP/s (vfmadd231ps); memory read "
        "21.4 GB/s"
    )
    full = Peaks(threads=2, fp32=229e9, bf16=466e9, int8=934e9, q4_1=678e9, amx_bf16=4100e9).describe()
    assert "bf16 466 GFLOP/s (vdpbf16ps), bf16 on AMX tiles 4100 GFLOP/s (tdpbf16ps), int8 934 GOP/s" in full
    assert "int8 in Q4_1 blocks 678 GOP/s (73% of" in full
