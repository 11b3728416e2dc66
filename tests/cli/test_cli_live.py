"""`encdec transcribe` while it runs: files written as each is done, segments printed as windows finish,
and Ctrl-C (SIGINT) mid-batch keeping what was finished and nothing half-written."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytestmark = pytest.mark.integration  # the CLI in a subprocess

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "prompts" / "audio"
FORMATS = ("json", "srt", "tsv", "txt", "vtt")
VERBOSE_LINE = re.compile(r"^\[(\d\d:)?\d\d:\d\d\.\d\d\d --> (\d\d:)?\d\d:\d\d\.\d\d\d\] .+$")


def start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "encdec_engine.cli.main", "transcribe", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def seconds(stamp: str) -> float:
    return sum(float(part) * 60**i for i, part in enumerate(reversed(stamp.split(":"))))


def wait_for(condition, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"exited {process.returncode} early: {process.stderr.read()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigint_mid_batch_keeps_finished_files_and_writes_no_partial_one(tmp_path):
    """Three files, the short one first to finish: once its outputs exist, SIGINT. It stays complete on
    disk; the two long ones (5.8 min each: a dozen windows) leave nothing, no temporary files either;
    exit 130 with one line on stderr and no traceback."""
    meeting, rate = sf.read(AUDIO / "long_meeting.flac", dtype="float32")
    for name in ("long_a.flac", "long_b.flac"):
        sf.write(tmp_path / name, np.concatenate([meeting] * 5), rate)
    out = tmp_path / "out"
    process = start(str(AUDIO / "coffee.wav"), str(tmp_path / "long_a.flac"), str(tmp_path / "long_b.flac"),
                    "--quiet", "-o", str(out), cwd=tmp_path)
    try:
        wait_for(lambda: all((out / f"coffee.{ext}").exists() for ext in FORMATS), process)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("interrupted: 1 of 3 files finished"), stderr
    assert sorted(p.name for p in out.iterdir()) == [f"coffee.{ext}" for ext in FORMATS]  # no .tmp, no long_*
    assert "coffee with milk" in (out / "coffee.txt").read_text()
    assert (out / "coffee.json").read_text().endswith("}")  # whole: the JSON closes


def test_verbose_prints_each_window_before_the_file_is_done(tmp_path):
    """openai-whisper's verbose lines, `[00:00.000 --> 00:05.000] text`, arrive as windows finish: the
    first comes while the file (two windows: 0-30 s and 30-40 s) is still being decoded."""
    process = start(str(AUDIO / "long_meeting.flac"), "--verbose", "--clip_timestamps", "0,40", "-f", "json",
                    cwd=tmp_path)
    try:
        first = process.stdout.readline()
        written_then = (tmp_path / "long_meeting.json").exists()
        rest, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert not written_then  # the segment came before the file was done
    lines = [first.rstrip("\n"), *rest.splitlines()]
    assert lines and all(VERBOSE_LINE.match(line) for line in lines), lines
    starts = [seconds(line[1:].split(" --> ")[0]) for line in lines]
    assert starts == sorted(starts) and starts[-1] >= 20.0  # in time order, up to the second window
    assert "CPU threads:" in stderr and "KV pool" in stderr  # --verbose logs what runs where
