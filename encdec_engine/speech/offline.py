"""The offline driver: every input's jobs through `LLMEngine.step()` at once (`LLM.transcribe`).

`stream_transcriptions` is the driver itself, a generator: it steps the engine only while it is
iterated, and after each step yields what became final, per input: the segments of windows just
taken (in time order) and, once the input is done, its `Transcription`. Inputs finish in completion
order, not input order (`Transcription.index` says which input). Closing it early (or an exception,
Ctrl-C included, inside it) aborts the requests in flight, so their KV blocks are free again.
`transcribe_offline` collects it into one Transcription per input, in input order.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from encdec_engine.speech.assembly import ResultAssembler
from encdec_engine.inputs.audio import FRAMES_PER_SECOND, audio_inputs
from encdec_engine.speech.inputs import InputQueue
from encdec_engine.speech.job import TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Segment, Transcription
from encdec_engine.speech.transcriber import Transcriber

if TYPE_CHECKING:
    from encdec_engine.engine.llm_engine import LLMEngine

# "12.3/69.3 s of audio [00:04<00:10, 7.6x realtime, files 1/3]": seconds of audio, not "s/s" rates.
_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s of audio [{elapsed}<{remaining}{postfix}]"
TRANSCRIBING, FINDING_SPEECH = "Transcribing", "Finding speech (VAD)"  # the bar's phases


@dataclass
class TranscriptionUpdate:
    """What became final for one input after an engine step."""

    index: int  # the input's position in the call
    segments: list[Segment] = field(default_factory=list)  # newly final segments, in time order
    transcription: Transcription | None = None  # set once the input is done (its last update)
    language: str | None = None  # the input's language, once known
    duration: float = 0.0  # seconds of audio


class _Progress:
    """The progress bar: seconds of audio done, the x-realtime rate, and files done. It counts whole mel
    frames (10 ms), never rounded float seconds, so that it ends exactly at its total: each input's frames
    are its length (from its header, corrected once it is read) and what a window advances is clamped to
    what is left of its input, which the input's end fills up.

    It is drawn when tqdm's `update` finds `mininterval` passed, and at each change of phase or file, never
    at every engine step: into a log (stderr not a terminal) each drawing is written out, not redrawn."""

    def __init__(self, probed: list[float | None], enabled: bool, phase: str = TRANSCRIBING) -> None:
        self.expected = {i: _frames(s) for i, s in enumerate(probed) if s is not None}  # input -> its frames
        self.counted: Counter[int] = Counter()  # input -> frames counted so far
        self.files, self.files_done = len(probed), 0
        self.current = phase  # what the bar names
        self.searched_at = 0.0  # when the VAD's progress was last drawn (time.monotonic)
        self.bar = tqdm(total=sum(self.expected.values()), unit_scale=1 / FRAMES_PER_SECOND, desc=phase,
                        bar_format=_BAR_FORMAT, disable=not enabled)

    def phase(self, what: str) -> None:
        """Name what runs now (reading the audio and finding its speech can take a while); drawn if new."""
        if what != self.current:
            self.current = what
            self.bar.set_description_str(what, refresh=False)
            self.bar.set_postfix_str(self._postfix(self.bar.n), refresh=False)
            self.bar.refresh()

    def searched(self, done: float, total: float) -> None:
        """The VAD has searched `done` of the `total` seconds it was given: drawn at most every
        `mininterval`, and at its end, so that a log shows the phase advance and finish."""
        now = time.monotonic()
        if self.bar.disable or (done < total and now - self.searched_at < self.bar.mininterval):
            return
        self.searched_at = now
        self.bar.set_postfix_str(f"speech searched in {done:.1f}/{total:.1f} s", refresh=False)
        self.bar.refresh()

    def read(self, index: int, seconds: float) -> None:
        """An input is read: its real length replaces what its header said (or nothing did)."""
        frames = _frames(seconds)
        change = frames - self.expected.get(index, 0)
        self.expected[index] = frames
        if change:
            self.bar.total += change
            self.bar.refresh()

    def advance(self, index: int, frames: int) -> bool:
        """Count a window's frames; True if the bar was drawn (tqdm's `update`: `mininterval` passed)."""
        frames = max(0, min(frames, self.expected.get(index, 0) - self.counted[index]))
        self.counted[index] += frames
        self.bar.set_postfix_str(self._postfix(self.bar.n + frames), refresh=False)
        return bool(self.bar.update(frames))

    def file_done(self, index: int) -> None:
        self.files_done += 1
        if not self.advance(index, self.expected.get(index, 0)):  # the rest of it (silence skipped, VAD's gaps)
            self.bar.refresh()  # the file count changed
        self.counted.pop(index, None)

    def _postfix(self, frames: int) -> str:
        elapsed = self.bar.format_dict["elapsed"]
        rate = f"{frames / FRAMES_PER_SECOND / elapsed:.1f}x realtime, " if elapsed > 0 else ""
        return f"{rate}files {self.files_done}/{self.files}"


def _frames(seconds: float) -> int:
    return round(seconds * FRAMES_PER_SECOND)


class _SegmentFeed:
    """Hands out each input's final segments once: every committed segment of a job is final; a
    chunked input's are final up to its first chunk still running (chunks finish in any order)."""

    def __init__(self, assembler: ResultAssembler) -> None:
        self.assembler = assembler
        self.sent: Counter[int] = Counter()  # segments handed out, per input
        self.finished: set[TranscriptionJob] = set()  # jobs and chunk jobs with no request left

    def new(self, job: TranscriptionJob) -> list[Segment]:
        """The input's final segments not handed out yet, on its timeline (each mapped once, not again at
        every update)."""
        parts = itertools.takewhile(lambda part: part in self.finished, job.parts) if job.parts else [job]
        start = skip = self.sent[job.index]
        fresh = []
        for part in parts:
            if skip >= len(part.segments):
                skip -= len(part.segments)
                continue
            fresh += self.assembler.on_timeline(job, part.part, part.segments[skip:])
            skip = 0
        for i, seg in enumerate(fresh, start=start):
            seg.id = i  # a chunk numbers its own segments; the input's numbering is known only here
        self.sent[job.index] = start + len(fresh)
        return fresh

    def forget(self, job: TranscriptionJob) -> None:
        """The input is done: hold nothing of it (its jobs hold its audio)."""
        self.finished.difference_update((job, *job.parts))
        self.sent.pop(job.index, None)


def stream_transcriptions(engine: LLMEngine, options: TranscribeOptions, audio, use_tqdm: bool = False,
                          max_in_flight: int | None = None) -> Iterator[TranscriptionUpdate]:
    """Transcribe audio (one input or a sequence: paths, bytes, arrays, (samples, rate) pairs) on an
    `LLMEngine`, yielding updates as windows finish (see the module docstring). At most
    `max_in_flight` jobs start at once (None: all that are read); a job's later requests, and the
    chunks it fans out into, follow at once. Inputs are read as the audio held allows
    (`speech.inputs`), and dropped once done. An input that cannot be read is done at once, with
    `error` set."""
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1 (or None: every input at once), got {max_in_flight}")
    transcriber = Transcriber(engine, options)

    def load(group: list[tuple[int, object]]) -> list[TranscriptionJob]:
        """Read a group of inputs; its VAD runs as one batch, shown as a phase of the bar (`progress`,
        made below from the lengths the queue probes)."""
        if not options.vad_filter:
            return transcriber.load_many(group)
        progress.phase(FINDING_SPEECH)
        jobs = transcriber.load_many(group, progress.searched)
        progress.phase(TRANSCRIBING)
        return jobs

    inputs = InputQueue(audio_inputs(audio), load)
    roots: dict[int, TranscriptionJob] = {}  # inputs read and not done
    queue: list[TranscriptionJob] = []
    running: Counter[int] = Counter()  # jobs of each input that are not done
    in_flight: dict[str, TranscriptionJob] = {}
    feed = _SegmentFeed(transcriber.assembler)
    progress = _Progress(inputs.probed, use_tqdm, FINDING_SPEECH if options.vad_filter else TRANSCRIBING)

    def submit(job: TranscriptionJob) -> None:
        align = "-words" if job.pending is not None else ""
        rid = f"transcribe-{id(transcriber)}-{job.index}-{job.part}-{job.window}-{job.temperature_index}{align}"
        engine.add_request(rid, *transcriber.next_request(job))
        in_flight[rid] = job

    def done(job: TranscriptionJob) -> TranscriptionUpdate:
        progress.file_done(job.index)
        update = TranscriptionUpdate(job.index, feed.new(job), transcriber.result(job), job.language, job.duration)
        roots.pop(job.index, None)
        feed.forget(job)
        inputs.release(job.index)
        transcriber.release(job)
        return update

    def read_more() -> list[TranscriptionUpdate]:
        """Read the inputs that fit now; those with nothing to decode (unreadable, no audio) are done."""
        finished = []
        for job in inputs.take():
            if job.error is None:
                progress.read(job.index, job.duration)
            roots[job.index] = job
            ready = transcriber.start(job)
            running[job.index] = len(ready)
            queue.extend(ready)
            if not ready:
                finished.append(done(job))
        return finished

    limit = max_in_flight or math.inf
    try:
        yield from read_more()
        while queue or in_flight or not inputs.exhausted:
            while queue and len(in_flight) < limit:
                submit(queue.pop(0))
            updates = []
            for out in engine.step() if in_flight else []:
                if not out.finished or out.request_id not in in_flight:
                    continue
                job = in_flight.pop(out.request_id)
                before = min(job.seek, job.num_frames)
                ready = transcriber.take(job, out)
                running[job.index] += len(ready) - 1
                if not ready:
                    feed.finished.add(job)
                for next_job in ready:
                    submit(next_job)
                root = roots[job.index]
                progress.advance(job.index, min(job.seek, job.num_frames) - before)
                if not running[job.index]:
                    updates.append(done(root))
                else:
                    updates.append(TranscriptionUpdate(job.index, feed.new(root), None, root.language, root.duration))
            updates += read_more()
            yield from (u for u in updates if u.segments or u.transcription is not None)
    except BaseException:  # an error, Ctrl-C, or the caller closing the generator early
        for rid in list(in_flight):
            engine.abort_request(rid)
        raise
    finally:
        progress.bar.close()


def transcribe_offline(engine: LLMEngine, options: TranscribeOptions, audio, use_tqdm: bool = False,
                       max_in_flight: int | None = None) -> list[Transcription]:
    """One Transcription per input, in input order (see `stream_transcriptions`)."""
    results = {u.index: u.transcription for u in stream_transcriptions(engine, options, audio, use_tqdm, max_in_flight)
               if u.transcription is not None}
    return [results[i] for i in sorted(results)]
