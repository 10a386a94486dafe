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
    assert tool_mode([WEATHER], None, "hermes") == tool_mode([WEATHER], "auto", "hermes") == "auto"
    assert tool_mode([WEATHER], "none", "hermes") is None and tool_mode(None, None, "hermes") is None
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
    # As the model often writes it, pretty-printed: json.dumps's spacing, whole or streamed.
    pretty = '{\n  "city" :"Oslo, Norway"\n}'
    call = render.message(pretty, "stop")[0]["tool_calls"][0]
    assert call["function"]["arguments"] == json.dumps(json.loads(pretty)) == '{"city": "Oslo, Norway"}'
    streamed = [
        render.delta(1, c, "stop" if i == len(pretty) - 1 else None, first=i == 0) for i, c in enumerate(pretty)
    ]
    assert streamed[1] is None  # a newline alone: nothing to send
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d, _ in filter(None, streamed) if "tool_calls" in d]
    assert "".join(pieces) == call["function"]["arguments"] and not render.spacings


REQUIRED = '[{"name": "clock", "parameters": {}}, {"name": "weather", "parameters": {"city": "Rome"}}]'
#: Strings that look like the structure: braces, brackets, commas, colons, quotes and backslashes inside them.
TRICKY = '[ {"name":"weather" ,\n "parameters": {"city": "}], {\\"x\\": [1, 2]}, \\\\", "n": [{"a": null}]}}\n]'
#: As the model often writes it: whitespace between the tokens.
PRETTY = (
    '[{"name": "weather", "parameters": {\n  "city" :"Rome, Italy",\n  "days":[1 ,2, {"a":null}]\n}}\n,'
    ' {"name": "clock", "parameters": { }}]'
)


def test_answers_of_required_calls_whole_or_cut_short():
    render = ToolCallRenderer("required", None)
    message, finish = render.message(REQUIRED, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("clock", "{}"),
        ("weather", '{"city": "Rome"}'),
    ]
    assert render.message(REQUIRED[:20], "length") == ({"role": "assistant", "content": REQUIRED[:20]}, "length")


@pytest.mark.parametrize("text", [REQUIRED, TRICKY, PRETTY])
def test_a_call_s_arguments_are_its_parameters_with_json_dumps_spacing(text):
    calls = ToolCallRenderer("required", None).message(text, "stop")[0]["tool_calls"]
    parsed = json.loads(text)
    assert [c["function"]["name"] for c in calls] == [p["name"] for p in parsed]
    assert [c["function"]["arguments"] for c in calls] == [json.dumps(p["parameters"]) for p in parsed]


def _stream(text: str, cuts: list[int], finish: str) -> list[tuple[dict, str | None]]:
    render = ToolCallRenderer("required", None)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    made = [
        render.delta(7, piece, finish if i == len(pieces) - 1 else None, first=i == 0) for i, piece in enumerate(pieces)
    ]
    assert not render.scanners and not render.sent  # nothing kept once the choice ends
    return [m for m in made if m is not None]


@pytest.mark.parametrize("text", [REQUIRED, TRICKY, PRETTY])
@pytest.mark.parametrize("cut", ["characters", "thirds"])
def test_required_calls_stream_as_they_are_generated(text, cut):
    """Streamed, each call goes out once its name is complete (id, type, name), then its arguments piece by piece;
    the pieces add up to the unstreamed answer's arguments, whatever the cuts."""
    cuts = list(range(1, len(text))) if cut == "characters" else [len(text) // 3, 2 * len(text) // 3]
    deltas = _stream(text, cuts, "stop")
    assert deltas[0][0]["role"] == "assistant" and deltas[-1][1] == "tool_calls"
    assert all(finish is None for _, finish in deltas[:-1])
    entries = [e for delta, _ in deltas for e in delta.get("tool_calls", [])]
    whole = ToolCallRenderer("required", None).message(text, "stop")[0]["tool_calls"]
    for index, call in enumerate(whole):
        mine = [e for e in entries if e["index"] == index]
        assert mine[0]["id"].startswith("call_") and mine[0]["type"] == "function"
        assert mine[0]["function"]["name"] == call["function"]["name"]
        assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in mine[1:])
        assert "".join(e["function"]["arguments"] for e in mine) == call["function"]["arguments"]
    if cut == "characters":  # a call is named before its arguments end, and they arrive in more than one piece
        assert all(
            len([e for e in entries if e["index"] == i]) > 2
            for i in range(len(whole))
            if whole[i]["function"]["arguments"] != "{}"
        )


def test_a_required_stream_cut_short_ends_with_its_reason():
    text = REQUIRED[:-5]  # inside the second call's arguments
    deltas = _stream(text, [10, 30, 60], "length")
    assert deltas[-1][1] == "length"
    entries = [e for delta, _ in deltas for e in delta.get("tool_calls", [])]
    assert [e["index"] for e in entries if "id" in e] == [0, 1]  # both calls had begun
    assert "".join(e["function"]["arguments"] for e in entries if e["index"] == 1) == '{"city": "Rom'


# ---------------------------------------------------------------- "auto" under --tool-call-parser hermes

CALL_PARIS = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_CLOCK = '<tool_call>\n{"name": "clock", "parameters": {}}\n</tool_call>'
#: As SmolLM2's function-calling prompt asks for calls: a list of them in one pair of tags.
CALL_LIST = '<tool_call>[\n{"name": "clock", "arguments": {}},\n{"name": "weather", "arguments": {"city": "Rome"}}\n]'
CALL_LIST += "</tool_call>"
#: Braces, tags and escapes inside the arguments' strings; arguments written as a JSON string.
CALL_TRICKY = '<tool_call>{"name":"weather","arguments":"{\\"city\\": \\"</tool_call> {}\\"}"}</tool_call>'


def _auto(text: str, finish: str = "stop") -> tuple[str | None, list[tuple[str, str]], str | None]:
    message, reason = ToolCallRenderer("auto", None).message(text, finish)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message.get("tool_calls", []))
    return message["content"], calls, reason


@pytest.mark.parametrize(
    ("text", "content", "calls", "finish"),
    [
        ("Just text, <tool_ not a call.", "Just text, <tool_ not a call.", [], "stop"),
        (CALL_PARIS, None, [("weather", '{"city": "Paris"}')], "tool_calls"),
        (
            "\n " + CALL_PARIS + "\n" + CALL_CLOCK + "\n",
            None,
            [("weather", '{"city": "Paris"}'), ("clock", "{}")],
            "tool_calls",
        ),
        (
            "Let me look.\n" + CALL_PARIS + " trailing words",
            "Let me look.\n",
            [("weather", '{"city": "Paris"}')],
            "tool_calls",
        ),
        (CALL_TRICKY, None, [("weather", '{"city": "</tool_call> {}"}')], "tool_calls"),
        (CALL_PARIS[: -len("</tool_call>")], None, [("weather", '{"city": "Paris"}')], "tool_calls"),  # no end tag
        ("Hm " + CALL_PARIS + '<tool_call>{"name": 3}</tool_call>', None, [], "stop"),  # one bad call: all text
        ('<tool_call>{"name": "weather", "arguments": {"ci', None, [], "length"),  # cut short: text
        (CALL_LIST, None, [("clock", "{}"), ("weather", '{"city": "Rome"}')], "tool_calls"),
        ("<tool_call>[]</tool_call>", None, [], "stop"),  # an empty list is not a call
    ],
)
def test_auto_answers_text_or_the_calls_it_wrote(text, content, calls, finish):
    got_content, got_calls, got_finish = _auto(text, "length" if text.endswith('"ci') else "stop")
    assert (got_content, got_calls, got_finish) == (content if calls else text, calls, finish)


def _auto_stream(text: str, cuts: list[int], finish: str = "stop") -> list[tuple[dict, str | None]]:
    render = ToolCallRenderer("auto", None)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    made = [
        render.delta(3, piece, finish if i == len(pieces) - 1 else None, first=i == 0) for i, piece in enumerate(pieces)
    ]
    assert not render.auto_streams  # nothing kept once the choice ends
    return [m for m in made if m is not None]


@pytest.mark.parametrize(
    "text",
    [
        "Just text, <tool_ not a call.",
        CALL_PARIS,
        "\n " + CALL_PARIS + "\n" + CALL_CLOCK + "\n",
        "Let me look.\n" + CALL_PARIS + " trailing words",
        CALL_TRICKY,
        CALL_PARIS[: -len("</tool_call>")],
        CALL_LIST + CALL_PARIS,
        "   ",
    ],
)
@pytest.mark.parametrize("cut", ["characters", "thirds", "whole"])
def test_auto_streams_add_up_to_the_unstreamed_answer(text, cut):
    """Streamed in any pieces: the content deltas add up to the answer's content, and each call goes out whole
    (id, name, arguments) in order; no part of a tag is ever sent as content."""
    cuts = {"characters": list(range(1, len(text))), "thirds": [len(text) // 3, 2 * len(text) // 3], "whole": []}
    deltas = _auto_stream(text, cuts[cut])
    content, calls, finish = _auto(text)
    assert deltas[0][0]["role"] == "assistant" and deltas[-1][1] == finish
    assert all(reason is None for _, reason in deltas[:-1])
    streamed = "".join(delta.get("content") or "" for delta, _ in deltas)
    assert streamed == (content or "") and "<tool" not in streamed.replace("<tool_ not", "")
    entries = [e for delta, _ in deltas for e in delta.get("tool_calls", [])]
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in entries] == [
        (i, name, arguments) for i, (name, arguments) in enumerate(calls)
    ]


def test_auto_streams_text_as_it_comes_and_holds_only_what_may_be_a_tag():
    render = ToolCallRenderer("auto", None)
    assert render.delta(0, "Hello", None, first=True) == ({"role": "assistant", "content": "Hello"}, None)
    assert render.delta(0, " wor<tool", None, first=False) == ({"content": " wor"}, None)
    assert render.delta(0, "s", None, first=False) == ({"content": "<tools"}, None)  # not a tag after all
    assert render.delta(0, " <", None, first=False) == ({"content": " "}, None)
    delta, finish = render.delta(0, "tool_call>{}</tool_call>", None, first=False)  # a call that does not parse
    assert (delta, finish) == ({"content": "<tool_call>{}</tool_call>"}, None)
    assert render.delta(0, ' <tool_call>{"name": "clo', "length", first=False) == (
        {"content": '<tool_call>{"name": "clo'},  # cut short: what there is (text after a call is not sent)
        "length",
    )


def test_the_tool_call_parser_setting_is_checked():
    from fiberserve.config import ServerConfig

    assert ServerConfig(tool_call_parser="hermes").tool_call_parser == "hermes"
    named = "none, auto, hermes, llama3_json, mistral, pythonic, functiongemma"
    with pytest.raises(ValueError, match=f"tool_call_parser must be one of {named}, not 'xml'"):
        ServerConfig(tool_call_parser="xml")
