"""Compiles the C++ kernels (fiberserve/kernels/csrc) at install, once per variant in fiberserve/kernels/variants.py.

Everything else about the package is in pyproject.toml.  The builds need PyTorch at build time (pyproject.toml's
build requirements pin the version they link against); without it, or off x86-64, the package installs without
builds and compiles the kernels on first use instead.  ``FIBERSERVE_KERNEL_VARIANTS=avx512,avx2`` builds only those.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("kernel_variants", ROOT / "fiberserve" / "kernels" / "variants.py")
assert _spec is not None and _spec.loader is not None
variants = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = variants  # dataclasses look their module up by name
_spec.loader.exec_module(variants)


def wanted_variants() -> list:
    """The variants to build: ``$FIBERSERVE_KERNEL_VARIANTS`` (comma-separated names), else all of them."""
    names = [name.strip() for name in os.environ.get("FIBERSERVE_KERNEL_VARIANTS", "").split(",") if name.strip()]
    by_name = {variant.name: variant for variant in variants.PREBUILT}
    unknown = set(names) - set(by_name)
    if unknown:
        raise SystemExit(
            f"FIBERSERVE_KERNEL_VARIANTS: unknown {', '.join(sorted(unknown))}; known: {', '.join(by_name)}"
        )
    return [by_name[name] for name in names] if names else list(variants.PREBUILT)


def remove_builds(folder: Path) -> None:
    """Delete the kernels' builds in ``folder``: those of earlier sources would otherwise ship beside the new ones."""
    for build in folder.glob("_kernels_*"):
        build.unlink()


def kernel_build() -> dict:
    """setup()'s arguments for the kernels' builds, or none where they cannot be built here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("fiberserve: PyTorch is not installed at build time; the kernels compile on first use", file=sys.stderr)
        return {}

    class BuildKernels(BuildExtension):
        """PyTorch's extension builder, with each variant's objects in a folder of its own (the variants compile
        the same sources with different targets) that outlives the build, so a reinstall recompiles only what
        changed; Python's own debug and wrapping flags are dropped, so a build matches the one compiled on first
        use."""

        def build_extensions(self) -> None:
            for flag in ("-g", "-fwrapv"):
                while flag in self.compiler.compiler_so:
                    self.compiler.compiler_so.remove(flag)
            super().build_extensions()

        def build_extension(self, ext) -> None:
            # The build's name (which changes with any source) is in its file name only: defined in every object
            # too, it would recompile them all.
            ext.extra_compile_args = [a for a in ext.extra_compile_args if not a.startswith("-DTORCH_EXTENSION_NAME=")]
            build_temp = self.build_temp
            variant = ext.name.rpartition(".")[2].rpartition("_")[0]  # _kernels_<variant>, without the digest
            self.build_temp = str(ROOT / "build" / "kernels" / variant)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = build_temp

        def run(self) -> None:
            remove_builds(Path(self.build_lib) / "fiberserve" / "kernels")
            super().run()

        def copy_extensions_to_source(self) -> None:
            remove_builds(ROOT / "fiberserve" / "kernels")
            super().copy_extensions_to_source()

    sources = [str((variants.SOURCE_DIR / source).relative_to(ROOT)) for source in variants.SOURCES]
    extensions = [
        CppExtension(
            name=f"fiberserve.kernels.{variant.library_name(torch.__version__)}",
            sources=sources,
            include_dirs=[str(variants.SOURCE_DIR)],
            extra_compile_args=[*variants.COMPILE_FLAGS, *variant.target_flags, "-g0"],
            extra_link_args=list(variants.LINK_FLAGS),
        )
        for variant in wanted_variants()
    ]
    return {"ext_modules": extensions, "cmdclass": {"build_ext": BuildKernels.with_options(use_ninja=True)}}


setup(**kernel_build())
