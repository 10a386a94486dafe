"""Turning logits into next tokens: minimum lengths, logit bias, penalties, temperature, top-k, top-p, min-p,
seeds, logprobs.

Each row is processed on its own with the sequence's own ``torch.Generator``,
so a seeded request samples the same tokens alone or inside any batch.
Logprobs are those of the model's raw distribution (before temperature and
truncation, and before bias and penalties), as vLLM and SGLang report them.
"""

from __future__ import annotations

import torch

from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.sequence import Sequence, TokenLogprob
from fiberserve.model.llama import argmax_rows


def _adjust(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """``row`` (a copy, float32) with the tokens its grammar does not allow and its stop tokens below
    ``min_new_tokens`` banned, the request's logit bias added, then its penalties applied (vLLM's order)."""
    p = seq.params
    if seq.grammar is not None:
        seq.grammar.mask(row)
    if len(seq.output_ids) < p.min_new_tokens and seq.stop_ids:
        row[torch.tensor(sorted(seq.stop_ids), dtype=torch.long)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.tokens)), dtype=torch.long)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.output_ids:
        ids, counts = torch.tensor(seq.output_ids, dtype=torch.long).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
    return row


def _truncate(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (not renormalized)."""
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop = cumulative - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
    """One next token (and its logprob, if asked) per row of ``logits`` [R, vocab] float32."""
    logits = logits.cpu()  # per-sequence generators live on the CPU
    want_logprobs = any(s.params.logprobs or s.params.top_logprobs for s in seqs)
    log_probs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if all(s.params.greedy and not s.params.adjusts_logits for s in seqs):
        chosen = argmax_rows(logits)
    else:
        chosen = []
        for i, seq in enumerate(seqs):
            row = logits[i]
            if seq.params.adjusts_logits:
                row = _adjust(row.clone(), seq)
            if seq.params.greedy:
                chosen.append(int(row.argmax()))
            else:
                probs = _truncate(row, seq.params)
                chosen.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    results: list[tuple[int, TokenLogprob | None]] = []
    for i, (seq, token) in enumerate(zip(seqs, chosen, strict=True)):
        info = None
        if log_probs is not None and (seq.params.logprobs or seq.params.top_logprobs):
            row = log_probs[i]
            top = []
            if seq.params.top_logprobs:
                values, ids = torch.topk(row, seq.params.top_logprobs)
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            info = TokenLogprob(token, float(row[token]), top)
        results.append((token, info))
    return results


def score_tokens(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """The logprob of ``targets[i]`` under row ``i`` of ``logits`` [len(targets), vocab], with the ``top`` most
    likely alternatives: how a prompt is scored (the raw distribution, as for generated tokens)."""
    log_probs = torch.log_softmax(logits.cpu().float(), dim=-1)
    chosen = log_probs.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0].tolist()
    if top:
        values, ids = torch.topk(log_probs, top, dim=-1)
        alternatives = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        alternatives = [[] for _ in targets]
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(targets, chosen, alternatives, strict=True)]
