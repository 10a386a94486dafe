"""The responses a later request may read back or continue (``previous_response_id``): each one's object and
its whole conversation, the newest :data:`RESPONSES_KEPT` only."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fiberserve.server.protocol import ChatMessage

#: How many stored responses the server keeps; an older one is forgotten (a 404 for who names it).
RESPONSES_KEPT = 1024


@dataclass(frozen=True)
class StoredResponse:
    body: dict  #: the response object, as it was answered
    conversation: list[ChatMessage]  #: its prompt's messages (but the instructions) and its answer


class ResponseStore:
    def __init__(self, kept: int = RESPONSES_KEPT) -> None:
        self.kept = kept
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        while len(self._responses) > self.kept:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """That response, or None if it is not (or no longer) kept."""
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def __len__(self) -> int:
        return len(self._responses)
