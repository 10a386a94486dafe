#!/usr/bin/env python3
"""A soak: mixed traffic against a fiberserve server on 127.0.0.1, bounded in time, checking that nothing grows.

Traffic, from ``--clients`` concurrent clients: streamed and non-streamed chat (the ``openai`` client) with
``n`` > 1, logprobs, grammars (``response_format`` JSON schemas, ``/generate`` regexes), forced and ``auto`` tool
calls; ``/v1/completions`` with logprobs; requests the client gives up on (aborts) and streams it drops after a
few chunks; malformed requests (each must get a 4xx JSON error); and overload bursts beyond ``--max-queue`` (each
must get a 200 or a fast 503).  Any other answer is an error.

The run starts with the largest flights the server allows (``Soak.peak``), then is cut into rounds of
``--sample-s`` seconds.  After each, the clients close their connections, the server is waited for until idle
(its heaps' freed memory returned too, which it does ``engine.service.IDLE_TRIM_S`` after its last flight), and its
process is sampled: RSS, open file descriptors, threads, asyncio tasks, KV pages in use, the C heaps' figures.  The
first sample at or after ``--warmup-s`` is the baseline; every later one must have RSS within ``RSS_GROWTH`` of it,
no page in use, and the same descriptors, threads and tasks.  Exit status 0 when every check holds and no request
went wrong, 1 otherwise; ``--json`` writes the samples, the request tallies and the
checks.

    python scripts/soak.py --minutes 30                   # starts its own server on the embedded model
    python scripts/soak.py --minutes 3 --sample-s 20 --warmup-s 60 -- --cache-dir DIR   # server flags after --
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai

#: How much the RSS may grow over the baseline sample (a share of it).
RSS_GROWTH = 0.02

#: Seconds a round waits for the server to go idle (every request's pages back, every fiber free, the heaps trimmed).
IDLE_TIMEOUT_S = 60.0

#: The server's flags for the soak: two fibers, a small admission queue that bursts overflow, tool parsing on.
SERVER_FLAGS = ("--fibers", "2", "--max-queue", "32", "--tool-call-parser", "hermes", "--no-progress")

BURST = 48  #: requests in one overload burst: more than the queue holds
PEAK_ROWS = 64  #: sequences in the warm-up's largest flights: the server's --max-running default

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 20}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}
BAD_BODIES = [
    ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": "hi", "n": 0}),
    ("/v1/completions", {"prompt": [[-5]]}),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "("}}),
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": "(?=a)"}}),
    ("/generate", {}),
]


@dataclass
class Sample:
    elapsed_s: float
    requests: int
    rss_kib: int
    rss_anon_kib: int  #: of ``rss_kib``: anonymous memory (heaps, tensors, stacks)
    rss_file_kib: int  #: of ``rss_kib``: pages of mapped files (the model file, shared libraries)
    fds: int
    threads: int
    asyncio_tasks: int
    kv_pages_used: int
    kv_pages_cached: int
    heap_bytes: dict[str, int] | None = None  #: the C heaps' live, kept-free and mapped bytes (glibc only)


@dataclass
class Report:
    samples: list[Sample] = field(default_factory=list)
    tallies: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  #: the checks that failed

    @property
    def ok(self) -> bool:
        return not self.errors and not self.checks


class Overloaded(Exception):
    """The server answered 503: its queue was full (a burst's overflow; any request may meet one)."""


def _ok(r: httpx.Response) -> dict:
    """The JSON of a 200; :class:`Overloaded` for a 503; else an AssertionError with the answer."""
    if r.status_code == 503:
        raise Overloaded
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


def _proc_status(pid: int) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
            values[key] = int(rest.split()[0])
    return values


class Soak:
    """The clients, the rounds and the checks of one run against the server at ``url`` (process ``pid``)."""

    def __init__(self, url: str, pid: int, clients: int, seed: int = 0) -> None:
        self.url, self.pid, self.clients = url, pid, clients
        self.rng = random.Random(seed)
        self.tally: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.requests = 0
        self.model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

    # ------------------------------------------------------------------ one request of each kind

    async def chat(self, api: openai.AsyncOpenAI, i: int) -> None:
        r = await api.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": f"Name a colour ({i})."}],
            max_tokens=12,
            temperature=0.8,
            seed=i,
            n=1 + i % 3,
            logprobs=True,
            top_logprobs=2,
        )
        assert len(r.choices) == 1 + i % 3 and all(c.finish_reason in ("stop", "length") for c in r.choices)

    async def chat_stream(self, api: openai.AsyncOpenAI, i: int) -> None:
        stream = await api.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": f"Say something short about the number {i}."}],
            max_tokens=16,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
        )
        reasons = [c.finish_reason async for chunk in stream for c in chunk.choices if c.finish_reason]
        assert reasons and reasons[-1] in ("stop", "length"), reasons

    async def grammar(self, api: openai.AsyncOpenAI, i: int) -> None:
        r = await api.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
            max_tokens=48,
            temperature=0.5,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}},
        )
        if r.choices[0].finish_reason == "stop":
            assert set(json.loads(r.choices[0].message.content or "")) == {"answer", "sure"}

    async def tools(self, api: openai.AsyncOpenAI, i: int) -> None:
        choice = {"type": "function", "function": {"name": "get_weather"}} if i % 2 else "auto"
        r = await api.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL],
            tool_choice=choice,
            max_tokens=40,
            temperature=0.3,
            seed=i,
        )
        if choice != "auto" and r.choices[0].finish_reason == "stop":
            assert r.choices[0].message.tool_calls and r.choices[0].message.tool_calls[0].function.name == "get_weather"

    async def completion(self, http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Once upon a time {i}", "max_tokens": 10, "logprobs": 2, "temperature": 0.9, "seed": i}
        answer = _ok(await http.post("/v1/completions", json=body))
        assert len(answer["choices"][0]["logprobs"]["tokens"]) >= 1, answer

    async def regex(self, http: httpx.AsyncClient, i: int) -> None:
        params = {"max_new_tokens": 16, "regex": "[0-9]{3}-[0-9]{4}", "temperature": 0.5, "seed": i}
        answer = _ok(await http.post("/generate", json={"text": "A phone number:", "sampling_params": params}))
        assert answer["meta_info"]["finish_reason"]["type"] in ("stop", "length"), answer

    async def abort(self, http: httpx.AsyncClient, i: int) -> None:
        params = {"max_new_tokens": 400, "ignore_eos": True}
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up: the server aborts the request
            await http.post("/generate", json={"text": f"Go on {i}", "sampling_params": params}, timeout=0.3)

    async def dropped_stream(self, http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Tell a long story {i}", "max_tokens": 300, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 503:
                raise Overloaded
            assert r.status_code == 200, r.status_code
            chunks = 0
            async for line in r.aiter_lines():
                chunks += bool(line)
                if chunks >= 3:
                    break  # the client goes away mid-stream

    async def bad_input(self, http: httpx.AsyncClient, i: int) -> None:
        path, body = BAD_BODIES[i % len(BAD_BODIES)]
        r = await http.post(path, json=body)
        assert 400 <= r.status_code < 500 and "error" in r.json(), (path, body, r.status_code, r.text)

    async def burst(self, _: httpx.AsyncClient, i: int) -> None:
        """:data:`BURST` requests at once, on connections of their own (closed after: a pooled connection left
        idle past the server's keep-alive may be closed by it just as it is reused)."""
        body = {"text": "Burst", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        limits = httpx.Limits(max_connections=BURST)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as http:
            answers = await asyncio.gather(*(http.post("/generate", json=body) for _ in range(BURST)))
        statuses = collections.Counter(r.status_code for r in answers)
        assert set(statuses) <= {200, 503}, statuses
        self.tally["burst 503"] += statuses[503]

    # ------------------------------------------------------------------ the rounds

    async def client(self, k: int, until: float) -> None:
        kinds = [
            self.chat, self.chat_stream, self.grammar, self.tools,
            self.completion, self.regex, self.abort, self.dropped_stream, self.bad_input,
        ]  # fmt: skip
        async with (
            httpx.AsyncClient(base_url=self.url, timeout=120) as http,
            openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120) as api,
        ):
            while time.monotonic() < until:
                self.requests += 1
                i = self.requests
                kind = self.burst if self.rng.random() < 0.01 else self.rng.choice(kinds)
                target = api if kind in (self.chat, self.chat_stream, self.grammar, self.tools) else http
                try:
                    await kind(target, i)  # type: ignore[arg-type]
                    self.tally[kind.__name__] += 1
                except (Overloaded, openai.InternalServerError) as exc:
                    if isinstance(exc, openai.InternalServerError) and exc.status_code != 503:
                        self.errors.append(f"{kind.__name__} #{i}: {exc}"[:500])
                    self.tally["503"] += 1
                except Exception as exc:  # every failure is a finding: kept with its request kind
                    self.errors.append(f"{kind.__name__} #{i}: {type(exc).__name__}: {exc}"[:500])

    async def peak(self, waves: int = 3) -> None:
        """The largest flights the server's limits allow, before the first round: :data:`PEAK_ROWS` chats at once
        with logprobs, so that the heap's high water (which keeps freed buffers for reuse) is reached during the
        warm-up rather than whenever traffic first reaches that shape."""
        async with openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120) as api:
            for _ in range(waves):
                await asyncio.gather(
                    *(self.chat(api, 3 * i) for i in range(PEAK_ROWS)),  # n = 1 each
                    return_exceptions=True,  # a queue overflow's 503 is expected here
                )

    async def round(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        await asyncio.gather(*(self.client(k, until) for k in range(self.clients)))

    def wait_idle(self) -> dict:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            info = httpx.get(f"{self.url}/get_server_info", timeout=10).json()
            pages, pool = info["kv_pages"], info["pool"]
            idle = pages["used"] == 0 and pool["busy"] == 0 and not info["active_requests"] and info["heap_trimmed"]
            if idle or time.monotonic() > deadline:
                if not idle:
                    self.errors.append(f"not idle {IDLE_TIMEOUT_S:.0f} s after a round: {pages}, {pool}")
                return info
            time.sleep(0.1)

    def settled_fds(self) -> int:
        """The server's open descriptors once the count holds for a second (the connections the clients just
        closed close on the server's side a moment later), at most ``IDLE_TIMEOUT_S`` later."""
        deadline, count = time.monotonic() + IDLE_TIMEOUT_S, -1
        while count != (count := len(os.listdir(f"/proc/{self.pid}/fd"))) and time.monotonic() < deadline:
            time.sleep(1.0)
        return count

    def sample(self, started: float) -> Sample:
        self.wait_idle()
        fds = self.settled_fds()
        info = httpx.get(f"{self.url}/get_server_info", timeout=10).json()
        status = _proc_status(self.pid)
        return Sample(
            elapsed_s=round(time.monotonic() - started, 1),
            requests=self.requests,
            rss_kib=status["VmRSS"],
            rss_anon_kib=status["RssAnon"],
            rss_file_kib=status["RssFile"],
            fds=fds,
            threads=status["Threads"],
            asyncio_tasks=info["asyncio_tasks"],
            kv_pages_used=info["kv_pages"]["used"],
            kv_pages_cached=info["kv_pages"]["cached"],
            heap_bytes=info.get("heap_bytes"),
        )

    def run(self, seconds: float, sample_s: float, warmup_s: float) -> Report:
        report = Report()
        started = time.monotonic()
        asyncio.run(self.peak())
        while time.monotonic() - started < seconds:
            asyncio.run(self.round(min(sample_s, seconds - (time.monotonic() - started))))
            report.samples.append(self.sample(started))
            print(json.dumps(asdict(report.samples[-1])), flush=True)
        report.tallies, report.errors = dict(self.tally), self.errors
        report.checks = check(report.samples, warmup_s)
        return report


def check(samples: list[Sample], warmup_s: float) -> list[str]:
    """The checks that fail: after the baseline (the first sample at or after ``warmup_s``), RSS within
    :data:`RSS_GROWTH`, no page in use, descriptors, threads and asyncio tasks as at the baseline."""
    after = [s for s in samples if s.elapsed_s >= warmup_s]
    if len(after) < 2:
        return [f"fewer than two samples after the warm-up of {warmup_s:.0f} s: nothing to compare"]
    base, failed = after[0], []
    for s in after[1:]:
        at = f"at {s.elapsed_s:.0f} s"
        if s.rss_kib > base.rss_kib * (1 + RSS_GROWTH):
            failed.append(f"RSS {base.rss_kib} -> {s.rss_kib} KiB {at}: more than {RSS_GROWTH:.0%}")
        for name in ("fds", "threads", "asyncio_tasks"):
            if getattr(s, name) != getattr(base, name):
                failed.append(f"{name} {getattr(base, name)} -> {getattr(s, name)} {at}")
    failed += [f"{s.kv_pages_used} KV pages in use at idle at {s.elapsed_s:.0f} s" for s in samples if s.kv_pages_used]
    return failed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def own_server(flags: list[str], log_path: Path):
    """A server process on 127.0.0.1 with :data:`SERVER_FLAGS` and ``flags``; yields (url, pid)."""
    port = _free_port()
    command = [sys.executable, "-m", "fiberserve.server", "--port", str(port), *SERVER_FLAGS, *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.2)
            else:
                raise RuntimeError(f"the server did not start: see {log_path}")
            yield url, proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between two samples")
    parser.add_argument("--warmup-s", type=float, default=300.0, help="seconds before the baseline sample")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the samples, tallies, errors and failed checks here")
    parser.add_argument("--server-log", type=Path, default=Path("soak-server.log"))
    args = parser.parse_args(own)
    with own_server(server_flags, args.server_log) as (url, pid):
        report = Soak(url, pid, args.clients, args.seed).run(args.minutes * 60, args.sample_s, args.warmup_s)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    print(json.dumps({"tallies": report.tallies, "errors": report.errors[:20], "failed_checks": report.checks}))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
