"""`encdec transcribe --live`: a file played at real-time pace (or as fast as read), raw PCM from stdin (a
microphone through ffmpeg), and client mode (`--server URL`) against a running server. The flag checks run
in-process without a model; the rest run the CLI in a subprocess."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from encdec_engine.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "prompts" / "audio"


def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "encdec_engine.cli.main", "transcribe", *args], input=stdin,
                          capture_output=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("argv, message", [
    (["--server", "http://127.0.0.1:1"], "--server sends a live stream"),
    ([str(AUDIO / "fox.wav"), "--live", "-"], "--live transcribes one stream"),
    (["--live", str(AUDIO / "missing.wav")], "no such file"),
    (["--live", "-", "--live-speed", "-1"], "--live-speed"),
    (["--live", "-", "--vad-min-silence-duration-ms", "5"], "silence_duration_ms"),
    (["--live", "-", "--language", "xx"], "language"),
])
def test_live_flags_are_checked_before_a_model_loads(argv, message, capsys):
    assert main(["transcribe", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.integration
def test_a_file_played_live_prints_its_turns():
    r = run("--live", str(AUDIO / "weather.wav"), "--live-speed", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == "Today is a beautiful day to go for a walk in the park.\n"


@pytest.mark.integration
def test_pcm_from_stdin_with_verbose_turn_times():
    from encdec_engine.inputs.audio import load_audio

    silence = np.zeros(16000, dtype=np.float32)
    audio = np.concatenate([silence, load_audio(AUDIO / "weather.wav"), silence, load_audio(AUDIO / "fox.wav"), silence])
    pcm = (audio * 32767).astype("<i2").tobytes()
    r = run("--live", "-", "--verbose", stdin=pcm)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[00:00.") and "beautiful day" in lines[0]
    assert "quick brown fox" in lines[1]


@pytest.mark.integration
def test_client_mode_sends_the_stream_to_a_running_server():
    from servers import KEY, LiveServer

    from encdec_engine.checkpoints.ct2.importer import default_model_path
    from encdec_engine.server.app import ServerLimits, build_app

    server = LiveServer(build_app(str(default_model_path()), limits=ServerLimits(api_key=KEY), kv_cache_space_gb=0.25))
    try:
        r = run("--live", str(AUDIO / "coffee.wav"), "--live-speed", "0", "--server", server.url, "--api-key", KEY)
        assert r.returncode == 0, r.stderr
        assert "cup of coffee" in r.stdout.decode()
        refused = run("--live", str(AUDIO / "coffee.wav"), "--live-speed", "0", "--server", server.url, "--api-key", "x")
        assert refused.returncode == 2 and b"401" in refused.stderr
    finally:
        server.stop()
