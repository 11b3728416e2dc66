"""Window planning: which 30 s windows of an input are decoded, and where each one starts.

An input of up to 30 s is one window, featurized as HF `generate` does it: the log-mel of the
audio zero-padded to 30 s. Longer audio, and any input with clips or the hallucination rules, takes
openai-whisper's path: the log-mel of the whole recording (plus 30 s of silence), then windows of up
to 30 s from `seek`, each bounded by the current clip. After a window is taken, `seek` is where its
text ended (the assembler moves it) and the planner moves it into the next clip with audio left.
Chunked inputs are cut at their quietest moments into spans that run as jobs of their own at once.
With a VAD, only the speech is kept (timeline.py): the job's audio is its speech joined end to end,
decoded as one long-form input, or (chunked) as chunks of at most 30 s of speech, at once.

    clips     |--------------- clip 0 ---------------|        |------ clip 1 ------|
    window 0  [=========== 30 s ===========]
    window 1                          [==============]        (bounded by its clip)
    window 2                                                  [====================]
                                      ^ seek after window 0: where its text ended
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from encdec_engine.inputs.audio import FRAMES_PER_SECOND, N_FRAMES, N_SAMPLES, SAMPLE_RATE, audio_samples
from encdec_engine.speech.chunking import frame_loudness, quiet_cuts
from encdec_engine.inputs.features import log_mel_spectrogram, long_log_mel_spectrogram
from encdec_engine.speech.job import TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.timeline import SpeechTimeline
from encdec_engine.speech.vad import shared_vad


class WindowPlanner:
    """Reads inputs into jobs and moves their windows: log-mel, clips, chunks, seeking."""

    def __init__(self, options: TranscribeOptions, n_mels: int) -> None:
        self.options = options
        self.n_mels = n_mels

    def load(self, index: int, item, language: str | None) -> TranscriptionJob:
        """Read one input (path, bytes, array, or (samples, rate)) and plan its windows; a bad one
        gets `error` set."""
        return self.load_many([(index, item)], language)[0]

    def load_many(self, items: Sequence[tuple[int, object]], language: str | None) -> list[TranscriptionJob]:
        """Read (index, input) pairs and plan their windows; the VAD runs on all of them at once."""
        jobs = [self._read(index, item, language) for index, item in items]
        readable = [job for job in jobs if job.error is None]
        vad = self.options.vad_parameters
        if vad is not None and readable:
            max_chunk = N_SAMPLES if self.options.chunked else None
            pad = round(vad.speech_pad_ms * SAMPLE_RATE / 1000)
            for job, spans in zip(readable, shared_vad().speech_spans([job.samples for job in readable], vad)):
                job.speech = SpeechTimeline.of(spans, len(job.samples), pad, max_chunk)
                job.samples = job.speech.join(job.samples)
        for job in readable:
            self._plan(job)
        return jobs

    def _read(self, index: int, item, language: str | None) -> TranscriptionJob:
        source = str(item) if isinstance(item, (str, Path)) else None
        job = TranscriptionJob(index, source, language=language)
        try:
            job.samples = audio_samples(item, self.options.max_audio_seconds)
        except ValueError as e:  # AudioError included
            job.error = str(e)
        return job

    def _plan(self, job: TranscriptionJob) -> None:
        job.long_form = len(job.samples) > N_SAMPLES or self.options.openai_windows
        if job.speech is not None and not job.speech.spans:
            return  # no speech: no clips, so the job is done without a window
        job.mel = self._log_mel(job)
        if job.speech is not None:
            job.clips = job.speech.chunk_frames()  # one chunk of all the speech, unless chunked
        else:
            job.clips = self._clips(job)
            if self.options.chunked and job.long_form:
                loudness = frame_loudness(job.mel)
                job.clips = [span for clip in job.clips for span in quiet_cuts(loudness, *clip)]
        self.advance(job)

    def split(self, job: TranscriptionJob) -> list[TranscriptionJob]:
        """Chunked: one job per chunk (sharing the audio and log-mel), to run at once, kept in
        `job.parts`; else [job]."""
        if not self.options.chunked or len(job.clips) < 2:
            return [job]
        # Each chunk starts as if speech last ended where it begins (the chunks before it run at the same time).
        job.parts = [TranscriptionJob(job.index, job.source, samples=job.samples, language=job.language, mel=job.mel,
                                      seek=start, long_form=True, clips=[(start, end)], part=i,
                                      last_speech=start / FRAMES_PER_SECOND)
                     for i, (start, end) in enumerate(job.clips)]
        return job.parts

    @staticmethod
    def advance(job: TranscriptionJob) -> bool:
        """Move `seek` into the first clip with audio left; False when none has."""
        while job.clip_index < len(job.clips):
            start, end = job.clips[job.clip_index]
            job.seek = max(job.seek, start)
            if job.seek < end:
                return True
            job.clip_index += 1  # the next clip starts at its start (a window may have run past this clip)
            job.seek = job.clips[job.clip_index][0] if job.clip_index < len(job.clips) else job.seek
        return False

    @staticmethod
    def window_frames(job: TranscriptionJob) -> int:
        """Mel frames of audio the current window covers."""
        if not job.long_form:
            return job.num_frames
        return min(N_FRAMES, job.num_frames - job.seek, job.clips[job.clip_index][1] - job.seek)

    def window_features(self, job: TranscriptionJob) -> torch.Tensor:  # [n_mels, N_FRAMES]
        """The encoder input of the current window."""
        if not job.long_form:
            return job.mel
        # openai-whisper and faster-whisper: only the window's audio frames, then zeros (not the
        # log-mel of silence) up to 30 s.
        window = job.mel[:, job.seek : job.seek + self.window_frames(job)]
        return F.pad(window, (0, N_FRAMES - window.shape[1]))

    def _log_mel(self, job: TranscriptionJob) -> torch.Tensor:  # [n_mels, frames]
        if not job.long_form:  # HF semantics: the zero-padded 30 s window is normalized as a whole
            return log_mel_spectrogram([job.samples], n_mels=self.n_mels)[0]
        # openai-whisper semantics: the whole recording plus 30 s of silence, sliced into windows later,
        # featurized in blocks (an hour's STFT in one piece would take gigabytes).
        return long_log_mel_spectrogram(job.samples, self.n_mels, tail_zeros=N_SAMPLES)

    def _clips(self, job: TranscriptionJob) -> list[tuple[int, int]]:
        """clip_timestamps as mel frames within the audio (openai-whisper: a missing last end is the end)."""
        points = [round(t * FRAMES_PER_SECOND) for t in self.options.clip_timestamps] or [0]
        if len(points) % 2:
            points.append(job.num_frames)
        return [(min(start, job.num_frames), min(end, job.num_frames)) for start, end in zip(points[::2], points[1::2])]
