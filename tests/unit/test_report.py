"""BENCHMARKS.md as `fiberserve bench compare` renders it: ratios and the compute-bound shares."""

from __future__ import annotations

from fiberserve.bench.loadgen import LoadResult, median_run
from fiberserve.bench.peak import Peaks, TokenFlops
from fiberserve.bench.peers import PeerServer
from fiberserve.bench.report import render


def result(concurrency: int, tokens_per_s: float, prompt_tokens: int = 0) -> LoadResult:
    """A level that produced ``tokens_per_s`` output tokens/s for 10 s."""
    output = int(tokens_per_s * 10)
    return LoadResult(
        spec={"concurrency": concurrency, "rate": None},
        wall_s=10.0,
        completed=output // 64,
        errors=0,
        output_tokens=output,
        output_tokens_per_s=tokens_per_s,
        prompt_tokens=prompt_tokens,
        requests_per_s=output / 64 / 10,
        ttft_p50_ms=None,
        ttft_p99_ms=None,
        tpot_p50_ms=None,
        tpot_p99_ms=None,
        e2e_p50_ms=100.0,
        e2e_p99_ms=120.0,
    )


def test_report_ratios_and_compute_bound_shares(tmp_path):
    series = {
        "fiberserve": [result(1, 100.0, 500), result(64, 1000.0, 5000)],
        "vLLM": [result(1, 50.0), result(64, 800.0)],
    }
    servers = [PeerServer("fiberserve", [], 1, version="v1"), PeerServer("vLLM", [], 2, version="v2")]
    # 1e9 FLOP per generated token, 0.5e9 per prompt token; peaks 1e12 (bf16), 4e12 (AMX bf16), 2e12 (int8),
    # 1.25e12 (Q4_1)
    peaks = Peaks(threads=2, fp32=5e11, bf16=1e12, int8=2e12, q4_1=1.25e12, amx_bf16=4e12)
    flops = TokenFlops(decoder=0.5e9, head=0.5e9)
    text = render("fiberserve bench compare", [1, 64], series, {}, {}, servers, ["llama-server"], peaks, flops)
    assert "| fiberserve | 100.0 | 1000.0 |" in text and "| ratio fiberserve / vLLM | 2.00x | 1.25x |" in text
    assert "Servers: fiberserve (v1); vLLM (v2)." in text and "Not measured (not installed): llama-server." in text
    assert "Decode-only bound at the measured bf16 peak: 1000 tokens/s" in text
    assert "at the AMX bf16 peak: 4000 tokens/s" in text
    # C=64: 1000 tok/s is 100% of the bf16 bound (1e12 / 1e9);
    # (10000 x 1e9 + 5000 x 0.5e9) / 10 s = 1250 GOP/s: 125% / 31% / 62% / 100%
    assert "| fiberserve | 64 | 1000.0 | 0.50 | 100% | 1250 | 125% | 31% | 62% | 100% |" in text
    assert "of bf16 bound" in text
    assert "int8 in Q4_1 blocks 1250 GOP/s (62% of int8)" in text
    assert "| vLLM | 64 |" not in text  # shares only for our own rows
    assert "## Analysis" not in text and "Targets" not in text  # figures only
    assert "Memory-bound decode bound" not in text  # no weight bytes given: no memory bound
    # 20 GB/s over 500 MB of weights a token: 40 tokens/s, which C=1's 100 tokens/s is 250% of
    read = Peaks(threads=2, fp32=5e11, bf16=1e12, int8=2e12, q4_1=1.25e12, amx_bf16=4e12, read_bytes=20e9)
    text = render("c", [1, 64], series, {}, {}, servers, [], read, flops, weight_bytes=500e6)
    assert (
        "memory read 20.0 GB/s / 500 MB of weights per token = 40.0 tokens/s; C=1 reached fiberserve 250% of it."
    ) in text
    # a CPU without AVX512-BF16 / VNNI measures no such peak: "-" rather than a division by zero
    no_dot = Peaks(threads=2, fp32=5e11, bf16=0.0, int8=0.0, q4_1=0.0, amx_bf16=0.0)
    text = render("c", [1, 64], series, {}, {}, servers, [], no_dot, flops)
    # its vector peak is fp32's (5e11): a bound of 500 tokens/s, so C=64 is at 200% of it
    assert "| fiberserve | 64 | 1000.0 | 0.50 | 200% | 1250 | - | - | - | - |" in text and "of fp32 bound" in text
    assert "bf16 peak: none (the CPU lacks the instruction);" in text
    assert "![throughput and latency](bench-results/benchmarks.png)" in text  # the default output's plot
    moved = render("c", [1], series, {}, {}, servers, [], no_dot, flops, plot="../out/benchmarks.png")
    assert "![throughput and latency](../out/benchmarks.png)" in moved


def test_rounds_report_the_median_round_and_list_every_round(tmp_path):
    runs = [result(64, 900.0), result(64, 700.0), result(64, 800.0)]
    assert median_run(runs) is runs[2]
    assert median_run(runs[:2]) is runs[1]  # an even count: the lower of the middle two
    servers = [PeerServer("fiberserve", [], 1), PeerServer("vLLM", [], 2)]
    series = {"fiberserve": [median_run(runs)], "vLLM": [result(64, 400.0)]}
    rounds = {"fiberserve": [[900.0], [700.0], [800.0]], "vLLM": [[400.0], [500.0], [300.0]]}
    peaks = Peaks(threads=2, fp32=5e11, bf16=1e12, int8=2e12, q4_1=1.25e12, amx_bf16=4e12)
    flops = TokenFlops(decoder=0.5e9, head=0.5e9)
    text = render("c", [64], series, {}, {}, servers, [], peaks, flops, rounds)
    assert "Each figure is the median of 3 rounds" in text
    assert "| fiberserve | 800.0 |" in text and "| ratio fiberserve / vLLM | 2.00x |" in text
    assert "## Rounds" in text and "| fiberserve | 900.0 / 700.0 / 800.0 |" in text
    one = render("c", [64], series, {}, {}, servers, [], peaks, flops)
    assert "## Rounds" not in one and "median of" not in one


def test_the_chat_workload_leads_the_report(tmp_path):
    servers = [PeerServer("fiberserve", [], 1), PeerServer("llama-server", [], 2)]
    forced = {"fiberserve": [result(1, 300.0)], "llama-server": [result(1, 100.0)]}
    chat = {"fiberserve": [result(1, 150.0)], "llama-server": [result(1, 120.0)]}
    peaks = Peaks(threads=2, fp32=5e11, bf16=1e12, int8=2e12, q4_1=1.25e12, amx_bf16=0.0)
    flops = TokenFlops(decoder=0.5e9, head=0.5e9)
    text = render("c", [1], forced, {}, {}, servers, [], peaks, flops, chat=chat)
    assert text.index("## Chat traffic") < text.index("## Forced workload")
    assert "| ratio fiberserve / llama-server | 1.25x |" in text.split("## Forced workload")[0]
    assert "| ratio fiberserve / llama-server | 3.00x |" in text.split("## Forced workload")[1]
    assert "## Chat traffic" not in render("c", [1], forced, {}, {}, servers, [], peaks, flops)


def test_a_level_with_errors_is_marked_and_not_compared(tmp_path):
    servers = [PeerServer("fiberserve", [], 1), PeerServer("vLLM", [], 2)]
    failed = result(64, 1.6)
    failed.errors = 128
    chat = {"fiberserve": [result(16, 700.0), result(64, 970.0)], "vLLM": [result(16, 350.0), failed]}
    peaks = Peaks(threads=2, fp32=5e11, bf16=1e12, int8=2e12, q4_1=1.25e12, amx_bf16=0.0)
    flops = TokenFlops(decoder=0.5e9, head=0.5e9)
    text = render("c", [16, 64], chat, {}, {}, servers, [], peaks, flops, chat=chat)
    assert "| vLLM | 350.0 | 1.6 (128 errors) |" in text and "| ratio fiberserve / vLLM | 2.00x | - |" in text


def test_a_models_section_is_replaced_or_added_and_the_rest_of_the_report_kept():
    from fiberserve.bench.report import merged, model_section

    main = "# Benchmarks\n\nGenerated by the embedded run.\n\n## Forced workload\n\n| a |\n"
    one = model_section("# Benchmarks\n\nfirst run\n\n## Forced workload\n", "1b.gguf", "1b.gguf (700 MB)")
    assert "## 1b.gguf (700 MB)" in one and "### Forced workload" in one and "# Benchmarks" not in one
    text = merged(merged("", main=main), section=("1b.gguf", one))
    assert text.startswith(main) and text.count("first run") == 1
    again = model_section("# Benchmarks\n\nsecond run\n", "1b.gguf", "1b.gguf (700 MB)")
    other = model_section("# Benchmarks\n\n8b run\n", "8b.gguf", "8b.gguf (4917 MB)")
    text = merged(merged(text, section=("1b.gguf", again)), section=("8b.gguf", other))
    assert "first run" not in text and text.count("second run") == 1 and text.index("second run") < text.index("8b run")
    rerun = merged(text, main=main.replace("embedded run", "embedded rerun"))
    assert "embedded rerun" in rerun and "embedded run." not in rerun and "second run" in rerun and "8b run" in rerun
