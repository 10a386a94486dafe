"""The kernels' builds: one per x86-64 level the project serves, and which one this CPU runs.

``setup.py`` compiles every variant at install (it loads this file by path, so it imports nothing but the standard
library); :mod:`fiberserve.kernels.loader` picks the best variant whose instructions this CPU has, by the feature
flags Linux reports in ``/proc/cpuinfo``, as ggml's CPU variants and PyTorch's own kernels are chosen.  A build is
named after its variant and a digest of its sources, flags and PyTorch version, so a build for other sources,
another PyTorch or another CPU is never loaded in its place.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

#: The C++ sources, their headers beside them.
SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = (
    "registration.cpp",
    "paged_attention.cpp",
    "elementwise.cpp",
    "linear_bf16.cpp",
    "linear_quant.cpp",
    "quant_pack.cpp",
    "gguf_blocks.cpp",
    "top_k.cpp",
    "decoder_layers.cpp",
    "lora.cpp",
)
#: Flags every variant compiles and links with; the variant adds its target.
COMPILE_FLAGS = ("-O3", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
#: The environment variable that forces a variant by name (``native``: a build for exactly this CPU, compiled here).
VARIANT_ENV = "FIBERSERVE_KERNEL_VARIANT"

#: x86-64-v3 (Haswell, Zen 1 and later) as /proc/cpuinfo names its instructions.
_X86_64_V3 = frozenset("cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split())
_AVX512 = frozenset("avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_vnni".split())


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its compiler target and what it needs of the CPU.

    ``cpu_flags``: the /proc/cpuinfo flags of every instruction the target lets the compiler emit (a CPU without
    one of them could die of SIGILL); ``isa``: which of the kernels' instruction-set paths the build compiles
    (``None`` for ``native``, whose paths the compiler decides).
    """

    name: str
    target_flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    isa: frozenset[str] | None

    def library_name(self, torch_version: str) -> str:
        """The build's name: the variant and a digest of the sources, headers, flags and PyTorch version."""
        digest = hashlib.sha256()
        for path in sorted(SOURCE_DIR.rglob("*")):
            if path.suffix in (".cpp", ".h"):
                digest.update(path.relative_to(SOURCE_DIR).as_posix().encode() + b"\0" + path.read_bytes())
        digest.update(" ".join((*COMPILE_FLAGS, *self.target_flags, *sorted(self.cpu_flags))).encode())
        digest.update(torch_version.encode())
        return f"_kernels_{self.name}_{digest.hexdigest()[:16]}"


_AVX2_PATHS = frozenset({"avx2", "fma", "f16c"})
_AVX512_PATHS = _AVX2_PATHS | {"avx512f", "avx512_bf16", "avx512_vnni"}
AVX2 = Variant("avx2", ("-march=x86-64-v3",), _X86_64_V3, _AVX2_PATHS)
AVX512 = Variant("avx512", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"), _X86_64_V3 | _AVX512, _AVX512_PATHS)
AMX = Variant(
    "amx",
    (*AVX512.target_flags, "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
    AVX512.cpu_flags | {"amx_tile", "amx_bf16", "amx_int8"},
    _AVX512_PATHS | {"amx_bf16", "amx_int8"},
)
#: The variants built at install, best first.
PREBUILT = (AMX, AVX512, AVX2)


def native_variant(cpu_flags: frozenset[str]) -> Variant:
    """A build for this CPU exactly (``-march=native``), compiled on first use where no prebuilt variant fits
    (a CPU without AVX2, or another architecture); it is named after the CPU's flags, not the word native."""
    return Variant("native", ("-march=native",), cpu_flags, None)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def best_variant(flags: frozenset[str]) -> Variant:
    """The best prebuilt variant whose instructions ``flags`` all include, else a native build for them."""
    for variant in PREBUILT:
        if variant.cpu_flags <= flags:
            return variant
    return native_variant(flags)


class VariantError(RuntimeError):
    """A forced variant is unknown, or needs instructions this CPU lacks."""


def chosen_variant(flags: frozenset[str], forced: str | None = None) -> Variant:
    """The variant to run: ``forced`` (default ``$FIBERSERVE_KERNEL_VARIANT``) if set, else :func:`best_variant`.

    Raises :class:`VariantError` for an unknown name, or a variant whose instructions ``flags`` do not all include.
    """
    forced = (os.environ.get(VARIANT_ENV, "") if forced is None else forced).strip()
    if not forced:
        return best_variant(flags)
    if forced == "native":
        return native_variant(flags)
    by_name = {variant.name: variant for variant in PREBUILT}
    if forced not in by_name:
        raise VariantError(f"{VARIANT_ENV}={forced}: unknown; choose one of {', '.join([*by_name, 'native'])}")
    missing = by_name[forced].cpu_flags - flags
    if missing:
        raise VariantError(
            f"{VARIANT_ENV}={forced}: this CPU lacks {', '.join(sorted(missing))}; "
            f"its kernels would die of an illegal instruction (this CPU runs {best_variant(flags).name})"
        )
    return by_name[forced]
