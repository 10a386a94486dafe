"""Request bodies of ``/v1/embeddings`` (OpenAI's, with vLLM's ``normalize`` and ``add_special_tokens``) and of
``/v1/rerank`` (Jina's and Cohere's, as vLLM and llama-server serve it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from fiberserve.engine import InvalidParameter
from fiberserve.server.protocol import Body


class EmbeddingRequest(Body):
    """``input``: one text, a list of texts, one prompt of token ids, or a list of such prompts."""

    model: str | None = None
    input: Any  # its shapes are told apart by :meth:`prompts`, which names what it takes
    encoding_format: Literal["float", "base64"] = "float"
    #: OpenAI's shortened embeddings, which only a model trained for them (Matryoshka) gives: only the full size.
    dimensions: StrictInt | None = None
    user: str | None = None
    normalize: StrictBool = True  # L2, as vLLM and llama-server return them
    add_special_tokens: StrictBool = True

    def prompts(self) -> tuple[list[str] | None, list[list[int]] | None]:
        """The inputs as texts, or as token-id prompts (exactly one is given); InvalidParameter naming ``input``
        if it is neither."""
        given = self.input
        if isinstance(given, str):
            return [given], None
        if isinstance(given, list) and given:
            if all(isinstance(text, str) for text in given):
                return given, None
            if all(_is_token_id(token) for token in given):
                return None, [given]
            if all(isinstance(ids, list) and all(_is_token_id(t) for t in ids) for ids in given):
                return None, given
        raise InvalidParameter("input", "give a text, a list of texts, a list of token ids or a list of such lists")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RerankRequest(Body):
    """Score each of ``documents`` against ``query``; the ``top_n`` best, best first (all where None or 0)."""

    model: str | None = None
    query: StrictStr
    documents: list[StrictStr] = Field(min_length=1)
    top_n: StrictInt | None = Field(default=None, ge=0)
    return_documents: StrictBool = True
