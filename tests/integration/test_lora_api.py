"""LoRA adapters on a real server: ``--lora-modules`` (a PEFT directory and a GGUF adapter), ``/v1/models``,
the ``openai`` client selecting an adapter by ``model`` in mixed concurrent batches, SGLang's ``lora_path``, the
prefix cache kept apart per adapter, and loading and unloading while serving behind ``--api-key``."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from fiberserve.model import load_checkpoint
from tests.lora_adapters import write_gguf_adapter, write_random_adapter

pytestmark = pytest.mark.slow

KEY = "secret-key"
PROMPT = "Name three things people keep in a kitchen drawer."


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_path) -> dict:
    root = tmp_path_factory.mktemp("adapters")
    config = load_checkpoint(model_path).config
    one = write_random_adapter(root / "one", config, rank=8, alpha=16, seed=1)
    three = write_random_adapter(root / "three", config, rank=16, alpha=16, seed=3)
    write_random_adapter(root / "two-peft", config, rank=8, alpha=8, seed=2)
    two = write_gguf_adapter(
        root / "two-peft", root / "two.gguf", alpha=8, heads=(config.num_heads, config.num_kv_heads)
    )
    wide = write_random_adapter(root / "wide", config, rank=128, alpha=16, seed=4)  # over --max-lora-rank
    return {"one": one, "two": two, "three": three, "wide": wide, "root": root}


@pytest.fixture(scope="module")
def server(start_server, adapters):
    flags = ["--fibers", "2", "--api-key", KEY, "--open-paths", "/health", "/get_server_info", "--check-integrity"]
    flags += ["--max-lora-rank", "64", "--max-loras", "3"]
    proc = start_server(*flags, "--lora-modules", f"one={adapters['one']}", f"two={adapters['two']}").wait_ready()
    yield proc
    assert proc.stop() == 0


def _client(server) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {KEY}"})


def _chat(client: httpx.Client, model: str, prompt: str = PROMPT, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    response = client.post("/v1/chat/completions", json={**body, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_each_adapter_as_a_model_whose_parent_is_the_base(server, adapters):
    with _client(server) as c:
        models = c.get("/v1/models").json()["data"]
    base = models[0]["id"]
    assert [(m["id"], m["parent"]) for m in models] == [(base, None), ("one", base), ("two", base)]
    assert models[1]["root"] == str(adapters["one"]) and models[2]["root"] == str(adapters["two"])


def test_each_adapter_answers_otherwise_and_mixed_concurrent_batches_equal_each_alone(server):
    """Greedy answers of the base and two adapters, asked one at a time and then all at once through the
    ``openai`` client (one flight holds all three): the same text each way; the adapters change the answer."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY)
    base = server.client().get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
    models = [base, "one", "two"]
    prompts = [PROMPT, "Why is the sky blue?"]

    async def ask(model: str, prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        assert answer.model == model
        return answer.choices[0].message.content

    async def run() -> tuple[list[str], list[str]]:
        pairs = [(m, p) for m in models for p in prompts]
        alone = [await ask(m, p) for m, p in pairs]
        together = await asyncio.gather(*(ask(m, p) for m, p in pairs * 2))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone * 2
    assert len({alone[0], alone[2], alone[4]}) == 3  # base, one and two each answer otherwise
    server.assert_idle()


def test_sglang_lora_path_picks_each_prompt_s_adapter(server):
    with _client(server) as c:
        base = c.get("/v1/models").json()["data"][0]["id"]
        texts = [_chat(c, name)["choices"][0]["message"]["content"] for name in (base, "one")]
        prompt_ids = c.post("/tokenize", json={"messages": [{"role": "user", "content": PROMPT}]}).json()["tokens"]
        params = {"max_new_tokens": 24, "temperature": 0}
        body = {"input_ids": [prompt_ids, prompt_ids], "sampling_params": params, "lora_path": [None, "one"]}
        answers = c.post("/generate", json=body).json()
        assert [a["text"] for a in answers] == texts
        one = c.post("/generate", json={"input_ids": prompt_ids, "sampling_params": params, "lora_path": "one"})
        assert one.json()["text"] == texts[1]
        refused = c.post("/generate", json={"input_ids": prompt_ids, "lora_path": "missing"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_path"
        assert "'missing'" in refused.json()["error"]["message"]
        uneven = c.post("/generate", json={"input_ids": [prompt_ids], "lora_path": ["one", "two"]})
        assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "lora_path"
        unknown = c.post(
            "/v1/chat/completions", json={"model": "nobody", "messages": [{"role": "user", "content": "x"}]}
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        assert "'one', 'two'" in unknown.json()["error"]["message"]


def test_a_prefix_cached_under_one_adapter_never_serves_another(server):
    """The same long prompt under the base model, then under an adapter: the adapter's first request finds no
    cached prefix (the base's K/V are not its own), its second finds its own; the answers are equal either way."""
    prompt = "Here is a story about a lighthouse keeper and a storm. " * 12

    def complete(c: httpx.Client, model: str) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        response = c.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    with _client(server) as c:
        complete(c, c.get("/v1/models").json()["data"][0]["id"])
        first, again = complete(c, "two"), complete(c, "two")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_adapters_load_and_unload_while_serving(server, adapters, tmp_path):
    with _client(server) as c:
        load = c.post("/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": str(adapters["three"])})
        assert load.status_code == 200, load.text
        assert load.json()["rank"] == 16
        assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["one", "two", "three"]
        answer = _chat(c, "three")["choices"][0]["message"]["content"]

        def refused(path: str, body: dict, status: int, field: str, words: str) -> None:
            response = c.post(path, json=body)
            assert response.status_code == status, response.text
            assert response.json()["error"]["param"] == field and words in response.json()["error"]["message"]

        refused("/v1/load_lora_adapter", {"lora_name": "four", "lora_path": str(adapters["one"])}, 400, "lora_name",
                "--max-loras 3")  # fmt: skip
        refused("/v1/unload_lora_adapter", {"lora_name": "nobody"}, 404, "lora_name", "'nobody'")
        # A request still running under an adapter keeps it loaded.
        with c.stream("POST", "/v1/chat/completions", json={
            "model": "three", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 400,
            "ignore_eos": True, "stream": True,
        }) as streaming:  # fmt: skip
            lines = streaming.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            refused("/v1/unload_lora_adapter", {"lora_name": "three"}, 409, "lora_name", "unfinished")
            for _ in lines:
                pass
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "three"}).status_code == 200
        gone = c.post("/v1/chat/completions", json={"model": "three", "messages": [{"role": "user", "content": "x"}]})
        assert gone.status_code == 404
        # Loaded again under the same name: the same answer (nothing cached under the old load serves it).
        assert c.post("/load_lora_adapter", json={"lora_name": "three", "lora_path": str(adapters["three"])}).is_success
        assert _chat(c, "three")["choices"][0]["message"]["content"] == answer
        assert c.post("/unload_lora_adapter", json={"lora_name": "three"}).status_code == 200

        base = c.get("/v1/models").json()["data"][0]["id"]
        refused("/v1/load_lora_adapter", {"lora_name": "one", "lora_path": str(adapters["one"])}, 400, "lora_name",
                "already served")  # fmt: skip
        refused("/v1/load_lora_adapter", {"lora_name": base, "lora_path": str(adapters["one"])}, 400, "lora_name",
                "already served")  # fmt: skip
        refused("/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(adapters["wide"])}, 400, "lora_path",
                "rank 128 is over --max-lora-rank 64")  # fmt: skip
        missing = str(tmp_path / "nowhere")
        refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": missing}, 400, "lora_path", missing)
        shutil.copytree(adapters["one"], tmp_path / "broken")
        (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
        refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "broken")}, 400, "lora_path",
                "adapter_config.json: not JSON")  # fmt: skip
    keyless = server.client().post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": missing})
    assert keyless.status_code == 401
    server.assert_idle()


def test_a_bad_adapter_at_start_stops_the_server_naming_it(start_server, adapters):
    server = start_server("--lora-modules", f"wide={adapters['wide']}", "--max-lora-rank", "64")
    assert server.proc.wait(120) != 0
    server.stop()
    log = server.log_path.read_text()
    assert "rank 128 is over --max-lora-rank 64" in log and str(adapters["wide"]) in log
