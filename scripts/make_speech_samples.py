#!/usr/bin/env python3
"""Generate the small synthetic speech set in ``prompts/audio/`` with espeak-ng.

Writes short 16 kHz mono 16-bit WAV clips (several voices and speeds), one stereo
44.1 kHz clip (exercises resampling and downmixing), one ~70 s FLAC clip for
long-form tests, and ``transcripts.json`` mapping file name -> spoken text; and
in ``multilingual/`` one short clip in each of seven other languages, with its
own ``transcripts.json``.
espeak-ng and the resampler are deterministic, so reruns give identical files.

Usage: python scripts/make_speech_samples.py [--out prompts/audio]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import librosa
import numpy as np
import soundfile as sf

ESPEAK_RATE = 22050  # Hz, espeak-ng's native output rate
SAMPLE_RATE = 16000  # Hz


@dataclass(frozen=True)
class Clip:
    name: str
    text: str
    voice: str = "en-us"
    speed: int = 150  # words per minute
    rate: int = SAMPLE_RATE  # Hz of the written file
    stereo: bool = False


LONG_TEXT = (
    "Good morning everyone, and thank you for joining the weekly planning meeting. "
    "First, let us review what happened last week. The team finished the new search page, "
    "and the early feedback from customers has been very positive. "
    "Several people said the results are faster and easier to read. "
    "However, we also found a problem with the mobile version, where some buttons are too small. "
    "Sarah will look into that and share a fix by the end of the week. "
    "Next, we need to talk about the budget for the coming quarter. "
    "Finance asked every group to reduce travel costs, so most visits will happen online. "
    "If you have a trip that cannot be moved, please send the details to Mark before Friday. "
    "The last topic is hiring. We have two open positions, one for a designer and one for a data engineer. "
    "Please share the job posts with friends who might be interested. "
    "That is everything for today. Thank you all, and have a great week."
)

CLIPS = (
    Clip("fox.wav", "The quick brown fox jumps over the lazy dog.", voice="en-us+f2", speed=140),
    Clip("weather.wav", "Today is a beautiful day to go for a walk in the park.", voice="en-us+m3"),
    Clip("stella.wav", "Please call Stella and ask her to bring these things with her from the store."),
    Clip("learning.wav", "Machine learning models can turn speech into written text.", voice="en-us+f3", speed=130),
    Clip("thanks_fast.wav", "Thank you very much for your help with this project.", speed=200),
    Clip("coffee.wav", "I would like a cup of coffee with milk, please.", voice="en-gb-x-rp", speed=140),
    Clip("meeting_stereo_44k.wav", "Welcome to the team meeting, let us get started.", rate=44100, stereo=True),
    Clip("long_meeting.flac", LONG_TEXT, speed=135),
)

# Other languages, written to <out>/multilingual/ and named by language code, for the checks on real
# multilingual weights (tests/speech/test_multilingual_real.py, Whisper base). Voices and speeds are the
# ones, of espeak-ng's variants tried, that base hears as the language spoken, Russian excepted (base
# detects Polish in every Russian variant tried).
MULTILINGUAL = (
    Clip("de.wav", "Das Wetter ist heute sehr schön, und wir gehen am Nachmittag in den Park.", voice="de+m3",
         speed=130),
    Clip("fr.wav", "Je voudrais une tasse de café avec du lait, s'il vous plaît.", voice="fr+f2", speed=130),
    Clip("es.wav", "Mañana vamos a visitar a mis abuelos en el pueblo.", voice="es", speed=140),
    Clip("it.wav", "La cena è pronta, venite a tavola prima che si raffreddi.", voice="it+f2", speed=130),
    Clip("pt.wav", "O trem para São Paulo sai da estação às nove horas.", voice="pt-br+m3", speed=110),
    Clip("ja.wav", "きょうはとてもいいてんきですね。", voice="ja+f2", speed=130),
    Clip("ru.wav", "Завтра утром мы поедем на поезде в Москву.", voice="ru+m3", speed=120),
)


def synthesize(clip: Clip, workdir: Path) -> np.ndarray:
    """Speak ``clip.text`` with espeak-ng; returns float32 ``[num_samples]`` at ESPEAK_RATE."""
    raw = workdir / "raw.wav"
    cmd = ["espeak-ng", "-v", clip.voice, "-s", str(clip.speed), "-w", str(raw), clip.text]
    subprocess.run(cmd, check=True, capture_output=True)
    samples, rate = sf.read(raw, dtype="float32")
    assert rate == ESPEAK_RATE, f"espeak-ng wrote {rate} Hz"
    return samples


def render(clip: Clip, out_dir: Path, workdir: Path) -> float:
    """Write one clip; returns its duration in seconds."""
    samples = librosa.resample(synthesize(clip, workdir), orig_sr=ESPEAK_RATE, target_sr=clip.rate)
    samples = np.clip(samples, -1.0, 1.0)
    if clip.stereo:
        # Unequal channels, so a test can tell averaging from picking one channel.
        samples = np.stack([samples, 0.5 * samples], axis=1)  # samples: [num_samples, 2]
    fmt = "FLAC" if clip.name.endswith(".flac") else "WAV"
    sf.write(out_dir / clip.name, samples, clip.rate, subtype="PCM_16", format=fmt)
    return samples.shape[0] / clip.rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).resolve().parent.parent / "prompts" / "audio"
    parser.add_argument("--out", type=Path, default=default_out, help="output folder")
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install espeak-ng)")

    for clips, out in ((CLIPS, args.out), (MULTILINGUAL, args.out / "multilingual")):
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for clip in clips:
                seconds = render(clip, out, Path(tmp))
                print(f"{clip.name:28s} {seconds:5.1f} s  {clip.rate} Hz  {'stereo' if clip.stereo else 'mono'}")
        transcripts = {clip.name: clip.text for clip in clips}
        (out / "transcripts.json").write_text(json.dumps(transcripts, indent=2, ensure_ascii=False) + "\n",
                                              encoding="utf-8")
        total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        print(f"wrote {len(clips)} clips + transcripts.json to {out} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
