"""Bad input, overload, disconnects, faults, auth and a soak: nothing crashes, nothing leaks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(start_server, model_path):
    proc = start_server("--fibers", "2", "--max-body-bytes", "65536").wait_ready()
    yield proc
    assert proc.stop() == 0


G = "/generate"
C = "/v1/completions"
CH = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}


def sp(**kw):
    return {"text": "Hello", "sampling_params": kw}


# (path, body (dict/list -> JSON, bytes -> raw), expected status, the field the error must name)
BAD_INPUT = [
    (G, b"{bad json", 400, "body"),
    (G, b'{"text": "\xff\xfe\xfd"}', 400, "body"),
    (G, b"", 400, "body"),
    (G, [], 400, "body"),
    (G, {}, 400, "text"),
    (G, {"text": "a", "input_ids": [1]}, 400, "text"),
    (G, {"text": 5}, 400, "text"),
    (G, {"text": ""}, 400, "text"),
    (G, {"text": []}, 400, "text"),
    (G, {"input_ids": []}, 400, "input_ids"),
    (G, {"input_ids": [-1]}, 400, "input_ids"),
    (G, {"input_ids": [10**9]}, 400, "input_ids"),
    (G, {"input_ids": ["a"]}, 400, "input_ids"),
    (G, sp(max_new_tokens=-1), 400, "max_new_tokens"),
    (G, sp(max_new_tokens="ten"), 400, "max_new_tokens"),
    (G, sp(max_new_tokens=10**7), 400, "max_new_tokens"),
    (G, sp(temperature=-0.5), 400, "temperature"),
    (G, sp(top_p=0), 400, "top_p"),
    (G, sp(top_p=1.5), 400, "top_p"),
    (G, sp(top_k=-5), 400, "top_k"),
    (G, sp(min_p=2), 400, "min_p"),
    (G, sp(n=0), 400, "n"),
    (G, sp(n=1000), 400, "n"),
    (G, sp(stop=5), 400, "stop"),
    (G, sp(stop=[""]), 400, "stop"),
    (G, sp(stop_token_ids=[-3]), 400, "stop_token_ids"),
    (G, sp(frequency_penalty=5), 400, "frequency_penalty"),
    (G, sp(repetition_penalty=0), 400, "repetition_penalty"),
    (G, sp(seed=-1), 400, "seed"),
    (G, {"text": "a", "stream": "yes"}, 400, "stream"),
    (G, {"text": "a", "sampling_params": "x"}, 400, "sampling_params"),
    (G, {"text": ["a", "b"], "rid": ["only-one"]}, 400, "rid"),
    (G, {"text": "a", "return_logprob": True, "top_logprobs_num": 100}, 400, "top_logprobs"),
    (C, {"max_tokens": 2}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt"),
    (C, {"prompt": [[-5]], "echo": True, "max_tokens": 1}, 400, "prompt"),  # checked before it is echoed
    (C, {"prompt": [70000], "max_tokens": 1}, 400, "prompt"),
    (C, {"prompt": "a", "max_tokens": -2}, 400, "max_tokens"),
    (C, {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "a", "n": 100}, 400, "n"),
    (C, {"prompt": "a", "echo": "yes"}, 400, "echo"),
    (C, {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    (C, {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    (G, sp(min_new_tokens=-1), 400, "min_new_tokens"),
    (G, sp(regex="("), 400, "regex"),
    (G, sp(logit_bias={"x": 1}), 400, "logit_bias"),
    (G, sp(json_schema="{"), 400, "json_schema"),
    (C, {"prompt": "a", "guided_choice": []}, 400, "guided_choice"),
    (C, {"prompt": "a", "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    (C, {"prompt": "a", "guided_json": {"type": "no-such-type"}}, 400, "guided_json"),
    (C, {"prompt": "a", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (C, {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (C, {"prompt": "a", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    (C, {"prompt": "a", "logit_bias": {"5": "high"}}, 400, "logit_bias"),
    (C, {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "a", "model": "gpt-17"}, 404, "model"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {}, 400, "messages"),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages"),
    (CH, {"messages": MSG, "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    (CH, {"messages": MSG, "stream_options": "x"}, 400, "stream_options"),
    (CH, {"messages": MSG, "max_tokens": 10**7}, 400, "max_tokens"),
    (CH, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CH, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (CH, {"messages": MSG, "tools": [TOOL]}, 400, "tool_choice"),  # "auto", the default, needs a parser
    (
        CH,
        {"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice",
    ),
    (CH, {"messages": MSG, "tool_choice": "required"}, 400, "tools"),
    (CH, {"messages": MSG, "tools": [TOOL, TOOL], "tool_choice": "required"}, 400, "tools"),
    (CH, {"messages": MSG, "tools": [{"type": "retrieval"}], "tool_choice": "required"}, 400, "tools"),
    (CH, {"messages": MSG, "tools": [TOOL], "tool_choice": "sometimes"}, 400, "tool_choice"),
    (CH, {"messages": MSG, "tools": [BAD_TOOL], "tool_choice": "required"}, 400, "tools"),
    (CH, {"messages": MSG, "tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, 400, "guided_regex"),
    (G, sp(logit_bias={"999999999": 1}), 400, "logit_bias"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MSG}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "model": "gpt-17"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/nope", {}, 404, None),
    (G, b"x" * 70000, 413, "body"),
]


def test_bad_input_gets_a_4xx_json_error_naming_the_field(server):
    assert len(BAD_INPUT) >= 40
    with server.client() as c:
        for path, body, status, field in BAD_INPUT:
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(path, json=body)
            assert r.status_code == status, (path, body, r.status_code, r.text)
            error = r.json()["error"]
            assert error["message"] and "Traceback" not in r.text
            if field:
                assert field in (error["param"] or "") or field in error["message"], (path, body, error)
        assert c.get(G).status_code == 405
        # still serving correctly afterwards
        ok = c.post(
            G, json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        )
        assert ok.status_code == 200 and ok.json()["text"].startswith(" Paris")
    server.assert_idle()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(-3, 3, allow_nan=False) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6,
)
sampling_keys = st.sampled_from(
    [
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "n",
        "seed",
        "stop_token_ids",
        "ignore_eos",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "x",
    ]
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from([G, C, CH]),
    prompt=st.one_of(json_values, st.just("Hi"), st.lists(st.integers(-2, 60000), max_size=4)),
    params=st.dictionaries(sampling_keys, json_values, max_size=5),
    stream=st.booleans(),
)
def test_fuzzed_bodies_never_get_a_5xx(server, path, prompt, params, stream):
    params = dict(params)
    if isinstance(params.get("max_new_tokens"), int | float) and not isinstance(params["max_new_tokens"], bool):
        params["max_new_tokens"] = min(params["max_new_tokens"], 4)
    params.setdefault("max_new_tokens", 2)
    if path == G:
        body = {"text" if isinstance(prompt, str) else "input_ids": prompt, "sampling_params": params, "stream": stream}
    elif path == C:
        body = {"prompt": prompt, **params, "max_tokens": params.pop("max_new_tokens"), "stream": stream}
    else:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            **params,
            "max_tokens": params.pop("max_new_tokens"),
            "stream": stream,
        }
    with server.client(timeout=60) as c:
        r = c.post(path, json=body)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        assert "error" in r.json()


def test_a_catastrophic_stop_regex_stalls_no_other_stream(server):
    """``(a+)+b`` over a run of a's backtracks exponentially in Python's re: checked at every token on the event
    loop, one such request froze every stream.  Here a plain request sent beside it finishes first, and the
    pathological one still ends with every ``a`` its grammar makes it write."""
    pathological = {
        "text": "Say a",
        "sampling_params": {"max_new_tokens": 120, "temperature": 0, "regex": "a{120}", "stop_regex": "(a+)+b"},
    }
    plain = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    finished: list[str] = []

    def send(name: str, body: dict) -> dict:
        with server.client(timeout=120) as c:
            r = c.post(G, json=body)
        finished.append(name)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(send, "pathological", pathological)
        time.sleep(0.5)
        quick = pool.submit(send, "plain", plain)
        assert quick.result()["meta_info"]["finish_reason"]["type"] == "length"
        out = slow.result()
    assert out["text"] == "a" * 120 and out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert finished == ["plain", "pathological"]
    server.assert_idle()


def test_metrics_and_no_cors_by_default(server):
    with server.client() as c:
        c.post(G, json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        r = c.get("/metrics")
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        text = r.text
        for name in [
            "fiberserve_requests_total",
            "fiberserve_prompt_tokens_total",
            "fiberserve_generation_tokens_total",
            "fiberserve_time_to_first_token_seconds_bucket",
            "fiberserve_time_per_output_token_seconds",
            "fiberserve_queue_depth",
            "fiberserve_running_sequences",
            'fiberserve_kv_pages{state="free"}',
            'fiberserve_kv_pages{state="cached"}',
            "fiberserve_prefix_cache_hit_rate",
            'state="idle"',
            "fiberserve_fiber_acquire_wait_seconds_total",
        ]:
            assert name in text, name
        pre = c.options(G, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers


def test_request_ids_are_sanitized_in_logs(server):
    with server.client() as c:
        r = c.post(G, json={"text": "Hi", "rid": "evil\nFAKE LOG LINE", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200
    assert "\nFAKE LOG LINE" not in server.log_with("rid=evil?FAKE?LOG?LINE")


async def _stream_then_leave(url: str, events: int) -> int:
    async with httpx.AsyncClient(timeout=60) as c:
        body = {
            "text": "Tell me a long story about dragons.",
            "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        }
        seen = 0
        async with c.stream("POST", url + G, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if seen >= events:
                        break  # leave: the connection closes with the stream unfinished
        return seen


def _finished_since(server, before: dict[str, float]) -> dict[str, float]:
    after = server.finished()
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}


def test_disconnecting_streaming_clients_free_their_pages(server):
    async def main():
        return await asyncio.gather(*(_stream_then_leave(server.url, 3) for _ in range(20)))

    before = server.finished()
    assert asyncio.run(main()) == [3] * 20
    server.assert_idle(timeout=120)
    # Each ended as aborted, long before its 400 tokens: the server noticed its client leave.
    since = _finished_since(server, before)
    assert since.get("abort") == 20 and since.get("length", 0) == 0 and since["tokens"] < 20 * 400 / 4, since


def test_disconnecting_non_streaming_client_aborts_its_request(server):
    before = server.finished()
    with pytest.raises(httpx.ReadTimeout), server.client(timeout=1.0) as c:
        c.post(G, json={"text": "Write an essay.", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}})
    server.assert_idle(timeout=120)
    since = _finished_since(server, before)
    assert since.get("abort") == 1 and since.get("length", 0) == 0 and since["tokens"] < 500, since


def test_overload_gets_fast_503s_and_loses_nothing(start_server, model_path):
    proc = start_server("--max-queue", "8", "--max-running", "8", "--fibers", "2").wait_ready()
    try:
        prompts = [f"Fact number {i % 5}:" for i in range(300)]
        # Long enough answers that the admitted requests are still decoding while the health probe runs.
        params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
        with proc.client() as c:
            expected = {p: c.post(G, json={"text": p, "sampling_params": params}).json()["text"] for p in set(prompts)}

        async def one(client, prompt):
            return prompt, await client.post(G, json={"text": prompt, "sampling_params": params})

        def health_probe(stop: threading.Event) -> int:
            # On a thread with its own connection: in the burst's event loop the probe would measure httpx's
            # connection pool instead, which is quadratic in its connections (encode/httpcore#1035) and stalls
            # that loop for seconds with 300 of them.
            answered = 0
            with proc.client() as probe:
                while not stop.is_set():
                    assert probe.get("/health").status_code == 200
                    answered += 1
                    stop.wait(0.05)
            return answered

        async def burst():
            limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
            async with httpx.AsyncClient(base_url=proc.url, timeout=300, limits=limits) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        stop = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            probe = pool.submit(health_probe, stop)
            try:
                results = asyncio.run(burst())
            finally:
                stop.set()
            health_answers = probe.result()
        ok = [r for r in results if r[1].status_code == 200]
        refused = [r for r in results if r[1].status_code != 200]
        assert ok and refused, (len(ok), len(refused))
        for prompt, r in ok:
            assert r.json()["text"] == expected[prompt]
        for _, r in refused:
            assert r.status_code == 503 and r.headers.get("retry-after") and r.json()["error"]["message"]
        assert health_answers > 0
        proc.assert_idle()
    finally:
        assert proc.stop() == 0
    # Checked by the order of the access log's lines, not by the clock (a shared CI machine's clock says little):
    # - A refusal does not wait for the work ahead of it.  A request is refused only while 8 others wait for
    #   admission, and none of those can finish before the refusal is sent, so after the last 503 come at least
    #   8 answers.
    # - /health answers during the burst, between its first refusal and its last answer.
    lines = [(m[1], m[2]) for m in re.finditer(r"(GET /health|POST /generate) (\d+) ", proc.log_path.read_text())]
    refusals = [i for i, line in enumerate(lines) if line == ("POST /generate", "503")]
    answers = [i for i, line in enumerate(lines) if line == ("POST /generate", "200")]
    assert len(refusals) == len(refused) and len(answers) == len(ok) + len(expected)
    assert sum(i > refusals[-1] for i in answers) >= 8
    during = lines[refusals[0] : answers[-1]]
    assert ("GET /health", "200") in during, lines


def test_fault_injection_fails_only_its_flights(start_server, model_path):
    proc = start_server("--fault-rate", "0.2", "--fibers", "2", "--invocation-timeout", "2")
    proc.wait_ready()
    try:
        prompts = [f"Item {i}: the colour of the sky is" for i in range(40)]
        params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

        async def run_all():
            async with httpx.AsyncClient(base_url=proc.url, timeout=120) as client:
                return await asyncio.gather(
                    *(
                        client.post(G, json={"text": p, "rid": f"req-{i}", "sampling_params": params})
                        for i, p in enumerate(prompts)
                    )
                )

        faulty = asyncio.run(run_all())
        failed = [r for r in faulty if r.status_code == 500]
        assert failed, "no invocation failed at a 20% fault rate"
        for r in failed:
            error = r.json()["error"]
            assert error["type"] == "server_error" and "req-" in error["message"]
        info = proc.assert_idle()
        assert info["pool"]["size"] == 2 and info["flights_failed"] > 0
        with proc.client() as c:
            assert c.post("/debug/faults", json={"rate": 0}).status_code == 200
        clean = asyncio.run(run_all())
        assert all(r.status_code == 200 for r in clean)
        # The pool hands out idle fibers first-in first-out, so the clean run's flights visit both
        # fibers, and every instance a fault discarded has been rebuilt by now.  (Checked before the
        # clean run, this raced: the faulty run may end right after its last fault.)
        assert proc.assert_idle()["program_instances_built"] > 2
        reference = {i: r.json()["text"] for i, r in enumerate(clean)}
        for i, r in enumerate(faulty):
            if r.status_code == 200:
                assert r.json()["text"] == reference[i]
        # a hung invocation is bounded by --invocation-timeout; its fiber is replaced, and until the call returns
        # its pages are quarantined, which /health, /get_server_info and /metrics say
        with proc.client() as c:
            c.post("/debug/faults", json={"rate": 1.0, "hang_seconds": 60, "point": "layers"})
            hung = c.post(G, json={"text": "Hello", "sampling_params": params})
            assert hung.status_code == 500 and "ran past 2s" in hung.json()["error"]["message"]
            c.post("/debug/faults", json={"rate": 0})
            assert c.post(G, json={"text": "Hello", "sampling_params": params}).status_code == 200
            health = c.get("/health").json()
            (fiber, held), *others = health["quarantined_kv_pages"].items()
            assert health["status"] == "ok" and fiber.startswith("fiber-") and held > 0 and not others
            assert c.get("/get_server_info").json()["kv_pages"]["quarantined"] == {fiber: held}
            assert f'fiberserve_kv_pages_quarantined{{fiber="{fiber}"}} {held}.0' in c.get("/metrics").text
            assert c.post("/debug/faults", json={"rate": 0, "release": True}).status_code == 200
            for _ in range(100):
                if "quarantined_kv_pages" not in c.get("/health").json():
                    break
                time.sleep(0.1)
            assert c.get("/health").json() == {"status": "ok"}
            assert c.post("/debug/faults", json={"point": "nowhere"}).status_code == 400
            assert c.post("/debug/faults", json={"release": "yes"}).status_code == 400
        info = proc.assert_idle()
        assert info["pool"]["size"] == 2 and info["pool"]["retired"] >= 1
    finally:
        assert proc.stop() == 0


def test_api_key(start_server, model_path):
    proc = start_server("--api-key", "s3cret").wait_ready()
    try:
        with proc.client() as c:
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            r = c.post(G, json={"text": "x"}, headers={"Authorization": "Bearer s3cret2"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
            assert c.get("/health").status_code == 200
            assert c.get("/metrics").status_code == 200
    finally:
        assert proc.stop() == 0


@pytest.mark.soak
def test_the_soak_script_s_short_form_finds_no_growth_and_no_wrong_answer(cache_dir, tmp_path):
    """``scripts/soak.py`` for 3 minutes (the full run is 30): every kind of request answered as it should be,
    and after a minute's warm-up RSS within 2%, no page in use at idle, descriptors, threads and tasks constant."""
    report_path = tmp_path / "soak.json"
    command = [
        sys.executable, str(Path(__file__).parents[2] / "scripts" / "soak.py"),
        "--minutes", "3", "--sample-s", "30", "--warmup-s", "60", "--clients", "6",
        "--json", str(report_path), "--server-log", str(tmp_path / "server.log"),
        "--", "--cache-dir", cache_dir,
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    report = json.loads(report_path.read_text())
    assert run.returncode == 0, (report["errors"][:10], report["checks"], run.stdout[-3000:], run.stderr[-3000:])
    kinds = {"chat", "chat_stream", "grammar", "tools", "completion", "regex", "abort", "dropped_stream", "bad_input"}
    assert kinds <= {kind for kind, count in report["tallies"].items() if count > 0}, report["tallies"]
    assert len(report["samples"]) >= 5 and not report["errors"] and not report["checks"]
