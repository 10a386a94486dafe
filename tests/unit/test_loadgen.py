"""The load generator's pure parts: prompts, per-level seeds, what counts as a first token."""

from __future__ import annotations

import pytest

from fiberserve.bench.cli import _levels
from fiberserve.bench.loadgen import LoadSpec, _body, _carries_text, make_prompts


def test_prompts_are_distinct_and_reproducible():
    prompts = make_prompts(32, 40, seed=3)
    assert len(set(prompts)) == 32 and prompts == make_prompts(32, 40, seed=3)
    assert all(len(p.split()) == 42 for p in prompts)  # "Request i:" + 40 words


def test_every_level_gets_prompts_of_its_own():
    specs = _levels(LoadSpec(url="http://127.0.0.1:1", requests=8), [1, 4, 16], [2.0], requests_per_client=2)
    assert [s.concurrency for s in specs] == [1, 4, 16, 1] and [s.requests for s in specs] == [8, 8, 32, 8]
    seeds = [s.seed for s in specs]
    assert len(set(seeds)) == len(seeds)
    first_prompts = [set(make_prompts(s.requests, s.prompt_words, s.seed)) for s in specs]
    assert not first_prompts[0] & first_prompts[1]


@pytest.mark.parametrize(
    "chunk,has_text",
    [
        ({"choices": [{"text": " Paris", "index": 0}]}, True),
        ({"choices": [{"text": "", "index": 0}]}, False),
        ({"choices": [{"delta": {"role": "assistant"}, "index": 0}]}, False),
        ({"choices": [{"delta": {"content": "Hi"}, "index": 0}]}, True),
        ({"choices": [], "usage": {"completion_tokens": 3}}, False),
        ({"text": "Paris", "meta_info": {}}, True),
        ({"text": "", "meta_info": {}}, False),
    ],
)
def test_time_to_first_token_waits_for_text(chunk, has_text):
    assert _carries_text(chunk) is has_text


@pytest.mark.parametrize("workload", ["forced", "chat"])
def test_requests_take_several_models_in_turn(workload):
    spec = LoadSpec(url="http://x", workload=workload, models=("base", "one", "two"))
    assert [_body(spec, "hi", i)[1]["model"] for i in range(5)] == ["base", "one", "two", "base", "one"]
    assert _body(LoadSpec(url="http://x", workload=workload, model="m"), "hi", 3)[1]["model"] == "m"
    assert "model" not in _body(LoadSpec(url="http://x", workload=workload), "hi", 0)[1]
