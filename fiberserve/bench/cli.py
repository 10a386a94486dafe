"""``fiberserve bench run`` (load one server) and ``fiberserve bench compare`` (fiberserve against its peers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from fiberserve.bench.loadgen import LoadResult, LoadSpec, plot, run_load, summarize
from fiberserve.bench.peak import Peaks, TokenFlops, bound_tokens_per_s, linear_flops, measure_peaks
from fiberserve.config import default_cache_dir
from fiberserve.model.loader import read_config

#: Prompt seeds of the warm-up and the streamed run; the levels use 1, 2, 3, ... (see ``_levels``).
WARMUP_SEED, STREAM_SEED = 100, 200
#: The fiberserve server with ``--quantization int4``: llama.cpp's arithmetic, the like-for-like llama-server peer.
INT4_LABEL = "fiberserve int4"
#: Issue 7's compute bound: ~0.27 GFLOP per token at the "~550-800 GFLOP/s" it quotes for bf16 products here.
NOMINAL_BOUND = 2000.0


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


def cmd_run(args: argparse.Namespace) -> int:
    spec = LoadSpec(
        url=args.url,
        api=args.api,
        model=args.model,
        requests=args.requests,
        duration_s=args.duration,
        prompt_words=args.prompt_words,
        output_len=args.output_len,
        ignore_eos=not args.natural_length,
        stream=args.stream,
        fresh_connections=args.fresh_connections,
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

    peaks = measure_peaks()
    flops = linear_flops(read_config(args.model or default_model_path(args.cache_dir)))
    print(peaks.describe())
    print(f"GFLOP per generated token {flops.generated / 1e9:.3f}, per prompt token {flops.prompt / 1e9:.3f}")
    for kind in ("bf16", "int8"):
        print(f"decode-only bound at the {kind} peak: {bound_tokens_per_s(getattr(peaks, kind), flops):.0f} tokens/s")
    return 0


def _machine() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    import os

    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.platform()}"


def cmd_compare(args: argparse.Namespace) -> int:
    from fiberserve.bench import peers as P
    from fiberserve.model.assets import default_model_path

    cache = Path(args.cache_dir)
    peers_dir = cache / "peers"
    gguf = args.model or str(default_model_path(cache))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    peaks = measure_peaks()  # first, while the machine is idle
    print(peaks.describe(), file=sys.stderr)
    flops = linear_flops(read_config(gguf))
    base = LoadSpec(url="", requests=args.requests, duration_s=args.duration, prompt_words=40, output_len=64)
    top = max(args.concurrency)
    flags = ["--max-running", str(top), *args.fiberserve_args]
    servers = [  # bf16 computes what vLLM does; int4 what llama-server does (Q4_1 x Q8_1)
        P.fiberserve_server(args.port, args.model, flags),
        P.fiberserve_server(args.port, args.model, [*flags, "--quantization", "int4"], label=INT4_LABEL),
    ]
    missing = []
    llama = P.llama_server(args.port + 1, gguf, peers_dir, slots=top)
    (servers.append(llama) if llama else missing.append("llama-server (run scripts/peers/build_llama_server.sh)"))
    vllm_python = peers_dir / "vllm-venv" / "bin" / "python"
    if vllm_python.exists():
        hf_dir = P.write_hf_directory(gguf, cache / "smollm2-hf")
        servers.append(P.vllm_server(args.port + 2, str(hf_dir), peers_dir, max_seqs=top))
    else:
        missing.append("vLLM (run scripts/peers/install_vllm.sh)")
    series: dict[str, list[LoadResult]] = {}
    streamed: dict[str, LoadResult] = {}
    for server in servers:
        server.start(out_dir)
        try:
            spec = replace(base, url=server.url, model=server.model, fresh_connections=server.fresh_connections)
            _warm_up(spec)
            series[server.name] = _run_levels(
                _levels(spec, args.concurrency, [], args.requests_per_client), server.name
            )
            streamed[server.name] = asyncio.run(
                run_load(
                    replace(spec, concurrency=16, stream=True, requests=16 * args.requests_per_client, seed=STREAM_SEED)
                )
            )
        finally:
            server.stop()
    ablation: dict[str, list[LoadResult]] = {}
    if args.ablation:
        for label, extra in [
            ("fibers 1", ["--fibers", "1"]),
            ("fibers 2", ["--fibers", "2"]),
            ("fibers 4", ["--fibers", "4"]),
            ("float32", ["--dtype", "float32"]),
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
    plot(series, str(out_dir / "benchmarks.png"))
    text = _report(args, series, streamed, ablation, servers, missing, _bound_section(series, peaks, flops))
    Path(args.output).write_text(text)
    (out_dir / "results.json").write_text(
        json.dumps(
            {
                name: [asdict(r) for r in rs]
                for name, rs in {**series, **{f"ablation {k}": v for k, v in ablation.items()}}.items()
            },
            indent=2,
        )
    )
    print(text)
    return 0


def _ratio_row(label: str, ours: list[LoadResult], theirs: list[LoadResult]) -> str:
    """A markdown table row of output-throughput ratios, level by level."""
    ratios = [
        a.output_tokens_per_s / b.output_tokens_per_s if b.output_tokens_per_s else float("nan")
        for a, b in zip(ours, theirs, strict=True)
    ]
    return f"| {label} | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |"


def _bound_section(series: dict[str, list[LoadResult]], peaks: Peaks, flops: TokenFlops) -> list[str]:
    """How close each fiberserve row came to the machine's compute bound, at each level."""
    giga = 1e9
    lines = [
        "## Compute bound",
        "",
        f"Dot-product peak measured by `fiberserve bench peak` before the servers ran: {peaks.describe()}.",
        f"Linear-layer work per generated token {flops.generated / giga:.3f} GFLOP (decoder "
        f"{flops.decoder / giga:.3f} + output head {flops.head / giga:.3f}), per prompt token "
        f"{flops.prompt / giga:.3f} GFLOP; attention and elementwise work not counted.",
        "",
        f"Decode-only bound at the measured bf16 peak: {bound_tokens_per_s(peaks.bf16, flops):.0f} tokens/s "
        f"(issue 7 quotes ~{NOMINAL_BOUND:.0f}, from 550-800 GFLOP/s); at the int8 peak: "
        f"{bound_tokens_per_s(peaks.int8, flops):.0f}.  Rows below: the output tokens/s, that as a share of "
        f"{NOMINAL_BOUND:.0f}, and the linear-layer rate the run sustained (generated and prompt tokens) as a "
        "share of each peak.",
        "",
        "| server | C | out tok/s | prompt tok / out tok | of 2000 | linear GOP/s | of bf16 peak | of int8 peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, results in series.items():
        if not name.startswith("fiberserve"):
            continue
        for r in results:
            rate = (r.output_tokens * flops.generated + r.prompt_tokens * flops.prompt) / r.wall_s
            lines.append(
                f"| {name} | {r.spec['concurrency']} | {r.output_tokens_per_s:.1f} | "
                f"{r.prompt_tokens / max(r.output_tokens, 1):.2f} | {r.output_tokens_per_s / NOMINAL_BOUND:.0%} | "
                f"{rate / giga:.0f} | {rate / peaks.bf16:.0%} | {rate / peaks.int8:.0%} |"
            )
    return [*lines, ""]


def _report(args, series, streamed, ablation, servers, missing, bound: list[str]) -> str:
    levels = args.concurrency
    names = list(series)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{' '.join(['fiberserve', 'bench', *map(shlex.quote, args.argv)])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}.",
        "",
        f"Machine: {_machine()}.",
        "",
        "Workload: SmolLM2-135M-Instruct, 40-word prompts, 64 output tokens forced (ignore_eos), temperature 0, "
        "non-streaming, closed loop; output tokens/s over the whole run.",
        "",
        "Servers: " + "; ".join(f"{s.name} ({s.version})" for s in servers) + ".",
        "",
    ]
    if missing:
        lines += ["Not measured (not installed): " + "; ".join(missing) + ".", ""]
    lines += [
        "## Output tokens/s",
        "",
        "| server | " + " | ".join(f"C={c}" for c in levels) + " |",
        "| --- |" + " --- |" * len(levels),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{r.output_tokens_per_s:.1f}" for r in series[name]) + " |")
    ours = [name for name in names if name.startswith("fiberserve")]
    for name in ours:
        for peer in (n for n in names if n not in ours):
            lines.append(_ratio_row(f"ratio {name} / {peer}", series[name], series[peer]))
    lines += ["", *bound, "## Latency (non-streaming), per server", ""]
    for name in names:
        lines += [f"### {name}", "", summarize(series[name]), ""]
    lines += [
        "## Streaming at C=16",
        "",
        "| server | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in streamed.items():
        lines.append(
            f"| {name} | {r.output_tokens_per_s:.1f} | {r.ttft_p50_ms or 0:.0f} | {r.ttft_p99_ms or 0:.0f} | "
            f"{r.tpot_p50_ms or 0:.0f} |"
        )
    if ablation:
        lines += [
            "",
            "## Ablation (fiberserve)",
            "",
            "| setting | " + " | ".join(f"C={r.spec['concurrency']}" for r in next(iter(ablation.values()))) + " |",
            "| --- |" + " --- |" * len(next(iter(ablation.values()))),
        ]
        for label, rs in ablation.items():
            lines.append(f"| {label} | " + " | ".join(f"{r.output_tokens_per_s:.1f}" for r in rs) + " |")
    lines += ["", "![throughput and latency](bench-results/benchmarks.png)", ""]
    notes = Path(args.notes)
    if notes.is_file():  # the hand-written analysis: where the time goes, what misses and why
        lines += [notes.read_text()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fiberserve bench")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="load one server (loopback only)")
    run.add_argument("--url", default="http://127.0.0.1:8000")
    run.add_argument("--api", choices=["openai", "sglang"], default="openai")
    run.add_argument("--model", help="model name to send (OpenAI API)")
    run.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64], help="closed-loop levels")
    run.add_argument("--rate", type=float, nargs="*", default=[], help="open-loop request rates (req/s)")
    run.add_argument("--requests", type=int, default=32, help="requests per level, at least")
    run.add_argument("--requests-per-client", type=int, default=4, help="closed loop: requests per client")
    run.add_argument("--duration", type=float, default=180.0, help="time limit per level (s)")
    run.add_argument("--prompt-words", type=int, default=40)
    run.add_argument("--output-len", type=int, default=64)
    run.add_argument("--natural-length", action="store_true", help="let EOS end requests (default: forced length)")
    run.add_argument("--stream", action="store_true")
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
    compare.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True)
    compare.add_argument("--fiberserve-args", default="", help="extra flags for fiberserve serve (one string)")
    compare.add_argument("--output", default="BENCHMARKS.md")
    compare.add_argument("--out-dir", default="bench-results")
    compare.add_argument("--notes", default="docs/benchmark-analysis.md", help="markdown appended to the report")
    peak = sub.add_parser("peak", help="the CPU's dot-product peak and the compute bound it sets for a model")
    peak.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded model)")
    peak.add_argument("--cache-dir", default=str(default_cache_dir()))
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command == "run":
        return cmd_run(args)
    if args.command == "peak":
        return cmd_peak(args)
    args.fiberserve_args = shlex.split(args.fiberserve_args)
    return cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
