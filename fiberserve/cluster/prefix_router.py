"""Prefix-aware routing for the engine replicas, on Ray Serve's request-router API.

A request whose prompt shares a long prefix with earlier ones goes to the replica that served them, whose prefix
cache holds that prefix's KV pages, as long as load is balanced (the replicas' queue lengths within
``imbalance`` of each other); prompts nobody has seen take the replicas in turn while load is balanced (so new
prefixes, and the cache they fill, spread evenly); otherwise the least loaded replica.

Prefixes are remembered as a chain of hashes over fixed chunks of the prompt's text: chunk i's key hashes chunk
i's text with chunk i - 1's key, so a key stands for the whole prefix up to it, and the deepest key a prompt
shares with a routed one is their longest common prefix in whole chunks.  The least loaded replica is Serve's
choice within a rank: Serve takes the shortest queue among the lengths it has cached, probing only where it has
none, so within one rank an idle cluster's requests can all land on one replica; hence the single-replica first
rank while load is balanced.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

#: Characters per chunk of a prompt's text: about a KV page of tokens.
CHUNK_CHARS = 64
#: Prefix keys remembered (least recently routed forgotten first).
MAX_KEYS = 200_000


def prefix_keys(text: str) -> list[int]:
    """The chain of keys of ``text``'s whole chunks (see the module docstring)."""
    keys, key = [], 0
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        key = hash((key, text[start : start + CHUNK_CHARS]))
        keys.append(key)
    return keys


def prompt_of(pending_request: PendingRequest | None) -> str:
    """The prompt text a forwarded request carries (``ForwardedRequest.prompt``), or "" if none."""
    if pending_request is None:
        return ""
    return next((arg.prompt for arg in pending_request.args if isinstance(getattr(arg, "prompt", None), str)), "")


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Routes a request to the replica that served its longest known prefix while load is balanced."""

    def initialize_state(self, imbalance: int = 4, **kwargs: Any) -> None:
        """``imbalance``: the queue-length spread above which load counts as unbalanced."""
        self.imbalance = imbalance
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()
        self.routed_by_prefix = 0
        self.routed = 0
        self.new_prefixes = 0  # prompts routed without a known prefix: whose turn it is

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        if not self._balanced(candidate_replicas):
            return [shuffled]
        first = self._owner(prompt_of(pending_request), by_id)
        if first is None:
            in_turn = sorted(candidate_replicas, key=lambda r: str(r.replica_id))
            first = in_turn[self.new_prefixes % len(in_turn)]
            self.new_prefixes += 1
        rest = [r for r in shuffled if r.replica_id != first.replica_id]
        return [[first], rest] if rest else [[first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        keys = prefix_keys(prompt_of(pending_request))
        self.routed += 1
        if keys and self.owners.get(keys[-1]) == replica_id:
            self.routed_by_prefix += 1
        for key in keys:
            self.owners[key] = replica_id
            self.owners.move_to_end(key)
        while len(self.owners) > MAX_KEYS:
            self.owners.popitem(last=False)

    def _owner(self, text: str, replicas: dict[ReplicaID, RunningReplica]) -> RunningReplica | None:
        """The live replica that served the deepest prefix key ``text`` shares, if any."""
        for key in reversed(prefix_keys(text)):
            owner = self.owners.get(key)
            if owner is not None and owner in replicas:
                return replicas[owner]
        return None

    def _balanced(self, replicas: list[RunningReplica]) -> bool:
        lengths = [self.replica_queue_len_cache.get(r.replica_id) for r in replicas]
        known = [n for n in lengths if n is not None]
        return not known or max(known) - min(known) <= self.imbalance
