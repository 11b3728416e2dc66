"""The async driver: one input's jobs through `AsyncLLMEngine` (the server's transcriptions).

Each job's requests run one after another; the chunks a chunked input fans out into run at once,
as separate engine requests, so other clients' requests share their batches.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Protocol

from encdec_engine.outputs import RequestOutput
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.speech.job import TranscriptionJob
from encdec_engine.speech.transcriber import Transcriber

if TYPE_CHECKING:
    from encdec_engine.engine.async_engine import AsyncLLMEngine


class QueueSlots(Protocol):
    """Slots of a bounded queue of engine requests waiting to start (the server's admission ticket)."""

    def add(self, n: int) -> None: ...

    def release(self, n: int = 1) -> None: ...


async def transcribe_async(engine: AsyncLLMEngine, transcriber: Transcriber, job: TranscriptionJob,
                           request_id: str, slots: QueueSlots | None = None) -> AsyncIterator[RequestOutput]:
    """Run a loaded input's jobs (`transcriber.start(job)` and what follows) through the engine.
    Yields every output of every request as it comes, a request's last one before its job moves
    on (so `job.segments` do not hold that window yet); once the iteration ends,
    `transcriber.result(job)` is the transcript.

    `slots` holds one slot for each job waiting for its first output: the caller holds the input's
    first, and each chunk fanned out adds one. An error in any request, or the caller leaving,
    cancels the other requests, which aborts them in the engine.

    Moving a job on (its chunks planned, a window's words aligned by DTW, the next request built)
    runs in a worker thread, so that one long input never stalls the event loop's other streams."""
    events: asyncio.Queue = asyncio.Queue()  # (job, RequestOutput) | Exception
    tasks: set[asyncio.Task] = set()
    request_ids: dict[TranscriptionJob, Iterator[str]] = {}
    waiting: set[TranscriptionJob] = {job}  # jobs holding a slot: no output yet

    async def forward(owner: TranscriptionJob, prompt: dict, params: SamplingParams, rid: str) -> None:
        try:
            async for out in engine.generate(prompt, params, rid):
                events.put_nowait((owner, out))
        except Exception as e:  # raised by the iteration below, which then cancels the others
            events.put_nowait(e)

    def send(ready: list[TranscriptionJob], parent: TranscriptionJob) -> None:
        """The next request of each ready job; `parent` is the job they follow (itself, or the input
        whose chunks they are)."""
        new = [j for j in ready if j is not parent]
        held = 0
        if parent in waiting and parent not in ready:  # replaced by its chunks before it started:
            waiting.discard(parent)  # its slot is theirs
            held = 1
        waiting.update(new)
        if slots is not None and len(new) > held:
            slots.add(len(new) - held)
        for owner in ready:
            if owner not in request_ids:
                base = request_id if owner is job else f"{request_id}-part{owner.part}"
                # Bound now: a generator expression would read `base` at each later next(), by then another
                # chunk's (two chunks' next windows then shared an id, and the engine refused the second).
                request_ids[owner] = map(f"{base}-{{}}".format, itertools.count())
            task = asyncio.ensure_future(forward(owner, *transcriber.next_request(owner), next(request_ids[owner])))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    try:
        ready = await asyncio.to_thread(transcriber.start, job)
        send(ready, job)
        in_flight = len(ready)
        while in_flight:
            event = await events.get()
            if isinstance(event, Exception):
                raise event
            owner, out = event
            if owner in waiting:
                waiting.discard(owner)
                if slots is not None:
                    slots.release()
            yield out
            if out.finished:  # taken only now: the caller saw the window before the job moved on
                ready = await asyncio.to_thread(transcriber.take, owner, out)  # the job itself, none, or its chunks
                send(ready, owner)
                in_flight += len(ready) - 1
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
