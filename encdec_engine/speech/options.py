"""Options of a transcription (openai-whisper's and faster-whisper's names), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from encdec_engine.speech.audio import CHUNK_LENGTH
from encdec_engine.speech.vad import VadOptions


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None  # None: English-only checkpoints use English; multilingual ones detect it
    task: str = "transcribe"  # or "translate" (multilingual checkpoints)
    timestamps: bool = True  # timed segments; False decodes with <|notimestamps|> (one segment per window)
    initial_prompt: str | None = None  # text that conditions the first window (<|startofprev|>)
    condition_on_previous_text: bool = True  # long-form: each window sees the previous window's text
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # fallback sequence
    compression_ratio_threshold: float | None = 2.4  # above: the window looped, retry hotter
    logprob_threshold: float | None = -1.0  # mean token log-probability below: retry hotter
    no_speech_threshold: float | None = 0.6  # no-speech probability above (and an improbable text): skip
    beam_size: int = 1  # beams per window at temperature 0 (1: greedy, as HF generate's default)
    word_timestamps: bool = False  # words with start, end and probability, from the cross-attention alignment
    best_of: int = 5  # samples per window when temperature > 0
    seed: int = 0  # sampling at temperature > 0 is seeded per window: reruns give the same text
    # Seconds: start,end[,start,end...] of the parts to transcribe ("0,10,20,30" or a list); an odd count's
    # last clip runs to the end of the audio. Empty: everything.
    clip_timestamps: tuple[float, ...] | str = ()
    # Seconds (needs word_timestamps): around a probable hallucination, silence at least this long is skipped.
    hallucination_silence_threshold: float | None = None
    # Audio over 30 s is cut at its quietest moments into windows decoded all at once (as faster-whisper's
    # batched pipeline decodes its chunks): faster for one long file, but no window sees an earlier one's text.
    chunked: bool = False
    # Silero VAD first: only the speech is decoded, joined end to end, and times map back onto the audio
    # (faster-whisper's vad_filter). With chunked, the speech is cut into chunks of at most 30 s instead.
    vad_filter: bool = False
    # VadOptions or a dict of its fields (faster-whisper's names). None: its defaults, or with chunked those
    # of faster-whisper's batched pipeline (speech of at most 30 s, 160 ms of silence ends it).
    vad_parameters: VadOptions | dict | None = None

    def __post_init__(self) -> None:
        for name in ("beam_size", "best_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        object.__setattr__(self, "clip_timestamps", _clip_timestamps(self.clip_timestamps))
        threshold = self.hallucination_silence_threshold
        if threshold is not None:
            if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold <= 0:
                raise ValueError(f"hallucination_silence_threshold must be a positive number of seconds, "
                                 f"got {threshold!r}")
            if not self.word_timestamps:
                raise ValueError("hallucination_silence_threshold needs word_timestamps=True (it judges words)")
        self._resolve_vad()

    @property
    def openai_windows(self) -> bool:
        """Whether every input, even one of 30 s or less, takes the long-form path (openai-whisper's
        features and seeking): clips and hallucination skips move within the audio."""
        return bool(self.clip_timestamps) or self.hallucination_silence_threshold is not None or self.vad_filter

    def _resolve_vad(self) -> None:
        """vad_parameters as VadOptions with faster-whisper's defaults (None without vad_filter)."""
        if not self.vad_filter:
            if self.vad_parameters is not None:
                raise ValueError("vad_parameters need vad_filter=True")
            return
        if self.clip_timestamps:
            raise ValueError("vad_filter and clip_timestamps cannot be combined: the VAD chooses what is transcribed")
        if self.vad_parameters is None and self.chunked:
            vad = VadOptions(max_speech_duration_s=CHUNK_LENGTH, min_silence_duration_ms=160)
        else:
            vad = VadOptions.of(self.vad_parameters)
        if self.chunked and vad.max_speech_duration_s > CHUNK_LENGTH:  # a span must fit one window
            vad = replace(vad, max_speech_duration_s=CHUNK_LENGTH)
        object.__setattr__(self, "vad_parameters", vad)


def _clip_timestamps(value) -> tuple[float, ...]:
    """Validated clip boundaries in seconds, ascending: start < end, each clip after the one before."""
    if isinstance(value, str):
        try:
            value = [float(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"clip_timestamps must be comma-separated seconds, got {value!r}") from None
    times = tuple(float(v) for v in value)
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise ValueError(f"clip_timestamps must be non-negative seconds, got {list(times)}")
    # Within a clip start < end; a clip may start where the one before ended.
    if any(b < a or (b == a and i % 2 == 0) for i, (a, b) in enumerate(zip(times, times[1:]))):
        raise ValueError(f"clip_timestamps must ascend (each clip's start < end <= the next start), got {list(times)}")
    return times
