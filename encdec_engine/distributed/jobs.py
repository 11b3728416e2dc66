"""Running a batch job on Ray: the driver hands batches of inputs to a pool of actors (one engine each,
the model loaded once) and writes every row as it comes back.

    driver                                  actor pool (one LLM each, model loaded once)
    inputs -> skip what --resume finds done
           -> batches of {id, input JSON} ----> Worker.process(batch): engine over the whole batch
    rows   <- as batches finish   <------------ {id, row JSON}
           -> output files (atomic), results JSONL (one row per id), progress

Fault tolerance is the driver's, and bounded: an actor whose process dies (an OOM kill, a native
crash) is restarted by Ray, and the batch it held is split in two and run again, so that an input
that kills its worker ends up alone; alone, it gets `MAX_ATTEMPTS` workers, then an error row naming
it, while every other input of its batch is written. A worker dies at most about log2(batch size) +
`MAX_ATTEMPTS` times per such input. Rows of a batch that arrive twice are dropped by id, so every
input gets exactly one row. An actor that cannot start (a missing model) fails the job at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from encdec_engine.distributed.cluster import ClusterOptions, connect, import_ray
from encdec_engine.distributed.inputs import JobInput
from encdec_engine.distributed.results import ResultsFile, Row

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 2  # workers an input alone may take down before it gets an error row
WORKERS = {"transcribe": "TranscribeWorker", "summarize": "SummarizeWorker", "generate": "GenerateWorker"}


@dataclass(frozen=True)
class Job:
    """What to run: `task` over `inputs` with `model` (None: the default tiny.en; a folder every worker
    can read). `options` go to the worker's LLM call; `engine` are EngineConfig fields."""

    task: str
    inputs: list[JobInput]
    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 16  # inputs per engine call; a dead worker's batch is split and run again
    limits: dict[str, Any] = field(default_factory=dict)  # per-input limits for the workers (max_document_bytes)
    worker: type | None = None  # the worker class (default: the task's, in distributed/workers.py)

    def __post_init__(self) -> None:
        if self.task not in WORKERS:
            raise ValueError(f"unknown task {self.task!r}; expected one of {', '.join(WORKERS)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")


@dataclass
class Outputs:
    """What the driver does with each row besides the results file: `write` it (output files, before the
    row is recorded, so a recorded row's files are complete), tell whether a resumed row is `complete`."""

    results: str | None = None  # the JSONL path; None: no results file (and no resume)
    resume: bool = False
    write: Callable[[Row], None] = lambda row: None
    complete: Callable[[Row], bool] = lambda row: True
    progress: bool = True
    unit: str = "input"


def run(job: Job, cluster: ClusterOptions, outputs: Outputs) -> Iterator[Row]:
    """Run `job`, yielding each input's row as it arrives (resumed rows first, from the results file)."""
    if outputs.resume and outputs.results is None:
        raise ValueError("resume needs a results file: it is how a job knows which inputs are done")
    results = ResultsFile(outputs.results, outputs.resume, outputs.complete) if outputs.results else None
    try:
        done = results.done if results else {}
        yield from (done[i.id] for i in job.inputs if i.id in done)
        pending = [i for i in job.inputs if i.id not in done]
        if pending:
            yield from _run_pending(job, pending, cluster, outputs, results, skipped=len(job.inputs) - len(pending))
    finally:
        if results:
            results.close()


def _run_pending(job: Job, pending: list[JobInput], cluster: ClusterOptions, outputs: Outputs,
                 results: ResultsFile | None, skipped: int) -> Iterator[Row]:
    expected = {i.id for i in pending}
    bar = tqdm(total=skipped + len(pending), initial=skipped, unit=outputs.unit, desc=job.task.capitalize(),
               disable=not outputs.progress, dynamic_ncols=True)
    audio_seconds, start = 0.0, time.monotonic()
    try:
        with connect(cluster) as num_workers:
            for row in _stream(job, pending, cluster, num_workers):
                if row["id"] not in expected:  # a retried batch's second copy: its row is in already
                    continue
                expected.discard(row["id"])
                outputs.write(row)
                if results:
                    results.append(row)
                bar.update(1)
                if row.get("duration"):  # transcription: how much audio, and how fast (audio hours per hour)
                    audio_seconds += row["duration"]
                    rate = audio_seconds / max(time.monotonic() - start, 1e-9)
                    bar.set_postfix_str(f"audio {_duration(audio_seconds)}, {rate:.1f} h/h")
                yield row
    finally:
        bar.close()
    if expected:  # never expected, but a lost input must not pass silently
        raise RuntimeError(f"the job ended without results for {len(expected)} inputs: {sorted(expected)[:5]}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.2f} h"


@dataclass
class _Batch:
    inputs: list[JobInput]
    deaths: int = 0  # workers that died running it


def _stream(job: Job, pending: list[JobInput], cluster: ClusterOptions, num_workers: int) -> Iterator[Row]:
    """The rows of the pending inputs from a pool of `num_workers` actors, as batches finish."""
    ray = import_ray()
    from ray.exceptions import RayActorError

    import encdec_engine.distributed.workers as workers  # lazy: torch and the engine (1.2 s) for the worker classes

    worker = job.worker or getattr(workers, WORKERS[job.task])
    # Ray restarts a dead actor (reloading its model); the driver, not Ray, retries the batch it held.
    actor = ray.remote(num_cpus=cluster.threads_per_worker, max_restarts=-1, max_task_retries=0)(worker)
    queue = deque(_Batch(pending[i:i + job.batch_size]) for i in range(0, len(pending), job.batch_size))
    idle = [actor.remote(job.model, job.engine, cluster.threads_per_worker, job.options, job.limits)
            for _ in range(min(num_workers, len(queue)))]
    running: dict[Any, tuple[Any, _Batch]] = {}
    restarting: dict[Any, Any] = {}  # ready() call -> an actor that died: no batch until it is back
    try:
        while queue or running:
            while queue and idle:
                handle, batch = idle.pop(), queue.popleft()
                ref = handle.process.remote([i.id for i in batch.inputs], [json.dumps(i.payload) for i in batch.inputs])
                running[ref] = (handle, batch)
            [ref], _ = ray.wait([*running, *restarting], num_returns=1)
            if ref in restarting:
                handle = restarting.pop(ref)
                _check_started(ray, ref)
                idle.append(handle)
                continue
            handle, batch = running.pop(ref)
            try:
                rows = ray.get(ref)
            except RayActorError as e:
                if e.actor_init_failed:
                    raise RuntimeError(f"a worker could not start: {e}") from None
                restarting[handle.ready.options(max_task_retries=-1).remote()] = handle
                yield from _after_death(batch, e, queue, worker)
                continue
            idle.append(handle)
            yield from (json.loads(row) for row in rows)
    finally:
        for handle in {id(h): h for h in [*idle, *(h for h, _ in running.values()), *restarting.values()]}.values():
            ray.kill(handle, no_restart=True)


def _check_started(ray, ready) -> None:
    from ray.exceptions import RayActorError

    try:
        ray.get(ready)
    except RayActorError as e:
        if e.actor_init_failed:
            raise RuntimeError(f"a worker could not start again: {e}") from None
        raise


def _after_death(batch: _Batch, error: Exception, queue: deque, worker) -> Iterator[Row]:
    """The batch a dead worker held: split in two and queued first; an input alone, queued again until
    `MAX_ATTEMPTS` workers died on it, then its error row."""
    batch.deaths += 1
    ids = [i.id for i in batch.inputs]
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if len(batch.inputs) > 1:
        logger.warning("a worker died running a batch of %d inputs (%s...): running it again in two halves (%s)",
                       len(ids), ids[0], reason)
        half = len(batch.inputs) // 2
        queue.extendleft([_Batch(batch.inputs[half:]), _Batch(batch.inputs[:half])])
    elif batch.deaths < MAX_ATTEMPTS:
        logger.warning("a worker died running input %s alone: trying it once more (%s)", ids[0], reason)
        queue.appendleft(batch)
    else:
        logger.error("input %s took down %d workers: it gets an error row", ids[0], batch.deaths)
        only = batch.inputs[0]
        yield {**worker.error_row(only.id, only.payload, f"the worker running this input died {batch.deaths} times "
                                                          f"(killed, out of memory or crashed: {reason}); "
                                                          "it was run alone and left out"),
               "worker": None}
