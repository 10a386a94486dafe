"""The model's shape, read from GGUF metadata or a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Hugging Face ``architectures`` / GGUF ``general.architecture`` values we run.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
}


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def max_context(self) -> int:
        """The longest sequence (prompt plus output) served.

        Attention here always sees every earlier key, which is what a sliding window of ``w`` keys
        computes for sequences of at most ``w`` tokens; so a model with a window is served up to its
        window, where the two agree exactly (vLLM caps ``max_model_len`` the same way on backends
        without windowed attention), rather than past it with silently different attention."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        arch = normalize_architecture(archs[0])
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or cfg.get("attention_bias", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            # Qwen2 configs name a window but switch it off with use_sliding_window: false
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        )
