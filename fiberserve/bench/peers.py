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
    import torch

    from fiberserve import __version__

    command = [sys.executable, "-m", "fiberserve.server", "--port", str(port), "--no-progress", *extra]
    if model:
        command += ["--model", model]
    return PeerServer(label, command, port, version=f"fiberserve {__version__}, torch {torch.__version__}")


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
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "all"},
    )


def write_hf_directory(gguf: str, target: Path) -> Path:
    """The GGUF model dequantized into a Hugging Face directory (what vLLM serves)."""
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target
