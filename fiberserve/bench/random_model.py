"""Random-weight GGUF files of real models' shapes, for measuring speed and memory at the sizes people run.

Nothing here downloads weights: the shapes are Llama 3's (:data:`SHAPES`), the weights random, and the
tokenizer the embedded model's (its vocabulary padded with reserved tokens to the shape's size, so the output
head does a real model's work).  The text is meaningless; the work per token is the real model's.

Formats: any block format the product serves (every 2-D weight in it, as llama-quantize's ``--pure`` writes), or
llama.cpp's mixes ``Q3_K_M``, ``Q4_K_M`` and ``Q5_K_M`` (:func:`tensor_format`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fiberserve.bench.block_quantizers import quantize_blocks
from fiberserve.model.block_formats import NATIVE_BITS
from fiberserve.model.gguf_file import GgufFile, StringArray


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool  #: the output head reads the token embedding
    rope_theta: float = 500000.0
    context: int = 131072


#: The shapes of Meta's Llama 3 models (their config.json values).
SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied=True),
    "llama-3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256, tied=True),
    "llama-3.1-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False),
}


@dataclass(frozen=True)
class Mix:
    """One of llama.cpp's mixes, as its quantizer (``llama_tensor_get_type``) gives a Llama model's matrices their
    formats: the output head's, attn_v's and ffn_down's in the layers it favours and in the rest, attn_output's,
    and ``base`` for every other matrix."""

    base: str
    head: str
    favoured: str  #: attn_v and ffn_down where :attr:`favours` says so
    plain: str  #: attn_v and ffn_down elsewhere
    attn_output: str
    favours: Callable[[int, int, str], bool]  #: (layer, layers, matrix name) -> favoured


def _favoured(layer: int, layers: int, _name: str = "") -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _q3_k_m_favoured(layer: int, layers: int, name: str) -> bool:
    """Q3_K_M's Q5_K matrices: the first two layers' attn_v, the first sixteenth's ffn_down."""
    return layer < 2 if name.endswith("attn_v.weight") else layer < layers // 16


#: llama.cpp's mixes by their names.
MIXES = {
    "Q3_K_M": Mix("Q3_K", "Q6_K", favoured="Q5_K", plain="Q4_K", attn_output="Q4_K", favours=_q3_k_m_favoured),
    "Q4_K_M": Mix("Q4_K", "Q6_K", favoured="Q6_K", plain="Q4_K", attn_output="Q4_K", favours=_favoured),
    "Q5_K_M": Mix("Q5_K", "Q6_K", favoured="Q6_K", plain="Q5_K", attn_output="Q5_K", favours=_favoured),
}

FORMATS = sorted(NATIVE_BITS) + sorted(MIXES)

#: The scale of the random weights (of a real model's order), and of the norms' spread around 1.
WEIGHT_SCALE, NORM_SPREAD = 0.02, 0.1

#: Rows quantized at a time: bounds the writer's memory whatever the matrix.
ROWS_PER_CHUNK = 1024


def tensor_format(name: str, layers: int, file_format: str, tied: bool) -> str:
    """The block format of matrix ``name`` in a ``file_format`` file: llama-quantize's choice for a mix (the output
    head's format for the head, or for the embedding where the head reads it (``tied``); see :class:`Mix`), else
    the file's."""
    if file_format not in MIXES:
        return file_format
    mix = MIXES[file_format]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return mix.head
    if name.endswith("attn_output.weight"):
        return mix.attn_output
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return mix.favoured if mix.favours(int(name.split(".")[1]), layers, name) else mix.plain
    return mix.base


def _matrices(shape: Shape) -> Iterator[tuple[str, tuple[int, int]]]:
    """Every matrix of the model, [rows, inputs], in llama.cpp's order."""
    head_dim = shape.hidden // shape.heads
    yield "token_embd.weight", (shape.vocab, shape.hidden)
    if not shape.tied:
        yield "output.weight", (shape.vocab, shape.hidden)
    for i in range(shape.layers):
        yield f"blk.{i}.attn_q.weight", (shape.heads * head_dim, shape.hidden)
        yield f"blk.{i}.attn_k.weight", (shape.kv_heads * head_dim, shape.hidden)
        yield f"blk.{i}.attn_v.weight", (shape.kv_heads * head_dim, shape.hidden)
        yield f"blk.{i}.attn_output.weight", (shape.hidden, shape.heads * head_dim)
        yield f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.hidden)
        yield f"blk.{i}.ffn_up.weight", (shape.ffn, shape.hidden)
        yield f"blk.{i}.ffn_down.weight", (shape.hidden, shape.ffn)


def _norms(shape: Shape) -> Iterator[str]:
    yield "output_norm.weight"
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight"
        yield f"blk.{i}.ffn_norm.weight"


def copy_tokenizer(writer, tokenizer_file: Path, vocab: int) -> None:
    """The tokenizer keys of ``tokenizer_file``, its tokens padded with reserved ones to ``vocab``."""
    import gguf

    source = GgufFile(tokenizer_file)
    for key, value in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, StringArray):
            value = value.items()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|reserved_{i}|>" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [gguf.TokenType.UNUSED] * (vocab - len(value))
        if isinstance(value, list):
            first = value[0] if value else 0
            item = gguf.GGUFValueType.get_type(first.item() if isinstance(first, np.generic) else first)
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=item)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):  # before int: llama.cpp refuses a flag stored as a number
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))
    if len(source.fields["tokenizer.ggml.tokens"]) > vocab:
        raise ValueError(f"the tokenizer has more tokens than the shape's vocabulary of {vocab}")


def write_random_model(
    path: Path, shape: Shape, file_format: str, tokenizer_file: Path, seed: int = 0, progress: bool = True
) -> Path:
    """Write a model of ``shape`` with random weights in ``file_format`` to ``path``, streamed (the writer holds one
    chunk of rows at a time); the tokenizer comes from the GGUF file ``tokenizer_file``."""
    import gguf
    from tqdm import tqdm

    if file_format not in FORMATS:
        raise ValueError(f"unknown format {file_format!r}; the formats are {', '.join(FORMATS)}")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"{path.stem} (random weights)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    copy_tokenizer(writer, tokenizer_file, shape.vocab)

    plan: list[tuple[str, tuple[int, int], str | None]] = [(n, (shape.hidden, 0), None) for n in _norms(shape)]
    plan += [(n, dims, tensor_format(n, shape.layers, file_format, shape.tied)) for n, dims in _matrices(shape)]
    for name, (rows, inputs), kind in plan:
        if kind is None:
            writer.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = rows * inputs // block * size
            writer.add_tensor_info(name, (rows, inputs // block * size), np.dtype(np.uint8), nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(rows * max(inputs, 1) for _, (rows, inputs), _ in plan)
    with tqdm(total=total, unit="weight", unit_scale=True, desc=path.name, disable=not progress) as bar:
        for _name, (rows, inputs), kind in plan:
            if kind is None:
                writer.write_tensor_data(1 + rng.standard_normal(rows, dtype=np.float32) * NORM_SPREAD)
                bar.update(rows)
                continue
            parts = []
            for first in range(0, rows, ROWS_PER_CHUNK):
                count = min(ROWS_PER_CHUNK, rows - first)
                weights = rng.standard_normal((count, inputs), dtype=np.float32) * WEIGHT_SCALE
                parts.append(quantize_blocks(weights, kind))
                bar.update(count * inputs)
            writer.write_tensor_data(np.concatenate(parts))
    writer.close()
    return path
