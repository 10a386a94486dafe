"""Registering the kernels in this process: the build installed for this CPU, else one compiled here.

``pip install`` builds every prebuilt variant (``setup.py``); :func:`load` loads the one
:func:`~fiberserve.kernels.variants.chosen_variant` picks.  Where that build is absent (a source tree whose sources
changed since its install, another PyTorch, a CPU no prebuilt variant fits) it compiles the same variant with
PyTorch's extension loader, once per machine (cached under ``~/.cache/torch_extensions`` or
``$TORCH_EXTENSIONS_DIR``), and says so on stderr first: that takes a minute or two and needs a C++ compiler.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from fiberserve.kernels import variants
from fiberserve.kernels.variants import Variant

_HERE = Path(__file__).parent
_lock = threading.Lock()
_variant: Variant | None = None


def load() -> None:
    """Register ``torch.ops.fiberserve.*`` in this process; idempotent and thread-safe.

    Raises :class:`~fiberserve.kernels.variants.VariantError` where ``$FIBERSERVE_KERNEL_VARIANT`` forces a
    variant this CPU cannot run.
    """
    global _variant
    with _lock:
        if _variant is not None:
            return
        variant = variants.chosen_variant(variants.cpu_flags())
        name = variant.library_name(torch.__version__)
        prebuilt = prebuilt_library(name)
        if prebuilt is not None:
            torch.ops.load_library(str(prebuilt))
        else:
            _compile_and_load(variant, name)
        _variant = variant


def prebuilt_library(name: str) -> Path | None:
    """The installed build named ``name`` in this package, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / f"{name}{suffix}"
        if path.exists():
            return path
    return None


def _compile_and_load(variant: Variant, name: str) -> None:
    from torch.utils.cpp_extension import load as load_extension

    print(
        f"fiberserve: compiling the {variant.name} kernels for this CPU (no installed build of these sources for"
        f" PyTorch {torch.__version__}); once per machine, a minute or two ...",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    load_extension(
        name=name,
        sources=[str(variants.SOURCE_DIR / source) for source in variants.SOURCES],
        extra_cflags=[*variants.COMPILE_FLAGS, *variant.target_flags],
        extra_ldflags=list(variants.LINK_FLAGS),
        extra_include_paths=[str(variants.SOURCE_DIR)],
        is_python_module=False,
    )
    print(f"fiberserve: kernels ready in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def loaded() -> bool:
    """Whether :func:`load` has run in this process (the ops are registered)."""
    return _variant is not None


def variant() -> Variant:
    """The variant :func:`load` registered, or would register (it neither loads nor compiles anything)."""
    return _variant or variants.chosen_variant(variants.cpu_flags())


#: The compiler's macros for the instruction sets the kernels choose between, by their /proc/cpuinfo names.
ISA_MACROS = {
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__AVX512F__": "avx512f",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512VNNI__": "avx512_vnni",
    "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8",
}


@functools.cache
def compiled_isa(target_flags: tuple[str, ...]) -> frozenset[str]:
    """The kernels' instruction-set paths a compiler target enables, as the C++ compiler (``$CXX``) reports."""
    macros = subprocess.run(
        [os.environ.get("CXX", "c++"), *target_flags, "-dM", "-E", "-x", "c++", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    return frozenset(flag for macro, flag in ISA_MACROS.items() if macro in defined)


def target_isa() -> frozenset[str]:
    """The instruction-set paths the kernels run here (as /proc/cpuinfo names them): the chosen variant's."""
    chosen = variant()
    return chosen.isa if chosen.isa is not None else compiled_isa(chosen.target_flags)
