"""KV pages: a fixed pool with reference counts, and a prefix cache of full pages.

Every page is in exactly one of three states:

* **free**: nobody holds it and it caches nothing;
* **in use**: held by one or more sequences (``refs > 0``), or quarantined:
  held for a model call that timed out and may still write them, until it
  returns (:meth:`PagePool.quarantine`);
* **cached**: nobody holds it, but it holds a full page of a known token
  prefix and may be reused by a later request; evicted LRU-first when free
  pages run out.

Invariant (:meth:`PagePool.check_integrity`): free + in use + cached == total.

The prefix cache is a trie over full pages: a node's key is (parent node,
the page's tokens), so a match is exact (no hash collisions) and a page is
only ever matched after the same whole prefix.  Shared pages are full, so
they are read, never written again.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence

_ROOT = 0


def root_of(namespace: int) -> Hashable:
    """The trie's root of a namespace: the base model's (0), or a LoRA adapter's (its ``uid``), whose K/V differ
    from the base's for the same tokens."""
    return _ROOT if namespace == 0 else ("adapter", namespace)


class PagePool:
    """Page allocation, sharing and the prefix cache of one KV cache."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True) -> None:
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._node_of_page: dict[int, int] = {}  # page -> trie node id
        self._page_of_key: dict[tuple[Hashable, tuple[int, ...]], int] = {}  # (parent node, tokens) -> page
        self._key_of_page: dict[int, tuple[Hashable, tuple[int, ...]]] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first
        self._node_ids = itertools.count(1)
        self._quarantined: dict[str, list[int]] = {}  # holder -> the page references it keeps
        self.hits = 0
        self.queries = 0

    # ------------------------------------------------------------------ counts

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        return len(self._lru)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages - self.cached_pages

    @property
    def total_references(self) -> int:
        return sum(self._refs)

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get: free ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def quarantined(self) -> dict[str, int]:
        """Distinct pages each quarantine holds, by holder."""
        return {holder: len(set(pages)) for holder, pages in self._quarantined.items()}

    @property
    def quarantined_pages(self) -> int:
        """Distinct pages in quarantine, all holders together."""
        return len({page for pages in self._quarantined.values() for page in pages})

    @property
    def quarantined_references(self) -> int:
        return sum(len(pages) for pages in self._quarantined.values())

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # ------------------------------------------------------------------ allocation

    def grow(self, pages: list[int], tokens: int) -> bool:
        """Extend a sequence's ``pages`` to cover ``tokens`` tokens; False (nothing taken) if too few are free."""
        need = self.pages_for(tokens) - len(pages)
        if need <= 0:
            return True
        new = self.allocate(need)
        if new is None:
            return False
        pages.extend(new)
        return True

    def covered(self, pages: list[int], start: int) -> int:
        """How many tokens from position ``start`` on ``pages`` hold room for."""
        return len(pages) * self.page_size - start

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh pages held once each, or None (nothing taken) if there are not enough."""
        if count > self.available_pages:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                self._forget(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced pages become cached or free."""
        for page in pages:
            refs = self._refs[page] - 1
            if refs < 0:
                raise AssertionError(f"page {page} released more often than held")
            self._refs[page] = refs
            if refs == 0:
                if page in self._key_of_page:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def quarantine(self, holder: str, pages: Sequence[int]) -> None:
        """Keep a sequence's references to ``pages`` under ``holder`` instead: the pages stay in use, neither free
        nor cached, until :meth:`end_quarantine` (for pages a call that timed out may still write)."""
        self._quarantined.setdefault(holder, []).extend(pages)

    def end_quarantine(self, holder: str) -> int:
        """Release the references ``holder`` keeps; returns how many."""
        pages = self._quarantined.pop(holder, [])
        self.release(pages)
        return len(pages)

    def _forget(self, page: int) -> None:
        key = self._key_of_page.pop(page)
        del self._page_of_key[key]
        del self._node_of_page[page]

    # ------------------------------------------------------------------ prefix cache

    def match_prefix(self, tokens: Sequence[int], namespace: int = 0) -> list[int]:
        """Hold and return the cached pages that spell the longest full-page prefix of ``tokens`` in
        ``namespace`` (0: the base model's; a LoRA adapter's pages are its own: :func:`root_of`).

        At least one token is always left uncovered: the last prompt token must
        be computed to produce the next token's logits.
        """
        if not self.prefix_caching:
            return []
        self.queries += 1
        pages = self._cached_chain(tokens, namespace)
        for page in pages:
            if self._refs[page] == 0:
                del self._lru[page]
            self._refs[page] += 1
        if pages:
            self.hits += 1
        return pages

    def cached_prefix_pages(self, tokens: Sequence[int], namespace: int = 0) -> int:
        """How many pages :meth:`match_prefix` would hold for ``tokens``, holding none."""
        return len(self._cached_chain(tokens, namespace)) if self.prefix_caching else 0

    def _cached_chain(self, tokens: Sequence[int], namespace: int) -> list[int]:
        ps, parent, pages = self.page_size, root_of(namespace), []
        for i in range((len(tokens) - 1) // ps):
            page = self._page_of_key.get((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if page is None:
                break
            pages.append(page)
            parent = self._node_of_page[page]
        return pages

    def register(self, pages: Sequence[int], tokens: Sequence[int], already: int, namespace: int = 0) -> int:
        """Offer the full pages ``pages[already:]`` (spelling ``tokens`` in ``namespace``) to the prefix cache.

        Returns how many leading pages are now registered (``already`` grows by
        one per full page).  A page whose prefix is already cached under
        another page stays private and is freed normally.
        """
        if not self.prefix_caching:
            return already
        ps = self.page_size
        full = min(len(tokens) // ps, len(pages))
        parent = self._node_of_page.get(pages[already - 1], None) if already else root_of(namespace)
        for i in range(already, full):
            page = pages[i]
            if parent is None:
                return i  # the chain broke (an earlier page stayed private)
            if page in self._node_of_page:
                parent = self._node_of_page[page]
                continue
            key = (parent, tuple(tokens[i * ps : (i + 1) * ps]))
            if key in self._page_of_key:
                return i
            node = next(self._node_ids)
            self._page_of_key[key] = page
            self._key_of_page[page] = key
            self._node_of_page[page] = node
            parent = node
        return full

    def flush(self) -> int:
        """Drop every cached (unreferenced) page from the prefix cache; returns how many."""
        dropped = 0
        while self._lru:
            page, _ = self._lru.popitem(last=False)
            self._forget(page)
            self._free.append(page)
            dropped += 1
        return dropped

    def check_integrity(self) -> None:
        """free + in use + cached == total, and every page is in exactly one state."""
        free, cached = set(self._free), set(self._lru)
        used = {p for p, r in enumerate(self._refs) if r > 0}
        assert len(free) == len(self._free), "a page is free twice"
        assert not (free & cached) and not (free & used) and not (cached & used), "a page is in two states"
        assert len(free) + len(cached) + len(used) == self.num_pages, (
            f"pages leaked: free {len(free)} + used {len(used)} + cached {len(cached)} != {self.num_pages}"
        )
        assert all(p in self._key_of_page for p in cached), "a cached page has no prefix key"
        assert all(r >= 0 for r in self._refs)
