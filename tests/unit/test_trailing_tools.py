"""``--tool-call-parser llama3_json | mistral | pythonic | functiongemma`` without a server: what each family's
output is answered with, and the same answer however it is streamed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fiberserve.server.tools import ToolCallRenderer

PARIS = ("get_weather", '{"city": "Paris"}')
CLOCK = ("clock", "{}")

CASES = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "clock", '
         '"parameters": {}}', None, [PARIS, CLOCK]),
        ('  {"name": "clock", "arguments": "{}"}', None, [CLOCK]),  # arguments as a JSON string
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call: text
        ('Sure: {"name": "clock"}', 'Sure: {"name": "clock"}', []),  # not at the start
        ('{"name": "clock", "parameters": {', '{"name": "clock", "parameters": {', []),  # cut short
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "clock", "arguments": {}}]',
         None, [PARIS, CLOCK]),
        ('Let me check.[TOOL_CALLS][{"name": "clock", "arguments": {}}]', "Let me check.", [CLOCK]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]clock[ARGS]{}', None, [PARIS, CLOCK]),
        ("No [TOOL_ here.", "No [TOOL_ here.", []),
        ("[TOOL_CALLS][{bad json", "[TOOL_CALLS][{bad json", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris"), clock()]', None, [PARIS, CLOCK]),
        ("\n[get_weather(city='Paris')]", None, [PARIS]),
        ("[1, 2, 3]", "[1, 2, 3]", []),  # a list, but no calls: text
        ("[get_weather(city=os.environ)]", "[get_weather(city=os.environ)]", []),  # arguments are literals only
        ("The weather is fine.", "The weather is fine.", []),
    ],
    "functiongemma": [
        ("<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>", None, [PARIS]),
        ("Checking.<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>"
         "<start_function_call>call:clock{}<end_function_call><start_function_response>", "Checking.", [PARIS, CLOCK]),
        ("<start_function_call>call:book{who:<escape>Ann, {Bo}<escape>, n:2, ok:true, at:{x:1.5,y:null},"
         " tags:[<escape>a<escape>,b], room:blue}<end_function_call>", None,
         [("book", '{"who": "Ann, {Bo}", "n": 2, "ok": true, "at": {"x": 1.5, "y": null}, "tags": ["a", "b"], '
           '"room": "blue"}')]),
        ("No call here: call:clock{}", "No call here: call:clock{}", []),
        ("<start_function_call>call:clock{a:<escape>open", "<start_function_call>call:clock{a:<escape>open", []),
        ("<start_function_call>call:clock{}<end_function_call> and then text",
         "<start_function_call>call:clock{}<end_function_call> and then text", []),  # calls run to the end
    ],
}  # fmt: skip
ALL = [(parser, *case) for parser, cases in CASES.items() for case in cases]


def _answer(parser: str, text: str) -> tuple[str | None, list[tuple[str, str]], str | None]:
    message, finish = ToolCallRenderer("auto", None, parser).message(text, "stop")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return message["content"], calls, finish


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_each_family_s_output_is_answered_with_its_text_or_its_calls(parser, text, content, calls):
    assert _answer(parser, text) == (content, calls, "tool_calls" if calls else "stop")


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
@given(cuts=st.lists(st.integers(0, 120), max_size=6))
def test_streamed_in_any_pieces_the_answer_is_the_same(parser, text, content, calls, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    render = ToolCallRenderer("auto", None, parser)
    deltas = [render.delta(0, p, "stop" if i == len(pieces) - 1 else None, i == 0) for i, p in enumerate(pieces)]
    made = [d for d in deltas if d is not None]
    streamed = "".join(delta.get("content") or "" for delta, _ in made)
    entries = [
        (e["function"]["name"], e["function"]["arguments"]) for delta, _ in made for e in delta.get("tool_calls", [])
    ]
    assert (streamed, entries, made[-1][1]) == (content or "", calls, "tool_calls" if calls else "stop")
    assert not render.auto_streams


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ('{{- "<tool_call>\\n{\\"name\\": <function-name>}\\n</tool_call>" }}', "hermes"),
        ("{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}", "mistral"),
        ('{%- if builtin_tools is defined %}{{- "<|python_tag|>" }}{%- endif %}', "llama3_json"),
        ("{%- for call in message.tool_calls %}<start_function_call>call:{{ call.name }}{% endfor %}",
         "functiongemma"),
        ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", "none"),
        (None, "none"),
    ],
)  # fmt: skip
def test_auto_names_the_parser_of_the_call_format_the_template_writes(template, parser):
    from fiberserve.server.trailing_tools import parser_for_template

    assert parser_for_template(template) == parser
