"""An uploaded audio file on its way to a loaded job, with the memory it holds accounted for.

The audio endpoint reserves bytes from the server's `AudioMemory` before it reads the body, and
holds the reservation until the job ends; this module sizes it at each stage. The duration is
read from the container's header before anything is decoded (a 25 MB low-bitrate file can hold
hours), and decoding stops at the server's limit even when the header lies.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from encdec_engine.server.errors import APIError
from encdec_engine.inputs import ffmpeg
from encdec_engine.inputs.audio import (AUDIO_EXTENSIONS, N_SAMPLES, SAMPLE_RATE, AudioError, AudioTooLong, load_audio,
                                        load_audio_bytes, read_header)
from encdec_engine.speech.job import TranscriptionJob

# Containers libsndfile cannot read from memory; probed and decoded through a temporary file and ffmpeg.
_FFMPEG_ONLY = AUDIO_EXTENSIONS - {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au"}
_FLOAT = 4  # bytes per float32 sample or log-mel value
_MEL_FRAMES_PER_SECOND = 100
_ASSUMED_RATE, _ASSUMED_CHANNELS = 48000, 2  # what a header that does not say is counted as


@dataclass(frozen=True)
class Probe:
    """What the container's header says; None where it says nothing."""

    seconds: float | None
    sample_rate: int | None
    channels: int | None


def held_bytes(seconds: float, n_mels: int) -> int:
    """Bytes a loaded job holds for `seconds` of audio: samples at 16 kHz and the log-mel (long-form
    pads 30 s of silence), about 350 MB per hour with 80 mel bins."""
    return int((seconds * SAMPLE_RATE + N_SAMPLES) * _FLOAT
               + (seconds * _MEL_FRAMES_PER_SECOND + 3000) * n_mels * _FLOAT)


def decode_peak_bytes(upload_bytes: int, seconds: float, sample_rate: int, channels: int, n_mels: int) -> int:
    """Bytes held while decoding an upload: its bytes, its samples at their own rate and channels, and
    the loaded job."""
    return upload_bytes + int(seconds * sample_rate * channels * _FLOAT) + held_bytes(seconds, n_mels)


def largest_upload_bytes(max_upload_bytes: int, max_seconds: float) -> int:
    """What the largest upload the limits allow may hold while it decodes: the longest audio, at 48 kHz
    stereo (as a header that says nothing counts), into 128 mel bins (large-v3's)."""
    return decode_peak_bytes(max_upload_bytes, max_seconds, _ASSUMED_RATE, _ASSUMED_CHANNELS, 128)


def job_bytes(job: TranscriptionJob) -> int:
    """Bytes a loaded job really holds (its samples and log-mel)."""
    samples = 0 if job.samples is None else job.samples.nbytes
    mel = 0 if job.mel is None else job.mel.numel() * job.mel.element_size()
    return samples + mel


class UploadedAudio:
    """One upload's bytes (and, for ffmpeg-only containers, a temporary file holding them).
    Use as a context manager; `probe` and `decode` run in a worker thread."""

    def __init__(self, data: bytes, name: str, max_seconds: float) -> None:
        if not data:
            raise APIError(400, f"the uploaded file {name!r} is empty (0 bytes)", "file")
        self.data, self.name, self.max_seconds = data, name, max_seconds
        self.suffix = Path(name).suffix.lower()
        self.path: str | None = None

    def __enter__(self) -> UploadedAudio:
        return self

    def __exit__(self, *exc) -> None:
        if self.path is not None:
            os.unlink(self.path)
            self.path = None

    def probe(self) -> Probe:
        """Duration, rate and channels from the header alone; 413 if the duration is over the limit."""
        probe = self._probe_soundfile()
        if probe is None:  # m4a, webm, ... or a name that says nothing ("blob"): ffmpeg names the format by
            probe = self._probe_ffmpeg()  # its bytes, and refuses what it does not take
        probe = probe or Probe(None, None, None)
        if probe.seconds is not None and probe.seconds > self.max_seconds:
            raise too_long(probe.seconds, self.max_seconds)
        return probe

    def decode_peak_bytes(self, probe: Probe, n_mels: int) -> int:
        """Bytes held while decoding: the upload, the samples at the file's own rate and channels, and
        the loaded job. Unknown header fields count as the worst case the limits allow."""
        seconds = probe.seconds if probe.seconds is not None else self.max_seconds
        return decode_peak_bytes(len(self.data), seconds, probe.sample_rate or _ASSUMED_RATE,
                                 probe.channels or _ASSUMED_CHANNELS, n_mels)

    def decode(self) -> np.ndarray:
        """float32 mono 16 kHz samples ``[num_samples]``, at most the limit's worth. Raises APIError."""
        try:
            if self.suffix not in _FFMPEG_ONLY:
                try:
                    return load_audio_bytes(self.data, self.name, max_seconds=self.max_seconds)
                except AudioTooLong:
                    raise
                except AudioError:  # not a format libsndfile reads, whatever the name says
                    pass
            # m4a, webm, ...: ffmpeg reads a file; errors name the upload, not the temporary file.
            return load_audio(self._file(), max_seconds=self.max_seconds, name=self.name)
        except AudioTooLong as e:
            raise too_long(e.seconds, self.max_seconds, at_least=True) from None
        except AudioError as e:
            raise APIError(400, f"cannot decode the uploaded audio: {e}", "file") from None

    def _probe_soundfile(self) -> Probe | None:
        buffer = io.BytesIO(self.data)
        buffer.name = self.name
        header = read_header(buffer)
        if header is None:  # not a format libsndfile knows; decoding says what is wrong
            return None
        seconds, rate, channels = header
        return Probe(seconds, rate or None, channels or None)

    def _probe_ffmpeg(self) -> Probe | None:
        try:
            info = ffmpeg.probe(self._file(), self.name)  # the container's header; a playlist is refused
        except ffmpeg.FormatError as e:
            raise APIError(400, f"cannot decode the uploaded audio: {e}", "file") from None
        except FileNotFoundError:  # no ffprobe: decoding says so
            return None
        return Probe(info.seconds, info.sample_rate, info.channels)

    def _file(self) -> str:
        if self.path is None:
            fd, self.path = tempfile.mkstemp(suffix=self.suffix)
            with os.fdopen(fd, "wb") as f:
                f.write(self.data)
        return self.path


def too_long(seconds: float, limit: float, at_least: bool = False) -> APIError:
    more = "more than " if at_least else ""
    return APIError(413, f"audio is {more}{seconds:.1f} s long; this server accepts at most {limit:g} s", "file")
