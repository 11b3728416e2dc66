"""Inputs read only as they are needed: a driver takes the next inputs into jobs while the audio it
holds (samples and log-mel, about 350 MB per hour) stays within a budget, and gives each input's
audio back once it is done. Memory is then flat in the number of files: `encdec transcribe *.flac`
holds at most the budget's worth of audio (or one input, if that is longer), not every file's.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

import numpy as np

from encdec_engine.inputs.audio import SAMPLE_RATE, read_header
from encdec_engine.speech.job import TranscriptionJob

LOADED_SECONDS = 1800.0  # audio held at once, in seconds (about 170 MB); at least one input whatever its length
_UNKNOWN_SECONDS = 600.0  # what an input whose length no header tells counts for, until it is read


def probe_seconds(item) -> float | None:
    """An input's length from what is at hand without decoding it: an array's size, a file's header.
    None when nothing tells (a container only ffmpeg reads, or a bad input: loading will say)."""
    if hasattr(item, "detach"):  # a torch tensor at 16 kHz
        return item.shape[-1] / SAMPLE_RATE
    if isinstance(item, np.ndarray):
        return len(item) / SAMPLE_RATE
    if isinstance(item, (tuple, list)) and len(item) == 2 and not isinstance(item[0], (str, os.PathLike)):
        samples, rate = item
        return len(samples) / rate if rate else None
    source = io.BytesIO(item) if isinstance(item, (bytes, bytearray)) else item
    if not isinstance(source, (str, os.PathLike, io.BytesIO)):
        return None
    header = read_header(source)
    return None if header is None else header[0]


class InputQueue:
    """The inputs of one call, numbered in order, read into jobs a few at a time (see the module
    docstring). `load` is how a group of (index, input) pairs becomes jobs."""

    def __init__(self, items: Sequence, load, budget_seconds: float = LOADED_SECONDS) -> None:
        self.items = list(enumerate(items))
        self.load, self.budget = load, budget_seconds
        self.probed = [probe_seconds(item) for _, item in self.items]
        self.next = 0
        self.held: dict[int, float] = {}  # input index -> seconds counted against the budget

    @property
    def exhausted(self) -> bool:
        return self.next >= len(self.items)

    def take(self) -> list[TranscriptionJob]:
        """The next inputs' jobs, as many as fit in the budget beside those held (at least one when none
        is held); [] when none fits or none is left."""
        group, seconds = [], sum(self.held.values())
        while not self.exhausted:
            need = self.probed[self.next]
            need = _UNKNOWN_SECONDS if need is None else need
            if (self.held or group) and seconds + need > self.budget:
                break
            group.append(self.items[self.next])
            self.held[self.next] = need
            seconds += need
            self.next += 1
        jobs = self.load(group) if group else []
        for job in jobs:
            if job.error is None:
                self.held[job.index] = job.duration  # what it really holds
        return jobs

    def release(self, index: int) -> None:
        """An input is done (the loop drops its audio: `Transcriber.release`): its seconds are freed."""
        self.held.pop(index, None)
