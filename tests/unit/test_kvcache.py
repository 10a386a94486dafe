"""The page pool and its prefix cache (no model)."""

from __future__ import annotations

import random

import pytest

from fiberserve.engine.kvcache import PagePool


def test_allocate_release_and_integrity():
    pool = PagePool(8, page_size=4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.free_pages == 0
    assert pool.allocate(1) is None  # nothing taken when there are not enough
    pool.release(a)
    assert pool.free_pages == 3 and pool.used_pages == 5
    pool.release(b)
    pool.check_integrity()
    with pytest.raises(AssertionError, match="released more often"):
        pool.release(b[:1])


def test_prefix_pages_are_shared_cached_and_evicted_lru():
    pool = PagePool(6, page_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    pages = pool.allocate(4)
    assert pool.register(pages, prompt, 0) == 3  # three full pages
    # a second sequence with the same prefix shares them (the last token is always left to compute)
    shared = pool.match_prefix(prompt)
    assert shared == pages[:3]
    assert pool.match_prefix([1, 2, 3, 4]) == pages[:1]  # 4 tokens: only 1 page, a token must remain
    pool.release(pages[:1])
    pool.release(shared)
    pool.release(pages)
    assert pool.cached_pages == 3 and pool.free_pages == 3
    pool.check_integrity()
    # allocation takes free pages first, then evicts the least recently used cached page
    pool.allocate(3)
    fresh = pool.allocate(1)
    assert fresh is not None and pool.cached_pages == 2
    pool.check_integrity()
    assert pool.match_prefix(prompt) == []  # the chain lost its first page


def test_same_tokens_after_a_different_prefix_do_not_match():
    pool = PagePool(8, page_size=2)
    a = pool.allocate(3)
    pool.register(a, [1, 2, 3, 4, 5], 0)
    assert pool.match_prefix([9, 9, 3, 4, 5]) == []  # same second page, different first page
    assert pool.match_prefix([1, 2, 3, 4, 5]) == a[:2]


def test_flush_drops_only_unreferenced_pages():
    pool = PagePool(4, page_size=2)
    a = pool.allocate(2)
    pool.register(a, [1, 2, 3, 4], 0)
    pool.release(a[1:])
    assert pool.flush() == 1
    pool.check_integrity()
    assert pool.used_pages == 1


def test_random_operations_keep_the_invariant():
    rng = random.Random(7)
    pool = PagePool(32, page_size=2)
    held: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            pages = pool.match_prefix(tokens)
            extra = pool.allocate(pool.pages_for(len(tokens)) - len(pages))
            if extra is None:
                pool.release(pages)
                continue
            pages += extra
            pool.register(pages, tokens, 0)
            held.append(pages)
        elif held:
            pool.release(held.pop(rng.randrange(len(held))))
        pool.check_integrity()
    for pages in held:
        pool.release(pages)
    pool.check_integrity()
    assert pool.used_pages == 0
