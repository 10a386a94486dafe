"""Tiny random-weight Llama-family checkpoints, written by the tests themselves (GGUF and HF)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def random_weights(cfg: dict, seed: int = 0, bias: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KVH = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = D // H

    def r(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": r(V, D, scale=1.0), "model.norm.weight": 1 + r(D, scale=0.1)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = r(V, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(D, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + r(D, scale=0.1)
        w[p + "self_attn.q_proj.weight"] = r(H * hd, D)
        w[p + "self_attn.k_proj.weight"] = r(KVH * hd, D)
        w[p + "self_attn.v_proj.weight"] = r(KVH * hd, D)
        w[p + "self_attn.o_proj.weight"] = r(D, H * hd)
        w[p + "mlp.gate_proj.weight"] = r(F, D)
        w[p + "mlp.up_proj.weight"] = r(F, D)
        w[p + "mlp.down_proj.weight"] = r(D, F)
        if bias:
            for x, n in (("q", H), ("k", KVH), ("v", KVH)):
                w[p + f"self_attn.{x}_proj.bias"] = r(n * hd, scale=0.1)
    return w


def write_hf(
    path: Path, cfg: dict, weights: dict[str, torch.Tensor], arch: str = "LlamaForCausalLM", shards: int = 1
) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model_type = next((t for t in ("qwen2", "mistral") if arch.lower().startswith(t)), "llama")
    config = {**cfg, "architectures": [arch], "model_type": model_type}
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    if shards == 1:
        save_file({k: weights[k].contiguous() for k in names}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: weights[k].contiguous() for k in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return path


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF q/k permutation (the loader must undo it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_writer(path: Path, arch: str, cfg: dict, rope_theta: float, bos: int, eos: int):
    """A GGUF writer holding the shape keys llama.cpp's converter writes, from a Hugging Face ``cfg``."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    return w


def _write_out(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path: Path, cfg: dict, weights: dict[str, torch.Tensor], qtype=None, dress=None) -> Path:
    """A GGUF file as llama.cpp's converter writes it; 2-D weights quantized to ``qtype`` if given (a type, or a
    function of the tensor's GGUF name giving one); ``dress(writer)`` adds keys and tensors of its own first."""
    from fiberserve.bench.block_quantizers import quantize_blocks

    H, KVH = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = _gguf_writer(path, "llama", cfg, cfg["rope_theta"], cfg["bos_token_id"], cfg["eos_token_id"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if dress is not None:
        dress(w)

    def put(name: str, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value, dtype=np.float32)
        kind = qtype(name) if callable(qtype) else qtype
        if kind is not None and value.ndim == 2:
            w.add_tensor(name, quantize_blocks(value, kind.name), raw_dtype=kind)
        else:
            w.add_tensor(name, value)

    put("token_embd.weight", weights["model.embed_tokens.weight"].numpy())
    put("output_norm.weight", weights["model.norm.weight"].numpy())
    if "lm_head.weight" in weights:
        put("output.weight", weights["lm_head.weight"].numpy())
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in _GGUF_NAMES.items():
            value = weights[f"model.layers.{i}.{hf_name}"].numpy()
            if gguf_name == "attn_q.weight":
                value = _permute(value, H)
            elif gguf_name == "attn_k.weight":
                value = _permute(value, KVH)
            put(f"blk.{i}.{gguf_name}", value)
    _write_out(w)
    return path


#: Tiny configs of the architectures beyond Llama, as the installed transformers writes them (its own classes).
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def write_transformers_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A tiny ``arch`` model made by transformers itself, every parameter random (norms too), saved as it saves."""
    import transformers

    config_class, model_class, extra = ARCHITECTURES[arch]
    shape = {k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")}
    num_layers = 6 if arch == "gemma3" else 4  # Gemma 3: five sliding-window layers, then a global one
    config = getattr(transformers, config_class)(
        **shape,
        num_hidden_layers=num_layers,
        num_key_value_heads=TINY["num_key_value_heads"],
        max_position_embeddings=TINY["max_position_embeddings"],
        bos_token_id=1,
        eos_token_id=2,
        **{**extra, **overrides},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.08)
    model.save_pretrained(str(path))
    return path


def write_gguf_like_llama_cpp(path: Path, hf_dir: Path) -> Path:
    """The GGUF file llama.cpp's converter writes for a Qwen3, Gemma 2/3 or Phi-3 directory: its metadata keys, its
    tensor names, Gemma's norms stored as 1 + w, Phi-3's projections fused, nothing permuted."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"gemma3_text": "gemma3"}.get(cfg["model_type"], cfg["model_type"])
    weights = {k: v.float() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention") or rope
    w = _gguf_writer(path, arch, cfg, rope.get("rope_theta", 10000.0), bos=1, eos=2)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("attn_logit_softcapping"):
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
    }
    if arch.startswith("gemma"):
        names |= {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    top["lm_head.weight"] = "output.weight"
    for name, value in weights.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            value = value + 1
        if name in top:
            if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
                continue
            gguf_name = top[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            base, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[base]}.{kind}"
        w.add_tensor(gguf_name, np.ascontiguousarray(value.numpy(), dtype=np.float32))
    _write_out(w)
    return path


#: The prompt of :func:`write_tiny_reranker`'s model, as llama.cpp's converter stores a reranker's.
RERANK_TEMPLATE = "<|im_start|>user\nQuery: {query}\nDocument: {document}<|im_end|>\n<|im_start|>assistant\n"


def write_tiny_reranker(path: Path, tokenizer_file: Path) -> tuple[Path, torch.Tensor]:
    """A tiny random Llama shaped as llama.cpp's converter writes a Qwen3-Reranker: ``tokenizer_file``'s tokenizer,
    pooling type ``rank``, a score head ``cls.output`` of the head's rows of "yes" and "no" (in that order), and
    :data:`RERANK_TEMPLATE`.  Returns the file and its score head [2, hidden]."""
    import gguf

    from fiberserve.bench.random_model import copy_tokenizer
    from fiberserve.model.gguf_file import GgufFile

    tokens = GgufFile(tokenizer_file).fields["tokenizer.ggml.tokens"].items()
    cfg = {**TINY, "vocab_size": len(tokens)}
    weights = random_weights(cfg, seed=3)
    head = weights["lm_head.weight"][[tokens.index("yes"), tokens.index("no")]].clone()

    def dress(writer) -> None:
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):  # the tokenizer's own instead
            writer.kv_data[0].pop(key)
        copy_tokenizer(writer, tokenizer_file, cfg["vocab_size"])
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_string("tokenizer.chat_template.rerank", RERANK_TEMPLATE)
        writer.add_tensor("cls.output.weight", head.numpy())

    return write_gguf(path, cfg, weights, dress=dress), head
