"""Tokenizer, chat template and incremental detokenization.

The tokenizer comes from ``transformers`` (which builds a fast tokenizer from
GGUF metadata, or reads ``tokenizer.json`` / ``tokenizer_config.json`` from a
Hugging Face directory), so the chat template renders exactly as
``apply_chat_template`` does.  Building one from GGUF metadata takes seconds,
so the result is saved under the cache directory and reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Tokenizer:
    """Encode, decode, render chats; BOS added only where the model's tokenizer asks for it."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        eos = [hf_tokenizer.eos_token_id, *extra_eos_ids]
        self.eos_token_ids: frozenset[int] = frozenset(int(e) for e in eos if e is not None)
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, context: list[int], skip_special_tokens: bool) -> Callable[[int], str | None] | None:
        """tokenizers' own incremental decoder, seeded with ``context``: ``step(id)`` returns the text that id
        completes (None while a character is incomplete), the pieces :meth:`decode` gives.  None where
        ``decode`` is more than the backend's decode (a tokenizer class of its own, or spaces cleaned up)."""
        if not _decodes_as_its_backend(self.hf):
            return None
        from tokenizers.decoders import DecodeStream

        stream, backend = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens), self.hf.backend_tokenizer
        return lambda token_id: stream.step(backend, token_id)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included (as SGLang's logprob entries show them)."""
        return self.hf.batch_decode([[i] for i in ids], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, where the template shows them to the model), rendered
        by the model's own template with ``variables`` (``enable_thinking``, ...) defined for it; ``continue_final``:
        the last message (an assistant's) left open for the answer to continue."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions or /generate")
        return self.hf.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            **(variables or {}),
        )

    def use_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (Jinja, as ``--chat-template`` gives it) instead of the model's own."""
        self.hf.chat_template = template
        self.has_chat_template = True

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        # The rendered template carries its own special tokens: add none twice.
        text = self.apply_chat_template(messages, add_generation_prompt, tools, variables, continue_final)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(
        self, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids or [], skip_special_tokens)


def read_chat_template(given: str) -> str:
    """``--chat-template``'s value: a Jinja file's text, or the template itself where it is one (as vLLM reads
    it); ValueError naming the flag for anything else, or a template that does not compile."""
    import jinja2

    path = Path(given)
    if path.is_file():
        template = path.read_text()
    elif "{{" in given or "{%" in given:
        template = given
    else:
        raise ValueError(f"--chat-template: {given!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: line {exc.lineno}: {exc.message}") from None
    return template


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one piece at a time.

    Contract: the concatenation of everything :meth:`push` returns equals the
    decode of all ids pushed so far once the text is complete; a multi-byte
    character split across tokens is held back until its last byte arrives
    (never emitted as U+FFFD).  A few prompt tokens give the first pieces
    their context (leading spaces of SentencePiece-style vocabularies).
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        #: The same steps in Rust where the tokenizer has them (see Tokenizer.stream_decoder).
        self._step = (
            tokenizer.stream_decoder(self.ids, skip_special_tokens) if isinstance(tokenizer, Tokenizer) else None
        )

    def push(self, token_id: int) -> str:
        """Add one id; return the new text it completes (possibly empty)."""
        self.ids.append(token_id)
        if self._step is not None:
            piece = self._step(token_id) or ""
        else:
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            complete = len(full) > len(prefix) and not full.endswith("\ufffd")
            piece = full[len(prefix) :] if complete else ""
        if piece:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += piece
        return piece

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        full = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        piece = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += piece
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _decodes_as_its_backend(hf: Any) -> bool:
    """Whether ``hf.decode`` is its ``backend_tokenizer``'s decode: transformers' fast-tokenizer decode, not
    overridden by the tokenizer's class, without the clean-up of spaces it can add afterwards."""
    cls = type(hf)
    return (
        getattr(hf, "backend_tokenizer", None) is not None
        and not getattr(hf, "clean_up_tokenization_spaces", True)
        and getattr(cls.decode, "__module__", None) == "transformers.tokenization_utils_base"
        and getattr(cls._decode, "__module__", None)
        in ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")
    )


def _cache_key(path: Path) -> str:
    stat = path.stat()
    raw = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def tokenizer_cache(model_path: str | Path, cache_dir: str | Path | None) -> Path | None:
    """The folder under ``cache_dir`` that keeps what is read from a GGUF file's tokenizer (None for a Hugging
    Face directory, whose tokenizer files are read as they are, or without a cache)."""
    path = Path(model_path)
    return Path(cache_dir) / "tokenizers" / _cache_key(path) if cache_dir and not path.is_dir() else None


#: Class names a saved tokenizer's config may give for transformers' fast tokenizer over ``tokenizer.json`` alone.
_PLAIN_FAST_TOKENIZERS = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _saved_tokenizer_class(saved: Path) -> Any:
    """The class ``AutoTokenizer`` picks for a tokenizer saved in ``saved``: transformers' plain fast tokenizer
    imported by name where the config names it, which spares the import of every model's tokenizer module that
    ``AutoTokenizer`` makes (most of the tokenizer's load)."""
    try:
        named = json.loads((saved / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in _PLAIN_FAST_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(model_path: str | Path, cache_dir: str | Path | None, extra_eos_ids=()) -> Tokenizer:
    """The tokenizer of a GGUF file (cached under ``cache_dir``) or a Hugging Face directory."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = Path(model_path)
    saved = tokenizer_cache(path, cache_dir)
    if saved is not None and (saved / "tokenizer.json").is_file():
        return Tokenizer(_saved_tokenizer_class(saved).from_pretrained(str(saved)), extra_eos_ids)
    from transformers import AutoTokenizer

    if path.is_dir():
        return Tokenizer(AutoTokenizer.from_pretrained(str(path)), extra_eos_ids)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if saved is not None:
        try:
            hf.save_pretrained(str(saved))
        except OSError as exc:  # a read-only cache only costs time
            log.warning("could not cache the tokenizer in %s: %s", saved, exc)
    return Tokenizer(hf, extra_eos_ids)
