"""``/v1/embeddings`` and ``/v1/rerank`` on a real server: the ``openai`` client's embeddings, httpx for the rest."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from tests.integration.engine_utils import QUESTIONS
from tests.tiny_models import RERANK_TEMPLATE, write_tiny_reranker

pytestmark = pytest.mark.slow

TEXTS = QUESTIONS[:5]


@pytest.fixture(scope="module")
def server(start_server, model_path):
    proc = start_server("--fibers", "2").wait_ready()
    yield proc
    assert proc.stop() == 0


def _embedding(client: httpx.Client, **body) -> list[list[float]]:
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    return [entry["embedding"] for entry in response.json()["data"]]


def test_the_openai_client_s_embeddings_batched_equal_each_alone_as_floats_or_base64(server, tokenizer):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    batch = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    assert [entry.index for entry in batch.data] == list(range(len(TEXTS)))
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    alone = [client.embeddings.create(model=model, input=t, encoding_format="float").data[0].embedding for t in TEXTS]
    assert [entry.embedding for entry in batch.data] == alone  # bit for bit
    for vector in alone:
        assert len(vector) == 576 and math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-5)
    assert len({tuple(v[:8]) for v in alone}) == len(TEXTS)
    with server.client() as c:
        ids = [tokenizer.encode(t) for t in TEXTS[:2]]
        assert _embedding(c, input=ids) == alone[:2] and _embedding(c, input=ids[0]) == alone[:1]
        [raw] = _embedding(c, input=TEXTS[0], normalize=False)
        norm = math.sqrt(math.fsum(x * x for x in raw))
        assert norm > 2 and max(abs(x / norm - y) for x, y in zip(raw, alone[0], strict=True)) < 1e-6
    server.assert_idle()


def test_related_texts_embed_closer_and_rerank_orders_documents_by_their_cosine(server):
    """The embedded model has no score head: its documents are ranked by their embeddings' cosine similarity to
    the query's, best first, cut to ``top_n``."""
    query, documents = "What is the capital of France?", ["Paris is the capital of France.", "Bananas are yellow.",
                                                          "The capital city of France is Paris."]  # fmt: skip
    with server.client() as c:
        vectors = [torch.tensor(v) for v in _embedding(c, input=[query, *documents])]
        cosines = [float(vectors[0] @ v) for v in vectors[1:]]
        assert min(cosines[0], cosines[2]) > cosines[1]
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            answer = c.post(path, json={"query": query, "documents": documents, "top_n": 2}).json()
            assert [r["index"] for r in answer["results"]] == sorted(range(3), key=lambda i: -cosines[i])[:2]
            for result in answer["results"]:
                assert result["relevance_score"] == pytest.approx(cosines[result["index"]], abs=1e-5)
                assert result["document"] == {"text": documents[result["index"]]}
        bare = c.post("/v1/rerank", json={"query": query, "documents": documents, "return_documents": False}).json()
        assert len(bare["results"]) == 3 and all("document" not in r for r in bare["results"])
        assert bare["usage"]["total_tokens"] > 0 and bare["model"] == answer["model"]
    server.assert_idle()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["fine", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1.5, 2]}, "input"),
        ({"input": [[1, 2], "mixed"]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "x " * 9000}, "input"),
        ({"input": "hi", "dimensions": 7}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
        ({"input": "hi", "normalize": "yes"}, "normalize"),
        ({}, "input"),
    ],
)
def test_a_bad_embeddings_body_is_a_400_naming_its_field(server, body, field):
    with server.client() as c:
        response = c.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    server.assert_idle()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a", 3]}, "documents.1"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": "q", "documents": ["a", ""]}, "query"),
    ],
)
def test_a_bad_rerank_body_is_a_400_naming_its_field(server, body, field):
    with server.client() as c:
        response = c.post("/v1/rerank", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    c_model = {"query": "q", "documents": ["a"], "model": "another"}
    with server.client() as c:
        assert c.post("/v1/rerank", json=c_model).status_code == 404
        assert c.post("/v1/embeddings", json={"input": "a", "model": "another"}).status_code == 404


def test_a_reranker_s_score_head_scores_each_query_document_prompt(start_server, model_path, tmp_path):
    """A file with a score head (``cls.output``, as llama.cpp's converter writes a Qwen3-Reranker) scores each pair's
    prompt, its rerank template filled in, by the softmax probability of the head's first row ("yes") over the last
    token's final hidden state, which ``/v1/embeddings`` gives for the same prompt (``normalize`` false)."""
    path, head = write_tiny_reranker(tmp_path / "reranker.gguf", model_path)
    query, documents = "capital of France", ["Paris", "Bananas are yellow.", "Berlin is in Germany."]
    proc = start_server("--model", str(path)).wait_ready()
    try:
        with proc.client() as c:
            answer = c.post("/v1/rerank", json={"query": query, "documents": documents}).json()
            expected = []
            for document in documents:
                text = RERANK_TEMPLATE.replace("{query}", query).replace("{document}", document)
                ids = c.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
                [hidden] = _embedding(c, input=ids, normalize=False)
                expected.append(float(torch.softmax(head @ torch.tensor(hidden), dim=0)[0]))
            assert len(set(expected)) == 3
            assert [r["index"] for r in answer["results"]] == sorted(range(3), key=lambda i: -expected[i])
            for result in answer["results"]:
                assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-6)
            assert answer["usage"]["total_tokens"] > 3 * len(RERANK_TEMPLATE) // 8
        proc.assert_idle()
    finally:
        assert proc.stop() == 0
