"""The synchronous driver of a live transcription: one stream of audio chunks through `LLMEngine.step`
(`LLM.transcribe_live`, `encdec transcribe --live`).

The chunks are read in a thread of their own, so a source that blocks until audio arrives (a
microphone, a pipe) never stalls a decode, and the engine steps while the next chunk is awaited:

    reader thread:  chunks -> 16 kHz float32 -> inbox
    this generator: inbox -> LiveSession.append -> events
                    LiveSession.next_request -> engine.add_request ... engine.step() -> take -> events

A partial decode whose turn ends meanwhile is aborted (the final decode goes instead). Closing the
generator early (or an exception inside it) aborts the request in flight: its KV blocks are free again.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from encdec_engine.inputs.audio import SAMPLE_RATE
from encdec_engine.inputs.pcm_stream import AudioChunks
from encdec_engine.speech.live.events import LiveEvent
from encdec_engine.speech.live.session import LiveSession
from encdec_engine.speech.live.turn import LiveRequest

if TYPE_CHECKING:
    from encdec_engine.engine.llm_engine import LLMEngine

_END = object()  # the source has no more chunks
_ids = itertools.count()


def stream_live(engine: LLMEngine, session: LiveSession, chunks: Iterable,
                convert: AudioChunks | None = None) -> Iterator[LiveEvent]:
    """Transcribe a stream of mono audio chunks (PCM16 bytes, or arrays: int16, or float in [-1, 1]; at
    16 kHz unless `convert` resamples them), yielding the session's events as they happen. When the
    chunks run out, the open turn ends there and the generator returns once every turn has its final text."""
    convert = convert or AudioChunks(SAMPLE_RATE)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    reader = threading.Thread(target=_read, args=(chunks, convert, inbox, stop), name="encdec-live-audio",
                              daemon=True)
    reader.start()
    rid: str | None = None
    request: LiveRequest | None = None
    ended = False
    try:
        while True:
            if rid is None:
                request = session.next_request()
                if request is not None:
                    rid = f"live-{next(_ids)}"
                    engine.add_request(rid, request.prompt, request.params)
                elif ended:
                    return
            for item in _drain(inbox, wait=rid is None):
                if item is _END:
                    ended = True
                    yield from session.finish()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield from session.append(item)
            if rid is not None and session.superseded(request):
                engine.abort_request(rid)
                session.drop(request)
                rid = None
                continue
            if rid is not None:
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        rid = None
                        yield from session.take_output(request, out)
    finally:
        stop.set()
        if rid is not None:
            engine.abort_request(rid)


def _read(chunks: Iterable, convert: AudioChunks, inbox: queue.SimpleQueue, stop: threading.Event) -> None:
    try:
        for chunk in chunks:
            if stop.is_set():
                return
            inbox.put(convert(chunk))
    except BaseException as e:  # handed to the generator, which raises it in the caller's thread
        inbox.put(e)
        return
    inbox.put(_END)


def _drain(inbox: queue.SimpleQueue, wait: bool) -> list:
    """Everything in the inbox now; with `wait`, at least one item (blocking until it comes)."""
    items = [inbox.get()] if wait else []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items
