"""Servers to compare, each started the same way: a command line, a port, a readiness URL.

The peers are installed by ``scripts/peers/*.sh`` into the cache directory;
a peer that is not installed is skipped (and said so in BENCHMARKS.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class PeerServer:
    name: str
    command: list[str]
    port: int
    api: str = "openai"
    model: str | None = None
    ready_path: str = "/health"
    fresh_connections: bool = False
    env: dict[str, str] = field(default_factory=dict)
    version: str = ""
    _proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path, timeout: float = 600) -> None:
        log = open(log_dir / f"{self.name.replace(' ', '_')}.log", "w")  # noqa: SIM115 - owned by the process
        self._proc = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode}; see {log.name}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout}s")

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()


def fiberserve_server(port: int, model: str | None, extra: list[str], label: str = "fiberserve") -> PeerServer:
    from importlib.metadata import version  # the installed torch's version, without importing it here

    from fiberserve import __version__

    command = [sys.executable, "-m", "fiberserve.server", "--port", str(port), "--no-progress", *extra]
    if model:
        command += ["--model", model]
    return PeerServer(label, command, port, version=f"fiberserve {__version__}, torch {version('torch')}")


def llama_server(port: int, gguf: str, peers_dir: Path, slots: int) -> PeerServer | None:
    binary = next(iter(sorted(peers_dir.glob("llama.cpp-*/build/bin/llama-server"))), None)
    if binary is None:
        return None
    version = binary.parents[2].name
    return PeerServer(
        "llama-server",
        [
            str(binary),
            "-m",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(os.cpu_count() or 2),
            "-np",
            str(slots),
            "-c",
            str(slots * 256),
        ],
        port,
        fresh_connections=True,
        version=version,
    )


def vllm_server(port: int, hf_dir: str, peers_dir: Path, max_seqs: int) -> PeerServer | None:
    python = peers_dir / "vllm-venv" / "bin" / "python"
    if not python.exists():
        return None
    version = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    return PeerServer(
        "vLLM",
        [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            hf_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-num-seqs",
            str(max_seqs),
            "--served-model-name",
            "smollm2",
        ],
        port,
        model="smollm2",
        version=f"vllm {version}",
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"},
    )


def write_hf_directory(gguf: str, target: Path) -> Path:
    """The GGUF model dequantized into a Hugging Face directory (what vLLM serves), written by our own loader
    (transformers refuses to save a model it loaded from GGUF)."""
    if (target / "config.json").exists():
        return target
    import json

    import torch
    from safetensors.torch import save_file

    from fiberserve.model.loader import load_checkpoint
    from fiberserve.model.tokenizer import load_tokenizer

    ck = load_checkpoint(gguf)
    c = ck.config
    target.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM" if c.architecture == "llama" else "Qwen2ForCausalLM"],
        "model_type": c.architecture,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if c.eos_token_ids else None,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    weights = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in ck.weights.items()
        if not (c.tie_word_embeddings and k == "lm_head.weight")
    }
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(gguf, None).hf.save_pretrained(str(target))
    return target
