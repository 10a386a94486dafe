"""fiberserve on Ray Serve with autoscaling: one replica at rest, two under load, one again after (its own Ray)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.integration.server_utils import ServerProcess

pytestmark = pytest.mark.slow


def running(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["replicas"]["running"]


def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def test_replicas_follow_the_requests_in_progress(cache_dir, tmp_path):
    # the settings come from a config file, with the same keys as the flags
    config = tmp_path / "cluster.yaml"
    settings = {"replicas": 1, "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2}
    config.write_text(json.dumps({**settings, "autoscale_delay_s": 1, "threads_per_fiber": 1}))
    server = ServerProcess("--config", str(config), cache_dir=cache_dir, log_dir=tmp_path).wait_ready(timeout=300)
    try:
        assert httpx.get(server.url + "/health").json() == {
            "status": "ok",
            "replicas": {"running": 1, "min": 1, "max": 2},
        }
        stop = threading.Event()

        def load() -> None:
            params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
            while not stop.is_set():
                httpx.post(server.url + "/generate", json={"text": "Go on:", "sampling_params": params}, timeout=300)

        workers = [threading.Thread(target=load) for _ in range(12)]
        for worker in workers:
            worker.start()
        until(lambda: running(server.url) == 2, 180, "no second replica under load")
        stop.set()
        for worker in workers:
            worker.join()
        until(lambda: running(server.url) == 1, 180, "the second replica stayed without load")
    finally:
        assert server.stop(signal.SIGTERM, timeout=120) == 0
