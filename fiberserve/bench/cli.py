"""``fiberserve bench run`` (load one server), ``compare`` (fiberserve against its peers), ``peak`` (the CPU bound),
``model`` (write a random-weight model of a real model's shape)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

import httpx

from fiberserve.bench.loadgen import LoadResult, LoadSpec, median_run, plot, run_load, summarize
from fiberserve.bench.peak import (
    LACKING,
    bound_tokens_per_s,
    linear_flops,
    measure_peaks,
    memory_bound_tokens_per_s,
    weight_bytes_per_token,
)
from fiberserve.bench.random_model import FORMATS, SHAPES
from fiberserve.bench.report import merged, model_section, render
from fiberserve.config import KV_CACHE_DTYPES, default_cache_dir
from fiberserve.model.config import read_config

#: Prompt seeds of the warm-up and the streamed run; the levels use 1, 2, 3, ... (see ``_levels``).
WARMUP_SEED, STREAM_SEED = 100, 200
#: Added to every seed per round of ``compare --rounds``, so no round repeats another's prompts.
ROUND_SEEDS = 1000
#: Output tokens of the forced workload; the chat workload's limit (its answers end on their own before it), and
#: its sampling temperature.
FORCED_OUTPUT_LEN, CHAT_MAX_TOKENS, CHAT_TEMPERATURE = 64, 256, 0.7
#: The fiberserve servers with ``--quantization int4`` (llama.cpp's arithmetic, the like-for-like llama-server peer)
#: and ``none`` (bf16, vLLM's arithmetic).
INT4_LABEL, BF16_LABEL = "fiberserve int4", "fiberserve bf16"


def _levels(spec: LoadSpec, concurrency: list[int], rates: list[float], requests_per_client: int) -> list[LoadSpec]:
    """One spec per level, each with prompts of its own.

    Reusing one level's prompts in the next would measure prompt caches rather than
    prefill (llama-server keeps each slot's last prompt; vLLM and fiberserve keep
    prefix pages), so every level draws its prompts from a different seed.
    """
    specs = [replace(spec, concurrency=c, requests=max(spec.requests, c * requests_per_client)) for c in concurrency]
    specs += [replace(spec, rate=r, concurrency=1) for r in rates]
    return [replace(s, seed=spec.seed + 1 + i) for i, s in enumerate(specs)]


def _warm_up(spec: LoadSpec) -> None:
    """A few requests first, so no level pays a server's first-request costs."""
    asyncio.run(run_load(replace(spec, requests=4, concurrency=2, seed=WARMUP_SEED)))


def _run_levels(specs: list[LoadSpec], label: str) -> list[LoadResult]:
    results = []
    for spec in specs:
        result = asyncio.run(run_load(spec))
        print(
            f"{label}: C={spec.concurrency} rate={spec.rate} -> {result.output_tokens_per_s:.1f} tok/s, "
            f"{result.errors} errors",
            file=sys.stderr,
        )
        results.append(result)
    return results


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def workload_spec(workload: str, **given) -> LoadSpec:
    """A load of ``workload`` ("forced" or "chat") with its defaults, overridden by the non-None ``given``."""
    if workload == "chat":
        defaults = {"output_len": CHAT_MAX_TOKENS, "temperature": CHAT_TEMPERATURE, "ignore_eos": False, "stream": True}
    else:
        defaults = {"output_len": FORCED_OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True}
    return LoadSpec(workload=workload, **{**defaults, **{k: v for k, v in given.items() if v is not None}})


def cmd_run(args: argparse.Namespace) -> int:
    spec = workload_spec(
        args.workload,
        url=args.url,
        api=args.api,
        model=args.model[0] if args.model and len(args.model) == 1 else None,
        models=tuple(args.model) if args.model and len(args.model) > 1 else (),
        requests=args.requests,
        duration_s=args.duration,
        prompt_words=args.prompt_words,
        output_len=args.output_len,
        temperature=args.temperature,
        ignore_eos=False if args.natural_length else None,
        stream=args.stream or None,
        fresh_connections=args.fresh_connections,
        seeded=args.seeds,
    )
    results = _run_levels(_levels(spec, args.concurrency, args.rate, args.requests_per_client), args.url)
    table = summarize(results)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plot:
        plot({args.url: results}, args.plot)
    return 0


def cmd_peak(args: argparse.Namespace) -> int:
    from fiberserve.model.assets import default_model_path

    model = args.model or default_model_path(args.cache_dir)
    peaks = measure_peaks(build_dir=Path(args.cache_dir) / "build")
    config = read_config(model)
    flops, weight_bytes = linear_flops(config), weight_bytes_per_token(model, config)
    print(peaks.describe())
    print(f"GFLOP per generated token {flops.generated / 1e9:.3f}, per prompt token {flops.prompt / 1e9:.3f}")
    for kind in ("bf16", "amx_bf16", "int8", "q4_1", "fp32"):
        peak = getattr(peaks, kind)
        bound = f"{bound_tokens_per_s(peak, flops):.0f} tokens/s" if peak else LACKING
        print(f"decode-only bound at the {kind} peak: {bound}")
    name, peak = peaks.vector
    print(f"decode-only bound at the vector peak ({name}): {bound_tokens_per_s(peak, flops):.0f} tokens/s")
    print(f"memory read bandwidth: {peaks.read_bytes / 1e9:.1f} GB/s ({peaks.threads} threads)")
    print(f"weight bytes read per generated token: {weight_bytes / 1e6:.1f} MB")
    memory_bound = memory_bound_tokens_per_s(peaks.read_bytes, weight_bytes)
    print(f"memory-bound decode bound (one sequence): {memory_bound:.1f} tokens/s")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from fiberserve.bench.random_model import write_random_model
    from fiberserve.model.assets import default_model_path

    output = Path(args.output or f"{args.shape}-{args.format}.gguf")
    write_random_model(output, SHAPES[args.shape], args.format, default_model_path(args.cache_dir), seed=args.seed)
    print(f"wrote {output} ({output.stat().st_size / 1e6:.0f} MB)")
    return 0


def cmd_kv_accuracy(args: argparse.Namespace) -> int:
    from fiberserve.bench.kv_accuracy import accuracy_table, kv_cache_accuracy, stdlib_text
    from fiberserve.config import EngineConfig
    from fiberserve.engine.service import LlmService

    service = LlmService.load(EngineConfig(model=args.model, cache_dir=args.cache_dir, kv_cache_mb=16))
    tokens = service.tokenizer.encode(stdlib_text())
    results = kv_cache_accuracy(service.model, tokens, args.context, args.formats)
    table = accuracy_table(service.model_name, results)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


def cmd_depth(args: argparse.Namespace) -> int:
    from fiberserve.bench.depth import depth_run, depth_table
    from fiberserve.bench.report import machine
    from fiberserve.config import EngineConfig
    from fiberserve.engine.service import LlmService

    service = LlmService.load(EngineConfig(model=args.model, cache_dir=args.cache_dir, kv_cache_mb=16))
    results = []
    for batch in args.batch:
        for name in args.formats:
            results.append(depth_run(service.model, name, args.depth, batch, args.steps))
            print(depth_table(service.model_name, machine(), results[-1:]).splitlines()[-1], flush=True)
    table = depth_table(service.model_name, machine(), results)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from fiberserve.bench import peers as P
    from fiberserve.model.assets import default_model_path

    cache = Path(args.cache_dir)
    peers_dir = cache / "peers"
    gguf = args.model or str(default_model_path(cache))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    peaks = measure_peaks(build_dir=cache / "build")  # first, while the machine is idle
    print(peaks.describe(), file=sys.stderr)
    config = read_config(gguf)
    flops, weight_bytes = linear_flops(config), weight_bytes_per_token(gguf, config)
    base = LoadSpec(
        url="", requests=args.requests, duration_s=args.duration, prompt_words=40, output_len=FORCED_OUTPUT_LEN
    )
    top = max(args.concurrency)
    flags = ["--max-running", str(top), *args.fiberserve_args]
    # The defaults, then each arithmetic by name (bf16 computes what vLLM does; int4 what llama-server does, Q4_1 x
    # Q8_1); the one the defaults run is dropped once the first server says which it is.
    servers = [
        P.fiberserve_server(args.port, args.model, flags),
        P.fiberserve_server(args.port, args.model, [*flags, "--quantization", "none"], label=BF16_LABEL),
        P.fiberserve_server(args.port, args.model, [*flags, "--quantization", "int4"], label=INT4_LABEL),
    ]
    if not args.bf16:
        servers = [s for s in servers if s.name != BF16_LABEL]
    missing = []
    llama = P.llama_server(args.port + 1, gguf, peers_dir, slots=top)
    if llama:
        servers.append(llama)
    else:
        missing.append("llama-server (run scripts/peers/build_llama_server.sh)")
    vllm_python = peers_dir / "vllm-venv" / "bin" / "python"
    if args.vllm and vllm_python.exists():
        hf_dir = P.write_hf_directory(gguf, cache / ("smollm2-hf" if args.model is None else f"{Path(gguf).stem}-hf"))
        vllm = P.vllm_server(args.port + 2, str(hf_dir), peers_dir, max_seqs=top)
        assert vllm is not None, "the vLLM venv exists"
        servers.append(vllm)
    elif args.vllm:
        missing.append("vLLM (run scripts/peers/install_vllm.sh)")
    # Round after round, each server in turn: a slow spell of this VM lands on every server's figures
    # alike rather than on one server's, and each figure is the median round.
    rounds: dict[str, list[list[LoadResult]]] = {}
    chat_rounds: dict[str, list[list[LoadResult]]] = {}
    streams: dict[str, list[LoadResult]] = {}
    for round_index in range(args.rounds):
        seed = round_index * ROUND_SEEDS
        for server in list(servers):
            if server not in servers:  # the defaults' own arithmetic, dropped below
                continue
            server.start(out_dir)
            try:
                if server is servers[0] and round_index == 0:
                    default_mode = httpx.get(server.url + "/get_server_info", timeout=10).json()["quantization"]
                    duplicate = INT4_LABEL if default_mode == "int4" else BF16_LABEL
                    servers = [s for s in servers if s.name != duplicate]
                spec = replace(
                    base, url=server.url, model=server.model, fresh_connections=server.fresh_connections, seed=seed
                )
                _warm_up(spec)
                label = server.name if args.rounds == 1 else f"{server.name} (round {round_index + 1})"
                rounds.setdefault(server.name, []).append(
                    _run_levels(_levels(spec, args.concurrency, [], args.requests_per_client), label)
                )
                stream = replace(
                    spec, concurrency=16, stream=True, requests=16 * args.requests_per_client, seed=STREAM_SEED + seed
                )
                streams.setdefault(server.name, []).append(asyncio.run(run_load(stream)))
                if args.chat:
                    chat = workload_spec(
                        "chat",
                        url=server.url,
                        model=server.model,
                        requests=args.requests,
                        duration_s=args.duration,
                        fresh_connections=server.fresh_connections,
                        seed=seed,
                    )
                    chat_rounds.setdefault(server.name, []).append(
                        _run_levels(_levels(chat, args.concurrency, [], args.requests_per_client), f"{label}, chat")
                    )
            finally:
                server.stop()
    series = {name: [median_run(list(level)) for level in zip(*runs, strict=True)] for name, runs in rounds.items()}
    chat_series = {
        name: [median_run(list(level)) for level in zip(*runs, strict=True)] for name, runs in chat_rounds.items()
    }
    streamed = {name: median_run(runs) for name, runs in streams.items()}
    ablation: dict[str, list[LoadResult]] = {}
    if args.ablation:
        for label, extra in [
            ("fibers 1", ["--fibers", "1"]),
            ("fibers 2", ["--fibers", "2"]),
            ("fibers 4", ["--fibers", "4"]),
            ("float32", ["--dtype", "float32"]),
            # speculative decoding is on by default; the workload's forced outputs repeat, which drafts well
            ("no speculation", ["--speculative-tokens", "0"]),
            ("int4, no speculation", ["--quantization", "int4", "--speculative-tokens", "0"]),
        ]:
            server = P.fiberserve_server(
                args.port,
                args.model,
                ["--max-running", str(top), *args.fiberserve_args, *extra],
                label=f"fiberserve {label}",
            )
            server.start(out_dir)
            try:
                spec = replace(base, url=server.url)
                _warm_up(spec)
                ablation[label] = _run_levels(
                    _levels(spec, args.concurrency, [], args.requests_per_client), server.name
                )
            finally:
                server.stop()
    plot_path = out_dir / ("benchmarks.png" if args.model is None else f"benchmarks-{Path(gguf).stem}.png")
    plot(series, str(plot_path))
    command = " ".join(["fiberserve", "bench", *map(shlex.quote, args.argv)])
    per_round = {name: [[r.output_tokens_per_s for r in run] for run in runs] for name, runs in rounds.items()}
    shown_plot = os.path.relpath(plot_path.resolve(), Path(args.output).resolve().parent)  # as the report links it
    text = render(
        command,
        args.concurrency,
        series,
        streamed,
        ablation,
        servers,
        missing,
        peaks,
        flops,
        per_round,
        plot=shown_plot,
        chat=chat_series,
        weight_bytes=weight_bytes,
    )
    output = Path(args.output)
    existing = output.read_text() if output.exists() else ""
    if args.model is None:
        output.write_text(merged(existing, main=text))
    else:  # a section of its own, beside the embedded model's report
        title = f"{Path(gguf).name} ({Path(gguf).stat().st_size / 1e6:.0f} MB)"
        output.write_text(merged(existing, section=(Path(gguf).name, model_section(text, Path(gguf).name, title))))
    (out_dir / "results.json").write_text(
        json.dumps(
            {
                **{name: [asdict(r) for r in rs] for name, rs in series.items()},
                **{f"chat {name}": [asdict(r) for r in rs] for name, rs in chat_series.items()},
                **{f"ablation {name}": [asdict(r) for r in rs] for name, rs in ablation.items()},
                **{f"streamed {name}": [asdict(r)] for name, r in streamed.items()},
            },
            indent=2,
        )
    )
    print(text)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fiberserve bench")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="load one server (loopback only)")
    run.add_argument("--url", default="http://127.0.0.1:8000")
    run.add_argument("--api", choices=["openai", "sglang"], default="openai")
    run.add_argument(
        "--model", nargs="+", help="model name to send (OpenAI API); several: the requests take them in turn"
    )
    run.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64], help="closed-loop levels")
    run.add_argument("--rate", type=float, nargs="*", default=[], help="open-loop request rates (req/s)")
    run.add_argument("--requests", type=int, default=32, help="requests per level, at least")
    run.add_argument("--requests-per-client", type=int, default=4, help="closed loop: requests per client")
    run.add_argument("--duration", type=float, default=180.0, help="time limit per level (s)")
    run.add_argument("--prompt-words", type=int, default=40)
    run.add_argument(
        "--workload",
        choices=["forced", "chat"],
        default="forced",
        help="forced: completions of random words, a fixed output length, greedy; chat: streamed chat completions "
        "with a shared system prompt and distinct questions, natural endings, sampled",
    )
    run.add_argument(
        "--output-len", type=int, help=f"forced: {FORCED_OUTPUT_LEN} tokens; chat: the limit, {CHAT_MAX_TOKENS}"
    )
    run.add_argument("--temperature", type=float, help=f"forced: 0; chat: {CHAT_TEMPERATURE}")
    run.add_argument(
        "--seeds", action=argparse.BooleanOptionalAction, default=True, help="chat: a seed of its own per request"
    )
    run.add_argument("--natural-length", action="store_true", help="let EOS end requests (default: forced length)")
    run.add_argument("--stream", action="store_true", help="stream the answers (the chat workload always does)")
    run.add_argument("--fresh-connections", action="store_true", help="a new connection per request")
    run.add_argument("--json")
    run.add_argument("--markdown")
    run.add_argument("--plot")
    compare = sub.add_parser("compare", help="fiberserve and each installed peer, same load, one after another")
    compare.add_argument("--model", help="GGUF file (default: the embedded model)")
    compare.add_argument("--cache-dir", default=str(default_cache_dir()))
    compare.add_argument("--port", type=int, default=18000)
    compare.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64])
    compare.add_argument("--requests", type=int, default=16)
    compare.add_argument("--requests-per-client", type=int, default=3)
    compare.add_argument("--duration", type=float, default=240.0)
    compare.add_argument(
        "--rounds", type=_positive, default=1, help="run every server this many times, in turn; report the median"
    )
    compare.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True)
    compare.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="run the chat workload too (see run)"
    )
    compare.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fiberserve in bf16 too (--quantization none: two bytes a weight, 16 GB for an 8B model)",
    )
    compare.add_argument("--fiberserve-args", default="", help="extra flags for fiberserve serve (one string)")
    compare.add_argument(
        "--vllm", action=argparse.BooleanOptionalAction, default=True, help="vLLM too, where installed"
    )
    compare.add_argument(
        "--output",
        default="BENCHMARKS.md",
        help="the report; with --model, the file's section of it (replaced, or added beside the others)",
    )
    compare.add_argument("--out-dir", default="bench-results")
    accuracy = sub.add_parser(
        "kv-accuracy", help="how far each quantized KV cache moves the logits, teacher-forced over a long text"
    )
    accuracy.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded model)")
    accuracy.add_argument("--context", type=_positive, nargs="+", default=[2048, 8192], help="tokens read")
    accuracy.add_argument("--formats", nargs="+", default=["fp8_e4m3", "q8_0"], choices=KV_CACHE_DTYPES[1:])
    accuracy.add_argument("--cache-dir", default=str(default_cache_dir()))
    accuracy.add_argument("--markdown", help="write the table here too")
    depth = sub.add_parser(
        "depth", help="prefill and decode at a context depth, in process, per KV cache format (llama-batched-bench)"
    )
    depth.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded model)")
    depth.add_argument("--depth", type=_positive, default=4096, help="prompt tokens of each sequence")
    depth.add_argument("--batch", type=_positive, nargs="+", default=[1, 16], help="sequences decoding at once")
    depth.add_argument("--steps", type=_positive, default=32, help="decode steps measured")
    depth.add_argument("--formats", nargs="+", default=["auto", "q8_0", "fp8_e4m3"], choices=KV_CACHE_DTYPES)
    depth.add_argument("--cache-dir", default=str(default_cache_dir()))
    depth.add_argument("--markdown", help="write the table here too")
    peak = sub.add_parser("peak", help="the CPU's dot-product peak and the compute bound it sets for a model")
    peak.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded model)")
    peak.add_argument("--cache-dir", default=str(default_cache_dir()))
    model = sub.add_parser(
        "model", help="write a random-weight GGUF of a real model's shape (the embedded model's tokenizer)"
    )
    model.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    model.add_argument("--format", choices=FORMATS, default="Q4_K_M", help="a block format, or a llama.cpp mix")
    model.add_argument("--output", "-o", help="the file to write (default: SHAPE-FORMAT.gguf)")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--cache-dir", default=str(default_cache_dir()))
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command == "model":
        return cmd_model(args)
    if args.command == "run":
        return cmd_run(args)
    if args.command == "peak":
        return cmd_peak(args)
    if args.command == "kv-accuracy":
        return cmd_kv_accuracy(args)
    if args.command == "depth":
        return cmd_depth(args)
    args.fiberserve_args = shlex.split(args.fiberserve_args)
    return cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
