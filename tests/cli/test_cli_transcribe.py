import pytest
"""`encdec transcribe` run as a user runs it: a subprocess, the default offline model, every output format."""

import json
import re
from pathlib import Path

from helpers import encdec

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "prompts" / "audio"
SRT_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d),(\d\d\d) --> (\d\d):(\d\d):(\d\d),(\d\d\d)$")
VTT_TIME = re.compile(r"^(?:(\d\d):)?(\d\d):(\d\d)\.(\d\d\d) --> (?:(\d\d):)?(\d\d):(\d\d)\.(\d\d\d)$")


def seconds(groups) -> tuple[float, float]:
    g = [int(x) if x else 0 for x in groups]
    return g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000, g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000


def check_cues(lines: list[str], pattern: re.Pattern, duration: float) -> int:
    previous_start, cues = -1.0, 0
    for line in lines:
        m = pattern.match(line)
        if m:
            start, end = seconds(m.groups())
            assert previous_start <= start <= end <= duration + 0.5, line
            previous_start, cues = start, cues + 1
    return cues


@pytest.mark.integration  # a subprocess of the engine
def test_transcribe_all_formats_and_a_bad_file(tmp_path):
    files = [str(AUDIO / "coffee.wav"), str(AUDIO / "meeting_stereo_44k.wav"), str(tmp_path / "missing.mp3"),
             str(AUDIO / "long_meeting.flac")]
    r = encdec("transcribe", *files, "--output-format", "all", "--output-dir", str(tmp_path / "out"), "--quiet",
               "--word-timestamps")
    assert r.returncode == 1  # one file failed ...
    assert "missing.mp3" in r.stderr  # ... and is named
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(f"{stem}.{ext}" for stem in ("coffee", "meeting_stereo_44k", "long_meeting")
                           for ext in ("txt", "vtt", "srt", "tsv", "json"))
    assert "coffee with milk" in (out / "coffee.txt").read_text()
    result = json.loads((out / "long_meeting.json").read_text())
    assert result["language"] == "en" and result["duration"] > 60 and len(result["segments"]) > 3
    # Speech throughout: no window skipped (the last one's no-speech probability is 0.62, as faster-whisper's,
    # but its text is probable), segments up to the end.
    assert all(0.0 < s["no_speech_prob"] < 1.0 for s in result["segments"])
    assert result["segments"][-1]["end"] > result["duration"] - 2.0
    for s in result["segments"]:
        assert "".join(w["word"] for w in s["words"]) == s["text"]
        assert all(s["start"] - 0.7 <= w["start"] <= w["end"] <= s["end"] + 0.7 for w in s["words"])
    srt = (out / "long_meeting.srt").read_text().splitlines()
    assert srt[0] == "1" and check_cues(srt, SRT_TIME, result["duration"]) == len(result["segments"])
    vtt = (out / "long_meeting.vtt").read_text().splitlines()
    assert vtt[0] == "WEBVTT" and check_cues(vtt, VTT_TIME, result["duration"]) == len(result["segments"])
    tsv = (out / "long_meeting.tsv").read_text().splitlines()
    assert tsv[0] == "start\tend\ttext" and len(tsv) == len(result["segments"]) + 1


@pytest.mark.integration  # a subprocess of the engine
def test_transcribe_prints_text_and_writes_every_format_here_by_default(tmp_path):
    """openai-whisper's defaults: no --output-dir / --output-format writes all formats to the current folder;
    the transcript is printed too."""
    r = encdec("transcribe", str(AUDIO / "weather.wav"), "--no-speech-threshold", "none", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "beautiful day to go for a walk in the park" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"weather.{ext}" for ext in sorted(
        ("txt", "vtt", "srt", "tsv", "json"))]
    assert (tmp_path / "weather.txt").read_text().strip() in r.stdout


@pytest.mark.integration  # a subprocess of the engine
def test_int8_weights_and_cache_from_the_command_line(tmp_path):
    """faster-whisper's --compute-type int8 spelling and --kv-cache-dtype int8; a compute type the engine
    does not run is refused with a message naming it."""
    r = encdec("transcribe", str(AUDIO / "weather.wav"), "--quiet", "--compute-type", "int8",
               "--kv-cache-dtype", "int8", "-f", "txt", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "beautiful day to go for a walk in the park" in (tmp_path / "weather.txt").read_text()
    r = encdec("transcribe", str(AUDIO / "weather.wav"), "--quiet", "--compute-type", "int16", cwd=tmp_path)
    assert r.returncode == 2 and "--compute-type int16" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.integration  # a subprocess of the engine
def test_bad_destinations_and_options_fail_before_any_work(tmp_path):
    """Each is refused at once with exit 2 and a one-line error naming the problem (no model is even loaded)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "x.wav").write_bytes((AUDIO / "fox.wav").read_bytes())
    one, two = [str(tmp_path / "a" / "x.wav")], [str(tmp_path / "a" / "x.wav"), str(tmp_path / "b" / "x.wav")]
    cases = [
        (one + ["--output-dir", str(AUDIO / "weather.wav")], "exists and is not a directory"),
        (two + ["--output-dir", str(tmp_path / "out")], "would both be written as x.*"),
        (one + ["--batch-size", "-1"], "--batch-size must be at least 1"),
        (one + ["--beam-size", "0"], "beam_size must be an integer of at least 1"),
        (one + ["--hallucination-silence-threshold", "2"], "hallucination_silence_threshold needs word_timestamps"),
        (one + ["--clip-timestamps", "5,2"], "clip_timestamps must ascend"),
    ]
    for args, message in cases:
        r = encdec("transcribe", "--quiet", *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_subtitle_flags_are_refused_before_any_work(capsys):
    """In process (refused before the model loads): the word layout flags need --word-timestamps, valid values,
    and an srt or vtt file to shape."""
    from encdec_engine.cli.main import main

    clip = [str(AUDIO / "fox.wav"), "--quiet"]
    cases = [
        (["--max-line-width", "42", "--output-format", "srt"], "--max-line-width needs --word-timestamps"),
        (["--highlight-words", "--max-words-per-line", "3", "--output-format", "vtt"],
         "--highlight-words, --max-words-per-line need --word-timestamps"),
        (["--word-timestamps", "--output-format", "srt", "--max-line-width", "0"],
         "max_line_width must be a positive integer"),
        (["--word-timestamps", "--output-format", "srt", "--max-line-count", "2"],
         "max_line_count needs max_line_width"),
        (["--word-timestamps", "--output-format", "srt", "--max-line-width", "42", "--max-words-per-line", "3"],
         "max_words_per_line and max_line_width exclude each other"),
        (["--word-timestamps", "--highlight-words", "--output-format", "txt"], "only shape srt and vtt files"),
        (["--word_timestamps", "True", "--highlight_words", "True", "-f", "json"], "only shape srt and vtt files"),
    ]
    for args, message in cases:
        assert main(["transcribe", *clip, *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.integration  # a subprocess of the engine
def test_subtitle_line_layout(tmp_path):
    r = encdec("transcribe", str(AUDIO / "weather.wav"), "--quiet", "--no-speech-threshold", "none",
               "--word-timestamps", "--max-line-width", "20", "--max-line-count", "2", "--output-format", "all",
               "--output-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    words = [w for s in json.loads((tmp_path / "weather.json").read_text())["segments"] for w in s["words"]]
    cues = (tmp_path / "weather.srt").read_text().split("\n\n")[:-1]
    lines = [cue.split("\n")[2:] for cue in cues]  # number, times, then the text lines
    assert len(cues) > 1 and all(1 <= len(text) <= 2 for text in lines)
    assert all(len(line) <= 20 or " " not in line for text in lines for line in text)
    assert " ".join(" ".join(text) for text in lines).split() == "".join(w["word"] for w in words).split()
    assert check_cues((tmp_path / "weather.srt").read_text().splitlines(), SRT_TIME, 10.0) == len(cues)


@pytest.mark.integration  # a subprocess of the engine
def test_bad_files_are_named_before_the_load_and_below_the_progress_bar(tmp_path):
    """stderr into a pipe, as in a log. A file in no audio format was named only after the model had loaded;
    one that fails while the bar is drawn (a WAV header with nothing decodable after it) was written on the
    bar's line, which ends in no newline: "...files 0/2]error: ...". Now the first is named before the bar
    exists, and the second is written after tqdm cleared the bar (a carriage return)."""
    notes, broken = tmp_path / "notes.wav", tmp_path / "broken.wav"
    notes.write_text("these are my notes\n")
    broken.write_bytes(b"RIFF\x24\x00\x00\x00WAVEjunk" + bytes(range(200)))
    r = encdec("transcribe", str(AUDIO / "fox.wav"), str(notes), str(broken), "-o", str(tmp_path), "-f", "txt")
    assert r.returncode == 1 and "quick brown fox" in r.stdout, r.stderr
    assert r.stderr.startswith(f"error: {notes} is not in an audio format this engine decodes"), r.stderr
    decode_error = f"error: cannot decode {broken} (wav: corrupt or truncated)\n"
    assert decode_error in r.stderr and r.stderr.index(decode_error) > r.stderr.index("Transcribing")
    for at in (m.start() for m in re.finditer("error: ", r.stderr)):
        assert at == 0 or r.stderr[at - 1] in "\r\n", repr(r.stderr[max(0, at - 40) : at + 40])
