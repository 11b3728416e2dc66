"""The window loop: one input's transcription as a series of engine requests, for any driver.

This is openai-whisper's `transcribe()` loop turned inside out for continuous batching: where
openai-whisper calls the model, a step here returns the engine request it needs, and the driver hands
the finished output to the next step. So the windows of every input in flight (a window's fallback
samples, a chunked input's chunks) share the engine's batches. Beside openai-whisper's transcribe.py:

    openai-whisper's transcribe()                    here
    mel = log_mel_spectrogram(audio, N_SAMPLES)      WindowPlanner.load_many (+ VAD, clips, chunks)
    detect_language(model, mel_segment)              the detection request, before the first window
    while clip_idx < len(seek_clips): seek = ...     WindowPlanner.advance
    mel_segment = mel[:, seek : seek + size]         WindowPlanner.window_features
    decode_options["prompt"] = all_tokens[...]       Transcriber.next_request (prompts.py, requests.py)
    decode_with_fallback(mel_segment)                _take_decode: the best candidate (ranking.py),
                                                     judged (fallback.py), decoded again hotter
    if should_skip: seek += segment_size             _take_decode: silence
    consecutive timestamps -> segments, seek         ResultAssembler.decoded_window (assembly.py)
    add_word_timestamps(...); seek to the last word  _take_words, after the alignment request
    hallucination_silence_threshold                  _take_words (hallucinations.py)
    all_segments, all_tokens, prompt_reset_since     _keep

Audio up to 30 s is one window, decoded exactly as HF `generate` does (features of the zero-padded
30 s window); longer audio, and any input with clips, VAD or the hallucination rules, takes
openai-whisper's windows. A driver (`offline.transcribe_offline` over `LLMEngine.step`,
`async_driver.transcribe_async` over `AsyncLLMEngine`) runs this protocol:

    job = load(index, audio)
    ready = start(job)                      # the jobs that need a request now
    for each ready job, until none is:
        prompt, params = next_request(job)  # -> the engine
        ready = take(job, finished output)  # [] when the job is done
    result(job)                             # -> Transcription

Only this module writes a job's fields (job.py declares them; prompts.py's `after_window` sets
`prompt_reset`, the conditioning rule `_keep` applies). The request and segment helpers read them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from encdec_engine.checkpoints.whisper.tokens import WhisperTokens, language_code
from encdec_engine.inputs.audio import FRAMES_PER_SECOND, N_FRAMES, N_SAMPLES, SAMPLE_RATE, audio_samples
from encdec_engine.inputs.features import log_mel_spectrogram, long_log_mel_spectrogram
from encdec_engine.outputs import RequestOutput
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.speech.assembly import ResultAssembler, clamp_words
from encdec_engine.speech.chunking import frame_loudness, quiet_cuts
from encdec_engine.speech.fallback import Verdict, judge
from encdec_engine.speech.hallucinations import cut_hallucinations
from encdec_engine.speech.job import DecodedWindow, TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.ranking import best_candidate
from encdec_engine.speech.requests import WindowRequests
from encdec_engine.speech.results import Transcription
from encdec_engine.speech.timeline import SpeechTimeline
from encdec_engine.speech.vad import shared_vad
from encdec_engine.speech.word_timestamps import add_word_timestamps, find_alignment, last_word_end, speech_end


class WindowPlanner:
    """An input's audio, log-mel and clips, and `seek`'s walk through them: the head of openai-whisper's
    loop. Needs no engine.

    Long-form, the log-mel covers the whole recording (plus 30 s of silence) and windows of up to 30 s
    start at `seek`, each bounded by its clip. After a window, `seek` is where its text ended, then moves
    into the next clip with audio left. Chunked inputs are cut at their quietest moments into spans that
    run as jobs of their own, at once. With a VAD only the speech is kept (timeline.py): the job's audio
    is its speech joined end to end, as one long-form input or (chunked) chunks of at most 30 s of speech.

        clips     |--------------- clip 0 ---------------|        |------ clip 1 ------|
        window 0  [=========== 30 s ===========]
        window 1                          [==============]        (bounded by its clip)
        window 2                                                  [====================]
                                          ^ seek after window 0: where its text ended
    """

    def __init__(self, options: TranscribeOptions, n_mels: int) -> None:
        self.options = options
        self.n_mels = n_mels

    def load_many(self, items: Sequence[tuple[int, object]], language: str | None,
                  on_vad: Callable[[float, float], None] | None = None) -> list[TranscriptionJob]:
        """Read (index, input) pairs (path, bytes, array, or (samples, rate)) and plan their windows; a bad
        input's job gets `error` set. The VAD runs on all of them at once (`on_vad(done, total)`: seconds
        it has searched, after each of its steps)."""
        jobs = [self._read(index, item, language) for index, item in items]
        readable = [job for job in jobs if job.error is None]
        vad = self.options.vad_parameters
        if vad is not None and readable:
            max_chunk = N_SAMPLES if self.options.chunked else None
            pad = round(vad.speech_pad_ms * SAMPLE_RATE / 1000)
            found = shared_vad().speech_spans([job.samples for job in readable], vad, on_progress=on_vad)
            for job, spans in zip(readable, found):
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
        if not job.long_form:  # HF semantics: the zero-padded 30 s window is normalized as a whole
            job.mel = log_mel_spectrogram([job.samples], n_mels=self.n_mels)[0]
        else:  # openai-whisper's: the recording plus 30 s of silence, in blocks (an hour's STFT takes GBs)
            job.mel = long_log_mel_spectrogram(job.samples, self.n_mels, tail_zeros=N_SAMPLES)
        if job.speech is not None:
            job.clips = job.speech.chunk_frames()  # one chunk of all the speech, unless chunked
        else:
            job.clips = self._clips(job.num_frames)
            if self.options.chunked and job.long_form:
                loudness = frame_loudness(job.mel)
                job.clips = [span for clip in job.clips for span in quiet_cuts(loudness, *clip)]
        self.advance(job)

    def _clips(self, num_frames: int) -> list[tuple[int, int]]:
        """clip_timestamps as mel frames within the audio (openai-whisper: a missing last end is the end)."""
        points = [round(t * FRAMES_PER_SECOND) for t in self.options.clip_timestamps] or [0]
        if len(points) % 2:
            points.append(num_frames)
        return [(min(start, num_frames), min(end, num_frames)) for start, end in zip(points[::2], points[1::2])]

    def split(self, job: TranscriptionJob) -> list[TranscriptionJob]:
        """Chunked: one job per chunk (sharing the audio and log-mel), to run at once, kept in `job.parts`;
        else [job]."""
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
        # openai-whisper and faster-whisper: only the window's audio frames, then zeros (not the log-mel of
        # silence) up to 30 s.
        window = job.mel[:, job.seek : job.seek + self.window_frames(job)]
        return F.pad(window, (0, N_FRAMES - window.shape[1]))


class Transcriber:
    """The loop over one call's jobs: turns each job into its next engine request and takes the finished
    output back. Holds the call's options and tokens; each job holds its own progress."""

    def __init__(self, engine, options: TranscribeOptions) -> None:
        if getattr(engine.model, "num_mel_bins", None) is None:
            raise ValueError("transcribe needs a Whisper checkpoint")
        self.options = options
        self.tokens = WhisperTokens.from_configs(engine.hf_config, engine.generation_config)
        self.tokenizer = engine.tokenizer
        self.planner = WindowPlanner(options, engine.model.num_mel_bins)
        self.requests = WindowRequests(engine, options, self.tokens)
        self.assembler = ResultAssembler(options, self.tokens, engine.tokenizer)
        # "English" -> "en"; None: detected per input, except on English-only checkpoints.
        self.language = "en" if not self.tokens.is_multilingual else None
        if options.language is not None:
            self.language = language_code(options.language)

    # The driver protocol.

    def load(self, index: int, item) -> TranscriptionJob:
        """Read one input (path, bytes, array, or (samples, rate)); a bad one gets `error` set."""
        return self.planner.load_many([(index, item)], self.language)[0]

    def load_many(self, pairs: list[tuple[int, object]],
                  on_vad: Callable[[float, float], None] | None = None) -> list[TranscriptionJob]:
        """Read (index, input) pairs at once: the VAD, when asked for, runs on all of them together
        (`on_vad(done, total)`: the seconds it has searched, as it goes)."""
        return self.planner.load_many(pairs, self.language, on_vad)

    def start(self, job: TranscriptionJob) -> list[TranscriptionJob]:
        """The jobs of a loaded input that need a request first (none for a bad input, or one whose clips
        hold no audio)."""
        return [] if job.error is not None or job.done else self._ready(job)

    def next_request(self, job: TranscriptionJob) -> tuple[dict, SamplingParams]:
        """The engine request (prompt, params) for the job's current window: language detection, its
        decode at the current temperature, or the alignment of its words (requests.py)."""
        return self.requests.build(job, self.planner.window_features(job))

    def take(self, job: TranscriptionJob, out: RequestOutput) -> list[TranscriptionJob]:
        """Fold the job's finished request in. Returns the jobs that need a request next: the job itself,
        none once it is done, or, after the language is detected, the input's chunks."""
        if out.error is not None:  # the request failed in the engine: its tokens are no window's decode
            raise RuntimeError(f"transcribing input {job.index} failed: {out.error}")
        if job.language is None:  # that was language detection
            job.language = self.tokens.language_of(out.outputs[0].token_ids[0]) or "en"
            return self._ready(job)
        more = self._take_words(job, out) if job.pending is not None else self._take_decode(job, out)
        return [job] if more else []

    def result(self, job: TranscriptionJob) -> Transcription:
        """The transcript of a loaded input once none of its jobs needs a request."""
        return self.assembler.result(job)

    def release(self, job: TranscriptionJob) -> None:
        """The input is done: its audio and log-mel (and its chunks') are dropped."""
        for j in (job, *job.parts):
            j.samples, j.mel = None, None

    # The loop's steps, in openai-whisper's order.

    def _ready(self, job: TranscriptionJob) -> list[TranscriptionJob]:
        # "Detect the language once, then fan the chunks out" is decided here and nowhere else: a
        # multilingual checkpoint's job first decodes one detection request; then its chunks run at once.
        return [job] if job.language is None else self.planner.split(job)

    def _take_decode(self, job: TranscriptionJob, out: RequestOutput) -> bool:
        """A window's decode: retried hotter while it fails (decode_with_fallback), skipped as silence,
        else cut into segments, kept, or first sent to have its words aligned. Whether the job needs
        another request."""
        forced = self.requests.prompts.forced(job)
        chosen = best_candidate(out, self.tokens.eot, self.options.length_penalty)
        quality = self.assembler.quality(chosen, forced, out.probes.no_speech_prob)  # every decode asks for it
        verdict = judge(quality, self.options, job.temperature_index)
        if verdict is Verdict.RETRY:  # the same window, at the next temperature
            job.temperature_index += 1
            return True
        temperature = self.options.temperatures[job.temperature_index]
        job.temperature_index, job.window = 0, job.window + 1  # the next window starts at the first temperature
        frames = self.planner.window_frames(job)
        if verdict is Verdict.SKIP:  # silence: no segment, nothing conditions the next window
            job.seek += frames
            return self._next_window(job)
        window = self.assembler.decoded_window(job, forced + chosen.tokens, frames, temperature, quality)
        if self.options.aligns_words:
            if self.requests.can_align(job, window):
                job.pending = window  # the next request aligns its words
                return True
            for seg in window.segments:
                seg.words = []
        return self._keep(job, window)

    def _take_words(self, job: TranscriptionJob, out: RequestOutput) -> bool:
        """The pending window's words, from the alignment request's cross-attention and token probabilities
        (word_timestamps.py); then seek to the last word, and the hallucination rules, which may end the
        window early or drop it as if never decoded."""
        window, job.pending = job.pending, None
        prefix_len = len(self.requests.alignment_prefix(job))
        text = window.text_tokens(self.tokens.eot)
        probs = [math.exp(out.probes.prompt_logprobs[prefix_len + k][t]) for k, t in enumerate(text)]
        alignment = find_alignment(out.probes.cross_attentions, probs, text, prefix_len, window.num_frames,
                                   self.tokenizer, self.tokens.eot, job.language)
        add_word_timestamps(window.segments, alignment, self.tokens.eot, window.offset, job.last_speech,
                            self.options.prepend_punctuations, self.options.append_punctuations)
        clamp_words(window.segments, self.assembler.end_of_audio(job))
        end = last_word_end(window.segments)
        if (self.options.word_timestamps and job.long_form and not window.single_ending and end is not None
                and end > window.offset):
            window.seek = round(end * FRAMES_PER_SECOND)  # openai-whisper: seek to the last word's end
        threshold = self.options.hallucination_silence_threshold
        if threshold is not None:
            cut = cut_hallucinations(window.segments, threshold, job.seek, window.num_frames, window.single_ending,
                                     job.last_speech, job.num_frames)
            if cut.discard:  # as if never decoded: no segment, the last speech stays
                job.seek = cut.seek
                return self._next_window(job)
            del window.segments[cut.keep :]
            if cut.seek is not None:
                window.seek = cut.seek
        return self._keep(job, window)

    def _keep(self, job: TranscriptionJob, window: DecodedWindow) -> bool:
        """The window's segments kept and `seek` moved past it. As openai-whisper and faster-whisper: an
        instantaneous or empty segment is dropped, and only kept segments' tokens condition later windows,
        unless the window resets the prompt."""
        for seg in window.segments:
            if seg.text.strip() and seg.start != seg.end:
                seg.id = len(job.segments)
                job.segments.append(seg)
                job.tokens.extend(seg.tokens)
        job.seek = window.seek
        if self.options.aligns_words and window.segments:  # the last speech: its last word, or segment
            job.last_speech = speech_end(window.segments)
        self.requests.prompts.after_window(job, window.temperature)
        return self._next_window(job)

    def _next_window(self, job: TranscriptionJob) -> bool:
        """Once a window is taken (`seek` past it): whether the job has another (long-form only)."""
        return job.long_form and self.planner.advance(job)
