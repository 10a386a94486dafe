"""``--reasoning-parser``: a reasoning model's thinking, split from its answer (vLLM's and SGLang's flag).

The text between the model's think markers goes to the message's ``reasoning_content``, the rest to its
``content`` (and tool calls are read from the content only).  Two ways a model marks its thinking:

- ``deepseek_r1``: the answer begins inside the thinking (recent templates put ``<think>`` in the prompt; an
  output that opens with it anyway is read the same) and ``</think>`` ends it; an output with no ``</think>``
  is all reasoning (cut short while thinking).  For DeepSeek-R1 and its distills, and Qwen3's thinking-only models.
- ``qwen3``: the output thinks only when it opens with ``<think>`` (after whitespace), up to ``</think>`` or the
  end of the output; otherwise it is all content, as when ``chat_template_kwargs: {"enable_thinking": false}``
  put an empty thinking in the prompt.

Streamed (:class:`ReasoningStream`), the same text splits the same way whatever the pieces: a piece that may be
the start of a marker is held back until the next one tells.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkMarkers:
    """How a model family marks its thinking; ``begins_inside``: its answers start inside the thinking."""

    begins_inside: bool
    start: str = "<think>"
    end: str = "</think>"


#: Each ``--reasoning-parser`` but ``none`` (``config.REASONING_PARSERS``) and its markers.
MARKERS = {"deepseek_r1": ThinkMarkers(begins_inside=True), "qwen3": ThinkMarkers(begins_inside=False)}


def split_reasoning(markers: ThinkMarkers, text: str) -> tuple[str | None, str]:
    """A whole output's reasoning (None where it has none) and its content."""
    stream = ReasoningStream(markers)
    reasoning, content = stream.feed(text, final=True)
    return (reasoning if stream.thought else None), content


class ReasoningStream:
    """Splits an output fed in pieces into reasoning and content: :meth:`feed` returns each piece's share of
    both; all of them joined equal :func:`split_reasoning` of the whole text."""

    def __init__(self, markers: ThinkMarkers) -> None:
        self.markers = markers
        self.thought = markers.begins_inside  #: whether the output has reasoning
        # "opening": before the first non-space text (a start marker may come); "thinking"; "closing": after the
        # end marker, before the answer's first non-space text; "answering".
        self._phase = "opening"
        self._held = ""  # text that may be the start of a marker

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """The next ``piece``'s reasoning and content (either may be empty); ``final``: the output ends here,
        nothing is held back."""
        text, self._held = self._held + piece, ""
        reasoning, content = [], []
        while text:
            if self._phase == "opening":
                stripped = text.lstrip()
                start = self.markers.start
                if not stripped or (start.startswith(stripped) and not final):
                    self._held = text  # whitespace, or maybe the start marker: wait for more
                    break
                if stripped.startswith(start):
                    self.thought, self._phase, text = True, "thinking", stripped[len(start) :]
                elif self.markers.begins_inside:
                    self._phase = "thinking"
                else:
                    self._phase = "answering"
            elif self._phase == "thinking":
                end = self.markers.end
                at = text.find(end)
                if at >= 0:
                    reasoning.append(text[:at])
                    self._phase, text = "closing", text[at + len(end) :]
                    continue
                keep = 0 if final else _partial_suffix(text, end)
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            elif self._phase == "closing":  # the whitespace between the thinking and the answer is neither's
                text = text.lstrip()
                if text:
                    self._phase = "answering"
            else:
                content.append(text)
                break
        if final and self._phase == "opening":  # nothing but whitespace
            (reasoning if self.markers.begins_inside else content).append(self._held)
            self._held = ""
        return "".join(reasoning), "".join(content)


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
