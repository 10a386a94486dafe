"""The benchmark issue's targets, checked against a compare run's own figures (same machine, same run).

Each target compares a fiberserve row with a peer's (or with the compute bound the issue quotes) at one
concurrency level.  A target whose peer or level the run did not measure reads "not measured", never "met".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fiberserve.bench.loadgen import LoadResult

#: Issue 7's compute bound: ~0.27 GFLOP per token at the "~550-800 GFLOP/s" it quotes for bf16 products.
NOMINAL_BOUND = 2000.0
LLAMA_SERVER, VLLM = "llama-server", "vLLM"


@dataclass(frozen=True)
class Target:
    label: str
    #: (our result, the peer's) -> (the figure shown, whether it meets the target); None when not measured.
    check: Callable[[LoadResult, LoadResult | None], tuple[str, bool]]
    concurrency: int
    peer: str | None  # None: against NOMINAL_BOUND
    streamed: bool = False


def _at_least(ratio: float) -> Callable[[LoadResult, LoadResult | None], tuple[str, bool]]:
    def check(ours: LoadResult, theirs: LoadResult | None) -> tuple[str, bool]:
        x = ours.output_tokens_per_s / theirs.output_tokens_per_s
        return f"{x:.2f}x", x >= ratio

    return check


def _bound_share(ours: LoadResult, _: LoadResult | None) -> tuple[str, bool]:
    share = ours.output_tokens_per_s / NOMINAL_BOUND
    return f"{share:.0%}", share >= 0.6


def _ttft_no_worse(ours: LoadResult, theirs: LoadResult | None) -> tuple[str, bool]:
    return f"{ours.ttft_p50_ms:.0f} vs {theirs.ttft_p50_ms:.0f} ms", ours.ttft_p50_ms <= theirs.ttft_p50_ms


TARGETS = [
    Target("C=1 >= llama-server", _at_least(1.0), 1, LLAMA_SERVER),
    Target("C=16 >= 1.3x vLLM", _at_least(1.3), 16, VLLM),
    Target("C=64 >= 1.3x vLLM", _at_least(1.3), 64, VLLM),
    Target(f"C=64 >= 60% of {NOMINAL_BOUND:.0f} tok/s", _bound_share, 64, None),
    Target("streamed TTFT p50 at C=16 <= llama-server's", _ttft_no_worse, 16, LLAMA_SERVER, streamed=True),
]


def _level(results: list[LoadResult], concurrency: int) -> LoadResult | None:
    return next((r for r in results if r.spec.get("concurrency") == concurrency), None)


def evaluate(target: Target, ours: str, series: dict[str, list[LoadResult]], streamed: dict[str, LoadResult]) -> str:
    """One cell: "<figure>: met", "<figure>: **missed**", or "not measured"."""
    if target.streamed:
        mine, theirs = streamed.get(ours), streamed.get(target.peer)
        if mine is None or theirs is None or mine.ttft_p50_ms is None or theirs.ttft_p50_ms is None:
            return "not measured"
    else:
        mine = _level(series.get(ours, []), target.concurrency)
        theirs = None if target.peer is None else _level(series.get(target.peer, []), target.concurrency)
        if mine is None or (target.peer is not None and (theirs is None or not theirs.output_tokens_per_s)):
            return "not measured"
    figure, met = target.check(mine, theirs)
    return f"{figure}: {'met' if met else '**missed**'}"


def targets_section(series: dict[str, list[LoadResult]], streamed: dict[str, LoadResult]) -> list[str]:
    """A markdown section: every target, for every fiberserve row of the run."""
    ours = [name for name in series if name.startswith("fiberserve")]
    lines = [
        "## Targets of the benchmark issue, from this run",
        "",
        "Computed from the tables of this report (ratios in the same run; the bound is the issue's).",
        "",
        "| target | " + " | ".join(ours) + " |",
        "| --- |" + " --- |" * len(ours),
    ]
    for target in TARGETS:
        lines.append(f"| {target.label} | " + " | ".join(evaluate(target, o, series, streamed) for o in ours) + " |")
    return [*lines, ""]
