"""Request bodies of every endpoint (pydantic): types are checked here, ranges by SamplingParams.validate.

Unknown keys are tolerated (clients send engine-specific extras) and null
means "use the default", as SGLang and vLLM behave.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from fiberserve.engine.sampling_params import InvalidParameter, SamplingParams

Int = int
Float = float


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NativeSamplingParams(Lenient):
    max_new_tokens: Int | None = None
    max_completion_tokens: Int | None = None  # shortfin's name for max_new_tokens
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
    sampling_seed: Int | None = None  # SGLang's name for seed


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def build_params(defaults: dict[str, Any], **given: Any) -> SamplingParams:
    """SamplingParams from defaults overridden by the non-null given values."""
    values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    try:
        return SamplingParams(**values)
    except TypeError as exc:  # pragma: no cover - programming error, not user input
        raise InvalidParameter("sampling_params", str(exc)) from None


class GenerateRequest(Lenient):
    """SGLang's ``POST /generate``."""

    text: str | list[str] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | None = None
    top_logprobs_num: Int | None = None
    rid: str | list[str] | None = None

    def params(self) -> SamplingParams:
        sp = self.sampling_params or NativeSamplingParams()
        return build_params(
            {"max_new_tokens": 128, "temperature": 1.0},
            max_new_tokens=sp.max_new_tokens if sp.max_new_tokens is not None else sp.max_completion_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            stop=_stops(sp.stop),
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
            skip_special_tokens=sp.skip_special_tokens,
            n=sp.n,
            seed=sp.seed if sp.seed is not None else sp.sampling_seed,
            logprobs=self.return_logprob,
            top_logprobs=self.top_logprobs_num if self.return_logprob else None,
        )


class StreamOptions(Lenient):
    include_usage: StrictBool | None = None


class OpenAICommon(Lenient):
    model: str | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    # vLLM / SGLang extensions
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[Int] | None = None

    def _params(self, max_tokens: int | None, logprobs: bool, top_logprobs: int | None) -> SamplingParams:
        return build_params(
            {"max_new_tokens": 16 if isinstance(self, CompletionRequest) else 512, "temperature": 1.0},
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            stop=_stops(self.stop),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            n=self.n,
            seed=self.seed,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )


class CompletionRequest(OpenAICommon):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = None
    logprobs: Int | None = None
    echo: StrictBool | None = None

    def params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs is not None, self.logprobs or None)


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
                raise InvalidParameter("messages", "only text content parts are supported")
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = None

    def params(self) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(limit, bool(self.logprobs), self.top_logprobs if self.logprobs else None)
