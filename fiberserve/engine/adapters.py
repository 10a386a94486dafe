"""The LoRA adapters an engine serves, by name: loaded at start (``--lora-modules``) or while serving, unloaded
only while no request uses them."""

from __future__ import annotations

import json

import torch

from fiberserve.engine.sampling_params import InvalidParameter
from fiberserve.model.config import ModelConfig
from fiberserve.model.lora import LoraAdapter, LoraError

#: The longest adapter name (a request's ``model`` names it).
MAX_NAME_LENGTH = 128


def lora_module(spec: str) -> tuple[str, str]:
    """An adapter's name and path from one ``--lora-modules`` item: ``NAME=PATH``, or vLLM's JSON form
    ``{"name": NAME, "path": PATH}``."""
    if spec.lstrip().startswith("{"):
        try:
            item = json.loads(spec)
            return str(item["name"]), str(item["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f'--lora-modules {spec!r}: JSON items need "name" and "path"') from None
    name, equals, path = spec.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: each item is NAME=PATH")
    return name, path


class AdapterNotFound(LookupError):
    """No adapter of that name is loaded."""


class AdapterInUse(RuntimeError):
    """The adapter still serves requests."""


class Adapters:
    """Loaded adapters by name, at most ``max_loras`` at once, each of rank at most ``max_rank``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_loras: int, max_rank: int) -> None:
        self.config = config
        self.dtype = dtype
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.loaded: dict[str, LoraAdapter] = {}

    def check_new(self, name: str, reserved: frozenset[str] = frozenset()) -> None:
        """Raise InvalidParameter (``lora_name``) unless ``name`` may name one more adapter: not one of
        ``reserved`` (the base model's names), not loaded already, and room left."""
        if not name or len(name) > MAX_NAME_LENGTH or not name.isprintable():
            raise InvalidParameter("lora_name", f"must be 1 to {MAX_NAME_LENGTH} printable characters")
        if name in self.loaded or name in reserved:
            raise InvalidParameter("lora_name", f"{name!r} is already served; unload it first")
        if len(self.loaded) >= self.max_loras:
            raise InvalidParameter("lora_name", f"--max-loras {self.max_loras} adapters are loaded already")

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at ``path`` read for this model (seconds for a large one: call it off the event loop);
        InvalidParameter (``lora_path``) naming the file where it does not fit."""
        try:
            return LoraAdapter.load(name, path, self.config, self.dtype, self.max_rank)
        except LoraError as error:
            raise InvalidParameter("lora_path", str(error)) from None

    def add(self, adapter: LoraAdapter, reserved: frozenset[str] = frozenset()) -> None:
        self.check_new(adapter.name, reserved)
        self.loaded[adapter.name] = adapter

    def get(self, name: str) -> LoraAdapter:
        adapter = self.loaded.get(name)
        if adapter is None:
            raise AdapterNotFound(name)
        return adapter

    def remove(self, name: str, users: int) -> LoraAdapter:
        """Forget adapter ``name``, which ``users`` unfinished sequences run under: AdapterInUse if any do."""
        self.get(name)
        if users:
            raise AdapterInUse(f"adapter {name!r} serves {users} unfinished sequence(s); unload it when they end")
        return self.loaded.pop(name)
