"""One configuration for the engine and one for the server around it, passed down explicitly.

Environment variables are read here and in the CLI only, never deep inside the code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def default_cache_dir() -> Path:
    """``$FIBERSERVE_CACHE``, else ``~/.cache/fiberserve``."""
    env = os.environ.get("FIBERSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fiberserve"


@dataclass
class EngineConfig:
    """Everything the engine needs; the server and the offline ``LLM`` build one of these."""

    #: A GGUF file (known by its content) or a Hugging Face directory; None serves the embedded default model.
    model: str | None = None
    cache_dir: str = field(default_factory=lambda: str(default_cache_dir()))
    device: str = "cpu"
    #: "float32", "bfloat16" or "auto" (bfloat16 where the CPU/GPU computes it natively).
    dtype: str = "auto"
    #: "none"; "int4": llama.cpp's arithmetic on CPU, Q4_1 decoder weights and a Q8_0 output head times int8
    #: activations; or "auto": int4 for a Q4_1 GGUF on a CPU without AMX tiles, else none
    #: (``service.resolve_quantization``).
    quantization: str = "auto"
    #: Fibers in the pool: flights that may run at once.
    fibers: int = 1
    #: Torch threads each fiber's worker uses (None: the machine's cores divided among the fibers).
    threads_per_fiber: int | None = None
    #: Narrow each fiber's thread team to the cores other processes leave free (``runtime/cpu_share.py``), and
    #: widen it back as they free them.
    fit_free_cores: bool = True
    isolation: str = "per_fiber"
    page_size: int = 16
    #: The KV cache in MiB; None: sized for the model (``service.kv_cache_pages``: one sequence of the whole
    #: context, at least 256 MiB, at most a quarter of the memory available at start).
    kv_cache_mb: float | None = None
    #: Overrides kv_cache_mb when set.
    kv_pages: int | None = None
    #: The longest context a request may use, prompt and output together (vLLM's --max-model-len); None: the
    #: model's own context length.  At most the model's.
    max_model_len: int | None = None
    max_running: int = 64
    max_batch_tokens: int = 512
    #: Decode steps a flight of a few plain decodes (``multi_step.MULTI_STEP_MAX_SEQUENCES``) may run before it
    #: lands (vLLM's former ``--num-scheduler-steps``):
    #: each step lands on the host while the next computes, and a new arrival halts the flight after its
    #: current step.  1: every step lands before the next boards.
    decode_steps: int = 8
    #: The longest draft by prompt lookup a decode (greedy or sampled) may carry, in a flight of any size (speculative
    #: decoding, vLLM's "ngram" method): checked in the same forward pass, kept up to the first token the model
    #: did not pick there, so the output is what plain decoding gives (bit for bit where the kernels are batch
    #: invariant: bf16 and int4 on CPU; elsewhere up to the near ties batching itself may flip).  A draft is cut
    #: where one more token would lower the flight's expected tokens per second, from the rate the sequence's
    #: drafts come true and the pass times measured by rows (scheduler policy 5).  0: off.
    #: On by default, unlike vLLM and SGLang: on a CPU a few extra rows cost little next to reading the weights,
    #: and the rule above, with ``speculation.DraftSwitch`` checking it per flight size, drops drafts where they
    #: would not pay.
    speculative_tokens: int = 8
    prefix_caching: bool = True
    #: Requests waiting for admission beyond which new ones are refused (the server answers 503).
    max_queue: int = 512
    #: Seconds one model invocation may take before its fiber is retired and its flight fails.
    invocation_timeout: float | None = 120.0
    #: Fraction of model invocations that fail on purpose (fault injection for tests; 0 in production).
    fault_rate: float = 0.0
    #: Longest n a request may ask for.
    max_n: int = 16
    #: Check the engine's invariants (pages, references, queues, fibers: ``LlmService.check_integrity``) each time
    #: it goes idle; a broken one is logged, and every later request fails with it (for tests and debugging).
    check_integrity: bool = False
    #: Seeds the seeds the engine draws for requests that give none, so that a server started alike and sent the
    #: same requests in the same order samples the same tokens (vLLM's ``--seed``).
    seed: int = 0
    progress: bool = True


#: ``tool_call_parser`` values: how ``tool_choice: "auto"`` reads calls (none: it is refused).
TOOL_CALL_PARSERS = ("none", "hermes")


@dataclass
class ServerConfig:
    """The HTTP server around one engine."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    #: The model name clients see (/v1/models, "model" fields); defaults to the model file's name.
    served_model_name: str | None = None
    #: When set, every path except ``open_paths`` needs ``Authorization: Bearer <key>``.
    api_key: str | None = None
    open_paths: tuple[str, ...] = ("/health", "/metrics")
    max_body_bytes: int = 1 << 20
    #: Origins allowed by CORS; empty: CORS off.
    cors_origins: tuple[str, ...] = ()
    #: How ``tool_choice: "auto"`` reads calls in the model's output: ``none`` (auto is refused) or ``hermes``.
    tool_call_parser: str = "none"
    #: Seconds SIGTERM waits for in-flight requests before aborting them.
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    #: A model that fails to load: exit non-zero with its error (as vLLM, SGLang and llama-server do, and as
    #: process managers expect), or with this set, stay up answering 503 with the error (``/health``: "failed").
    stay_up_on_load_failure: bool = False
    #: Replicas on Ray Serve behind this one endpoint, each a whole engine (``fiberserve[ray]``); 0: one process.
    replicas: int = 0
    #: The Ray cluster to join (``auto``, or ``HOST:PORT`` of its head); None: start a local one.
    ray_address: str | None = None
    #: Route a request to the replica that served its prompt's prefix while load is balanced (Ray Serve's default
    #: power-of-two-choices router otherwise).
    prefix_routing: bool = True
    #: Autoscaling on Ray Serve (with ``max_replicas`` set): between these many replicas, aiming at this many
    #: requests in progress per replica; ``replicas`` is then where it starts.
    min_replicas: int = 1
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    #: Seconds the load must call for more (or fewer) replicas before the autoscaler adds (or removes) one.
    autoscale_delay_s: float = 30.0

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
