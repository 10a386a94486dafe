"""Request bodies of every endpoint (pydantic): types are checked here, ranges by SamplingParams.validate.

Unknown keys are tolerated (clients send engine-specific extras) and null
means "use the default", as SGLang and vLLM behave.  Options a client sets to
change the answer in a way this server does not implement (``suffix``, tool
choice ``auto`` without ``--tool-call-parser``, the peers' keys of
``peer_keys.py``, ...) are refused by name instead: an answer that silently
ignored them would be wrong.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from fiberserve.engine.grammar import GrammarSpec, choice_regex, schema_text
from fiberserve.engine.sampling_params import InvalidParameter, SamplingParams
from fiberserve.server.peer_keys import unhonoured
from fiberserve.server.tools import ToolChoice, ToolSpec, tool_grammar, tool_mode

Int = int
Float = float


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Body(BaseModel):
    """A request body whose undeclared keys are kept (``model_extra``) for :meth:`refuse_unhonoured`."""

    model_config = ConfigDict(extra="allow")

    def refuse_unhonoured(self) -> None:
        """Raise InvalidParameter for the first peer's key set here that this server does not honour."""
        if refused := unhonoured(self.model_extra):
            raise refused


#: Constrained decoding's keys, SGLang's and vLLM's, and the kind of grammar each gives (see engine/grammar.py).
GRAMMAR_KEYS = {
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "regex",
    "guided_grammar": "ebnf",
    "grammar": "ebnf",  # llama.cpp's GBNF, which xgrammar's EBNF reads
}

#: vLLM's ``structured_outputs`` keys and the grammar keys above they stand for.
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar"}  # fmt: skip


class SamplingFields(Body):
    """The sampling keys every API shares, under the same names."""

    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    n: Int | None = None
    seed: Int | None = None
    logit_bias: dict[str, Float] | None = None  # token id (a JSON key, so a string) -> bias
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar_: str | None = Field(default=None, alias="grammar")  # llama.cpp's GBNF
    structured_outputs: dict[str, Any] | None = None

    def shared_values(self) -> dict[str, Any]:
        self.refuse_unhonoured()
        grammar_fields = {"grammar_", "structured_outputs", *GRAMMAR_KEYS}
        values = {name: getattr(self, name) for name in SamplingFields.model_fields if name not in grammar_fields}
        values["stop"] = _stops(self.stop)
        values["logit_bias"] = _token_biases(self.logit_bias)
        values["grammar"] = self.grammar()
        return values

    def grammar(self) -> GrammarSpec | None:
        """The one constraint the request gives (a grammar key, vLLM's ``structured_outputs`` or OpenAI's
        ``response_format``), if any."""
        # field as the client named it -> (the grammar key it stands for, its value)
        given = {key: (key, getattr(self, "grammar_" if key == "grammar" else key)) for key in GRAMMAR_KEYS}
        given |= _structured_outputs(self.structured_outputs)
        named = [field for field, (_, value) in given.items() if value is not None]
        response_format = getattr(self, "response_format", None)
        if response_format is not None and response_format.get("type", "text") != "text":
            named.append("response_format")
        if len(named) > 1:
            raise InvalidParameter(named[1], f"only one constraint per request (this one and {named[0]})")
        if not named:
            return None
        field = named[0]
        if field == "response_format" and response_format is not None:
            return _response_format_grammar(response_format)
        key, value = given[field]
        if key == "json_object":
            return GrammarSpec("json_object", "", field)
        if key == "guided_choice":
            if not value or not all(value):
                raise InvalidParameter(field, "must be a non-empty list of non-empty strings")
            return GrammarSpec("regex", choice_regex(value), field)
        kind = GRAMMAR_KEYS[key]
        return GrammarSpec(kind, schema_text(value) if kind == "json_schema" else value, field)


def _structured_outputs(spec: dict[str, Any] | None) -> dict[str, tuple[str, Any]]:
    """vLLM's ``structured_outputs``: each key set, named ``structured_outputs.KEY``, with the grammar key it
    stands for (``json_object: true`` as itself) and its value."""
    given = {}
    for key, value in (spec or {}).items():
        field = f"structured_outputs.{key}"
        if value is None or (key == "json_object" and value is False):
            continue
        if key == "json_object":
            given[field] = ("json_object", True)
        elif key in STRUCTURED_OUTPUTS:
            given[field] = (STRUCTURED_OUTPUTS[key], value)
        else:
            raise InvalidParameter(field, "is not supported")
    return given


def _response_format_grammar(response_format: dict[str, Any]) -> GrammarSpec:
    kind = response_format.get("type")
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | str):
            raise InvalidParameter("response_format", "json_schema.schema (a JSON schema) is required")
        return GrammarSpec("json_schema", schema_text(schema), "response_format")
    raise InvalidParameter("response_format", "type must be text, json_object or json_schema")


class NativeSamplingParams(SamplingFields):
    max_new_tokens: Int | None = None
    min_new_tokens: Int | None = None
    max_completion_tokens: Int | None = None  # shortfin's name for max_new_tokens
    no_stop_trim: StrictBool | None = None  # SGLang's name for include_stop_str_in_output
    sampling_seed: Int | None = None  # SGLang's name for seed
    stop_regex: str | list[str] | None = None
    #: Accepted and ignored: the tokenizers served are fast ones, which never put spaces between special tokens.
    spaces_between_special_tokens: StrictBool | None = None


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _token_biases(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidParameter("logit_bias", "keys must be token ids") from None


def build_params(defaults: dict[str, Any], **given: Any) -> SamplingParams:
    """SamplingParams from defaults overridden by the non-null given values."""
    values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    values["max_new_tokens_by_default"] = given.get("max_new_tokens") is None
    try:
        return SamplingParams(**values)
    except TypeError as exc:  # pragma: no cover - programming error, not user input
        raise InvalidParameter("sampling_params", str(exc)) from None


class GenerateRequest(Body):
    """SGLang's ``POST /generate``."""

    text: str | list[str] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | None = None
    top_logprobs_num: Int | None = None
    logprob_start_len: Int | None = None  # with return_logprob: the input's logprobs too, from this position on
    return_text_in_logprobs: StrictBool | None = None  # each logprob entry carries its token's text
    image_data: Any = None  # refused: the models served read text only
    rid: str | list[str] | None = None
    #: The LoRA adapter each prompt runs under, by its served name (one for all, or one per prompt; None: the base).
    lora_path: str | list[str | None] | None = None

    def input_logprobs_from(self) -> int | None:
        """Where the input's logprobs start, if asked for: ``logprob_start_len`` where it is >= 0; where it is
        not given (or -1), 0 for a request that generates nothing (a scoring request, such as the frontend's
        unconditional likelihoods) and none for one that generates."""
        if not self.return_logprob:
            return None
        start = self.logprob_start_len
        if start is None or start < 0:
            return 0 if self.max_new_tokens() == 0 else None
        return start

    def max_new_tokens(self) -> int | None:
        sp = self.sampling_params or NativeSamplingParams()
        return sp.max_new_tokens if sp.max_new_tokens is not None else sp.max_completion_tokens

    def params(self) -> SamplingParams:
        self.refuse_unhonoured()
        sp = self.sampling_params or NativeSamplingParams()
        values = sp.shared_values()
        if values["seed"] is None:
            values["seed"] = sp.sampling_seed
        return build_params(
            {"max_new_tokens": 128, "temperature": 1.0},
            **values,
            max_new_tokens=self.max_new_tokens(),
            min_new_tokens=sp.min_new_tokens,
            stop_regex=_stops(sp.stop_regex),
            include_stop_str=sp.no_stop_trim,
            logprobs=self.return_logprob,
            top_logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs=None if self.input_logprobs_from() is None else self.top_logprobs_num or 0,
        )


class StreamOptions(Lenient):
    include_usage: StrictBool | None = None


class OpenAICommon(SamplingFields):
    model: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    min_tokens: Int | None = None  # vLLM's extension
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (see SamplingFields.grammar)
    include_stop_str_in_output: StrictBool | None = None  # vLLM's extension

    def _params(
        self, max_tokens: int | None, logprobs: bool, top_logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        return build_params(
            {"max_new_tokens": 16 if isinstance(self, CompletionRequest) else 512, "temperature": 1.0},
            **self.shared_values(),
            max_new_tokens=max_tokens,
            min_new_tokens=self.min_tokens,
            include_stop_str=self.include_stop_str_in_output,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionRequest(OpenAICommon):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = None
    logprobs: Int | None = None
    echo: StrictBool | None = None  # the prompt before the completion, scored too if logprobs are asked for
    # Accepted so that asking for them is refused by name rather than silently ignored (see `unsupported`).
    suffix: str | None = None
    best_of: Int | None = None

    def unsupported(self) -> InvalidParameter | None:
        """The first option set here that this server does not implement, as the error to answer with."""
        if self.suffix:
            return InvalidParameter("suffix", "is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            return InvalidParameter("best_of", "only best_of == n is supported")
        return None

    def params(self) -> SamplingParams:
        scored = self.logprobs if self.echo and self.logprobs is not None else None
        return self._params(self.max_tokens, self.logprobs is not None, self.logprobs or None, scored)


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # An assistant's earlier calls, and which call a tool message answers: for templates that show them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text") for p in self.content if p.get("type") == "text"]
            texts = [p for p in parts if isinstance(p, str)]
            if len(texts) != len(self.content):
                raise InvalidParameter("messages", "only text content parts are supported")
            return "".join(texts)
        return self.content or ""


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them."""
    extras = ("tool_calls", "tool_call_id", "name")
    return [
        {"role": m.role, "content": m.text(), **{k: getattr(m, k) for k in extras if getattr(m, k) is not None}}
        for m in messages
    ]


#: The names ``transformers``' ``apply_chat_template`` takes for itself, which a template variable cannot have.
TEMPLATE_ARGUMENTS = frozenset(
    ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "kwargs")
)  # fmt: skip


class ChatCompletionRequest(OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    #: Variables for the chat template (``enable_thinking``, ...), and OpenAI's ``reasoning_effort`` as one.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    separate_reasoning: StrictBool = True  # SGLang's: False leaves the thinking in the content
    #: vLLM's: the answer continues the final (assistant's) message instead of starting a new one.
    continue_final_message: StrictBool = False
    add_generation_prompt: StrictBool | None = None

    def generation_prompt(self) -> bool:
        """Whether the template ends with the assistant's turn opened: not where the final message continues
        (which must be an assistant's, and cannot have a generation prompt too)."""
        if not self.continue_final_message:
            return self.add_generation_prompt is not False
        if self.add_generation_prompt:
            raise InvalidParameter("continue_final_message", "cannot be set with add_generation_prompt")
        if self.messages[-1].role != "assistant":
            raise InvalidParameter("continue_final_message", "needs the final message to be an assistant's")
        return False

    def template_variables(self) -> dict[str, Any]:
        """What the chat template reads beyond the messages and tools."""
        variables = dict(self.chat_template_kwargs or {})
        for name in variables:
            if name in TEMPLATE_ARGUMENTS:
                raise InvalidParameter("chat_template_kwargs", f"{name!r} is the renderer's own, not a variable")
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        return variables

    def tool_mode(self, parser: str = "none") -> str | None:
        """``"named"`` or ``"required"`` where the answer is tool calls, ``"auto"`` where the model chooses (under
        the server's tool-call ``parser``), else None (see server/tools.py)."""
        return tool_mode(self.tools, self.tool_choice, parser)

    def grammar(self) -> GrammarSpec | None:
        given = super().grammar()
        if not self.tools or self.tool_choice in (None, "none", "auto"):  # no grammar of the tools' own
            return given
        if given is not None:
            raise InvalidParameter(given.field, "a tool call's output cannot follow another constraint too")
        return tool_grammar(self.tools, self.tool_choice, self.parallel_tool_calls is not False)

    def params(self) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(limit, bool(self.logprobs), self.top_logprobs if self.logprobs else None)


class TokenizeRequest(Lenient):
    """vLLM's ``POST /tokenize``: a prompt (llama.cpp's ``content``), or chat messages rendered by the model's chat
    template."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    add_special: StrictBool = False  # with content: llama.cpp's add_special_tokens, off by default there
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolSpec] | None = None  # with messages: where the template shows them, they count too
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(Lenient):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[Int]


class LoadLoraRequest(Body):
    """vLLM's ``POST /v1/load_lora_adapter`` (SGLang's ``/load_lora_adapter``)."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` (SGLang's ``/unload_lora_adapter``)."""

    lora_name: str
