"""fiberserve on Ray Serve: engine replicas behind one HTTP endpoint, routed by prompt prefix.

Two deployments make the application:

* :class:`EngineReplica` (``--replicas`` of them, or autoscaled): the whole single-process server (its own engine,
  fiber pool and KV cache), its CPU threads reserved as Ray CPUs. It answers forwarded HTTP requests by running
  them through the single server's FastAPI app in-process, streaming the ASGI messages back.
* :class:`Frontend` (the HTTP ingress): reads each request's body, takes its prompt, and forwards it to a replica
  through a handle whose router is :class:`.PrefixAffinityRouter`; streams the answer back. A replica that dies
  before answering is retried on another; one that dies mid-stream ends the stream with an error naming the cause.
  ``/health`` reports the replicas running against the target; ``/metrics`` is every replica's series, each
  labelled with its replica, as pushed to :class:`MetricsBoard`.

LoRA adapters loaded or unloaded while serving reach every replica: the frontend forwards ``/v1/load_lora_adapter``
(or unload) to one replica, which checks and applies it; once that replica accepts, the frontend records the change
in :class:`AdapterRegistry` and stamps every later request with the registry's version. A replica that sees a newer
version brings its adapters in line with the registry before it serves the request (a replica started later by the
autoscaler too), so a request naming a just-loaded adapter finds it on whichever replica it lands.

:func:`run_cluster` starts a local Ray instance (or joins ``ray_address``), deploys the application, and serves
until SIGINT/SIGTERM, which drains in-flight requests (Serve's graceful shutdown, ``shutdown_timeout`` seconds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

from fiberserve.config import ServerConfig
from fiberserve.startup import configure_logging

log = logging.getLogger("fiberserve.cluster")

#: The Serve application's name (``serve status``), and its deployments'.
APP_NAME, ENGINE, FRONTEND = "fiberserve", "EngineReplica", "Frontend"
#: Named Ray actors: each replica's latest metrics; the LoRA adapters every replica serves.
METRICS_BOARD, ADAPTER_REGISTRY = "fiberserve-metrics", "fiberserve-adapters"
#: The routes that change the adapters served, and whether each loads (True) or unloads.
ADAPTER_ROUTES = {
    "/v1/load_lora_adapter": True,
    "/load_lora_adapter": True,
    "/v1/unload_lora_adapter": False,
    "/unload_lora_adapter": False,
}
#: Seconds between two pushes of a replica's metrics, and after which a replica's last push no longer counts.
METRICS_PUSH_S, METRICS_STALE_S = 2.0, 7.0
#: The response header naming the replica that answered.
REPLICA_HEADER = b"x-fiberserve-replica"
#: Tries for a request whose replica died before it answered anything.
FORWARD_TRIES = 3


@dataclasses.dataclass
class ForwardedRequest:
    """An HTTP request as the frontend hands it to a replica; ``prompt`` is what the router matches prefixes on."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str
    adapters_version: int = 0  # the AdapterRegistry version the replica must have caught up with


def prompt_text(body: bytes) -> str:
    """The prompt a request's body carries, as text the router can match: ``/generate``'s text or input ids, the
    completions' prompt, a chat's messages; "" where there is none."""
    try:
        payload = json.loads(body) if body else {}
    except ValueError:
        return ""
    if not isinstance(payload, dict):
        return ""
    if isinstance(messages := payload.get("messages"), list):
        return "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages if isinstance(m, dict))
    for key in ("text", "prompt", "input_ids"):
        value = payload.get(key)
        if isinstance(value, list) and value and not isinstance(value[0], int):
            value = value[0]  # a batch: its first prompt
        if value is not None:
            return value if isinstance(value, str) else " ".join(map(str, value))
    return ""


def replica_threads(config: ServerConfig) -> int:
    """CPU threads each replica runs (and reserves from Ray): ``--threads-per-fiber`` times its fibers, or the
    machine's cores shared out between the replicas."""
    engine = config.engine
    if engine.threads_per_fiber:
        return engine.threads_per_fiber * engine.fibers
    return max(1, (os.cpu_count() or 1) // max(1, config.replicas, config.max_replicas or 0))


class MetricsBoard:
    """The latest Prometheus exposition of every live replica (a named actor: replicas push, the frontend reads).
    A replica that stopped pushing (it died, or was stopped) drops out after ``METRICS_STALE_S``."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def push(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def all(self) -> dict[str, str]:
        now = time.monotonic()
        self.texts = {r: (t, text) for r, (t, text) in self.texts.items() if now - t < METRICS_STALE_S}
        return {r: text for r, (_, text) in self.texts.items()}


class AdapterRegistry:
    """The LoRA adapters every replica serves, by name (a named actor: the frontend writes, replicas read).
    ``version`` counts the changes; version 0 is ``--lora-modules``, which every replica loads at start."""

    def __init__(self, lora_modules: tuple[str, ...]) -> None:
        from fiberserve.engine.adapters import lora_module

        self.version = 0
        self.table = {name: str(Path(path)) for name, path in map(lora_module, lora_modules)}  # as adapters keep it

    def snapshot(self) -> tuple[int, dict[str, str]]:
        return self.version, dict(self.table)

    def change(self, name: str, path: str | None) -> int:
        """Serve ``name`` from ``path`` (None: no longer serve it); returns the new version."""
        if path is None:
            self.table.pop(name, None)
        else:
            self.table[name] = str(Path(path))
        self.version += 1
        return self.version


class EngineReplica:
    """One engine: loads the model as it starts (Serve counts it ready once the constructor returns)."""

    async def __init__(self, config: ServerConfig) -> None:  # type: ignore[misc]  # Ray actors may construct async
        from ray import serve

        from fiberserve.engine import LlmService
        from fiberserve.server.app import create_app

        configure_logging(config.log_level)
        self.config = config
        self.service = await asyncio.to_thread(LlmService.load, config.engine)
        self.app = create_app(config, service=self.service)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.name = serve.get_replica_context().replica_id.unique_id
        self._pusher = asyncio.create_task(self._push_metrics())
        self.adapters_version = 0
        self._adapters_sync = asyncio.Lock()

    async def http(self, request: ForwardedRequest) -> AsyncIterator[dict]:
        """Run ``request`` through the app; yield its ASGI messages (the response's start, then its body)."""
        if request.adapters_version > self.adapters_version:
            await self._sync_adapters(request.adapters_version)
        messages: asyncio.Queue[dict] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()  # the caller went away (this generator was closed)
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query_string,
            "root_path": "",
            "headers": request.headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", self.config.port),
        }

        async def send(message: MutableMapping[str, Any]) -> None:
            await messages.put(dict(message))

        task = asyncio.create_task(self.app(scope, receive, send))
        try:
            while True:
                message = await messages.get()
                if message["type"] == "http.response.start":  # which replica answered, for clients and tests
                    message["headers"] = [*message.get("headers", []), (REPLICA_HEADER, self.name.encode())]
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    break
            await task
        finally:
            gone.set()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _sync_adapters(self, version: int) -> None:
        """Load and unload adapters until this replica serves what :class:`AdapterRegistry` lists. An adapter
        that cannot load here is logged (requests naming it get the usual 400); one still in use here is unloaded
        at a later sync, once its requests have ended."""
        import ray

        from fiberserve.engine.adapters import AdapterInUse
        from fiberserve.engine.sampling_params import InvalidParameter

        async with self._adapters_sync:
            if version <= self.adapters_version:
                return  # another request's sync got there first
            latest, table = await ray.get_actor(ADAPTER_REGISTRY, namespace="serve").snapshot.remote()
            loaded, complete = self.service.adapters.loaded, True
            for name, adapter in list(loaded.items()):
                if table.get(name) != adapter.path:
                    try:
                        self.service.unload_adapter(name)
                    except AdapterInUse:
                        complete = False
            for name, path in table.items():
                if name not in loaded:
                    try:
                        await self.service.load_adapter(name, path)
                    except InvalidParameter as exc:
                        log.error("replica %s could not load LoRA adapter %r: %s", self.name, name, exc)
            if complete:
                self.adapters_version = latest

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine broke an invariant is replaced."""
        if self.service.broken is not None:
            raise RuntimeError(f"the engine is broken: {self.service.broken}")

    async def _push_metrics(self) -> None:
        import ray
        from prometheus_client import generate_latest

        board = ray.get_actor(METRICS_BOARD, namespace="serve")
        state = self.app.state.fiberserve
        while True:
            text = generate_latest(state.metrics.registry).decode()
            await board.push.remote(self.name, text)
            await asyncio.sleep(METRICS_PUSH_S)

    async def __del__(self) -> None:
        self._pusher.cancel()
        await self._lifespan.__aexit__(None, None, None)


class Frontend:
    """The HTTP ingress: forwards every request to an engine replica (see the module docstring)."""

    def __init__(self, replicas: Any, config: ServerConfig) -> None:
        self.replicas = replicas.options(stream=True)
        self.config = config
        self._registry: Any = None  # the AdapterRegistry's handle, and its version, taken at the first request
        self.adapters_version = 0
        self._adapters_change = asyncio.Lock()

    def __serve_build_asgi_app__(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/{path:path}", self.forward, methods=methods),
            ]
        )

    async def forward(self, request: Any) -> Any:
        import ray

        if self._registry is None:
            registry = ray.get_actor(ADAPTER_REGISTRY, namespace="serve")
            self.adapters_version, _ = await registry.snapshot.remote()
            self._registry = registry
        body = await request.body()
        loads = ADAPTER_ROUTES.get(request.url.path)
        if loads is None or request.method != "POST":
            return await self._forward(request, body)
        async with self._adapters_change:  # one change at a time, each applied on one replica before it is recorded
            response = await self._forward(request, body)
            if response.status_code == 200:
                payload = json.loads(body)
                path = payload["lora_path"] if loads else None
                self.adapters_version = await self._registry.change.remote(payload["lora_name"], path)
            return response

    async def _forward(self, request: Any, body: bytes) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        from fiberserve.server.errors import error_body

        forwarded = ForwardedRequest(
            request.method,
            request.url.path,
            request.url.query.encode(),
            list(request.headers.raw),
            body,
            prompt_text(body),
            self.adapters_version,
        )
        cause: BaseException | None = None
        for _ in range(FORWARD_TRIES):  # only while the replica has sent no byte of the answer: then a retry is safe
            stream = self.replicas.http.remote(forwarded)
            try:
                start, first = await self._first_bytes(stream)
            except Exception as exc:  # the replica died, or Ray could not reach it
                cause = exc
                log.warning("a replica failed before answering %s: %s; trying another", request.url.path, exc)
                continue
            headers = {k.decode(): v.decode() for k, v in start.get("headers", []) if k.lower() != b"content-length"}
            return StreamingResponse(self._rest(first, stream), status_code=start["status"], headers=headers)
        message = f"no replica could answer: {_cause(cause)}"
        return JSONResponse(error_body(message, "server_error", code=503), 503)

    @staticmethod
    async def _first_bytes(stream: Any) -> tuple[dict, list[bytes]]:
        """The answer's start, and its body up to its first bytes (a stream's start comes before any token)."""
        start = await stream.__anext__()
        first: list[bytes] = []
        while not first:
            message = await stream.__anext__()
            first.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
            if not first[-1]:
                first.pop()
        return start, first

    @staticmethod
    async def _rest(first: list[bytes], stream: Any) -> AsyncIterator[bytes]:
        """The answer's body as the replica sends it; a replica lost mid-answer ends it with an error event."""
        for chunk in first:
            yield chunk
        try:
            async for message in stream:
                if message.get("body"):
                    yield message["body"]
        except Exception as exc:
            from fiberserve.server.errors import error_body

            message = f"the replica serving this request failed: {_cause(exc)}"
            yield f"data: {json.dumps(error_body(message, 'server_error'))}\n\n".encode()

    async def health(self, request: Any) -> Any:
        from ray import serve
        from starlette.responses import JSONResponse

        status = serve.status().applications[APP_NAME].deployments[ENGINE]
        running = sum(count for state, count in status.replica_states.items() if state == "RUNNING")
        config = self.config
        wanted = config.min_replicas if config.max_replicas else config.replicas  # the fewest it should run
        healthy = running >= wanted and status.status != "UNHEALTHY"
        state = "ok" if healthy else "degraded" if running else "unavailable"
        replicas = {"running": running, "target": config.replicas}
        if config.max_replicas:
            replicas = {"running": running, "min": config.min_replicas, "max": config.max_replicas}
        return JSONResponse({"status": state, "replicas": replicas}, 200 if running else 503)

    async def metrics(self, request: Any) -> Any:
        import ray
        from starlette.responses import Response

        board = ray.get_actor(METRICS_BOARD, namespace="serve")
        texts = await board.all.remote()
        return Response(merge_expositions(texts), media_type="text/plain; version=0.0.4; charset=utf-8")


def _cause(exc: BaseException | None) -> str:
    """An exception in a line: its type and the first line of its message (Ray's run on for paragraphs)."""
    if exc is None:
        return "unknown"
    first = next(iter(str(exc).strip().splitlines()), "")
    return f"{type(exc).__name__}: {first[:200]}"


def merge_expositions(texts: dict[str, str]) -> str:
    """Several Prometheus text expositions as one, every sample labelled ``replica`` with its source's name."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.type, family.documentation, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                rendered = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{rendered}}} {_number(sample.value)}")
    out = []
    for name, (kind, documentation, lines) in families.items():
        out += [f"# HELP {name} {documentation}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) or abs(value) > 2**53 else str(int(value))


def build_application(config: ServerConfig) -> Any:
    """The Serve application (not yet running): the frontend bound to the engine replicas."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from fiberserve.cluster.prefix_router import PrefixAffinityRouter

    threads = replica_threads(config)
    engine = dataclasses.replace(
        config.engine, threads_per_fiber=config.engine.threads_per_fiber or max(1, threads // config.engine.fibers)
    )
    replica_config = dataclasses.replace(config, engine=engine)
    router: dict[str, Any] = {}
    if config.prefix_routing:  # (pydantic's signature hides that a class is taken, as well as its import path)
        router["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter)  # type: ignore[arg-type]
    scaling: dict[str, Any] = {"num_replicas": config.replicas}
    if config.max_replicas:
        scaling = {
            "num_replicas": "auto",
            "autoscaling_config": AutoscalingConfig(
                min_replicas=config.min_replicas,
                initial_replicas=max(config.min_replicas, min(config.replicas, config.max_replicas)),
                max_replicas=config.max_replicas,
                target_ongoing_requests=config.target_ongoing_requests,
                upscale_delay_s=config.autoscale_delay_s,
                downscale_delay_s=config.autoscale_delay_s,
                metrics_interval_s=min(10.0, config.autoscale_delay_s),
                look_back_period_s=min(30.0, 2 * config.autoscale_delay_s),
            ),
        }
    replicas = serve.deployment(
        name=ENGINE,
        ray_actor_options={"num_cpus": threads, "num_gpus": 1 if config.engine.device.startswith("cuda") else 0},
        # The engine batches and queues itself (up to max_running + max_queue sequences): Serve must not cap the
        # requests a replica holds far below that.
        max_ongoing_requests=engine.max_running + engine.max_queue,
        graceful_shutdown_timeout_s=config.shutdown_timeout,
        health_check_period_s=2,
        **router,
        **scaling,
    )(EngineReplica)
    frontend = serve.deployment(
        name=FRONTEND,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
        graceful_shutdown_timeout_s=config.shutdown_timeout,
    )(serve.ingress()(Frontend))
    return frontend.bind(replicas.bind(replica_config), config)


def run_cluster(config: ServerConfig) -> int:
    """Serve ``config`` on Ray Serve until SIGINT/SIGTERM; returns 0 (1 if the application failed to deploy)."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise SystemExit(f"--replicas needs Ray Serve: pip install 'fiberserve[ray]' ({exc})") from None
    configure_logging(config.log_level)
    if config.ray_address:
        ray.init(address=config.ray_address, logging_level=logging.WARNING)
    else:  # a local instance of our own
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        board = ray.remote(num_cpus=0)(MetricsBoard).options(name=METRICS_BOARD, namespace="serve").remote()
        registry_actor = ray.remote(num_cpus=0)(AdapterRegistry).options(name=ADAPTER_REGISTRY, namespace="serve")
        registry = registry_actor.remote(config.engine.lora_modules)
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_application(config), name=APP_NAME, route_prefix="/", blocking=False)
        log.info("ready: %d replicas on http://%s:%d", config.replicas, config.host, config.port)
        stop.wait()
        log.info("draining in-flight requests (up to %s s), then stopping", config.shutdown_timeout)
        # In a thread with a deadline: a Ctrl-C reaches the local Ray's own processes too, and deleting the
        # application would then wait for a cluster that is gone.
        deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
        deleting.start()
        deleting.join(config.shutdown_timeout + 10)
        ray.kill(board)  # type: ignore[arg-type]
        ray.kill(registry)  # type: ignore[arg-type]
        return 0
    except Exception as exc:  # a deployment that never became healthy, a Ray that did not start
        log.error("the Ray Serve application failed: %s", exc)
        return 1
    finally:
        serve.shutdown()
        ray.shutdown()
