"""A load generator for OpenAI-compatible and SGLang-native servers on this machine.

Closed loop (``concurrency`` clients, each sending its next request when the
last one returns) or open loop (requests arrive at ``rate`` per second, Poisson).
Bounded by a request count and a time limit.  Only loopback targets.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import aiohttp

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree near the river bank"
    " and count every star in the quiet night sky"
).split()


def check_loopback(url: str) -> None:
    """Refuse any target that is not this machine."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing to load {url}: only loopback targets (127.0.0.0/8, ::1, localhost) are allowed")


#: The chat workload's system prompt, shared by every request (as an assistant's product sends its own).
CHAT_SYSTEM = (
    "You are a friendly and knowledgeable assistant for a public library. Answer the visitor's question clearly "
    "and accurately in a few sentences, using plain language that a curious teenager would understand. If the "
    "question has several parts, answer each of them in order. Do not invent facts: when you are unsure, say so "
    "and suggest where in the library the visitor could look for more. Keep a warm and encouraging tone."
)
CHAT_ASKS = (
    "Explain how {} works.",
    "What is the history of {}?",
    "Give me three interesting facts about {}.",
    "Why does {} matter to people today?",
    "How would you describe {} to a ten-year-old?",
    "What are common misconceptions about {}?",
)
CHAT_SUBJECTS = (
    "photosynthesis",
    "the printing press",
    "volcanoes",
    "the moon landing",
    "bread baking",
    "honey bees",
    "the water cycle",
    "electric cars",
    "the Roman aqueducts",
    "jazz music",
    "black holes",
    "vaccines",
    "the stock market",
    "origami",
    "the Great Wall of China",
    "recycling",
    "rainbows",
    "chess openings",
    "the human heart",
    "wind turbines",
    "coral reefs",
    "the internet",
    "ancient Egyptian writing",
    "tides",
)


def make_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def make_chat_questions(count: int, seed: int = 0) -> list[str]:
    """Distinct user questions (as distinct as the templates allow), shuffled by ``seed``."""
    pairs = [(ask, subject) for ask in CHAT_ASKS for subject in CHAT_SUBJECTS]
    random.Random(seed).shuffle(pairs)
    return [ask.format(subject) for ask, subject in (pairs * (count // len(pairs) + 1))[:count]]


@dataclass
class LoadSpec:
    url: str
    api: str = "openai"  # openai | sglang
    model: str | None = None
    #: Model names the requests take in turn (e.g. LoRA adapters, the base among them or not); empty: ``model``.
    models: tuple[str, ...] = ()
    concurrency: int = 1
    rate: float | None = None  # requests/s, open loop; None = closed loop
    requests: int = 64
    duration_s: float = 120.0
    prompt_words: int = 40
    output_len: int = 64
    ignore_eos: bool = True
    stream: bool = False
    fresh_connections: bool = False  # llama-server closes connections after a streamed response
    seed: int = 0
    #: "forced": completions of ``prompt_words`` random words, ``output_len`` tokens, greedy.  "chat": chat
    #: completions with a shared system prompt and distinct questions, up to ``output_len`` tokens ending
    #: naturally, sampled at ``temperature`` (each request with a seed of its own where ``seeded``).
    workload: str = "forced"
    temperature: float = 0.0
    seeded: bool = True


@dataclass
class Sample:
    ok: bool
    latency: float
    ttft: float | None
    output_tokens: int
    error: str | None = None
    prompt_tokens: int = 0


@dataclass
class LoadResult:
    spec: dict
    wall_s: float
    completed: int
    errors: int
    output_tokens: int
    output_tokens_per_s: float
    #: Prompt tokens of the completed requests, as the server counted them (0 where it did not say).
    prompt_tokens: int
    requests_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    first_errors: list[str] = field(default_factory=list)


def median_run(runs: list[LoadResult]) -> LoadResult:
    """The run of median output tokens/s (for an even count, the lower of the middle two), kept whole so that
    its latencies describe the same run as its throughput."""
    if not runs:
        raise ValueError("no runs")
    return sorted(runs, key=lambda r: r.output_tokens_per_s)[(len(runs) - 1) // 2]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k] * 1000


def _body(spec: LoadSpec, prompt: str, index: int) -> tuple[str, dict]:
    if spec.workload == "chat":
        return "/v1/chat/completions", _chat_body(spec, prompt, index)
    if spec.api == "sglang":
        return "/generate", {
            "text": prompt,
            "stream": spec.stream,
            "sampling_params": {
                "max_new_tokens": spec.output_len,
                "temperature": spec.temperature,
                "ignore_eos": spec.ignore_eos,
            },
        }
    body = {
        "prompt": prompt,
        "max_tokens": spec.output_len,
        "temperature": spec.temperature,
        "stream": spec.stream,
        "ignore_eos": spec.ignore_eos,
    }
    return "/v1/completions", _openai_extras(spec, body, index)


def _chat_body(spec: LoadSpec, question: str, index: int) -> dict:
    body = {
        "messages": [{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": spec.output_len,
        "temperature": spec.temperature,
        "stream": spec.stream,
    }
    if spec.seeded:
        body["seed"] = spec.seed * 100_000 + index
    return _openai_extras(spec, body, index)


def _openai_extras(spec: LoadSpec, body: dict, index: int) -> dict:
    """Request ``index``'s ``body`` with its model named (where given) and, streamed, the usage asked for in the
    last chunk."""
    model = spec.models[index % len(spec.models)] if spec.models else spec.model
    if model:
        body["model"] = model
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _carries_text(chunk: dict) -> bool:
    """Whether a streamed chunk holds generated text (not just a role, usage or an empty first chunk)."""
    if "choices" in chunk:
        return any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk["choices"])
    return bool(chunk.get("text"))


def _usage(spec: LoadSpec, data: dict) -> dict:
    """The token counts of a response (or streamed chunk): SGLang's ``meta_info`` or OpenAI's ``usage``."""
    return data["meta_info"] if spec.api == "sglang" else data["usage"]


def _prompt(usage: dict) -> int:
    return int(usage.get("prompt_tokens") or 0)


async def _one(session: aiohttp.ClientSession, spec: LoadSpec, prompt: str, index: int) -> Sample:
    path, body = _body(spec, prompt, index)
    url = spec.url.rstrip("/") + path
    started = time.perf_counter()
    ttft = None
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                return Sample(False, time.perf_counter() - started, None, 0, f"{r.status} {(await r.text())[:200]}")
            if not spec.stream:
                usage = _usage(spec, json.loads(await r.read()))
                latency = time.perf_counter() - started
                return Sample(True, latency, None, usage["completion_tokens"], None, _prompt(usage))
            tokens = prompt_tokens = 0
            async for line in r.content:  # server-sent events, a line at a time
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if ttft is None and _carries_text(data):  # as vLLM's benchmark: the first chunk with text
                    ttft = time.perf_counter() - started
                if spec.api == "sglang" or data.get("usage"):
                    usage = _usage(spec, data)
                    tokens, prompt_tokens = usage["completion_tokens"], _prompt(usage)
                elif data.get("choices"):
                    tokens += 1
        return Sample(True, time.perf_counter() - started, ttft, tokens, None, prompt_tokens)
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
        return Sample(False, time.perf_counter() - started, ttft, 0, f"{type(exc).__name__}: {exc}")


def _session(spec: LoadSpec) -> aiohttp.ClientSession:
    """The load's HTTP client: as many connections as requests in flight (kept alive and reused, unless
    ``fresh_connections``), a 600 s limit per request, streamed lines up to 2 MiB.

    aiohttp rather than httpx, as vLLM's ``benchmark_serving`` does, because the client shares the server's
    cores: its HTTP parser is C, and against fiberserve at C=16 (Zen 3) the load generator's own CPU time per
    output token measured 110-126 against 284-330 us streamed and 7-9 against 33-46 us non-streamed.  (httpx's
    connection pool is also quadratic in its connections, encode/httpcore#1035, which at a few hundred
    held up its event loop for seconds.)
    """
    connector = aiohttp.TCPConnector(limit=0, force_close=spec.fresh_connections)
    # read_bufsize: a streamed line may be up to twice this; SGLang's events carry the whole text so far
    timeout = aiohttp.ClientTimeout(total=600)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20)


async def run_load(spec: LoadSpec) -> LoadResult:
    """Run one load level and summarize it."""
    check_loopback(spec.url)
    if spec.workload == "chat":
        if spec.api != "openai":
            raise SystemExit("the chat workload sends OpenAI chat completions (--api openai)")
        prompts = make_chat_questions(spec.requests, spec.seed)
    else:
        prompts = make_prompts(spec.requests, spec.prompt_words, spec.seed)
    samples: list[Sample] = []
    deadline = time.perf_counter() + spec.duration_s
    queue = iter(enumerate(prompts))
    session = _session(spec)

    try:
        started = time.perf_counter()
        if spec.rate:
            rng = random.Random(spec.seed)
            tasks = []
            for index, prompt in enumerate(prompts):
                if time.perf_counter() > deadline:
                    break
                tasks.append(asyncio.create_task(_one(session, spec, prompt, index)))
                await asyncio.sleep(rng.expovariate(spec.rate))
            samples = list(await asyncio.gather(*tasks))
        else:

            async def client_loop() -> None:
                for index, prompt in queue:
                    if time.perf_counter() > deadline:
                        return
                    samples.append(await _one(session, spec, prompt, index))

            await asyncio.gather(*(client_loop() for _ in range(spec.concurrency)))
        wall = time.perf_counter() - started
    finally:
        await session.close()
    ok = [s for s in samples if s.ok]
    out_tokens = sum(s.output_tokens for s in ok)
    tpots = [(s.latency - s.ttft) / (s.output_tokens - 1) for s in ok if s.ttft is not None and s.output_tokens > 1]
    return LoadResult(
        spec=asdict(spec),
        wall_s=wall,
        completed=len(ok),
        errors=len(samples) - len(ok),
        output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / wall if wall else 0.0,
        prompt_tokens=sum(s.prompt_tokens for s in ok),
        requests_per_s=len(ok) / wall if wall else 0.0,
        ttft_p50_ms=_percentile([s.ttft for s in ok if s.ttft is not None], 50),
        ttft_p99_ms=_percentile([s.ttft for s in ok if s.ttft is not None], 99),
        tpot_p50_ms=_percentile(tpots, 50),
        tpot_p99_ms=_percentile(tpots, 99),
        e2e_p50_ms=_percentile([s.latency for s in ok], 50),
        e2e_p99_ms=_percentile([s.latency for s in ok], 99),
        first_errors=[s.error or "" for s in samples if not s.ok][:3],
    )


def summarize(results: list[LoadResult]) -> str:
    """A markdown table of load levels."""
    lines = [
        "| C | rate | ok | err | out tok/s | req/s | TTFT p50/p99 ms | TPOT p50/p99 ms | e2e p50/p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(x):
        return "-" if x is None else f"{x:.0f}"

    for r in results:
        s = r.spec
        lines.append(
            f"| {s['concurrency']} | {s['rate'] or '-'} | {r.completed} | {r.errors} | "
            f"{r.output_tokens_per_s:.1f} | {r.requests_per_s:.2f} | {f(r.ttft_p50_ms)}/{f(r.ttft_p99_ms)} | "
            f"{f(r.tpot_p50_ms)}/{f(r.tpot_p99_ms)} | {f(r.e2e_p50_ms)}/{f(r.e2e_p99_ms)} |"
        )
    return "\n".join(lines)


def plot(series: dict[str, list[LoadResult]], path: str) -> None:
    """Throughput and p50 latency against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, results in series.items():
        cs = [r.spec["concurrency"] for r in results]
        a.plot(cs, [r.output_tokens_per_s for r in results], marker="o", label=name)
        b.plot(cs, [r.e2e_p50_ms or 0 for r in results], marker="o", label=name)
    for ax, title in ((a, "output tokens/s"), (b, "end-to-end latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
