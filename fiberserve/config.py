"""One configuration for the engine and one for the server around it, passed down explicitly.

Environment variables are read here and in the CLI only, never deep inside the code.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """``$FIBERSERVE_CACHE``, else ``~/.cache/fiberserve``."""
    env = os.environ.get("FIBERSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fiberserve"


def setting(default: Any = MISSING, help: str = "", *, choices: tuple[str, ...] = (), factory: Any = MISSING) -> Any:
    """A config field with its flag's help (and allowed values): the one place a setting is described."""
    metadata = {"help": help, "choices": choices}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


#: ``tool_call_parser`` values: how ``tool_choice: "auto"`` reads calls (none: it is refused).
TOOL_CALL_PARSERS = ("none", "auto", "hermes", "llama3_json", "mistral", "pythonic", "functiongemma")
#: ``reasoning_parser`` values: how a chat answer's thinking is split from it (none: it stays in the content).
REASONING_PARSERS = ("none", "deepseek_r1", "qwen3")
#: ``kv_cache_dtype`` values: how the KV cache stores keys and values (model/kv_format.py); auto: the model's dtype.
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3", "q8_0")
#: ``pooling`` values: how an embedding pools the prompt (``engine.sampling_params.POOLINGS``, or the file's).
POOLING_SETTINGS = ("auto", "last", "mean")


@dataclass
class EngineConfig:
    """Everything the engine needs; the server and the offline ``LLM`` build one of these.  Each field's help
    (``fields(EngineConfig)[i].metadata["help"]``) is its flag's help too."""

    model: str | None = setting(
        None,
        "a GGUF file (known by its content, any name) or a Hugging Face model directory "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    cache_dir: str = setting(
        help="where the default model and converted tokenizers are cached ($FIBERSERVE_CACHE)",
        factory=lambda: str(default_cache_dir()),
    )
    chat_template: str | None = setting(
        None, "a Jinja chat template, as a file or the template itself, that renders chats instead of the model's own"
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    dtype: str = setting(
        "auto",
        "bfloat16 where the hardware computes it natively (auto), else float32",
        choices=("auto", "float32", "bfloat16"),
    )
    quantization: str = setting(
        "auto",
        "int4: llama.cpp's arithmetic on CPU, a GGUF's own 4, 5, 6 and 8-bit blocks (or Q4_1 from other weights) "
        "times int8 activations; auto is int4 for a GGUF whose decoder matrices are all in such blocks, except "
        "small models on a CPU with AMX tiles (service.resolve_quantization); none computes in --dtype",
        choices=("auto", "none", "int4"),
    )
    fibers: int = setting(1, "fibers in the pool = model invocations (flights) that may run at once")
    threads_per_fiber: int | None = setting(None, "torch threads per fiber (default: CPU cores / fibers)")
    fit_free_cores: bool = setting(
        True,
        "narrow each fiber's thread team to the cores other processes leave free (a busy neighbour or a second "
        "replica), and widen it back as they free them (runtime/cpu_share.py)",
    )
    isolation: str = setting(
        "per_fiber",
        "program isolation: per_fiber (one instance per fiber), per_call, or none",
        choices=("per_fiber", "per_call", "none"),
    )
    page_size: int = setting(16, "tokens per KV cache page")
    kv_cache_mb: float | None = setting(
        None,
        "KV cache size in MiB (default: one sequence of the whole context, at least 256 MiB, at most a quarter "
        "of the memory available at start: service.kv_cache_pages)",
    )
    kv_pages: int | None = setting(None, "KV cache size in pages (overrides --kv-cache-mb)")
    kv_cache_dtype: str = setting(
        "auto",
        "how the KV cache stores keys and values: auto (the model's dtype), bf16, fp8_e4m3 (float8, half of bf16's "
        "bytes) or q8_0 (llama.cpp's -ctk/-ctv q8_0: int8 in blocks of 32 with a float16 scale); quantized when "
        "written, read by attention in place (model/kv_format.py)",
        choices=KV_CACHE_DTYPES,
    )
    max_model_len: int | None = setting(
        None, "longest context (prompt + output) a request may use; at most the model's, which is the default"
    )
    max_running: int = setting(64, "most sequences running at once")
    max_batch_tokens: int = setting(512, "token budget of one flight (long prompts are prefilled in chunks of this)")
    decode_steps: int = setting(
        8,
        "decode steps a flight of a few plain decodes (multi_step.MULTI_STEP_MAX_SEQUENCES) runs before it "
        "returns to the scheduler: each step's tokens land and stream while the next computes, and a new request "
        "halts the flight after its current step; 1 = off",
    )
    # On by default, unlike vLLM and SGLang: on a CPU a few extra rows cost little next to reading the weights,
    # and the cut below, which speculation.DraftSwitch checks per flight size, drops drafts where they do not pay.
    speculative_tokens: int = setting(
        8,
        "the longest draft a decode carries (speculative decoding by prompt lookup: the tokens that followed the "
        "last earlier occurrence of its last 2-3 tokens; checked in the same pass, so the output is unchanged; a "
        "draft is cut where one more token would lower the expected tokens per second, from how often the "
        "sequence's drafts came true and the pass times seen); 0 = off",
    )
    prefix_caching: bool = setting(True, "reuse KV pages of prompt prefixes already computed")
    max_queue: int = setting(512, "most sequences waiting for admission; beyond it requests get 503 at once")
    invocation_timeout: float | None = setting(
        120.0, "seconds one model invocation may take before its flight fails and its fiber is replaced"
    )
    fault_rate: float = setting(
        0.0,
        "fraction of model invocations that fail on purpose (testing only; POST /debug/faults retunes it: rate, "
        "hang_seconds, point 'start' or 'layers')",
    )
    max_n: int = setting(16, "largest n (completions per prompt) a request may ask for")
    lora_modules: tuple[str, ...] = setting(
        (),
        "LoRA adapters served from the start, each NAME=PATH (a PEFT directory or a GGUF adapter) or vLLM's JSON "
        '{"name": ..., "path": ...}; a request selects one by naming it as its model (SGLang: lora_path)',
    )
    max_loras: int = setting(8, "most LoRA adapters loaded at once (--lora-modules and POST /v1/load_lora_adapter)")
    max_lora_rank: int = setting(64, "highest LoRA rank an adapter may have")
    check_integrity: bool = setting(
        False,
        "check the engine's invariants (pages, references, queues, fibers: LlmService.check_integrity) each time "
        "it goes idle; a broken one is logged and fails every later request",
    )
    seed: int = setting(
        0, "seeds the sampling seeds drawn for requests that give none (same server, same requests: same tokens)"
    )
    progress: bool = setting(True, "show progress bars while fetching and loading")
    mlock: bool = setting(
        False,
        "keep the model's weights in RAM (mlock, as llama.cpp's --mlock): memory pressure pages none of them out; "
        "a start that the locked-memory limit (ulimit -l) refuses stops, naming it",
    )


@dataclass
class ServerConfig:
    """The HTTP server around one engine; each field's help is its flag's help, as in :class:`EngineConfig`."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(8000, "port to listen on")
    served_model_name: str | None = setting(None, "model name clients see (default: the model file's name)")
    api_key: str | None = setting(
        None, "require Authorization: Bearer <key> on every path but --open-paths ($FIBERSERVE_API_KEY)"
    )
    open_paths: tuple[str, ...] = setting(("/health", "/metrics"), "paths that need no API key")
    max_body_bytes: int = setting(1 << 20, "largest request body accepted")
    cors_origins: tuple[str, ...] = setting((), "origins allowed by CORS (off when empty)")
    webui: bool = setting(True, "serve the built-in chat page at / (its requests carry the --api-key its user types)")
    tool_call_parser: str = setting(
        "none",
        "how tool_choice 'auto' reads the model's calls: hermes (<tool_call> JSON blocks: Qwen2.5, Qwen3, Hermes), "
        "llama3_json (JSON calls after <|python_tag|> or alone: Llama 3.x), mistral ([TOOL_CALLS]), pythonic "
        "([f(a=1), ...]: Llama 4, Gemma 3), functiongemma (<start_function_call>: FunctionGemma), auto (the one "
        "the model's chat template writes calls in, where it shows one) or none (auto is refused)",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str = setting(
        "none",
        "split a chat answer's thinking into reasoning_content: deepseek_r1 (answers begin inside <think>...</think>,"
        " as DeepSeek-R1 and Qwen3's thinking models write them), qwen3 (answers that open with <think>) or none",
        choices=REASONING_PARSERS,
    )
    pooling: str = setting(
        "auto",
        "how /v1/embeddings pools the prompt's final hidden states: last (the last token's), mean (every token's) "
        "or auto (the file's pooling_type where it names one of these, else last)",
        choices=POOLING_SETTINGS,
    )
    shutdown_timeout: float = setting(30.0, "seconds SIGTERM lets in-flight requests finish before aborting them")
    log_level: str = setting("info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"))
    # Exiting is what vLLM, SGLang and llama-server do, and what process managers expect.
    stay_up_on_load_failure: bool = setting(
        False,
        "when the model fails to load, stay up answering 503 with the error (/health: failed) instead of "
        "exiting with status 1",
    )
    replicas: int = setting(
        0, "replicas on Ray Serve behind this endpoint, each a whole engine (fiberserve[ray]); 0 = one process"
    )
    ray_address: str | None = setting(
        None, "the Ray cluster to join (auto, or HOST:PORT of its head); default: start a local one"
    )
    prefix_routing: bool = setting(
        True,
        "send a prompt to the replica that served its prefix while load is balanced (Ray Serve; else its "
        "power-of-two-choices router)",
    )
    min_replicas: int = setting(1, "autoscaling (with --max-replicas): the fewest replicas")
    max_replicas: int | None = setting(
        None, "autoscale between --min-replicas and this many replicas on requests in progress (--replicas: the start)"
    )
    target_ongoing_requests: float = setting(16.0, "autoscaling: requests in progress per replica it aims at")
    autoscale_delay_s: float = setting(
        30.0, "autoscaling: seconds the load must call for more (or fewer) replicas before it acts"
    )

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"--replicas must be >= 0, not {self.replicas}")
        if self.min_replicas < 1:
            raise ValueError(f"--min-replicas must be >= 1, not {self.min_replicas}")
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"--max-replicas ({self.max_replicas}) must be >= --min-replicas ({self.min_replicas})")
        if self.target_ongoing_requests <= 0 or self.autoscale_delay_s <= 0:
            raise ValueError("--target-ongoing-requests and --autoscale-delay-s must be positive")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            choices = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(f"tool_call_parser must be one of {choices}, not {self.tool_call_parser!r}")
        if self.pooling not in POOLING_SETTINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_SETTINGS)}, not {self.pooling!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            choices = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {choices}, not {self.reasoning_parser!r}")
