"""POST /v1/audio/transcriptions and /v1/audio/translations for Whisper: the multipart upload, decoding
it off the event loop, running the transcription, and answering in the requested format or as a stream."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from encdec_engine.entrypoints import protocol as P
from encdec_engine.entrypoints.server_errors import APIError, engine_error
from encdec_engine.entrypoints.server_gate import Ticket
from encdec_engine.entrypoints.server_state import ServerState, SSEResponse, sse, sse_error, state_of, until_disconnect
from encdec_engine.entrypoints.writers import render
from encdec_engine.speech.audio import AUDIO_EXTENSIONS, N_FRAMES, SAMPLE_RATE, AudioError, load_audio, load_audio_bytes
from encdec_engine.speech.async_driver import transcribe_async
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Transcription
from encdec_engine.speech.transcriber import Transcriber

# Containers libsndfile cannot read from memory; decoded through a temporary file and ffmpeg.
_FFMPEG_ONLY = AUDIO_EXTENSIONS - {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au"}

router = APIRouter()


@router.post("/v1/audio/transcriptions")
async def create_transcription(request: Request) -> Response:
    return await _audio_request(request, "transcribe")


@router.post("/v1/audio/translations")
async def create_translation(request: Request) -> Response:
    return await _audio_request(request, "translate")


async def _audio_request(request: Request, task: str) -> Response:
    st = state_of(request)
    st.require(audio=True, path=request.url.path)
    upload, fields = await _read_form(request)
    schema = P.TranscriptionRequest if task == "transcribe" else P.TranslationRequest
    try:
        req = schema.model_validate(fields)
    except ValidationError as e:
        raise APIError(400, *P.describe_validation_errors(e.errors())) from None
    st.check_model(req.model)
    data = await upload.read()
    if len(data) > st.limits.max_body_bytes:
        raise APIError(413, f"upload is larger than this server's limit of {st.limits.max_upload_mb:g} MB", "file")
    stream = getattr(req, "stream", False)
    temperatures = (req.temperature,) if stream else _fallback_temperatures(req.temperature)
    chunking = getattr(req, "chunking_strategy", None)
    vad = chunking if isinstance(chunking, P.ServerVadChunking) else None
    # A stream sends tokens as they are decoded, so nothing it sent may be retried or skipped after.
    options = TranscribeOptions(language=getattr(req, "language", None), task=task, initial_prompt=req.prompt,
                                timestamps=not stream, temperatures=temperatures,
                                word_timestamps=getattr(req, "words", False), chunked=chunking is not None,
                                vad_filter=vad is not None, vad_parameters=vad and vad.vad_parameters,
                                no_speech_threshold=None if stream else TranscribeOptions.no_speech_threshold)
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
            return SSEResponse(_transcript_events(st, transcriber, job, request_id, ticket), None, ticket)

        async def run() -> Transcription:
            async for _ in transcribe_async(st.engine, transcriber, job, request_id, ticket):
                pass
            return transcriber.result(job)

        result = await until_disconnect(request, run())
    except Exception as e:
        raise engine_error(e) from None
    finally:
        if not handed_over:
            ticket.release_all()
    return _audio_response(result, req.response_format, task, getattr(req, "timestamp_granularities", []))


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
            raise APIError(400, f"field {name!r} must be text, got a file (the audio goes in the 'file' field)", name)
        elif name == "timestamp_granularities":
            fields.setdefault(name, []).append(value)
        elif name.startswith("chunking_strategy[") and name.endswith("]"):  # OpenAI's client: one part a field
            inner = fields.setdefault("chunking_strategy", {})
            if not isinstance(inner, dict) or name[18:-1] in inner:
                raise APIError(400, f"field {name!r} is given more than once", "chunking_strategy")
            inner[name[18:-1]] = value
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


async def _transcript_events(st: ServerState, transcriber: Transcriber, job, request_id: str,
                             ticket: Ticket) -> AsyncIterator[str]:
    """`transcript.text.delta` events as tokens are decoded, then `transcript.text.done`.

    Streaming decodes without timestamps, temperature fallback or silence skipping, so every
    token decoded is final and can be sent at once (windows of long audio follow each other)."""
    sent, prompt_tokens, output_tokens, windows = "", 0, 0, 0
    try:
        async for out in transcribe_async(st.engine, transcriber, job, request_id, ticket):
            committed = "".join(s.text for s in job.segments)
            text = (committed + transcriber.assembler.text(out.outputs[0].token_ids)).lstrip().rstrip("\ufffd")
            if len(text) > len(sent) and text.startswith(sent):
                yield sse(P.TranscriptDelta(delta=text[len(sent):]))
                sent = text
            if out.finished:
                windows += 1
                prompt_tokens += len(out.prompt_token_ids)
                output_tokens += len(out.outputs[0].token_ids)
        final = transcriber.result(job).text.strip()
        if len(final) > len(sent) and final.startswith(sent):
            yield sse(P.TranscriptDelta(delta=final[len(sent):]))
        audio_tokens = windows * st.engine.engine.model.encoder_num_positions(N_FRAMES)
        usage = P.TokenUsage(input_tokens=prompt_tokens + audio_tokens, output_tokens=output_tokens,
                             total_tokens=prompt_tokens + audio_tokens + output_tokens)
        yield sse(P.TranscriptDone(text=final, usage=usage))
    except Exception as e:  # headers are out: report in-band
        yield sse_error(e)


def _audio_response(t: Transcription, fmt: str, task: str, granularities: list[str]) -> Response:
    if fmt == "json":
        return JSONResponse(P.TranscriptionResponse(text=t.text.strip(), usage=P.audio_usage(t)).model_dump())
    if fmt == "text":
        return PlainTextResponse(t.text.strip() + "\n")
    if fmt in ("srt", "vtt"):
        return PlainTextResponse(render(t, fmt))
    return JSONResponse(P.verbose_transcription(t, task, granularities).model_dump(exclude_none=True))
