"""fiberserve on Ray Serve: two replicas of one thread each on a local Ray cluster, one endpoint, real clients;
prefix-aware routing; a replica killed under load (last: it changes the cluster)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.server_utils import ServerProcess
from tests.integration.test_server import run_sgl

pytestmark = pytest.mark.slow

PROMPTS = [f"Tell me one fact about {topic}." for topic in ("France", "Japan", "Peru", "Kenya", "Norway", "Chile")]


@pytest.fixture(scope="module")
def cluster(cache_dir, tmp_path_factory):
    """``fiberserve serve --replicas 2``: Ray started once for the module, stopped by SIGTERM at its end."""
    server = ServerProcess(
        "--replicas", "2", "--threads-per-fiber", "1", cache_dir=cache_dir, log_dir=tmp_path_factory.mktemp("ray")
    )
    server.wait_ready(timeout=300)
    yield server
    # SIGTERM drains: a request in flight when it comes still gets its whole answer
    answers = []
    params = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}
    body = {"text": "Count to fifty:", "sampling_params": params}
    in_flight = threading.Thread(
        target=lambda: answers.append(httpx.post(server.url + "/generate", json=body, timeout=120))
    )
    in_flight.start()
    time.sleep(1)
    assert server.stop(signal.SIGTERM, timeout=120) == 0, server.log_path.read_text()[-3000:]
    in_flight.join()
    assert answers[0].status_code == 200 and len(answers[0].json()["output_ids"]) == 96


async def _generate_all(url: str, prompts: list[str], tokens: int) -> list[dict]:
    params = {"max_new_tokens": tokens, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        answers = await asyncio.gather(
            *(client.post("/generate", json={"text": p, "sampling_params": params}) for p in prompts)
        )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [a.json() for a in answers]


def test_greedy_answers_through_the_replicas_equal_one_engines(cluster, cache_dir):
    from fiberserve import LLM, SamplingParams

    served = asyncio.run(_generate_all(cluster.url, PROMPTS * 2, 24))
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    with LLM(cache_dir=cache_dir, progress=False, threads_per_fiber=1) as llm:
        alone = [llm.generate([prompt], greedy)[0].outputs[0].token_ids for prompt in PROMPTS]
    assert [answer["output_ids"] for answer in served] == alone * 2


def test_both_replicas_answer(cluster):
    replicas = set()
    with cluster.client() as client:
        for _ in range(40):
            replica = client.get("/get_server_info").json()["replica"]
            replicas.add((replica["host"], replica["pid"]))
            if len(replicas) == 2:
                break
    assert len(replicas) == 2
    health = httpx.get(cluster.url + "/health").json()
    assert health == {"status": "ok", "replicas": {"running": 2, "target": 2}}


def test_the_openai_client_streams_through_the_endpoint(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sglang_run_batch_through_the_replicas_equals_one_at_a_time(cluster):
    questions = [
        {"question_1": f"What is the capital of {country}?", "question_2": "Name one thing to see there."}
        for country in ("France", "Japan", "Egypt", "Canada")
    ]
    batched = run_sgl(cluster, questions, 0.0, "batch", 32)
    sequential = run_sgl(cluster, questions, 0.0, "seq", 32)
    assert all(s["error"] is None for s in batched)
    assert batched == sequential


def _chat(url: str, system: str, question: str) -> tuple[str, int, int]:
    """(the replica that answered, prompt tokens, of them from its prefix cache)."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    r = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 2, "temperature": 0}, timeout=120)
    usage = r.json()["usage"]
    return r.headers["x-fiberserve-replica"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_requests_sharing_a_long_prefix_go_to_the_replica_that_served_it(cluster):
    systems = [
        f"You are assistant {k}. " + "Answer carefully and briefly, citing facts where you can. " * 6 for k in range(6)
    ]
    served: dict[int, set[str]] = {k: set() for k in range(len(systems))}
    cached = []
    for round_ in range(3):  # one at a time: load stays balanced, so the prefix decides
        for k, system in enumerate(systems):
            replica, prompt, hit = _chat(cluster.url, system, f"Question {round_}-{k}: what is {k} plus {round_}?")
            served[k].add(replica)
            if round_:
                cached.append(hit / prompt)
    assert all(len(replicas) == 1 for replicas in served.values()), served
    assert len(set().union(*served.values())) == 2  # new prefixes still spread over both replicas
    assert min(cached) > 0.5  # every repeat found its system prompt's pages


def _metrics(url: str) -> dict[tuple[str, str, str], float]:
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
    return {
        (s.name, s.labels.get("replica", ""), s.labels.get("state", "")): s.value for f in families for s in f.samples
    }


def test_metrics_hold_every_replicas_series_labelled(cluster):
    time.sleep(3)  # a push interval: the replicas' latest counts
    samples = _metrics(cluster.url)
    replicas = {replica for name, replica, _ in samples if name == "fiberserve_generation_tokens_total"}
    assert len(replicas) == 2 and "" not in replicas
    assert sum(v for (name, _, _), v in samples.items() if name == "fiberserve_generation_tokens_total") > 0


def test_an_adapter_loaded_through_the_endpoint_serves_on_every_replica_until_unloaded(cluster, model_path, tmp_path):
    from fiberserve.model import load_checkpoint
    from tests.lora_adapters import write_random_adapter

    path = write_random_adapter(tmp_path / "tuned", load_checkpoint(model_path).config, rank=8, alpha=16, seed=1)

    def chat(client: httpx.Client, model: str, k: int) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": f"Topic {k}: name a colour."}]}
        return client.post("/v1/chat/completions", json={**body, "max_tokens": 8, "temperature": 0})

    with cluster.client() as client:
        base = client.get("/v1/models").json()["data"][0]["id"]
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(path)})
        assert loaded.status_code == 200, loaded.text
        answered: dict[str, str] = {}  # replica -> the adapter's answer to prompt 0 there
        for _ in range(40):  # one at a time, short prompts: the replicas take them in turn
            tuned = chat(client, "tuned", 0)
            assert tuned.status_code == 200 and tuned.json()["model"] == "tuned", tuned.text
            answered[tuned.headers["x-fiberserve-replica"]] = tuned.json()["choices"][0]["message"]["content"]
            if len(answered) == 2:
                break
        assert len(answered) == 2, answered
        plain = chat(client, base, 0).json()["choices"][0]["message"]["content"]
        assert len(set(answered.values())) == 1 and plain not in answered.values(), (answered, plain)
        listed = set()
        for _ in range(40):
            models = client.get("/v1/models")
            assert "tuned" in [m["id"] for m in models.json()["data"]]
            listed.add(models.headers["x-fiberserve-replica"])
            if len(listed) == 2:
                break
        assert listed == set(answered)

        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"})
        assert unloaded.status_code == 200, unloaded.text
        refused = set()
        for k in range(40):
            answer = chat(client, "tuned", k)
            assert answer.status_code == 404 and answer.json()["error"]["param"] == "model", answer.text
            refused.add(answer.headers["x-fiberserve-replica"])
            if len(refused) == 2:
                break
        assert refused == set(answered)


def _replica_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ServeReplica:fiberserve:EngineReplica"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def test_a_replica_killed_under_load(cluster):
    """kill -9 of one replica: requests that had received nothing are retried on the other; streams cut short end
    with an error naming the cause; nothing on the healthy replica fails; /health degrades, then recovers; the
    survivor holds no pages afterwards."""
    results: list[tuple[bool, str | None, bool]] = []  # (streamed, replica, completed)

    def request(i: int) -> None:
        stream = i % 2 == 0
        params = {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}
        body = {"text": f"Request {i}: count slowly to one hundred:", "sampling_params": params, "stream": stream}
        with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=300) as r:
            text = b"".join(r.iter_bytes()).decode()
            completed = r.status_code == 200 and '"error"' not in text
            if stream:
                completed = completed and text.rstrip().endswith("data: [DONE]")
                assert completed or "the replica serving this request failed: ActorDiedError" in text, text[-300:]
            results.append((stream, r.headers.get("x-fiberserve-replica"), completed))

    threads = [threading.Thread(target=request, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    time.sleep(3)  # the streams have begun
    victim, survivors = _replica_pids()[0], _replica_pids()[1:]
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join()
    assert len(results) == 24
    failed = [(stream, replica) for stream, replica, completed in results if not completed]
    assert all(stream for stream, _ in failed), "a request that had received nothing was not retried"
    # Every failure is on one replica, the killed one (which may have finished requests before it was killed).
    assert len({replica for _, replica in failed}) <= 1, f"requests failed on more than one replica: {failed}"
    deadline = time.monotonic() + 120
    while (health := httpx.get(cluster.url + "/health").json())["status"] != "ok":
        assert health["status"] == "degraded" and time.monotonic() < deadline, health
        time.sleep(1)
    assert len(_replica_pids()) == 2 and survivors[0] in _replica_pids()
    deadline = time.monotonic() + 30  # the dead replica's last series go stale; the live ones are pushed again
    while True:
        pages = {
            (replica, state): v
            for (name, replica, state), v in _metrics(cluster.url).items()
            if name == "fiberserve_kv_pages"
        }
        used = [v for (_, state), v in pages.items() if state == "used"]
        if len(used) == 2 and not any(used):
            break
        assert time.monotonic() < deadline, pages
        time.sleep(1)
