"""A real fiberserve server process on 127.0.0.1 for the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self, *flags: str, cache_dir: str, log_dir: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        command = [
            sys.executable,
            "-m",
            "fiberserve.server",
            "--port",
            str(self.port),
            "--cache-dir",
            cache_dir,
            "--no-progress",
            *flags,
        ]
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd
        )
        self.saw_503 = False

    def wait_ready(self, timeout: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return self
                if r.status_code == 503:
                    self.saw_503 = True
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not ready:\n{self.log_path.read_text()[-3000:]}")

    def wait_loading(self, timeout: float = 180) -> ServerProcess:
        """Until ``/health`` says 503: the server is up and its model still loading."""
        deadline = time.monotonic() + timeout
        while not self.saw_503 and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                self.saw_503 = httpx.get(self.url + "/health", timeout=2).status_code == 503
            time.sleep(0.01)
        assert self.saw_503, f"health never said 503:\n{self.log_path.read_text()[-3000:]}"
        return self

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 300), **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def server_info(self) -> dict:
        return httpx.get(self.url + "/get_server_info", timeout=10).json()

    def log_with(self, text: str, timeout: float = 30.0) -> str:
        """The server's log once ``text`` is in it (a request's line is written just after its answer)."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.log_path.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert text in log, f"{text!r} not in the server's log"
        return log

    def finished(self) -> dict[str, float]:
        """Sequences finished so far by reason, and tokens generated, from the server's /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        counts = {"tokens": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "fiberserve_sequences_finished_total":
                    counts[sample.labels["reason"]] = sample.value
                elif sample.name == "fiberserve_generation_tokens_total":
                    counts["tokens"] = sample.value
        return counts

    def assert_idle(self, timeout: float = 30.0) -> dict:
        """Every page free or cached, every fiber idle, nothing queued (waits up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info()
            pages, pool = info["kv_pages"], info["pool"]
            idle = pages["used"] == 0 and pool["busy"] == 0 and pool["waiters"] == 0
            if idle or time.monotonic() > deadline:
                assert idle, f"not idle: pages {pages}, pool {pool}"
                assert pages["free"] + pages["cached"] == pages["total"]
                return info
            time.sleep(0.05)
