"""Cutting long audio into windows at its quietest moments (chunked transcription).

Each span longer than a 30 s window is cut where the log-mel is quietest in the last
`SEARCH_SECONDS` before the window would end, so that a cut falls in a pause rather than in a
word. Loudness is a frame's mean log-mel, smoothed over `SMOOTH_FRAMES`.
"""

from __future__ import annotations

import numpy as np
import torch

from encdec_engine.inputs.audio import FRAMES_PER_SECOND, N_FRAMES

SEARCH_SECONDS = 10  # a cut falls in the last 10 s of a 30 s window
SMOOTH_FRAMES = 20  # 200 ms: a pause, not a single quiet frame between syllables


def frame_loudness(mel: torch.Tensor) -> np.ndarray:
    """[frames] smoothed mean log-mel of a [n_mels, frames] log-mel."""
    loudness = mel.float().mean(dim=0).cpu().numpy()
    kernel = np.full(SMOOTH_FRAMES, 1.0 / SMOOTH_FRAMES)
    return np.convolve(loudness, kernel, mode="same")


def quiet_cuts(loudness: np.ndarray, start: int, end: int, max_frames: int = N_FRAMES) -> list[tuple[int, int]]:
    """Split frames [start, end) into spans of at most `max_frames`, each cut at the quietest frame
    of the last SEARCH_SECONDS of its span (the latest such frame on a tie)."""
    search = min(SEARCH_SECONDS * FRAMES_PER_SECOND, max_frames - 1)
    spans = []
    while end - start > max_frames:
        lo, hi = start + max_frames - search, start + max_frames  # the cut lies in (lo, hi]
        window = loudness[lo + 1 : hi + 1]
        cut = lo + 1 + int(len(window) - 1 - np.argmin(window[::-1]))
        spans.append((start, cut))
        start = cut
    spans.append((start, end))
    return spans
