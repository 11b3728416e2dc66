"""Offline transcription reads its inputs as they are needed and drops each one's audio once it is done,
so the audio held is bounded by a budget, not by the number of files (issue 14: `encdec transcribe
*.flac` used to load every file's samples and log-mel before decoding started)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.speech import offline
from encdec_engine.inputs.audio import load_audio
from encdec_engine.speech.inputs import InputQueue, probe_seconds

AUDIO = Path(__file__).resolve().parents[2] / "prompts" / "audio"
CLIPS = ["fox.wav", "weather.wav", "stella.wav", "learning.wav", "thanks_fast.wav", "coffee.wav"]


@pytest.fixture(scope="module")
def whisper(make_llm):
    return make_llm(default_model_path(), num_kv_blocks=600)


def test_inputs_are_read_within_the_budget_and_dropped_when_done(whisper, monkeypatch):
    """Six clips (3-7 s each) with a budget of 8 s: never more than 8 s of audio held (or one clip), every
    done input's samples and log-mel dropped, and the transcripts those of reading everything at once."""
    eager = [t.text for t in whisper.transcribe([AUDIO / c for c in CLIPS], language="en")]
    queues = []

    class Recorded(InputQueue):
        def __init__(self, items, load, budget_seconds=8.0):
            super().__init__(items, load, budget_seconds)
            self.loaded, self.most = [], 0.0
            queues.append(self)

        def take(self):
            jobs = super().take()
            self.loaded += jobs
            held = [j for j in self.loaded if j.samples is not None]
            self.most = max(self.most, sum(len(j.samples) for j in held) / 16000)
            assert len(held) == 1 or self.most <= 8.0, [j.source for j in held]
            return jobs

    monkeypatch.setattr(offline, "InputQueue", Recorded)
    lazy = [t.text for t in whisper.transcribe([AUDIO / c for c in CLIPS], language="en")]
    (queue,) = queues
    assert lazy == eager
    assert len(queue.loaded) == len(CLIPS) and 0 < queue.most <= 8.0
    assert all(j.samples is None and j.mel is None for j in queue.loaded)


def test_an_input_longer_than_the_budget_is_read_alone(whisper, monkeypatch):
    monkeypatch.setattr(offline, "InputQueue", lambda items, load: InputQueue(items, load, budget_seconds=1.0))
    out = whisper.transcribe([AUDIO / "fox.wav", AUDIO / "weather.wav", AUDIO / "missing.wav"], language="en")
    assert [bool(t.text.strip()) for t in out[:2]] == [True, True]
    assert out[2].error is not None and "missing.wav" in out[2].error


def test_lengths_are_probed_without_decoding(tmp_path):
    fox = load_audio(AUDIO / "fox.wav")
    seconds = len(fox) / 16000
    assert probe_seconds(fox) == seconds
    assert probe_seconds((np.zeros(44100), 44100)) == 1.0
    assert probe_seconds(AUDIO / "fox.wav") == pytest.approx(seconds, abs=1e-3)
    assert probe_seconds(str(AUDIO / "long_meeting.flac")) == pytest.approx(69.3, abs=0.1)
    assert probe_seconds((AUDIO / "fox.wav").read_bytes()) == pytest.approx(seconds, abs=1e-3)
    m4a = tmp_path / "fox.m4a"
    subprocess.run(["ffmpeg", "-v", "error", "-i", str(AUDIO / "fox.wav"), str(m4a)], check=True)
    assert probe_seconds(m4a) is None  # only ffmpeg knows: counted as 600 s until read
    assert probe_seconds(tmp_path / "missing.wav") is None
