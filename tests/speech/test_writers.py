"""Transcript writers: exact txt/vtt/srt/tsv text, json keys, and openai-whisper's file naming."""

from __future__ import annotations

import json
import re

import pytest

from encdec_engine.speech.writers import (
    OUTPUT_FORMATS,
    SubtitleOptions,
    format_timestamp,
    render,
    write_transcription,
)
from encdec_engine.speech.results import Segment, Transcription, Word


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


# Word options: expected cues derived by hand from openai-whisper's SubtitlesWriter.iterate_result.


@pytest.fixture
def worded() -> Transcription:
    """Three segments with word timings: a 0.3 s gap before "fox"; 4.8 s from the start of "dog." to "Done!"."""
    def seg(i: int, start: float, end: float, words: list[tuple[float, float, str]]) -> Segment:
        ws = [Word(a, b, w, 0.9) for a, b, w in words]
        return Segment(i, start, end, "".join(w.word for w in ws), words=ws)

    segments = [
        seg(0, 0.0, 3.0, [(0.0, 0.4, " The"), (0.4, 0.8, " quick"), (0.8, 1.2, " brown"), (1.5, 1.9, " fox"),
                          (1.9, 2.6, " jumps.")]),
        seg(1, 3.0, 6.0, [(3.1, 3.5, " Over"), (3.5, 3.7, " the"), (3.7, 4.2, " lazy"), (4.2, 4.8, " dog.")]),
        seg(2, 9.0, 10.0, [(9.0, 9.6, " Done!")]),
    ]
    return Transcription("".join(s.text for s in segments), "en", segments, duration=10.0)


def srt(*cues: tuple[str, str, str]) -> str:
    """SRT text from (start, end, text) cues, times as "SS.mmm" within the first minute."""
    return "".join(f"{i}\n00:00:{a.replace('.', ',')} --> 00:00:{b.replace('.', ',')}\n{text}\n\n"
                   for i, (a, b, text) in enumerate(cues, start=1))


def test_default_options_keep_segment_cues(worded):
    """Without options cues stay segments (their own times), words or not: today's output."""
    expected = srt(("00.000", "03.000", "The quick brown fox jumps."), ("03.000", "06.000", "Over the lazy dog."),
                   ("09.000", "10.000", "Done!"))
    assert render(worded, "srt") == render(worded, "srt", SubtitleOptions()) == expected


def test_max_line_width_breaks_lines_within_segment_cues(worded):
    # "The quick brown" is 15 characters; " fox" would make 19 > 16.
    assert render(worded, "srt", SubtitleOptions(max_line_width=16)) == srt(
        ("00.000", "02.600", "The quick brown\nfox jumps."),  # cue times are word times
        ("03.100", "04.800", "Over the lazy\ndog."),
        ("09.000", "09.600", "Done!"),
    )


def test_max_line_count_flows_cues_across_segments(worded):
    one = SubtitleOptions(max_line_width=16, max_line_count=1)
    assert render(worded, "srt", one) == srt(
        ("00.000", "01.200", "The quick brown"),
        ("01.500", "03.500", "fox jumps. Over"),  # crosses into segment 1
        ("03.500", "04.800", "the lazy dog."),  # "Done!" starts 4.8 s after "dog." started: a new cue
        ("09.000", "09.600", "Done!"),
    )
    two = SubtitleOptions(max_line_width=16, max_line_count=2)
    assert render(worded, "srt", two) == srt(
        ("00.000", "03.500", "The quick brown\nfox jumps. Over"),
        ("03.500", "04.800", "the lazy dog."),
        ("09.000", "09.600", "Done!"),
    )


def test_max_words_per_line(worded):
    assert render(worded, "srt", SubtitleOptions(max_words_per_line=2)) == srt(
        ("00.000", "00.800", "The quick"), ("00.800", "01.900", "brown fox"), ("01.900", "02.600", "jumps."),
        ("03.100", "03.700", "Over the"), ("03.700", "04.800", "lazy dog."),  # runs restart at each segment
        ("09.000", "09.600", "Done!"),
    )


def test_highlight_words_with_gap_cues(worded):
    line = "The quick brown fox jumps."
    assert render(worded, "srt", SubtitleOptions(highlight_words=True)) == srt(
        ("00.000", "00.400", "<u>The</u> quick brown fox jumps."),
        ("00.400", "00.800", "The <u>quick</u> brown fox jumps."),
        ("00.800", "01.200", "The quick <u>brown</u> fox jumps."),
        ("01.200", "01.500", line),  # the gap before "fox": the plain line
        ("01.500", "01.900", "The quick brown <u>fox</u> jumps."),
        ("01.900", "02.600", "The quick brown fox <u>jumps.</u>"),
        # no gap cue between cues (2.6 -> 3.1)
        ("03.100", "03.500", "<u>Over</u> the lazy dog."),
        ("03.500", "03.700", "Over <u>the</u> lazy dog."),
        ("03.700", "04.200", "Over the <u>lazy</u> dog."),
        ("04.200", "04.800", "Over the lazy <u>dog.</u>"),
        ("09.000", "09.600", "<u>Done!</u>"),
    )


def test_highlight_words_in_vtt_with_line_breaks(worded):
    short = Transcription(worded.segments[0].text, "en", worded.segments[:1], duration=3.0)
    assert render(short, "vtt", SubtitleOptions(highlight_words=True, max_line_width=16)) == (
        "WEBVTT\n\n"
        "00:00.000 --> 00:00.400\n<u>The</u> quick brown\nfox jumps.\n\n"
        "00:00.400 --> 00:00.800\nThe <u>quick</u> brown\nfox jumps.\n\n"
        "00:00.800 --> 00:01.200\nThe quick <u>brown</u>\nfox jumps.\n\n"
        "00:01.200 --> 00:01.500\nThe quick brown\nfox jumps.\n\n"
        "00:01.500 --> 00:01.900\nThe quick brown\n<u>fox</u> jumps.\n\n"  # the "\n" stays outside the tags
        "00:01.900 --> 00:02.600\nThe quick brown\nfox <u>jumps.</u>\n\n"
    )


def test_a_word_wider_than_the_line_gets_a_line_of_its_own():
    words = [Word(0.0, 0.5, " a", 0.9), Word(0.5, 1.5, " internationalization", 0.9), Word(1.5, 2.0, " b", 0.9)]
    t = Transcription("", "en", [Segment(0, 0.0, 2.0, " a internationalization b", words=words)], 2.0)
    assert render(t, "srt", SubtitleOptions(max_line_width=5)) == srt(
        ("00.000", "02.000", "a\ninternationalization\nb"))


def test_unaligned_segments_keep_their_text():
    """words == [] (the engine could not align the window): the segment's own cue, wrapped, never split or
    highlighted; a blank one is left out. openai-whisper would drop the text."""
    segments = [
        Segment(0, 0.0, 1.0, " Hi there.", words=[Word(0.0, 0.4, " Hi", 0.9), Word(0.5, 1.0, " there.", 0.9)]),
        Segment(1, 1.0, 4.0, " Too long to align --> here", words=[]),
        Segment(2, 4.0, 4.5, " ", words=[]),
        Segment(3, 4.5, 5.0, " Bye.", words=[Word(4.5, 5.0, " Bye.", 0.9)]),
    ]
    t = Transcription("", "en", segments, 5.0)
    assert render(t, "srt", SubtitleOptions(max_line_width=12, max_line_count=1)) == srt(
        ("00.000", "01.000", "Hi there."),
        ("01.000", "04.000", "Too long to\nalign ->\nhere"),  # widths measured before "-->" becomes "->"
        ("04.500", "05.000", "Bye."))
    assert render(t, "srt", SubtitleOptions(highlight_words=True)) == srt(
        ("00.000", "00.400", "<u>Hi</u> there."), ("00.400", "00.500", "Hi there."),
        ("00.500", "01.000", "Hi <u>there.</u>"), ("01.000", "04.000", "Too long to align -> here"),
        ("04.500", "05.000", "<u>Bye.</u>"))


def test_arrows_in_words_are_defused():
    words = [Word(0.0, 0.5, " A", 0.9), Word(0.5, 1.0, " -->", 0.9), Word(1.0, 1.5, " B", 0.9)]
    t = Transcription("", "en", [Segment(0, 0.0, 1.5, " A --> B", words=words)], 1.5)
    assert render(t, "srt", SubtitleOptions(max_line_width=40)) == srt(("00.000", "01.500", "A -> B"))


def test_options_need_word_timestamps(transcription, tmp_path):
    with pytest.raises(ValueError, match=r"highlight_words needs word timestamps.*segment 0"):
        render(transcription, "vtt", SubtitleOptions(highlight_words=True))
    with pytest.raises(ValueError, match=r"max_line_width, max_line_count need word timestamps"):
        write_transcription(transcription, "all", tmp_path / "out", "a.wav",
                            SubtitleOptions(max_line_width=42, max_line_count=2))
    assert not (tmp_path / "out").exists()  # refused before anything is written
    # txt, tsv and json ignore the options, as openai-whisper's writers do
    options = SubtitleOptions(max_words_per_line=3)
    for fmt in ("txt", "tsv", "json"):
        assert render(transcription, fmt, options) == render(transcription, fmt)
    assert write_transcription(transcription, "txt", tmp_path, "a.wav", options) == [tmp_path / "a.txt"]


def test_write_with_options(worded, tmp_path):
    options = SubtitleOptions(max_words_per_line=2)
    paths = write_transcription(worded, "all", tmp_path, "clip.wav", options)
    for p, f in zip(paths, OUTPUT_FORMATS, strict=True):
        assert p.read_text(encoding="utf-8") == render(worded, f, options)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_line_width": 0}, "max_line_width must be a positive integer"),
    ({"max_line_width": -3}, "max_line_width must be a positive integer"),
    ({"max_words_per_line": 2.5}, "max_words_per_line must be a positive integer"),
    ({"max_line_width": 40, "max_line_count": True}, "max_line_count must be a positive integer"),
    ({"max_line_count": 2}, "max_line_count needs max_line_width"),
    ({"max_line_width": 40, "max_words_per_line": 3}, "max_words_per_line and max_line_width exclude each other"),
])
def test_subtitle_options_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SubtitleOptions(**kwargs)


HOSTILE = [" tab\there", " line one\nline two", " blank\n\n\nline --> arrow\r\nend", " naïve café 東京 🎉", "\n\t-->\n"]


@pytest.mark.parametrize("fmt", ["srt", "vtt", "tsv", "json", "txt"])
def test_hostile_text_keeps_every_format_well_formed(fmt):
    """Tabs, line breaks (blank lines too), '-->' and non-ASCII in segment text: one TSV row per
    segment, one SRT/VTT cue per segment with its number and timing line intact, JSON unchanged."""
    segments = [Segment(i, float(i), i + 0.5, text, tokens=[1]) for i, text in enumerate(HOSTILE)]
    t = Transcription("".join(HOSTILE), "en", segments, duration=5.0)
    out = render(t, fmt)
    if fmt == "tsv":
        rows = out.splitlines()
        assert len(rows) == 1 + len(segments) and all(len(row.split("\t")) == 3 for row in rows)
        assert rows[4].split("\t")[2] == "naïve café 東京 🎉"
        assert rows[2].split("\t")[2] == "line one line two"
    elif fmt in ("srt", "vtt"):
        body = out.removeprefix("WEBVTT\n\n") if fmt == "vtt" else out
        cues = body.rstrip("\n").split("\n\n")
        assert len(cues) == len(segments)
        sep = "," if fmt == "srt" else "."
        for i, cue in enumerate(cues):
            lines = cue.split("\n")
            if fmt == "srt":
                assert lines.pop(0) == str(i + 1)
            assert re.fullmatch(rf"[\d:]+{re.escape(sep)}\d{{3}} --> [\d:]+{re.escape(sep)}\d{{3}}", lines[0])
            assert lines[1:] and all(line.strip() and "-->" not in line for line in lines[1:])
        assert "naïve café 東京 🎉" in out
    elif fmt == "json":
        assert [s["text"] for s in json.loads(out)["segments"]] == HOSTILE
    else:
        assert "naïve café 東京 🎉" in out
