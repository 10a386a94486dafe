"""Real clients against a real server process: the SGLang frontend, the openai package, httpx."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(start_server, model_path):
    # bf16 on every CPU, so that the answers these tests read are the same on all (the default is int4 where
    # that is faster: see test_default_quantization_is_the_files_own_where_int4_is_faster)
    proc = start_server(
        "--fibers", "2", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--quantization", "none"
    ).wait_ready()  # fmt: skip
    yield proc
    assert proc.stop() == 0


def test_health_is_503_until_the_model_is_ready_and_sigterm_exits_cleanly(start_server, model_path):
    proc = start_server()
    proc.wait_ready()
    assert proc.saw_503, "health never said 503 while loading"
    # a long streamed request in flight when SIGTERM arrives is finished (or aborted), then exit 0
    events = []
    streaming = threading.Event()

    def stream():
        with httpx.stream(
            "POST",
            proc.url + "/generate",
            timeout=120,
            json={
                "text": "Count to one hundred:",
                "stream": True,
                "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
            },
        ) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    streaming.set()

    t = threading.Thread(target=stream)
    t.start()
    assert streaming.wait(60)  # the first event is out: the request is in flight
    assert proc.stop(signal.SIGTERM) == 0
    t.join(30)
    assert events and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][5:])
    assert last["meta_info"]["finish_reason"]["type"] in ("length", "abort")


def test_sigterm_while_the_model_loads_stops_the_load_and_exits_0(start_server, model_path):
    """The load stops at its next layer and the server exits 0 (its thread, killed at exit inside a kernel, had
    aborted the process: "terminate called without an active exception", exit 134)."""
    proc = start_server().wait_loading()
    assert proc.stop(signal.SIGTERM) == 0
    log = proc.log_path.read_text()
    assert "stopped the model's load" in log and "terminate called" not in log


def test_a_model_that_fails_to_load_exits_1_with_its_error(tmp_path, start_server):
    """As vLLM, SGLang and llama-server do, and as process managers expect."""
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(b"GGUF but not really")
    proc = start_server("--model", str(bad))
    assert proc.proc.wait(timeout=120) == 1
    log = proc.log_path.read_text()
    assert "could not load the model" in log and str(bad) in log and "not a GGUF file this server can read" in log
    assert proc.stop() == 1


def test_a_model_that_fails_to_load_is_reported_by_a_server_asked_to_stay_up(tmp_path, start_server):
    """--stay-up-on-load-failure: /health says "failed" (503), and a request gets a 503 naming the flag."""
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF but not really")
    proc = start_server("--model", str(bad), "--stay-up-on-load-failure")
    try:
        health = None
        for _ in range(600):
            with contextlib.suppress(httpx.TransportError):
                health = httpx.get(proc.url + "/health", timeout=5)
                if health.json()["status"] == "failed":
                    break
            assert proc.proc.poll() is None, proc.log_path.read_text()
            time.sleep(0.1)
        assert health is not None and health.status_code == 503 and health.json() == {"status": "failed"}
        r = httpx.post(proc.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        error = r.json()["error"]
        assert r.status_code == 503 and r.headers["retry-after"] and error["type"] == "unavailable"
        assert error["message"].startswith("the model failed to load:") and str(bad) in error["message"]
    finally:
        assert proc.stop() == 0


def test_a_chat_template_given_renders_the_chats_and_a_bad_one_stops_the_start(tmp_path, start_server, model_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    proc = start_server("--chat-template", str(template), "--quantization", "none").wait_ready()
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        with proc.client() as c:
            tokens = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
            text = c.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
            assert text == "system: Be brief.\nuser: Hi\nassistant:"
            answer = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).json()
            assert answer["usage"]["prompt_tokens"] == len(tokens)
    finally:
        assert proc.stop() == 0
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    proc = start_server("--chat-template", str(broken))
    assert proc.proc.wait(timeout=120) == 1
    assert "--chat-template: line 1" in proc.log_path.read_text()
    proc.stop()


def test_a_quantized_kv_cache_holds_more_tokens_in_the_same_memory_and_a_bad_pairing_stops_the_start(start_server):
    """--kv-cache-dtype q8_0: 17/32 of bf16's bytes a value, so the same --kv-cache-mb holds 32/17 the tokens."""
    tokens = {}
    for kv_cache_dtype in ("auto", "q8_0"):
        proc = start_server("--kv-cache-dtype", kv_cache_dtype, "--kv-cache-mb", "64").wait_ready()
        try:
            info = proc.server_info()
            tokens[info["kv_cache_dtype"]] = info["max_total_num_tokens"]
            with proc.client() as c:
                body = {"messages": [{"role": "user", "content": "What does CPU stand for?"}], "max_tokens": 12}
                answer = c.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
            assert "Central Processing Unit" in answer["choices"][0]["message"]["content"]
        finally:
            assert proc.stop() == 0
    assert tokens["int8"] == pytest.approx(tokens["bfloat16"] * 32 / 17, rel=0.01)
    proc = start_server("--kv-cache-dtype", "bf16", "--dtype", "float32")
    assert proc.proc.wait(timeout=120) == 1
    assert "--kv-cache-dtype bf16 needs a bfloat16 model" in proc.log_path.read_text()
    proc.stop()


def test_config_file_keys_are_the_flags_and_flags_win(tmp_path, start_server, model_path):
    config = tmp_path / "fiberserve.yaml"
    config.write_text("fibers: 3\nmax-batch-tokens: 128\nserved_model_name: from-file\n")
    proc = start_server("--config", str(config), "--served-model-name", "from-flag")
    try:
        proc.wait_ready()
        info = proc.server_info()
        assert (info["fibers"], info["max_batch_tokens"], info["served_model_name"]) == (3, 128, "from-flag")
    finally:
        assert proc.stop() == 0


def test_model_and_server_info(server):
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert info["is_generation"] is True and info["model_path"].endswith(".gguf")
        assert info["served_model_name"] == "SmolLM2-135M-Instruct"
        assert c.get("/model_info").json() == info
        assert c.get("/server_info").json()["fibers"] == 2
        assert c.post("/flush_cache").json()["success"] is True
        assert c.get("/health").json() == {"status": "ok"}
        [card] = c.get("/v1/models").json()["data"]
        assert card["id"] == "SmolLM2-135M-Instruct" and card["max_model_len"] == info["max_context_length"] == 8192


def test_generate_list_of_8_equals_single_prompts(server):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with server.client() as c:
        batched = c.post("/generate", json={"text": prompts, "sampling_params": params}).json()
        assert isinstance(batched, list) and len(batched) == 8
        for prompt, result in zip(prompts, batched, strict=True):
            single = c.post("/generate", json={"text": prompt, "sampling_params": params}).json()
            assert single["text"] == result["text"] and single["output_ids"] == result["output_ids"]
            meta = result["meta_info"]
            assert meta["completion_tokens"] == 12 and meta["finish_reason"] == {"type": "length", "length": 12}
            assert meta["prompt_tokens"] > 0 and "cached_tokens" in meta and meta["id"]
    server.assert_idle()


def test_generate_input_ids_max_new_tokens_zero_unknown_and_null_keys(server, tokenizer):
    ids = tokenizer.encode("Hello there")
    with server.client() as c:
        r = c.post(
            "/generate",
            json={
                "input_ids": ids,
                "rid": "my-request-1",
                "sampling_params": {
                    "max_new_tokens": 0,
                    "regex": None,
                    "json_schema": None,
                    "frobnicate": 3,
                    "top_k": None,
                },
            },
        )
        assert r.status_code == 200
        body = r.json()
        assert body["text"] == "" and body["output_ids"] == [] and body["meta_info"]["id"] == "my-request-1"
        assert body["meta_info"]["finish_reason"]["type"] == "length"
        # shortfin's max_completion_tokens is max_new_tokens
        r = c.post("/generate", json={"text": "Hi", "sampling_params": {"max_completion_tokens": 3}}).json()
        assert r["meta_info"]["completion_tokens"] == 3
        lp = c.post(
            "/generate",
            json={
                "text": "Hi",
                "return_logprob": True,
                "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            },
        ).json()
        assert len(lp["meta_info"]["output_token_logprobs"]) == 3
        assert all(len(top) == 2 for top in lp["meta_info"]["output_top_logprobs"])


def test_generate_stream_parses_as_the_sglang_client_parses_it(server):
    payload = {
        "text": "The capital of France is",
        "stream": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
    }
    with server.client() as c:
        full = c.post("/generate", json={**payload, "stream": False}).json()
        with c.stream("POST", "/generate", json=payload) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    pos, text, meta = 0, "", None
    for chunk in lines:  # exactly what sglang.lang.backend.runtime_endpoint does
        if chunk == "data: [DONE]":
            break
        data = json.loads(chunk[5:].strip("\n"))
        text += data["text"][pos:]
        pos += len(data["text"][pos:])
        meta = data["meta_info"]
    assert text == full["text"] and meta["finish_reason"] == full["meta_info"]["finish_reason"]


def test_openai_client_models_completions_and_chat(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    model = models.data[0].id

    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert comp.choices[0].text.startswith(" Paris") and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 8 and comp.usage.total_tokens == comp.usage.prompt_tokens + 8

    stream = client.completions.create(
        model=model,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=30, temperature=0)
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 10

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens

    many = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=1.0,
        n=3,
        seed=11,
        stop=["\n"],
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) > 0 for c in many.choices)
    again = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=1.0, n=3, seed=11, stop=["\n"]
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in many.choices]

    # the access log names each request by the id its answer carries (a batch: the id, numbered)
    batch = client.completions.create(model=model, prompt=["One", "Two"], max_tokens=1)
    server.log_with(f"rid={chat.id}\n")
    server.log_with(f"rid={batch.id}-0 (+1)\n")

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    server.assert_idle()


def test_openai_logit_bias_special_tokens_and_kept_stop_strings(server, tokenizer):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=2)
    (first, first_lp), (second, second_lp) = plain.choices[0].logprobs.top_logprobs[0].items()
    assert first == " Paris" and first_lp > second_lp
    [second_id] = tokenizer.encode(second)

    banned = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        logprobs=2,
        logit_bias={str(tokenizer.encode(first)[0]): -100},
    )
    assert banned.choices[0].text == second
    assert banned.choices[0].logprobs.token_logprobs[0] == pytest.approx(second_lp, abs=1e-5)  # before the bias

    [forced_id] = tokenizer.encode(" London")
    forced = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=1.0, seed=3, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == " London" * 3
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        logit_bias={str(second_id): 100},
    )
    assert chat.choices[0].message.content == second * 2

    # Special tokens are left out of the text unless skip_special_tokens is false (vLLM's extension).
    special = {"max_tokens": 2, "temperature": 0, "logit_bias": {"1": 100}}  # <|im_start|>
    hidden = client.completions.create(model=model, prompt=prompt, **special)
    shown = client.completions.create(model=model, prompt=prompt, **special, extra_body={"skip_special_tokens": False})
    assert (hidden.choices[0].text, shown.choices[0].text) == ("", "<|im_start|>" * 2)
    kept = client.completions.create(
        model=model,
        prompt="1, 2, 3,",
        max_tokens=20,
        temperature=0,
        stop=[" 5"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == " 4, 5" and kept.choices[0].finish_reason == "stop"
    with server.client() as c:  # the same on /generate, under SGLang's names
        native = {"max_new_tokens": 20, "temperature": 0, "stop": [" 5"], "no_stop_trim": True}
        assert c.post("/generate", json={"text": "1, 2, 3,", "sampling_params": native}).json()["text"] == " 4, 5"
        native = {"max_new_tokens": 1, "logit_bias": {"1": 100}, "skip_special_tokens": False}
        assert c.post("/generate", json={"text": prompt, "sampling_params": native}).json()["text"] == "<|im_start|>"
    server.assert_idle()


def test_echo_and_input_logprobs_score_the_prompt_as_lm_eval_asks(server, tokenizer):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    context = "The capital of France is"
    scored = client.completions.create(
        model=model, prompt=context + " Paris", max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    assert choice.text == context + " Paris" and choice.finish_reason == "length"
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (6, 0)
    lp = choice.logprobs
    assert "".join(lp.tokens) == context + " Paris" and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:])
    generated = client.completions.create(model=model, prompt=context, max_tokens=1, temperature=0, logprobs=1)
    assert generated.choices[0].text == " Paris"
    assert lp.token_logprobs[-1] == pytest.approx(generated.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    assert max(lp.top_logprobs[-1], key=lp.top_logprobs[-1].get) == " Paris"  # lm-eval's is_greedy check
    assert lp.top_logprobs[1][" capital"] == lp.token_logprobs[1]  # the chosen token is listed with the top ones

    stream = client.completions.create(model=model, prompt=context, max_tokens=3, temperature=0, echo=True, stream=True)
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0] == context and "".join(texts).startswith(context + " Paris")

    with server.client() as c:  # SGLang's way: return_logprob with logprob_start_len
        body = {"text": context + " Paris", "return_logprob": True, "logprob_start_len": 4, "top_logprobs_num": 1}
        meta = c.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 0}}).json()["meta_info"]
        # from logprob_start_len + 1, as the frontend's token healing reads them
        assert [t for _, t, _ in meta["input_token_logprobs"]] == tokenizer.encode(context + " Paris")[5:]
        assert [lp for lp, _, _ in meta["input_token_logprobs"]] == pytest.approx(lp.token_logprobs[5:], abs=1e-6)
        assert [len(top) for top in meta["input_top_logprobs"]] == [1]
        whole = c.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]
        assert whole["input_token_logprobs"][0][0] is None and whole["input_top_logprobs"][0] is None
        assert len(whole["input_token_logprobs"]) == 6
        two = {"max_new_tokens": 2, "ignore_eos": True}
        outputs_only = c.post("/generate", json={**body, "logprob_start_len": -1, "sampling_params": two}).json()
        assert outputs_only["meta_info"]["input_token_logprobs"] == []
        assert len(outputs_only["meta_info"]["output_token_logprobs"]) == 2
    server.assert_idle()


def test_openai_streams_carry_the_logprobs_of_their_tokens(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    ask = {"model": model, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(messages=messages, **ask).choices[0].logprobs.content
    chunks = client.chat.completions.create(messages=messages, stream=True, **ask)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob, len(t.top_logprobs)) for t in streamed] == [
        (t.token, t.logprob, len(t.top_logprobs)) for t in whole
    ]
    # A stop string holds text back; its tokens' logprobs come with the text, none lost.
    ask = {"model": model, "prompt": "1, 2, 3,", "max_tokens": 20, "temperature": 0, "logprobs": 1, "stop": [" 6"]}
    whole = client.completions.create(**ask).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **ask))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens and len(whole.tokens) > 4
    assert [v for lp in streamed for v in lp.token_logprobs] == whole.token_logprobs
    server.assert_idle()


def test_drafted_tokens_stream_one_by_one_and_are_counted(server):
    """Speculative decoding is on by default: a repeating text drafts, and the reply streamed (several tokens
    land per pass, each still its own chunk) equals the reply whole and the reply with n=2, where both
    sequences share one flight and draft too; /get_server_info and /metrics count the drafts alike."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    before = server.server_info()["spec_decode"]
    ask = {"model": client.models.list().data[0].id, "prompt": "the dog lazy " * 3, "max_tokens": 40}
    whole = client.completions.create(temperature=0, **ask).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(temperature=0, stream=True, **ask) if c.choices]
    pair = client.completions.create(temperature=0, n=2, **ask).choices
    assert "".join(chunks) == whole == pair[0].text == pair[1].text and len(chunks) >= 30
    after = server.server_info()["spec_decode"]
    # (the engine measures plain flights too before it settles on drafting: see engine/speculation.py)
    assert (
        after["accepted_tokens"] - before["accepted_tokens"] > 20 and after["draft_tokens"] >= after["accepted_tokens"]
    )
    assert after["measured"]["up to 1 sequences"]["drafting_flights"] > 0
    metrics = {
        s.name: s.value
        for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
        for s in family.samples
    }
    assert metrics["fiberserve_spec_decode_draft_tokens_total"] == after["draft_tokens"]
    assert metrics["fiberserve_spec_decode_accepted_tokens_total"] == after["accepted_tokens"]
    server.assert_idle()


def test_constrained_decoding_json_schema_choice_and_regex(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a person as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}},
    )
    answer = json.loads(chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop" and set(answer) == {"name", "age"}
    assert isinstance(answer["name"], str) and isinstance(answer["age"], int)

    choices = client.completions.create(
        model=model,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        n=4,
        seed=2,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in choices.choices)
    with server.client() as c:
        phone = {"max_new_tokens": 20, "regex": "[0-9]{3}-[0-9]{4}"}
        out = c.post("/generate", json={"text": "My phone number is ", "sampling_params": phone}).json()
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
        # With no stop token to take (ignore_eos), the grammar itself ends the output.
        ab = {"max_new_tokens": 8, "regex": "ab", "ignore_eos": True}
        out = c.post("/generate", json={"text": "x", "sampling_params": ab}).json()
        assert out["text"] == "ab" and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
        # A grammar of the empty output alone, with no stop token to take: that output, at once.
        empty = {"max_new_tokens": 8, "regex": "", "ignore_eos": True}
        out = c.post("/generate", json={"input_ids": [0], "sampling_params": empty}).json()
        assert out["text"] == "" and out["meta_info"]["finish_reason"]["type"] == "stop"
    server.assert_idle()


def test_a_constraint_no_output_meets_is_a_400_naming_its_field(server):
    """Found before the request is queued where it can be (the empty output only, but min_tokens), else where the
    output reaches the dead end: a 400 naming the field, or in a stream an invalid_request_error event."""
    with server.client() as c:
        only_empty = {"max_new_tokens": 8, "regex": "", "min_new_tokens": 1}
        r = c.post("/generate", json={"input_ids": [[0]], "sampling_params": only_empty})
        assert r.status_code == 400 and r.json()["error"]["param"] == "regex"
        assert "takes only the empty output, but min_tokens asks for 1 token" in r.json()["error"]["message"]
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": "x",
            "max_tokens": 8,
            "min_tokens": 3,
            "guided_choice": ["a"],
        }
        r = c.post("/v1/completions", json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
        assert "guided_choice: no output satisfies it: after 1 token the grammar allows no token" in error["message"]
        events = [line for line in c.post("/v1/completions", json={**body, "stream": True}).text.splitlines() if line]
        failed = json.loads(events[-2].removeprefix("data: "))  # the last event before [DONE]
        assert failed["error"]["type"] == "invalid_request_error" and failed["error"]["code"] == 400
        assert events[-1] == "data: [DONE]"
    server.assert_idle()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The current time"}}


def _is_weather_call(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    return name == "get_weather" and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")


def test_tool_calls_named_required_streamed_and_answered(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    ask = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER, CLOCK],
        "temperature": 0,
        "max_tokens": 80,
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = client.chat.completions.create(tool_choice=named, **ask).choices[0]
    assert forced.finish_reason == "stop" and forced.message.content is None
    [call] = forced.message.tool_calls
    assert call.id.startswith("call_") and _is_weather_call(call.function.name, call.function.arguments)

    required = client.chat.completions.create(tool_choice="required", **ask).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    for c in required.message.tool_calls:
        assert (c.function.name == "get_time" and json.loads(c.function.arguments) == {}) or _is_weather_call(
            c.function.name, c.function.arguments
        )
    single = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, n=3, seed=1, **ask)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)

    # Streamed: a call's arguments arrive in pieces after a first delta that names it (named and required alike);
    # the same calls as unstreamed.
    chunks = list(client.chat.completions.create(tool_choice=named, stream=True, **ask))
    deltas = [ch.choices[0].delta.tool_calls[0] for ch in chunks if ch.choices[0].delta.tool_calls]
    assert len(deltas) > 3 and deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(tool_choice="required", stream=True, **ask))
    pieces = [c for ch in chunks for c in ch.choices[0].delta.tool_calls or []]
    streamed = [[p for p in pieces if p.index == i] for i in range(len(required.message.tool_calls))]
    assert len(pieces) > 2 * len(streamed) and sum(map(len, streamed)) == len(pieces)
    assert [(call[0].function.name, "".join(p.function.arguments for p in call)) for call in streamed] == [
        (c.function.name, c.function.arguments) for c in required.message.tool_calls
    ]
    assert all(call[0].id.startswith("call_") and all(p.id is None for p in call[1:]) for call in streamed)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The call's result goes back as a tool message; with tool_choice "none" the model answers in text.
    history = [
        *ask["messages"],
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(**{**ask, "messages": history, "tool_choice": "none"}).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    server.assert_idle()


def test_auto_tool_choice_answers_text_or_the_calls_the_model_writes(server):
    """Under --tool-call-parser hermes, "auto" (the default with tools) lets the model choose.  SmolLM2 answers in
    text (its template shows no tools), so a regex makes it write a Hermes call for the other branch."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ask = {
        "model": client.models.list().data[0].id,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "temperature": 0,
        "max_tokens": 40,
    }
    plain = client.chat.completions.create(**ask).choices[0]
    text = client.chat.completions.create(tools=[WEATHER, CLOCK], **ask).choices[0]
    assert text.message.tool_calls is None and text.message.content == plain.message.content
    assert text.finish_reason == plain.finish_reason

    arguments = r'\{"city": "[A-Z][a-z]{1,15}", "unit": "(celsius|fahrenheit)"\}'
    call_regex = rf'<tool_call>\n\{{"name": "get_weather", "arguments": {arguments}\}}\n</tool_call>'
    forced = {**ask, "max_tokens": 80, "tools": [WEATHER, CLOCK], "tool_choice": "auto"}
    forced["extra_body"] = {"guided_regex": call_regex}
    answer = client.chat.completions.create(**forced).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    [call] = answer.message.tool_calls
    assert call.id.startswith("call_") and _is_weather_call(call.function.name, call.function.arguments)
    chunks = list(client.chat.completions.create(stream=True, **forced))
    entries = [e for ch in chunks for e in ch.choices[0].delta.tool_calls or []]
    assert [(e.index, e.function.name, e.function.arguments) for e in entries] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
    server.assert_idle()


def test_the_reasoning_parser_splits_thinking_from_the_answer_streamed_or_not(server):
    """Under --reasoning-parser qwen3 an answer that opens with <think> thinks until </think> (a regex makes
    SmolLM2 write one); an answer that does not is all content, as before."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ask = {
        "model": client.models.list().data[0].id,
        "messages": [{"role": "user", "content": "Is the sky blue?"}],
        "temperature": 0,
        "max_tokens": 60,
    }
    plain = client.chat.completions.create(**ask).choices[0].message
    assert plain.content and getattr(plain, "reasoning_content", None) is None
    thinking = r"<think>\nThe sky [a-z]{1,12}\.\n</think>\n\n(Yes|No)\."
    forced = {**ask, "extra_body": {"guided_regex": thinking}}
    message = client.chat.completions.create(**forced).choices[0].message
    assert re.fullmatch(r"\nThe sky [a-z]{1,12}\.\n", message.reasoning_content)
    assert message.reasoning == message.reasoning_content  # vLLM's newer name
    assert message.content in ("Yes.", "No.")
    chunks = list(client.chat.completions.create(stream=True, **forced))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    kept = client.chat.completions.create(
        **{**forced, "extra_body": {**forced["extra_body"], "separate_reasoning": False}}
    )
    assert kept.choices[0].message.content.startswith("<think>\nThe sky ")
    server.assert_idle()


def test_peer_keys_not_honoured_are_refused_by_name_and_grammar_is_gbnf(server):
    """llama.cpp's, vLLM's and OpenAI's keys that fiberserve does not serve get a 400 naming them unless they
    are at their neutral value; llama.cpp's GBNF ``grammar`` and vLLM's ``structured_outputs`` constrain."""
    ask = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 8, "temperature": 0}
    with server.client() as c:
        for key, value in [("typical_p", 0.5), ("mirostat", 2), ("dry_multiplier", 0.8), ("lora", [{"id": 0}]),
                           ("use_beam_search", True), ("priority", 3), ("xtc_probability", 0.5)]:  # fmt: skip
            r = c.post("/v1/chat/completions", json={**ask, key: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == key, (key, r.text)
        neutral = {"typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0, "lora": []}
        assert c.post("/v1/chat/completions", json={**ask, **neutral}).status_code == 200
        r = c.post("/generate", json={"text": "Is the sky blue?", "sampling_params": {"typical_p": 0.5}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "typical_p"
        for constraint in ({"grammar": 'root ::= "yes" | "no"'},
                           {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
                           {"structured_outputs": {"choice": ["yes", "no"]}},
                           {"structured_outputs": {"regex": "(yes|no)"}}):  # fmt: skip
            answer = c.post("/v1/chat/completions", json={**ask, **constraint}).json()
            assert answer["choices"][0]["message"]["content"] in ("yes", "no"), (constraint, answer)
        r = c.post("/v1/chat/completions", json={**ask, "structured_outputs": {"structural_tag": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.structural_tag"
        r = c.post("/v1/chat/completions", json={**ask, "grammar": 'root ::= "yes"', "guided_regex": "no"})
        assert r.status_code == 400
        tokens = c.post("/tokenize", json={"content": "The capital of France is"}).json()["tokens"]
        assert tokens == c.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    server.assert_idle()


@pytest.mark.parametrize(
    ("parser", "calls"),
    [
        ("pythonic", r'\[get_weather\(city="[A-Z][a-z]{1,15}"\)\]'),
        ("functiongemma", r"Let me look\.<start_function_call>call:get_weather\{city:<escape>[A-Z][a-z]{1,15}"
         r"<escape>\}<end_function_call>"),
    ],
)  # fmt: skip
def test_other_families_tool_call_parsers_read_their_format_end_to_end(start_server, model_path, parser, calls):
    """Under --tool-call-parser pythonic or functiongemma a regex makes SmolLM2 write that family's calls:
    answered as calls (with the content before them), streamed too; the other families' formats are tested
    without a server (tests/unit/test_trailing_tools.py)."""
    import openai

    proc = start_server("--tool-call-parser", parser, "--quantization", "none").wait_ready()
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused")
        ask = {
            "model": client.models.list().data[0].id,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "temperature": 0,
            "max_tokens": 80,  # the markers are plain text to SmolLM2: many tokens
            "tools": [WEATHER, CLOCK],
            "extra_body": {"guided_regex": calls},
        }
        content = "Let me look." if parser == "functiongemma" else None
        answer = client.chat.completions.create(**ask).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content == content
        [call] = answer.message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        chunks = list(client.chat.completions.create(stream=True, **ask))
        entries = [e for ch in chunks for e in ch.choices[0].delta.tool_calls or []]
        assert [(e.function.name, e.function.arguments) for e in entries] == [("get_weather", call.function.arguments)]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == (content or "")
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        proc.assert_idle()
    finally:
        assert proc.stop() == 0


def test_continue_final_message_continues_the_assistant_s_words(server, tokenizer):
    """vLLM's ``continue_final_message``: the answer goes on from the final assistant message, as a completion
    of the template rendered with that message left open; without an assistant's message last, a 400."""
    messages = [{"role": "user", "content": "Name a primary colour."}, {"role": "assistant", "content": "One is"}]
    opened = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final=True)
    assert opened.endswith("One is")
    with server.client() as c:
        ask = {"messages": messages, "max_tokens": 12, "temperature": 0, "continue_final_message": True}
        ask["add_generation_prompt"] = False
        chat = c.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]["content"]
        plain = c.post("/v1/completions", json={"prompt": opened, "max_tokens": 12, "temperature": 0}).json()
        assert chat == plain["choices"][0]["text"] and chat
        for wrong in ({**ask, "messages": messages[:1]}, {**ask, "add_generation_prompt": True}):
            r = c.post("/v1/chat/completions", json=wrong)
            assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    server.assert_idle()


def test_the_anthropic_client_gets_the_chat_answer_as_messages_blocks_streamed_or_not(server):
    """``/v1/messages`` through the ``anthropic`` package: the same greedy text as the chat API, stop reasons,
    stop sequences, usage, thinking blocks (the reasoning parser), tool_use blocks and a tool_result turn back,
    streamed events that add up to the message, count_tokens, and a 400 naming a block it cannot take."""
    import anthropic
    import openai

    client = anthropic.Anthropic(base_url=server.url, api_key="unused")
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = chat.models.list().data[0].id
    question = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = {"temperature": 0}  # the client has no sampling arguments of its own: the body carries them
    ask = {"model": model, "max_tokens": 24, "system": "Be brief.", "messages": question, "extra_body": greedy}
    same = [{"role": "system", "content": "Be brief."}, *question]
    expected = chat.chat.completions.create(model=model, messages=same, max_tokens=24, temperature=0).choices[0]
    message = client.messages.create(**ask)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.type == "message"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected.message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected.finish_reason]
    count = client.messages.count_tokens(model=model, system="Be brief.", messages=question)
    assert message.usage.input_tokens == count.input_tokens > 0 and message.usage.output_tokens > 0

    with client.messages.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text and streamed.stop_reason == message.stop_reason
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds

    word = expected.message.content.split()[1]
    stopped = client.messages.create(**{**ask, "stop_sequences": [word]})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)

    thinking = r"<think>\nThe capital is [A-Z][a-z]{2,8}\.\n</think>\n\n[A-Z][a-z]{2,8}\."
    thinks = {**ask, "extra_body": {**greedy, "guided_regex": thinking}}
    thought = client.messages.create(**thinks)
    assert [b.type for b in thought.content] == ["thinking", "text"]
    assert thought.content[0].thinking.startswith("\nThe capital is ") and thought.content[1].text.endswith(".")
    with client.messages.stream(**thinks) as stream:
        blocks = [b.model_dump(include={"type", "text", "thinking"}) for b in stream.get_final_message().content]
    assert blocks == [b.model_dump(include={"type", "text", "thinking"}) for b in thought.content]

    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": city}
    call_regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,15}"\}\}\n</tool_call>'
    weather = {**ask, "max_tokens": 60, "tools": [tool], "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    calls = {**weather, "extra_body": {**greedy, "guided_regex": call_regex}}
    called = client.messages.create(**calls)
    assert called.stop_reason == "tool_use" and [b.type for b in called.content] == ["tool_use"]
    use = called.content[0]
    assert use.name == "get_weather" and set(use.input) == {"city"}
    with client.messages.stream(**calls) as stream:
        assert stream.get_final_message().content[0].input == use.input
    answered = client.messages.create(**{**weather, "messages": [
        *weather["messages"],
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
    ], "tool_choice": {"type": "none"}})  # fmt: skip
    assert answered.content[0].type == "text" and answered.content[0].text

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(**{**ask, "messages": [{"role": "user", "content": [image]}]})
    assert refused.value.body["error"]["param"] == "messages.0.content.0"
    server.assert_idle()


def test_the_openai_responses_api_answers_continues_and_streams(server):
    """``/v1/responses`` through ``openai``'s ``responses``: the chat API's greedy text as an output message,
    instructions, a stored response read back and continued by ``previous_response_id`` (404 for one not
    kept), function calls and their outputs, reasoning items, and streamed events that add up to the answer."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    question = "What is the capital of France?"
    same = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    expected = client.chat.completions.create(model=model, messages=same, max_tokens=24, temperature=0).choices[0]
    ask = {"model": model, "instructions": "Be brief.", "max_output_tokens": 24, "temperature": 0}
    first = client.responses.create(input=question, **ask)
    assert first.id.startswith("resp_") and first.output_text == expected.message.content
    assert first.status == ("completed" if expected.finish_reason == "stop" else "incomplete")
    assert [item.type for item in first.output] == ["message"] and first.usage.input_tokens > 0
    assert client.responses.retrieve(first.id).output_text == first.output_text

    follow = "And of Italy?"
    history = [*same, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": follow}]
    again = client.chat.completions.create(model=model, messages=history, max_tokens=24, temperature=0).choices[0]
    second = client.responses.create(input=follow, previous_response_id=first.id, **ask)
    assert second.output_text == again.message.content and second.previous_response_id == first.id
    items = [{"role": "user", "content": question}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": [{"type": "input_text", "text": follow}]}]  # fmt: skip
    assert client.responses.create(input=items, **ask).output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input=follow, previous_response_id="resp_gone", **ask)

    events = list(client.responses.create(input=question, stream=True, **ask))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first.output_text
    assert events[-1].response.output_text == first.output_text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))

    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": city}
    call_regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,15}"\}\}\n</tool_call>'
    weather = {**ask, "max_output_tokens": 60, "tools": [tool], "extra_body": {"guided_regex": call_regex}}
    called = client.responses.create(input="Weather in Paris?", **weather)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    streamed = list(client.responses.create(input="Weather in Paris?", stream=True, **weather))
    assert [i.type for i in streamed[-1].response.output] == ["function_call"]
    assert streamed[-1].response.output[0].arguments == call.arguments
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    told = client.responses.create(input=[answer], previous_response_id=called.id, tool_choice="none",
                                   **{**ask, "tools": [tool]})  # fmt: skip
    assert told.output[0].type == "message" and told.output_text

    thinking = r"<think>\nThe capital is [A-Z][a-z]{2,8}\.\n</think>\n\n[A-Z][a-z]{2,8}\."
    thought = client.responses.create(input=question, **ask, extra_body={"guided_regex": thinking})
    assert [i.type for i in thought.output] == ["reasoning", "message"]
    assert thought.output[0].content[0].text.startswith("\nThe capital is ")
    r = httpx.post(server.url + "/v1/responses", json={"input": [{"type": "web_search_call"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.type"
    server.assert_idle()


def test_tokenize_and_detokenize_agree_with_what_generation_uses(server, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with server.client() as c:
        prompt = c.post("/tokenize", json={"prompt": "The capital of France is"}).json()
        assert prompt == {"count": 5, "max_model_len": 8192, "tokens": tokenizer.encode("The capital of France is")}
        assert c.post("/detokenize", json={"tokens": prompt["tokens"]}).json() == {"prompt": "The capital of France is"}
        chat = c.post("/tokenize", json={"messages": messages}).json()
        served = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
        assert chat["count"] == len(chat["tokens"]) == served["usage"]["prompt_tokens"]
        text = c.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
        assert text.endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
        bare = c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert chat["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    server.assert_idle()


SGL_PROGRAM = """
import json, sys
import sglang as sgl

@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=MAX_TOKENS))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=MAX_TOKENS))

sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
questions = json.loads(sys.argv[2])
temperature = json.loads(sys.argv[3])
extra = {} if temperature is None else {"temperature": temperature}
if sys.argv[4] == "batch":
    states = multi_turn_question.run_batch(questions, **extra)
else:
    states = [multi_turn_question.run(**q, **extra) for q in questions]
print(json.dumps([{"answer_1": s["answer_1"], "answer_2": s["answer_2"], "error": s.error()} for s in states]))
"""


def run_sgl(server, questions, temperature, mode, max_tokens):
    import subprocess
    import sys

    program = SGL_PROGRAM.replace("MAX_TOKENS", str(max_tokens))
    out = subprocess.run(
        [sys.executable, "-c", program, server.url, json.dumps(questions), json.dumps(temperature), mode],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_original_report_sglang_run_batch(server):
    """The program that first broke batch serving, unchanged: every answer non-empty, no error."""
    questions = [
        {"question_1": "What is the capital of the United States?", "question_2": "List two local attractions."},
        {"question_1": "What is the capital of France?", "question_2": "What is the population of this city?"},
    ]
    states = run_sgl(server, questions, None, "batch", 256)
    assert len(states) == 2
    for s in states:
        assert s["error"] is None
        for answer in (s["answer_1"], s["answer_2"]):
            # sampled at the frontend's default temperature 1.0: any text, but never a run of one character
            assert answer.strip() and len(set(answer.strip())) > 1, answer
    server.assert_idle()


def test_sglang_16_conversations_batched_equal_one_at_a_time(server):
    topics = [
        "France",
        "Japan",
        "Brazil",
        "Egypt",
        "Canada",
        "Italy",
        "India",
        "Kenya",
        "Peru",
        "Spain",
        "Norway",
        "Chile",
        "Ghana",
        "Nepal",
        "Cuba",
        "Iran",
    ]
    questions = [
        {"question_1": f"What is the capital of {t}?", "question_2": "Name one famous landmark there."} for t in topics
    ]
    batched = run_sgl(server, questions, 0, "batch", 24)
    alone = run_sgl(server, questions, 0, "sequential", 24)
    assert batched == alone
    assert all(s["answer_1"].strip() and s["answer_2"].strip() for s in batched)
    server.assert_idle()


def test_load_generator_against_the_real_server(server):
    """`fiberserve bench`'s load generator: counted tokens, a measured first token, no errors."""
    import asyncio

    from fiberserve.bench.loadgen import LoadSpec, run_load

    prompt_tokens = set()
    for api in ("openai", "sglang"):
        for stream in (True, False):
            spec = LoadSpec(server.url, api=api, concurrency=2, requests=4, output_len=8, stream=stream, prompt_words=8)
            result = asyncio.run(run_load(spec))
            assert (result.completed, result.errors, result.output_tokens) == (4, 0, 32), result.first_errors
            assert result.output_tokens_per_s > 0
            if stream:
                assert 0 < result.ttft_p50_ms <= result.e2e_p50_ms
            prompt_tokens.add(result.prompt_tokens)
    # open loop (Poisson arrivals), a new connection per request as for llama-server
    spec = LoadSpec(server.url, rate=50.0, requests=4, output_len=8, prompt_words=8, fresh_connections=True)
    result = asyncio.run(run_load(spec))
    assert (result.completed, result.errors, result.output_tokens) == (4, 0, 32), result.first_errors
    prompt_tokens.add(result.prompt_tokens)
    # the same four prompts each time: every API and mode reports the same prompt tokens, 8+ words each
    assert len(prompt_tokens) == 1 and prompt_tokens.pop() >= 4 * 8
    # the chat workload: streamed, sampled with a seed per request, ending on its own within the limit
    from fiberserve.bench.cli import workload_spec
    from fiberserve.bench.loadgen import CHAT_SYSTEM

    chat = workload_spec("chat", url=server.url, concurrency=2, requests=4, output_len=24)
    assert (chat.stream, chat.ignore_eos, chat.temperature) == (True, False, 0.7)
    result = asyncio.run(run_load(chat))
    assert (result.completed, result.errors) == (4, 0) and 4 <= result.output_tokens <= 4 * 24, result.first_errors
    assert 0 < result.ttft_p50_ms <= result.e2e_p50_ms
    assert result.prompt_tokens > 4 * len(CHAT_SYSTEM.split())  # the system prompt went with every question


def test_bench_run_writes_its_json_table_and_plot(server, tmp_path, capsys):
    """`fiberserve bench run` end to end: a closed-loop level and an open-loop rate, each in the JSON, the
    markdown table (also printed) and the PNG plot."""
    from fiberserve.bench.cli import main as bench

    out = {kind: tmp_path / f"levels.{kind}" for kind in ("json", "md", "png")}
    load = "--concurrency 2 --rate 20 --requests 4 --requests-per-client 2 --output-len 4 --prompt-words 8"
    files = f"--json {out['json']} --markdown {out['md']} --plot {out['png']}"
    argv = ["run", "--url", server.url, *load.split(), *files.split()]
    assert bench(argv) == 0
    levels = json.loads(out["json"].read_text())  # one entry per level
    assert [(lv["spec"]["concurrency"], lv["spec"]["rate"]) for lv in levels] == [(2, None), (1, 20.0)]
    assert [(lv["completed"], lv["errors"], lv["output_tokens"]) for lv in levels] == [(4, 0, 16)] * 2
    table = out["md"].read_text().splitlines()
    assert len(table) == 4 and table[2].startswith("| 2 | - | 4 | 0 |") and table[3].startswith("| 1 | 20.0 | 4 | 0 |")
    assert "\n".join(table) in capsys.readouterr().out
    assert out["png"].read_bytes().startswith(b"\x89PNG")
    server.assert_idle()


def test_an_app_made_without_a_service_loads_its_model_in_its_lifespan(model_path, cache_dir, tmp_path):
    """``create_app(config)`` (no service, no load begun before): the lifespan begins the load, /health says 503
    until it is done, then serves; a file that is no model leaves /health a 503 "failed" and requests a 503
    naming the failure."""
    from starlette.testclient import TestClient

    from fiberserve.config import EngineConfig, ServerConfig
    from fiberserve.server import create_app

    config = ServerConfig(engine=EngineConfig(model=model_path, cache_dir=cache_dir, progress=False))
    with TestClient(create_app(config)) as client:
        codes = []
        for _ in range(600):
            codes.append(client.get("/health").status_code)
            if codes[-1] == 200:
                break
            time.sleep(0.1)
        assert codes[-1] == 200 and set(codes) <= {200, 503}
        r = client.post(
            "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    config = ServerConfig(engine=EngineConfig(model=str(bad), cache_dir=cache_dir), stay_up_on_load_failure=True)
    with TestClient(create_app(config)) as client:
        for _ in range(100):
            r = client.get("/health")
            if "failed" in r.text:
                break
            time.sleep(0.1)
        assert r.status_code == 503 and r.json() == {"status": "failed"}
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and "not a GGUF file" in r.json()["error"]["message"]
