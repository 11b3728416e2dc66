"""The state of one input's transcription: where the input has got to (`TranscriptionJob`), and a decoded
window waiting for its words to be aligned (`DecodedWindow`). Plain data, declared apart from the loop
so that the request and segment helpers can read it; the loop (transcriber.py) alone moves it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from encdec_engine.inputs.audio import HOP_LENGTH, SAMPLE_RATE
from encdec_engine.speech.results import Segment
from encdec_engine.speech.timeline import SpeechTimeline


@dataclass
class DecodedWindow:
    """A window's segments as decoded, before empty and instantaneous ones are dropped."""

    segments: list[Segment]
    seek: int  # mel frames done once the window is taken
    offset: float  # seconds: where the window starts
    num_frames: int  # mel frames of audio in the window
    single_ending: bool  # the text ended on a single timestamp token (the window is used up)
    temperature: float

    def text_tokens(self, eot: int) -> list[int]:
        """The window's text tokens (no timestamps or special tokens), as its words are aligned."""
        return [t for seg in self.segments for t in seg.tokens if t < eot]


@dataclass(eq=False)  # a job is compared by identity: drivers track jobs, not their values
class TranscriptionJob:
    """One input's progress through its windows (chunked: one chunk's, beside its input's job)."""

    index: int  # the input's position in the call
    source: str | None  # the file name, when the input was a file
    samples: np.ndarray | None = None  # [num_samples] float32 mono at 16 kHz (VAD: its speech, joined)
    error: str | None = None  # why the input cannot be transcribed
    language: str | None = None  # None until detected (multilingual checkpoints without a language)
    mel: torch.Tensor | None = None  # log-mel [n_mels, frames]: the 30 s window, or (long-form) the recording
    seek: int = 0  # mel frames done
    temperature_index: int = 0  # into TranscribeOptions.temperatures: the current window's attempt
    window: int = 0  # windows taken so far
    tokens: list[int] = field(default_factory=list)  # all text + timestamp tokens so far (for conditioning)
    # None: the initial prompt and all tokens so far condition the next window; else only tokens[prompt_reset:]
    prompt_reset: int | None = None
    segments: list[Segment] = field(default_factory=list)
    pending: DecodedWindow | None = None  # a decoded window waiting for its word alignment
    last_speech: float = 0.0  # seconds: end of the last word so far (word timestamps)
    long_form: bool = False  # openai-whisper's windows over the whole log-mel (else: one HF window)
    clips: list[tuple[int, int]] = field(default_factory=list)  # mel frames [start, end) to transcribe
    clip_index: int = 0
    part: int = 0  # chunked: which chunk of the input this job transcribes
    parts: list[TranscriptionJob] = field(default_factory=list)  # chunked: the input's chunk jobs, in order
    speech: SpeechTimeline | None = None  # VAD: where the joined speech in `samples` lies in the input

    @property
    def duration(self) -> float:
        """Seconds of audio decoded (VAD: of speech)."""
        return 0.0 if self.samples is None else len(self.samples) / SAMPLE_RATE

    @property
    def num_frames(self) -> int:
        """Mel frames of audio (10 ms each)."""
        return 0 if self.samples is None else len(self.samples) // HOP_LENGTH

    @property
    def done(self) -> bool:
        """Nothing left to transcribe (every clip is done)."""
        return self.long_form and self.clip_index >= len(self.clips)
