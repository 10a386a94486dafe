"""Shared fixtures: the real default model (fetched once, cached) and tiny random models."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from fiberserve.config import default_cache_dir


@pytest.fixture(scope="session")
def cache_dir() -> str:
    path = default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def model_path(cache_dir: str) -> str:
    """The embedded default model (SmolLM2-135M-Instruct Q4_1), fetched and verified on first use."""
    from fiberserve.model.assets import default_model_path

    return str(default_model_path(cache_dir, progress=False))


@pytest.fixture(scope="session")
def tokenizer(model_path: str, cache_dir: str):
    from fiberserve.model.tokenizer import load_tokenizer

    return load_tokenizer(model_path, cache_dir)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """The same tiny random Llama as a GGUF file and as a Hugging Face directory."""
    from tests.tiny_models import TINY, random_weights, write_gguf, write_hf

    root = tmp_path_factory.mktemp("tiny")
    weights = random_weights(TINY)
    return {"hf": write_hf(root / "hf", TINY, weights), "gguf": write_gguf(root / "tiny.gguf", TINY, weights)}


@pytest.fixture(scope="session")
def start_server(cache_dir: str, tmp_path_factory):
    """``start_server(*flags)``: a real server process (``ServerProcess``), logging into pytest's temporary
    directory (pytest keeps the last three runs' and removes older ones)."""
    from tests.integration.server_utils import ServerProcess

    return functools.partial(ServerProcess, cache_dir=cache_dir, log_dir=tmp_path_factory.mktemp("server-logs"))


def pytest_configure(config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
