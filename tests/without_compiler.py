"""An environment in which no C++ compiler can be found, for processes that must load the kernels' installed builds."""

from __future__ import annotations

import os
from pathlib import Path

from fiberserve.kernels import variants


def environment_without_compiler(folder: Path) -> dict[str, str]:
    """``os.environ`` with every compiler name on PATH failing, ``$CXX`` failing, an empty extension cache at
    ``folder / "extensions"`` (it exists afterwards only if something compiled) and no forced variant."""
    shims = folder / "no-compilers"
    shims.mkdir(parents=True, exist_ok=True)
    for compiler in ("c++", "g++", "gcc", "cc", "clang", "clang++"):
        (shims / compiler).write_text("#!/bin/sh\nexit 1\n")
        (shims / compiler).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "CXX": str(shims / "c++"),
        "TORCH_EXTENSIONS_DIR": str(folder / "extensions"),
    }
    env.pop(variants.VARIANT_ENV, None)
    return env
