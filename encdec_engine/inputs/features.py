"""Batched Whisper log-mel features in torch, numerically matching ``WhisperFeatureExtractor``."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from encdec_engine.inputs.audio import HOP_LENGTH, N_FFT, N_SAMPLES, SAMPLE_RATE

SUPPORTED_N_MELS = (80, 128)  # 128 bins: large-v3 and later checkpoints


def pad_or_trim(samples: np.ndarray | torch.Tensor, length: int = N_SAMPLES) -> np.ndarray | torch.Tensor:
    """Zero-pad or cut the last axis of ``samples`` to exactly ``length`` samples.

    Keeps the input's type (numpy or torch), dtype and device.
    """
    size = samples.shape[-1]
    if size > length:
        return samples[..., :length]
    if size == length:
        return samples
    if isinstance(samples, torch.Tensor):
        return torch.nn.functional.pad(samples, (0, length - size))
    widths = [(0, 0)] * (samples.ndim - 1) + [(0, length - size)]
    return np.pad(samples, widths)


# The Slaney mel scale (librosa's default, which Whisper's filters use): 3 mels per 200 Hz up to 1 kHz
# (mel 15), then logarithmic: 27 mels per factor 6.4. Written in the order of operations of
# transformers' `audio_utils`, so that the float64 filters come out identical.
_LOG_START_HZ = 1000.0
_LOG_START_MEL = 15.0
_LOG_HZ_PER_MEL = np.log(6.4) / 27.0
_MELS_PER_LOG_HZ = 27.0 / np.log(6.4)  # not 1 / _LOG_HZ_PER_MEL: the same rounding as transformers'


def _hz_to_mel(hz: float) -> float:
    if hz < _LOG_START_HZ:
        return 3.0 * hz / 200.0
    return _LOG_START_MEL + np.log(hz / _LOG_START_HZ) * _MELS_PER_LOG_HZ


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = 200.0 * mels / 3.0
    log_part = mels >= _LOG_START_MEL
    hz[log_part] = _LOG_START_HZ * np.exp(_LOG_HZ_PER_MEL * (mels[log_part] - _LOG_START_MEL))
    return hz


def mel_filter_bank(n_mels: int) -> np.ndarray:
    """Whisper's triangular filters, area-normalized (Slaney), over the 0-8 kHz bins of a 400-point FFT:
    [n_mels, 201] in float64. The same numbers as `WhisperFeatureExtractor`'s filters, bit for bit."""
    n_freqs = 1 + N_FFT // 2
    # n_mels + 2 edges evenly spaced in mels; filter i rises from edge i to i + 1 and falls to i + 2.
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), n_mels + 2))
    bins = np.linspace(0, SAMPLE_RATE // 2, n_freqs)
    widths = np.diff(edges)
    offsets = edges[None, :] - bins[:, None]  # [n_freqs, n_mels + 2]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    filters = np.maximum(np.zeros(1), np.minimum(rising, falling))  # [n_freqs, n_mels]
    filters *= (2.0 / (edges[2:] - edges[:-2]))[None, :]
    return filters.T


@lru_cache(maxsize=8)
def _mel_filters(n_mels: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(mel_filter_bank(n_mels).copy()).to(device=device, dtype=torch.float32)  # [n_mels, 201]


@lru_cache(maxsize=8)
def _window(device: torch.device) -> torch.Tensor:
    return torch.hann_window(N_FFT, periodic=True, device=device)  # [N_FFT]


def _stack(batch: Sequence[np.ndarray] | np.ndarray | torch.Tensor, length: int | None) -> torch.Tensor:
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        tensor = torch.as_tensor(batch, dtype=torch.float32)
        if tensor.ndim == 1:
            tensor = tensor[None]  # a single unbatched signal
        if tensor.ndim != 2:
            raise ValueError(f"expected audio of shape [batch, num_samples], got {tuple(tensor.shape)}")
        return pad_or_trim(tensor, tensor.shape[-1] if length is None else length)
    if len(batch) == 0:
        raise ValueError("empty audio batch")
    signals = [torch.as_tensor(np.asarray(s, dtype=np.float32)).reshape(-1) for s in batch]
    target = max(s.shape[0] for s in signals) if length is None else length
    return torch.stack([pad_or_trim(s, target) for s in signals])  # [batch, target]


def log_mel_spectrogram(
    batch: Sequence[np.ndarray] | np.ndarray | torch.Tensor,
    n_mels: int = 80,
    pad_to: int | None = N_SAMPLES,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Whisper log-mel spectrogram of a batch of 16 kHz mono signals.

    ``batch`` is a list of ``[num_samples]`` arrays (lengths may differ) or a
    ``[batch, num_samples]`` array/tensor (a single ``[num_samples]`` signal is treated as a
    batch of one). Each signal is zero-padded or truncated to ``pad_to`` samples first (the
    30 s window by default; ``None`` pads to the longest signal), exactly as
    ``WhisperFeatureExtractor(feature_size=n_mels)(audio, sampling_rate=16000)`` does.
    Returns float32 ``[batch, n_mels, pad_to // HOP_LENGTH]`` (``[batch, n_mels, 3000]``)
    on ``device`` (default: the input tensor's device, else CPU).
    """
    if n_mels not in SUPPORTED_N_MELS:
        raise ValueError(f"n_mels must be one of {SUPPORTED_N_MELS}, got {n_mels}")
    if device is None:
        device = batch.device if isinstance(batch, torch.Tensor) else "cpu"
    device = torch.device(device)
    audio = _stack(batch, pad_to).to(device)  # audio: [batch, num_samples]

    # Centered STFT (reflect padding) with a periodic Hann window, like HF and OpenAI.
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=_window(device), return_complex=True)
    # The final frame only sees the reflected padding past the end; Whisper drops it so a
    # 30 s window gives exactly 3000 frames.
    power = stft[..., :-1].abs() ** 2  # power: [batch, 201, frames]
    mel = _mel_filters(n_mels, device) @ power  # mel: [batch, n_mels, frames]

    log_spec = torch.clamp(mel, min=1e-10).log10()
    # Per-example dynamic range of 80 dB (8 in log10 units) below that example's peak.
    peak = log_spec.amax(dim=(1, 2), keepdim=True)  # peak: [batch, 1, 1]
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return (log_spec + 4.0) / 4.0


_BLOCK_FRAMES = 3000  # frames per STFT block of a long recording (30 s)


def long_log_mel_spectrogram(samples: np.ndarray, n_mels: int = 80, tail_zeros: int = 0) -> torch.Tensor:
    """`log_mel_spectrogram([samples + tail_zeros zeros], pad_to=None)[0]` of one recording, computed
    30 s of frames at a time, so an hour of audio needs the log-mel it returns (115 MB with 80 bins)
    and one block's STFT, not the STFT of the whole hour (gigabytes). Each frame sees the same
    samples (the reflect padding is at the signal's ends only) and the dynamic range is clamped below
    the whole recording's peak, as in one piece. Returns float32 ``[n_mels, frames]`` on the CPU."""
    if n_mels not in SUPPORTED_N_MELS:
        raise ValueError(f"n_mels must be one of {SUPPORTED_N_MELS}, got {n_mels}")
    signal = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))  # signal: [num_samples]
    length = signal.shape[0] + tail_zeros
    frames = length // HOP_LENGTH  # torch.stft's 1 + length // hop frames, less Whisper's dropped last one
    half = N_FFT // 2
    filters, window = _mel_filters(n_mels, torch.device("cpu")), _window(torch.device("cpu"))
    out = torch.empty(n_mels, frames)
    for f0 in range(0, frames, _BLOCK_FRAMES):
        f1 = min(frames, f0 + _BLOCK_FRAMES)
        # Frame t covers samples [t * hop - half, t * hop + half) of the reflect-padded signal.
        block = _reflect_slice(signal, length, f0 * HOP_LENGTH - half, (f1 - 1) * HOP_LENGTH + half)
        stft = torch.stft(block[None], N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
        out[:, f0:f1] = torch.clamp(filters @ (stft[0].abs() ** 2), min=1e-10).log10()  # [n_mels, f1 - f0]
    torch.maximum(out, out.max() - 8.0, out=out)
    return out.add_(4.0).div_(4.0)


def _reflect_slice(signal: torch.Tensor, length: int, start: int, end: int) -> torch.Tensor:
    """Samples [start, end) of `signal` followed by zeros up to `length`, reflect-padded at both ends
    (as torch.stft(center=True) pads): indices below 0 or past `length` mirror those inside."""
    inside = torch.zeros(min(end, length) - max(start, 0))
    stop = min(end, signal.shape[0])
    if stop > max(start, 0):
        inside[: stop - max(start, 0)] = signal[max(start, 0) : stop]
    if start >= 0 and end <= length:
        return inside
    left, right = max(0, -start), max(0, end - length)
    return torch.nn.functional.pad(inside[None, None], (left, right), mode="reflect")[0, 0]
