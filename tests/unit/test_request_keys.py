"""The request bodies' keys without a server: peers' keys refused unless neutral, the constraints each key
gives, and the chat template's variables."""

from __future__ import annotations

import copy
import inspect

import pytest

from fiberserve.engine.sampling_params import InvalidParameter
from fiberserve.server.peer_keys import NEUTRAL_VALUES
from fiberserve.server.protocol import TEMPLATE_ARGUMENTS, ChatCompletionRequest, GenerateRequest

MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]


def chat(**keys) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **keys})


@pytest.mark.parametrize("key", sorted(NEUTRAL_VALUES))
def test_every_peer_key_is_refused_by_name_unless_neutral_or_null(key):
    for neutral in (None, *NEUTRAL_VALUES[key]):
        chat(**{key: neutral}).params()
    with pytest.raises(InvalidParameter) as refused:
        chat(**{key: {"something": "else"}}).params()
    assert refused.value.field == key


def test_a_boolean_is_not_taken_for_a_neutral_number_and_generate_refuses_at_both_levels():
    with pytest.raises(InvalidParameter, match="mirostat"):
        chat(mirostat=False).params()  # False == 0, but a client that sent a boolean meant something else
    chat(mirostat=0, mirostat_tau=5.0, dry_base=1.75, xtc_threshold=0.1, some_unknown_key=1).params()
    for body in ({"text": "hi", "custom_logit_processor": "x"}, {"text": "hi", "sampling_params": {"typical_p": 0.5}}):
        with pytest.raises(InvalidParameter) as refused:
            GenerateRequest.model_validate(body).params()
        assert refused.value.field in ("custom_logit_processor", "typical_p")


@pytest.mark.parametrize(
    "keys,kind,text,field",
    [
        ({"grammar": 'root ::= "yes"'}, "ebnf", 'root ::= "yes"', "grammar"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "ebnf", 'root ::= "a"', "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "regex", "(a|b)", "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "", "structured_outputs.json_object"),
    ],
)
def test_llama_cpp_s_grammar_and_vllm_s_structured_outputs_give_their_constraint(keys, kind, text, field):
    spec = chat(**keys).grammar()
    assert (spec.kind, spec.source, spec.field) == (kind, text, field)


def test_structured_outputs_refuses_what_it_cannot_do_and_one_constraint_only():
    with pytest.raises(InvalidParameter) as refused:
        chat(structured_outputs={"structural_tag": {"x": 1}}).grammar()
    assert refused.value.field == "structured_outputs.structural_tag"
    with pytest.raises(InvalidParameter) as refused:
        chat(grammar='root ::= "a"', structured_outputs={"regex": "a"}).grammar()
    assert refused.value.field == "structured_outputs.regex"
    assert chat(structured_outputs={"json_object": False, "regex": None}).grammar() is None


def test_no_template_variable_can_take_a_name_the_renderer_takes(tokenizer):
    taken = set(inspect.signature(tokenizer.hf.apply_chat_template).parameters)
    assert taken <= TEMPLATE_ARGUMENTS
    for name in taken:
        with pytest.raises(InvalidParameter, match="chat_template_kwargs"):
            chat(chat_template_kwargs={name: 1}).template_variables()


def test_template_variables_reach_the_model_s_template(tokenizer):
    request = chat(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="low")
    assert request.template_variables() == {"enable_thinking": False, "reasoning_effort": "low"}
    with pytest.raises(InvalidParameter, match="chat_template_kwargs"):
        chat(chat_template_kwargs={"messages": []}).template_variables()
    reading = copy.copy(tokenizer)
    reading.hf = copy.deepcopy(tokenizer.hf)
    reading.hf.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
        "[{{ reasoning_effort | default('medium') }}]"
    )
    messages = [{"role": "user", "content": "Hi"}]
    assert reading.apply_chat_template(messages) == "Hi[medium]"
    assert reading.apply_chat_template(messages, variables=request.template_variables()) == "Hi<think></think>[low]"


def test_chat_template_flag_takes_a_file_or_a_template_and_names_itself_otherwise(tmp_path):
    from fiberserve.model.tokenizer import read_chat_template

    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(inline)
    assert read_chat_template(str(tmp_path / "t.jinja")) == read_chat_template(inline) == inline
    for bad, says in ((str(tmp_path / "missing.jinja"), "neither a file nor"), ("{{ unclosed", "line 1")):
        with pytest.raises(ValueError, match=f"--chat-template: .*{says}"):
            read_chat_template(bad)


def test_a_final_message_continues_only_where_it_is_an_assistant_s_and_nothing_opens_after_it():
    assistant = [*MESSAGES, {"role": "assistant", "content": "Yes"}]
    assert chat(messages=assistant, continue_final_message=True).generation_prompt() is False
    assert chat(add_generation_prompt=False).generation_prompt() is False
    assert chat().generation_prompt() is True
    for keys in ({"continue_final_message": True}, {"messages": assistant, "continue_final_message": True,
                                                    "add_generation_prompt": True}):  # fmt: skip
        with pytest.raises(InvalidParameter, match="continue_final_message"):
            chat(**keys).generation_prompt()


def test_an_anthropic_request_is_the_chat_request_it_means():
    from fiberserve.server.anthropic_protocol import MessagesRequest

    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                              {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "P"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"}, "stop_sequences": ["\n\n"], "min_p": 0.1,
    })  # fmt: skip
    chat = body.chat_request()
    assert [(m.role, m.content, m.tool_call_id) for m in chat.messages] == [
        ("system", "Be brief.", None), ("user", "Weather?", None), ("assistant", None, None),
        ("tool", "Sunny", "t1"), ("user", "And tomorrow?", None),
    ]  # fmt: skip
    assert chat.messages[2].tool_calls == [
        {"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}
    ]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.max_tokens, chat.stop) == ("required", False, 9, ["\n\n"])
    assert chat.template_variables() == {"enable_thinking": False} and chat.min_p == 0.1
    with pytest.raises(InvalidParameter, match="typical_p"):
        MessagesRequest.model_validate({**body.model_dump(), "typical_p": 0.5}).chat_request().params()
    with pytest.raises(InvalidParameter) as refused:
        MessagesRequest.model_validate({**body.model_dump(), "messages": [
            {"role": "user", "content": [{"type": "document", "source": {}}]}]}).chat_request()  # fmt: skip
    assert refused.value.field == "messages.0.content.0"


def test_a_responses_request_is_the_chat_request_it_means_and_the_store_keeps_the_newest():
    from fiberserve.server.protocol import ChatMessage
    from fiberserve.server.responses_protocol import ResponsesRequest
    from fiberserve.server.responses_store import ResponseStore, StoredResponse

    body = ResponsesRequest.model_validate({
        "instructions": "Be brief.", "max_output_tokens": 7, "reasoning": {"effort": "low"},
        "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c": "P"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        ],
        "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "w"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    })  # fmt: skip
    chat = body.chat_request([])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Weather?"), ("assistant", "Checking."), ("tool", "Sunny"),
    ]  # fmt: skip
    assert chat.messages[2].tool_calls[0]["function"] == {"name": "w", "arguments": '{"c": "P"}'}
    assert chat.max_tokens == 7 and chat.template_variables() == {"reasoning_effort": "low"}
    assert chat.tool_choice.function.name == "w" and chat.response_format["json_schema"]["schema"] == {"type": "object"}
    for refused, field in (({"background": True}, "background"), ({"include": ["x"]}, "include"),
                           ({"tools": [{"type": "web_search"}]}, "tools.0.type")):  # fmt: skip
        with pytest.raises(InvalidParameter) as error:
            ResponsesRequest.model_validate({"input": "Hi", **refused}).chat_request([])
        assert error.value.field == field
    store = ResponseStore(kept=2)
    for i in range(3):
        store.put(f"resp_{i}", StoredResponse({"id": f"resp_{i}"}, [ChatMessage(role="user", content=str(i))]))
    assert store.get("resp_0") is None and store.get("resp_2").body == {"id": "resp_2"} and len(store) == 2
