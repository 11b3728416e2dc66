"""Long recordings built from the bundled espeak-ng clips (prompts/audio), for the fidelity tests and
scripts/openai_whisper_reference.py. Each is a list of (clip, seconds of silence after it).

- repeated_phrase (34.6 s, six utterances): "Welcome to the team meeting, let us get started" four
  times, then the Stella sentence twice. The repetition pushes the first window's compression
  ratio over 2.4, so it falls back through every temperature to 1.0, where the engine's five
  samples (seed 0) are 10 to 90 tokens long; ranking them by their summed log-probability kept
  the 10-token "STEP Welcome to pharmacy meeting, Deborah" (mean log-prob -4.8): three of the four
  meeting sentences lost. By the mean (openai-whisper) an 80-token sample with all four is kept.
  (With the gaps 1.0/1.4/1.2/3.2/4.2 s the no-speech probability is 0.61 and no sample at 1.0 has a
  mean above -1, so openai-whisper's rules skip the window whatever the ranking: the layout
  matters, and this one is held fixed.)
- thanks_ten_times (44.0 s): one clip ten times, 4.4 s apart. Its windows fall back too, and the
  last segment's timestamp runs past the end of the audio (46.6 s before times were clamped).
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import numpy as np

from encdec_engine.inputs.audio import SAMPLE_RATE, load_audio

AUDIO = Path(__file__).resolve().parent.parent / "prompts" / "audio"
MEETING, STELLA, THANKS = "meeting_stereo_44k.wav", "stella.wav", "thanks_fast.wav"

RECORDINGS: dict[str, list[tuple[str, float]]] = {
    "repeated_phrase": [(MEETING, 1.2), (MEETING, 1.4), (MEETING, 1.2), (MEETING, 3.2), (STELLA, 4.0), (STELLA, 0.3)],
    "thanks_ten_times": [(THANKS, 4.4 - 2.64)] * 10,
}


def spoken_text(name: str) -> str:
    """What is said in a recording (bundled file or built one), from prompts/audio/transcripts.json."""
    transcripts = json.loads((AUDIO / "transcripts.json").read_text())
    if name in transcripts:
        return transcripts[name]
    return " ".join(transcripts[clip] for clip, _ in RECORDINGS[name])


def utterances(name: str) -> list[str]:
    """The spoken text of each utterance of a built recording, in order."""
    transcripts = json.loads((AUDIO / "transcripts.json").read_text())
    return [transcripts[clip] for clip, _ in RECORDINGS[name]]


def build(name: str) -> np.ndarray:
    """[num_samples] float32 at 16 kHz: the clips of RECORDINGS[name] with their silences."""
    parts = []
    for clip, silence in RECORDINGS[name]:
        parts += [load_audio(AUDIO / clip), np.zeros(round(silence * SAMPLE_RATE), dtype=np.float32)]
    return np.concatenate(parts)


def words(text: str) -> list[str]:
    """Lower-case words, punctuation and hyphens as spaces (for matching speech against a transcript)."""
    return re.sub(r"[^\w\s']|_", " ", text.lower()).replace("'", "").split()


def missing_utterances(name: str, transcript: str, min_share: float = 0.5) -> list[str]:
    """The utterances of recording `name` of which less than `min_share` of the words are found in
    the transcript, in order (difflib's longest matching blocks: a repeated sentence must be there
    as often as it is spoken)."""
    spoken = [words(u) for u in utterances(name)]
    flat = [w for u in spoken for w in u]
    matched = [False] * len(flat)
    for block in difflib.SequenceMatcher(None, flat, words(transcript), autojunk=False).get_matching_blocks():
        matched[block.a : block.a + block.size] = [True] * block.size
    missing, start = [], 0
    for text, u in zip(utterances(name), spoken):
        if sum(matched[start : start + len(u)]) < min_share * len(u):
            missing.append(text)
        start += len(u)
    return missing
