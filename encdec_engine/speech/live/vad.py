"""Turn detection on a live stream: Silero VAD frame by frame as audio arrives, and OpenAI's `server_vad`
rules over its speech probabilities.

Silero's network takes a 32 ms frame (512 samples at 16 kHz) after the last 64 samples of the frame
before, and an LSTM state it returns updated. `SileroStream` keeps that state and context for one
stream, so its probabilities equal silero's own frame loop over the whole recording however the audio
is chunked. The network itself is shared by every stream (it holds no state of its own), and one call
of it takes any number of streams' new frames (`push_streams`): a call costs about as much for one
frame as for thirty, so the server gathers the streams' appends into one call (`async_driver.VadBatch`).

    probability  . . . . # # # # # # . # # . . . . . . . . . . . . # # ...
                         ^ start                  ^ stop: silence_duration_ms below neg_threshold
    turn audio       [<-- prefix_padding_ms --][...............]  (the silence is part of the turn)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from encdec_engine.inputs.audio import SAMPLE_RATE
from encdec_engine.machine.threads import one_thread
from encdec_engine.speech.live.options import TurnDetection
from encdec_engine.speech.vad import CONTEXT_SAMPLES, FRAME_SAMPLES, SileroVad, State, shared_vad


class SileroStream:
    """Speech probabilities of one stream's 32 ms frames, as its audio arrives in chunks of any size."""

    def __init__(self) -> None:
        self.vad: SileroVad = shared_vad()
        self.state: State | None = None  # the LSTM's after the last frame
        self.context = torch.zeros(CONTEXT_SAMPLES)
        self.rest = np.zeros(0, dtype=np.float32)  # samples of a frame not complete yet

    def push(self, samples: np.ndarray) -> np.ndarray:
        """[frames] probability of every frame completed by these [num_samples] 16 kHz samples."""
        return push_streams([(self, samples)])[0]

    def _frames(self, samples: np.ndarray) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """The frames these samples complete ([frames, CONTEXT_SAMPLES + FRAME_SAMPLES], each after the
        context before it), and the rest and context to keep once they are read (nothing changes here)."""
        audio = np.concatenate([self.rest, np.asarray(samples, dtype=np.float32)])
        count = len(audio) // FRAME_SAMPLES
        flat = torch.cat([self.context, torch.from_numpy(audio[: count * FRAME_SAMPLES].copy())])
        size = CONTEXT_SAMPLES + FRAME_SAMPLES
        frames = flat.unfold(0, size, FRAME_SAMPLES) if count else flat.new_zeros(0, size)
        return frames, audio[count * FRAME_SAMPLES :], flat[len(flat) - CONTEXT_SAMPLES :].clone()


@one_thread()
def push_streams(pushes: Sequence[tuple[SileroStream, np.ndarray]]) -> list[np.ndarray]:
    """`SileroStream.push` of several streams (each at most once) in one call of the network, on one of
    torch's threads (a call's ops are too small to split, and the engine's steps hold the cores). Should
    the call raise, no stream has changed."""
    if len({id(stream) for stream, _ in pushes}) < len(pushes):
        raise ValueError("push_streams takes each stream at most once: its second push needs the first's state")
    read = [stream._frames(samples) for stream, samples in pushes]
    probs = [np.zeros(0, dtype=np.float32) for _ in pushes]
    rows = [i for i, (frames, _, _) in enumerate(read) if len(frames)]
    states = [stream.state for stream, _ in pushes]
    if rows:
        got, after = pushes[rows[0]][0].vad.rows([read[i][0] for i in rows], [states[i] for i in rows])
        for row, i in enumerate(rows):
            probs[i], states[i] = got[row].numpy(), after[row]
    for (stream, _), (_, rest, context), state in zip(pushes, read, states):
        stream.rest, stream.context, stream.state = rest, context, state
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
        return self.take(self.vad.push(samples))

    def take(self, probs: np.ndarray) -> list[Mark]:
        """The turn boundaries of the next frames, given their speech probabilities (`self.vad`'s, as
        `push_streams` gives them for several streams at once), in order."""
        o = self.options
        pad = o.prefix_padding_ms * SAMPLE_RATE // 1000
        silence = o.silence_duration_ms * SAMPLE_RATE // 1000
        marks = []
        for prob in probs:
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
