"""Result assembly: a window's tokens cut into timed segments (openai-whisper's consecutive timestamps),
what the fallback rules judge it by, and a finished job (or its chunks, in order) made into a
`Transcription`. Reads a job, never writes it: the loop (transcriber.py) keeps what it decides."""

from __future__ import annotations

import dataclasses

from encdec_engine.checkpoints.whisper.tokens import TIME_PRECISION, WhisperTokens
from encdec_engine.inputs.audio import FRAMES_PER_SECOND, INPUT_STRIDE
from encdec_engine.speech.fallback import WindowQuality, compression_ratio
from encdec_engine.speech.job import DecodedWindow, TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.ranking import Candidate
from encdec_engine.speech.results import Segment, Transcription


class ResultAssembler:
    """A window's tokens into segments, and a job into its Transcription, with the call's tokenizer."""

    def __init__(self, options: TranscribeOptions, tokens: WhisperTokens, tokenizer) -> None:
        self.options = options
        self.tokens = tokens
        self.tokenizer = tokenizer

    def text(self, token_ids: list[int]) -> str:
        """The text of tokens, timestamps and special tokens left out."""
        return self.tokenizer.decode([t for t in token_ids if t < self.tokens.eot])

    def quality(self, chosen: Candidate, forced: list[int], no_speech_prob: float) -> WindowQuality:
        """What the fallback rules judge a window by: the chosen candidate's mean log-probability,
        and the compression ratio of its stripped text, a forced start included (faster-whisper)."""
        return WindowQuality(chosen.avg_logprob, compression_ratio(self.text(forced + chosen.tokens).strip()),
                             no_speech_prob)

    def decoded_window(self, job: TranscriptionJob, tokens: list[int], window_frames: int, temperature: float,
                       quality: WindowQuality) -> DecodedWindow:
        """Cut the window's tokens (a forced start, then the generated ones before <|endoftext|>) into
        segments at consecutive timestamp tokens (openai-whisper). window_frames: mel frames of audio
        in the window. Times past the end of the audio (or of the clip) are clamped to it; `seek`
        follows the tokens, as openai-whisper's."""
        begin = self.tokens.timestamp_begin
        offset = job.seek / FRAMES_PER_SECOND
        is_ts = [t >= begin for t in tokens]
        cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        single_ending = len(tokens) >= 2 and not is_ts[-2] and is_ts[-1]
        pieces = []  # (tokens, start, end in seconds)
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
        limit = self.end_of_audio(job)
        segments = [Segment(0, round(min(start, limit), 3), round(min(end, limit), 3), self.text(piece), piece,
                            temperature, quality.avg_logprob, quality.compression_ratio, quality.no_speech_prob)
                    for piece, start, end in pieces]
        return DecodedWindow(segments, seek, offset, window_frames, single_ending, temperature)

    @staticmethod
    def end_of_audio(job: TranscriptionJob) -> float:
        """Seconds no time may pass: the end of the audio, or of the current clip."""
        if job.long_form and job.clip_index < len(job.clips):
            return job.clips[job.clip_index][1] / FRAMES_PER_SECOND
        return job.num_frames / FRAMES_PER_SECOND

    def result(self, job: TranscriptionJob) -> Transcription:
        """The input's transcript: its segments, or its chunks' segments in order (renumbered), with
        VAD mapped from the joined speech back onto the input's timeline."""
        if job.error is not None:
            return Transcription("", None, [], 0.0, job.source, error=job.error, index=job.index)
        if job.parts:  # each chunk numbered its own segments
            for i, seg in enumerate(seg for part in job.parts for seg in part.segments):
                seg.id = i
        segments = [seg for part in job.parts or [job] for seg in self.on_timeline(job, part.part, part.segments)]
        duration = job.duration if job.speech is None else job.speech.duration
        text = "".join(s.text for s in segments)
        return Transcription(text, job.language or "en", segments, round(duration, 3), job.source, index=job.index)

    def on_timeline(self, job: TranscriptionJob, part: int, segments: list[Segment]) -> list[Segment]:
        """Segments of the input's job (or of its chunk `part`) as the caller sees them: with VAD, copies
        mapped from the joined speech back onto the input's timeline (the job keeps the joined times),
        without the words unless they were asked for (they only placed the segments on the speech)."""
        if job.speech is None:
            return segments
        restored = job.speech.restore(segments, part)
        if self.options.word_timestamps:
            return restored
        return [dataclasses.replace(seg, words=None) for seg in restored]


def clamp_words(segments: list[Segment], limit: float) -> None:
    """Word times, and the segment times moved to them, end at `limit` (the end of the audio or clip)."""
    for seg in segments:
        seg.start, seg.end = min(seg.start, limit), min(seg.end, limit)
        for word in seg.words or ():
            word.start, word.end = min(word.start, limit), min(word.end, limit)
