"""Load a large synthetic GGUF model and report the memory it takes: peak RSS against the file and the serving weights.

    python scripts/memory_check.py --params 1.1 --format Q4_0   # a TinyLlama-1.1B-shaped model

The file is written with random blocks (no float weights are ever made), then loaded in a child process the way
the server loads a model (``LlamaModel`` in int4, the file's own blocks where the format is served as is), which
prints one JSON line: file and serving bytes, RSS before the load and at its peak, and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

#: The formats written here: inputs and bytes per block, and where its float16 scales sit (the rest is random).
BLOCKS = {"Q4_0": (32, 18, (0,)), "Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,))}


def llama_shape(billions: float) -> dict[str, int]:
    """A Llama-family shape of about ``billions`` parameters (TinyLlama's at 1.1: hidden 2048, 22 layers)."""
    hidden, intermediate, vocab = 2048, 5632, 32000
    per_layer = hidden * hidden * 2 + hidden * 256 * 2 + hidden * intermediate * 3  # q, o, k, v (4 kv heads), mlp
    layers = max(1, round((billions * 1e9 - 2 * vocab * hidden) / per_layer))
    return {"hidden": hidden, "intermediate": intermediate, "vocab": vocab, "layers": layers, "heads": 32, "kv": 4}


def write_model(path: Path, shape: dict[str, int], kind: str, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    writer = gguf.GGUFWriter(str(path), "llama")
    hidden, heads = shape["hidden"], shape["heads"]
    writer.add_block_count(shape["layers"])
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(shape["kv"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape["vocab"])

    inputs, size, scale_offsets = BLOCKS[kind]

    def blocks(rows: int, cols: int) -> np.ndarray:
        raw = rng.integers(0, 256, (rows, cols // inputs, size), dtype=np.uint8)
        for offset in scale_offsets:
            scales = (rng.random((rows, cols // inputs)) * 0.002).astype(np.float16)
            raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // inputs, 2)
        return raw.reshape(rows, -1)

    def norm(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    kv_rows = shape["kv"] * hidden // heads
    writer.add_tensor("token_embd.weight", blocks(shape["vocab"], hidden), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", norm(hidden))
    writer.add_tensor("output.weight", blocks(shape["vocab"], hidden), raw_dtype=qtype)
    for i in range(shape["layers"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm(hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm(hidden))
        for name, rows, cols in (
            ("attn_q", hidden, hidden),
            ("attn_k", kv_rows, hidden),
            ("attn_v", kv_rows, hidden),
            ("attn_output", hidden, hidden),
            ("ffn_gate", shape["intermediate"], hidden),
            ("ffn_up", shape["intermediate"], hidden),
            ("ffn_down", hidden, shape["intermediate"]),
        ):
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(rows, cols), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


MEASURE = """
import json, os, sys, time
import torch
from fiberserve import kernels
from fiberserve.model import load_checkpoint, LlamaModel
from fiberserve.runtime.allocator import return_freed_buffers
from fiberserve.runtime.memory_lock import tensor_storages
def status(key):  # this process's own figures (ru_maxrss would keep the parent's from before the exec)
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
kernels.load()
return_freed_buffers()  # as the server loads
before = status("VmRSS")
started = time.perf_counter()
model = LlamaModel(load_checkpoint(sys.argv[1]), torch.bfloat16, quantization="int4")
seconds = time.perf_counter() - started
peak = status("VmHWM")
storages = tensor_storages(model)
print(json.dumps({"file_bytes": os.path.getsize(sys.argv[1]), "serving_bytes": sum(storages.values()),
                  "rss_before": before, "rss_peak": peak, "load_seconds": round(seconds, 2)}))
"""


def measure(path: Path) -> dict[str, float]:
    """Load ``path`` in a child process; what it printed."""
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=1.1, help="billions of parameters (about)")
    parser.add_argument("--format", choices=sorted(BLOCKS), default="Q4_0")
    parser.add_argument("--dir", default=None, help="where to write the file (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "synthetic.gguf"
        shape = llama_shape(args.params)
        write_model(path, shape, args.format)
        result = measure(path)
    mib = 2**20
    print(json.dumps({**shape, "format": args.format, **result}))
    print(
        f"file {result['file_bytes'] / mib:.0f} MiB, serving weights {result['serving_bytes'] / mib:.0f} MiB, "
        f"peak RSS {result['rss_peak'] / mib:.0f} MiB ({(result['rss_peak'] - result['rss_before']) / mib:.0f} MiB "
        f"over the {result['rss_before'] / mib:.0f} MiB before loading), load {result['load_seconds']} s"
    )


if __name__ == "__main__":
    main()
