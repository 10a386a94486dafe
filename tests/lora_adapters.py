"""LoRA adapters written by the tests: by PEFT itself, by hand in PEFT's files for a model no transformers
class is built for here, and as llama.cpp's converter writes them in GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import _permute

EVERY_TARGET = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_peft_adapter(
    base: Path, path: Path, rank: int, alpha: float, targets: list[str], seed: int = 0
) -> torch.nn.Module:
    """A PEFT adapter of random A and B for the Hugging Face model ``base``, saved by PEFT at ``path``; returns
    transformers' float32 model with the adapter merged into its weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: both random here, so every target adds something
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(str(path))
    return peft_model.merge_and_unload().eval()


def write_gguf_adapter(peft_dir: Path, path: Path, alpha: float, heads: tuple[int, int]) -> Path:
    """The GGUF adapter llama.cpp's ``convert_lora_to_gguf.py`` writes from a PEFT adapter of a Llama model: GGUF
    tensor names with ``.lora_a`` / ``.lora_b``, q and k's B rows permuted as the base's q and k are (``heads``: the
    model's query and key/value heads)."""
    import gguf
    from safetensors.torch import load_file

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, tensor in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        layer, module, half = key.split(".layers.")[1].split(".")[0], key.split(".")[-3], key.split(".")[-2]
        value = tensor.float().numpy()
        if half == "lora_B" and module in ("q_proj", "k_proj"):
            value = _permute(value, heads[0] if module == "q_proj" else heads[1])
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.{half.lower()}", np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_random_adapter(path: Path, config, rank: int, alpha: float, seed: int, spread: float = 0.05) -> Path:
    """PEFT's files (``adapter_config.json``, ``adapter_model.safetensors``) of a rank-``rank`` adapter of every
    target module of a model of ``config`` (a :class:`.ModelConfig`), A and B drawn from N(0, ``spread``)."""
    from safetensors.torch import save_file

    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    width, ffn = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (width, q), "k_proj": (width, kv), "v_proj": (width, kv), "o_proj": (q, width)}
    shapes |= {"gate_proj": (width, ffn), "up_proj": (width, ffn), "down_proj": (ffn, width)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * spread
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * spread
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": EVERY_TARGET, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path
