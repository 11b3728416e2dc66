"""The offline driver: every input's jobs through `LLMEngine.step()` at once (`LLM.transcribe`)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from encdec_engine.speech.audio import FRAMES_PER_SECOND, audio_inputs
from encdec_engine.speech.job import TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Transcription
from encdec_engine.speech.transcriber import Transcriber

if TYPE_CHECKING:
    from encdec_engine.engine.llm_engine import LLMEngine


def transcribe_offline(engine: LLMEngine, options: TranscribeOptions, audio, use_tqdm: bool = False,
                       max_in_flight: int | None = None) -> list[Transcription]:
    """Transcribe audio (one input or a sequence: paths, bytes, arrays, (samples, rate) pairs) on an
    `LLMEngine`: one Transcription per input, in input order. At most `max_in_flight` jobs start at
    once (None: all); a job's later requests, and the chunks it fans out into, follow at once."""
    transcriber = Transcriber(engine, options)
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1 (or None: every input at once), got {max_in_flight}")
    jobs = transcriber.load_many(audio_inputs(audio))
    queue = [ready for job in jobs for ready in transcriber.start(job)]
    running = Counter(job.index for job in queue)  # jobs of each input that are not done
    in_flight: dict[str, TranscriptionJob] = {}
    bar = tqdm(total=round(sum(j.duration for j in jobs), 1), unit="s", desc="Transcribing", disable=not use_tqdm)
    files_done, bar_files = 0, len(running)

    def submit(job: TranscriptionJob) -> None:
        align = "-words" if job.pending is not None else ""
        rid = f"transcribe-{id(transcriber)}-{job.index}-{job.part}-{job.window}-{job.temperature_index}{align}"
        engine.add_request(rid, *transcriber.next_request(job))
        in_flight[rid] = job

    limit = max_in_flight or len(queue) or 1
    try:
        while queue or in_flight:
            while queue and len(in_flight) < limit:
                submit(queue.pop(0))
            for out in engine.step():
                if not out.finished:
                    continue
                job = in_flight.pop(out.request_id)
                before = min(job.seek, job.num_frames)
                ready = transcriber.take(job, out)
                running[job.index] += len(ready) - 1
                for next_job in ready:
                    submit(next_job)
                if not ready:
                    files_done += not running[job.index]
                    bar.set_postfix_str(f"files {files_done}/{bar_files}")
                bar.update(round((min(job.seek, job.num_frames) - before) / FRAMES_PER_SECOND, 1))
    except BaseException:
        for rid in list(in_flight):
            engine.abort_request(rid)
        raise
    finally:
        bar.close()
    return [transcriber.result(job) for job in jobs]
