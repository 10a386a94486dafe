"""Checkpoint loading: a GGUF file or a Hugging Face directory -> config + weights read on demand.

Both loaders return weights under Hugging Face names and layout, so the model
has one code path.  A weight is read from the (memory-mapped) file and turned
into float32 only when the model asks for it, and not kept: the model builds
its serving layout tensor by tensor, so no float32 copy of the whole model ever
exists.  Fused projections (Phi-3's qkv and gate/up) are split, and
norms are stored as the factor they multiply by (Gemma's ``1 + w``, which is
what llama.cpp's files hold).  GGUF stores Llama's q/k projections permuted for
llama.cpp's interleaved rotary embedding; :func:`unpermute` undoes that so
the usual rotate-half RoPE gives the reference logits.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fiberserve.model.block_formats import NATIVE_BITS
from fiberserve.model.config import (
    OFFSET_NORMS,
    ModelConfig,
    UnsupportedModelError,
    gguf_config,
    model_format,
    open_gguf,
)
from fiberserve.model.gguf_rows import GgufRows


class LazyWeights(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by Hugging Face name, each read as float32 when asked for and not kept (ask once)."""

    def __init__(self, keep_open: Any = None) -> None:
        """``keep_open``: whatever must stay alive for the readers to work (the open files)."""
        self._readers: dict[str, Callable[[], torch.Tensor]] = {}
        self._block_readers: dict[str, Callable[[], GgufRows]] = {}
        self._typed_readers: dict[str, Callable[[torch.dtype], torch.Tensor]] = {}
        self._row_readers: dict[str, tuple[Callable[[np.ndarray], torch.Tensor], int, int]] = {}
        self._keep_open = keep_open

    def add_rows(self, name: str, reader: Callable[[np.ndarray], torch.Tensor], rows: int, width: int) -> None:
        """How to read some of ``name``'s rows (float32) straight from the file's mapping, for a matrix [rows,
        width] stored in a format served in its own blocks."""
        self._row_readers[name] = (reader, rows, width)

    def rows(self, name: str) -> tuple[Callable[[np.ndarray], torch.Tensor], int, int] | None:
        """A reader of ``name``'s rows by index (float32 [len(index), width]) from the file, with the matrix's rows
        and width; None where there is none."""
        return self._row_readers.get(name)

    def add_blocks(self, name: str, reader: Callable[[], GgufRows]) -> None:
        """How to read ``name``'s own blocks, for a file that stores it in a format served in its own blocks."""
        self._block_readers[name] = reader

    def read_as(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``name`` in ``dtype`` without a float32 copy of the whole tensor where the file allows (a GGUF tensor
        is dequantized a slice of rows at a time; a safetensors one is converted from its own dtype)."""
        reader = self._typed_readers.get(name)
        return reader(dtype) if reader is not None else self[name].to(dtype)

    def add_typed(self, name: str, reader: Callable[[torch.dtype], torch.Tensor]) -> None:
        self._typed_readers[name] = reader

    def blocks(self, name: str) -> GgufRows | None:
        """``name``'s rows in the file's own blocks (unpacked where a product is built of them), or None if the file
        stores it otherwise."""
        reader = self._block_readers.get(name)
        return None if reader is None else reader()

    def add(self, name: str, reader: Callable[[], torch.Tensor]) -> None:
        self._readers[name] = reader

    def reader(self, name: str) -> Callable[[], torch.Tensor]:
        return self._readers[name]

    def remove(self, name: str) -> Callable[[], torch.Tensor]:
        self._block_readers.pop(name, None)
        self._typed_readers.pop(name, None)
        self._row_readers.pop(name, None)
        return self._readers.pop(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._readers[name]()

    def __contains__(self, name: object) -> bool:
        """Whether the checkpoint has ``name`` (nothing is read: Mapping's own test would read the tensor)."""
        return name in self._readers

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


class LoadStopped(Exception):
    """A load asked to stop (the server was told to exit while it loaded) that stopped before its end."""


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: LazyWeights
    #: Llama 3 style per-frequency divisors stored by GGUF files (``rope_freqs.weight``).
    rope_freq_factors: torch.Tensor | None = None
    #: The GGUF block types of the decoder layers' matrices, e.g. {"Q4_1"} (empty for a Hugging Face directory).
    decoder_weight_types: frozenset[str] = frozenset()


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a GGUF file (known by its content, whatever its name) or a Hugging Face model directory."""
    path = Path(path)
    if model_format(path) == "hf":
        return load_hf_directory(path)
    return load_gguf(path)


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "cls.output.weight": "score.weight",  # a reranker's score head (llama.cpp's name)
    "cls.output.bias": "score.bias",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
}
#: Where an architecture's GGUF layer names mean something else than Llama's.
GGUF_ARCH_LAYER_NAMES = {
    "gemma2": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up rows in one matrix, gate first
}
GGUF_ARCH_LAYER_NAMES["gemma3"] = GGUF_ARCH_LAYER_NAMES["gemma2"]
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path) -> Checkpoint:
    reader = open_gguf(path)
    config = gguf_config(reader)
    permuted = config.architecture == "llama"
    weights = LazyWeights(keep_open=reader)
    freq_factors = None
    types = set()
    layer_names = GGUF_LAYER_NAMES | GGUF_ARCH_LAYER_NAMES.get(config.architecture, {})
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            freq_factors = dequantized(tensor)
            continue
        name = _GGUF_NAMES.get(tensor.name)
        heads = None
        if name is None:
            match = _GGUF_LAYER.fullmatch(tensor.name)
            if not match or match.group(2) not in layer_names:
                raise UnsupportedModelError(f"{path.name}: unexpected tensor {tensor.name!r}")
            layer, part, kind = match.groups()
            name = f"model.layers.{layer}.{layer_names[part]}.{kind}"
            if kind == "weight" and not part.endswith("norm"):
                types.add(tensor.tensor_type.name)
            if permuted and part in ("attn_q", "attn_k"):
                heads = config.num_heads if part == "attn_q" else config.num_kv_heads
        release = functools.partial(reader.release, tensor)  # each read drops the tensor's pages after it
        weights.add(name, _gguf_reader(tensor, heads, release))
        if heads is None and tensor.data.ndim == 2:
            weights.add_typed(name, _gguf_typed_reader(tensor, release))
        if tensor.tensor_type.name in NATIVE_BITS:
            weights.add_blocks(name, _gguf_blocks_reader(tensor, heads, release))
            if heads is None and tensor.data.ndim == 2:
                weights.add_rows(name, functools.partial(_file_rows, reader, tensor), *reversed(tensor.shape))
    return Checkpoint(config, _split_fused(weights, config), freq_factors, frozenset(types))


def _file_rows(reader: Any, tensor: Any, index: np.ndarray) -> torch.Tensor:
    """Rows ``index`` of a GGUF matrix as float32, read from the file (not through its mapping: see
    ``GgufFile.read_rows``)."""
    import gguf

    rows = gguf.quants.dequantize(reader.read_rows(tensor, index), tensor.tensor_type)
    return torch.from_numpy(np.asarray(rows, dtype=np.float32))


def dequantized(tensor: Any, rows: slice | np.ndarray = slice(None)) -> torch.Tensor:
    """A GGUF tensor's ``rows`` (a slice, or row indices) as a float32 tensor of its own (the file's mapping is
    read-only)."""
    import gguf

    array = np.asarray(gguf.quants.dequantize(tensor.data[rows], tensor.tensor_type), dtype=np.float32)
    if not array.flags.writeable:  # the file's own float32 data, mapped read-only: copied
        array = array.copy()
    return torch.from_numpy(array)


def _gguf_blocks_reader(
    tensor: Any, unpermute_heads: int | None, release: Callable[[], None]
) -> Callable[[], GgufRows]:
    def read() -> GgufRows:
        blocks = GgufRows(tensor.data, tensor.tensor_type.name, release)
        return blocks if unpermute_heads is None else blocks.map_rows(lambda t: unpermute(t, unpermute_heads))

    return read


#: Rows a GGUF matrix is dequantized at a time where it is read straight into another dtype.
ROWS_PER_SLICE = 4096


def _gguf_typed_reader(tensor: Any, release: Callable[[], None]) -> Callable[[torch.dtype], torch.Tensor]:
    def read(dtype: torch.dtype) -> torch.Tensor:
        rows = tensor.data.shape[0]
        out = None
        for start in range(0, rows, ROWS_PER_SLICE):
            part = dequantized(tensor, slice(start, start + ROWS_PER_SLICE))
            if out is None:
                out = torch.empty(rows, part.shape[1], dtype=dtype)
            out[start : start + part.shape[0]] = part
        release()
        assert out is not None, "a matrix has rows"
        return out

    return read


def _gguf_reader(tensor: Any, unpermute_heads: int | None, release: Callable[[], None]) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        value = dequantized(tensor)
        release()
        return value if unpermute_heads is None else unpermute(value, unpermute_heads)

    return read


def _split_fused(weights: LazyWeights, config: ModelConfig) -> LazyWeights:
    """Phi-3's fused projections as separate ones: qkv rows are [q; k; v], gate/up rows [gate; up]."""
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name in [n for n in weights if ".qkv_proj." in n or ".gate_up_proj." in n]:
        read = weights.remove(name)
        if ".qkv_proj." in name:
            for index, x in enumerate("qkv"):
                weights.add(name.replace("qkv_proj", f"{x}_proj"), _part(read, [q_rows, kv_rows, kv_rows], index))
        else:
            for index, x in enumerate(("gate", "up")):
                weights.add(name.replace("gate_up_proj", f"{x}_proj"), _part(read, 2, index))
    return weights


def _part(read: Callable[[], torch.Tensor], split: int | list[int], index: int) -> Callable[[], torch.Tensor]:
    """A reader of the ``index``-th rows of what ``read`` reads, split into ``split`` (sizes, or equal parts)."""

    def read_part() -> torch.Tensor:
        value = read()
        parts = value.chunk(split) if isinstance(split, int) else value.split(split)
        return parts[index].clone()  # not a view that keeps the whole fused matrix alive

    return read_part


# ---------------------------------------------------------------- Hugging Face directory


def load_hf_directory(path: Path) -> Checkpoint:
    from safetensors import safe_open

    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--model {path}: no config.json in this directory")
    config = ModelConfig.from_hf(json.loads(config_file.read_text()))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"--model {path}: no *.safetensors files")
    files = [safe_open(str(path / shard), framework="pt") for shard in shards]
    weights = LazyWeights(keep_open=files)
    offset = config.architecture in OFFSET_NORMS
    for file in files:
        for name in file.keys():  # noqa: SIM118 (a safetensors file is not a dict)
            plus_one = offset and name.endswith("norm.weight")
            weights.add(name, _safetensors_reader(file, name, plus_one))
            if not plus_one:
                weights.add_typed(name, _safetensors_typed_reader(file, name))
    return Checkpoint(config, _split_fused(weights, config))


def _safetensors_reader(file: Any, name: str, plus_one: bool) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        value = file.get_tensor(name).float()
        return value + 1 if plus_one else value

    return read


def _safetensors_typed_reader(file: Any, name: str) -> Callable[[torch.dtype], torch.Tensor]:
    return lambda dtype: file.get_tensor(name).to(dtype)
