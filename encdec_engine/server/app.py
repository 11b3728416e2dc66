"""OpenAI-compatible HTTP server over `AsyncLLMEngine`.

Which endpoints answer depends on the loaded model; the other kind gets a 404 that says why:

    Whisper      POST /v1/audio/transcriptions, /v1/audio/translations   (multipart upload)
                 websocket /v1/realtime                                  (OpenAI's Realtime transcription sessions)
    text models  POST /v1/completions                                     (BART: prompt = encoder prompt)
    always       GET /v1/models, /health, /metrics (Prometheus text)

Every request passes the same gate: a Host and an Origin header this server serves (403: no web page
may use it through a browser, by DNS rebinding or cross-site), an optional Bearer API key (401; with the
key set it also guards /metrics, /docs, /redoc and /openapi.json unless `--no-protect-info`), a body
size limit (413), then a bounded queue of requests admitted but not yet running in the
engine (429). Bad input is a 400 naming the problem, in OpenAI's error shape, and
never reaches the engine thread. An internal failure is a 500 whose body names a request
id, never the exception (the log has the traceback under that id). A client that goes
away aborts its requests.

This module builds and runs the app; the parts live beside it:

    limits.py        ServerLimits and what enforces them: the admission queue, the audio memory, the
                     output budget (a leaf: nothing else of the server is imported there)
    gate.py          what every request passes first: Host and Origin, the API key, the body's size and rate
    origins.py       which Host and Origin headers are served (DNS rebinding, cross-site requests)
    errors.py        APIError (OpenAI's error shape) and mapping engine exceptions to it
    protocol.py      the request and response bodies (pydantic)
    openapi.py       the OpenAPI document: real request and response bodies, error statuses
    metrics.py       request counters and latency histograms, the Prometheus text
    state.py         ServerState, server-sent events, cancelling on client disconnect
    info.py          GET /v1/models, /health, /metrics
    completions.py   POST /v1/completions, whole or streamed
    audio.py         POST /v1/audio/*: the upload (uploads.py), transcription, response formats
    realtime.py      the /v1/realtime websocket: live transcription sessions (realtime_protocol.py: their events)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from encdec_engine.config import EngineConfig
from encdec_engine.engine.async_engine import AsyncLLMEngine
from encdec_engine.engine.llm_engine import LLMEngine
from encdec_engine.machine.threads import beside_engine_thread, single_threaded
from encdec_engine.server import protocol as P
from encdec_engine.server import audio, completions, info, realtime, routes
from encdec_engine.server.errors import APIError, internal_error
from encdec_engine.server.gate import Gate
from encdec_engine.server.limits import ServerLimits
from encdec_engine.server.openapi import ModelFacts, install_openapi
from encdec_engine.server.origins import ANY, is_loopback
from encdec_engine.server.state import ServerState
from encdec_engine.checkpoints.whisper.languages import LANGUAGES, TO_LANGUAGE_CODE
from encdec_engine.checkpoints.whisper.tokens import WhisperTokens

__all__ = ["ServerLimits", "build_app", "run_server"]

logger = logging.getLogger(__name__)


# -- errors -------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, *P.describe_validation_errors(e.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 404 and message == "Not Found":
            message = f"no endpoint {request.method} {request.url.path}"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return APIError(e.status_code, message).response(dict(e.headers or {}))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody is listening: no body, no traceback

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        return internal_error(e, where=request.url.path).response()


# -- building and running -----------------------------------------------------------
def build_app(model: str | None = None, *, engine: LLMEngine | AsyncLLMEngine | None = None,
              limits: ServerLimits | None = None, served_model_name: str | None = None,
              shutdown_timeout: float = 30.0, **engine_kwargs) -> FastAPI:
    """The FastAPI app serving `model` (a checkpoint folder; `engine_kwargs` are EngineConfig fields),
    or an engine built already. The engine thread starts and stops with the app's lifespan;
    at shutdown requests in flight get `shutdown_timeout` s to finish, then are aborted."""
    if engine is None:
        if model is None:
            raise ValueError("build_app needs a model path or an engine")
        engine = LLMEngine(EngineConfig(model=str(model), **engine_kwargs))
    async_engine = engine if isinstance(engine, AsyncLLMEngine) else AsyncLLMEngine(engine)
    async_engine.engine.reject_max_tokens_past_limit = True  # OpenAI: a 400, not a silently shorter answer
    state = ServerState(async_engine, limits or ServerLimits(), served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The event loop's own torch work (voice detection) and its workers' (uploads decoded, long files'
        # log-mels) run on one thread each, beside the engine thread's steps, which keep the cores; and the
        # workers are `preprocess_workers` (2), not asyncio's cores + 4: at 64 clients six of them decoding
        # and featurizing at once took the cores from the engine's parallel regions (2 cores, tiny.en bf16:
        # 128 requests in 33.5 s with six, 25-27 s with one or two, where 16 clients take 4 requests a second).
        beside_engine_thread()
        # What was built up to now (the model, tokenizer, libraries: 200,000 objects) lives as long as the
        # server: out of the collector's reach while it serves, a full collection walks only what requests made
        # since; back within it once the server stops (an app dropped is freed).
        gc.collect()
        gc.freeze()
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
            state.limits.preprocess_workers, thread_name_prefix="encdec-server", initializer=single_threaded))
        async_engine.start()
        try:
            yield
            await async_engine.shutdown(timeout=shutdown_timeout)
        finally:
            gc.unfreeze()

    app = FastAPI(title="encdec-engine", summary="OpenAI-compatible serving of encoder/decoder models",
                  lifespan=lifespan, docs_url=None, redoc_url=routes.REDOC, openapi_url=routes.OPENAPI)
    app.state.server = state
    _install_swagger_ui(app)
    for endpoints in (info.router, completions.router, audio.router, realtime.router):
        app.include_router(endpoints)
    _install_error_handlers(app)
    install_openapi(app, _model_facts(state))
    app.add_middleware(Gate, state=state)
    return app


def _install_swagger_ui(app: FastAPI) -> None:
    """/docs: Swagger UI from the swagger-ui-bundle package, so that it works offline (FastAPI's own
    fetches its scripts from a CDN)."""
    app.mount(routes.DOCS_STATIC, StaticFiles(directory=swagger_ui_path), name="swagger-ui")

    # The endpoint reads its app from the request, never by closure: FastAPI keeps endpoint functions in a
    # module-level cache, and a closure over `app` would keep every app built in the process (its engine too).
    @app.get(routes.DOCS, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        app = request.app
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
                                   oauth2_redirect_url=routes.DOCS_OAUTH2_REDIRECT,
                                   swagger_js_url=f"{routes.DOCS_STATIC}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{routes.DOCS_STATIC}/swagger-ui.css",
                                   swagger_favicon_url=f"{routes.DOCS_STATIC}/favicon-32x32.png")

    @app.get(routes.DOCS_OAUTH2_REDIRECT, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()


def _model_facts(state: ServerState) -> ModelFacts:
    engine = state.engine.engine
    facts = dict(is_audio=state.is_audio, vocab_size=engine.input_processor.vocab_size,
                 max_decoder_len=engine.max_decoder_len, max_prompts=min(P.MAX_PROMPTS, state.limits.max_queue))
    if state.is_audio:
        tokens = WhisperTokens.from_configs(engine.hf_config, engine.generation_config)
        codes = [code for code in LANGUAGES if tokens.is_multilingual and f"<|{code}|>" in tokens.lang_to_id] or ["en"]
        names = [name for name, code in TO_LANGUAGE_CODE.items() if code in codes]
        facts.update(languages=tuple(dict.fromkeys(codes + names + [n.title() for n in names])),
                     window_prompt_len=len(tokens.decoder_prompt(codes[0], "transcribe")))
    return ModelFacts(**facts)


def _log_to_stderr(level: str) -> None:
    """The engine's own log lines (threads, KV pool, ...) beside uvicorn's, which configures only its own."""
    engine_logger = logging.getLogger("encdec_engine")
    if not engine_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))  # uvicorn's layout
        engine_logger.addHandler(handler)
    engine_logger.setLevel(level.upper())


def run_server(model: str, *, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None,
               served_model_name: str | None = None, shutdown_timeout: float = 30.0, log_level: str = "info",
               **engine_kwargs) -> None:
    """Serve `model` with uvicorn until interrupted (SIGINT/SIGTERM shut down gracefully)."""
    import uvicorn

    limits = (limits or ServerLimits()).for_bind(host)
    _log_to_stderr(log_level)
    _warn_what_is_open(host, limits)
    app = build_app(model, limits=limits, served_model_name=served_model_name, shutdown_timeout=shutdown_timeout,
                    **engine_kwargs)
    state: ServerState = app.state.server
    logger.info("serving %r: %s", state.model_name, state.engine.engine.describe())
    # No per-message deflate on websockets: the realtime sessions' messages are base64 audio, which it shrinks by
    # about a quarter, and compressing and inflating every 100 ms chunk cost both ends CPU the engine needs (a client
    # that asks for it gets plain frames, as the protocol allows).
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, ws_per_message_deflate=False)
    uvicorn_server(config, state).run()


def _warn_what_is_open(host: str, limits: ServerLimits) -> None:
    """Warn of what is left open to others: a public address without an API key, any Host answered."""
    if limits.api_key is None and not is_loopback(host):
        logger.warning("serving on %s without an API key: anyone who can reach the port can use it "
                       "(set one in $ENCDEC_API_KEY)", host)
    if ANY in (limits.allowed_hosts or ()):
        logger.warning("serving on %s: any Host header is answered, so a web page can reach this server by DNS "
                       "rebinding; name the server's host names with --allowed-hosts to check it", host)


def uvicorn_server(config, state: ServerState):
    """uvicorn's Server, whose shutdown first lets the realtime sessions finish (`RealtimeConnection.finish`:
    the open turn's final text, then close 1001), within `config.timeout_graceful_shutdown`. Without this
    uvicorn closes every websocket at once (1012) and an open turn's words are lost."""
    import uvicorn  # lazy: the server's own modules load only for a command that serves

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:  # no new connections while the sessions finish
                server.close()
            sessions = [c.finish() for c in list(state.realtime_connections)]
            if sessions:
                logger.info("finishing %d realtime session(s)", len(sessions))
                _, pending = await asyncio.wait([asyncio.ensure_future(s) for s in sessions],
                                                   timeout=config.timeout_graceful_shutdown)
                if pending:
                    logger.warning("%d realtime session(s) did not finish in time; closing them", len(pending))
            await super().shutdown(sockets)

    return Server(config)
