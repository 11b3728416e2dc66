"""POST /v1/completions for text models (BART, T5, ...: the prompt is the encoder prompt), whole or streamed.
With a target_language, text prompts of a translation model are told the languages its family's way
(translation/conventions.py), and the forced target code is left out of the text."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from encdec_engine.server import protocol as P
from encdec_engine.server import routes
from encdec_engine.server.errors import APIError, engine_error
from encdec_engine.server.limits import check_request_tokens
from encdec_engine.server.state import ServerState, SSEResponse, sse, sse_error, state_of, until_disconnect
from encdec_engine.outputs import CompletionOutput, RequestOutput

router = APIRouter()


@router.post(routes.COMPLETIONS, response_model=P.CompletionResponse)
async def create_completion(body: P.CompletionRequest, request: Request) -> Response:
    st = state_of(request)
    st.require(audio=False, path=routes.COMPLETIONS)
    st.check_model(body.model)
    try:
        params = body.sampling_params()
    except ValueError as e:
        raise APIError(400, str(e)) from None
    prompts, request_id = body.prompt, f"cmpl-{uuid.uuid4().hex}"
    strip = ""  # the forced target code's text, where the detokenizer writes one
    if body.target_language is not None:
        prompts, params, strip = await _translation(st, body, params)
    # A sequence never outgrows the model (a max_tokens past it is refused by the engine, naming the limit).
    model_len = st.engine.engine.max_decoder_len
    check_request_tokens(st.limits, len(prompts), params.best_of, min(params.max_tokens or model_len, model_len),
                         body.logprobs)
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
            first = await until_disconnect(request, next_output())
            events = _completion_stream(st, body, request_id, first, next_output, strip)
            handed_over = True
            return SSEResponse(events, outputs, ticket)

        async def collect() -> list[RequestOutput]:
            finals: list[RequestOutput | None] = [None] * len(prompts)
            while (item := await next_output()) is not None:
                finals[item[0]] = item[1]
            return finals

        finals = await until_disconnect(request, collect())
    except Exception as e:
        await outputs.aclose()
        raise engine_error(e, request_id) from None
    finally:
        if not handed_over:
            ticket.release_all()
    choices = [_choice(st, body, i * body.n + j, _text(c, strip), c.token_ids, c.logprobs, c.finish_reason)
               for i, out in enumerate(finals) for j, c in enumerate(out.outputs)]
    return JSONResponse(P.CompletionResponse(id=request_id, model=st.model_name, choices=choices,
                                             usage=P.usage_of(finals)).model_dump())


async def _translation(st: ServerState, body: P.CompletionRequest, params) -> tuple[list, object, str]:
    """The prompts, sampling parameters and forced code text of a request with a target_language: text
    encoder prompts are encoded the model's way (off the event loop), token prompts are taken as they are."""
    translator = st.translator()
    try:
        request = translator.request(body.source_language, body.target_language)
    except ValueError as e:
        raise APIError(400, str(e), "target_language") from None

    def encode() -> list:
        return [translator.translation_prompt(request, p) for p in body.prompt]

    async with st.preprocess:
        try:
            prompts = await asyncio.to_thread(encode)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
    return prompts, translator.with_target(request, params), translator.target_code_text(request)


def _text(c: CompletionOutput, strip: str) -> str:
    """The completion's text without the forced target code's ("" when the code is a special token)."""
    return c.text[len(strip):].lstrip() if strip and c.text.startswith(strip) else c.text


def _choice(st: ServerState, body: P.CompletionRequest, index: int, text: str, token_ids: list[int],
            logprobs: list[dict[int, float]] | None, finish_reason: str | None, offset: int = 0) -> P.CompletionChoice:
    lp = None
    if body.logprobs is not None and logprobs is not None:
        tok = st.engine.engine.tokenizer
        if tok is None:
            lp = P.completion_logprobs(token_ids, logprobs, str, offset)
        else:
            lp = P.completion_logprobs(token_ids, logprobs, lambda t: tok.decode([t]), offset,
                                       lambda t: tok.decode([t], skip_special_tokens=True))
    return P.CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish_reason)


async def _completion_stream(st: ServerState, body: P.CompletionRequest, request_id: str, first,
                             next_output, strip: str = "") -> AsyncIterator[str]:
    """SSE chunks of text deltas; text that might still turn out to be a stop string is held back."""
    params_stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    hold = max((len(s) for s in params_stop), default=1) - 1
    sent_text: dict[int, str] = defaultdict(str)
    sent_tokens: dict[int, int] = defaultdict(int)
    done: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    latest: dict[int, RequestOutput] = {}  # per prompt, for continuous usage stats
    options = body.stream_options
    continuous = options is not None and options.continuous_usage_stats
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
                text = _text(c, strip)
                text = text if c.finish_reason else text[: max(0, len(text) - hold)]
                prev = sent_text[key]
                delta = text[len(prev):] if len(text) > len(prev) and text.startswith(prev) else ""
                if not delta and c.finish_reason is None:
                    continue
                new = slice(sent_tokens[key], len(c.token_ids))
                choices.append(_choice(st, body, key, delta, c.token_ids[new], c.logprobs[new] if c.logprobs else None,
                                       c.finish_reason, len(prev)))
                sent_text[key], sent_tokens[key] = prev + delta, len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(key)
            latest[i] = out
            if choices:
                usage = P.usage_of(list(latest.values())) if continuous else None
                yield sse(P.CompletionResponse(id=request_id, created=created, model=st.model_name, choices=choices,
                                               usage=usage))
            if out.finished:
                finals[i] = out
            item = await next_output()
        if options is not None and options.include_usage:
            yield sse(P.CompletionResponse(id=request_id, created=created, model=st.model_name, choices=[],
                                           usage=P.usage_of(list(finals.values()))))
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are out: report in-band, as OpenAI does
        yield sse_error(e, request_id)
