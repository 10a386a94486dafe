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
* elsewhere (CUDA) the layer is PyTorch ops around ``scaled_dot_product_attention``
  over keys gathered from the pages (:mod:`.attention`).

A pass has three parts, each its own call: :meth:`LlamaModel.prepare` (the
host's work: the embedding lookup, the attention backend's tables),
:meth:`LlamaModel.run_layers` (the decoder layers and the final norm) and the
head (:class:`.OutputHead`: logits, or each row's pick).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from fiberserve import kernels
from fiberserve.model.attention import PagedKernelAttention, SdpaAttention
from fiberserve.model.batch import ForwardBatch, KVCache
from fiberserve.model.file_rows import FileRows
from fiberserve.model.head import OutputHead
from fiberserve.model.layer_weights import LayerWeights
from fiberserve.model.linear import (
    Linear,
    QuantLinear,
    kernel_parts,
    make_linear,
    quant_kernel_available,
)
from fiberserve.model.loader import Checkpoint, LazyWeights, LoadStopped
from fiberserve.model.lora import LoraRows
from fiberserve.model.rope_tables import RopeTables

#: No LoRA rows, as :func:`.kernels.decoder_layers` takes them.
NO_LORA: tuple[torch.Tensor | None, list[int], list[torch.Tensor], list[int]] = (None, [], [], [])
#: Decoder layers built at once when a model loads (threads: their unpacking and packing run without the GIL).
LAYERS_AT_ONCE = 2


@dataclass
class LayerInputs:
    """What the decoder layers take for one forward pass, built by :meth:`LlamaModel.prepare`: the step's host
    work (the embedding lookup, the attention backend's tables) is done; the layers that follow run in kernels."""

    h: torch.Tensor  #: float32 [T, hidden]: the residual stream, the batch's rows then padding rows
    positions: torch.Tensor  #: int64 [T]
    write_slots: torch.Tensor  #: int64 [new]: where each new token's K/V goes (padding rows write none)
    cache: KVCache
    attention: PagedKernelAttention | SdpaAttention
    logit_rows: torch.Tensor  #: int64 [R]: the rows whose final hidden states are returned
    lora: LoraRows  #: the rows each LoRA adapter runs


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


class LlamaModel:
    """Weights plus the forward pass; stateless between calls (the KV cache is passed in)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        quantization: str = "none",
        progress: bool = False,
        stop: threading.Event | None = None,
    ) -> None:
        """``quantization="int4"``: every matrix a GGUF file stores in a format served as is (``NATIVE_BITS``) in
        the file's own blocks; the others in Q4_1 blocks, the output head in Q8_0 (4-bit where the CPU has neither
        AVX512-VNNI nor AVX2); computed as llama.cpp does (see
        :class:`.QuantLinear`; CPU only); norms stay in ``dtype``, the embedding's and the head's rows are read in
        ``dtype`` from the file's blocks as lookups ask for them (:class:`.FileRows`; whole in ``dtype`` where the
        file stores them otherwise), and the top candidates the head picks are re-scored exactly from those
        ``dtype`` rows (:class:`.OutputHead`).  Once ``stop`` is set, no layer begins to load and the constructor
        raises :class:`.LoadStopped` when those under way end."""
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
        head_rows = self.embed if tied else self._rows_of("lm_head.weight", w, quantization)
        self.norm = w["model.norm.weight"].to(device=self.device, dtype=torch.float32)
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
            head_linear = pool.submit(head)  # beside the first layers

            def build(i: int) -> LayerWeights:
                if stop is not None and stop.is_set():
                    raise LoadStopped(f"stopped before layer {i} of {config.num_layers}")
                return LayerWeights(w, i, config, dtype, self.device, quantization, self.fused)

            built = pool.map(build, range(config.num_layers))
            self.layers = list(
                tqdm(built, total=config.num_layers, desc="loading layers", unit="layer", disable=not progress)
            )
            score = w["score.weight"].float() if "score.weight" in w else None
            score_bias = w["score.bias"].float() if "score.bias" in w else None
            self.head = OutputHead(
                head_linear.result(), head_rows, config.vocab_size, dtype, config.final_softcap, score, score_bias
            )
        linears = [self.head.linear] + [
            x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        self.min_rows = max(x.min_rows for x in linears)
        inv_freq = _rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, checkpoint.rope_freq_factors)
        local_inv_freq = None
        if config.rope_local_theta is not None:
            local_inv_freq = _rope_inv_freq(config.head_dim, config.rope_local_theta, None)
        self.rope = RopeTables(inv_freq, local_inv_freq, config.max_position_embeddings, self.device)
        self.scale = config.attention_scale or 1.0 / math.sqrt(config.head_dim)
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
        return self.head.logits(self.final_hidden(batch, cache))

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run the flat batch, write its K/V into ``cache``, return the final norm's float32 [R, hidden] of its
        ``logit_rows``: what :meth:`forward` puts through the head (an embedding pools these)."""
        return self.run_layers(self.prepare(batch, cache))

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over rows of :meth:`final_hidden`: float32 [R, vocab], as :meth:`forward` gives them."""
        return self.head.logits(hidden)

    @torch.inference_mode()
    def label_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """The score head over rows of :meth:`final_hidden`: float32 [R, labels] (a reranker's raw scores)."""
        return self.head.label_scores(hidden)

    @property
    def score_head(self) -> torch.Tensor | None:
        """A reranker's score head [labels, hidden], float32 (None: the file has none)."""
        return self.head.score_head

    @torch.inference_mode()
    def pick(
        self, batch: ForwardBatch, cache: KVCache, race: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> list[int]:
        """:meth:`forward`, then each row's token (:meth:`.OutputHead.pick`: an argmax, or a draw where ``race``
        says so), without writing the logits where the head's kernel can."""
        return self.head.pick(self.final_hidden(batch, cache), race)

    def _rows_of(self, name: str, w: LazyWeights, quantization: str) -> torch.Tensor | FileRows:
        """The embedding (or head) matrix the lookups and the exact re-scoring index: in int4 on CPU, a matrix the
        file stores in its own blocks is read a few rows at a time (:class:`.FileRows`, no copy); else it is read
        whole in the model's dtype."""
        rows = w.rows(name) if quantization == "int4" and self.device.type == "cpu" else None
        if rows is not None:
            return FileRows(*rows, self.dtype)
        return w.read_as(name, self.dtype).to(self.device)

    @torch.inference_mode()
    def prepare(self, batch: ForwardBatch, cache: KVCache) -> LayerInputs:
        """The pass's inputs: the batch padded to the products' least row count (padding rows write no K/V and
        join no span), its embedding rows, and the attention backend's tables for its spans."""
        tokens, positions, new = batch.tokens, batch.positions, batch.num_tokens
        if new < self.min_rows:  # pad the batch once rather than every linear layer (see .linear)
            pad = torch.zeros(self.min_rows - new, dtype=torch.long)
            tokens, positions = torch.cat([tokens, pad]), torch.cat([positions, pad])
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        self.rope.ensure(int(positions.max()) + 1)
        h = self.embed[tokens]
        if self.config.embedding_multiplier is not None:  # rounded to the model's dtype, as transformers does
            h = h * torch.tensor(self.config.embedding_multiplier, dtype=self.dtype)
        h = h.float()  # the residual stream stays float32 (see the module docstring)
        attention: PagedKernelAttention | SdpaAttention
        if self.kernel_attention:
            attention = PagedKernelAttention.build(
                batch, cache.page_size, tokens.numel(), self.scale, self.config.attn_softcap
            )
        else:
            windows = {self.config.layer_window(i) for i in range(self.config.num_layers)}
            attention = SdpaAttention(
                batch, cache.page_size, windows, self.scale, self.dtype, self.device, self.config.attn_softcap
            )
        write_slots, logit_rows = batch.write_slots.to(self.device), batch.logit_rows.to(self.device)
        return LayerInputs(h, positions, write_slots, cache, attention, logit_rows, batch.lora)

    @torch.inference_mode()
    def run_layers(self, inputs: LayerInputs) -> torch.Tensor:
        """The decoder layers over :meth:`prepare`'s inputs (K/V written into its cache), then the final norm of
        the rows whose logits are asked for: float32 [R, hidden].  LoRA adapters' products are added to their rows
        (by :func:`.kernels.lora_add`, in the C++ loop where it takes them all)."""
        h, attention = inputs.h, inputs.attention
        lora = inputs.lora.kernel_args() if inputs.lora else NO_LORA
        if self.native_layers is not None and isinstance(attention, PagedKernelAttention) and lora is not None:
            cache = inputs.cache
            kernels.decoder_layers(
                h, inputs.positions, self.rope.cos, self.rope.sin, inputs.write_slots, cache.k, cache.v,
                attention.tables, self.config.num_heads, self.eps, self.dtype, self.native_layers, lora,
            )  # fmt: skip
        elif self.fused and isinstance(attention, PagedKernelAttention):
            self._layers_fused(inputs, attention)
        else:
            h = self._layers_generic(inputs)
        return F.rms_norm(h[inputs.logit_rows], (self.config.hidden_size,), self.norm, self.eps)

    def _layers_fused(self, inputs: LayerInputs, attention: PagedKernelAttention) -> None:
        """The decoder layers with the C++ kernels (CPU): 8 ops per layer; ``h`` is updated in place.

        :func:`.kernels.decoder_layers` is this loop in C++, used when every product is one of the
        extension's kernels; this one also takes oneDNN's (float32) products."""
        H, eps, dtype, lora = self.config.num_heads, self.eps, self.dtype, inputs.lora
        h, positions, write_slots, cache = inputs.h, inputs.positions, inputs.write_slots, inputs.cache
        cos, sin = self.rope.cos, self.rope.sin
        delta: torch.Tensor | None = None  # the previous layer's MLP output, added to h by the next norm
        for index, layer in enumerate(self.layers):
            x = kernels.add_rms_norm(h, delta, layer.attn_norm, eps, dtype)
            k_cache, v_cache = cache.k[index], cache.v[index]
            qkv = lora.add(index, "qkv", x, layer.qkv(x))
            q = kernels.rope_store(qkv, positions, cos, sin, write_slots, k_cache, v_cache, H)
            attended = attention(q, k_cache, v_cache)
            x = kernels.add_rms_norm(
                h, lora.add(index, "o", attended, layer.o(attended, wide=True)), layer.mlp_norm, eps, dtype
            )
            gated = lora.gate_up(index, layer.gate_up, x, layer.gate_up(x))
            delta = lora.add(index, "down", gated, layer.down(gated, wide=True))  # added to h unrounded
        assert delta is not None, "a model has layers"
        h.add_(delta)

    def _layers_generic(self, inputs: LayerInputs) -> torch.Tensor:
        """The decoder layers in PyTorch ops and the attention backend (any device, any layer shape: q/k norms,
        Gemma's extra norms, sliding-window layers)."""
        cfg, dtype, eps, lora = self.config, self.dtype, self.eps, inputs.lora
        h, positions, write_slots, cache = inputs.h, inputs.positions, inputs.write_slots, inputs.cache
        attend = inputs.attention
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
            qkv = lora.add(index, "qkv", x, layer.qkv(x))
            qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = F.rms_norm(qk[:, :H].float(), (D,), layer.q_norm, eps)
                qk = torch.cat([q, F.rms_norm(qk[:, H:].float(), (D,), layer.k_norm, eps)], 1).to(dtype)
            qk = self._rope(qk, *(local_rope if window else rope))
            cache.store(index, write_slots, qk[:new, H:], qkv[:new, (H + KVH) * D :].view(new, KVH, D))
            attended = attend(qk[:, :H], cache.k[index], cache.v[index], window)
            h = h + _norm_if(lora.add(index, "o", attended, layer.o(attended)), layer.post_attn_norm, eps)
            x = F.rms_norm(h, (W,), layer.mlp_norm, eps).to(dtype)
            gated = lora.gate_up(index, layer.gate_up, x, layer.gate_up(x))
            h = h + _norm_if(lora.add(index, "down", gated, layer.down(gated)), layer.post_mlp_norm, eps)
        return h
