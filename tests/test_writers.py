"""Transcript writers: exact txt/vtt/srt/tsv text, json keys, and openai-whisper's file naming."""

from __future__ import annotations

import json
import re

import pytest

from encdec_engine.entrypoints.writers import (
    OUTPUT_FORMATS,
    format_timestamp,
    render,
    write_transcription,
)
from encdec_engine.outputs import Segment, Transcription


@pytest.fixture
def transcription() -> Transcription:
    segments = [
        Segment(0, 0.0, 2.5, " Hello\tworld.", tokens=[50364, 2425, 1002], temperature=0.0, avg_logprob=-0.25,
                compression_ratio=1.1, no_speech_prob=0.01),
        Segment(1, 2.5, 61.0004, " A --> B, done. ", tokens=[316], avg_logprob=-0.5),
        Segment(2, 3599.9996, 3725.25, " Grüße, 世界 ", tokens=[7, 8]),
    ]
    return Transcription(text=" Hello\tworld. A --> B, done. Grüße, 世界", language="en", segments=segments,
                         duration=3726.0, source="meeting.wav")


def test_format_timestamp():
    assert format_timestamp(0.0) == "00:00.000"
    assert format_timestamp(1.0005) == "00:01.000"  # round(1000.5): half to even, like openai-whisper
    assert format_timestamp(59.9996) == "01:00.000"  # rounds first, so no "00:60.000"
    assert format_timestamp(3599.9996) == "01:00:00.000"  # hours appear once reached
    assert format_timestamp(3725.25) == "01:02:05.250"
    assert format_timestamp(5.0, always_include_hours=True, decimal_marker=",") == "00:00:05,000"
    assert format_timestamp(36000.0) == "10:00:00.000"
    with pytest.raises(ValueError):
        format_timestamp(-0.1)


def test_txt(transcription):
    assert render(transcription, "txt") == "Hello\tworld.\nA --> B, done.\nGrüße, 世界\n"


def test_vtt_exact(transcription):
    assert render(transcription, "vtt") == (
        "WEBVTT\n\n"
        "00:00.000 --> 00:02.500\nHello\tworld.\n\n"
        "00:02.500 --> 01:01.000\nA -> B, done.\n\n"
        "01:00:00.000 --> 01:02:05.250\nGrüße, 世界\n\n"
    )


def test_srt_exact(transcription):
    assert render(transcription, "srt") == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello\tworld.\n\n"
        "2\n00:00:02,500 --> 00:01:01,000\nA -> B, done.\n\n"
        "3\n01:00:00,000 --> 01:02:05,250\nGrüße, 世界\n\n"
    )


def test_tsv_exact(transcription):
    assert render(transcription, "tsv") == (
        "start\tend\ttext\n"
        "0\t2500\tHello world.\n"
        "2500\t61000\tA --> B, done.\n"
        "3600000\t3725250\tGrüße, 世界\n"
    )
    for row in render(transcription, "tsv").splitlines():
        assert row.count("\t") == 2


def test_json_round_trip(transcription):
    d = json.loads(render(transcription, "json"))
    assert set(d) == {"text", "segments", "language", "duration"}
    assert d["text"] == transcription.text and d["language"] == "en" and d["duration"] == 3726.0
    keys = {"id", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio",
            "no_speech_prob"}
    for got, seg in zip(d["segments"], transcription.segments, strict=True):
        assert set(got) == keys
        assert got["id"] == seg.id and got["start"] == seg.start and got["end"] == seg.end
        assert got["text"] == seg.text and got["tokens"] == seg.tokens  # raw text kept
        assert got["avg_logprob"] == seg.avg_logprob and got["no_speech_prob"] == seg.no_speech_prob


def test_empty_transcription():
    t = Transcription(text="", language=None, segments=[], duration=0.0)
    assert render(t, "txt") == "" and render(t, "srt") == ""
    assert render(t, "vtt") == "WEBVTT\n\n"
    assert render(t, "tsv") == "start\tend\ttext\n"
    assert json.loads(render(t, "json")) == {"text": "", "segments": [], "language": None, "duration": 0.0}


def _parse(ts: str) -> float:
    m = re.fullmatch(r"(?:(\d+):)?(\d\d):(\d\d)[.,](\d\d\d)", ts)
    assert m, ts
    h, mnt, s, ms = (int(g or 0) for g in m.groups())
    return h * 3600 + mnt * 60 + s + ms / 1000


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitle_times_parse_back_in_order(transcription, fmt):
    pairs = re.findall(r"^(\S+) --> (\S+)$", render(transcription, fmt), flags=re.M)
    assert len(pairs) == len(transcription.segments)
    last = 0.0
    for (a, b), seg in zip(pairs, transcription.segments, strict=True):
        start, end = _parse(a), _parse(b)
        assert last <= start <= end
        assert start == pytest.approx(seg.start, abs=5e-4) and end == pytest.approx(seg.end, abs=5e-4)
        last = end


def test_write_one_format(transcription, tmp_path):
    out = tmp_path / "new" / "dir"  # created on demand
    paths = write_transcription(transcription, "srt", out, "/data/audio/meeting.wav")
    assert paths == [out / "meeting.srt"]
    assert paths[0].read_bytes() == render(transcription, "srt").encode("utf-8")


def test_write_all(transcription, tmp_path):
    paths = write_transcription(transcription, "all", str(tmp_path), "talk.v2.flac")
    assert [p.name for p in paths] == [f"talk.v2.{f}" for f in OUTPUT_FORMATS]  # only the last suffix goes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)
    for p, f in zip(paths, OUTPUT_FORMATS, strict=True):
        assert p.read_text(encoding="utf-8") == render(transcription, f)


def test_write_without_audio_path_uses_source(transcription, tmp_path):
    assert write_transcription(transcription, "txt", tmp_path, None) == [tmp_path / "meeting.txt"]


def test_unknown_format(transcription, tmp_path):
    with pytest.raises(ValueError, match=r"'docx'.*txt, vtt, srt, tsv, json, all"):
        write_transcription(transcription, "docx", tmp_path / "out", "a.wav")
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder
    with pytest.raises(ValueError, match="'all'"):
        render(transcription, "all")
