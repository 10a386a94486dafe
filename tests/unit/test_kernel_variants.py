"""Which build of the kernels a CPU runs, that the install's build loads with no compiler, and that a build for
instructions this CPU lacks is refused."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fiberserve.kernels import loader, variants
from tests.without_compiler import environment_without_compiler

HERE_FLAGS = variants.cpu_flags()
#: The prebuilt variants this CPU would not choose by itself (the one it chooses loads unforced below).
OTHER_VARIANTS = [variant for variant in variants.PREBUILT if variant is not variants.best_variant(HERE_FLAGS)]
ZEN3 = variants.AVX2.cpu_flags | {"sha_ni", "vaes", "vpclmulqdq"}
ZEN4 = variants.AVX512.cpu_flags | {"avx512vbmi", "avx512_bitalg", "gfni"}
SAPPHIRE_RAPIDS = variants.AMX.cpu_flags | {"amx_int8", "avx512_fp16"}

#: The compiler's macros for the instructions a target lets it emit, by their /proc/cpuinfo names.
TARGET_MACROS = {
    "__SSSE3__": "ssse3",
    "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__BMI__": "bmi1",
    "__BMI2__": "bmi2",
    "__F16C__": "f16c",
    "__FMA__": "fma",
    "__LZCNT__": "abm",
    "__MOVBE__": "movbe",
    "__XSAVE__": "xsave",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512CD__": "avx512cd",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512VNNI__": "avx512_vnni",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
}


def test_each_cpu_runs_the_best_variant_its_flags_allow():
    assert variants.best_variant(ZEN3) is variants.AVX2
    assert variants.best_variant(ZEN4) is variants.AVX512
    assert variants.best_variant(SAPPHIRE_RAPIDS) is variants.AMX
    # AVX-512 without BF16 (Skylake-X, Ice Lake) runs the AVX2 build; a CPU short of x86-64-v3 a native one.
    assert variants.best_variant(ZEN4 - {"avx512_bf16"}) is variants.AVX2
    native = variants.best_variant(ZEN3 - {"movbe"})
    assert native.name == "native" and native.target_flags == ("-march=native",) and native.isa is None
    assert variants.best_variant(frozenset()).name == "native"


def test_a_forced_variant_is_taken_only_where_the_cpu_has_its_instructions():
    assert variants.chosen_variant(ZEN4, forced="avx2") is variants.AVX2
    assert variants.chosen_variant(ZEN4, forced="") is variants.AVX512
    assert variants.chosen_variant(ZEN4, forced="native").cpu_flags == ZEN4
    lacks_amx = r"=amx: this CPU lacks amx_bf16, amx_int8, amx_tile;.* runs avx512"
    with pytest.raises(variants.VariantError, match=lacks_amx):
        variants.chosen_variant(ZEN4, forced="amx")
    with pytest.raises(variants.VariantError, match=r"=avx512: this CPU lacks avx512_bf16, avx512_vnni"):
        variants.chosen_variant(ZEN4 - {"avx512_bf16", "avx512_vnni"}, forced="avx512")
    with pytest.raises(variants.VariantError, match=r"=avx9: unknown; choose one of amx, avx512, avx2, native"):
        variants.chosen_variant(ZEN4, forced="avx9")


@pytest.mark.parametrize("variant", variants.PREBUILT, ids=lambda v: v.name)
def test_a_variant_declares_what_its_target_emits_and_compiles(variant):
    """Every instruction the compiler may emit for the target is in the flags the CPU must have, and the kernels'
    paths the target enables are the ones the variant declares."""
    macros = subprocess.run(
        ["c++", *variant.target_flags, "-dM", "-E", "-x", "c++", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    assert {flag for macro, flag in TARGET_MACROS.items() if macro in defined} <= variant.cpu_flags
    assert loader.compiled_isa(variant.target_flags) == variant.isa


def test_a_build_is_named_after_its_variant_sources_and_torch(tmp_path, monkeypatch):
    names = {variant.library_name("2.13.0") for variant in variants.PREBUILT}
    assert len(names) == len(variants.PREBUILT) and all(n.startswith("_kernels_") for n in names)
    assert variants.AVX2.library_name("2.13.0") != variants.AVX2.library_name("2.14.1")
    # A native build is named after the CPU's flags, so a cache shared with another CPU never loads it.
    assert variants.native_variant(ZEN3).library_name("2.13.0") != variants.native_variant(ZEN4).library_name("2.13.0")
    # Any change to a source or a header renames every build.
    for source in variants.SOURCE_DIR.rglob("*"):
        if source.is_file():
            (tmp_path / source.relative_to(variants.SOURCE_DIR)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / source.relative_to(variants.SOURCE_DIR)).write_bytes(source.read_bytes())
    monkeypatch.setattr(variants, "SOURCE_DIR", tmp_path)
    assert variants.AVX2.library_name("2.13.0") in names
    (tmp_path / "simd" / "vec16.h").write_text((tmp_path / "simd" / "vec16.h").read_text() + "\n")
    assert variants.AVX2.library_name("2.13.0") not in names


def run_kernels(tmp_path: Path, forced: str | None) -> subprocess.CompletedProcess:
    """A fresh process that loads the kernels with no C++ compiler to be found and an empty extension cache, then
    reports the variant it registered and a product computed on it."""
    env = environment_without_compiler(tmp_path)
    if forced is not None:
        env[variants.VARIANT_ENV] = forced
    code = (
        "import torch\n"
        "from fiberserve import kernels\n"
        "kernels.load()\n"
        "x = torch.arange(32.0).reshape(1, 32) / 8\n"
        "print(kernels.variant().name, kernels.silu_mul(x)[0, 3].item())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_installed_build_loads_with_no_compiler(tmp_path):
    best = variants.best_variant(HERE_FLAGS)
    assert loader.prebuilt_library(best.library_name(torch.__version__)) is not None, (
        f"no installed {best.name} build of these sources: reinstall (pip install --no-build-isolation -e .)"
    )
    done = run_kernels(tmp_path, forced=None)
    assert done.returncode == 0, done.stderr
    expected = torch.nn.functional.silu(torch.tensor(3 / 8)) * (19 / 8)
    name, value = done.stdout.split()
    assert name == best.name and float(value) == pytest.approx(expected.item(), rel=1e-6)
    assert "compiling" not in done.stderr and not (tmp_path / "extensions").exists()


@pytest.mark.parametrize("variant", OTHER_VARIANTS, ids=lambda v: v.name)
def test_forcing_a_variant_loads_it_or_refuses_a_cpu_without_its_instructions(tmp_path, variant):
    done = run_kernels(tmp_path, forced=variant.name)
    missing = variant.cpu_flags - HERE_FLAGS
    if missing:
        assert done.returncode != 0 and done.stdout == ""
        assert f"VariantError: {variants.VARIANT_ENV}={variant.name}: this CPU lacks" in done.stderr
        assert not (tmp_path / "extensions").exists()
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[0] == variant.name and "compiling" not in done.stderr
