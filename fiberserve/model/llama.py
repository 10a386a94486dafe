"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2/3, Gemma 2/3, Phi-3) over a paged KV cache.

One :meth:`LlamaModel.forward` runs a *flat* batch: the new tokens of every
sequence laid end to end (no padding rows), each with its position and the
KV-cache slot it writes.  Prefill chunks and single decode tokens share the
call.  Attention reads each sequence's keys through its own page table only.

Batch invariance (same logits for a row alone or inside any batch) is a
design goal, and it shapes the code:

* linear layers are row-wise and prepacked for oneDNN (:mod:`.linear`);
* the residual stream is float32 in every dtype (only the inputs of the
  linear layers and attention are rounded to bf16).  With a bf16 residual,
  changing only the rounding of attention flipped a greedy answer ("The
  capital of France is Paris" -> "L'Etoile ...", a 0.08 logit margin in
  float32); with a float32 residual bf16 keeps float32's order there;
* on CPU the rest of a layer is four C++ kernels (:mod:`.kernels`): add +
  RMSNorm, RoPE + KV write, paged attention, SiLU x up.  Each computes a row
  from that row alone in a fixed order, so any row gives the same bits alone,
  in any batch, as a decode token or inside a prefill chunk of any length.
  Attention reads each sequence's pages in place through its page table: no
  gathered key copies, no padding, no masks.  When every linear layer is one
  of the extension's products too, the loop over the layers runs in C++
  (``kernels.decoder_layers``): one call per forward pass instead of 270,
  which matters most on a fiber's thread, where each call was a GIL handoff
  with the event loop.  Layers of other shapes (q/k norms, Gemma's extra norms,
  sliding windows, soft-capping) run in PyTorch ops around the same attention
  kernel (``_layers_generic``): PyTorch's CPU attention can give a row other
  bits inside a longer span;
* elsewhere (CUDA) the layer is PyTorch ops and ``scaled_dot_product_attention``
  over keys gathered into a buffer padded to a multiple of :data:`KEY_BUCKET`;
  decode rows are grouped by that padded length, so a row's reductions have
  the same shape alone or in a batch; the padded keys are masked to exactly
  zero weight and only ever *read* (from slot 0 of the cache).  In float32,
  query matrices are padded to at least :data:`MIN_QUERY_ROWS` rows there.

The KV cache is laid out ``[layer, slot, kv_head, head_dim]``: a page is one
contiguous run of ``page_size * kv_heads * head_dim`` values.  The generic path
gathers a decode group's keys as one row gather (``index_select`` on dim 0)
and groups decode queries by kv head (the ``G`` query heads that share a kv
head are the rows of one small attention problem), so GQA costs no key
duplication.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from fiberserve import kernels
from fiberserve.model.batch import ForwardBatch, KVCache, SequenceSpan
from fiberserve.model.file_rows import FileRows
from fiberserve.model.layer_weights import LayerWeights
from fiberserve.model.linear import (
    Linear,
    QuantLinear,
    kernel_parts,
    make_linear,
    quant_kernel_available,
)
from fiberserve.model.loader import Checkpoint, LazyWeights
from fiberserve.model.rope_tables import RopeTables
from fiberserve.model.small_tensors import tensor_of

#: Key buffers are padded to a multiple of this many positions (see module docstring).
KEY_BUCKET = 64
#: In float32, attention never runs with fewer query rows per problem than this:
#: thin float32 products take a different (differently rounding) path, so a
#: decode row would not match the same row computed inside a prefill.  bf16 rows match at any count.
MIN_QUERY_ROWS = {torch.float32: 8}
#: How many of the top bf16 logits of a row are recomputed exactly (see ``_refine_top``).
REFINED_LOGITS = 16
#: Decoder layers built at once when a model loads (threads: their unpacking and packing run without the GIL).
LAYERS_AT_ONCE = 2


def _page_table(span: SequenceSpan, page_size: int, padded: int) -> torch.Tensor:
    """The pages holding the span's keys, padded with page 0 (read, masked) to cover ``padded`` keys.

    Slots are page-aligned (position i lives at ``pages[i // page_size] * page_size + i % page_size``),
    so every ``page_size``-th slot names the next page.
    """
    pages = torch.zeros(padded // page_size, dtype=torch.long)
    used = span.page_list(page_size)
    pages[: len(used)] = torch.tensor(used, dtype=torch.long)
    return pages


def _rows(starts: list[int], device) -> slice | torch.Tensor:
    """Row indices as a slice when they are consecutive (decodes usually are), which indexes without a copy."""
    if starts == list(range(starts[0], starts[0] + len(starts))):
        return slice(starts[0], starts[0] + len(starts))
    return torch.tensor(starts, dtype=torch.long, device=device)


def _additive(mask: torch.Tensor, dtype, device) -> torch.Tensor:
    """A boolean keep-mask as the additive mask attention adds to its scores."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")).to(device)


@dataclass
class _AttentionPlan:
    """Index tensors shared by every layer of one forward call.

    Keys are gathered a page at a time: a page is one contiguous row of
    ``page_size * kv_heads * head_dim`` values, so a gather moves whole rows with 16x
    fewer indices than a slot-at-a-time gather.
    """

    decode_groups: list[tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor]]  # rows, pages [B*P], mask
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # start, length, pages [P], mask [Q, L]

    @classmethod
    def build(
        cls, batch: ForwardBatch, page_size: int, min_query_rows: int, dtype, device, window: int | None = None
    ) -> _AttentionPlan:
        """Group decode rows by padded key length; give each prefill chunk its causal mask (and, for layers with
        a sliding ``window``, one that hides the keys before each row's last ``window``).

        Key buffers are padded to a multiple of both :data:`KEY_BUCKET` and the page size.
        A chunk with fewer than ``min_query_rows`` rows gets extra mask rows (for the
        zero query rows :meth:`LlamaModel._pad_rows` adds) that see key 0 only.  Masks
        are additive (0 or -inf, in ``dtype``), built once here rather than by every
        layer's attention call.
        """
        unit = math.lcm(KEY_BUCKET, page_size)
        by_bucket: dict[int, list[SequenceSpan]] = {}
        prefills = []
        for span in batch.spans:
            padded = -(-span.context // unit) * unit
            if span.length == 1:
                by_bucket.setdefault(padded, []).append(span)
                continue
            first = span.context - span.length
            query_pos = torch.arange(first, span.context).unsqueeze(1)
            keys = torch.arange(padded).unsqueeze(0)
            mask = keys <= query_pos  # causal; also hides padding
            if window is not None:
                mask &= keys > query_pos - window
            if span.length < min_query_rows:
                mask = torch.cat([mask, torch.arange(padded).eq(0).expand(min_query_rows - span.length, -1)])
            pages = _page_table(span, page_size, padded)
            prefills.append((span.start, span.length, pages.to(device), _additive(mask, dtype, device)))
        groups = []
        for padded, spans in by_bucket.items():
            starts = [s.start for s in spans]
            rows = _rows(starts, device)
            pages = torch.cat([_page_table(s, page_size, padded) for s in spans])
            mask = torch.zeros(len(spans), padded, dtype=torch.bool)
            for i, s in enumerate(spans):
                mask[i, max(0, s.context - window) if window else 0 : s.context] = True
            groups.append((rows, pages.to(device), _additive(mask.view(len(spans), 1, 1, padded), dtype, device)))
        return cls(groups, prefills)


#: The generic loop's attention: (q [T, H, D], one layer's k and v cache, the layer's window) -> [T, H * D].
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None], torch.Tensor]


@dataclass
class _KernelPlan:
    """The inputs of :func:`.kernels.paged_attention` for one forward call (every layer shares them)."""

    pages: torch.Tensor  #: int32 [spans, max pages]: each span's page table, padded with page 0
    row_span: torch.Tensor  #: int32 [rows]: the span of each row; -1 for a padding row
    row_keys: torch.Tensor  #: int32 [rows]: how many keys each row sees (its position + 1)

    @classmethod
    def build(cls, batch: ForwardBatch, page_size: int, rows: int) -> _KernelPlan:
        row_span, row_keys, tables = [-1] * rows, [0] * rows, []
        for index, span in enumerate(batch.spans):
            end, first = span.start + span.length, span.context - span.length
            row_span[span.start : end] = [index] * span.length
            row_keys[span.start : end] = range(first + 1, span.context + 1)
            tables.append(span.page_list(page_size))
        width = max(map(len, tables), default=1)
        padded = [page for table in tables for page in table + [0] * (width - len(table))] or [0]
        pages = tensor_of(padded, torch.int32).view(-1, width)
        return cls(pages, tensor_of(row_span, torch.int32), tensor_of(row_keys, torch.int32))


def _rope_inv_freq(
    dim: int, theta: float, scaling: dict | None, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.double()
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


def _norm_if(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x`` through an RMSNorm of ``weight`` in float32 where there is one (Gemma's extra norms), else ``x``."""
    return x if weight is None else F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(-1)`` (the first maximum), by the CPU kernel where the model built the kernels (8x faster
    over a vocabulary)."""
    if kernels.loaded() and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        picked = kernels.top_k_rows(logits, 1)[1][:, 0]
        if bool((picked >= 0).all()):  # a row of NaN has no pick: leave it to torch
            return picked.tolist()
    return logits.argmax(dim=-1).tolist()


class LlamaModel:
    """Weights plus the forward pass; stateless between calls (the KV cache is passed in)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        quantization: str = "none",
        progress: bool = False,
    ) -> None:
        """``quantization="int4"``: every matrix a GGUF file stores in a format served as is (``NATIVE_BITS``) in
        the file's own blocks; the others in Q4_1 blocks, the output head in Q8_0 (4-bit where the CPU has neither
        AVX512-VNNI nor AVX2); computed as llama.cpp does (see
        :class:`.QuantLinear`; CPU only); norms stay in ``dtype``, the embedding's and the head's rows are read in
        ``dtype`` from the file's blocks as lookups ask for them (:class:`.FileRows`; whole in ``dtype`` where the
        file stores them otherwise), and the top candidates the head picks are re-scored exactly by
        :meth:`_refine_top` from those ``dtype`` rows."""
        if quantization != "none" and torch.device(device).type != "cpu":
            raise ValueError(f"quantization {quantization!r} runs on CPU only")
        config = checkpoint.config
        w = checkpoint.weights
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        tied = config.tie_word_embeddings or "lm_head.weight" not in w
        head_bits = 8 if quantization != "none" and quant_kernel_available() else 4  # llama.cpp's Q8_0 output head
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        head_blocks = w.blocks(head_name) if quantization == "int4" else None

        def head() -> Linear | QuantLinear:
            if head_blocks is not None:  # the file's own (QuantLinear requantizes bytes where no kernel takes them)
                return QuantLinear(head_blocks, dtype=dtype)
            return make_linear(w[head_name].to(self.device), None, quantization, dtype, head_bits)

        self.embed = self._rows_of("model.embed_tokens.weight", w, quantization)
        self.lm_head = self.embed if tied else self._rows_of("lm_head.weight", w, quantization)
        self.norm = w["model.norm.weight"].to(device=self.device, dtype=torch.float32)
        #: A reranker's score head [labels, hidden] and its bias, float32 (None: the file has none).
        self.score_head = w["score.weight"].float() if "score.weight" in w else None
        self.score_bias = w["score.bias"].float() if "score.bias" in w else None
        self.quantization = quantization
        #: Attention runs on :func:`.kernels.paged_attention` (CPU, a head size and group the kernel takes).
        self.kernel_attention = self.device.type == "cpu" and kernels.supports(config, dtype)
        #: The whole layer runs on the extension's kernels (also Llama-shaped layers: no extra norms or windows).
        self.fused = self.kernel_attention and config.plain_layers
        if self.kernel_attention:
            kernels.load()
        # Layer by layer from the checkpoint's file, LAYERS_AT_ONCE at a time: the unpacking and packing kernels
        # run without the GIL, and only those layers' temporaries exist at once.
        with ThreadPoolExecutor(LAYERS_AT_ONCE, thread_name_prefix="fiberserve-load") as pool:
            logits = pool.submit(head)  # beside the first layers
            built = pool.map(
                lambda i: LayerWeights(w, i, config, dtype, self.device, quantization, self.fused),
                range(config.num_layers),
            )
            self.layers = list(
                tqdm(built, total=config.num_layers, desc="loading layers", unit="layer", disable=not progress)
            )
            self.logits: Linear | QuantLinear = logits.result()
        linears = [self.logits] + [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.min_rows = max(x.min_rows for x in linears)
        inv_freq = _rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, checkpoint.rope_freq_factors)
        local_inv_freq = None
        if config.rope_local_theta is not None:
            local_inv_freq = _rope_inv_freq(config.head_dim, config.rope_local_theta, None)
        self.rope = RopeTables(inv_freq, local_inv_freq, config.max_position_embeddings, self.device)
        self.scale = config.attention_scale or 1.0 / math.sqrt(config.head_dim)
        self.min_query_rows = MIN_QUERY_ROWS.get(dtype, 1)
        self.eps = config.rms_norm_eps
        #: The layers' tensors for :func:`.kernels.decoder_layers` when every decoder product runs on the
        #: extension's kernels (so the whole layer loop can run in C++), else None.
        self.native_layers = self._native_layer_tensors() if self.fused else None

    def _native_layer_tensors(self) -> tuple[list, list, list, list, list, list] | None:
        norms: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []
        scales: list[torch.Tensor | None] = []
        mins: list[torch.Tensor | None] = []
        biases: list[torch.Tensor | None] = []
        parts: list[int] = []
        into_lists: tuple[list, ...] = (weights, scales, mins, biases)
        for layer in self.layers:
            norms += [layer.attn_norm, layer.mlp_norm]
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                products = kernel_parts(linear)
                if products is None:
                    return None
                parts.append(len(products))
                for tensors in products:
                    for into, tensor in zip(into_lists, tensors, strict=True):
                        into.append(tensor)
        return norms, weights, scales, mins, biases, parts

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in float32, result in the model dtype; x: [T, heads, D], cos/sin: [T, 1, D].

        ``x * cos + rotate_half(x) * sin`` where ``rotate_half(x) = [-x2, x1]``: rolling by half
        gives ``[x2, x1]`` and ``sin`` carries the minus sign of the first half.
        """
        xf = x.float()
        return torch.addcmul(xf * cos, xf.roll(xf.shape[-1] // 2, -1), sin).to(self.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run the flat batch, write its K/V into ``cache``, return float32 logits [R, vocab]."""
        return self._logits(self._final_hidden(batch, cache))

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run the flat batch, write its K/V into ``cache``, return the final norm's float32 [R, hidden] of its
        ``logit_rows``: what :meth:`forward` puts through the head (an embedding pools these)."""
        return self._final_hidden(batch, cache)

    @torch.inference_mode()
    def label_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """The score head over rows of :meth:`final_hidden`: float32 [R, labels] (a reranker's raw scores)."""
        assert self.score_head is not None, "the model has a score head"
        scores = hidden.float().cpu() @ self.score_head.T
        return scores if self.score_bias is None else scores + self.score_bias

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over rows of :meth:`final_hidden`: float32 [R, vocab], as :meth:`forward` gives them."""
        return self._logits(hidden)

    @torch.inference_mode()
    def greedy(self, batch: ForwardBatch, cache: KVCache) -> list[int]:
        """:meth:`forward`, then the argmax of each row (the first maximum): the same tokens (see :meth:`pick`)."""
        return self.pick(batch, cache)

    def _rows_of(self, name: str, w: LazyWeights, quantization: str) -> torch.Tensor | FileRows:
        """The embedding (or head) matrix the lookups and the exact re-scoring index: in int4 on CPU, a matrix the
        file stores in its own blocks is read a few rows at a time (:class:`.FileRows`, no copy); else it is read
        whole in the model's dtype."""
        rows = w.rows(name) if quantization == "int4" and self.device.type == "cpu" else None
        if rows is not None:
            return FileRows(*rows, self.dtype)
        return w.read_as(name, self.dtype).to(self.device)

    def _head_rows(self, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the re-scoring kernels read for ``candidates`` [R, k]: the whole head where it is in memory, else
        the table of rows read from the file and the candidates' places in it (-1, a row of NaN's missing
        candidate, reads row 0, never used)."""
        if isinstance(self.lm_head, torch.Tensor):
            return self.lm_head, None
        return self.lm_head.table_rows(candidates.clamp(min=0))

    @torch.inference_mode()
    def pick(
        self, batch: ForwardBatch, cache: KVCache, race: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> list[int]:
        """:meth:`forward`, then each row's token: its argmax (the first maximum), or for a row whose ``race``
        (inverse temperature float32 [R], 0 for an argmax row; seeds int64 [R]) says so, its draw
        (:func:`.kernels.race_rows` over its logits): the same tokens either way.

        Where the head is one of the extension's products, its kernel keeps each row's top candidates (and race
        entries) as its tiles produce them (``quant_linear_race``, ``bf16_linear_race``), and the pick is taken
        over those once re-scored (:func:`.kernels.refined_race`): the [R, vocab] float32 logits are never
        written nor read back (64 rows: 12.6 MB written, then read by the re-scoring's top-k pass and again by
        the argmax or the sampler)."""
        h = self._final_hidden(batch, cache)
        rows, k = h.shape[0], REFINED_LOGITS + 1  # the re-scored candidates and the best of the rest
        inverse, seeds = race if race is not None else (torch.zeros(rows), torch.zeros(rows, dtype=torch.long))
        # The cap is monotonic: an argmax keeps it, a draw does not.
        capped = self.config.final_softcap is not None and bool((inverse > 0).any())
        if self.dtype != torch.float32 and k < self.config.vocab_size and not capped:
            found = self.logits.race(h.to(self.dtype), k, inverse, seeds)
            if found is not None:
                weight, weight_rows = self._head_rows(found[1][:, :REFINED_LOGITS])
                picked = kernels.refined_race(found, h, weight, inverse, seeds, weight_rows).tolist()
                if all(token >= 0 for token in picked):  # else a row of NaN: the logits below decide
                    return picked
        logits = self._logits(h)
        picks = argmax_rows(logits)
        drawn = (inverse > 0).nonzero()[:, 0]
        if len(drawn):  # the race runs on the CPU kernels, whatever the model's device
            kernels.load()
            raced = kernels.race_rows(logits[drawn.to(logits.device)].cpu(), inverse[drawn], seeds[drawn]).tolist()
            for row, token in zip(drawn.tolist(), raced, strict=True):
                picks[row] = token if token >= 0 else picks[row]
        return picks

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over the final hidden states: float32 [R, vocab], the top candidates re-scored exactly."""
        logits = self.logits(h.to(self.dtype), wide=True).float()  # float32 straight from the CPU kernels
        if self.dtype != torch.float32:
            self._refine_top(logits, h)
        if (cap := self.config.final_softcap) is not None:  # monotonic: greedy picks are the same either way
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _final_hidden(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """The decoder layers over the batch (K/V written into ``cache``), then the final norm of the rows whose
        logits are asked for: float32 [R, hidden]."""
        tokens, positions, new = batch.tokens, batch.positions, batch.num_tokens
        if new < self.min_rows:  # pad the batch once rather than every linear layer (see .linear); the
            pad = torch.zeros(self.min_rows - new, dtype=torch.long)  # padding rows write no K/V, join no span
            tokens, positions = torch.cat([tokens, pad]), torch.cat([positions, pad])
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        write_slots = batch.write_slots.to(self.device)
        self.rope.ensure(int(positions.max()) + 1)
        h = self.embed[tokens]
        if self.config.embedding_multiplier is not None:  # rounded to the model's dtype, as transformers does
            h = h * torch.tensor(self.config.embedding_multiplier, dtype=self.dtype)
        h = h.float()  # the residual stream stays float32 (see the module docstring)
        if self.native_layers or self.fused:
            plan = _KernelPlan.build(batch, cache.page_size, tokens.numel())
            batch.layers_start()
            if self.native_layers:
                attention = (plan.pages, plan.row_span, plan.row_keys, cache.page_size, self.scale)
                kernels.decoder_layers(
                    h, positions, self.rope.cos, self.rope.sin, write_slots, cache.k, cache.v, attention,
                    self.config.num_heads, self.eps, self.dtype, self.native_layers,
                )  # fmt: skip
            else:
                self._layers_fused(h, positions, write_slots, cache, plan)
        else:
            layer_attention = self._attention_of(batch, cache, tokens.numel())
            batch.layers_start()
            h = self._layers_generic(h, positions, write_slots, cache, layer_attention)
        return F.rms_norm(h[batch.logit_rows.to(self.device)], (self.config.hidden_size,), self.norm, self.eps)

    def _layers_fused(self, h, positions, write_slots, cache: KVCache, plan: _KernelPlan) -> None:
        """The decoder layers with the C++ kernels (CPU): 8 ops per layer; ``h`` is updated in place.

        :func:`.kernels.decoder_layers` is this loop in C++, used when every product is one of the
        extension's kernels; this one also takes oneDNN's (float32) products."""
        H, eps, dtype = self.config.num_heads, self.eps, self.dtype
        cos, sin = self.rope.cos, self.rope.sin
        delta = None  # the previous layer's MLP output, added to h by the next norm
        for index, layer in enumerate(self.layers):
            x = kernels.add_rms_norm(h, delta, layer.attn_norm, eps, dtype)
            k_cache, v_cache = cache.k[index], cache.v[index]
            q = kernels.rope_store(layer.qkv(x), positions, cos, sin, write_slots, k_cache, v_cache, H)
            attention = kernels.paged_attention(
                q, k_cache, v_cache, plan.pages, plan.row_span, plan.row_keys, cache.page_size, self.scale
            )
            x = kernels.add_rms_norm(h, layer.o(attention, wide=True), layer.mlp_norm, eps, dtype)
            delta = layer.down(layer.gate_up(x), wide=True)  # added to h unrounded
        h.add_(delta)

    def _attention_of(self, batch: ForwardBatch, cache: KVCache, rows: int) -> Attention:
        """The generic loop's attention for this batch: ``attend(q, k_cache, v_cache, window)`` -> [T, H * D].
        On :func:`.kernels.paged_attention` where it takes the model (a row's bits then do not depend on the
        rows beside it, as ``scaled_dot_product_attention``'s can on CPU), else ``scaled_dot_product_attention``."""
        if self.kernel_attention:
            plan = _KernelPlan.build(batch, cache.page_size, rows)
            tables = (plan.pages, plan.row_span, plan.row_keys, cache.page_size, self.scale)
            cap = self.config.attn_softcap
            return lambda q, k, v, window: kernels.paged_attention(q, k, v, *tables, window, cap)
        windows = {self.config.layer_window(i) for i in range(self.config.num_layers)}
        plans = {
            window: _AttentionPlan.build(batch, cache.page_size, self.min_query_rows, self.dtype, self.device, window)
            for window in windows
        }
        return lambda q, k, v, window: self._attention(q, k, v, cache.page_size, plans[window])

    def _layers_generic(self, h, positions, write_slots, cache: KVCache, attend: Attention) -> torch.Tensor:
        """The decoder layers in PyTorch ops and ``attend`` (any device, any layer shape: q/k norms, Gemma's extra
        norms, sliding-window layers)."""
        cfg, dtype, eps = self.config, self.dtype, self.eps
        H, KVH, D, W = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        T, new = h.shape[0], write_slots.numel()
        tables = self.rope
        rope = (tables.cos[positions].unsqueeze(1), tables.sin[positions].unsqueeze(1))
        local_rope = rope  # the sliding-window layers' own, where their RoPE base differs
        if tables.has_local:
            local_rope = (tables.local_cos[positions].unsqueeze(1), tables.local_sin[positions].unsqueeze(1))
        for index, layer in enumerate(self.layers):
            window = cfg.layer_window(index)
            x = F.rms_norm(h, (W,), layer.attn_norm, eps).to(dtype)
            qkv = layer.qkv(x)
            qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = F.rms_norm(qk[:, :H].float(), (D,), layer.q_norm, eps)
                qk = torch.cat([q, F.rms_norm(qk[:, H:].float(), (D,), layer.k_norm, eps)], 1).to(dtype)
            qk = self._rope(qk, *(local_rope if window else rope))
            k_cache, v_cache = cache.k[index], cache.v[index]
            k_cache.index_copy_(0, write_slots, qk[:new, H:])
            v_cache.index_copy_(0, write_slots, qkv[:new, (H + KVH) * D :].view(new, KVH, D))
            attended = layer.o(attend(qk[:, :H], k_cache, v_cache, window))
            h = h + _norm_if(attended, layer.post_attn_norm, eps)
            x = F.rms_norm(h, (W,), layer.mlp_norm, eps).to(dtype)
            h = h + _norm_if(layer.down(layer.gate_up(x)), layer.post_mlp_norm, eps)
        return h

    def _refine_top(self, logits: torch.Tensor, h: torch.Tensor) -> None:
        """Recompute the leading candidates' logits exactly, in place.

        Logits from bf16 (or int8) inputs are coarse, so the top tokens often
        nearly tie and greedy decoding would pick by rounding noise.  The dot
        products of the top :data:`REFINED_LOGITS` with the float32 hidden state
        (accumulated in float64 on CPU, in float32 elsewhere) break those ties as
        the float32 model would; the work is per row, so batch invariant.
        """
        k = min(REFINED_LOGITS, logits.shape[-1])
        if logits.device.type == "cpu":  # one kernel: top-k (5x torch.topk over a vocabulary), float64 dots
            if isinstance(self.lm_head, torch.Tensor):
                kernels.refine_top_logits(logits, h, self.lm_head, k)
            else:  # the candidates' rows, read from the file
                table, places = self._head_rows(kernels.top_k_rows(logits, k)[1])
                kernels.refine_top_logits(logits, h, table, k, places)
            return
        top = logits.topk(k, dim=-1).indices  # [R, k]
        logits.scatter_(1, top, (h.unsqueeze(1) * self.lm_head[top].float()).sum(-1))

    def _attention(self, q: torch.Tensor, k_cache, v_cache, page_size: int, plan: _AttentionPlan) -> torch.Tensor:
        """q: [T, H, D] -> [T, H*D], each row attending to its own sequence only (the generic path).

        ``k_cache``/``v_cache``: one layer, ``[slots, KVH, D]``.  A decode group of B
        sequences is one attention call with batch ``(B, KVH)`` and the G query heads
        of each kv head as its rows; a prefill chunk is one call over its own keys.
        """
        T, H, D = q.shape
        KVH = self.config.num_kv_heads
        G = H // KVH
        out = torch.zeros(T, H * D, dtype=q.dtype, device=q.device)  # rows of no span (padding) stay zero
        k_pages, v_pages = k_cache.view(-1, page_size * KVH * D), v_cache.view(-1, page_size * KVH * D)
        for rows, pages, mask in plan.decode_groups:
            B = mask.shape[0]
            kk = k_pages.index_select(0, pages).view(B, -1, KVH, D).transpose(1, 2)  # [B, KVH, L, D]
            vv = v_pages.index_select(0, pages).view(B, -1, KVH, D).transpose(1, 2)
            qq = self._pad_rows(q[rows].view(B, KVH, G, D))  # [B, KVH, >=G, D]
            o = self._sdpa(qq, kk, vv, mask)
            out[rows] = o[:, :, :G].reshape(B, H * D)
        for start, length, pages, mask in plan.prefills:
            kk = k_pages.index_select(0, pages).view(1, -1, KVH, D).transpose(1, 2)  # [1, KVH, L, D]
            vv = v_pages.index_select(0, pages).view(1, -1, KVH, D).transpose(1, 2)
            qq = self._pad_rows(q[start : start + length].transpose(0, 1).unsqueeze(0))  # [1, H, >=Q, D]
            o = self._sdpa(qq, kk, vv, mask)
            out[start : start + length] = o[0, :, :length].transpose(0, 1).reshape(length, H * D)
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, H, Q, D] over k, v [B, KVH, L, D] (H a multiple of KVH) with an additive ``mask``;
        with ``attn_softcap`` (Gemma 2), the scores are capped before the mask, as transformers does."""
        cap = self.config.attn_softcap
        if cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.tanh(q.float() @ k.float().transpose(-1, -2) * self.scale / cap) * cap + mask
        return (scores.softmax(-1) @ v.float()).to(q.dtype)

    def _pad_rows(self, q: torch.Tensor) -> torch.Tensor:
        """Pad the query rows (dim -2) with zeros up to :attr:`min_query_rows` (float32 only)."""
        rows = q.shape[-2]
        if rows >= self.min_query_rows:
            return q
        pad = q.new_zeros(*q.shape[:-2], self.min_query_rows - rows, q.shape[-1])
        return torch.cat([q, pad], dim=-2)
