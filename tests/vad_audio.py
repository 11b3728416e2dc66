"""Recordings with known speech: the bundled espeak-ng clips, with silence, white noise, babble or a
music-like tone between them (for the VAD tests and scripts/bench_vad.py). Deterministic: fixed seeds."""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import librosa
import numpy as np
import soundfile

from encdec_engine.inputs.audio import SAMPLE_RATE, load_audio

AUDIO = Path(__file__).resolve().parent.parent / "prompts" / "audio"
TRANSCRIPTS = json.loads((AUDIO / "transcripts.json").read_text())
CLIPS = ("fox.wav", "weather.wav", "stella.wav", "learning.wav", "thanks_fast.wav", "coffee.wav")
SPEECH_RMS = 0.1  # the clips' speech: RMS 0.08-0.12


@functools.lru_cache(maxsize=None)
def _clip(name: str) -> np.ndarray:
    return load_audio(AUDIO / name)


def clip(name: str) -> np.ndarray:
    """A bundled clip, 16 kHz mono (a copy: callers may change it)."""
    return _clip(name).copy()


def speech_extent(samples: np.ndarray) -> tuple[float, float]:
    """Seconds where a clip's speech starts and ends (espeak-ng leaves ~0.3 s of silence after it)."""
    _, (start, end) = librosa.effects.trim(samples, top_db=40)
    return start / SAMPLE_RATE, end / SAMPLE_RATE


def wav(samples: np.ndarray) -> bytes:
    """The samples as a 16-bit WAV file (an upload's bytes)."""
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * SAMPLE_RATE), dtype=np.float32)


def white_noise(seconds: float, rms: float = 0.03, seed: int = 0) -> np.ndarray:
    """Hiss 10 dB below the speech."""
    return (np.random.default_rng(seed).standard_normal(round(seconds * SAMPLE_RATE)) * rms).astype(np.float32)


def babble(seconds: float, rms: float = 0.003, seed: int = 0) -> np.ndarray:
    """Many voices at once, 30 dB below the speech: every bundled clip twice, reversed (unintelligible) and
    at random offsets. Silero VAD hears louder babble (25 dB below the speech or more) as speech."""
    rng = np.random.default_rng(seed)
    out = np.zeros(round(seconds * SAMPLE_RATE), dtype=np.float32)
    for name in CLIPS * 2:
        voice = clip(name)[::-1]
        start = int(rng.integers(-len(voice) // 2, len(out)))
        lo, hi = max(start, 0), min(start + len(voice), len(out))
        if hi > lo:
            out[lo:hi] += voice[lo - start : hi - start]
    return (out * rms / np.sqrt(np.mean(out**2))).astype(np.float32)


def tone(seconds: float, rms: float = 0.05, seed: int = 0) -> np.ndarray:
    """A music-like tone 6 dB below the speech: a melody of 0.4 s notes, each a decaying harmonic tone."""
    rng = np.random.default_rng(seed)
    note = np.arange(round(0.4 * SAMPLE_RATE)) / SAMPLE_RATE
    scale = 220.0 * 2 ** (np.array([0, 2, 4, 5, 7, 9, 11, 12]) / 12)
    notes = []
    for _ in range(int(np.ceil(seconds / 0.4))):
        f = rng.choice(scale)
        wave = sum(np.sin(2 * np.pi * f * k * note) / k for k in (1, 2, 3, 4))
        notes.append(wave * np.exp(-3 * note))
    out = np.concatenate(notes)[: round(seconds * SAMPLE_RATE)]
    return (out * rms / np.sqrt(np.mean(out**2))).astype(np.float32)


@dataclass
class Recording:
    """Clips and fillers end to end, with where each clip's speech lies."""

    samples: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    speech: list[tuple[float, float]] = field(default_factory=list)  # seconds of each clip's speech
    offsets: list[float] = field(default_factory=list)  # seconds where each clip starts
    clips: list[str] = field(default_factory=list)  # the clips' names, in order
    text: str = ""  # what is said

    def add(self, part: str | np.ndarray) -> Recording:
        """Append a clip (by name) or a filler (samples)."""
        start = len(self.samples) / SAMPLE_RATE
        if isinstance(part, str):
            samples = clip(part)
            a, b = speech_extent(samples)
            self.speech.append((start + a, start + b))
            self.offsets.append(start)
            self.clips.append(part)
            self.text = f"{self.text} {TRANSCRIPTS[part]}".strip()
        else:
            samples = part
        self.samples = np.concatenate([self.samples, samples])
        return self

    @property
    def gaps(self) -> list[tuple[float, float]]:
        """Seconds of no speech between (and around) the clips' speech."""
        bounds = [0.0, *[t for span in self.speech for t in span], len(self.samples) / SAMPLE_RATE]
        return [(a, b) for a, b in zip(bounds[::2], bounds[1::2]) if b > a]


def recording(*parts: str | np.ndarray) -> Recording:
    rec = Recording()
    for part in parts:
        rec.add(part)
    return rec


def fixtures(long: bool = False) -> dict[str, Recording]:
    """The test recordings: 10 s of silence, white noise, babble and a tone between utterances (and,
    with `long`, 60 s of silence)."""
    recs = {
        "silence10": recording(silence(0.5), "fox.wav", silence(10), "weather.wav", silence(1)),
        "white": recording("learning.wav", white_noise(6), "coffee.wav", white_noise(1, seed=1)),
        "babble": recording(babble(2), "stella.wav", babble(6, seed=1), "thanks_fast.wav"),
        "tone": recording("weather.wav", tone(6), "fox.wav", silence(0.5)),
    }
    if long:
        recs["silence60"] = recording("thanks_fast.wav", silence(60), "coffee.wav", silence(2))
    return recs
