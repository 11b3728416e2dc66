"""Probable hallucinations in silence (openai-whisper's `hallucination_silence_threshold`).

A segment whose first words are improbable, or implausibly short or long, is a probable
hallucination. After a window's words are timed, one that opens the window after a long silence
drops the window; one with silence (or more hallucination) on both sides ends the window there.
"""

from __future__ import annotations

from dataclasses import dataclass

from encdec_engine.inputs.audio import FRAMES_PER_SECOND, N_FRAMES
from encdec_engine.speech.results import Segment, Word
from encdec_engine.speech.word_timestamps import APPEND_PUNCTUATIONS, PREPEND_PUNCTUATIONS, speech_end

_ANOMALY_PUNCTUATION = PREPEND_PUNCTUATIONS + APPEND_PUNCTUATIONS


def word_anomaly_score(word: Word) -> float:
    """How unlike real speech a word's timing is: improbable, very short or very long words score."""
    duration = word.end - word.start
    score = 1.0 if word.probability < 0.15 else 0.0
    if duration < 0.133:
        score += (0.133 - duration) * 15
    if duration > 2.0:
        score += duration - 2.0
    return score


def is_segment_anomaly(segment: Segment | None) -> bool:
    """Whether a segment's first (up to 8) words look hallucinated (openai-whisper's rule)."""
    if segment is None or not segment.words:
        return False
    words = [w for w in segment.words if w.word not in _ANOMALY_PUNCTUATION][:8]
    score = sum(word_anomaly_score(w) for w in words)
    return score >= 3 or score + 0.01 >= len(words)


def _next_with_words(segments: list[Segment]) -> Segment | None:
    return next((s for s in segments if s.words), None)


@dataclass
class HallucinationCut:
    seek: int | None  # mel frames to go on from; None: the usual rule (the last word's end)
    keep: int  # segments of the window kept
    discard: bool = False  # the whole window is dropped as if never decoded


def cut_hallucinations(segments: list[Segment], threshold: float, seek: int, window_frames: int,
                       single_ending: bool, last_speech: float, total_frames: int) -> HallucinationCut:
    """openai-whisper's hallucination_silence_threshold over an aligned window starting at mel frame
    `seek` with `window_frames` frames of audio, of a recording of `total_frames` (times in seconds):

    - a window not used up goes on from its last word if more than `threshold` of the 30 s window
      is left after it, else from the end of its audio;
    - a probable hallucination first in the window, after more than `threshold` of silence, drops
      the window and goes on from the end of that silence;
    - a probable hallucination with silence (or more hallucination) on both sides ends the window
      there, and decoding goes on from it.
    """
    time_offset, window_end = seek / FRAMES_PER_SECOND, (seek + N_FRAMES) / FRAMES_PER_SECOND
    cut = HallucinationCut(None, len(segments))
    end = speech_end(segments)
    if not single_ending and end is not None and end > time_offset:
        cut.seek = round(end * FRAMES_PER_SECOND) if window_end - end > threshold else seek + window_frames
    first = _next_with_words(segments)
    if is_segment_anomaly(first) and first.start - time_offset > threshold:
        return HallucinationCut(seek + round((first.start - time_offset) * FRAMES_PER_SECOND), 0, discard=True)
    last_end = last_speech
    for i, segment in enumerate(segments):
        if not segment.words:
            continue
        if is_segment_anomaly(segment):
            following = _next_with_words(segments[i + 1 :])
            next_start = following.words[0].start if following is not None else time_offset + window_frames / FRAMES_PER_SECOND
            silence_before = (segment.start - last_end > threshold or segment.start < threshold
                              or segment.start - time_offset < 2.0)
            silence_after = (next_start - segment.end > threshold or is_segment_anomaly(following)
                             or window_end - segment.end < 2.0)
            if silence_before and silence_after:
                resume = round(max(time_offset + 1, segment.start) * FRAMES_PER_SECOND)
                if total_frames / FRAMES_PER_SECOND - segment.end < threshold:
                    resume = total_frames  # nothing but silence left
                return HallucinationCut(resume, i)
        last_end = segment.end
    return cut

