import pytest
"""`encdec transcribe --vad-filter` and the --vad-* flags: faster-whisper's vad_parameters, refused when they
would change nothing or hold a bad value, and (end to end) a JSON transcript with no words in the silence."""

import json
import subprocess
import sys
from pathlib import Path

import soundfile
from vad_audio import recording, silence

from encdec_engine.inputs.audio import SAMPLE_RATE
from encdec_engine.speech.vad import VadOptions

ROOT = Path(__file__).resolve().parents[2]
CLIP = str(ROOT / "prompts" / "audio" / "fox.wav")


def test_vad_flags_become_vad_parameters():
    """Each --vad-* flag sets the vad_parameters field of its name; the others keep their defaults."""
    from encdec_engine.cli.main import build_parser
    from encdec_engine.cli.transcribe_args import transcribe_options

    def options(*flags):
        return transcribe_options(build_parser().parse_args(["transcribe", CLIP, *flags]), (0.0,))

    flags = ["--vad-threshold", "0.6", "--vad-neg-threshold", "0.3", "--vad-min-speech-duration-ms", "250",
             "--vad-max-speech-duration-s", "20", "--vad-min-silence-duration-ms", "500", "--vad-speech-pad-ms", "100"]
    got = options("--vad-filter", *flags)
    assert got.vad_filter is True and got.vad_parameters == VadOptions(
        threshold=0.6, neg_threshold=0.3, min_speech_duration_ms=250, max_speech_duration_s=20,
        min_silence_duration_ms=500, speech_pad_ms=100)
    assert options("--vad-filter", "--vad-threshold", "0.7").vad_parameters == VadOptions(threshold=0.7)
    got = options()
    assert got.vad_filter is False and got.vad_parameters is None


def test_bad_vad_flags_are_refused_before_any_work(capsys):
    from encdec_engine.cli.main import main

    cases = [
        (["--vad-threshold", "0.6"], "--vad-threshold needs --vad-filter"),
        (["--vad-threshold", "0.6", "--vad-speech-pad-ms", "100"], "--vad-threshold, --vad-speech-pad-ms need --vad-filter"),
        (["--vad-filter", "--vad-threshold", "1.5"], "threshold must be a probability in [0, 1], got 1.5"),
        (["--vad-filter", "--vad-speech-pad-ms", "-1"], "speech_pad_ms must be a non-negative number"),
        (["--vad-filter", "--vad-threshold", "0.3", "--vad-neg-threshold", "0.4"], "neg_threshold (0.4) must not exceed"),
        (["--vad-filter", "--clip-timestamps", "0,1"], "vad_filter and clip_timestamps cannot be combined"),
    ]
    for args, message in cases:
        assert main(["transcribe", CLIP, "--quiet", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.integration  # a subprocess of the engine
def test_vad_filter_end_to_end(tmp_path):
    """tiny.en on speech, 10 s of silence, speech: words only where the speech is, times on the file's timeline."""
    rec = recording(silence(1), "fox.wav", silence(10), "weather.wav")
    path = tmp_path / "pauses.wav"
    soundfile.write(path, rec.samples, SAMPLE_RATE)
    done = subprocess.run([sys.executable, "-m", "encdec_engine.cli.main", "transcribe", str(path), "--quiet",
                           "--vad-filter", "--chunked", "--word-timestamps", "--output-format", "json",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "pauses.json").read_text())
    words = [w for s in result["segments"] for w in s["words"]]
    assert len(words) >= 15, result["text"]
    for w in words:  # within 0.3 s of one of the two utterances
        assert any(a - 0.32 <= w["start"] and w["end"] <= b + 0.32 for a, b in rec.speech), (w, rec.speech)
    assert words[-1]["start"] > rec.speech[1][0] - 0.32  # the second utterance keeps its place after the gap
