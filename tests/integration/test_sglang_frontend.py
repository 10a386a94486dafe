"""SGLang's frontend (``sgl.RuntimeEndpoint``, unchanged) against a real server: every primitive its programs use.

The frontend runs in a child process (it keeps global state); the test reads what it printed.  ``select``'s
decisions are checked against the model's own logprobs, computed here with ``LlamaModel`` directly.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
import torch

from fiberserve.model import ForwardBatch, KVCache, LlamaModel, SequenceSpan, load_checkpoint

pytestmark = pytest.mark.slow

PREFIX = "Question: What is the capital of France?\nAnswer: The capital of France is"
CHOICES = [" Paris", " London", " the city of Lyon", " Berlin"]
METHODS = ["token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized"]

PROGRAM = r"""
import json, sys
import sglang as sgl
from sglang.lang import choices as methods

PREFIX, CHOICES, METHODS = json.loads(sys.argv[2])


@sgl.function
def pick(s, method):
    s += PREFIX + sgl.select("city", choices=CHOICES, choices_method=getattr(methods, method))


@sgl.function
def react(s, question):
    s += "You answer by searching first.\nQuestion: " + question + "\nAction:"
    s += sgl.select("action", choices=[" Search", " Finish"])
    s += " [" + sgl.gen("argument", max_tokens=8, stop="]", temperature=0) + "]"


@sgl.function
def typed(s):
    s += "Q: What is 12 times 12?\nA (a number):" + sgl.gen("int", dtype=int, max_tokens=8, temperature=0)
    s += "\nQ: What is pi to two decimals?\nA:" + sgl.gen("float", dtype=float, max_tokens=8, temperature=0)
    s += "\nQ: Is Paris in France?\nA:" + sgl.gen("bool", dtype=bool, max_tokens=4, temperature=0)
    s += "\nQ: Name a colour in quotes.\nA: " + sgl.gen("str", dtype=str, max_tokens=12, temperature=0)
    s += "\nPhone: " + sgl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=12, temperature=0)
    s += "\nColour:" + sgl.gen("colour", choices=[" red", " green", " blue"])
    s += "\nList three fruits:" + sgl.gen("stopped", stop=[","], max_tokens=32, temperature=0)
    s += "\nSay nothing:" + sgl.gen("long", min_tokens=6, max_tokens=6, temperature=0, stop=["\n"])


@sgl.function
def forked(s):
    s += "Two facts about the sea.\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=12, temperature=0, stop="\n")
    forks.join()
    s += "Done."


@sgl.function
def streamed(s):
    s += "Count from one to five:" + sgl.gen("count", max_tokens=16, temperature=0)


sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
out = {}
for method in METHODS:
    state = pick.run(method=method)
    meta = state.get_meta_info("city")
    out[method] = {"decision": state["city"], "meta": meta}


@sgl.function
def healed(s):
    s += "The capital of France is " + sgl.select("city", choices=["Paris", "London"])


state = healed.run()
out["healed"] = {"decision": state["city"], "meta": state.get_meta_info("city")}
questions = ["Who wrote Hamlet?", "What is 2 + 2?", "Where is Peru?", "What is a prime number?"]
batch = react.run_batch([{"question": q} for q in questions])
alone = [react.run(question=q) for q in questions]
out["react"] = [[s["action"], s["argument"]] for s in batch]
out["react_alone"] = [[s["action"], s["argument"]] for s in alone]
out["react_errors"] = [s.error() for s in batch + alone]
t = typed.run()
out["typed"] = {k: t[k] for k in ["int", "float", "bool", "str", "phone", "colour", "stopped", "long"]}
out["typed_meta"] = {k: t.get_meta_info(k) for k in ["int", "long"]}
f = forked.run()
out["forked"] = {"facts": f["fact"], "text": f.text()}
stream = streamed.run(stream=True)
out["stream_pieces"] = list(stream.text_iter(var_name="count"))
out["stream_whole"] = streamed.run()["count"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def server(start_server):
    proc = start_server().wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def frontend(server):
    """What the frontend program printed."""
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM, server.url, json.dumps([PREFIX, CHOICES, METHODS])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(model_path, server):
    """The model as the server computes it (its default dtype and quantization)."""
    info = server.server_info()
    dtype = torch.bfloat16 if info["dtype"] == "bfloat16" else torch.float32
    return LlamaModel(load_checkpoint(model_path), dtype=dtype, quantization=info["quantization"])


def token_logprobs(model: LlamaModel, ids: list[int]) -> list[float | None]:
    """Each token's logprob given the ones before it (None for the first), from one forward pass."""
    n, page = len(ids), 16
    pages = (n + page - 1) // page
    cache = KVCache(model.config, pages, page, model.dtype, "cpu")
    slots = torch.arange(pages * page)
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), slots[:n], [SequenceSpan(0, n, n, slots)], torch.arange(n))
    logprobs = torch.log_softmax(model.forward(batch, cache).float(), dim=-1)
    return [None] + [float(logprobs[i - 1, ids[i]]) for i in range(1, n)]


def test_select_picks_what_the_models_own_logprobs_pick_by_every_method(frontend, model, tokenizer):
    from sglang.lang import choices as methods

    prefix_len = len(tokenizer.encode(PREFIX))
    for method in METHODS:
        got = frontend[method]
        entries = got["meta"]["input_token_logprobs"]
        reference_entries, unconditional = [], []
        for choice, served in zip(CHOICES, entries, strict=True):
            ids = tokenizer.encode(PREFIX + choice)
            full = token_logprobs(model, ids)
            tail = len(served)
            assert [token for _, token, _ in served] == ids[-tail:]  # the frontend kept these, healing applied
            assert [text for _, _, text in served] == [
                tokenizer.decode([t], skip_special_tokens=False) for t in ids[-tail:]
            ]
            assert [lp for lp, _, _ in served] == pytest.approx(full[-tail:], abs=1e-4)
            assert len(ids) - tail in (prefix_len - 1, prefix_len)  # from the prefix's last token, or after it
            reference_entries.append([[lp, t, None] for lp, t in zip(full[-tail:], ids[-tail:], strict=True)])
            unconditional.append([[lp, None, None] for lp in token_logprobs(model, ids[-tail:])])
        normalized = [sum(e[0] for e in es) / len(es) for es in reference_entries]
        decision = getattr(methods, method)(
            choices=CHOICES,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=reference_entries,
            output_token_logprobs=[[] for _ in CHOICES],
            unconditional_token_logprobs=unconditional,
        ).decision
        assert got["decision"] == decision, method
        if method == "unconditional_likelihood_normalized":
            served_unconditional = got["meta"]["unconditional_token_logprobs"]
            for served, reference in zip(served_unconditional, unconditional, strict=True):
                assert served[0][0] is None
                assert [lp for lp, _, _ in served[1:]] == pytest.approx([lp for lp, _, _ in reference[1:]], abs=1e-4)
    assert frontend["token_length_normalized"]["decision"] == " Paris"


def test_select_heals_a_prefix_that_ends_inside_a_token(frontend, tokenizer):
    """The prefix's trailing space and the choice make one token: the frontend keeps that token's entry."""
    prefix = "The capital of France is "
    healed = frontend["healed"]
    for choice, entries in zip(["Paris", "London"], healed["meta"]["input_token_logprobs"], strict=True):
        ids = tokenizer.encode(prefix + choice)
        assert ids[: len(tokenizer.encode(prefix)) - 1] == tokenizer.encode(prefix)[:-1]  # the space was merged
        assert [t for _, t, _ in entries] == ids[len(tokenizer.encode(prefix)) - 1 :]
        assert entries[0][2].strip() == choice  # the healed token: " Paris", not the prefix's own
    assert healed["decision"] == "Paris"


def test_select_inside_run_batch_equals_sequential_runs(frontend):
    assert frontend["react_errors"] == [None] * 8
    assert frontend["react"] == frontend["react_alone"]
    assert all(action in (" Search", " Finish") for action, _ in frontend["react"])


def test_typed_constrained_and_stopped_gen(frontend):
    typed = frontend["typed"]
    assert re.fullmatch(r"[-+]?[0-9]+", typed["int"]), typed["int"]  # the stops " " and "\n" cut the regex's tail
    assert re.fullmatch(r"[-+]?[0-9]*\.?[0-9]+", typed["float"]), typed["float"]
    assert typed["bool"] in ("True", "False")
    assert re.fullmatch(r"\"[\w\d\s]*\"", typed["str"]), typed["str"]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", typed["phone"]), typed["phone"]
    assert typed["colour"] in (" red", " green", " blue")
    assert "," not in typed["stopped"]
    assert frontend["typed_meta"]["long"]["completion_tokens"] == 6  # min_tokens: no stop before 6 tokens
    int_reason = frontend["typed_meta"]["int"]["finish_reason"]
    assert int_reason["type"] == "length" or int_reason == {"type": "stop", "matched": int_reason["matched"]}


def test_forks_and_streams(frontend):
    facts = frontend["forked"]["facts"]
    assert len(facts) == 2 and all(f.strip() for f in facts)
    assert frontend["forked"]["text"].endswith("Done.")
    pieces = frontend["stream_pieces"]
    assert len(pieces) > 1 and "".join(pieces) == frontend["stream_whole"]


def test_generate_logprob_fields_as_sglang_shapes_them(server, tokenizer):
    text = "The capital of France is Paris"
    ids = tokenizer.encode(text)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body = {"text": text, "return_logprob": True, "return_text_in_logprobs": True, "top_logprobs_num": 2}
        zero = c.post("/generate", json={**body, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
        meta = zero.json()["meta_info"]
        assert [t for _, t, _ in meta["input_token_logprobs"]] == ids
        assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
        assert [x for _, _, x in meta["input_token_logprobs"]] == [tokenizer.decode([t]) for t in ids]
        assert all(
            len(top) == 2 and all(isinstance(x, str) for _, _, x in top) for top in meta["input_top_logprobs"][1:]
        )
        later = c.post("/generate", json={**body, "logprob_start_len": 3, "sampling_params": {"max_new_tokens": 0}})
        assert later.json()["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"][4:]
        unset = c.post(
            "/generate",
            json={"input_ids": [ids, ids[:3]], "return_logprob": True, "sampling_params": {"max_new_tokens": 0}},
        )
        assert [len(r["meta_info"]["input_token_logprobs"]) for r in unset.json()] == [len(ids), 3]
        generating = c.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        meta = generating.json()["meta_info"]
        assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 3
        assert all(isinstance(x, str) for _, _, x in meta["output_token_logprobs"])
        lines = [
            json.loads(line[5:])
            for line in c.post("/generate", json={**generating_body(body), "stream": True}).text.splitlines()
            if line.startswith("data:") and line != "data: [DONE]"
        ]
        assert lines[-1]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
        too_far = c.post("/generate", json={**body, "logprob_start_len": 99})
        assert too_far.status_code == 400 and too_far.json()["error"]["param"] == "logprob_start_len"
        image = c.post("/generate", json={"text": "hi", "image_data": "data:image/png;base64,AAAA"})
        assert image.status_code == 400 and image.json()["error"]["param"] == "image_data"
        joined = c.post("/concate_and_append_request", json={"src_rids": ["a"], "dst_rid": "b"})
        assert joined.status_code == 404 and "no longer" in joined.json()["error"]["message"]
        assert c.post("/start_profile").status_code == 400
        regex = {
            "text": "Count: 1, 2, 3,",
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "stop_regex": r"[0-9] *,\s*[0-9]"},
        }
        stopped = c.post("/generate", json=regex).json()
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"[0-9] *,\s*[0-9]"}
        assert re.search(r"[0-9] *,\s*[0-9]", stopped["text"])  # kept whole, as SGLang keeps a regex's match
        bad = c.post("/generate", json={"text": "x", "sampling_params": {"stop_regex": "("}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_regex"
    server.assert_idle()


def generating_body(body: dict) -> dict:
    return {**body, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
