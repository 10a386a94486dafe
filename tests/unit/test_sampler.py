"""The batched sampler: exact distributions (chi-square), seeded draws the same alone and in any batch, each
adjustment equal to a plain per-row reference, logprobs of the raw distribution (no model)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from scipy import stats

from fiberserve import kernels
from fiberserve.engine.sampler import NUCLEUS_CANDIDATES, adjust_logits, sample
from fiberserve.engine.sampling_noise import row_seed, sampling_key
from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.sequence import Sequence
from fiberserve.model.tokenizer import IncrementalDetokenizer

STOP = 3


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def make(params: SamplingParams, prompt=(5, 6, 7), output=(), index=0) -> Sequence:
    seq = Sequence(
        "r", index, list(prompt), params, IncrementalDetokenizer(_NoText(), list(prompt)), frozenset({STOP}), 4096
    )
    seq.output_ids = list(output)
    return seq


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    kernels.load()  # the sampler's top-k kernel serves once the kernels are built


def expected_distribution(logits: list[float], p: SamplingParams) -> list[float]:
    """The truncated distribution, computed the textbook way (a sort, in float64)."""
    scaled = [x / p.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[: p.top_k] if p.top_k > 0 else order)
    top = max(scaled)
    weights = [math.exp(scaled[i] - top) if i in keep else 0.0 for i in range(len(scaled))]
    total = sum(weights)
    probs = [w / total for w in weights]
    if p.top_p < 1.0:
        mass, nucleus = 0.0, set()
        for i in order:
            if mass > p.top_p or probs[i] == 0.0:
                break
            nucleus.add(i)
            mass += probs[i]
        probs = [q if i in nucleus else 0.0 for i, q in enumerate(probs)]
    if p.min_p:
        floor = p.min_p * max(probs)
        probs = [q if q >= floor else 0.0 for q in probs]
    total = sum(probs)
    return [q / total for q in probs]


LOGITS = [2.0, 1.5, 1.0, 0.4, 0.3, -0.5, -1.0, -3.0]
TRUNCATIONS = {
    "plain": SamplingParams(temperature=1.0),
    "temperature": SamplingParams(temperature=0.6),
    "hot": SamplingParams(temperature=1.7),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.15),
    "all": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_draws_follow_the_exact_distribution(name):
    params = TRUNCATIONS[name]
    draws = 20_000
    seqs = [make(params, index=i) for i in range(draws)]
    logits = torch.tensor([LOGITS] * draws)
    tokens = [token for token, _ in sample(logits, seqs, [3] * draws)]
    counts = [tokens.count(t) for t in range(len(LOGITS))]
    expected = expected_distribution(LOGITS, params)
    assert all(c == 0 for c, q in zip(counts, expected, strict=True) if q == 0.0), (counts, expected)
    observed = [c for c, q in zip(counts, expected, strict=True) if q > 0]
    wanted = [q * draws for q in expected if q > 0]
    if len(observed) > 1:
        assert stats.chisquare(observed, wanted).pvalue > 1e-4, (counts, expected)
    else:
        assert observed == [draws]


def test_a_sequence_draws_independently_position_after_position():
    """One sequence's successive positions are independent draws of the same distribution."""
    params = SamplingParams(temperature=1.0)
    seq = make(params)
    draws = 20_000
    logits = torch.tensor([LOGITS] * draws)
    tokens = [token for token, _ in sample(logits, [seq] * draws, range(draws))]
    counts = [tokens.count(t) for t in range(len(LOGITS))]
    assert stats.chisquare(counts, [q * draws for q in expected_distribution(LOGITS, params)]).pvalue > 1e-4
    pairs = [(a, b) for a, b in itertools.pairwise(tokens) if a == 0]  # after a 0, the next is as often 0
    follow = sum(1 for _, b in pairs if b == 0) / len(pairs)
    assert abs(follow - counts[0] / draws) < 0.03


def test_noise_is_keyed_by_sequence_and_position_and_even_over_tokens():
    key = sampling_key(1234, 0)
    assert row_seed(key, 7) == row_seed(sampling_key(1234, 0), 7)
    assert len({row_seed(key, 7), row_seed(sampling_key(1234, 1), 7), row_seed(sampling_key(1235, 0), 7)}) == 3
    assert all(-(2**63) <= row_seed(key, p) < 2**63 for p in range(100))
    # A flat row of 37 tokens (two groups of 16 and a tail) is won by each token equally often.
    draws, vocab = 37_000, 37
    seeds = torch.tensor([row_seed(key, p) for p in range(draws)])
    picks = kernels.race_rows(torch.zeros(draws, vocab), torch.ones(draws), seeds)
    assert stats.chisquare(torch.bincount(picks, minlength=vocab).tolist()).pvalue > 1e-4


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([-1, -1, 1, 5, 40, 100]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9, 0.99]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.4]),
        presence_penalty=rng.choice([0.0, 0.0, 1.0]),
        logit_bias=rng.choice([{}, {}, {11: 5.0, 12: -100.0}]),
        min_new_tokens=rng.choice([0, 0, 5]),
        max_new_tokens=64,
        logprobs=rng.random() < 0.3,
        top_logprobs=rng.choice([0, 0, 3]),
        seed=rng.randrange(2**32),
    )


def test_each_row_picks_the_same_alone_and_in_any_batch():
    rng = random.Random(5)
    vocab = 3000
    seqs = [
        make(random_params(rng), output=[rng.randrange(vocab) for _ in range(rng.randrange(8))], index=i)
        for i in range(40)
    ]
    positions = [rng.randrange(3, 200) for _ in seqs]
    torch.manual_seed(0)
    logits = torch.randn(len(seqs), vocab) * 4
    logits[::3] = torch.randn(len(seqs[::3]), vocab) * 0.01  # flat rows: nuclei past every candidate count
    together = sample(logits, seqs, positions)
    alone = [sample(logits[i : i + 1], [seq], [positions[i]])[0] for i, seq in enumerate(seqs)]
    order = list(range(len(seqs)))
    rng.shuffle(order)
    shuffled = sample(logits[order], [seqs[i] for i in order], [positions[i] for i in order])
    assert [token for token, _ in together] == [token for token, _ in alone]
    assert [together[i][0] for i in order] == [token for token, _ in shuffled]
    for (_, a), (_, b) in zip(together, alone, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_seed_repeats_its_tokens_and_another_seed_differs():
    logits = torch.randn(1, 500) * 0.5
    picks = {
        seed: [sample(logits, [make(SamplingParams(seed=seed))], [p])[0][0] for p in range(40)] for seed in (1, 1, 2)
    }
    again = [sample(logits, [make(SamplingParams(seed=1))], [p])[0][0] for p in range(40)]
    assert picks[1] == again and picks[1] != picks[2]


def reference_adjust(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The adjustments one row at a time, in vLLM's order."""
    p = seq.params
    row = row.clone()
    if len(seq.output_ids) < p.min_new_tokens:
        row[sorted(seq.sampling.stop_ids)] = float("-inf")
    for token, bias in p.logit_bias.items():
        row[token] += bias
    if p.repetition_penalty != 1.0:
        for token in set(seq.tokens):
            value = row[token]
            row[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(seq.output_ids):
        row[token] -= p.frequency_penalty * seq.output_ids.count(token) + p.presence_penalty
    return row


def test_adjustments_equal_a_row_by_row_reference():
    rng = random.Random(9)
    vocab = 200
    seqs = [
        make(
            random_params(rng),
            prompt=[rng.randrange(vocab) for _ in range(6)],
            output=[rng.randrange(vocab) for _ in range(rng.randrange(10))],
        )
        for _ in range(30)
    ]
    logits = torch.randn(len(seqs), vocab) * 3
    adjusted = adjust_logits(logits, seqs)
    for i, seq in enumerate(seqs):
        assert torch.equal(adjusted[i], reference_adjust(logits[i], seq)), seq.params


def test_parameters_act_on_the_pick():
    vocab = 100
    logits = torch.zeros(1, vocab)
    logits[0, 42] = 10.0
    logits[0, STOP] = 20.0
    pick = lambda p, **kw: sample(logits, [make(p, **kw)], [3])[0][0]  # noqa: E731
    assert pick(SamplingParams(temperature=0)) == STOP
    assert pick(SamplingParams(temperature=0, min_new_tokens=2)) == 42  # the stop token is banned below min_tokens
    assert pick(SamplingParams(temperature=0, min_new_tokens=2), output=[1, 2]) == STOP
    assert pick(SamplingParams(temperature=0, logit_bias={7: 50.0})) == 7
    assert pick(SamplingParams(temperature=0, repetition_penalty=4.0), prompt=[STOP]) == 42  # 20 / 4 < 10
    assert pick(SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0), output=[STOP] * 5) == 42
    for seed in range(20):  # one token of the top-k set: sampling never leaves it
        assert pick(SamplingParams(temperature=5.0, top_k=2, seed=seed)) in (STOP, 42)
        assert pick(SamplingParams(temperature=2.0, top_p=0.5, seed=seed)) == STOP
        assert pick(SamplingParams(temperature=50.0, min_p=0.9, seed=seed)) in (STOP, 42)


def test_nucleus_past_every_candidate_count_equals_a_sort():
    """A flat row's nucleus holds more tokens than any candidate count but the whole vocabulary."""
    vocab = NUCLEUS_CANDIDATES[-1] * 3
    torch.manual_seed(3)
    logits = torch.randn(1, vocab) * 0.05
    params = SamplingParams(temperature=1.0, top_p=0.9)
    expected = expected_distribution(logits[0].tolist(), params)
    allowed = {i for i, q in enumerate(expected) if q > 0}
    assert len(allowed) > NUCLEUS_CANDIDATES[-1]
    draws = 3000
    seqs = [make(params, index=i) for i in range(draws)]
    tokens = {token for token, _ in sample(logits.expand(draws, vocab).contiguous(), seqs, [3] * draws)}
    assert tokens <= allowed and len(tokens) > NUCLEUS_CANDIDATES[-1]


def test_logprobs_are_the_raw_distributions():
    torch.manual_seed(1)
    logits = torch.randn(3, 300) * 2
    params = [
        SamplingParams(temperature=0.5, logprobs=True, top_logprobs=4, logit_bias={9: 30.0}),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=1.0),
    ]
    picks = sample(logits, [make(p) for p in params], [3, 3, 3])
    raw = torch.log_softmax(logits, dim=-1)
    (token, first), (greedy, second), (_, third) = picks
    assert token == 9 and first.logprob == pytest.approx(float(raw[0, 9]), abs=1e-6)
    assert [t for t, _ in first.top] == raw[0].topk(4).indices.tolist()
    assert greedy == int(logits[1].argmax()) and second.top == [] and third is None


def test_drafted_rows_keep_the_distribution_of_plain_decoding():
    """Speculative sampling with prompt-lookup drafts: rows fed a draft draw, ``FlightItem.accept`` keeps picks
    while they equal the draft; the first two tokens then follow the model's own distribution (a Markov chain
    here: each token's logits depend on the token before), whatever the draft."""
    from fiberserve.engine.flight import FlightItem

    vocab = 5
    torch.manual_seed(4)
    chain = torch.randn(vocab, vocab) * 1.5  # logits of the next token given the previous one
    probs = torch.softmax(chain.double(), dim=-1).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    trials, first = 12_000, 0
    pairs = []
    for trial in range(trials):
        seq = make(params, prompt=[first], index=trial)
        draft = (trial % vocab, (trial // vocab) % vocab)  # every draft, drafted by nothing the model knows
        item = FlightItem(seq, start=0, length=1 + len(draft), pages=(0,), draft=draft)
        fed = [first, *draft]
        picks = sample(chain[fed], [seq] * len(fed), list(item.sampled_positions))
        kept = [token for token, _ in item.accept(picks)]
        while len(kept) < 2:  # decode on without drafts
            kept.append(sample(chain[kept[-1:]], [seq], [1 + len(kept)])[0][0])
        pairs.append(kept[0] * vocab + kept[1])
    counts = [pairs.count(i) for i in range(vocab * vocab)]
    expected = [probs[first][i // vocab] * probs[i // vocab][i % vocab] for i in range(vocab * vocab)]
    expected = [q * trials / sum(expected) for q in expected]
    assert stats.chisquare(counts, expected).pvalue > 1e-4, counts
