"""Turning a flight's logits into next tokens, all rows at once.

Order of operations (vLLM's): grammar mask, stop tokens banned below ``min_new_tokens``, logit bias, repetition
penalty, frequency and presence penalties; then greedy rows take the argmax, and sampled rows divide by their
temperature, keep their top-k, renormalize, keep their top-p nucleus and their min-p share, and draw.

Every step is one tensor operation over the rows that need it, and each row's result depends only on that row
(row-wise kernels, a fixed candidate count for the nucleus), so a row picks the same token alone or inside any
batch.  A sampled row draws by an exponential race (:func:`.kernels.race_rows`: the argmax over its kept tokens of
``logit / temperature`` plus Gumbel noise), and the noise is a pure function of (the sequence's key, the position
of the token drawn, the token) (``sampling_noise``): a seeded request samples the same tokens alone, in any batch,
after a preemption, whether or not its tokens were drafted, and whether or not its logits were written (a row
without truncation, adjustments or logprobs runs its race in the head's kernel: ``OutputHead.pick``).

Logprobs are those of the model's raw distribution (before temperature and truncation, and before bias and
penalties), as vLLM and SGLang report them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Rows

import torch

from fiberserve import kernels
from fiberserve.engine.sampling_noise import row_seed
from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.sequence import Sequence
from fiberserve.engine.sequence_output import TokenLogprob
from fiberserve.model.head import argmax_rows
from fiberserve.model.small_tensors import tensor_of

#: Candidate counts tried, in order, for a row's top-p nucleus: the largest that the top-k kernel takes, then one
#: that covers all but the flattest distributions, then the whole vocabulary (a sort).
NUCLEUS_CANDIDATES = (64, 1024)


def sample(logits: torch.Tensor, seqs: Rows[Sequence], positions: Rows[int]) -> list[tuple[int, TokenLogprob | None]]:
    """One next token (and its logprob, if asked) per row of ``logits`` [R, vocab] float32.

    Row ``i`` picks for ``seqs[i]`` the token at index ``positions[i]`` of its tokens (prompt then output);
    a sequence may own several rows (a drafted decode).  The sequences are read, never changed, except that a
    grammar's matcher is asked for its mask.
    """
    logits = logits.float().cpu()
    params = [seq.params for seq in seqs]
    if all(p.argmax_only for p in params):
        return [(token, None) for token in argmax_rows(logits)]
    adjusted = adjust_logits(logits, seqs) if any(p.adjusts_logits for p in params) else logits
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    chosen = torch.empty(len(params), dtype=torch.long)
    if greedy:
        rows = adjusted if len(greedy) == len(params) else adjusted[greedy]
        chosen[greedy] = torch.tensor(argmax_rows(rows), dtype=torch.long)
    if drawn:
        rows = adjusted if len(drawn) == len(params) else adjusted[drawn]
        race = race_parameters([seqs[i] for i in drawn], [positions[i] for i in drawn])
        chosen[drawn] = draw(rows, [params[i] for i in drawn], race)
    return with_logprobs(logits, chosen, params)


def race_parameters(seqs: Rows[Sequence], positions: Rows[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's race: 1 / temperature as float32 (0 for a greedy row) and the seed of its draw (int64), as
    :func:`.kernels.race_rows` and the head's kernels take them."""
    inverse = [0.0 if seq.params.greedy else 1.0 / seq.params.temperature for seq in seqs]
    seeds = [row_seed(seq.sampling.key, position) for seq, position in zip(seqs, positions, strict=True)]
    return tensor_of(inverse, torch.float32), tensor_of(seeds, torch.long)


def adjust_logits(logits: torch.Tensor, seqs: Rows[Sequence]) -> torch.Tensor:
    """A copy of ``logits`` with each row's grammar mask, stop-token ban (below ``min_new_tokens``), logit bias and
    penalties applied, in that order."""
    out = logits.clone()
    banned: tuple[list[int], list[int]] = ([], [])
    biased: tuple[list[int], list[int], list[float]] = ([], [], [])
    repeated: tuple[list[int], list[int], list[float]] = ([], [], [])
    counted: tuple[list[int], list[int], list[float]] = ([], [], [])
    for row, seq in enumerate(seqs):
        p, state = seq.params, seq.sampling
        if not p.adjusts_logits:
            continue
        if state.grammar is not None:
            state.grammar.mask(out[row])
        if len(seq.output_ids) < p.min_new_tokens and state.stop_ids:
            banned[0].extend([row] * len(state.stop_ids))
            banned[1].extend(state.stop_ids)
        if p.logit_bias:
            biased[0].extend([row] * len(p.logit_bias))
            biased[1].extend(p.logit_bias)
            biased[2].extend(p.logit_bias.values())
        if p.repetition_penalty != 1.0:
            seen = set(seq.prompt_ids).union(seq.output_ids)
            repeated[0].extend([row] * len(seen))
            repeated[1].extend(seen)
            repeated[2].extend([p.repetition_penalty] * len(seen))
        if (p.frequency_penalty or p.presence_penalty) and seq.output_ids:
            for token, count in Counter(seq.output_ids).items():
                counted[0].append(row)
                counted[1].append(token)
                counted[2].append(p.frequency_penalty * count + p.presence_penalty)
    if banned[0]:
        out[_index(banned)] = float("-inf")
    if biased[0]:
        out.index_put_(_index(biased), torch.tensor(biased[2], dtype=out.dtype), accumulate=True)
    if repeated[0]:
        where, penalty = _index(repeated), torch.tensor(repeated[2], dtype=out.dtype)
        values = out[where]
        out[where] = torch.where(values > 0, values / penalty, values * penalty)
    if counted[0]:
        where = _index(counted)
        out[where] -= torch.tensor(counted[2], dtype=out.dtype)
    return out


def _index(pairs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rows, tokens) index of a list of adjustments."""
    return torch.tensor(pairs[0], dtype=torch.long), torch.tensor(pairs[1], dtype=torch.long)


def draw(logits: torch.Tensor, params: list[SamplingParams], race: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Row ``i``'s token drawn from ``logits[i]`` under ``params[i]`` (temperature, top-k, top-p, min-p) by its race
    (:func:`race_parameters` of the sampled rows) over the tokens its truncation keeps."""
    kernels.load()
    vocab = logits.shape[-1]
    inverse, seeds = race
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p, min_p = [p.top_p for p in params], [p.min_p for p in params]
    if any(top_k) or any(p < 1.0 for p in top_p) or any(min_p):
        scaled = logits * inverse[:, None]
        if any(top_k):
            _keep_top_k(scaled, top_k)
        if any(p < 1.0 for p in top_p) or any(min_p):
            probs = torch.softmax(scaled, dim=-1)
            floor = _nucleus_floor(probs, top_p)
            if any(min_p):
                floor = torch.maximum(floor, torch.tensor(min_p, dtype=probs.dtype) * probs.amax(dim=-1))
            scaled.masked_fill_(probs < floor[:, None], float("-inf"))
        logits = logits.masked_fill(scaled == float("-inf"), float("-inf"))
    picked = kernels.race_rows(logits, inverse, seeds)
    if bool((picked < 0).any()):  # a row with no finite logit left: its first (raw) maximum
        empty = picked < 0
        picked[empty] = torch.tensor(argmax_rows(logits[empty]), dtype=torch.long)
    return picked


def _keep_top_k(scaled: torch.Tensor, top_k: list[int]) -> None:
    """Set ``-inf`` below each row's ``top_k``-th largest value (0: the row is left whole)."""
    largest = _largest(scaled, max(top_k))
    k = torch.tensor(top_k, dtype=torch.long)
    kth = largest.gather(1, (k - 1).clamp(min=0)[:, None])
    kth[k == 0] = float("-inf")
    scaled.masked_fill_(scaled < kth, float("-inf"))


def _largest(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest values of each row, largest first."""
    if k <= NUCLEUS_CANDIDATES[0] and kernels.loaded():
        return kernels.top_k_rows(rows, k)[0]
    return torch.topk(rows, min(k, rows.shape[-1]), dim=-1).values


def _nucleus_floor(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Each row's smallest probability inside its top-p nucleus, the smallest set of likeliest tokens whose
    mass reaches ``top_p`` (0 for a row with ``top_p`` 1).  The candidates are the row's largest few; a row whose
    nucleus they may not hold whole is tried again with more, up to a sort of the whole row."""
    floor = torch.zeros(len(top_p), dtype=probs.dtype)
    rows = torch.tensor([i for i, p in enumerate(top_p) if p < 1.0], dtype=torch.long)
    limit = torch.tensor(top_p, dtype=probs.dtype)
    vocab = probs.shape[-1]
    for k in (*NUCLEUS_CANDIDATES, vocab):
        if len(rows) == 0:
            break
        k = min(k, vocab)
        largest = _largest(probs if len(rows) == len(top_p) else probs[rows], k)
        mass_before = largest.cumsum(dim=-1) - largest
        kept = (mass_before <= limit[rows, None]).sum(dim=-1)
        whole = (kept < k) | (k == vocab)
        floor[rows[whole]] = largest[whole].gather(1, (kept[whole] - 1).clamp(min=0)[:, None])[:, 0]
        rows = rows[~whole]
    return floor


def with_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, params: list[SamplingParams]
) -> list[tuple[int, TokenLogprob | None]]:
    """The picks, each with its logprob and top alternatives under the raw ``logits`` where its request asks."""
    tokens = chosen.tolist()
    results: list[tuple[int, TokenLogprob | None]] = [(token, None) for token in tokens]
    want = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs]
    if not want:
        return results
    log_probs = torch.log_softmax(logits[want], dim=-1)
    picked = log_probs.gather(1, chosen[want][:, None])[:, 0].tolist()
    top = max(params[i].top_logprobs for i in want)
    values, ids = torch.topk(log_probs, top, dim=-1) if top else (log_probs[:, :0], log_probs[:, :0].long())
    for i, logprob, top_values, top_ids in zip(want, picked, values.tolist(), ids.tolist(), strict=True):
        n = params[i].top_logprobs
        alternatives = list(zip(top_ids[:n], top_values[:n], strict=True))
        results[i] = (tokens[i], TokenLogprob(tokens[i], logprob, alternatives))
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
