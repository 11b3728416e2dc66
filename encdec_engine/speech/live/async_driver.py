"""The asyncio driver of a live transcription: one session over `AsyncLLMEngine` (the server's realtime
sessions). Every session's decodes are ordinary engine requests, so the sessions' re-decodes share the
engine's continuous batches; each session has at most one request in flight, and a slower engine only
makes each decode cover more new audio (latency grows; nothing is dropped or reordered).

    caller (the websocket loop)            run() (a task per session)
    append / commit / clear  --events-->   next_request -> engine.generate -> take -> emit(events)
          \\__ a partial decode made useless (its turn ended, or was cleared) is cancelled: aborted
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import weakref
from collections.abc import Callable

import numpy as np

from encdec_engine.engine.async_engine import AsyncLLMEngine, EngineStepError, RequestFailedError
from encdec_engine.outputs import RequestOutput
from encdec_engine.speech.live.events import LiveEvent
from encdec_engine.speech.live.session import LiveSession
from encdec_engine.speech.live.turn import LiveRequest
from encdec_engine.speech.live.vad import SileroStream, push_streams

logger = logging.getLogger(__name__)

_ids = itertools.count()
_ARRIVALS = 4096  # appends remembered for the lag (about 7 minutes of 100 ms chunks)


class LiveStream:
    """A LiveSession driven through an AsyncLLMEngine. `emit` gets the events of each finished decode;
    `on_decoded(lag_seconds)` the wall time from the arrival of a decoded window's last audio to its
    result (the lag the metrics show); `vad`: the voice detection shared with other streams (None: the
    session's own). Call `run()` as a task; cancelling it aborts the request in flight; `close()` at the end."""

    def __init__(self, engine: AsyncLLMEngine, session: LiveSession, emit: Callable[[list[LiveEvent]], None],
                 on_decoded: Callable[[float], None] | None = None, name: str = "live",
                 vad: VadBatch | None = None) -> None:
        self.engine, self.session, self.emit, self.on_decoded, self.vad = engine, session, emit, on_decoded, vad
        self.name = f"{name}-{next(_ids)}"
        self._requests = itertools.count()
        self._wake = asyncio.Event()
        self._decode: asyncio.Task | None = None
        self._request: LiveRequest | None = None
        # (samples so far, when) of the latest appends (bounded: a long silence makes no request to pop them)
        self._arrivals: collections.deque[tuple[int, float]] = collections.deque(maxlen=_ARRIVALS)

    # -- what the caller does ----------------------------------------------------------------
    async def append(self, samples: np.ndarray) -> list[LiveEvent]:
        detector = self.session.detector
        probs = None
        if detector is not None and self.vad is not None:
            probs = await self.vad.push(detector.vad, samples)  # meanwhile this caller sends nothing else
        events = self.session.append(samples, probs)
        self._arrivals.append((self.session.received, time.monotonic()))
        self._changed()
        return events

    def commit(self) -> list[LiveEvent]:
        events = self.session.commit()
        self._changed()
        return events

    def clear(self) -> list[LiveEvent]:
        events = self.session.clear()
        self._changed()
        return events

    def finish(self) -> list[LiveEvent]:
        """The stream ends: its open turn ends where the audio does (`LiveSession.finish`)."""
        events = self.session.finish()
        self._changed()
        return events

    def close(self) -> None:
        """The stream is over: its voice detection stops counting among the shared calls' streams."""
        if self.vad is not None and self.session.detector is not None:
            self.vad.leave(self.session.detector.vad)

    def _changed(self) -> None:
        """Wake the loop; cancel a decode that is no use any more (the final decode goes next)."""
        request, decode = self._request, self._decode
        if request is not None and decode is not None and self.session.superseded(request):
            decode.cancel()
        self._wake.set()

    # -- the decode loop ---------------------------------------------------------------------
    async def run(self) -> None:
        """Send each due request and emit what it confirms, until cancelled. An engine that stops raises."""
        while True:
            self._wake.clear()
            request = self.session.next_request()
            if request is None:
                await self._wake.wait()
                continue
            decode = asyncio.ensure_future(self._generate(request))
            self._request, self._decode = request, decode
            try:
                await asyncio.wait({decode})
            finally:
                self._request = self._decode = None
                if not decode.done():  # this loop was cancelled: so is the request (the engine aborts it)
                    decode.cancel()
                    await asyncio.gather(decode, return_exceptions=True)
                    self.session.drop(request)
            if decode.cancelled():
                self.session.drop(request)
                continue
            error = decode.exception()
            if error is not None:
                if not _is_request_failure(error):
                    self.session.drop(request)
                    raise error
                self.emit(self.session.fail(request, str(error)))
                continue
            self._lag(request)
            self.emit(self.session.take_output(request, decode.result()))

    async def _generate(self, request: LiveRequest) -> RequestOutput:
        last = None
        async for out in self.engine.generate(request.prompt, request.params, f"{self.name}-{next(self._requests)}"):
            last = out
        return last

    def _lag(self, request: LiveRequest) -> None:
        while self._arrivals and self._arrivals[0][0] < request.audio_end:
            self._arrivals.popleft()
        if self._arrivals and self.on_decoded is not None:
            self.on_decoded(time.monotonic() - self._arrivals[0][1])


class VadBatch:
    """Voice detection of the live streams on one event loop, in shared calls of the network. A call costs
    about as much for one 32 ms frame as for thirty (one thread, 2-core AMD EPYC Zen 3: the network's front
    0.4 ms for one frame, 1.3 ms for 24), and 100 ms appends complete about three frames each; so an append
    waits until every stream that pushes here has one waiting, or `max_wait` seconds, whichever comes
    first, and then they all go through one call (`push_streams`). With one stream nothing waits. Should a
    shared call fail, each append is tried alone: a failure is its own stream's."""

    def __init__(self, max_wait: float = 0.05) -> None:
        self.max_wait = max_wait
        self.streams: weakref.WeakSet[SileroStream] = weakref.WeakSet()  # those that push here (not `leave`d)
        self._waiting: list[tuple[SileroStream, np.ndarray, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self.calls = self.appends = 0  # network calls made, and the appends they took

    async def push(self, stream: SileroStream, samples: np.ndarray) -> np.ndarray:
        """`stream.push(samples)`, in a call shared with other streams' appends. A stream's next append waits
        for this one (its frames follow these)."""
        loop = asyncio.get_running_loop()
        self.streams.add(stream)
        future = loop.create_future()
        self._waiting.append((stream, samples, future))
        if len(self._waiting) >= len(self.streams):
            self._run()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait, self._run)
        return await future

    def leave(self, stream: SileroStream) -> None:
        """`stream` pushes no more: the others stop waiting for it."""
        self.streams.discard(stream)
        if self._waiting and len(self._waiting) >= len(self.streams):
            self._run()

    def _run(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting = [w for w in self._waiting if not w[2].done()]  # an append cancelled meanwhile is not read
        self._waiting = []
        if waiting:
            self._call(waiting)

    def _call(self, waiting: list[tuple[SileroStream, np.ndarray, asyncio.Future]]) -> None:
        try:
            probs = push_streams([(stream, samples) for stream, samples, _ in waiting])
        except Exception as e:
            if len(waiting) == 1:
                waiting[0][2].set_exception(e)
                return
            logger.exception("voice detection of %d live streams in one call failed; each is tried alone", len(waiting))
            for one in waiting:
                self._call([one])
            return
        self.calls += 1
        self.appends += len(waiting)
        for (_, _, future), p in zip(waiting, probs):
            future.set_result(p)


def _is_request_failure(error: BaseException) -> bool:
    """A failure of this request alone, after which the engine goes on: a request the engine refused, one
    that failed while it ran, or one aborted by a failed step."""
    return isinstance(error, (RequestFailedError, EngineStepError, ValueError))
