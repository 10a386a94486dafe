"""Tool calls without a server: which tool_choice is refused, the grammar each mode gives, and the answers."""

from __future__ import annotations

import json

import pytest

from fiberserve.engine.grammar import GrammarCompiler, GrammarState
from fiberserve.engine.sampling_params import InvalidParameter
from fiberserve.server.tools import (
    NO_PARAMETERS,
    NamedToolChoice,
    ToolCallRenderer,
    ToolSpec,
    tool_grammar,
    tool_mode,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = ToolSpec.model_validate({"type": "function", "function": {"name": "weather", "parameters": CITY}})
CLOCK = ToolSpec.model_validate({"type": "function", "function": {"name": "clock"}})


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        ([WEATHER], None, "tool_choice"),  # "auto" is the default with tools
        ([WEATHER], "auto", "tool_choice"),
        ([WEATHER], named("clock"), "tool_choice"),
        ([WEATHER, WEATHER], "required", "tools"),
        (None, "required", "tools"),
        ([], named("weather"), "tools"),
    ],
)
def test_refused_tool_choices_name_their_field(tools, choice, field):
    with pytest.raises(InvalidParameter) as err:
        tool_mode(tools, choice)
    assert err.value.field == field


def test_modes():
    assert tool_mode(None, None) is None and tool_mode(None, "none") is None
    assert tool_mode([WEATHER], "none") is None
    assert tool_mode([WEATHER, CLOCK], "required") == "required"
    assert tool_mode([WEATHER, CLOCK], named("clock")) == "named"


def test_a_named_function_constrains_the_output_to_its_arguments():
    assert json.loads(tool_grammar([WEATHER, CLOCK], named("weather"), True).source) == CITY
    assert json.loads(tool_grammar([WEATHER, CLOCK], named("clock"), True).source) == NO_PARAMETERS


def test_required_accepts_a_list_of_the_tools_calls_only(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)

    def accepts(text: str, parallel: bool = True) -> bool:
        compiled = compiler.compile(tool_grammar([WEATHER, CLOCK], "required", parallel))
        state = GrammarState(compiled, frozenset(tokenizer.eos_token_ids))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(state.accept(t) for t in ids) and state.accept(min(tokenizer.eos_token_ids)) and state.complete

    one = '[{"name": "weather", "parameters": {"city": "Oslo"}}]'
    two = '[{"name": "clock", "parameters": {}}, {"name": "weather", "parameters": {"city": "Rome"}}]'
    assert accepts(one) and accepts(two) and accepts(one, parallel=False)
    assert not accepts(two, parallel=False)
    assert not accepts("[]")
    assert not accepts('[{"name": "weather", "parameters": {}}]')  # city is required
    assert not accepts('[{"name": "mail", "parameters": {}}]')  # not a tool


def test_answers_of_a_named_function():
    render = ToolCallRenderer("named", "weather")
    message, finish = render.message('{"city": "Oslo"}', "stop")
    [call] = message["tool_calls"]
    assert finish == "stop" and message["content"] is None and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    first, _ = render.delta(0, '{"ci', None, first=True)
    assert first["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"ci'}
    assert render.delta(0, 'ty": "Oslo"}', None, first=False) == (
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]},
        None,
    )
    assert render.delta(0, "", "stop", first=False) == ({}, "stop")


def test_answers_of_required_calls_whole_or_cut_short():
    render = ToolCallRenderer("required", None)
    text = '[{"name": "clock", "parameters": {}}, {"name": "weather", "parameters": {"city": "Rome"}}]'
    message, finish = render.message(text, "stop")
    assert finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("clock", {}),
        ("weather", {"city": "Rome"}),
    ]
    assert render.message(text[:20], "length") == ({"role": "assistant", "content": text[:20]}, "length")
    # Streamed, the calls are held back until the output ends, then sent whole with their indices.
    assert render.delta(3, text[:30], None, first=True) is None
    delta, finish = render.delta(3, text[30:], "stop", first=False)
    assert finish == "tool_calls" and [c["index"] for c in delta["tool_calls"]] == [0, 1]
    assert delta["tool_calls"][1]["function"]["arguments"] == '{"city": "Rome"}'
