"""fiberserve on Ray Serve: two replicas of one thread each on a local Ray cluster, one endpoint, real clients."""

from __future__ import annotations

import asyncio
import signal

import httpx
import openai
import pytest

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
    assert server.stop(signal.SIGTERM, timeout=120) == 0, server.log_path.read_text()[-3000:]


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
