"""Schemathesis over the server's own OpenAPI schema (``/openapi.json``): every route, with requests that follow
the schema and requests that break it; no answer is a 5xx.

A bounded run in the suite (:data:`FUZZ_EXAMPLES` per route and mode); a longer one by hand, e.g.
``FIBERSERVE_FUZZ_EXAMPLES=1000 pytest tests/integration/test_openapi_fuzz.py``.
"""

from __future__ import annotations

import collections
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

pytestmark = pytest.mark.slow

#: Generated requests per route and generation mode.
FUZZ_EXAMPLES = int(os.environ.get("FIBERSERVE_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def server(start_server, model_path):
    # A short context keeps every generated request short: a longer one is refused with a 400 naming the limit.
    proc = start_server("--fibers", "2", "--max-model-len", "64", "--max-body-bytes", "65536").wait_ready()
    yield proc
    assert proc.stop() == 0


def _fuzz(operation, mode: GenerationMode, seen: collections.Counter):
    """A hypothesis test sending ``operation``'s generated requests, counting their statuses into ``seen``."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def call(case) -> None:
        response = case.call_and_validate(checks=[not_a_server_error], timeout=60)
        seen[response.status_code] += 1

    return call


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda mode: mode.value)
def test_no_generated_request_gets_a_server_error(server, mode):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    routes = {"POST /generate", "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages"}
    routes |= {"POST /v1/responses", "POST /v1/embeddings", "POST /v1/rerank"}
    assert routes <= {op.label for op in operations}
    failures, statuses = [], {}
    for operation in operations:
        seen = statuses.setdefault(operation.label, collections.Counter())
        call = _fuzz(operation, mode, seen)
        try:
            call()
        except Unsatisfiable:  # a route with no parameters and no body has nothing to break
            assert mode is GenerationMode.NEGATIVE and not operation.body and not operation.query
        except Exception as exc:  # the first failing request of this route, as hypothesis shrank it
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
    print(mode.value, {label: dict(counts) for label, counts in statuses.items()})
    for label in ("POST /generate", "POST /v1/completions", "POST /v1/chat/completions"):
        assert statuses[label].total() >= FUZZ_EXAMPLES // 2, (label, statuses[label])
    server.assert_idle()


def test_a_request_without_a_token_limit_gets_what_the_context_leaves(server):
    """The APIs' default limits (chat 512, completions 16, /generate 128) are cut to the context after the prompt,
    as vLLM's default is that remainder; a limit the client gives is refused where it does not fit."""
    chat = {"messages": [{"role": "user", "content": "Count to a thousand."}], "temperature": 0, "ignore_eos": True}
    with server.client(timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/chat/completions", json={**chat, "max_tokens": 512})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
