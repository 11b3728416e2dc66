"""A real server for the tests: uvicorn on a free loopback port in a background thread, with the helpers
the server tests share (the API key they use, waiting for a condition)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import uvicorn
from helpers import AUDIO

from encdec_engine.engine.async_engine import AsyncLLMEngine
from encdec_engine.server.app import uvicorn_server

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
__all__ = ["AUDIO", "AUTH", "KEY", "LiveServer", "default_model_server", "until"]


class LiveServer:
    """A uvicorn server in a background thread on a free loopback port."""

    def __init__(self, app, shutdown_timeout: float = 5.0) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.app, self.state = app, app.state.server
        self.engine: AsyncLLMEngine = self.state.engine
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout)
        self.server = uvicorn_server(config, self.state)  # `encdec serve`'s: realtime sessions finish at shutdown
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", KEY)
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def on_engine(self, fn):
        """Run fn(LLMEngine) on the engine thread (the only thread allowed to touch it)."""
        return self.engine.call(fn).result(timeout=60)

    def assert_clean(self, timeout: float = 10.0) -> None:
        """Eventually: nothing in flight, every KV block free, no queue slot held; and still serving."""
        deadline = time.monotonic() + timeout
        while True:
            busy, free, total = self.on_engine(
                lambda e: (e.has_unfinished_requests(), e.num_free_blocks(), e.num_total_blocks()))
            memory = self.state.audio_memory.used
            if not busy and free == total and self.state.admission.waiting == 0 and memory == 0:
                break
            assert time.monotonic() < deadline, f"leak: busy={busy} free={free} total={total} audio bytes={memory}"
            time.sleep(0.05)
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def default_model_server(limits=None, kv_cache_space_gb: float = 0.25):
    """The body of a module fixture: the bundled tiny.en served behind `limits` (ServerLimits), stopped after."""
    from encdec_engine.checkpoints.ct2.importer import default_model_path
    from encdec_engine.server.app import ServerLimits, build_app

    live = LiveServer(build_app(str(default_model_path()), limits=limits or ServerLimits(),
                                kv_cache_space_gb=kv_cache_space_gb))
    yield live
    live.stop()
