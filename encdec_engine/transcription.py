"""Transcription: audio in, text and timed segments out, many files through the engine at once.

Audio up to 30 s is one window, decoded exactly as HF `generate` does (features
of the zero-padded 30 s window). Longer audio follows openai-whisper: log-mel
of the whole recording, then sequential 30 s windows that seek to the last
timestamp token, each conditioned on the previous window's text, with
temperature fallback when the compression ratio or the mean log-probability
says a window failed. A window whose no-speech probability is above
`no_speech_threshold` and whose text is improbable (mean log-probability at or
below `logprob_threshold`) is silence: it is skipped, with no segment and no
fallback. Each file's windows are sequential, but the windows of all files in
flight share the engine's batches.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from encdec_engine.inputs.audio import FRAMES_PER_SECOND, HOP_LENGTH, N_FRAMES, N_SAMPLES, SAMPLE_RATE, audio_samples
from encdec_engine.inputs.audio_chunks import frame_loudness, quiet_cuts
from encdec_engine.inputs.audio_features import log_mel_spectrogram
from encdec_engine.layers.whisper_timestamps import timestamp_rules_from_generation_config
from encdec_engine.models.whisper_tokens import TIME_PRECISION, WhisperTokens, language_code
from encdec_engine.outputs import RequestOutput, Segment, Transcription
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.transcribe_options import TranscribeOptions
from encdec_engine.word_timestamps import (add_word_timestamps, alignment_heads, cut_hallucinations, find_alignment,
                                           last_word_end, speech_end)

INPUT_STRIDE = 2  # mel frames per encoder position (the second conv has stride 2)


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass
class DecodedWindow:
    """A window's segments as decoded, before empty and instantaneous ones are dropped."""

    segments: list[Segment]
    seek: int  # mel frames done once the window is taken
    offset: float  # seconds: where the window starts
    num_frames: int  # mel frames of audio in the window
    single_ending: bool  # the text ended on a single timestamp token (the window is used up)
    temperature: float

    @property
    def last_word_end(self) -> float | None:
        return last_word_end(self.segments)


@dataclass
class TranscriptionJob:
    """One input's progress through its windows."""

    index: int
    source: str | None
    samples: np.ndarray | None = None
    error: str | None = None
    language: str | None = None
    mel: Any = None  # log-mel: the 30 s window, or (long-form) the whole recording [n_mels, frames]
    seek: int = 0  # mel frames done
    temperature_index: int = 0
    window: int = 0
    tokens: list[int] = field(default_factory=list)  # all text + timestamp tokens so far (for conditioning)
    prompt_reset: int = 0  # tokens before this index do not condition later windows
    segments: list[Segment] = field(default_factory=list)
    pending: DecodedWindow | None = None  # a decoded window waiting for its word alignment
    last_speech: float = 0.0  # end of the last word so far (word timestamps)
    long_form: bool = False  # openai-whisper's windows over the whole log-mel (else: one HF window)
    clips: list[tuple[int, int]] = field(default_factory=list)  # mel frames [start, end) to transcribe
    clip_index: int = 0
    part: int = 0  # chunked: which chunk of the input this job transcribes

    @property
    def duration(self) -> float:
        return 0.0 if self.samples is None else len(self.samples) / SAMPLE_RATE

    @property
    def num_frames(self) -> int:
        return 0 if self.samples is None else len(self.samples) // HOP_LENGTH

    @property
    def done(self) -> bool:
        """Nothing left to transcribe (every clip is done)."""
        return self.long_form and self.clip_index >= len(self.clips)


class Transcriber:
    def __init__(self, engine, options: TranscribeOptions) -> None:
        if getattr(engine.model, "num_mel_bins", None) is None:
            raise ValueError("transcribe needs a Whisper checkpoint")
        self.engine = engine
        self.options = options
        self.tokens = WhisperTokens.from_configs(engine.hf_config, engine.generation_config)
        gc = engine.generation_config
        self.suppress = list(getattr(gc, "suppress_tokens", None) or [])
        self.begin_suppress = list(getattr(gc, "begin_suppress_tokens", None) or [])
        self.timestamp_rules = timestamp_rules_from_generation_config(gc)
        self.n_mels = engine.model.num_mel_bins
        self.tokenizer = engine.tokenizer
        self.prompt_tokens = []
        if options.initial_prompt:
            self.prompt_tokens = self.tokenizer(" " + options.initial_prompt.strip(), add_special_tokens=False)[
                "input_ids"]
            special = [t for t in self.prompt_tokens if t >= self.tokens.eot]  # as HF's get_prompt_ids refuses
            if special:
                raise ValueError(f"initial_prompt contains special-token text "
                                 f"{self.tokenizer.convert_ids_to_tokens(special)}; write it without <|...|> tokens")
        self.language = None if options.language is None else language_code(options.language)  # "English" -> "en"
        spec = engine.model.kv_cache_spec
        self.alignment_heads = alignment_heads(engine.generation_config, spec.num_layers, spec.num_kv_heads)
        max_seqs = engine.scheduler.config.max_num_seqs
        for name in ("beam_size", "best_of"):
            if getattr(options, name) > max_seqs:
                raise ValueError(f"{name} {getattr(options, name)} is more than the engine's max_num_seqs {max_seqs}")
        if options.language is not None:
            self.tokens.decoder_prompt(options.language, options.task)  # validates language and task

    # -- driving the engine --------------------------------------------------
    def run(self, inputs: list, use_tqdm: bool = False, max_in_flight: int | None = None) -> list[Transcription]:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1 (or None: every input at once), got {max_in_flight}")
        jobs = [self.load(i, x) for i, x in enumerate(inputs)]
        parts = {j.index: [j] for j in jobs}
        queue = [p for j in jobs if j.error is None and not j.done for p in self._fan_out(j, parts)]
        parts_left = {j.index: sum(p.index == j.index for p in queue) for j in jobs}
        in_flight: dict[str, TranscriptionJob] = {}
        bar = tqdm(total=round(sum(j.duration for j in jobs), 1), unit="s", desc="Transcribing", disable=not use_tqdm)
        files_done, bar_files = 0, sum(1 for left in parts_left.values() if left)
        limit = max_in_flight or len(queue) or 1
        try:
            while queue or in_flight:
                while queue and len(in_flight) < limit:
                    self._submit(queue.pop(0), in_flight)
                for out in self.engine.step():
                    if not out.finished:
                        continue
                    job = in_flight.pop(out.request_id)
                    before, detecting = min(job.seek, job.num_frames), self.detects_language(job)
                    if self.take(job, out):
                        fresh = self._fan_out(job, parts) if detecting else [job]  # chunked: now split
                        parts_left[job.index] += len(fresh) - 1
                        for part in fresh:
                            self._submit(part, in_flight)
                    else:
                        parts_left[job.index] -= 1
                        files_done += not parts_left[job.index]
                        bar.set_postfix_str(f"files {files_done}/{bar_files}")
                    bar.update(round((min(job.seek, job.num_frames) - before) / FRAMES_PER_SECOND, 1))
        except BaseException:
            for rid in list(in_flight):
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [self.result(self.merge(j, parts[j.index])) for j in jobs]

    def _submit(self, job: TranscriptionJob, in_flight: dict[str, TranscriptionJob]) -> None:
        align = "-words" if job.pending is not None else ""
        rid = f"transcribe-{id(self)}-{job.index}-{job.part}-{job.window}-{job.temperature_index}{align}"
        self.engine.add_request(rid, *self.next_request(job))
        in_flight[rid] = job

    # -- one input's windows (any driver: this loop, or an async server) ------
    def load(self, index: int, item) -> TranscriptionJob:
        """Read one input (path, array, or (samples, rate)); a bad one gets `error` set."""
        source = str(item) if isinstance(item, (str, Path)) else None
        job = TranscriptionJob(index, source, language=self.language)
        try:
            job.samples = audio_samples(item)
        except ValueError as e:  # AudioError included
            job.error = str(e)
        if job.error is None:
            job.long_form = len(job.samples) > N_SAMPLES or self.options.openai_windows
            job.mel = self._log_mel(job)
            job.clips = self._clips(job)
            if self.options.chunked and job.long_form:
                loudness = frame_loudness(job.mel)
                job.clips = [span for clip in job.clips for span in quiet_cuts(loudness, *clip)]
            self._advance(job)
        return job

    def detects_language(self, job: TranscriptionJob) -> bool:
        """Whether the job's next request is language detection (a multilingual checkpoint, no language yet)."""
        return self.tokens.is_multilingual and job.language is None

    def _fan_out(self, job: TranscriptionJob, parts: dict[int, list[TranscriptionJob]]) -> list[TranscriptionJob]:
        """The jobs to run for an input: its chunks (recorded in `parts`) once its language is known, else
        the job itself, which detects the language first, once for the whole input."""
        if self.detects_language(job):
            return [job]
        parts[job.index] = self.split(job)
        return parts[job.index]

    def split(self, job: TranscriptionJob) -> list[TranscriptionJob]:
        """Chunked: one job per chunk (sharing the audio and log-mel), to run at once; else [job]."""
        if not self.options.chunked or len(job.clips) < 2:
            return [job]
        # Each chunk starts as if speech last ended where it begins (the chunks before it run at the same time).
        return [TranscriptionJob(job.index, job.source, samples=job.samples, language=job.language, mel=job.mel,
                                 seek=start, long_form=True, clips=[(start, end)], part=i,
                                 last_speech=start / FRAMES_PER_SECOND)
                for i, (start, end) in enumerate(job.clips)]

    @staticmethod
    def merge(job: TranscriptionJob, parts: list[TranscriptionJob]) -> TranscriptionJob:
        """The input's job with its parts' segments in order (the job itself when it was not split)."""
        if parts[0] is job:
            return job
        job.segments = [seg for part in parts for seg in part.segments]
        for i, seg in enumerate(job.segments):
            seg.id = i
        return job

    def _clips(self, job: TranscriptionJob) -> list[tuple[int, int]]:
        """clip_timestamps as mel frames within the audio (openai-whisper: a missing last end is the end)."""
        points = [round(t * FRAMES_PER_SECOND) for t in self.options.clip_timestamps] or [0]
        if len(points) % 2:
            points.append(job.num_frames)
        return [(min(start, job.num_frames), min(end, job.num_frames)) for start, end in zip(points[::2], points[1::2])]

    @staticmethod
    def _advance(job: TranscriptionJob) -> bool:
        """Move `seek` into the first clip with audio left; False when none has."""
        while job.clip_index < len(job.clips):
            start, end = job.clips[job.clip_index]
            job.seek = max(job.seek, start)
            if job.seek < end:
                return True
            job.clip_index += 1  # the next clip starts at its start (a window may have run past this clip)
            job.seek = job.clips[job.clip_index][0] if job.clip_index < len(job.clips) else job.seek
        return False

    def _log_mel(self, job: TranscriptionJob) -> torch.Tensor:
        if not job.long_form:  # HF semantics: the zero-padded 30 s window is normalized as a whole
            return log_mel_spectrogram([job.samples], n_mels=self.n_mels)[0]
        # openai-whisper semantics: the whole recording plus 30 s of silence, sliced into windows later
        padded = np.concatenate([job.samples, np.zeros(N_SAMPLES, dtype=np.float32)])
        return log_mel_spectrogram([padded], n_mels=self.n_mels, pad_to=None)[0]

    def _window_features(self, job: TranscriptionJob) -> torch.Tensor:  # [n_mels, N_FRAMES]
        if not job.long_form:
            return job.mel
        # openai-whisper and faster-whisper: only the window's audio frames, then zeros (not the
        # log-mel of silence) up to 30 s.
        window = job.mel[:, job.seek : job.seek + self._window_frames(job)]
        return F.pad(window, (0, N_FRAMES - window.shape[1]))

    def next_request(self, job: TranscriptionJob) -> tuple[dict, SamplingParams]:
        """The engine request (prompt, params) for the job's current window."""
        encoder = {"prompt": "", "multi_modal_data": {"input_features": self._window_features(job)}}
        if job.pending is not None:  # teacher-force the window's text for its cross-attention
            decoder = self._alignment_prefix(job) + self._text_tokens(job.pending) + [self.tokens.eot]
            # Word probabilities as openai-whisper's: over the text tokens only.
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                                    allowed_token_ids=range(self.tokens.eot),
                                    cross_attention_heads=self.alignment_heads)
        elif self.tokens.is_multilingual and job.language is None:
            params = SamplingParams(temperature=0.0, max_tokens=1,
                                    allowed_token_ids=list(self.tokens.lang_to_id.values()))
            decoder = [self.tokens.sot]
        else:
            decoder = self.tokens.decoder_prompt(job.language, self.options.task, self.options.timestamps,
                                                 self._previous(job))
            params = self._params(job, len(decoder))
        return {"encoder_prompt": encoder, "decoder_prompt": {"prompt_token_ids": decoder}}, params

    def _alignment_prefix(self, job: TranscriptionJob) -> list[int]:
        return self.tokens.decoder_prompt(job.language, self.options.task, timestamps=False)

    def _text_tokens(self, window: DecodedWindow) -> list[int]:
        return [t for seg in window.segments for t in seg.tokens if t < self.tokens.eot]

    def _previous(self, job: TranscriptionJob) -> list[int]:
        previous = list(self.prompt_tokens)
        if self.options.condition_on_previous_text:
            previous += job.tokens[job.prompt_reset :]
        # openai-whisper keeps at most half the decoder context for the prompt.
        return previous[-(self.engine.max_decoder_len // 2 - 1) :] if previous else []

    def _params(self, job: TranscriptionJob, prompt_len: int) -> SamplingParams:
        temperature = self.options.temperatures[job.temperature_index]
        sampled = temperature > 0
        beams = 1 if sampled else self.options.beam_size  # openai-whisper: beams at 0, best_of samples above
        return SamplingParams(
            temperature=temperature, n=1, best_of=self.options.best_of if sampled else 1, num_beams=beams,
            seed=self.options.seed + 1000 * job.index + job.window + 1_000_000 * job.part if sampled else None,
            max_tokens=self._max_tokens(prompt_len), logprobs=0 if beams == 1 else None, skip_special_tokens=True,
            no_speech_token_id=self.tokens.no_speech,
            suppress_tokens=self.suppress, begin_suppress_tokens=self.begin_suppress,
            logits_processors=[self.timestamp_rules] if self.options.timestamps else None,
        )

    def _max_tokens(self, prompt_len: int) -> int:
        """HF's rule: the checkpoint's max_length counts new tokens plus (up to half the context
        of) the prompt, capped by the decoder's positions."""
        limit = self.engine.max_decoder_len
        max_length = getattr(self.engine.generation_config, "max_length", None) or limit
        return max(1, min(max_length + min(limit // 2 - 1, prompt_len), limit) - prompt_len)

    # -- interpreting a window -----------------------------------------------
    def take(self, job: TranscriptionJob, out: RequestOutput) -> bool:
        """Take the finished request of the job's window; True if the job needs another request."""
        if out.error is not None:  # the request failed in the engine: its tokens are no window's decode
            raise RuntimeError(f"transcribing input {job.index} failed: {out.error}")
        if job.pending is not None:
            return self._take_alignment(job, out)
        completion = out.outputs[0]
        if job.language is None and self.tokens.is_multilingual:  # that was language detection
            job.language = self.tokens.language_of(completion.token_ids[0]) or "en"
            return True
        tokens = [t for t in completion.token_ids if t != self.tokens.eot]
        text = self.tokenizer.decode([t for t in tokens if t < self.tokens.eot])
        avg_logprob = (completion.cumulative_logprob or 0.0) / max(1, len(completion.token_ids))
        ratio = compression_ratio(text)
        temperature = self.options.temperatures[job.temperature_index]
        opts = self.options
        no_speech = out.no_speech_prob  # every window request asks for it (_params)
        improbable = opts.logprob_threshold is not None and avg_logprob < opts.logprob_threshold
        silence = opts.no_speech_threshold is not None and no_speech > opts.no_speech_threshold
        looped = opts.compression_ratio_threshold is not None and ratio > opts.compression_ratio_threshold
        failed = (looped or improbable) and not (silence and improbable)  # silence: no use retrying hotter
        if failed and job.temperature_index + 1 < len(opts.temperatures):
            job.temperature_index += 1
            return True
        job.temperature_index = 0
        job.window += 1
        if silence and not (opts.logprob_threshold is not None and avg_logprob > opts.logprob_threshold):
            job.seek += self._window_frames(job)  # skipped: no segment, nothing conditions the next window
            return job.long_form and self._advance(job)
        window = self._decoded_window(job, tokens, temperature, avg_logprob, ratio, no_speech)
        if self.options.word_timestamps:
            if self._alignable(job, window):
                job.pending = window  # the next request aligns its words
                return True
            for seg in window.segments:
                seg.words = []
        return self._commit(job, window)

    def _alignable(self, job: TranscriptionJob, window: DecodedWindow) -> bool:
        """Whether the window's words can be aligned: it has text, the text fits the decoder with
        the alignment prefix, and the audio spans at least two encoder positions."""
        text = self._text_tokens(window)
        fits = len(self._alignment_prefix(job)) + len(text) + 1 <= self.engine.max_decoder_len
        return bool(text) and fits and window.num_frames // INPUT_STRIDE >= 2

    def _take_alignment(self, job: TranscriptionJob, out: RequestOutput) -> bool:
        window, job.pending = job.pending, None
        text = self._text_tokens(window)
        prefix_len = len(self._alignment_prefix(job))
        probs = [math.exp(out.prompt_logprobs[prefix_len + k][t]) for k, t in enumerate(text)]
        alignment = find_alignment(out.cross_attentions, probs, text, prefix_len, window.num_frames,
                                   self.tokenizer, self.tokens.eot, job.language)
        add_word_timestamps(window.segments, alignment, self.tokens.eot, window.offset, job.last_speech)
        end = window.last_word_end
        if job.long_form and not window.single_ending and end is not None and end > window.offset:
            window.seek = round(end * FRAMES_PER_SECOND)  # openai-whisper: seek to the last word's end
        threshold = self.options.hallucination_silence_threshold
        if threshold is not None:
            cut = cut_hallucinations(window.segments, threshold, job.seek, window.num_frames, window.single_ending,
                                     job.last_speech, job.num_frames)
            if cut.discard:  # as if never decoded: no segments, the last speech stays
                job.seek = cut.seek
                return self._advance(job)
            del window.segments[cut.keep :]
            if cut.seek is not None:
                window.seek = cut.seek
        return self._commit(job, window)

    def _commit(self, job: TranscriptionJob, window: DecodedWindow) -> bool:
        """Keep the window's segments and move past it. As openai-whisper and faster-whisper: an
        instantaneous or empty segment is dropped, and only kept segments' tokens condition the next
        window."""
        for seg in window.segments:
            if seg.text.strip() and seg.start != seg.end:
                seg.id = len(job.segments)
                job.segments.append(seg)
                job.tokens.extend(seg.tokens)
        job.seek = window.seek
        if window.temperature > 0.5:
            job.prompt_reset = len(job.tokens)
        if self.options.word_timestamps and window.segments:  # the last speech: its last word, or segment
            job.last_speech = speech_end(window.segments)
        return job.long_form and self._advance(job)

    @staticmethod
    def _window_frames(job: TranscriptionJob) -> int:
        """Mel frames of audio the current window covers."""
        if not job.long_form:
            return job.num_frames
        return min(N_FRAMES, job.num_frames - job.seek, job.clips[job.clip_index][1] - job.seek)

    def _decoded_window(self, job: TranscriptionJob, tokens: list[int], temperature: float, avg_logprob: float,
                        ratio: float, no_speech: float) -> DecodedWindow:
        """Cut the window's tokens into segments at consecutive timestamp tokens (openai-whisper)."""
        begin = self.tokens.timestamp_begin
        offset = job.seek / FRAMES_PER_SECOND
        window_frames = self._window_frames(job)
        is_ts = [t >= begin for t in tokens]
        cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        single_ending = len(tokens) >= 2 and not is_ts[-2] and is_ts[-1]
        pieces = []
        seek = job.seek + window_frames
        if cuts:
            if single_ending:
                cuts.append(len(tokens))
            last = 0
            for cut in cuts:
                piece = tokens[last:cut]
                pieces.append((piece, offset + (piece[0] - begin) * TIME_PRECISION,
                               offset + (piece[-1] - begin) * TIME_PRECISION))
                last = cut
            if job.long_form and not single_ending:
                seek = job.seek + (tokens[last - 1] - begin) * INPUT_STRIDE
        else:
            duration = window_frames / FRAMES_PER_SECOND
            stamps = [t for t in tokens if t >= begin]
            if stamps and stamps[-1] != begin:
                duration = (stamps[-1] - begin) * TIME_PRECISION
            pieces.append((tokens, offset, offset + duration))
        segments = [Segment(0, round(start, 3), round(end, 3),
                            self.tokenizer.decode([t for t in piece if t < self.tokens.eot]), piece, temperature,
                            avg_logprob, ratio, no_speech) for piece, start, end in pieces]
        return DecodedWindow(segments, seek, offset, window_frames, single_ending, temperature)

    def result(self, job: TranscriptionJob) -> Transcription:
        if job.error is not None:
            return Transcription("", None, [], 0.0, job.source, error=job.error)
        text = "".join(s.text for s in job.segments)
        return Transcription(text, job.language or "en", job.segments, round(job.duration, 3), job.source)
