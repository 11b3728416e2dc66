"""POST /v1/audio/transcriptions and /v1/audio/translations for Whisper: the multipart upload, decoding
it off the event loop, running the transcription, and answering in the requested format or as a stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from encdec_engine.server import protocol as P
from encdec_engine.server import routes
from encdec_engine.server.errors import APIError, engine_error
from encdec_engine.server.limits import Reservation, Ticket
from encdec_engine.server.state import ServerState, SSEResponse, sse, sse_error, state_of, until_disconnect
from encdec_engine.server.uploads import UploadedAudio, job_bytes
from encdec_engine.speech.writers import render
from encdec_engine.inputs.audio import N_FRAMES, SAMPLE_RATE
from encdec_engine.speech.async_driver import transcribe_async
from encdec_engine.speech.options import TranscribeOptions, fallback_temperatures
from encdec_engine.speech.results import Transcription
from encdec_engine.speech.transcriber import Transcriber

router = APIRouter()


@router.post(routes.TRANSCRIPTIONS)
async def create_transcription(request: Request) -> Response:
    return await _audio_request(request, "transcribe")


@router.post(routes.TRANSLATIONS)
async def create_translation(request: Request) -> Response:
    return await _audio_request(request, "translate")


async def _audio_request(request: Request, task: str) -> Response:
    st = state_of(request)
    st.require(audio=True, path=request.url.path)
    # The gate reserves the upload's audio memory as its bytes arrive (a slow client holds only what it
    # sent, and only as long as it keeps the minimum rate) and releases it when the request is over;
    # the queue slot is taken once the body is in.
    reservation: Reservation = request.state.audio_reservation
    upload, fields = await _read_form(request)
    ticket = st.admission.acquire(1)
    handed_over = False
    try:
        schema = P.TranscriptionRequest if task == "transcribe" else P.TranslationRequest
        try:
            req = schema.model_validate(fields)
        except ValidationError as e:
            raise APIError(400, *P.describe_validation_errors(e.errors())) from None
        st.check_model(req.model)
        stream = getattr(req, "stream", False)
        chunking = getattr(req, "chunking_strategy", None)  # "auto": quiet-point chunks; server_vad: Silero VAD
        vad = chunking if isinstance(chunking, P.ServerVadChunking) else None
        # A stream decodes exactly as the non-streamed answer does (timestamps, fallback, silence skipping)
        # and sends each window's text once the window is final: nothing sent is ever taken back.
        try:  # an unknown language is refused by TranscribeOptions, one this checkpoint lacks by the Transcriber
            options = TranscribeOptions(language=getattr(req, "language", None), task=task,
                                        timestamps=not (st.limits.without_timestamps and _untimed(req)),
                                        initial_prompt=req.prompt, temperatures=fallback_temperatures(req.temperature),
                                        word_timestamps=getattr(req, "words", False), chunked=chunking is not None,
                                        vad_filter=vad is not None, vad_parameters=vad and vad.vad_parameters,
                                        **req.decoding_options())
        except ValueError as e:
            raise APIError(400, str(e), "language" if "language" in str(e) else None) from None
        # Tokenizing the prompt (up to the field's cap) is CPU work: off the event loop.
        transcriber = await asyncio.to_thread(_transcriber, st.engine.engine, options, task)
        data = await upload.read()
        reservation.resize(len(data))
        job = await _load_job(st, transcriber, UploadedAudio(data, upload.filename or "upload",
                                                             st.limits.max_audio_seconds), reservation)
        del data
        request_id = st.engine.new_request_id("transcribe")
        if stream:
            handed_over = True
            return SSEResponse(_transcript_events(st, transcriber, job, request_id, ticket), None, ticket,
                               reservation)

        async def run() -> Transcription:
            async for _ in transcribe_async(st.engine, transcriber, job, request_id, ticket):
                pass
            return transcriber.result(job)

        result = await until_disconnect(request, run())
    except HTTPException:  # the form parser's own 400s
        raise
    except ClientDisconnect:  # gone while sending the body
        raise APIError(499, "client closed the request") from None
    except Exception as e:
        raise engine_error(e) from None
    finally:
        if not handed_over:
            ticket.release_all()
    return _audio_response(result, req.response_format, task, getattr(req, "timestamp_granularities", []))


def _untimed(req: P.TranslationRequest) -> bool:
    """Whether the answer carries no times: json or text (or a stream of text), no timestamp granularities."""
    return req.response_format in ("json", "text") and not getattr(req, "timestamp_granularities", [])


def _transcriber(engine, options: TranscribeOptions, task: str) -> Transcriber:
    try:
        transcriber = Transcriber(engine, options)
        start = transcriber.tokens.decoder_prompt(options.language, task)  # language and task on this checkpoint
    except ValueError as e:
        message = str(e)
        param = "language" if "language" in message else "model" if "cannot translate" in message else "prompt"
        raise APIError(400, message, param) from None
    check_window_tokens(options.max_new_tokens, len(start), engine.max_decoder_len)
    return transcriber


def check_window_tokens(max_new_tokens: int | None, prompt_len: int, limit: int) -> None:
    """The completions rule for the audio endpoints: tokens asked for past the model's positions are a 400
    (a window whose prompt carries earlier text gets what is left, as in openai-whisper)."""
    if max_new_tokens is not None and max_new_tokens + prompt_len > limit:
        raise APIError(400, f"max_completion_tokens {max_new_tokens} plus the window's {prompt_len}-token decoder "
                            f"prompt is more than the model's limit of {limit} positions; ask for at most "
                            f"{limit - prompt_len}", "max_completion_tokens")


async def _load_job(st: ServerState, transcriber: Transcriber, upload: UploadedAudio, reservation: Reservation):
    """Probe, decode and featurize an upload in a worker (at most `preprocess_workers` at once), with
    the reservation grown to the decode's peak first and then shrunk to what the job holds."""
    n_mels = st.engine.engine.model.num_mel_bins
    async with st.preprocess:
        with upload:
            probe = await asyncio.to_thread(upload.probe)
            reservation.resize(upload.decode_peak_bytes(probe, n_mels))
            samples = await asyncio.to_thread(upload.decode)
        job = await asyncio.to_thread(transcriber.load, 0, (samples, SAMPLE_RATE))
    if job.error is not None:
        raise APIError(400, f"cannot use the uploaded audio: {job.error}", "file")
    reservation.resize(job_bytes(job))
    return job


async def _read_form(request: Request) -> tuple[UploadFile, dict[str, Any]]:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, f"expected a multipart/form-data body with a 'file' part, got content type "
                            f"{content_type or 'none'!r}")
    form = await request.form(max_files=1, max_fields=32)
    upload, fields = None, {}
    for key, value in form.multi_items():
        name = key.removesuffix("[]")
        if not name:
            raise APIError(400, "a form part has no name (its Content-Disposition needs name=\"...\")")
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
    if upload is None:  # none, or one cut off before the body's closing boundary (which drops it)
        raise APIError(400, "missing 'file': send the audio as a multipart/form-data part named 'file' (a body "
                            "cut off before its closing boundary loses its last part)", "file")
    return upload, fields


async def _transcript_events(st: ServerState, transcriber: Transcriber, job, request_id: str,
                             ticket: Ticket) -> AsyncIterator[str]:
    """`transcript.text.delta` events, one per window once it is final, then `transcript.text.done`.

    Each window is decoded as in the non-streamed answer, temperature fallback and silence skipping
    included; its text is sent when the window is committed (a retried window sends nothing until
    its last decode), so the streamed text equals the non-streamed one."""
    sent, prompt_tokens, output_tokens, windows = "", 0, 0, 0
    try:
        async for out in transcribe_async(st.engine, transcriber, job, request_id, ticket):
            # The windows committed so far (a request's last output comes before its job takes it).
            committed = "".join(s.text for s in job.segments).strip()
            if len(committed) > len(sent) and committed.startswith(sent):
                yield sse(P.TranscriptDelta(delta=committed[len(sent):]))
                sent = committed
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
