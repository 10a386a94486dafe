"""The page pool and its prefix cache (no model)."""

from __future__ import annotations

import random
from pathlib import Path

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


def test_the_kv_cache_is_sized_for_the_model_within_a_share_of_memory():
    from fiberserve.config import EngineConfig
    from fiberserve.engine.service import KV_CACHE_MIN_MB, kv_cache_pages

    MiB, GiB = 2**20, 2**30
    page = 16 * 32 * 1024  # 16 tokens of a Llama-3.2-1B shape in bf16: 32 KiB a token
    auto = EngineConfig()
    assert auto.kv_cache_mb is None and auto.kv_pages is None
    # the embedded model's context fits the least size: that size, as before
    small = 16 * 23 * 1024
    pages, bound = kv_cache_pages(auto, small, 8192, 20 * GiB)
    assert pages == KV_CACHE_MIN_MB * MiB // small and "its least size" in bound
    # a 131072-token context: one sequence of it (4 GiB) where a quarter of the memory holds it
    pages, bound = kv_cache_pages(auto, page, 131072, 20 * GiB)
    assert pages * 16 == 131072 and bound == "the model's context (one sequence of it)"
    # else a quarter of the memory: 8 GiB available -> 2 GiB -> 65536 tokens
    pages, bound = kv_cache_pages(auto, page, 131072, 8 * GiB)
    assert pages * 16 == 65536 and bound == "25% of the memory available at start (8.0 GiB)"
    # never below the least size, even on a machine with little memory left
    assert kv_cache_pages(auto, page, 131072, 256 * MiB)[0] == KV_CACHE_MIN_MB * MiB // page
    # given sizes win
    assert kv_cache_pages(EngineConfig(kv_cache_mb=64), page, 131072, 20 * GiB) == (128, "--kv-cache-mb")
    assert kv_cache_pages(EngineConfig(kv_pages=7, kv_cache_mb=64), page, 131072, 20 * GiB) == (7, "--kv-pages")


def test_a_kv_cache_takes_memory_only_as_its_pages_are_written():
    """Sized for a whole context by default, the cache must not be resident before it is used, but for the pages
    handed out first: zeros from the operating system, page-aligned."""
    import torch

    from fiberserve.model.batch import KVCache
    from fiberserve.model.config import ModelConfig

    def rss() -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    config = ModelConfig(
        architecture="llama", vocab_size=256, hidden_size=512, intermediate_size=1024,
        num_layers=16, num_heads=8, num_kv_heads=8, head_dim=64,
    )  # fmt: skip
    before = rss()
    cache = KVCache(config, 4096, 16, torch.bfloat16, "cpu", resident_pages=64)  # 2 GiB; 32 MiB written at once
    assert 32 * 2**20 <= rss() - before < 96 * 2**20
    assert cache.k.data_ptr() % 4096 == 0 and cache.v.data_ptr() % 4096 == 0  # page-aligned
    assert cache.k.shape == (16, 65536, 8, 64) and cache.k.dtype == torch.bfloat16
    cache.v[3, 1000:1016] = 1.5
    assert float(cache.k[15, -1].abs().sum()) == 0.0 and float(cache.v[3, 1000:1016].sum()) == 1.5 * 16 * 8 * 64


def test_quarantined_pages_stay_in_use_until_their_quarantine_ends():
    pool = PagePool(num_pages=4, page_size=2)
    held = pool.allocate(3)
    assert held is not None
    pool.register(held, [1, 2, 3, 4, 5], 0)  # two full pages enter the prefix cache
    pool.quarantine("fiber-0", held)
    pool.check_integrity()
    assert pool.quarantined == {"fiber-0": 3} and pool.quarantined_references == 3 and pool.quarantined_pages == 3
    assert pool.used_pages == 3 and pool.cached_pages == 0 and pool.available_pages == 1
    assert pool.allocate(2) is None  # nobody gets them meanwhile
    assert pool.end_quarantine("fiber-0") == 3
    assert pool.quarantined == {} and pool.used_pages == 0 and pool.cached_pages == 2 and pool.free_pages == 2
    assert pool.end_quarantine("fiber-0") == 0
    pool.check_integrity()
