"""OpenAI-compatible HTTP server over `AsyncLLMEngine`.

Which endpoints answer depends on the loaded model; the other kind gets a 404 that says why:

    Whisper      POST /v1/audio/transcriptions, /v1/audio/translations   (multipart upload)
    text models  POST /v1/completions                                     (BART: prompt = encoder prompt)
    always       GET /v1/models, /health, /metrics (Prometheus text)

Every request passes the same gate: an optional Bearer API key (401), a body size
limit (413), then a bounded queue of requests admitted but not yet running in the
engine (429). Bad input is a 400 naming the problem, in OpenAI's error shape, and
never reaches the engine thread. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from encdec_engine.config import EngineConfig
from encdec_engine.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from encdec_engine.engine.llm_engine import LLMEngine
from encdec_engine.entrypoints import protocol as P
from encdec_engine.entrypoints.writers import render
from encdec_engine.inputs.audio import AUDIO_EXTENSIONS, N_FRAMES, SAMPLE_RATE, AudioError, load_audio, load_audio_bytes
from encdec_engine.outputs import CompletionOutput, RequestOutput, Transcription
from encdec_engine.transcription import FRAMES_PER_SECOND, Transcriber, TranscribeOptions

logger = logging.getLogger(__name__)
T = TypeVar("T")

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, math.inf)  # s
# Containers libsndfile cannot read from memory; decoded through a temporary file and ffmpeg.
_FFMPEG_ONLY = AUDIO_EXTENSIONS - {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au"}
_API_PATHS = ("/v1/completions", "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/models")


@dataclass(frozen=True)
class ServerLimits:
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    max_queue: int = 256  # engine requests admitted but not yet running; more get 429
    max_upload_mb: float = 25.0  # request body size (OpenAI's audio limit); more get 413
    max_audio_seconds: float = 3600.0  # decoded audio length; more get 413
    preprocess_workers: int = 2  # audio decodes / log-mels computed at once (off the event loop)

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.max_upload_mb <= 0 or self.max_audio_seconds <= 0:
            raise ValueError("max_upload_mb and max_audio_seconds must be positive")
        if self.preprocess_workers < 1:
            raise ValueError(f"preprocess_workers must be at least 1, got {self.preprocess_workers}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no key)")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_upload_mb * (1 << 20))


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with its HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 499: "client_closed_request",
             500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.TYPES.get(self.status, "error"),
                                                 param=self.param, code=self.status))
        if self.status == 429:
            headers = {"Retry-After": "1", **(headers or {})}
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


class _BodyTooLarge(HTTPException):
    # An HTTPException so that FastAPI's body reader passes it through instead of making it a 400.
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than this server's limit of {limit / (1 << 20):g} MB")


# -- admission: the bounded waiting queue -----------------------------------
class _Ticket:
    """Slots held in the queue until the engine starts the requests (or they end)."""

    def __init__(self, admission: _Admission, held: int) -> None:
        self.admission, self.held = admission, held

    def release(self, n: int = 1) -> None:
        n = min(n, self.held)
        self.held -= n
        self.admission.waiting -= n

    def release_all(self) -> None:
        self.release(self.held)


class _Admission:
    """Counts engine requests admitted but not yet started (event loop only, so exact)."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.waiting = 0

    def acquire(self, n: int) -> _Ticket:
        if n > self.max_queue:
            raise APIError(400, f"{n} prompts in one request exceed this server's queue of {self.max_queue}; "
                                "send fewer per request", "prompt")
        if self.waiting + n > self.max_queue:
            raise APIError(429, f"server busy: {self.waiting} requests are already waiting to start "
                                f"(limit {self.max_queue}); retry shortly")
        self.waiting += n
        return _Ticket(self, n)


# -- metrics ------------------------------------------------------------------
class _Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (endpoint, status) -> count
        self.buckets: dict[str, list[int]] = defaultdict(lambda: [0] * len(_LATENCY_BUCKETS))
        self.latency_sum: dict[str, float] = defaultdict(float)

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests[(endpoint, status)] += 1
        counts = self.buckets[endpoint]
        for i, bound in enumerate(_LATENCY_BUCKETS):
            if seconds <= bound:
                counts[i] += 1
        self.latency_sum[endpoint] += seconds

    def render(self, engine: AsyncLLMEngine, admission: _Admission) -> str:
        s = engine.snapshot
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{labels} {value:g}" for labels, value in samples)

        metric("encdec_engine_up", "gauge", "1 while the engine thread runs", [("", float(engine.is_running))])
        metric("encdec_requests_waiting", "gauge", "Requests in the engine's waiting queue", [("", s.num_waiting)])
        metric("encdec_requests_running", "gauge", "Requests in the engine's running batch", [("", s.num_running)])
        metric("encdec_requests_swapped", "gauge", "Requests swapped out to CPU memory", [("", s.num_swapped)])
        metric("encdec_server_queue_size", "gauge", "Requests admitted but not yet started (429 at the limit)",
               [("", admission.waiting)])
        metric("encdec_server_queue_limit", "gauge", "The admission queue's limit", [("", admission.max_queue)])
        metric("encdec_kv_blocks_used", "gauge", "KV cache blocks in use, by attention type",
               [('{kind="self"}', s.self_blocks), ('{kind="cross"}', s.cross_blocks)])
        metric("encdec_kv_blocks_free", "gauge", "Free KV cache blocks, by pool",
               [('{pool="device"}', s.free_blocks), ('{pool="swap"}', s.free_swap_blocks)])
        metric("encdec_kv_blocks_total", "gauge", "KV cache blocks, by pool",
               [('{pool="device"}', s.total_blocks), ('{pool="swap"}', s.total_swap_blocks)])
        metric("encdec_generated_tokens_total", "counter", "Tokens generated", [("", s.generated_tokens)])
        metric("encdec_generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s",
               [("", round(engine.tokens_per_second(), 3))])
        metric("encdec_requests_aborted_total", "counter", "Engine requests aborted before finishing",
               [("", s.num_aborted)])
        metric("encdec_engine_step_errors_total", "counter", "Engine steps that raised", [("", s.num_step_errors)])
        metric("encdec_http_requests_total", "counter", "API requests answered, by endpoint and status",
               [(f'{{endpoint="{e}",status="{c}"}}', n) for (e, c), n in sorted(self.requests.items())])
        out.extend(["# HELP encdec_request_latency_seconds API request latency (to the last byte)",
                    "# TYPE encdec_request_latency_seconds histogram"])
        for endpoint, counts in sorted(self.buckets.items()):
            for bound, count in zip(_LATENCY_BUCKETS, counts):
                le = "+Inf" if bound == math.inf else f"{bound:g}"
                out.append(f'encdec_request_latency_seconds_bucket{{endpoint="{endpoint}",le="{le}"}} {count}')
            out.append(f'encdec_request_latency_seconds_sum{{endpoint="{endpoint}"}} {self.latency_sum[endpoint]:g}')
            out.append(f'encdec_request_latency_seconds_count{{endpoint="{endpoint}"}} {counts[-1]}')
        return "\n".join(out) + "\n"


# -- the gate: API key, body size, metrics (pure ASGI, so streaming is timed to the last byte) --
class _Gate:
    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, limits = scope["path"], self.state.limits
        endpoint = path if path in _API_PATHS else None
        start, status, done = time.monotonic(), [500], [False]

        async def send_timed(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done[0] = True
            await send(message)

        received = 0

        async def receive_limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limits.max_body_bytes:
                    raise _BodyTooLarge(limits.max_body_bytes)
            return message

        try:
            headers = dict(scope["headers"])
            error = None
            if limits.api_key is not None and path.startswith("/v1"):
                error = _check_api_key(headers.get(b"authorization"), limits.api_key)
            length = headers.get(b"content-length", b"")
            if error is None and length.isdigit() and int(length) > limits.max_body_bytes:
                error = APIError(413, str(_BodyTooLarge(limits.max_body_bytes).detail))
            if error is not None:
                return await error.response()(scope, receive, send_timed)
            await self.app(scope, receive_limited, send_timed)
        finally:
            if endpoint is not None:
                self.state.metrics.observe(endpoint, status[0] if done[0] else 499, time.monotonic() - start)


def _check_api_key(header: bytes | None, api_key: str) -> APIError | None:
    if not header:
        return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, token = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return APIError(401, "invalid API key")
    return None


# -- server state -------------------------------------------------------------
class ServerState:
    def __init__(self, engine: AsyncLLMEngine, limits: ServerLimits, served_model_name: str | None) -> None:
        self.engine, self.limits = engine, limits
        core = engine.engine
        self.is_audio = getattr(core.model, "num_mel_bins", None) is not None
        self.model_path = str(core.config.model)
        self.model_name = served_model_name or Path(self.model_path).name or self.model_path
        self.aliases = {self.model_name, self.model_path} | ({"whisper-1"} if self.is_audio else set())
        self.admission = _Admission(limits.max_queue)
        self.metrics = _Metrics()
        self.preprocess = asyncio.Semaphore(limits.preprocess_workers)

    def check_model(self, name: str | None) -> None:
        if name and name not in self.aliases:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_name!r}", "model")

    def require(self, audio: bool, path: str) -> None:
        if audio and not self.is_audio:
            raise APIError(404, f"{path} needs a speech model (Whisper); this server runs the text model "
                                f"{self.model_name!r}: use /v1/completions")
        if not audio and self.is_audio:
            raise APIError(404, f"{path} needs a text model (BART or decoder-only); this server runs the speech "
                                f"model {self.model_name!r}: use /v1/audio/transcriptions")


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def _sse_error(e: Exception) -> str:
    err = _engine_error(e)
    return _sse(P.ErrorResponse(error=P.ErrorInfo(message=err.message, type=err.TYPES.get(err.status, "error"),
                                                  code=err.status)))


class _SSEResponse(StreamingResponse):
    """A server-sent event stream that always cleans up: closes its event generator and the engine
    outputs behind it (aborting unfinished requests) and frees its queue slots, even when the client
    left before the first byte."""

    def __init__(self, events: AsyncIterator[str], outputs: AsyncIterator | None, ticket: _Ticket) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events, self._outputs, self._ticket = events, outputs, ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            if self._outputs is not None:
                await self._outputs.aclose()
            self._ticket.release_all()


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine unavailable: {e}")
    return APIError(500, f"internal error: {e}")


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes away first, cancel it (which aborts its engine requests)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "client closed the request")
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


router = APIRouter()


# -- models, health, metrics ---------------------------------------------------
@router.get("/v1/models", response_model=P.ModelList)
async def list_models(request: Request) -> P.ModelList:
    st = _state(request)
    return P.ModelList(data=[P.ModelCard(id=st.model_name, root=st.model_path,
                                         max_model_len=st.engine.engine.max_decoder_len)])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    engine = _state(request).engine
    if engine.is_running:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "reason": engine.dead_reason or "engine not started"}, 503)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    st = _state(request)
    return PlainTextResponse(st.metrics.render(st.engine, st.admission),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


# -- completions ------------------------------------------------------------
@router.post("/v1/completions", response_model=P.CompletionResponse)
async def create_completion(body: P.CompletionRequest, request: Request) -> Response:
    st = _state(request)
    st.require(audio=False, path="/v1/completions")
    st.check_model(body.model)
    try:
        params = body.sampling_params()
    except ValueError as e:
        raise APIError(400, str(e)) from None
    prompts, request_id = body.prompt, f"cmpl-{uuid.uuid4().hex}"
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    ticket = st.admission.acquire(len(prompts))
    outputs = st.engine.generate_batch(prompts, [params] * len(prompts), ids)
    started: set[int] = set()

    async def next_output() -> tuple[int, RequestOutput] | None:
        item = await anext(outputs, None)
        if item is not None and item[0] not in started:
            started.add(item[0])
            ticket.release()
        return item

    handed_over = False  # to the stream, which then releases the ticket and closes the outputs
    try:
        if body.stream:  # the first output (or a bad prompt's 400) comes before the stream starts
            first = await _until_disconnect(request, next_output())
            events = _completion_stream(st, body, request_id, first, next_output)
            handed_over = True
            return _SSEResponse(events, outputs, ticket)

        async def collect() -> list[RequestOutput]:
            finals: list[RequestOutput | None] = [None] * len(prompts)
            while (item := await next_output()) is not None:
                finals[item[0]] = item[1]
            return finals

        finals = await _until_disconnect(request, collect())
    except Exception as e:
        await outputs.aclose()
        raise _engine_error(e) from None
    finally:
        if not handed_over:
            ticket.release_all()
    choices = [_choice(st, body, i * body.n + j, c, c.text, c.token_ids, c.logprobs, c.finish_reason)
               for i, out in enumerate(finals) for j, c in enumerate(out.outputs)]
    return JSONResponse(P.CompletionResponse(id=request_id, model=st.model_name, choices=choices,
                                             usage=_usage(finals)).model_dump())


def _usage(finals: list[RequestOutput]) -> P.Usage:
    prompt = sum(len(o.prompt_token_ids) + len(o.encoder_prompt_token_ids or []) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _choice(st: ServerState, body: P.CompletionRequest, index: int, c: CompletionOutput, text: str,
            token_ids: list[int], logprobs: list[dict[int, float]] | None, finish_reason: str | None,
            text_offset: int = 0) -> P.CompletionChoice:
    lp = None
    if body.logprobs is not None and logprobs is not None:
        tok = st.engine.engine.tokenizer
        decode = (lambda t: tok.decode([t])) if tok is not None else str
        lp = P.CompletionLogprobs()
        for token, top in zip(token_ids, logprobs):
            piece = decode(token)
            lp.tokens.append(piece)
            lp.token_logprobs.append(top.get(token, -math.inf))
            lp.top_logprobs.append({decode(t): v for t, v in top.items()})
            lp.text_offset.append(text_offset)
            text_offset += len(piece)
    return P.CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish_reason)


async def _completion_stream(st: ServerState, body: P.CompletionRequest, request_id: str, first,
                             next_output) -> AsyncIterator[str]:
    """SSE chunks of text deltas; text that might still turn out to be a stop string is held back."""
    params_stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    hold = max((len(s) for s in params_stop), default=1) - 1
    sent_text: dict[int, str] = defaultdict(str)
    sent_tokens: dict[int, int] = defaultdict(int)
    done: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    created = int(time.time())
    try:
        item = first
        while item is not None:
            i, out = item
            choices = []
            for j, c in enumerate(out.outputs):
                key = i * body.n + j
                if key in done:
                    continue
                text = c.text if c.finish_reason else c.text[: max(0, len(c.text) - hold)]
                prev = sent_text[key]
                delta = text[len(prev):] if len(text) > len(prev) and text.startswith(prev) else ""
                if not delta and c.finish_reason is None:
                    continue
                new = slice(sent_tokens[key], len(c.token_ids))
                choices.append(_choice(st, body, key, c, delta, c.token_ids[new],
                                       c.logprobs[new] if c.logprobs else None, c.finish_reason, len(prev)))
                sent_text[key], sent_tokens[key] = prev + delta, len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(key)
            if choices:
                yield _sse(P.CompletionResponse(id=request_id, created=created, model=st.model_name, choices=choices))
            if out.finished:
                finals[i] = out
            item = await next_output()
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(P.CompletionResponse(id=request_id, created=created, model=st.model_name, choices=[],
                                            usage=_usage(list(finals.values()))))
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are out: report in-band, as OpenAI does
        yield _sse_error(e)


# -- audio --------------------------------------------------------------------
@router.post("/v1/audio/transcriptions")
async def create_transcription(request: Request) -> Response:
    return await _audio_request(request, "transcribe")


@router.post("/v1/audio/translations")
async def create_translation(request: Request) -> Response:
    return await _audio_request(request, "translate")


async def _audio_request(request: Request, task: str) -> Response:
    st = _state(request)
    st.require(audio=True, path=request.url.path)
    upload, fields = await _read_form(request)
    schema = P.TranscriptionRequest if task == "transcribe" else P.TranslationRequest
    try:
        req = schema.model_validate(fields)
    except ValidationError as e:
        raise APIError(400, _describe_errors(e.errors()), _first_param(e.errors())) from None
    st.check_model(req.model)
    data = await upload.read()
    if len(data) > st.limits.max_body_bytes:
        raise APIError(413, f"upload is larger than this server's limit of {st.limits.max_upload_mb:g} MB", "file")
    stream = getattr(req, "stream", False)
    temperatures = (req.temperature,) if stream else _fallback_temperatures(req.temperature)
    options = TranscribeOptions(language=getattr(req, "language", None), task=task, initial_prompt=req.prompt,
                                timestamps=not stream, temperatures=temperatures)
    try:
        transcriber = Transcriber(st.engine.engine, options)
        transcriber.tokens.decoder_prompt(options.language, task)  # language and task on this checkpoint
    except ValueError as e:
        raise APIError(400, str(e), "language") from None
    ticket, handed_over = st.admission.acquire(1), False
    try:
        async with st.preprocess:
            job = await asyncio.to_thread(_load_job, transcriber, data, upload.filename or "upload",
                                          st.limits.max_audio_seconds)
        request_id = st.engine.new_request_id("transcribe")
        if stream:
            handed_over = True
            return _SSEResponse(_transcript_events(st, transcriber, job, request_id, ticket), None, ticket)

        async def run() -> Transcription:
            async for _ in st.engine.run_transcription(transcriber, job, request_id):
                ticket.release()
            return transcriber.result(job)

        result = await _until_disconnect(request, run())
    except Exception as e:
        raise _engine_error(e) from None
    finally:
        if not handed_over:
            ticket.release_all()
    return _audio_response(result, req.response_format, task)


async def _read_form(request: Request) -> tuple[UploadFile, dict[str, Any]]:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, f"expected a multipart/form-data body with a 'file' part, got content type "
                            f"{content_type or 'none'!r}")
    form = await request.form(max_files=1, max_fields=32)
    upload, fields = None, {}
    for key, value in form.multi_items():
        name = key.removesuffix("[]")
        if name == "file":
            if not isinstance(value, UploadFile):
                raise APIError(400, "'file' must be an uploaded file (a multipart part with a filename)", "file")
            upload = value
        elif isinstance(value, UploadFile):
            raise APIError(400, f"field {name!r} must be text, got a file", name)
        elif name == "timestamp_granularities":
            fields.setdefault(name, []).append(value)
        elif name in fields:
            raise APIError(400, f"field {name!r} is given more than once", name)
        elif value != "":
            fields[name] = value
    if upload is None:
        raise APIError(400, "missing 'file': send the audio as a multipart/form-data part named 'file'", "file")
    return upload, fields


def _fallback_temperatures(start: float) -> tuple[float, ...]:
    """openai-whisper's schedule: from `start` up to 1.0 in steps of 0.2."""
    return tuple(round(t, 2) for t in np.arange(start, 1.0 + 1e-6, 0.2)) or (start,)


def _load_job(transcriber: Transcriber, data: bytes, name: str, max_seconds: float):
    """Decode an upload and compute its log-mel (in a worker thread). Raises APIError 400 / 413."""
    try:
        import soundfile

        info = soundfile.info(_named_bytes(data, name))  # a cheap look before decoding everything
    except Exception:
        info = None  # not a format libsndfile knows; the decoder below says what is wrong
    if info is not None and info.samplerate > 0 and info.frames / info.samplerate > max_seconds:
        raise _too_long(info.frames / info.samplerate, max_seconds)
    suffix = Path(name).suffix.lower()
    try:
        samples = load_audio_bytes(data, name)
    except AudioError as e:
        if not data or suffix not in _FFMPEG_ONLY:
            raise APIError(400, f"cannot decode the uploaded audio: {e}", "file") from None
        samples = _decode_via_file(data, suffix, name)  # m4a, webm, ...: ffmpeg reads paths only
    if len(samples) > max_seconds * SAMPLE_RATE:
        raise _too_long(len(samples) / SAMPLE_RATE, max_seconds)
    job = transcriber.load(0, (samples, SAMPLE_RATE))
    if job.error is not None:
        raise APIError(400, f"cannot use the uploaded audio: {job.error}", "file")
    if job.language is None and not transcriber.tokens.is_multilingual:
        job.language = "en"  # nothing to detect (and Transcriber.take would take the window for a detection)
    return job


def _named_bytes(data: bytes, name: str):
    import io

    buffer = io.BytesIO(data)
    buffer.name = name
    return buffer


def _decode_via_file(data: bytes, suffix: str, name: str) -> np.ndarray:
    fd, path = tempfile.mkstemp(suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return load_audio(path)
    except AudioError:
        raise APIError(400, f"cannot decode the uploaded audio {name!r} (corrupt or unsupported codec)",
                       "file") from None
    finally:
        os.unlink(path)


def _too_long(seconds: float, limit: float) -> APIError:
    return APIError(413, f"audio is {seconds:.1f} s long; this server accepts at most {limit:g} s", "file")


def _window_text(transcriber: Transcriber, token_ids: list[int]) -> str:
    return transcriber.tokenizer.decode([t for t in token_ids if t < transcriber.tokens.eot])


async def _transcript_events(st: ServerState, transcriber: Transcriber, job, request_id: str,
                             ticket: _Ticket) -> AsyncIterator[str]:
    """`transcript.text.delta` events as tokens are decoded, then `transcript.text.done`.

    Streaming decodes without timestamps and without temperature fallback, so every token
    decoded is final and can be sent at once (windows of long audio follow each other)."""
    sent, prompt_tokens, output_tokens, windows = "", 0, 0, 0
    try:
        async for out in st.engine.run_transcription(transcriber, job, request_id):
            ticket.release()
            committed = "".join(s.text for s in job.segments)
            text = (committed + _window_text(transcriber, out.outputs[0].token_ids)).lstrip().rstrip("\ufffd")
            if len(text) > len(sent) and text.startswith(sent):
                yield _sse(P.TranscriptDelta(delta=text[len(sent):]))
                sent = text
            if out.finished:
                windows += 1
                prompt_tokens += len(out.prompt_token_ids)
                output_tokens += len(out.outputs[0].token_ids)
        final = transcriber.result(job).text.strip()
        if len(final) > len(sent) and final.startswith(sent):
            yield _sse(P.TranscriptDelta(delta=final[len(sent):]))
        audio_tokens = windows * st.engine.engine.model.encoder_num_positions(N_FRAMES)
        usage = P.TokenUsage(input_tokens=prompt_tokens + audio_tokens, output_tokens=output_tokens,
                             total_tokens=prompt_tokens + audio_tokens + output_tokens)
        yield _sse(P.TranscriptDone(text=final, usage=usage))
    except Exception as e:  # headers are out: report in-band
        yield _sse_error(e)


def _audio_response(t: Transcription, fmt: str, task: str) -> Response:
    text = t.text.strip()
    usage = P.AudioUsage(seconds=math.ceil(t.duration))
    if fmt == "json":
        return JSONResponse(P.TranscriptionResponse(text=text, usage=usage).model_dump())
    if fmt == "text":
        return PlainTextResponse(text + "\n")
    if fmt in ("srt", "vtt"):
        return PlainTextResponse(render(t, fmt))
    segments = [P.TranscriptionSegment(id=s.id, seek=round(s.start * FRAMES_PER_SECOND), start=s.start, end=s.end,
                                       text=s.text, tokens=s.tokens, temperature=s.temperature,
                                       avg_logprob=s.avg_logprob, compression_ratio=s.compression_ratio,
                                       no_speech_prob=s.no_speech_prob) for s in t.segments]
    verbose = P.TranscriptionVerboseResponse(task=task, language=_language_name(t.language), duration=t.duration,
                                             text=text, segments=segments, usage=usage)
    return JSONResponse(verbose.model_dump())


def _language_name(code: str | None) -> str:
    try:
        from transformers.models.whisper.tokenization_whisper import LANGUAGES
    except ImportError:
        return code or "english"
    return LANGUAGES.get(code or "en", code or "english")


# -- errors -------------------------------------------------------------------
def _describe_errors(errors: list[dict]) -> str:
    parts = []
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            msg = f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
            loc = []
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def _first_param(errors: list[dict]) -> str | None:
    for err in errors:
        if err.get("type") == "json_invalid":
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc:
            return loc[0]
    return None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, _describe_errors(e.errors()), _first_param(e.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 404 and message == "Not Found":
            message = f"no endpoint {request.method} {request.url.path}"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return APIError(e.status_code, message).response(dict(e.headers or {}))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}").response()


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
    state = ServerState(async_engine, limits or ServerLimits(), served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown(timeout=shutdown_timeout)

    app = FastAPI(title="encdec-engine", summary="OpenAI-compatible serving of encoder/decoder models",
                  lifespan=lifespan)
    app.state.server = state
    app.include_router(router)
    _install_error_handlers(app)
    app.add_middleware(_Gate, state=state)
    return app


def run_server(model: str, *, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None,
               served_model_name: str | None = None, shutdown_timeout: float = 30.0, log_level: str = "info",
               **engine_kwargs) -> None:
    """Serve `model` with uvicorn until interrupted (SIGINT/SIGTERM shut down gracefully)."""
    import uvicorn

    limits = limits or ServerLimits()
    if host not in ("127.0.0.1", "localhost", "::1") and limits.api_key is None:
        logger.warning("serving on %s without an API key: anyone who can reach the port can use it", host)
    app = build_app(model, limits=limits, served_model_name=served_model_name, shutdown_timeout=shutdown_timeout,
                    **engine_kwargs)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout)
    uvicorn.Server(config).run()
