"""Log-mel features must reproduce transformers' WhisperFeatureExtractor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from encdec_engine.inputs.audio import HOP_LENGTH, N_FRAMES, N_SAMPLES, SAMPLE_RATE, load_audio
from encdec_engine.inputs.features import log_mel_spectrogram, long_log_mel_spectrogram, pad_or_trim

AUDIO_DIR = Path(__file__).resolve().parents[2] / "prompts" / "audio"
# Measured: 0.0 (bit-identical) on CPU for both 80 and 128 bins; the bound leaves room
# for other BLAS backends.
MAX_ABS_ERROR = 1e-4


@pytest.fixture(scope="module")
def signals() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    names = json.loads((AUDIO_DIR / "transcripts.json").read_text())
    clips = {name: load_audio(AUDIO_DIR / name) for name in names}
    return {
        **clips,  # includes a ~69 s clip: truncated to the first 30 s
        "noise_short": (0.3 * rng.standard_normal(1000)).astype(np.float32),
        "noise_exact_30s": (0.1 * rng.standard_normal(N_SAMPLES)).astype(np.float32),
        "noise_37s": rng.uniform(-1, 1, 600_000).astype(np.float32),
        "quiet_tone": (1e-4 * np.sin(np.arange(SAMPLE_RATE * 2) * 0.05)).astype(np.float32),
        "silence": np.zeros(SAMPLE_RATE, dtype=np.float32),
        "one_sample": np.array([0.5], dtype=np.float32),
    }


@pytest.mark.parametrize("n_mels", [80, 128])
def test_matches_whisper_feature_extractor(signals: dict[str, np.ndarray], n_mels: int) -> None:
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    batch = log_mel_spectrogram(list(signals.values()), n_mels=n_mels)
    assert batch.shape == (len(signals), n_mels, N_FRAMES) and batch.dtype == torch.float32
    worst = 0.0
    for i, (name, audio) in enumerate(signals.items()):
        expected = extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features[0]
        error = (batch[i] - expected).abs().max().item()
        assert error < MAX_ABS_ERROR, f"{name}: max abs error {error}"
        worst = max(worst, error)
        # Batching must not change an example's features.
        single = log_mel_spectrogram([audio], n_mels=n_mels)[0]
        assert (single - batch[i]).abs().max().item() <= 1e-6, name
    print(f"n_mels={n_mels}: max abs error vs WhisperFeatureExtractor = {worst:.3g}")


def test_tensor_and_array_inputs_match_list_input(signals: dict[str, np.ndarray]) -> None:
    clips = [pad_or_trim(signals[name]) for name in ("fox.wav", "noise_37s", "silence")]
    expected = log_mel_spectrogram(clips)
    stacked = np.stack(clips)  # [3, N_SAMPLES]
    torch.testing.assert_close(log_mel_spectrogram(stacked), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(log_mel_spectrogram(torch.from_numpy(stacked)), expected, rtol=0, atol=1e-6)
    # A bare 1-D signal is a batch of one.
    torch.testing.assert_close(log_mel_spectrogram(clips[0]), expected[:1], rtol=0, atol=1e-6)


def test_pad_to_none_pads_to_longest(signals: dict[str, np.ndarray]) -> None:
    short, longer = signals["noise_short"], signals["fox.wav"]
    features = log_mel_spectrogram([short, longer], pad_to=None)
    assert features.shape == (2, 80, longer.size // HOP_LENGTH)


def test_pad_or_trim() -> None:
    audio = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(pad_or_trim(audio, 4), audio[:4])
    np.testing.assert_array_equal(pad_or_trim(audio, 12), np.concatenate([audio, [0, 0]]))
    assert pad_or_trim(audio, 10) is audio
    batch = torch.ones(2, 5)
    assert torch.equal(pad_or_trim(batch, 7)[:, 5:], torch.zeros(2, 2))
    assert pad_or_trim(np.zeros(5), N_SAMPLES).shape == (N_SAMPLES,)


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="n_mels"):
        log_mel_spectrogram([np.zeros(100, dtype=np.float32)], n_mels=64)
    with pytest.raises(ValueError, match="empty"):
        log_mel_spectrogram([])
    with pytest.raises(ValueError, match="shape"):
        log_mel_spectrogram(torch.zeros(1, 2, 100))


@pytest.mark.parametrize("seconds", [30.01, 47.3, 69.3])
def test_long_recordings_are_featurized_in_blocks_exactly_as_in_one_piece(seconds):
    """The long-form log-mel (the recording plus 30 s of silence) in 30 s blocks: the same values as the
    whole-recording STFT, which for an hour of audio takes gigabytes."""
    samples = load_audio(Path(__file__).resolve().parents[2] / "prompts" / "audio" / "long_meeting.flac")
    samples = samples[: int(seconds * 16000)]
    whole = log_mel_spectrogram([np.concatenate([samples, np.zeros(N_SAMPLES, np.float32)])], pad_to=None)[0]
    assert torch.equal(long_log_mel_spectrogram(samples, 80, tail_zeros=N_SAMPLES), whole)
    whole = log_mel_spectrogram([samples], n_mels=128, pad_to=None)[0]
    torch.testing.assert_close(long_log_mel_spectrogram(samples, 128), whole, rtol=0, atol=1e-6)
