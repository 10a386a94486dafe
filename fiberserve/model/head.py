"""The output head: final hidden states to logits, and each row's pick.

The head's product gives bf16 (or int8) logits, whose top tokens often nearly tie; the leading
:data:`REFINED_LOGITS` candidates of every row are re-scored exactly (float32 hidden state against the head's
rows, accumulated in float64 on CPU), so a greedy pick is the float32 model's.  The work is per row, so batch
invariant.  Where the head's product is one of the extension's kernels, :meth:`OutputHead.pick` never writes the
[rows, vocab] logits at all: the kernel keeps each row's candidates and race entries as its tiles produce them.
"""

from __future__ import annotations

import torch

from fiberserve import kernels
from fiberserve.model.file_rows import FileRows
from fiberserve.model.linear import Linear, QuantLinear

#: How many of the top bf16 logits of a row are recomputed exactly.
REFINED_LOGITS = 16


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(-1)`` (the first maximum), by the CPU kernel where the model built the kernels (8x faster
    over a vocabulary)."""
    if kernels.loaded() and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        picked = kernels.top_k_rows(logits, 1)[1][:, 0]
        if bool((picked >= 0).all()):  # a row of NaN has no pick: leave it to torch
            return picked.tolist()
    return logits.argmax(dim=-1).tolist()


class OutputHead:
    """The head's product (``linear``), the rows it re-scores from (``rows``: the head's matrix in the model's
    dtype, in memory or read from the file's blocks), the final soft-cap, and a reranker's score head."""

    def __init__(
        self,
        linear: Linear | QuantLinear,
        rows: torch.Tensor | FileRows,
        vocab_size: int,
        dtype: torch.dtype,
        final_softcap: float | None = None,
        score_head: torch.Tensor | None = None,
        score_bias: torch.Tensor | None = None,
    ) -> None:
        self.linear, self.rows, self.vocab_size = linear, rows, vocab_size
        self.dtype, self.final_softcap = dtype, final_softcap
        #: A reranker's score head [labels, hidden] and its bias, float32 (None: the file has none).
        self.score_head, self.score_bias = score_head, score_bias

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 [R, vocab] over the final hidden states ``h``, the top candidates re-scored exactly."""
        logits = self.linear(h.to(self.dtype), wide=True).float()  # float32 straight from the CPU kernels
        if self.dtype != torch.float32:
            self._refine_top(logits, h)
        if (cap := self.final_softcap) is not None:  # monotonic: greedy picks are the same either way
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def label_scores(self, h: torch.Tensor) -> torch.Tensor:
        """The score head over ``h``: float32 [R, labels] (a reranker's raw scores)."""
        assert self.score_head is not None, "the model has a score head"
        scores = h.float().cpu() @ self.score_head.T
        return scores if self.score_bias is None else scores + self.score_bias

    @torch.inference_mode()
    def pick(self, h: torch.Tensor, race: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
        """Each row's token: its argmax (the first maximum), or for a row whose ``race`` (inverse temperature
        float32 [R], 0 for an argmax row; seeds int64 [R]) says so, its draw (:func:`.kernels.race_rows` over
        its logits): the same tokens as :meth:`logits` would give, either way.

        Where the head is one of the extension's products, its kernel keeps each row's top candidates (and race
        entries) as its tiles produce them (``quant_linear_race``, ``bf16_linear_race``), and the pick is taken
        over those once re-scored (:func:`.kernels.refined_race`): the float32 logits are never written nor read
        back."""
        rows, k = h.shape[0], REFINED_LOGITS + 1  # the re-scored candidates and the best of the rest
        inverse, seeds = race if race is not None else (torch.zeros(rows), torch.zeros(rows, dtype=torch.long))
        # The cap is monotonic: an argmax keeps it, a draw does not.
        capped = self.final_softcap is not None and bool((inverse > 0).any())
        if self.dtype != torch.float32 and k < self.vocab_size and not capped:
            found = self.linear.race(h.to(self.dtype), k, inverse, seeds)
            if found is not None:
                weight, weight_rows = self._rows_for(found[1][:, :REFINED_LOGITS])
                picked = kernels.refined_race(found, h, weight, inverse, seeds, weight_rows).tolist()
                if all(token >= 0 for token in picked):  # else a row of NaN: the logits below decide
                    return picked
        logits = self.logits(h)
        picks = argmax_rows(logits)
        drawn = (inverse > 0).nonzero()[:, 0]
        if len(drawn):  # the race runs on the CPU kernels, whatever the model's device
            kernels.load()
            raced = kernels.race_rows(logits[drawn.to(logits.device)].cpu(), inverse[drawn], seeds[drawn]).tolist()
            for row, token in zip(drawn.tolist(), raced, strict=True):
                picks[row] = token if token >= 0 else picks[row]
        return picks

    def _rows_for(self, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the re-scoring kernels read for ``candidates`` [R, k]: the whole head where it is in memory, else
        the table of rows read from the file and the candidates' places in it (-1, a row of NaN's missing
        candidate, reads row 0, never used)."""
        if isinstance(self.rows, torch.Tensor):
            return self.rows, None
        return self.rows.table_rows(candidates.clamp(min=0))

    def _refine_top(self, logits: torch.Tensor, h: torch.Tensor) -> None:
        """Recompute the leading candidates' logits exactly, in place (see the module docstring)."""
        k = min(REFINED_LOGITS, logits.shape[-1])
        if logits.device.type == "cpu":  # one kernel: top-k (5x torch.topk over a vocabulary), float64 dots
            if isinstance(self.rows, torch.Tensor):
                kernels.refine_top_logits(logits, h, self.rows, k)
            else:  # the candidates' rows, read from the file
                table, places = self._rows_for(kernels.top_k_rows(logits, k)[1])
                kernels.refine_top_logits(logits, h, table, k, places)
            return
        assert isinstance(self.rows, torch.Tensor), "rows read from the file serve the CPU"
        top = logits.topk(k, dim=-1).indices  # [R, k]
        logits.scatter_(1, top, (h.unsqueeze(1) * self.rows[top].float()).sum(-1))
