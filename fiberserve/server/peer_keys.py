"""The request keys that peers define and fiberserve does not honour (llama.cpp's samplers, vLLM's and SGLang's
extras, OpenAI's options for other models): a request that sets one to anything but its neutral value gets a 400
naming it, never an answer that silently ignored it.  Keys no peer defines are still tolerated.

Keys that act only together with one of these (``mirostat_tau`` with ``mirostat``, ``dry_base`` with
``dry_multiplier``, ``xtc_threshold`` with ``xtc_probability``, ...) are accepted whatever their value: while
their sampler is off, which the check guarantees, they change nothing.
"""

from __future__ import annotations

from typing import Any

from fiberserve.engine.sampling_params import InvalidParameter

#: Each refused key and the values that change nothing (accepted, as clients such as llama.cpp's web page send
#: every sampler's neutral setting).
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    # llama.cpp's samplers and options
    "typical_p": (1,),
    "mirostat": (0,),
    "dry_multiplier": (0,),
    "xtc_probability": (0,),
    "top_n_sigma": (-1,),
    "dynatemp_range": (0,),
    "repeat_penalty": (1,),  # over the last repeat_last_n tokens; repetition_penalty is served
    "n_probs": (0,),  # logprobs / top_logprobs are served
    "lora": ([],),
    "id_slot": (-1,),
    # vLLM's extras
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "priority": (0,),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "guided_whitespace_pattern": (),
    "logits_processors": (),
    "cache_salt": (),
    "return_tokens_as_token_ids": (False,),
    "chat_template": (),  # the server's --chat-template is the one template
    "documents": (),
    "echo": (False,),  # of the chat API (the completions API serves it)
    # OpenAI's options for other models
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "functions": (),
    "function_call": (),
    # SGLang's extras
    "return_hidden_states": (False,),
    "custom_logit_processor": (),
}


def unhonoured(extra: dict[str, Any] | None) -> InvalidParameter | None:
    """The first key of a body's undeclared ``extra`` keys that asks for what fiberserve does not do, as the
    error to answer with; None (null) is every key's neutral value."""
    for key, value in (extra or {}).items():
        neutral = NEUTRAL_VALUES.get(key)
        if neutral is not None and value is not None and not any(_same(value, n) for n in neutral):
            return InvalidParameter(key, f"is not supported (given {value!r})")
    return None


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` where booleans are not numbers (``True`` is not ``1``)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral
