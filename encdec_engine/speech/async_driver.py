"""The async driver: one input's jobs through `AsyncLLMEngine` (the server's transcriptions).

Each job's requests run one after another; the chunks a chunked input fans out into run at once,
as separate engine requests, so other clients' requests share their batches.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from encdec_engine.outputs import RequestOutput
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
    Yields every output of every request as it comes; once the iteration ends,
    `transcriber.result(job)` is the transcript.

    `slots` holds one slot for each job waiting for its first output: the caller holds the input's
    first, and each chunk fanned out adds one. An error in any request, or the caller leaving,
    cancels the other jobs, which aborts their engine requests."""
    events: asyncio.Queue = asyncio.Queue()  # RequestOutput | Exception | (ready jobs, still waiting)
    tasks: list[asyncio.Task] = []

    async def run(job: TranscriptionJob, rid: str) -> None:
        waiting = True  # no output yet: the job's slot is still held
        try:
            for attempt in itertools.count():
                final = None
                async for final in engine.generate(*transcriber.next_request(job), f"{rid}-{attempt}"):
                    if waiting and slots is not None:
                        slots.release()
                    waiting = False
                    events.put_nowait(final)
                ready = transcriber.take(job, final)
                if ready != [job]:  # done, or replaced by its chunks
                    break
            events.put_nowait((ready, waiting))
        except Exception as e:  # raised by the iteration below, which then cancels the others
            events.put_nowait(e)

    def launch(ready: list[TranscriptionJob], parent_waiting: bool) -> int:
        # A job replaced by its chunks hands its slot on to them if it never started.
        more = len(ready) - (1 if parent_waiting else 0)
        if slots is not None and more > 0:
            slots.add(more)
        for next_job in ready:
            rid = request_id if next_job is job else f"{request_id}-part{next_job.part}"
            tasks.append(asyncio.ensure_future(run(next_job, rid)))
        return len(ready)

    active = launch(transcriber.start(job), parent_waiting=True)
    try:
        while active:
            event = await events.get()
            if isinstance(event, RequestOutput):
                yield event
            elif isinstance(event, Exception):
                raise event
            else:  # a job is done, or detected its language and fanned out
                active += launch(*event) - 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
