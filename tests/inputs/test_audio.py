"""Audio loading: formats, resampling, downmixing and error messages."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from encdec_engine.inputs.audio import (
    N_SAMPLES,
    SAMPLE_RATE,
    AudioError,
    AudioTooLong,
    audio_samples,
    load_audio,
    load_audio_bytes,
    to_mono_16k,
)

AUDIO_DIR = Path(__file__).resolve().parents[2] / "prompts" / "audio"
TRANSCRIPTS = json.loads((AUDIO_DIR / "transcripts.json").read_text())
needs_ffmpeg = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg not installed")


def _ffmpeg(src: Path, dst: Path, *args: str) -> Path:
    cmd = ["ffmpeg", "-v", "error", "-y", "-i", str(src), *args, str(dst)]
    subprocess.run(cmd, check=True)
    return dst


@pytest.mark.parametrize("name", sorted(TRANSCRIPTS))
def test_sample_clips_load_as_16k_mono_float32(name: str) -> None:
    info = sf.info(AUDIO_DIR / name)
    audio = load_audio(AUDIO_DIR / name)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(audio.size / SAMPLE_RATE - info.duration) < 0.01
    assert 0.01 < np.abs(audio).max() <= 1.0


def test_long_clip_is_longer_than_one_window() -> None:
    audio = load_audio(AUDIO_DIR / "long_meeting.flac")
    assert 65 * SAMPLE_RATE < audio.size < 75 * SAMPLE_RATE
    assert audio.size > 2 * N_SAMPLES


def test_stereo_44k_is_resampled_and_averaged() -> None:
    raw, rate = sf.read(AUDIO_DIR / "meeting_stereo_44k.wav", dtype="float32")  # raw: [n, 2]
    assert rate == 44100 and raw.shape[1] == 2
    audio = load_audio(AUDIO_DIR / "meeting_stereo_44k.wav")
    assert abs(audio.size - round(raw.shape[0] * SAMPLE_RATE / rate)) <= 1
    # The second channel is half the first, so the downmix is 0.75 x the first channel.
    left = to_mono_16k(raw[:, 0], rate)
    np.testing.assert_allclose(audio, 0.75 * left, atol=1e-4)


def test_flac_equals_wav(tmp_path: Path) -> None:
    data, rate = sf.read(AUDIO_DIR / "fox.wav", dtype="int16")
    sf.write(tmp_path / "fox.flac", data, rate)
    np.testing.assert_array_equal(load_audio(tmp_path / "fox.flac"), load_audio(AUDIO_DIR / "fox.wav"))


@needs_ffmpeg
@pytest.mark.parametrize(
    ("source", "suffix", "args"),
    [
        ("meeting_stereo_44k.wav", ".mp3", []),  # stereo 44.1 kHz MP3
        ("fox.wav", ".ogg", ["-c:a", "libvorbis", "-ar", "48000"]),
        ("fox.wav", ".m4a", ["-c:a", "aac", "-ar", "22050"]),  # not in libsndfile: ffmpeg path
        ("fox.wav", ".mkv", ["-c:a", "libopus"]),  # a video container with an audio track
    ],
)
def test_compressed_formats(tmp_path: Path, source: str, suffix: str, args: list[str]) -> None:
    reference = load_audio(AUDIO_DIR / source)
    path = _ffmpeg(AUDIO_DIR / source, tmp_path / f"clip{suffix}", *args)
    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    # Lossy codecs add encoder delay/padding of a few tens of milliseconds.
    assert abs(audio.size - reference.size) < 0.1 * SAMPLE_RATE
    rms, ref_rms = np.sqrt(np.mean(audio**2)), np.sqrt(np.mean(reference**2))
    assert abs(rms / ref_rms - 1.0) < 0.1


@needs_ffmpeg
@pytest.mark.parametrize("suffix", [".wav", ".ogg", ".m4a"])  # libsndfile from memory and paths; ffmpeg
def test_decoding_stops_at_max_seconds(tmp_path: Path, suffix: str) -> None:
    """A file longer than the limit is refused from its header, before anything is decoded (a small
    compressed file can hold hours: decoding it all first is what the limit is there to prevent); where
    the header says nothing or lies, decoding stops at the limit."""
    path = _ffmpeg(AUDIO_DIR / "fox.wav", tmp_path / f"fox{suffix}")
    seconds = load_audio(path).size / SAMPLE_RATE
    message = rf"audio is [0-9.]+ s long; the limit is {seconds / 2:g} s: .*fox{suffix}"
    with pytest.raises(AudioTooLong, match=message) as e:
        load_audio(path, max_seconds=seconds / 2)
    assert e.value.limit == seconds / 2 and abs(e.value.seconds - seconds) < 0.1
    if suffix != ".m4a":
        with pytest.raises(AudioTooLong):
            load_audio_bytes(path.read_bytes(), path.name, max_seconds=seconds / 2)
    assert load_audio(path, max_seconds=seconds + 1).size == load_audio(path).size


def test_file_object_and_bytes() -> None:
    path = AUDIO_DIR / "coffee.wav"
    expected = load_audio(path)
    with open(path, "rb") as f:
        np.testing.assert_array_equal(load_audio(f), expected)
    np.testing.assert_array_equal(load_audio_bytes(path.read_bytes(), "coffee.wav"), expected)


def test_to_mono_16k_layouts_and_integer_pcm() -> None:
    rng = np.random.default_rng(0)
    stereo = rng.uniform(-1, 1, size=(8000, 2)).astype(np.float32)  # [n, channels]
    channels_last = to_mono_16k(stereo, 8000)
    channels_first = to_mono_16k(stereo.T, 8000, channels_last=False)
    np.testing.assert_array_equal(channels_last, channels_first)
    assert channels_last.shape == (16000,)

    pcm = np.array([0, 16384, -32768, 32767], dtype=np.int16)
    np.testing.assert_allclose(to_mono_16k(pcm, SAMPLE_RATE), [0.0, 0.5, -1.0, 32767 / 32768])
    pcm8 = np.array([128, 255, 0], dtype=np.uint8)  # unsigned 8-bit PCM is centred at 128
    np.testing.assert_allclose(to_mono_16k(pcm8, SAMPLE_RATE), [0.0, 127 / 128, -1.0])

    with pytest.raises(ValueError):
        to_mono_16k(np.zeros((2, 2, 2)), SAMPLE_RATE)
    with pytest.raises(ValueError):
        to_mono_16k(np.zeros(10), 0)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.wav"
    with pytest.raises(AudioError, match=r"not found.*nope.wav"):
        load_audio(path)


def test_empty_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    with pytest.raises(AudioError, match=r"empty.*empty.wav"):
        load_audio(path)
    with pytest.raises(AudioError, match=r"empty.*upload.wav"):
        load_audio_bytes(b"", "upload.wav")


def test_zero_sample_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "silent.wav"
    sf.write(path, np.zeros(0, dtype=np.int16), SAMPLE_RATE)
    assert path.stat().st_size > 0  # a valid header with no frames
    with pytest.raises(AudioError, match=r"no samples.*silent.wav"):
        load_audio(path)


def test_corrupt_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.wav"
    path.write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk" + bytes(range(256)) * 4)
    with pytest.raises(AudioError, match=r"cannot decode.*broken.wav"):
        load_audio(path)
    with pytest.raises(AudioError, match=r"cannot decode.*broken-upload.mp3"):
        load_audio_bytes(b"\x00\x01garbage" * 64, "broken-upload.mp3")


def test_unsupported_format_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("this is not audio\n" * 20)
    with pytest.raises(AudioError, match=r"notes.txt is not in an audio format this engine decodes \(WAV, "):
        load_audio(path)
    with pytest.raises(AudioError, match="not a regular file"):
        load_audio(tmp_path)
    with pytest.raises(AudioError):
        load_audio(io.BytesIO(b"not audio at all" * 32))


def test_channels_first_arrays_are_refused_not_read_as_two_samples():
    stereo = np.zeros((2, 16000), dtype=np.float32)
    with pytest.raises(AudioError, match=r"shape \(2, 16000\) has more channels than samples.*transpose"):
        audio_samples((stereo, 16000))
    assert audio_samples((stereo.T, 16000)).shape == (16000,)


def test_tensors_bytes_and_unknown_inputs():
    import torch

    assert audio_samples(torch.zeros(1600)).shape == (1600,)
    wav = (AUDIO_DIR / "fox.wav").read_bytes()
    assert np.array_equal(audio_samples(wav), load_audio(AUDIO_DIR / "fox.wav"))
    with pytest.raises(AudioError, match="unsupported audio input of type dict"):
        audio_samples({"x": 1})
