"""Turn detection on a live stream: Silero VAD frame by frame as audio arrives, and OpenAI's `server_vad`
rules over its speech probabilities.

Silero's network takes a 32 ms frame (512 samples at 16 kHz) after the last 64 samples of the frame
before, and an LSTM state it returns updated. `SileroStream` keeps that state and context for one
stream, so its probabilities equal silero's own frame loop over the whole recording however the audio
is chunked. The network itself is shared by every stream (it holds no state of its own).

    probability  . . . . # # # # # # . # # . . . . . . . . . . . . # # ...
                         ^ start                  ^ stop: silence_duration_ms below neg_threshold
    turn audio       [<-- prefix_padding_ms --][...............]  (the silence is part of the turn)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from encdec_engine.inputs.audio import SAMPLE_RATE
from encdec_engine.machine.threads import one_thread
from encdec_engine.speech.live.options import TurnDetection

FRAME_SAMPLES = 512  # 32 ms at 16 kHz, the frame Silero VAD reads
CONTEXT_SAMPLES = 64  # samples of the frame before, prepended to each frame


@functools.lru_cache(maxsize=1)
def silero_network():
    """Silero VAD's 16 kHz network (from the silero-vad package: no download):
    (frames [n, 576], state [2, n, 128]) -> (speech probabilities [n, 1], state)."""
    threads = torch.get_num_threads()
    try:
        import silero_vad
    finally:
        torch.set_num_threads(threads)  # importing silero_vad sets one thread for the whole process
    return silero_vad.load_silero_vad()._model


class SileroStream:
    """Speech probabilities of one stream's 32 ms frames, as its audio arrives in chunks of any size."""

    def __init__(self) -> None:
        self.net = silero_network()
        self.state = torch.zeros(2, 1, 128)
        self.context = torch.zeros(CONTEXT_SAMPLES)
        self.rest = np.zeros(0, dtype=np.float32)  # samples of a frame not complete yet

    @torch.inference_mode()
    @one_thread()
    def push(self, samples: np.ndarray) -> np.ndarray:
        """[frames] probability of every frame completed by these [num_samples] 16 kHz samples (on one of
        torch's threads: a frame's ops are too small to split, and the engine's steps hold the cores)."""
        audio = np.concatenate([self.rest, np.asarray(samples, dtype=np.float32)])
        count = len(audio) // FRAME_SAMPLES
        self.rest = audio[count * FRAME_SAMPLES :]
        probs = np.zeros(count, dtype=np.float32)
        frames = torch.from_numpy(audio[: count * FRAME_SAMPLES].copy()).view(count, FRAME_SAMPLES)
        for i in range(count):
            x = torch.cat([self.context, frames[i]]).unsqueeze(0)  # x: [1, 576]
            prob, self.state = self.net(x, self.state)
            probs[i] = float(prob)
            self.context = frames[i, -CONTEXT_SAMPLES:]
        return probs


@dataclass(frozen=True)
class Mark:
    """A turn boundary found in the stream (sample positions from the stream's start)."""

    kind: str  # "start" (speech began) or "stop" (it ended)
    at: int  # where it was detected: the end of the frame that decided it
    boundary: int  # where the turn's audio starts (prefix padding before the first speech frame) or ends


class TurnDetector:
    """OpenAI's server_vad over a stream: a frame at or above `threshold` starts speech (the turn's audio
    begins `prefix_padding_ms` earlier); `silence_duration_ms` of frames below `neg_threshold` (a frame
    at or above `threshold` starts the count anew) stops it, the silence included in the turn."""

    def __init__(self, options: TurnDetection, origin: int = 0, speaking: bool = False) -> None:
        self.options = options
        self.vad = SileroStream()
        self.origin = origin  # the sample of the stream where the detector's first frame starts
        self.frames = 0  # frames read
        self.speaking = speaking
        self.silence_start: int | None = None  # sample where the current run of silence began

    def push(self, samples: np.ndarray) -> list[Mark]:
        """The turn boundaries these samples complete, in order."""
        o = self.options
        pad = o.prefix_padding_ms * SAMPLE_RATE // 1000
        silence = o.silence_duration_ms * SAMPLE_RATE // 1000
        marks = []
        for prob in self.vad.push(samples):
            start = self.origin + self.frames * FRAME_SAMPLES
            end = start + FRAME_SAMPLES
            self.frames += 1
            if not self.speaking:
                if prob >= o.threshold:
                    self.speaking, self.silence_start = True, None
                    marks.append(Mark("start", end, max(0, start - pad)))
                continue
            if prob >= o.threshold:
                self.silence_start = None
            elif prob < o.neg_threshold and self.silence_start is None:
                self.silence_start = start
            if self.silence_start is not None and end - self.silence_start >= silence:
                self.speaking, self.silence_start = False, None
                marks.append(Mark("stop", end, end))
        return marks
