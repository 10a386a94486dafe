"""LoRA adapters: low-rank additions to a decoder's products, chosen per request.

An adapter adds ``scale * (x @ A.T) @ B.T`` to a product's output for the rows of the sequences that run under
it; the base model's products run once over the whole batch, then each adapter's rows get their addition
(punica's batched LoRA: a grouped low-rank product per adapter over its rows), so one flight holds sequences of
several adapters and of the base model.  Rows in no adapter's group are not touched: they get the base model's
bits, alone or in any mixed batch.

Adapters come as PEFT directories (``adapter_config.json`` + ``adapter_model.safetensors``) or as llama.cpp's
GGUF adapters (``convert_lora_to_gguf.py``: ``blk.N.attn_q.weight.lora_a`` ...).  The products they add to are
the model's: ``qkv`` (q, k, v columns one after another), ``o``, ``gate_up`` (gate then up, before the
activation) and ``down``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fiberserve import kernels
from fiberserve.model.config import ModelConfig
from fiberserve.model.gguf_file import GgufFile
from fiberserve.model.loader import GGUF_ARCH_LAYER_NAMES, GGUF_LAYER_NAMES, dequantized, unpermute

#: The modules an adapter may target (PEFT's names); Phi-3's fused ones cover a whole product.
TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
)
#: The products of a decoder layer an adapter adds to, in the order the C++ layer loop runs them.
PRODUCTS = ("qkv", "o", "gate_up", "down")
#: The columns of one panel of B^T as :func:`.kernels.lora_add` reads it: its SIMD width (16 float32 lanes).
PANEL = 16
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
_ids = itertools.count(1)


class LoraError(ValueError):
    """An adapter that cannot be served here; the message names its file."""


@dataclass(frozen=True)
class Placement:
    """Where a target module's addition goes: its product, the columns of that product's output, its input width."""

    product: str
    start: int
    end: int
    in_features: int


def placements(config: ModelConfig) -> dict[str, Placement]:
    """Every target module's :class:`Placement` in a model of ``config``."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    width, ffn = config.hidden_size, config.intermediate_size
    return {
        "q_proj": Placement("qkv", 0, q, width),
        "k_proj": Placement("qkv", q, q + kv, width),
        "v_proj": Placement("qkv", q + kv, q + 2 * kv, width),
        "qkv_proj": Placement("qkv", 0, q + 2 * kv, width),
        "o_proj": Placement("o", 0, width, q),
        "gate_proj": Placement("gate_up", 0, ffn, width),
        "up_proj": Placement("gate_up", ffn, 2 * ffn, width),
        "gate_up_proj": Placement("gate_up", 0, 2 * ffn, width),
        "down_proj": Placement("down", 0, width, ffn),
    }


class LowRank:
    """One adapter's addition to one product of one layer: ``x @ a.T`` gives every part's rank coordinates
    (``a``: the parts' A matrices stacked), rounded to the adapter's dtype; a part adds ``coordinates[:, first:last]
    @ b.T`` (``b`` scaled) to the output columns ``start:end``.  ``bt`` holds each part's ``b.T`` from element
    ``offset``: in panels of 16 columns (:func:`in_panels`) where :func:`.kernels.lora_add` takes it, which runs it
    on a CPU (a row's bits depend on the row alone); else flattened whole, for PyTorch's products."""

    def __init__(self, parts: list[tuple[Placement, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
        self.a = torch.cat([part_a for _, part_a, _ in parts]).to(dtype).contiguous()
        self.dtype = dtype
        widths = [self.a.shape[1], *(place.end - place.start for place, _, _ in parts)]
        #: Whether :func:`.kernels.lora_add` takes it (on a CPU).
        self.kernel_fits = dtype in (torch.float32, torch.bfloat16) and all(w % PANEL == 0 for w in widths)
        self.layout: list[int] = []  #: (start, end, first, last, offset) per part
        blocks, first, offset = [], 0, 0
        for place, part_a, part_b in parts:
            rank = part_a.shape[0]
            bt = part_b.t().to(dtype)
            blocks.append(in_panels(bt) if self.kernel_fits else bt.flatten())
            self.layout += [place.start, place.end, first, first + rank, offset]
            first, offset = first + rank, offset + blocks[-1].numel()
        self.bt = torch.cat(blocks)

    def kernel_layout(self) -> tuple[list[int], list[torch.Tensor]] | None:
        """This addition as :func:`.kernels.decoder_layers` takes it: its count of parts, each part's (start, end,
        first, last, offset), and ``a`` and ``bt``; None where :func:`.kernels.lora_add` does not take it."""
        if not self.kernel_fits:
            return None
        return [len(self.layout) // 5, *self.layout], [self.a, self.bt]

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> None:
        """``out[rows]`` (the product's output for the input ``x``) plus this addition for ``x[rows]``, in place in
        ``out``'s dtype."""
        x = x.to(self.dtype)
        if out.device.type == "cpu" and self.kernel_fits:
            kernels.load()
            kernels.lora_add(out, x, [rows], [self.a], [self.bt], [len(self.layout) // 5, *self.layout])
            return
        coordinates = (x[rows].float() @ self.a.float().T).to(self.dtype).float()
        added = out[rows].float()
        for p in range(0, len(self.layout), 5):
            start, end, first, last, offset = self.layout[p : p + 5]
            bt = self.bt[offset : offset + (last - first) * (end - start)]
            bt = from_panels(bt, last - first) if self.kernel_fits else bt.view(last - first, end - start)
            added[:, start:end] += coordinates[:, first:last] @ bt.float()
        out[rows] = added.to(out.dtype)


def in_panels(bt: torch.Tensor) -> torch.Tensor:
    """``bt`` [rank, columns] (columns a multiple of :data:`PANEL`) as :func:`.kernels.lora_add` reads it,
    flattened: panel j holds columns ``PANEL * j`` onwards of every rank row, one row after another."""
    rank, columns = bt.shape
    return bt.reshape(rank, columns // PANEL, PANEL).transpose(0, 1).flatten()


def from_panels(flat: torch.Tensor, rank: int) -> torch.Tensor:
    """The [rank, columns] matrix that :func:`in_panels` laid out as ``flat``."""
    return flat.view(-1, rank, PANEL).transpose(0, 1).reshape(rank, -1)


class LoraAdapter:
    """A loaded adapter: its name (what requests ask for), where it came from, and each layer's additions by
    product.  ``uid`` is unique to this load: the prefix cache keys pages by it, so a name loaded again with
    other weights never reuses pages computed under the old ones."""

    def __init__(self, name: str, path: str, rank: int, layers: list[dict[str, LowRank]]) -> None:
        self.name = name
        self.path = path
        self.rank = rank
        self.layers = layers
        self.uid = next(_ids)
        self._kernel_layout = _flat_layout(layers)

    @property
    def kernel_layout(self) -> tuple[list[int], list[torch.Tensor]] | None:
        """Every layer's additions as :func:`.kernels.decoder_layers` takes them (per layer, the products qkv, o,
        gate_up, down: a count of parts, 0 for none), or None where :func:`.kernels.lora_add` does not take one."""
        return self._kernel_layout

    @classmethod
    def load(cls, name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype, max_rank: int) -> LoraAdapter:
        """Read a PEFT directory or a GGUF adapter for a model of ``config``; raise :class:`LoraError` naming the
        file for one that does not fit it (a target module it lacks, shapes of another model, a rank over
        ``max_rank``, a missing file)."""
        path = Path(path)
        if path.is_dir():
            modules, source = _read_peft(path)
        elif path.is_file():
            modules, source = _read_gguf(path, config), path
        else:
            raise LoraError(f"{path}: no such adapter (a PEFT directory or a GGUF file)")
        places = placements(config)
        rank = 0
        per_layer: list[dict[str, list[tuple[Placement, torch.Tensor, torch.Tensor]]]] = [
            {} for _ in range(config.num_layers)
        ]
        for (layer, module), (a, b, scale) in sorted(modules.items()):
            place = places.get(module)
            if place is None:
                known = ", ".join(TARGET_MODULES)
                raise LoraError(f"{source}: target module {module!r} is not one this server adapts ({known})")
            if not 0 <= layer < config.num_layers:
                raise LoraError(f"{source}: layer {layer} of {module}, but the model has {config.num_layers} layers")
            expected = ((a.shape[0], place.in_features), (place.end - place.start, a.shape[0]))
            if (tuple(a.shape), tuple(b.shape)) != expected:
                raise LoraError(
                    f"{source}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit this "
                    f"model (A [rank, {place.in_features}], B [{place.end - place.start}, rank]): an adapter of "
                    "another base model"
                )
            if a.shape[0] > max_rank:
                raise LoraError(f"{source}: rank {a.shape[0]} is over --max-lora-rank {max_rank}")
            rank = max(rank, a.shape[0])
            if scale != 0 and b.any():  # a zero addition is none: those rows keep the base model's bits
                per_layer[layer].setdefault(place.product, []).append((place, a, b * scale))
        if rank == 0:
            raise LoraError(f"{source}: the adapter holds no LoRA weights")
        layers = [{product: LowRank(parts, dtype) for product, parts in layer.items()} for layer in per_layer]
        return cls(name, str(path), rank, layers)


#: Each target's (A [rank, in], B [out, rank], scale), by (layer, module).
Modules = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


def _read_peft(path: Path) -> tuple[Modules, Path]:
    config_file = path / PEFT_CONFIG
    if not config_file.is_file():
        raise LoraError(f"{config_file}: missing (a PEFT adapter directory holds {PEFT_CONFIG})")
    try:
        settings = json.loads(config_file.read_text())
    except ValueError as error:
        raise LoraError(f"{config_file}: not JSON ({error})") from None
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{config_file}: peft_type {settings['peft_type']!r}; only LORA adapters are served")
    for key, why in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save (whole trained modules)"),
        ("alpha_pattern", "alpha_pattern"),
        ("layers_to_transform", "layers_to_transform"),
    ):
        if settings.get(key):
            raise LoraError(f"{config_file}: {why} is not served")
    if settings.get("bias", "none") != "none":
        raise LoraError(f"{config_file}: bias {settings['bias']!r} is not served (only bias 'none')")
    weights_file = next((path / name for name in PEFT_WEIGHTS if (path / name).is_file()), None)
    if weights_file is None:
        raise LoraError(f"{path}: no {' or '.join(PEFT_WEIGHTS)}")
    tensors = _read_tensors(weights_file)
    alpha = float(settings.get("lora_alpha", settings.get("r", 8)))
    rslora = bool(settings.get("use_rslora"))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.fullmatch(key)
        if match is None:
            raise LoraError(f"{weights_file}: unexpected tensor {key!r} (not a LoRA A or B of a decoder layer)")
        layer, module, half = match.groups()
        pairs.setdefault((int(layer), module), {})[half] = tensor.float()
    return _modules(pairs, lambda rank: alpha / (math.sqrt(rank) if rslora else rank), weights_file, "AB"), weights_file


def _read_tensors(weights_file: Path) -> dict[str, torch.Tensor]:
    try:
        if weights_file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(weights_file))
        return torch.load(weights_file, map_location="cpu", weights_only=True)
    except Exception as error:  # a file cut short or of another kind: its reader's own words
        raise LoraError(f"{weights_file}: cannot be read ({error})") from None


def _read_gguf(path: Path, config: ModelConfig) -> Modules:
    try:
        file = GgufFile(path)
    except Exception as error:  # the reader's own errors (bad magic, a file cut short) name no file
        raise LoraError(f"{path}: not a GGUF file this server can read ({error})") from None
    if file.fields.get("general.type") != "adapter" or file.fields.get("adapter.type") != "lora":
        raise LoraError(f"{path}: not a GGUF LoRA adapter (general.type 'adapter', adapter.type 'lora')")
    architecture = file.fields.get("general.architecture")
    layer_names = GGUF_LAYER_NAMES | GGUF_ARCH_LAYER_NAMES.get(str(architecture), {})
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in file.tensors:
        match = _GGUF_KEY.fullmatch(tensor.name)
        if match is None or match.group(2) not in layer_names:
            raise LoraError(f"{path}: unexpected tensor {tensor.name!r}")
        layer, part, half = match.groups()
        module = layer_names[part].rsplit(".", 1)[1]
        value = dequantized(tensor)
        if half == "b" and architecture == "llama" and module in ("q_proj", "k_proj"):  # rows as the base has them
            value = unpermute(value, config.num_heads if module == "q_proj" else config.num_kv_heads)
        pairs.setdefault((int(layer), module), {})[half] = value
    alpha = file.fields.get("adapter.lora.alpha")
    return _modules(pairs, lambda rank: 1.0 if not alpha else float(alpha) / rank, path, "ab")


def _modules(pairs: dict[tuple[int, str], dict[str, torch.Tensor]], scale_of, source: Path, halves: str) -> Modules:
    modules: Modules = {}
    for (layer, module), found in pairs.items():
        if set(found) != set(halves):
            raise LoraError(f"{source}: layer {layer} {module} has {'/'.join(sorted(found))} but not both of A and B")
        a, b = found[halves[0]], found[halves[1]]
        modules[layer, module] = (a, b, scale_of(a.shape[0]))
    return modules


def _flat_layout(layers: list[dict[str, LowRank]]) -> tuple[list[int], list[torch.Tensor]] | None:
    ints: list[int] = []
    tensors: list[torch.Tensor] = []
    for layer in layers:
        for product in PRODUCTS:
            low = layer.get(product)
            layout = None if low is None else low.kernel_layout()
            if low is not None and layout is None:
                return None
            ints += [0] if layout is None else layout[0]
            tensors += [] if layout is None else layout[1]
    return ints, tensors


@dataclass
class LoraRows:
    """The rows of a flat batch that run under each adapter; a row in no group runs the base model."""

    groups: list[tuple[LoraAdapter, torch.Tensor]] = field(default_factory=list)  #: (adapter, int64 row indices)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def kernel_args(self) -> tuple[torch.Tensor, list[int], list[torch.Tensor], list[int]] | None:
        """The groups as :func:`.kernels.decoder_layers` takes them (rows, their counts, tensors, layout), or
        None where :func:`.kernels.lora_add` does not take all of an adapter's additions."""
        layouts = [adapter.kernel_layout for adapter, _ in self.groups]
        if any(layout is None for layout in layouts):
            return None
        ints: list[int] = []
        tensors: list[torch.Tensor] = []
        for layout in layouts:  # whole lists joined: every step of every flight does this
            ints += layout[0]  # type: ignore[index]
            tensors += layout[1]  # type: ignore[index]
        every_row = torch.cat([rows for _, rows in self.groups])
        return every_row, [len(rows) for _, rows in self.groups], tensors, ints

    def add(self, layer: int, product: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (``product``'s output of layer ``layer`` for the input ``x``) with each group's rows plus its
        adapter's addition, in ``y``'s dtype, in place; other rows untouched."""
        for adapter, rows in self.groups:
            low = adapter.layers[layer].get(product)
            if low is not None:
                low.add_to(y, x, rows)
        return y

    def gate_up(self, layer: int, gate_up, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (a :class:`.GateUp`'s activated output for ``x``) with each group's rows recomputed from the gate
        and up products plus its adapter's additions, added before the activation (as the gated kernel's epilogue
        does in the C++ layer loop, bit for bit)."""
        for adapter, rows in self.groups:
            low = adapter.layers[layer].get("gate_up")
            if low is not None:
                xs = x[rows]
                pre = gate_up.pre_activation(xs)
                added = torch.zeros_like(pre)
                low.add_to(added, xs, torch.arange(len(rows)))
                pre = pre + added
                activated = kernels.silu_mul(pre) if gate_up.silu_kernel else gate_up.activate(pre)
                y[rows] = activated.to(y.dtype)
        return y
