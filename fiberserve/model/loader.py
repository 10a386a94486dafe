"""Checkpoint loading: a GGUF file or a Hugging Face directory -> config + float32 weights.

Both loaders return weights under Hugging Face names and layout, so the model
has one code path.  GGUF stores Llama's q/k projections permuted for
llama.cpp's interleaved rotary embedding; :func:`_unpermute` undoes that so
the usual rotate-half RoPE gives the reference logits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fiberserve.model.config import ModelConfig, UnsupportedModelError, gguf_config, model_format, open_gguf


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    #: Llama 3 style per-frequency divisors stored by GGUF files (``rope_freqs.weight``).
    rope_freq_factors: torch.Tensor | None = None
    #: The GGUF block types of the decoder layers' matrices, e.g. {"Q4_1"} (empty for a Hugging Face directory).
    decoder_weight_types: frozenset[str] = frozenset()


def load_checkpoint(path: str | Path, progress: bool = True) -> Checkpoint:
    """Load a GGUF file (known by its content, whatever its name) or a Hugging Face model directory."""
    path = Path(path)
    if model_format(path) == "hf":
        return load_hf_directory(path, progress)
    return load_gguf(path, progress)


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, progress: bool = True) -> Checkpoint:
    import gguf

    reader = open_gguf(path)
    config = gguf_config(reader)
    permuted = config.architecture == "llama"
    weights: dict[str, torch.Tensor] = {}
    freq_factors = None
    types = set()
    for tensor in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not array.flags.writeable:  # the file's own float32 data, mapped read-only: copied
            array = array.copy()
        value = torch.from_numpy(array)  # a dequantized tensor is a new array already (copying it took 1.9 s)
        if tensor.name == "rope_freqs.weight":
            freq_factors = value
            continue
        name = _GGUF_NAMES.get(tensor.name)
        if name is None:
            match = _GGUF_LAYER.fullmatch(tensor.name)
            if not match or match.group(2) not in _GGUF_LAYER_NAMES:
                raise UnsupportedModelError(f"{path.name}: unexpected tensor {tensor.name!r}")
            layer, part, kind = match.groups()
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
            if kind == "weight" and not part.endswith("norm"):
                types.add(tensor.tensor_type.name)
            if permuted and part == "attn_q":
                value = _unpermute(value, config.num_heads)
            elif permuted and part == "attn_k":
                value = _unpermute(value, config.num_kv_heads)
        weights[name] = value
    return Checkpoint(config, weights, freq_factors, frozenset(types))


# ---------------------------------------------------------------- Hugging Face directory


def load_hf_directory(path: Path, progress: bool = True) -> Checkpoint:
    from safetensors.torch import load_file

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
    weights: dict[str, torch.Tensor] = {}
    for shard in tqdm(shards, desc=f"loading {path.name}", unit="shard", disable=not progress):
        for name, value in load_file(str(path / shard)).items():
            weights[name] = value.float()
    return Checkpoint(config, weights)
