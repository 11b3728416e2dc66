"""Live audio in chunks -> float32 mono at 16 kHz: raw PCM16 bytes (little-endian, as OpenAI's Realtime API and
`ffmpeg -f s16le` send them) or arrays, at any rate, resampled as one continuous signal (soxr's streaming
resampler: no seam at chunk boundaries, unlike resampling each chunk alone)."""

from __future__ import annotations

import numpy as np

from encdec_engine.inputs.audio import SAMPLE_RATE


class PcmFormatError(ValueError):
    """Bytes that are not 16-bit PCM samples."""


def pcm16_samples(data: bytes) -> np.ndarray:
    """[num_samples] int16 of little-endian 16-bit PCM bytes; PcmFormatError for an odd byte count."""
    if len(data) % 2:
        raise PcmFormatError(f"audio must be 16-bit PCM (2 bytes a sample), got {len(data)} bytes, an odd count")
    return np.frombuffer(data, dtype="<i2")


class AudioChunks:
    """Turns chunks of one mono stream at `sample_rate` into float32 chunks at 16 kHz."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or not 8000 <= sample_rate <= 192000:
            raise ValueError(f"sample_rate must be an integer number of Hz in [8000, 192000], got {sample_rate!r}")
        self.sample_rate = sample_rate
        self._resampler = None
        if sample_rate != SAMPLE_RATE:
            import soxr  # lazy: only a stream at another rate needs it

            self._resampler = soxr.ResampleStream(sample_rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")

    def __call__(self, chunk: bytes | np.ndarray) -> np.ndarray:
        """[num_samples] float32 at 16 kHz (the resampler may hold back a few samples until the next chunk).
        bytes are PCM16; integer arrays are scaled by their type's range; float arrays are taken as they are."""
        samples = pcm16_samples(chunk) if isinstance(chunk, (bytes, bytearray, memoryview)) else np.asarray(chunk)
        if samples.ndim != 1:
            raise ValueError(f"a live audio chunk must be one channel, [num_samples], got shape {samples.shape}")
        if np.issubdtype(samples.dtype, np.unsignedinteger):
            raise ValueError(f"a live audio chunk of integers must be signed PCM (int16, int32), got {samples.dtype}")
        if np.issubdtype(samples.dtype, np.integer):
            samples = samples.astype(np.float32) / float(-np.iinfo(samples.dtype).min)
        samples = samples.astype(np.float32, copy=False)
        if not np.isfinite(samples).all():
            raise ValueError("a live audio chunk has NaN or infinite samples")
        if self._resampler is None:
            return samples
        return self._resampler.resample_chunk(samples)
