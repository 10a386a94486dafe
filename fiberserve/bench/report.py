"""BENCHMARKS.md, rendered from the results of ``fiberserve bench compare``."""

from __future__ import annotations

import os
import platform
import re
import time
from pathlib import Path

from fiberserve.bench.loadgen import LoadResult, summarize
from fiberserve.bench.peak import Peaks, TokenFlops, bound_tokens_per_s, memory_bound_tokens_per_s
from fiberserve.bench.peers import PeerServer

#: The matrix-product instructions a figure depends on, by their /proc/cpuinfo flag.
CPU_FEATURES = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "avx512_vnni": "VNNI",
    "amx_bf16": "AMX",
}


#: AMD's core generations by CPU family (the model name of a cloud VM's CPU is often just "AMD EPYC").
AMD_FAMILIES = {"23": "Zen 1 or 2: ", "25": "Zen 3 or 4: ", "26": "Zen 5: "}


def machine() -> str:
    """The CPU (its name, family and model, and the product instructions it has), its core count, Python and
    the OS, in one line."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lines[:40])}
        flags = set(info.get("flags", "").split())
        features = ", ".join(name for flag, name in CPU_FEATURES.items() if flag in flags) or "no AVX2"
        family = info.get("cpu family", "")
        core = AMD_FAMILIES.get(family, "") if info.get("vendor_id") == "AuthenticAMD" else ""
        cpu = f"{info['model name']} ({core}family {family}, model {info.get('model')}; {features})"
    except (OSError, KeyError):
        cpu = platform.processor()
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.platform()}"


def _ratio_row(label: str, ours: list[LoadResult], theirs: list[LoadResult]) -> str:
    """A markdown table row of output-throughput ratios, level by level ("-" where either side had errors: its
    throughput is not that of the load asked for)."""
    cells = [
        f"{a.output_tokens_per_s / b.output_tokens_per_s:.2f}x"
        if b.output_tokens_per_s and not a.errors + b.errors
        else "-"
        for a, b in zip(ours, theirs, strict=True)
    ]
    return f"| {label} | " + " | ".join(cells) + " |"


def _throughput(r: LoadResult) -> str:
    return f"{r.output_tokens_per_s:.1f}" + (f" ({r.errors} errors)" if r.errors else "")


def _table(levels: list[int], series: dict[str, list[LoadResult]]) -> list[str]:
    """Output tokens/s by server and level, then each fiberserve row's ratio to each peer."""
    lines = ["| server | " + " | ".join(f"C={c}" for c in levels) + " |", "| --- |" + " --- |" * len(levels)]
    for name, results in series.items():
        lines.append(f"| {name} | " + " | ".join(_throughput(r) for r in results) + " |")
    ours = [name for name in series if name.startswith("fiberserve")]
    for name in ours:
        for peer in (n for n in series if n not in ours):
            lines.append(_ratio_row(f"ratio {name} / {peer}", series[name], series[peer]))
    return lines


def _memory_bound(series: dict[str, list[LoadResult]], peaks: Peaks, weight_bytes: float) -> list[str]:
    """The memory-bound decode bound of one sequence, and each fiberserve C=1 row as a share of it."""
    bound = memory_bound_tokens_per_s(peaks.read_bytes, weight_bytes)
    shares = [
        f"{name} {r.output_tokens_per_s / bound:.0%}"
        for name, results in series.items()
        if name.startswith("fiberserve")
        for r in results
        if r.spec["concurrency"] == 1
    ]
    return [
        f"Memory-bound decode bound (one sequence reads every weight once per token): memory read "
        f"{peaks.read_bytes / 1e9:.1f} GB/s / {weight_bytes / 1e6:.0f} MB of weights per token = {bound:.1f} "
        "tokens/s" + (f"; C=1 reached {', '.join(shares)} of it." if shares else "."),
        "",
    ]


def _bound_section(
    series: dict[str, list[LoadResult]], peaks: Peaks, flops: TokenFlops, weight_bytes: float = 0.0
) -> list[str]:
    """How close each fiberserve row came to the machine's compute bound, at each level, and (where
    ``weight_bytes`` and the read bandwidth are known) its C=1 rows to the memory-bound decode bound."""
    giga = 1e9
    vector, vector_peak = peaks.vector
    lines = [
        "## Compute bound",
        "",
        f"Dot-product peak measured by `fiberserve bench peak` before the servers ran: {peaks.describe()}.",
        f"Linear-layer work per generated token {flops.generated / giga:.3f} GFLOP (decoder "
        f"{flops.decoder / giga:.3f} + output head {flops.head / giga:.3f}), per prompt token "
        f"{flops.prompt / giga:.3f} GFLOP; attention and elementwise work not counted.",
        "",
        f"Decode-only bound at the measured bf16 peak: {_bound(peaks.bf16, flops)}; at the AMX bf16 peak: "
        f"{_bound(peaks.amx_bf16, flops)}; at the int8 peak: "
        f"{_bound(peaks.int8, flops)}; at the int8 rate inside Q4_1 blocks (the int4 row's arithmetic): "
        f"{_bound(peaks.q4_1, flops)}; at the fp32 peak: {_bound(peaks.fp32, flops)}.  Rows below: the output "
        f"tokens/s, that as a share of the decode bound at the vector peak ({vector}: bf16 where the CPU has it, "
        "else fp32), and the linear-layer rate the run sustained (generated and prompt tokens) as a share of each "
        "peak.",
        "",
        *(_memory_bound(series, peaks, weight_bytes) if weight_bytes and peaks.read_bytes else []),
        f"| server | C | out tok/s | prompt tok / out tok | of {vector} bound | linear GOP/s | of bf16 peak "
        "| of AMX bf16 peak | of int8 peak | of Q4_1 rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, results in series.items():
        if not name.startswith("fiberserve"):
            continue
        for r in results:
            rate = (r.output_tokens * flops.generated + r.prompt_tokens * flops.prompt) / r.wall_s
            lines.append(
                f"| {name} | {r.spec['concurrency']} | {r.output_tokens_per_s:.1f} | "
                f"{r.prompt_tokens / max(r.output_tokens, 1):.2f} | "
                f"{_share(r.output_tokens_per_s, bound_tokens_per_s(vector_peak, flops))} | "
                f"{rate / giga:.0f} | {_share(rate, peaks.bf16)} | {_share(rate, peaks.amx_bf16)} | "
                f"{_share(rate, peaks.int8)} | "
                f"{_share(rate, peaks.q4_1)} |"
            )
    return [*lines, ""]


def _bound(peak: float, flops: TokenFlops) -> str:
    return f"{bound_tokens_per_s(peak, flops):.0f} tokens/s" if peak else "none (the CPU lacks the instruction)"


def _share(rate: float, peak: float) -> str:
    """``rate`` as a percentage of ``peak``; "-" where the CPU lacks the instruction (peak 0)."""
    return f"{rate / peak:.0%}" if peak else "-"


def render(
    command: str,
    levels: list[int],
    series: dict[str, list[LoadResult]],
    streamed: dict[str, LoadResult],
    ablation: dict[str, list[LoadResult]],
    servers: list[PeerServer],
    missing: list[str],
    peaks: Peaks,
    flops: TokenFlops,
    rounds: dict[str, list[list[float]]] | None = None,
    plot: str = "bench-results/benchmarks.png",
    chat: dict[str, list[LoadResult]] | None = None,
    weight_bytes: float = 0.0,
) -> str:
    """BENCHMARKS.md: the chat workload's table and ratios (where it ran), then the forced workload's table and
    ratios, the compute bound, latencies, streaming and the ablation: figures only (what they mean is in
    ``docs/performance.md``).

    ``rounds``: every round's output tokens/s per server and level (``compare --rounds``), where ``series``
    and ``streamed`` hold each level's median round; with more than one round they get a table of their own.
    ``weight_bytes``: the weights one decode step reads (:func:`.weight_bytes_per_token`), for the memory bound."""
    names = list(series)
    count = max((len(runs) for runs in (rounds or {}).values()), default=1)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M %Z')}.",
        "",
        f"Machine: {machine()}.",
        "",
        "Servers: " + "; ".join(f"{s.name} ({s.version})" for s in servers) + ".",
        "",
    ]
    if missing:
        lines += ["Not measured (not installed): " + "; ".join(missing) + ".", ""]
    if chat:
        lines += [
            "## Chat traffic: output tokens/s",
            "",
            "Streamed chat completions, a shared system prompt and distinct questions, answers ending on their own "
            "(at most 256 tokens), temperature 0.7, a seed per request; closed loop (`fiberserve bench run "
            "--workload chat`).",
            "",
            *_table(levels, chat),
            "",
            "### Latency (chat), per server",
            "",
        ]
        for name, results in chat.items():
            lines += [f"#### {name}", "", summarize(results), ""]
    lines += [
        "## Forced workload: output tokens/s",
        "",
        "40-word prompts, 64 output tokens forced (ignore_eos), temperature 0, non-streaming, closed loop; output "
        "tokens/s over the whole run.",
        "",
    ]
    if count > 1:
        lines += [
            f"Each figure is the median of {count} rounds (every server ran once per round, in turn; the ratios "
            "and the sections below use the median round of each level); all rounds are under Rounds.",
            "",
        ]
    lines += [*_table(levels, series), "", *_bound_section(series, peaks, flops, weight_bytes)]
    lines += ["## Latency (non-streaming), per server", ""]
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
    if count > 1:
        lines += ["", "## Rounds", "", "Output tokens/s of every round, in order.", ""]
        lines += ["| server | " + " | ".join(f"C={c}" for c in levels) + " |", "| --- |" + " --- |" * len(levels)]
        for name, runs in (rounds or {}).items():
            cells = [" / ".join(f"{run[i]:.1f}" for run in runs) for i in range(len(levels))]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"![throughput and latency]({plot})", ""]
    return "\n".join(lines)


#: The lines that open and close a model's section of BENCHMARKS.md (``compare --model F``), by the file's name.
_SECTION_OPEN = "<!-- bench compare --model {key}: begin -->"
_SECTION_CLOSE = "<!-- bench compare --model {key}: end -->"
_SECTION = re.compile(
    r"<!-- bench compare --model (?P<key>.+?): begin -->\n.*?<!-- bench compare --model (?P=key): end -->\n", re.S
)


def model_section(report: str, key: str, title: str) -> str:
    """A report of :func:`render` for a file other than the embedded model as a section of BENCHMARKS.md: its
    title ``title``, every heading one level down, between the lines that mark it as ``key``'s."""
    body = report.split("\n", 1)[1]  # "# Benchmarks"
    demoted = re.sub(r"^(#+) ", r"#\1 ", body, flags=re.M)
    return f"{_SECTION_OPEN.format(key=key)}\n## {title}\n{demoted.rstrip()}\n\n{_SECTION_CLOSE.format(key=key)}\n"


def merged(existing: str, main: str | None = None, section: tuple[str, str] | None = None) -> str:
    """BENCHMARKS.md from its ``existing`` text: the embedded model's report replaced by ``main`` where given, a
    model's section (key, text of :func:`model_section`) replaced or added where given; other sections kept."""
    sections = {m["key"]: m[0] for m in _SECTION.finditer(existing)}
    head = main if main is not None else _SECTION.sub("", existing).rstrip() + "\n"
    if section is not None:
        sections[section[0]] = section[1]
    return head.rstrip() + "\n" + "".join("\n" + text for text in sections.values())
