"""Audio loading: WAV, FLAC, Ogg and MP3 through libsndfile, other containers through ffmpeg, as float32 mono
at 16 kHz."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from encdec_engine.inputs import ffmpeg

SAMPLE_RATE = 16000  # Hz, the rate Whisper was trained on
N_FFT = 400  # samples per STFT window (25 ms)
HOP_LENGTH = 160  # samples between STFT frames (10 ms)
CHUNK_LENGTH = 30  # s, the fixed Whisper input window
N_SAMPLES = CHUNK_LENGTH * SAMPLE_RATE  # 480000 samples in a 30 s window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 frames in a 30 s mel
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100 mel frames per second
INPUT_STRIDE = 2  # mel frames per encoder position (Whisper's second conv has stride 2)

# Extensions we expect to decode; anything else is reported as unsupported, not corrupt.
AUDIO_EXTENSIONS = frozenset(
    {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".mp4", ".aac", ".wma", ".aiff", ".aif", ".webm", ".au",
     ".mkv", ".mka", ".mov", ".avi", ".3gp", ".amr", ".ac3", ".caf", ".wv"}  # the rest: containers ffmpeg reads
)

AudioSource = str | os.PathLike[str] | BinaryIO


class AudioError(ValueError):
    """An audio input could not be used; the message names the file."""


class AudioTooLong(AudioError):
    """The audio is longer than the caller's limit (found before or while decoding, never after
    decoding more than the limit)."""

    def __init__(self, seconds: float, limit: float, name: str, *, at_least: bool = False) -> None:
        more = "more than " if at_least else ""
        super().__init__(f"audio is {more}{seconds:.1f} s long; the limit is {limit:g} s: {name}")
        self.seconds, self.limit = seconds, limit


def _describe(source: AudioSource) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return str(getattr(source, "name", f"<{type(source).__name__}>"))


def to_mono_16k(samples: np.ndarray, sample_rate: int, *, channels_last: bool = True) -> np.ndarray:
    """Downmix and resample an in-memory signal to float32 mono at ``SAMPLE_RATE``.

    ``samples`` is ``[num_samples]`` or 2-D. A 2-D array is ``[num_samples, channels]``
    (soundfile's layout) by default, or ``[channels, num_samples]`` (librosa/torchaudio
    layout) with ``channels_last=False``; there is no guessing from the shape. Integer PCM
    is scaled to [-1, 1) by its type's range. Channels are averaged.
    Returns ``[num_samples_16k]`` float32.
    """
    return _to_mono(samples, sample_rate, SAMPLE_RATE, channels_last=channels_last)


def _to_mono(samples: np.ndarray, sample_rate: int, target_rate: int, *, channels_last: bool) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim not in (1, 2):
        raise AudioError(f"expected a 1-D or 2-D array of samples, got shape {samples.shape}")
    if samples.ndim == 2:
        num_samples, channels = samples.shape if channels_last else samples.shape[::-1]
        if channels > num_samples:
            layout = "[num_samples, channels]" if channels_last else "[channels, num_samples]"
            raise AudioError(f"2-D audio of shape {tuple(samples.shape)} has more channels than samples as "
                             f"{layout}; transpose it (librosa and torchaudio give [channels, num_samples])")
    if sample_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {sample_rate} -> {target_rate}")
    if np.issubdtype(samples.dtype, np.integer):
        info = np.iinfo(samples.dtype)
        # Unsigned PCM (e.g. 8-bit WAV) is centred on the middle of its range.
        offset = (int(info.max) + 1) // 2 if info.min == 0 else 0
        samples = (samples.astype(np.float32) - offset) / float(offset or -int(info.min))
    samples = samples.astype(np.float32, copy=False)
    if not np.isfinite(samples).all():
        raise AudioError(f"audio has {int(np.count_nonzero(~np.isfinite(samples)))} NaN or infinite samples")
    if samples.ndim == 2:  # one channel is taken as it is: no copy of an hour of samples
        axis = 1 if channels_last else 0
        if samples.shape[axis] > 1:
            samples = samples.mean(axis=axis)
        else:
            samples = samples[:, 0] if channels_last else samples[0]
    if sample_rate != target_rate and samples.size:
        samples = resample(samples, sample_rate, target_rate)
    return np.ascontiguousarray(samples, dtype=np.float32)


def resample(samples: np.ndarray, sample_rate: int, target_rate: int) -> np.ndarray:
    """``[num_samples]`` at `target_rate`: soxr's band-limited "HQ" resampler, to the length
    ceil(num_samples * target_rate / sample_rate) (what librosa.resample gives with its defaults)."""
    import soxr  # lazy: only a file at another rate needs it

    out = soxr.resample(samples, sample_rate, target_rate, quality="soxr_hq")
    n = int(np.ceil(len(samples) * target_rate / sample_rate))
    return out[:n] if len(out) >= n else np.pad(out, (0, n - len(out)))


def _decode_soundfile(source: AudioSource, max_seconds: float | None) -> tuple[np.ndarray, int]:
    import soundfile

    with soundfile.SoundFile(source) as f:
        if max_seconds is not None and f.samplerate > 0 and f.frames / f.samplerate > max_seconds:
            raise AudioTooLong(f.frames / f.samplerate, max_seconds, _describe(source))  # from the header
        # One frame past the limit tells "too long" without decoding the rest (headers can lie).
        frames = -1 if max_seconds is None else int(max_seconds * f.samplerate) + 1
        # always_2d gives one layout for every file: [num_samples, channels].
        return f.read(frames, dtype="float32", always_2d=True), f.samplerate


def read_header(source: AudioSource) -> tuple[float | None, int, int] | None:
    """(seconds, sample rate, channels) from a file's header, as libsndfile reads it, without decoding;
    None when libsndfile does not know the file (or it is missing). Seconds is None when the header
    gives no length."""
    import soundfile

    try:
        info = soundfile.info(source)
    except Exception:  # libsndfile raises several types for what it cannot read
        return None
    seconds = info.frames / info.samplerate if info.samplerate > 0 and info.frames > 0 else None
    return seconds, info.samplerate, info.channels


def format_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a file is in no format decoded here, from its first bytes alone (nothing is decoded): None when
    libsndfile reads its header or its first bytes name a container ffmpeg decodes, the two that
    `load_audio` tries, in that order; else the refusal `load_audio` would raise, naming the file. A file
    that passes may still be corrupt past its header."""
    if read_header(path) is not None:
        return None
    try:
        ffmpeg.sniff_file(str(path), str(path))
    except ffmpeg.FormatError as e:
        return str(e)
    except OSError as e:  # gone or locked since it was listed
        return f"cannot read {path}: {e.strerror or e}"
    return None


def load_audio(path_or_file: AudioSource, sr: int = SAMPLE_RATE, max_seconds: float | None = None,
               name: str | None = None) -> np.ndarray:
    """Decode an audio file (path or binary file object) to float32 mono at ``sr`` Hz.

    Reads WAV, FLAC, OGG/Vorbis/Opus and MP3 with libsndfile; for paths, the containers ffmpeg
    decodes (MP4/M4A, WebM/Matroska, WMA, ...: `inputs/ffmpeg.py`, which names the format by the
    file's first bytes, whatever its name, and refuses playlists and any file that refers to others).
    Any sample rate and channel count. Raises ``AudioError`` naming the file (``name``, default: the
    path) when it is missing, empty, has no samples, is in no format decoded here, or cannot be
    decoded, and ``AudioTooLong`` when it holds more than
    ``max_seconds`` of audio (decoding stops there). Returns ``[num_samples]``.
    """
    name = name or _describe(path_or_file)
    is_path = isinstance(path_or_file, (str, os.PathLike))
    if is_path:
        path = Path(path_or_file)
        if not path.exists():
            raise AudioError(f"audio file not found: {name}")
        if not path.is_file():
            raise AudioError(f"not a regular file: {name}")
        if path.stat().st_size == 0:
            raise AudioError(f"audio file is empty (0 bytes): {name}")
    try:
        data, rate = _decode_soundfile(path_or_file, max_seconds)
    except AudioTooLong as e:
        raise AudioTooLong(e.seconds, e.limit, name) from None
    except Exception as sf_error:  # libsndfile raises several types for bad input
        if not is_path:
            raise AudioError(f"cannot decode audio from {name}: not a supported audio format, or corrupt") from sf_error
        try:  # ffmpeg, with the demuxer its first bytes name (a file called "audio" or "x.dat" too)
            info = ffmpeg.probe(str(path_or_file), name)
            if max_seconds is not None and info.seconds is not None and info.seconds > max_seconds:
                raise AudioTooLong(info.seconds, max_seconds, name)  # from the container, before decoding
            data, rate = ffmpeg.decode(str(path_or_file), name, max_seconds, info)
        except ffmpeg.FormatError as e:
            raise AudioError(str(e)) from None
        except FileNotFoundError as e:  # no ffmpeg
            raise AudioError(f"cannot decode {name}: {e}") from None
    if data.size == 0:
        raise AudioError(f"audio file contains no samples: {name}")
    if max_seconds is not None and len(data) > max_seconds * rate:
        raise AudioTooLong(len(data) / rate, max_seconds, name, at_least=True)
    try:
        return _to_mono(data, rate, sr, channels_last=True)  # data: [num_samples, channels]
    except AudioError as e:
        raise AudioError(f"{e}: {name}") from None


def audio_samples(audio, max_seconds: float | None = None) -> np.ndarray:
    """Any audio input as float32 mono 16 kHz ``[num_samples]``: a ``(samples, sample_rate)``
    pair, an array already at 16 kHz, or a file path / binary file object.
    Raises ``AudioError`` (a ValueError) naming the problem, including no samples, and ``AudioTooLong``
    past ``max_seconds`` (a file's from its header where it tells, before decoding)."""
    if hasattr(audio, "detach"):  # a torch tensor
        audio = audio.detach().cpu().numpy()
    if isinstance(audio, (tuple, list)) and len(audio) == 2:
        samples = to_mono_16k(audio[0], audio[1])
    elif isinstance(audio, np.ndarray):
        samples = to_mono_16k(audio, SAMPLE_RATE)
    elif isinstance(audio, (bytes, bytearray)):
        return load_audio_bytes(bytes(audio), max_seconds=max_seconds)
    elif isinstance(audio, (str, os.PathLike)) or hasattr(audio, "read"):
        return load_audio(audio, max_seconds=max_seconds)  # names the file in its errors, empty files included
    else:
        raise AudioError(f"unsupported audio input of type {type(audio).__name__}: pass a path, file bytes, "
                         "a 1-D float array at 16 kHz or a (samples, sample_rate) pair")
    if samples.size == 0:
        raise AudioError("audio has no samples")
    if max_seconds is not None and len(samples) > max_seconds * SAMPLE_RATE:
        raise AudioTooLong(len(samples) / SAMPLE_RATE, max_seconds, "the array")
    return samples


def load_audio_bytes(data: bytes, name: str = "<bytes>", max_seconds: float | None = None) -> np.ndarray:
    """Decode in-memory file contents (e.g. an upload) to float32 mono 16 kHz ``[num_samples]``."""
    if not data:
        raise AudioError(f"audio data is empty (0 bytes): {name}")
    buffer = io.BytesIO(data)
    buffer.name = name  # so errors name the upload
    return load_audio(buffer, max_seconds=max_seconds)


def audio_inputs(audio) -> list:
    """One input (a path, file bytes, a 1-D array or tensor, a (samples, rate) pair) or a sequence of
    them -> a list."""
    one = (isinstance(audio, (str, Path, bytes, bytearray))
           or ((isinstance(audio, np.ndarray) or hasattr(audio, "detach")) and audio.ndim == 1)  # detach: a tensor
           or (isinstance(audio, tuple) and len(audio) == 2 and not isinstance(audio[0], (str, Path))))
    return [audio] if one else list(audio)
