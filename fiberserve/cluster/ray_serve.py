"""fiberserve replicas on Ray Serve: each replica is the whole single-process server (its own engine, fiber pool and
KV cache) behind Ray Serve's HTTP proxy, with its CPU threads reserved through Ray's resources.

``run_cluster`` starts a local Ray instance (or joins ``ray_address``), deploys ``replicas`` copies of
:class:`FiberserveReplica`, and serves until SIGINT/SIGTERM, which drains in-flight requests (Serve's graceful
shutdown, ``shutdown_timeout`` seconds) before the application is deleted.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from typing import Any

from fiberserve.config import ServerConfig

log = logging.getLogger("fiberserve.cluster")

#: The Serve application's name (``serve status``, ``serve.delete``).
APP_NAME = "fiberserve"


def replica_threads(config: ServerConfig) -> int:
    """CPU threads each replica runs (and reserves from Ray): ``--threads-per-fiber`` times its fibers, or the
    machine's cores shared out between the replicas."""
    engine = config.engine
    if engine.threads_per_fiber:
        return engine.threads_per_fiber * engine.fibers
    return max(1, (os.cpu_count() or 1) // max(1, config.replicas))


class FiberserveReplica:
    """One replica: loads the model as it starts (Serve counts it ready once this constructor returns), then serves
    the same FastAPI app a single server does, on Serve's event loop."""

    def __init__(self, config: ServerConfig) -> None:
        from fiberserve.engine import LlmService

        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = config
        self.service = LlmService.load(config.engine)

    def __serve_build_asgi_app__(self) -> Any:
        from fiberserve.server.app import create_app

        return create_app(self.config, service=self.service)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine broke an invariant is replaced."""
        if self.service.broken is not None:
            raise RuntimeError(f"the engine is broken: {self.service.broken}")


def build_application(config: ServerConfig) -> Any:
    """The Serve application of ``config.replicas`` replicas (not yet running)."""
    from ray import serve

    threads = replica_threads(config)
    engine = dataclasses.replace(
        config.engine, threads_per_fiber=config.engine.threads_per_fiber or max(1, threads // config.engine.fibers)
    )
    replica_config = dataclasses.replace(config, engine=engine)
    deployment = serve.deployment(
        name="FiberserveReplica",
        num_replicas=config.replicas,
        ray_actor_options={"num_cpus": threads},
        # The engine batches and queues itself (up to max_running + max_queue sequences): Serve must not cap the
        # requests a replica holds far below that.
        max_ongoing_requests=engine.max_running + engine.max_queue,
        graceful_shutdown_timeout_s=config.shutdown_timeout,
        health_check_period_s=5,
    )(serve.ingress()(FiberserveReplica))
    return deployment.bind(replica_config)


def run_cluster(config: ServerConfig) -> int:
    """Serve ``config`` on Ray Serve until SIGINT/SIGTERM; returns 0 (1 if the application failed to deploy)."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise SystemExit(f"--replicas needs Ray Serve: pip install 'fiberserve[ray]' ({exc})") from None
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.ray_address:
        ray.init(address=config.ray_address, logging_level=logging.WARNING)
    else:  # a local instance of our own
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port}, detached=False)
        serve.run(build_application(config), name=APP_NAME, route_prefix="/", blocking=False)
        log.info("ready: %d replicas on http://%s:%d", config.replicas, config.host, config.port)
        stop.wait()
        log.info("draining in-flight requests (up to %s s), then stopping", config.shutdown_timeout)
        # In a thread with a deadline: a Ctrl-C reaches the local Ray's own processes too, and deleting the
        # application would then wait for a cluster that is gone.
        deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
        deleting.start()
        deleting.join(config.shutdown_timeout + 10)
        return 0
    except Exception as exc:  # a deployment that never became healthy, a Ray that did not start
        log.error("the Ray Serve application failed: %s", exc)
        return 1
    finally:
        serve.shutdown()
        ray.shutdown()
