"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regex, or EBNF) the output must match.

The grammar is compiled once per request by `xgrammar <https://github.com/mlc-ai/xgrammar>`_, the library vLLM
and SGLang use; each sequence then holds its own matcher.  Before a token is picked the matcher marks the tokens
that may come next (a bitmask over the vocabulary) and the rest get ``-inf`` logits; the picked token is fed
back to it.  Once the grammar is complete only a stop token may follow, so the output ends with ``stop``.

xgrammar is optional (``pip install --no-deps xgrammar apache-tvm-ffi``: its own requirements pull in triton, a
GPU compiler this CPU path does not use); without it a constrained request is refused by name.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fiberserve.engine.sampling_params import InvalidParameter

#: The kinds of grammar a request may give.
KINDS = ("json_schema", "json_object", "regex", "ebnf")
#: The time and C++ source location xgrammar puts before its messages.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match; ``field`` is the request key it came from (errors name it)."""

    kind: str  #: one of KINDS
    source: str  #: the schema (JSON text), regex or EBNF; empty for json_object
    field: str


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (vLLM's ``guided_choice``)."""
    special = set("\\.^$|?*+()[]{}/")
    return "(" + "|".join("".join("\\" + c if c in special else c for c in choice) for choice in choices) + ")"


def schema_text(schema: Any) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    return schema if isinstance(schema, str) else json.dumps(schema)


class GrammarCompiler:
    """Compiles specs for one tokenizer (a :class:`.Tokenizer`); thread-safe.  The last :data:`CACHED` grammars
    are kept (clients repeat the same schema).  Nothing is built before :meth:`prepare` or the first spec.

    ``saved_vocabulary``: where xgrammar's view of the vocabulary (its ``TokenizerInfo``, slow to read from a
    large vocabulary's tokenizer) is kept between starts, as JSON; named after the xgrammar version that wrote it.
    None: read from the tokenizer each time."""

    CACHED = 64

    def __init__(self, tokenizer: Any, vocab_size: int, saved_vocabulary: Path | None = None) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._saved_vocabulary = saved_vocabulary
        self._compiler: Any = None  #: xgrammar's GrammarCompiler, made on first use
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def prepare(self) -> None:
        """Import xgrammar and read the tokenizer's vocabulary now (~0.3 s, ~2 s with a cold import), if xgrammar
        is installed; otherwise the first compile does it."""
        with contextlib.suppress(InvalidParameter):  # not installed: constrained requests are refused by name
            self._ready(_xgrammar("grammar"))

    def _ready(self, xgr: Any) -> None:
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self._vocabulary(xgr))

    def _vocabulary(self, xgr: Any) -> Any:
        """xgrammar's TokenizerInfo: the saved one where this xgrammar version saved it, else read and saved."""
        saved = self._saved_vocabulary
        if saved is not None:
            saved = saved.with_name(f"{saved.stem}-xgrammar-{importlib.metadata.version('xgrammar')}{saved.suffix}")
            with contextlib.suppress(OSError, ValueError, RuntimeError):  # absent or unreadable: read it again
                return xgr.TokenizerInfo.deserialize_json(saved.read_text())
        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer.hf, vocab_size=self._vocab_size)
        if saved is not None:
            partial = saved.with_suffix(f".{os.getpid()}.partial")
            try:
                saved.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(info.serialize_json())
                partial.replace(saved)  # whole or absent, whoever reads it
            except OSError as exc:  # a read-only or full cache only costs time
                log.warning("could not save the grammar vocabulary in %s: %s", saved, exc)
                partial.unlink(missing_ok=True)
        return info

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar; :class:`InvalidParameter` naming ``spec.field`` if it does not compile."""
        self._ready(_xgrammar(spec.field))
        key = (spec.kind, spec.source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                if spec.kind == "json_schema":
                    grammar = self._compiler.compile_json_schema(spec.source)
                elif spec.kind == "json_object":
                    grammar = self._compiler.compile_builtin_json_grammar()
                elif spec.kind == "regex":
                    grammar = self._compiler.compile_regex(spec.source)
                else:
                    grammar = self._compiler.compile_grammar(spec.source)
            except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the parser's message
                message = _LOG_PREFIX.sub("", str(exc)).strip()
                raise InvalidParameter(spec.field, f"does not compile as {spec.kind}: {message}") from None
            self._cache[key] = grammar
            if len(self._cache) > self.CACHED:
                self._cache.popitem(last=False)
            return grammar


class GrammarState:
    """One sequence's place in its grammar.  ``stop_ids``: the sequence's stop tokens, the only tokens allowed
    once the grammar is complete; with none (``ignore_eos``), the grammar ends the output by itself."""

    def __init__(self, compiled: Any, stop_ids: frozenset[int]) -> None:
        xgr = _xgrammar("grammar")
        if stop_ids:
            self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))
        else:
            self._matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        self._vocab_size = compiled.tokenizer_info.vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._apply = xgr.apply_token_bitmask_inplace

    def mask(self, row: torch.Tensor) -> None:
        """Set ``-inf`` in ``row`` [vocab] (float32, CPU) at every token the grammar does not allow next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._apply(row.view(1, -1), self._bitmask)

    def allows_a_token(self, banned: frozenset[int] = frozenset()) -> bool:
        """Whether the grammar allows some token next other than ``banned`` (the stop tokens, while the sampler
        bans them): False at a dead end, where no output can continue within the constraint."""
        row = torch.zeros(self._vocab_size)
        self.mask(row)
        if banned:
            row[sorted(t for t in banned if t < self._vocab_size)] = float("-inf")
        return bool(torch.isfinite(row).any())

    def accept(self, token: int) -> bool:
        """Feed the picked token; False if the grammar refuses it (it cannot, if :meth:`mask` chose it)."""
        return self._matcher.accept_token(token)

    @property
    def complete(self) -> bool:
        """The output matches the whole grammar and its stop token was taken."""
        return self._matcher.is_terminated()


def _xgrammar(field: str) -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidParameter(
            field, "constrained decoding needs xgrammar (pip install --no-deps xgrammar apache-tvm-ffi)"
        ) from None
    return xgrammar
