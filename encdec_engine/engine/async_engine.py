"""AsyncLLMEngine: the blocking LLMEngine stepped by one background thread, outputs streamed to coroutines.

    event loop (many coroutines)                 engine thread (the only one touching LLMEngine)
    ----------------------------                 ----------------------------------------------
    generate() --add / abort / call--> commands --> between steps: add_request, abort_request, fn(engine)
        ^                                            step() -> RequestOutputs
        +---- newest output per request <---------- loop.call_soon_threadsafe(deliver)

Requests are prepared (tokenized, audio features computed, bad words resolved,
sampler state built) in a small worker pool before they reach the engine
thread, so neither the event loop nor the other requests' steps wait on that
work. Outputs are cumulative (all text and tokens so far), so a slow consumer
simply sees the newest one. A consumer that stops listening (client gone, task
cancelled) aborts its requests: the engine thread frees their self and cross
blocks before its next step. A request that fails while it runs (finish_reason
"error": its result could not be applied, or the forward running it raised)
raises `RequestFailedError` to its caller alone. Should `LLMEngine.step` itself
raise (a bug outside any one request), the callers in flight get
`EngineStepError`; the engine goes on when aborting them left it consistent
(every block free), and is declared dead (`EngineDeadError`) otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from encdec_engine.engine.llm_engine import LLMEngine, ProcessedRequest
from encdec_engine.inputs.prompts import PromptType
from encdec_engine.machine.threads import own_threads, single_threaded
from encdec_engine.outputs import RequestOutput
from encdec_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

_SNAPSHOT_INTERVAL = 0.1  # s between metric snapshots while stepping (always one when going idle)
_RATE_WINDOW = 10.0  # s over which tokens per second are measured


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a failed step left it unusable)."""


class EngineStepError(RuntimeError):
    """A step raised; the requests in flight were aborted and their callers get this error."""


class RequestFailedError(RuntimeError):
    """The request ended with finish_reason "error" (the engine went on with the others)."""

    def __init__(self, output: RequestOutput) -> None:
        super().__init__(f"request {output.request_id} failed: {output.error}")
        self.output = output


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state for metrics, taken by the engine thread between steps."""

    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    self_blocks: int = 0  # decoder self-attention KV blocks in use (device and swap)
    cross_blocks: int = 0  # cross-attention KV blocks in use (device and swap)
    free_blocks: int = 0  # device pool
    total_blocks: int = 0
    free_swap_blocks: int = 0
    total_swap_blocks: int = 0
    generated_tokens: int = 0
    num_step_errors: int = 0
    num_aborted: int = 0  # requests aborted before they finished (client gone, shutdown, failed step)
    step_seconds: float = 0.0  # wall time the engine thread has spent in steps (the rest it waited for work)
    cache_stats: tuple[tuple[str, int], ...] = ()  # the block manager's prefix-cache counters


class _Mailbox:
    """Where the engine thread leaves the newest outputs of one caller's requests (read on the loop)."""

    __slots__ = ("pending", "error", "event")

    def __init__(self) -> None:
        self.pending: dict[str, RequestOutput] = {}
        self.error: BaseException | None = None
        self.event = asyncio.Event()


class AsyncLLMEngine:
    """Runs an `LLMEngine` in a background thread and streams each request's outputs.

    >>> engine = AsyncLLMEngine(LLMEngine(EngineConfig(model="path/to/bart")))
    >>> async for out in engine.generate("A long document ...", SamplingParams(max_tokens=32), "req-1"):
    ...     print(out.outputs[0].text)
    """

    def __init__(self, engine: LLMEngine, input_workers: int = 2) -> None:
        self.engine = engine
        # Prepares requests (LLMEngine.process_request) off the event loop and the engine thread, each worker's
        # torch ops (log-mels) on one thread: the workers run beside the engine's steps, which hold the cores.
        self._inputs = concurrent.futures.ThreadPoolExecutor(input_workers, thread_name_prefix="encdec-inputs",
                                                             initializer=single_threaded)
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._mailboxes: dict[str, _Mailbox] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: str | None = None  # why the engine stopped
        self._closing = False
        # Commands are queued under this lock, and the exiting thread sets _exiting under it before
        # answering what is left: so nothing is queued that no one will ever answer.
        self._lock = threading.Lock()
        self._exiting = False
        self._active: set[str] = set()  # request ids with a live caller (event loop side)
        self._ids = itertools.count()
        self._num_step_errors = 0
        self._step_seconds = 0.0
        self._num_aborted = 0
        self._last_snapshot = 0.0
        self._started_at = time.monotonic()
        self._token_samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=1024)
        self.snapshot = EngineSnapshot()
        self._publish()

    # -- lifecycle -----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running loop). The engine
        thread's torch ops run at full speed only where no other thread holds an OpenMP team: call
        `machine.threads.beside_engine_thread()` in the threads that run beside it (the server does)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="encdec-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def num_aborted(self) -> int:
        """Requests aborted before they finished (client gone, shutdown, failed step)."""
        return self._num_aborted

    @property
    def num_in_flight(self) -> int:
        """Requests whose caller is still listening."""
        return len(self._active)

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Refuse new requests, let those in flight finish for up to `timeout` s, abort the rest
        (their callers get EngineDeadError) and stop the thread."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join, 30.0)
        self._inputs.shutdown(wait=False, cancel_futures=True)

    # -- requests ------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, prompt: PromptType, params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request until it finishes. A bad request raises ValueError here,
        and only here; leaving the loop early (or being cancelled) aborts the request."""
        async for _, out in self.generate_batch([prompt], [params or SamplingParams()], [request_id]):
            yield out

    async def generate_batch(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams],
                             request_ids: Sequence[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Stream `(index, output)` for several requests added at once: either all are added or,
        if one is bad, none is and ValueError names its index. A request that fails while it runs
        raises RequestFailedError (the others of the batch are then aborted)."""
        if not (len(prompts) == len(params) == len(request_ids)) or not prompts:
            raise ValueError("generate_batch needs as many prompts, params and request ids, at least one")
        self._check_accepting()
        if self._thread is None:
            self.start()
        processed = await asyncio.wrap_future(self._inputs.submit(self._process, prompts, params))
        self._check_accepting()
        box = _Mailbox()
        index = {rid: i for i, rid in enumerate(request_ids)}
        self._submit(("add", list(zip(request_ids, processed)), box))
        unfinished = set(request_ids)
        self._active.update(request_ids)
        try:
            while unfinished:
                await box.event.wait()
                box.event.clear()
                if box.error is not None:
                    unfinished.clear()  # the engine thread has already dropped them
                    raise box.error
                pending, box.pending = box.pending, {}
                for rid, out in pending.items():
                    if out.finished:
                        unfinished.discard(rid)
                        if out.error is not None:
                            raise RequestFailedError(out)
                    yield index[rid], out
        finally:
            self._active.difference_update(request_ids)
            if unfinished:
                self._commands.put(("abort", list(unfinished)))

    def _process(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams]) -> list[ProcessedRequest]:
        """In the input workers: validate and prepare every request of a batch, naming a bad one's index."""
        processed = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                processed.append(self.engine.process_request(prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
        return processed

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread between steps (from any thread); the future holds its result."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            self._submit(("call", fn, future))
        except EngineDeadError as e:
            future.set_exception(e)
        return future

    def _submit(self, command: tuple) -> None:
        with self._lock:
            if self._thread is None or self._exiting:
                raise EngineDeadError(self._dead or "the engine thread is not running")
            self._commands.put(command)

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def tokens_per_second(self, window: float = _RATE_WINDOW) -> float:
        """Generated tokens per second over the last `window` seconds."""
        samples = list(self._token_samples)
        now = time.monotonic()
        recent = [s for s in samples if now - s[0] <= window]
        if not recent:
            return 0.0
        older = [s for s in samples if now - s[0] > window]
        base = older[-1][1] if older else recent[0][1]
        return (recent[-1][1] - base) / max(1e-3, min(window, now - self._started_at))

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closing:
            raise EngineDeadError("the engine is shutting down")

    # -- the engine thread ---------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        if engine.device.type == "cpu":  # its count, not the one a thread beside it (the event loop) set last
            own_threads(engine.threads)
        try:
            while self._dead is None:
                idle = not engine.has_unfinished_requests()
                if idle:
                    self._publish()
                self._run_commands(block=idle)
                if self._dead is None and engine.has_unfinished_requests():
                    self._step()
        except BaseException:  # a bug in this loop: fail everyone rather than hang them
            logger.exception("engine thread crashed")
            self._dead = "the engine thread crashed (the log has the traceback)"
            self._fail_all(lambda: EngineDeadError(self._dead))
        finally:
            self._refuse_pending()
            self._publish()

    def _refuse_pending(self) -> None:
        """Answer whatever is still queued once the thread is about to exit."""
        with self._lock:
            self._exiting = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._post([(command[2], EngineDeadError(self._dead or "the engine stopped"))])
            elif command[0] == "call":
                command[2].set_exception(EngineDeadError(self._dead or "the engine stopped"))

    def _run_commands(self, block: bool) -> None:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "call":
                self._call(*command[1:])
            elif kind == "stop":
                self._fail_all(lambda: EngineDeadError("the engine was shut down; request aborted"))
                self._dead = "the engine was shut down"

    def _add(self, items: list[tuple[str, ProcessedRequest]], box: _Mailbox) -> None:
        if self._dead is not None:
            return self._post([(box, EngineDeadError(self._dead))])
        added: list[str] = []
        try:
            for i, (rid, request) in enumerate(items):
                try:
                    self.engine.add_processed(rid, request)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}" if len(items) > 1 else str(e)) from None
                added.append(rid)
        except Exception as e:  # ValueError: bad input; anything else: a bug, still this caller's alone
            for rid in added:
                self.engine.abort_request(rid)
            return self._post([(box, e)])
        for rid in added:
            self._mailboxes[rid] = box

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._mailboxes.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                self._num_aborted += 1

    def _call(self, fn: Callable, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(self.engine))
        except BaseException as e:
            future.set_exception(e)

    def _step(self) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; aborting the requests in flight")
            self._num_step_errors += 1
            message = f"engine step failed ({e!r}); the request was aborted"
            self._fail_all(lambda: EngineStepError(message))
            free, total = self.engine.num_free_blocks(), self.engine.num_total_blocks()
            if self.engine.has_unfinished_requests() or free != total:
                self._dead = "engine state inconsistent after a failed step (the log has the traceback)"
            return
        finally:
            self._step_seconds += time.monotonic() - start
        batch = []
        for out in outputs:
            box = self._mailboxes.get(out.request_id)
            if box is None:
                continue
            if out.finished:
                del self._mailboxes[out.request_id]
            batch.append((box, out))
        self._post(batch)
        if time.monotonic() - self._last_snapshot >= _SNAPSHOT_INTERVAL:
            self._publish()

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """Abort every request with a caller and hand each caller its own error."""
        boxes: dict[int, _Mailbox] = {}
        for rid, box in list(self._mailboxes.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("aborting %s failed", rid)
            self._num_aborted += 1
            boxes[id(box)] = box
        self._mailboxes.clear()
        self._post([(box, make_error()) for box in boxes.values()])

    def _post(self, batch: list[tuple[_Mailbox, RequestOutput | BaseException]]) -> None:
        if batch and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _publish(self) -> None:
        engine = self.engine
        scheduler, bm = engine.scheduler, engine.block_manager
        (free, free_swap), (total, total_swap) = engine.num_free_blocks(), engine.num_total_blocks()
        cross = len({b for table in bm.cross_block_tables.values() for b in table})  # shared when cached
        used = (total - free) + (total_swap - free_swap)
        generated = engine.stats.get("generated_tokens", 0)
        now = time.monotonic()
        self.snapshot = EngineSnapshot(
            num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
            num_swapped=len(scheduler.swapped), self_blocks=used - cross, cross_blocks=cross,
            free_blocks=free, total_blocks=total, free_swap_blocks=free_swap, total_swap_blocks=total_swap,
            generated_tokens=generated, num_step_errors=self._num_step_errors, num_aborted=self._num_aborted,
            step_seconds=self._step_seconds,
            cache_stats=tuple(getattr(bm, "cache_stats", {}).items()),
        )
        self._token_samples.append((now, generated))
        self._last_snapshot = now


def _deliver(batch: list[tuple[_Mailbox, RequestOutput | BaseException]]) -> None:
    """On the event loop: leave each output (or error) in its mailbox and wake its reader."""
    for box, item in batch:
        if isinstance(item, BaseException):
            box.error = item
        else:
            box.pending[item.request_id] = item
        box.event.set()
