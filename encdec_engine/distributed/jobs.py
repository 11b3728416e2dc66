"""Running a batch job on Ray Data: the inputs become a Dataset, an actor pool of engines maps it batch by
batch, and the rows stream back to this process, which writes every output and the results file.

    driver                                  actor pool (one LLM each, model loaded once)
    inputs -> skip what --resume finds done
           -> Dataset of {id, input JSON} --map_batches--> Worker(batch): engine over the whole batch
    rows   <- iter_rows (as batches finish)  <------------ {id, row JSON}
           -> output files (atomic), results JSONL (one row per id), progress

Fault tolerance is Ray Data's: its actor pools restart an actor whose process died and retry the
tasks it held (`max_restarts` and `max_task_retries` default to -1 there, unlimited), so a killed
worker's batch runs again on a live one. Rows of a retried batch that did arrive already are dropped
by id, so every input gets exactly one row. An actor that cannot start (a missing model) fails the
job at once (Ray Data's `max_consecutive_actor_init_deaths`, 0 by default).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from encdec_engine.distributed.cluster import ClusterOptions, connect, import_ray
from encdec_engine.distributed.inputs import JobInput
from encdec_engine.distributed.results import ResultsFile, Row

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
    batch_size: int = 16  # inputs per engine call; also what a dead worker's retry repeats

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
    if expected:  # Ray Data returned without them: never expected, but a lost input must not pass silently
        raise RuntimeError(f"the job ended without results for {len(expected)} inputs: {sorted(expected)[:5]}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.2f} h"


def _stream(job: Job, pending: list[JobInput], cluster: ClusterOptions, num_workers: int) -> Iterator[Row]:
    """The rows of the pending inputs from an actor pool of `num_workers` engines, as batches finish."""
    ray = import_ray()
    from ray.data import ActorPoolStrategy, DataContext

    from encdec_engine.distributed import workers

    DataContext.get_current().enable_progress_bars = False  # the driver's bar counts inputs instead
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # not a line per execution step
    blocks = math.ceil(len(pending) / job.batch_size)
    ds = ray.data.from_items([{"id": i.id, "input": json.dumps(i.payload)} for i in pending],
                             override_num_blocks=blocks)
    ds = ds.map_batches(getattr(workers, WORKERS[job.task]), batch_size=job.batch_size, batch_format="numpy",
                        compute=ActorPoolStrategy(size=min(num_workers, blocks)),
                        num_cpus=cluster.threads_per_worker,
                        fn_constructor_kwargs=dict(model=job.model, engine_kwargs=job.engine,
                                                   threads=cluster.threads_per_worker, options=job.options))
    for item in ds.iter_rows():
        yield json.loads(item["row"])
