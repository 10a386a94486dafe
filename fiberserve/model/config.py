"""The model's shape, read from GGUF metadata or a Hugging Face ``config.json`` without reading any weights.

This module imports no PyTorch (``gguf`` needs only numpy), so the load generator and ``bench peak`` can size a
model without paying for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fiberserve.model.gguf_file import GGUF_MAGIC, GgufFile

#: Hugging Face ``architectures`` / GGUF ``general.architecture`` values we run.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}

#: Architectures whose RMSNorm scales by ``1 + weight`` in Hugging Face form (llama.cpp's files store ``1 + weight``).
OFFSET_NORMS = frozenset({"gemma2", "gemma3"})
#: Gemma 3 layers with a sliding window: all but every GEMMA3_GLOBAL_EVERY-th (llama.cpp's fixed pattern).
GEMMA3_GLOBAL_EVERY = 6
#: Gemma 3's RoPE base on its sliding-window layers, where a GGUF file does not say.
GEMMA3_LOCAL_ROPE_THETA = 10000.0


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder this package can run."""


def normalize_architecture(name: str) -> str:
    try:
        return SUPPORTED_ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedModelError(f"unsupported model architecture {name!r}; fiberserve runs: {supported}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    #: Hugging Face style ``rope_scaling`` dict (``rope_type`` llama3 or linear), or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    #: How many of the latest keys a token attends to (Mistral's sliding window); None: all of them.
    sliding_window: int | None = None
    #: Which layers attend through ``sliding_window`` (Gemma's interleaving); empty: every layer does.
    sliding_layers: tuple[bool, ...] = ()
    #: RoPE base of the sliding-window layers where it differs from ``rope_theta`` (Gemma 3).
    rope_local_theta: float | None = None
    #: Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    #: The MLP's gate activation: ``silu`` or ``gelu_tanh`` (Gemma).
    hidden_act: str = "silu"
    #: Gemma 2/3's extra norms: on the attention's output and around the MLP.
    sandwich_norms: bool = False
    #: Embeddings are multiplied by this (Gemma: sqrt(hidden_size)); None: not scaled.
    embedding_multiplier: float | None = None
    #: Attention scores are scaled by this; None: 1 / sqrt(head_dim).
    attention_scale: float | None = None
    #: ``cap * tanh(x / cap)`` on attention scores and on the final logits (Gemma 2); None: no capping.
    attn_softcap: float | None = None
    final_softcap: float | None = None
    #: How the file says its embeddings pool the final hidden states (llama.cpp's ``pooling_type``: ``mean``,
    #: ``last`` or ``rank``, a reranker's score head over the last token's); None: not said.
    pooling: str | None = None
    #: A reranker's prompt, with ``{query}`` and ``{document}`` in it (``tokenizer.chat_template.rerank``).
    rerank_template: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def decoder_weights(self) -> int:
        """The weights of every decoder layer's linear layers (q, k, v, o, gate, up, down), norms aside."""
        h, heads, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.num_layers * (h * (heads + 2 * kv) + heads * h + 3 * h * self.intermediate_size)

    @property
    def max_context(self) -> int:
        """The longest sequence (prompt plus output) served.

        Attention here always sees every earlier key, which is what a sliding window of ``w`` keys
        computes for sequences of at most ``w`` tokens; so a model with a window is served up to its
        window, where the two agree exactly (vLLM caps ``max_model_len`` the same way on backends
        without windowed attention), rather than past it with silently different attention."""
        if self.sliding_window and not self.sliding_layers:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention where it has one that the context can exceed, else None."""
        if self.sliding_layers and self.sliding_layers[layer]:
            return self.sliding_window
        return None

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is Llama's (the C++ layer kernels' shape); otherwise the model runs PyTorch's ops."""
        return not (
            self.qk_norm
            or self.sandwich_norms
            or self.hidden_act != "silu"
            or self.embedding_multiplier is not None
            or self.attention_scale is not None
            or self.attn_softcap is not None
            or self.final_softcap is not None
            or any(self.sliding_layers)
        )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        arch = normalize_architecture(archs[0])
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers 5 writes RoPE's base and scaling together as rope_parameters (rope_type "default": none),
        # per layer type where they differ (Gemma 3: "full_attention" and "sliding_attention")
        rope = cfg.get("rope_parameters") or {}
        local_rope = rope.get("sliding_attention") or {}
        rope = rope.get("full_attention") or rope
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        gemma = arch in OFFSET_NORMS
        layer_types = cfg.get("layer_types") or []
        sliding_layers = tuple(t == "sliding_attention" for t in layer_types) if gemma else ()
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or cfg.get("attention_bias", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            # Qwen2 configs name a window but switch it off with use_sliding_window: false
            sliding_window=window,
            sliding_layers=sliding_layers if window else (),
            rope_local_theta=local_rope.get("rope_theta") or cfg.get("rope_local_base_freq"),
            qk_norm=arch in ("qwen3", "gemma3"),
            hidden_act="gelu_tanh" if gemma else "silu",
            sandwich_norms=gemma,
            embedding_multiplier=cfg["hidden_size"] ** 0.5 if gemma else None,
            attention_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5 if gemma else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        )


def read_config(path: str | Path) -> ModelConfig:
    """The model's configuration alone (no weights read) from a GGUF file or a Hugging Face directory."""
    path = Path(path)
    if model_format(path) == "hf":
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    return gguf_config(open_gguf(path))


def model_format(path: Path) -> str:
    """The format of ``path``: "gguf" for a file that starts with GGUF's magic (whatever its name: Ollama's blobs
    have none), "hf" for a directory; otherwise an error that says what ``path`` is."""
    if not path.exists():
        raise FileNotFoundError(f"--model {path}: does not exist")
    if path.is_dir():
        return "hf"
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"--model {path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}) nor a Hugging Face "
            "model directory"
        )
    return "gguf"


def open_gguf(path: Path) -> GgufFile:
    """The metadata and tensors of the GGUF file ``path``; a file it cannot read is a ValueError naming the file."""
    try:
        return GgufFile(path)
    except Exception as exc:  # the reader's own errors (bad magic, version, a truncated file) name no file
        raise ValueError(f"--model {path}: not a GGUF file this server can read ({type(exc).__name__}: {exc})") from exc


#: llama.cpp's ``pooling_type`` values that a decoder model's embeddings take (1 mean, 3 last, 4 rank).
GGUF_POOLING_TYPES = {1: "mean", 3: "last", 4: "rank"}


def _field(reader: GgufFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_config(reader: GgufFile) -> ModelConfig:
    """The config stored in a GGUF file's metadata (llama.cpp's keys, under the architecture's name)."""
    arch_name = _field(reader, "general.architecture")
    arch = normalize_architecture(arch_name)

    def get(key, default=None):
        return _field(reader, f"{arch_name}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if tokens is not None else None)
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    eos = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    window = get("attention.sliding_window")
    layers = int(get("block_count"))
    gemma = arch in OFFSET_NORMS
    head_dim = int(get("attention.key_length") or hidden // heads)
    sliding_layers: tuple[bool, ...] = ()
    if arch == "gemma2":
        sliding_layers = tuple(i % 2 == 0 for i in range(layers))
    elif arch == "gemma3":
        sliding_layers = tuple((i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(layers))
    if vocab is None:
        raise ValueError("the GGUF file has neither a vocabulary size nor a token list")
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=int(heads),
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=any(n.endswith("attn_q.bias") for n in names),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        sliding_window=int(window) if window else None,
        sliding_layers=sliding_layers if window else (),
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if arch == "gemma3" else None,
        qk_norm=any(n.endswith("attn_q_norm.weight") for n in names),
        hidden_act="gelu_tanh" if gemma else "silu",
        sandwich_norms=gemma,
        embedding_multiplier=int(hidden) ** 0.5 if gemma else None,
        # llama.cpp scales Gemma's queries by 1 / sqrt(head_dim), which is query_pre_attn_scalar for Gemma 2 2B/9B
        # and Gemma 3
        attention_scale=head_dim**-0.5 if gemma else None,
        attn_softcap=_optional_float(get("attn_logit_softcapping")),
        final_softcap=_optional_float(get("final_logit_softcapping")),
        pooling=GGUF_POOLING_TYPES.get(get("pooling_type")),
        rerank_template=_field(reader, "tokenizer.chat_template.rerank"),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
