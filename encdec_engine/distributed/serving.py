"""Replicated serving on Ray Serve: N engine replicas behind the OpenAI-compatible routes of one address.

Each replica is the app `server/app.py` builds (`build_app`), deployed as a Serve ASGI ingress,
so limits, the API key, streaming, errors and graceful shutdown are the single server's, per replica.
Serve's proxy spreads requests over the replicas; a replica whose process dies fails only the requests
it held (the proxy answers them with a 5xx), the others take the new ones, and Serve starts a
replacement. A replica whose engine thread stopped fails its health check and is replaced too.

`/metrics` sums every replica's samples and lists each replica's under a `replica` label (see
`metrics_merge.py`): replicas push their own text to a small hub actor every `REPORT_INTERVAL_S`, so the
answering replica's numbers are current and the others' at most that old.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from encdec_engine.checkpoints.names import resolve_job_model
from encdec_engine.distributed.api import local_model
from encdec_engine.distributed.cluster import ClusterOptions, connect, import_ray
from encdec_engine.distributed.metrics_merge import merge
from encdec_engine.server.limits import ServerLimits
from encdec_engine.server.metrics import Metrics

APP_NAME = "encdec"
REPORT_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0  # a replica silent this long is dropped from /metrics (it died)
HEALTH_CHECK_PERIOD_S = 2.0


class MetricsHub:
    """A Ray actor that keeps each replica's latest Prometheus text."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, str]] = {}

    def report(self, replica: str, text: str) -> dict[str, str]:
        """Keep `replica`'s text; return the other live replicas' texts."""
        now = time.monotonic()
        self.reports[replica] = (now, text)
        return {r: t for r, (at, t) in self.reports.items() if r != replica and now - at < STALE_AFTER_S}

    def leave(self, replica: str) -> None:
        self.reports.pop(replica, None)


class ReplicaMetrics(Metrics):
    """A replica's metrics: its own samples plus an info sample, rendered merged with the others'."""

    def __init__(self, replica: str) -> None:
        super().__init__()
        self.replica = replica
        self.others: dict[str, str] = {}

    def own(self, engine, admission, *parts) -> str:
        info = (f'encdec_replica_info{{pid="{os.getpid()}",node="{socket.gethostname()}"}} 1')
        return (super().render(engine, admission, *parts) + "# HELP encdec_replica_info The replica's process\n"
                "# TYPE encdec_replica_info gauge\n" + info + "\n")

    def render(self, engine, admission, *parts) -> str:
        """`parts`: what `Metrics.render` takes after the admission (audio memory, realtime sessions)."""
        return merge({self.replica: self.own(engine, admission, *parts), **self.others})


class ReplicaHeader:
    """ASGI middleware: every response says which replica made it (`x-encdec-replica`, the `replica`
    label of /metrics), so a client or a test can tell the replicas apart."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (b"x-encdec-replica", replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class EngineReplica:
    """One Serve replica: an engine and the server's app (wrapped by `serve.ingress` in `_deployment`)."""

    def __init__(self, model: str | None, engine: dict[str, Any], limits: ServerLimits,
                 served_model_name: str | None, shutdown_timeout: float, threads: int, hub) -> None:
        import torch

        torch.set_num_threads(threads)
        self.model, self.engine, self.limits = model, engine, limits
        self.served_model_name, self.shutdown_timeout, self.hub = served_model_name, shutdown_timeout, hub
        self.state = None
        self.reporter: asyncio.Task | None = None

    async def __serve_build_asgi_app__(self):
        from ray import serve

        from encdec_engine.server.app import build_app  # lazy: in the replica; the driver needs no engine

        app = build_app(resolve_job_model(self.model), limits=self.limits, served_model_name=self.served_model_name,
                        shutdown_timeout=self.shutdown_timeout, **self.engine)
        self.state = app.state.server
        replica = serve.get_replica_context().replica_id.unique_id
        self.state.metrics = ReplicaMetrics(replica)
        self.reporter = asyncio.get_running_loop().create_task(self._report())
        app.add_middleware(ReplicaHeader, replica=replica)
        return app

    async def _report(self) -> None:
        metrics = self.state.metrics
        while True:
            try:
                metrics.others = await self.hub.report.remote(metrics.replica,
                                                              metrics.own(self.state.engine, self.state.admission,
                                                                          self.state.audio_memory))
            except Exception:  # the hub is gone (the server is shutting down): keep serving own numbers
                metrics.others = {}
            await asyncio.sleep(REPORT_INTERVAL_S)

    def check_health(self) -> None:
        """Serve's periodic check: a replica whose engine thread stopped is replaced."""
        engine = self.state.engine if self.state is not None else None
        if engine is not None and not engine.is_running:
            raise RuntimeError(f"the engine stopped: {engine.dead_reason or 'shut down'}")

    async def __del__(self) -> None:
        if self.reporter is not None:
            self.reporter.cancel()
            try:
                await self.hub.leave.remote(self.state.metrics.replica)
            except Exception:  # the hub went first
                pass


@dataclass
class ReplicatedServer:
    """A running replicated server; `shutdown()` drains and stops it (and a cluster it started)."""

    url: str
    replicas: int
    _stack: ExitStack = field(repr=False)

    def wait(self) -> None:
        """Block until SIGINT or SIGTERM, then shut down gracefully."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        self.shutdown()

    def shutdown(self) -> None:
        self._stack.close()


def start(model: str | None = None, *, replicas: int = 2, address: str | None = None, threads_per_replica: int = 1,
          host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None,
          served_model_name: str | None = None, shutdown_timeout: float = 30.0, log_level: str = "warning",
          engine: dict[str, Any] | None = None) -> ReplicatedServer:
    """Deploy `replicas` engines of `model` (None: the default tiny.en) behind http://host:port."""
    limits = (limits or ServerLimits()).for_bind(host)  # the proxy binds `host`; the replicas check Host
    engine = engine or {}
    model = local_model(model, address)
    ray = import_ray()
    from ray import serve

    stack = ExitStack()
    try:
        stack.enter_context(connect(ClusterOptions(address, replicas, threads_per_replica)))
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": log_level.upper()})
        stack.callback(serve.shutdown)
        hub = ray.remote(num_cpus=0)(MetricsHub).options(name=f"{APP_NAME}-metrics", get_if_exists=True).remote()
        stack.callback(ray.kill, hub)
        deployment = _deployment(replicas, threads_per_replica, limits, engine, shutdown_timeout)
        serve.run(deployment.bind(model, engine, limits, served_model_name, shutdown_timeout, threads_per_replica,
                                  hub), name=APP_NAME, route_prefix="/")
        stack.callback(serve.delete, APP_NAME)  # first out: drains requests in flight before Serve stops
    except BaseException:
        stack.close()
        raise
    return ReplicatedServer(f"http://{host}:{port}", replicas, stack)


def _deployment(replicas: int, threads: int, limits: ServerLimits, engine: dict[str, Any], shutdown_timeout: float):
    from ray import serve

    # Serve queues requests beyond max_ongoing_requests in its proxy, where the replica's own limit (429
    # past max_queue waiting) would never see them: let each replica hold its running batch and its queue.
    ongoing = limits.max_queue + engine.get("max_num_seqs", 256)
    return serve.deployment(serve.ingress()(EngineReplica), name=APP_NAME, num_replicas=replicas,
                            ray_actor_options={"num_cpus": threads}, max_ongoing_requests=ongoing,
                            graceful_shutdown_timeout_s=shutdown_timeout, health_check_period_s=HEALTH_CHECK_PERIOD_S)
