"""The speech a VAD found, cut out of a recording and joined end to end, and the way back: times on the
joined speech mapped onto the recording (faster-whisper's `collect_chunks` and `SpeechTimestampsMap`).

    recording   |--silence--[ span 0 ]--silence--[ span 1 ][ span 2 ]--noise--[ span 3 ]--|
    joined                  [ span 0 ][ span 1 ][ span 2 ][ span 3 ]
    chunks                  [ chunk 0: spans 0-1 ][ chunk 1: spans 2-3 ]     (each at most 30 s)
    one span    [pad|     speech the VAD heard (its core)     |pad]

A time on the joined speech lies in one span; adding the audio removed before that span gives the
time on the recording. Three refinements over faster-whisper's map:
- a chunk's times map through its own spans only, so a timestamp past a chunk's end stays beside
  that chunk's speech instead of jumping over the next gap;
- a time in the padding the VAD added beside removed audio moves to the edge of the speech it
  heard (the padding keeps speech from being cut; no speech was heard there, and Whisper likes to
  start a window's first segment and word at its very start);
- a segment without words whose start (end) lies within JOIN_SNAP_SECONDS before (after) a join
  starts (ends) on the other side: Whisper puts a boundary somewhere in the pause it hears, and
  on the wrong side of a join the segment would stretch over all the audio removed there.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from encdec_engine.inputs.audio import HOP_LENGTH, SAMPLE_RATE
from encdec_engine.speech.results import Segment

JOIN_SNAP_SECONDS = 1.0  # how far Whisper's segment boundaries miss a pause, at most (seconds)


@dataclass(frozen=True)
class SpeechTimeline:
    """Speech spans of a recording, joined, and grouped into chunks that are decoded on their own."""

    spans: tuple[tuple[int, int], ...]  # [(start, end)] samples of speech in the recording, ascending
    num_samples: int  # samples in the recording
    chunks: tuple[tuple[int, int], ...]  # [(first, last + 1)] span indices of each chunk, in order
    pad: int = 0  # samples of padding the VAD added on each side of the speech it heard

    @classmethod
    def of(cls, spans: Sequence[tuple[int, int]], num_samples: int, pad: int = 0,
           max_chunk_samples: int | None = None) -> SpeechTimeline:
        """Spans grouped into chunks: consecutive spans join a chunk while its speech stays within
        `max_chunk_samples` (None: one chunk of everything), as faster-whisper's collect_chunks. A span
        shorter than a mel frame (10 ms, only possible at the end of the audio) holds nothing to decode."""
        spans = [(start, end) for start, end in spans if end - start >= HOP_LENGTH]
        chunks, first, size = [], 0, 0
        for i, (start, end) in enumerate(spans):
            if max_chunk_samples is not None and i > first and size + end - start > max_chunk_samples:
                chunks.append((first, i))
                first, size = i, 0
            size += end - start
        if spans:
            chunks.append((first, len(spans)))
        return cls(tuple(spans), num_samples, tuple(chunks), pad)

    @property
    def duration(self) -> float:
        """Seconds in the recording."""
        return self.num_samples / SAMPLE_RATE

    def join(self, samples: np.ndarray) -> np.ndarray:
        """[joined samples] the speech of the recording's [num_samples], end to end."""
        return np.concatenate([samples[start:end] for start, end in self.spans] or [samples[:0]])

    def chunk_frames(self) -> list[tuple[int, int]]:
        """[(start, end)] mel frames of each chunk on the joined speech."""
        starts = self._joined_starts()
        return [(starts[a] // HOP_LENGTH, starts[b] // HOP_LENGTH) for a, b in self.chunks]

    def restore(self, segments: Sequence[Segment], chunk: int) -> list[Segment]:
        """Copies of a chunk's segments (and words) with times on the recording. As faster-whisper: a
        word maps through the span holding its middle, and a segment with words spans them."""
        if not segments:
            return []
        starts = [t / SAMPLE_RATE for t in self._joined_starts()]  # seconds on the joined speech
        cores, removed = self._cores(), self._removed_before()
        first, last = self.chunks[chunk]

        def span_of(t: float, is_end: bool = False) -> int:
            """The chunk's span holding joined time t (an end on a span's end stays in it)."""
            find = bisect.bisect_left if is_end else bisect.bisect_right
            return min(max(find(starts, t) - 1, first), last - 1)

        def original(t: float, span: int) -> float:
            lo, hi = cores[span]
            return round(min(max(t + self.spans[span][0] / SAMPLE_RATE - starts[span], lo), hi), 3)

        def boundaries(seg: Segment) -> tuple[float, float]:
            i, j = span_of(seg.start), span_of(seg.end, is_end=True)
            start, end = original(seg.start, i), original(seg.end, j)
            snapped_start, snapped_end = start, end
            if i + 1 < last and removed[i + 1] and starts[i + 1] - seg.start < JOIN_SNAP_SECONDS:
                snapped_start = original(starts[i + 1], i + 1)
            if j > first and removed[j] and seg.end - starts[j] < JOIN_SNAP_SECONDS:
                snapped_end = original(starts[j], j - 1)
            return (snapped_start, snapped_end) if snapped_start <= snapped_end else (start, end)

        restored = []
        for seg in segments:
            if seg.words:
                words = [dataclasses.replace(w, start=original(w.start, k), end=original(w.end, k))
                         for w in seg.words for k in [span_of((w.start + w.end) / 2)]]
                restored.append(dataclasses.replace(seg, start=words[0].start, end=words[-1].end, words=words))
            else:
                start, end = boundaries(seg)
                words = None if seg.words is None else []
                restored.append(dataclasses.replace(seg, start=start, end=end, words=words))
        return restored

    def _joined_starts(self) -> list[int]:
        """[num_spans + 1] the sample where each span starts once joined (the last: the joined length)."""
        return [0, *itertools.accumulate(end - start for start, end in self.spans)]

    def _removed_before(self) -> list[bool]:
        """[num_spans + 1] whether audio was removed before each span (the last: after the last span). The
        VAD pads speech in full beside removed audio; where spans touch, it split the pause between them."""
        bounds = [0, *[t for span in self.spans for t in span], self.num_samples]
        return [b - a >= HOP_LENGTH for a, b in zip(bounds[::2], bounds[1::2])]

    def _cores(self) -> list[tuple[float, float]]:
        """Seconds of each span without the padding the VAD added beside removed audio (where it heard
        speech). At the recording's edges the padding may not have fitted, so none is taken off there."""
        removed = self._removed_before()
        cores = []
        for k, (start, end) in enumerate(self.spans):
            lo = start + (self.pad if removed[k] else 0)
            hi = end - (self.pad if removed[k + 1] and end < self.num_samples else 0)
            lo, hi = (lo, hi) if lo <= hi else (start, end)
            cores.append((lo / SAMPLE_RATE, hi / SAMPLE_RATE))
        return cores
