"""A decoder layer's weights read from a checkpoint and built into the products that run them."""

from __future__ import annotations

import torch

from fiberserve.model.config import ModelConfig
from fiberserve.model.gguf_rows import GgufRows
from fiberserve.model.linear import (
    GateUp,
    Linear,
    QuantLinear,
    StackedLinear,
    Weight,
    make_linear,
    quant_kernel_available,
    unpacked,
)
from fiberserve.model.loader import LazyWeights
from fiberserve.model.quant_blocks import QuantBlocks


class LayerWeights:
    """One decoder layer's weights as its products take them: norms in float32, the qkv, o, gate/up and down
    products of the file's own blocks where they are served as stored (see :func:`.make_linear`)."""

    def __init__(
        self,
        w: LazyWeights,
        i: int,
        config: ModelConfig,
        dtype,
        device,
        quantization: str,
        fused: bool,
    ) -> None:
        """``fused``: the model runs the extension's kernels (:attr:`LlamaModel.fused`)."""
        p = f"model.layers.{i}."

        # Checkpoint precision here: make_linear rounds to dtype, or quantizes from these values.
        def get(name: str) -> torch.Tensor:
            return w[p + name].to(device=device)

        def matrix(name: str) -> torch.Tensor | QuantBlocks | GgufRows:
            """The file's own blocks where the products are quantized and the file's format is served as is: its
            rows as stored on the CPU (unpacked once joined), else unpacked on ``device``."""
            blocks = w.blocks(p + name) if quantization == "int4" else None
            if blocks is None:
                return get(name)
            return blocks if torch.device(device).type == "cpu" else blocks.unpack().map_rows(lambda t: t.to(device))

        def linear(weight: Weight, bias: torch.Tensor | None = None) -> Linear | QuantLinear:
            return make_linear(weight, bias, quantization, dtype)

        def norm(name: str) -> torch.Tensor:
            return w[p + name + ".weight"].to(device=device, dtype=torch.float32)

        self.attn_norm = norm("input_layernorm")
        #: Gemma's extra norms, on the attention's output and on the MLP's (None elsewhere).
        self.post_attn_norm: torch.Tensor | None = None
        self.post_mlp_norm: torch.Tensor | None = None
        if config.sandwich_norms:
            self.post_attn_norm = norm("post_attention_layernorm")
            self.mlp_norm = norm("pre_feedforward_layernorm")
            self.post_mlp_norm = norm("post_feedforward_layernorm")
        else:
            self.mlp_norm = norm("post_attention_layernorm")
        #: Per-head norms of q and k (Qwen3, Gemma 3), else None.
        self.q_norm = norm("self_attn.q_norm") if config.qk_norm else None
        self.k_norm = norm("self_attn.k_norm") if config.qk_norm else None
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([get(f"self_attn.{x}_proj.bias") for x in "qkv"])
        stacked = _stack([matrix(f"self_attn.{x}_proj.weight") for x in "qkv"])
        if isinstance(stacked, list):  # parts in different block formats: a product each
            biases = [None] * len(stacked) if qkv_bias is None else list(qkv_bias.split([b.shape[0] for b in stacked]))
            self.qkv: Linear | QuantLinear | StackedLinear = StackedLinear(
                [linear(b, bias) for b, bias in zip(stacked, biases, strict=True)]
            )
        else:
            self.qkv = linear(stacked, qkv_bias)
        self.o = linear(matrix("self_attn.o_proj.weight"))
        gate, up = matrix("mlp.gate_proj.weight"), matrix("mlp.up_proj.weight")
        self.gate_up = GateUp(gate, up, quantization, dtype, silu_kernel=fused, gelu=config.hidden_act == "gelu_tanh")
        self.down = linear(matrix("mlp.down_proj.weight"))


def _stack(parts: list[Weight]) -> Weight | list[QuantBlocks | GgufRows]:
    """The rows of ``parts`` one after another: blocks where all are blocks in one format (where the kernel runs
    them; a file's rows joined as stored), a list of such of consecutive parts alike where their formats differ, else
    floats."""
    blocks = [p for p in parts if not isinstance(p, torch.Tensor)]
    if len(blocks) < len(parts):
        return torch.cat([p if isinstance(p, torch.Tensor) else unpacked(p).dequantize() for p in parts])
    runs: list[list[QuantBlocks | GgufRows]] = []
    for b in blocks:
        if runs and type(runs[-1][0]) is type(b) and runs[-1][0].same_format(b):  # type: ignore[arg-type]
            runs[-1].append(b)
        else:
            runs.append([b])
    if len(runs) > 1 and not quant_kernel_available():  # one product: blocks in one format
        return QuantBlocks.cat([unpacked(b) for b in blocks])
    joined = [run[0] if len(run) == 1 else _cat_rows(run) for run in runs]
    return joined[0] if len(joined) == 1 else joined


def _cat_rows(run: list[QuantBlocks | GgufRows]) -> QuantBlocks | GgufRows:
    if all(isinstance(b, GgufRows) for b in run):
        return GgufRows.cat(run)  # type: ignore[arg-type]
    return QuantBlocks.cat([unpacked(b) for b in run])
