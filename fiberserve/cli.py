"""The ``fiberserve`` command line: serve | generate | fetch | bench.

Flags are generated from the config dataclasses, so every engine and server
setting is a flag (``--max-batch-tokens``), a ``--config`` file key
(``max_batch_tokens`` or ``max-batch-tokens``), and a field, with one name.
Flags win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from pathlib import Path

from fiberserve.config import TOOL_CALL_PARSERS, EngineConfig, ServerConfig

HELP = {
    "model": "a GGUF file (any name) or a Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)",
    "cache_dir": "where the default model and converted tokenizers are cached ($FIBERSERVE_CACHE)",
    "device": "cpu, cuda or cuda:N",
    "dtype": "float32, bfloat16, or auto (bfloat16 where the hardware computes it natively)",
    "quantization": (
        "auto, none, or int4: llama.cpp's arithmetic on CPU (Q4_1 decoder weights, Q8_0 output head, int8 "
        "activations per block of 32); auto is int4 for a Q4_1 GGUF (its own blocks) on a CPU without AMX "
        "tiles, where int4 is the faster mode, else none"
    ),
    "fibers": "fibers in the pool = model invocations (flights) that may run at once",
    "threads_per_fiber": "torch threads per fiber (default: CPU cores / fibers)",
    "fit_free_cores": (
        "narrow each fiber's thread team to the cores other processes leave free (a busy neighbour or a second "
        "replica), and widen it back as they free them"
    ),
    "isolation": "program isolation: per_fiber (one instance per fiber), per_call, or none",
    "page_size": "tokens per KV cache page",
    "kv_cache_mb": "KV cache size in MiB (default: one sequence of the whole context, at least 256 MiB, at most a "
    "quarter of the memory available at start)",
    "kv_pages": "KV cache size in pages (overrides --kv-cache-mb)",
    "max_model_len": "longest context (prompt + output) a request may use (default: the model's context length)",
    "max_running": "most sequences running at once",
    "max_batch_tokens": "token budget of one flight (long prompts are prefilled in chunks of this)",
    "decode_steps": (
        "decode steps a batch of a few plain decodes runs before it returns to the scheduler (each step's tokens "
        "still stream at once; a new request ends the run after the current step); 1 = off"
    ),
    "speculative_tokens": (
        "the longest draft a decode carries (speculative decoding by prompt lookup: the tokens that followed "
        "the last earlier occurrence of its last 2-3 tokens; checked in the same pass, so the output is unchanged; "
        "a draft is cut where one more token would lower the expected tokens per second, from how often the "
        "sequence's drafts came true and the pass times seen); 0 = off"
    ),
    "prefix_caching": "reuse KV pages of prompt prefixes already computed",
    "max_queue": "most sequences waiting for admission; beyond it requests get 503 at once",
    "invocation_timeout": "seconds one model invocation may take before its flight fails and its fiber is replaced",
    "fault_rate": (
        "fraction of model invocations that fail on purpose (testing only; POST /debug/faults retunes it: rate, "
        "hang_seconds, point 'start' or 'layers')"
    ),
    "max_n": "largest n (completions per prompt) a request may ask for",
    "seed": "seeds the sampling seeds drawn for requests that give none (same server, same requests: same tokens)",
    "progress": "show progress bars while fetching and loading",
    "host": "address to bind (127.0.0.1 unless told otherwise)",
    "port": "port to listen on",
    "served_model_name": "model name clients see (default: the model file's name)",
    "api_key": "require Authorization: Bearer <key> ($FIBERSERVE_API_KEY)",
    "open_paths": "paths that need no API key",
    "max_body_bytes": "largest request body accepted",
    "cors_origins": "origins allowed by CORS (off when empty)",
    "tool_call_parser": (
        "how tool_choice 'auto' reads the model's calls: none (auto is refused) or hermes (<tool_call> JSON "
        "blocks, as Qwen2.5 and Hermes models write them)"
    ),
    "shutdown_timeout": "seconds SIGTERM lets in-flight requests finish before aborting them",
    "replicas": "replicas on Ray Serve behind this endpoint, each a whole engine (fiberserve[ray]); 0 = one process",
    "ray_address": "the Ray cluster to join (auto, or HOST:PORT of its head); default: start a local one",
    "prefix_routing": "send a prompt to the replica that served its prefix while load is balanced (Ray Serve)",
    "min_replicas": "autoscaling (with --max-replicas): the fewest replicas",
    "max_replicas": "autoscale between --min-replicas and this many replicas on requests in progress",
    "target_ongoing_requests": "autoscaling: requests in progress per replica it aims at",
    "autoscale_delay_s": "autoscaling: seconds the load must call for more (or fewer) replicas before it acts",
    "check_integrity": "check the engine's invariants (pages, references, queues, fibers) each time it goes idle",
    "stay_up_on_load_failure": (
        "when the model fails to load, stay up answering 503 with the error instead of exiting with status 1"
    ),
    "log_level": "debug, info, warning or error",
}


CHOICES = {
    "dtype": ["auto", "float32", "bfloat16"],
    "quantization": ["auto", "none", "int4"],
    "isolation": ["per_fiber", "per_call", "none"],
    "log_level": ["debug", "info", "warning", "error"],
    "tool_call_parser": list(TOOL_CALL_PARSERS),
}
SECRET = {"api_key"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_fields(parser: argparse.ArgumentParser, cls) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if args else hint
        default = f.default if isinstance(f.default_factory, dataclasses._MISSING_TYPE) else f.default_factory()
        shown = "" if f.name in SECRET or default is None else f" (default: {default})"
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS, "help": HELP.get(f.name, "") + shown}
        if f.name in CHOICES:
            kwargs["choices"] = CHOICES[f.name]
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is tuple:
            kwargs["nargs"] = "*"
        else:
            kwargs["type"] = base
        parser.add_argument(_flag(f.name), **kwargs)


def _read_config_file(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of flag names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def _build(cls, values: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    chosen = {}
    for k in names & values.keys():
        v = values[k]
        chosen[k] = tuple(v) if isinstance(v, list) else v
    return cls(**chosen)


def server_config(values: dict) -> ServerConfig:
    """A ServerConfig from flag/file values; environment fallbacks are applied here only."""
    known = {f.name for f in dataclasses.fields(EngineConfig)} | {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = set(values) - known
    if unknown:
        raise SystemExit(f"unknown settings: {', '.join(sorted(unknown))}")
    if "api_key" not in values and os.environ.get("FIBERSERVE_API_KEY"):
        values["api_key"] = os.environ["FIBERSERVE_API_KEY"]
    try:
        config = _build(ServerConfig, values)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    config.engine = _build(EngineConfig, values)
    return config


def _settings(args: argparse.Namespace) -> dict:
    values = _read_config_file(args.config) if getattr(args, "config", None) else {}
    values.update(
        {
            k: v
            for k, v in vars(args).items()
            if k not in ("command", "config", "prompt", "max_new_tokens", "temperature", "chat")
        }
    )
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fiberserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the HTTP APIs")
    serve.add_argument("--config", help="a YAML or JSON file whose keys are these flags; flags win over it")
    _add_fields(serve, EngineConfig)
    _add_fields(serve, ServerConfig)

    gen = sub.add_parser("generate", help="complete one prompt offline and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--config", help="a YAML or JSON file of engine settings")
    _add_fields(gen, EngineConfig)

    fetch = sub.add_parser("fetch", help="download, verify and cache the embedded default model")
    fetch.add_argument("--cache-dir", dest="cache_dir", default=argparse.SUPPRESS, help=HELP["cache_dir"])

    bench = sub.add_parser(
        "bench", help="load generator and peer comparison (see fiberserve bench --help)", add_help=False
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    if args.command == "bench":
        try:
            from fiberserve.bench.cli import main as bench_main
        except ImportError as exc:
            raise SystemExit(f"fiberserve bench needs its extra: pip install 'fiberserve[bench]' ({exc})") from None
        return bench_main(args.rest)
    if args.command == "fetch":
        from fiberserve.model.assets import fetch_default_model

        cache = getattr(args, "cache_dir", None) or str(EngineConfig().cache_dir)
        print(fetch_default_model(cache))
        return 0
    config = server_config(_settings(args))
    if args.command == "serve":
        if config.replicas > 0:
            from fiberserve.cluster.ray_serve import run_cluster

            return run_cluster(config)
        from fiberserve.server import run_server

        return run_server(config)
    from fiberserve import LLM, SamplingParams

    with LLM(config=config.engine) as llm:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate([args.prompt], params)[0]
    print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
