"""clip_timestamps and hallucination_silence_threshold (openai-whisper's options; on long_meeting.flac and a
noisy mix the engine's segments and words equal faster-whisper's with them, checked by hand)."""

import json
from pathlib import Path

import jiwer
import pytest
from helpers import norm, record_adds

from encdec_engine.speech.hallucinations import cut_hallucinations, is_segment_anomaly, word_anomaly_score
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Segment, Word

AUDIO = Path(__file__).resolve().parents[2] / "prompts" / "audio"
TRANSCRIPTS = json.loads((AUDIO / "transcripts.json").read_text())


def test_clips_transcribe_only_their_audio(tiny_en):
    full = tiny_en.transcribe(AUDIO / "long_meeting.flac")[0]
    clipped = tiny_en.transcribe(AUDIO / "long_meeting.flac", clip_timestamps="3,20,33.5")[0]
    assert clipped.segments and clipped.duration == full.duration
    assert all(3.0 <= s.start and (s.end <= 20.0 or s.start >= 33.5) for s in clipped.segments)
    assert any(s.end > 60 for s in clipped.segments)  # an odd count: the last clip runs to the end
    # Speech wholly outside the clips is not transcribed.
    skipped = [s.text for s in full.segments if 21.0 <= s.start and s.end <= 33.0]
    assert skipped and not any(text in clipped.text for text in skipped)


def test_clips_past_the_end_give_an_empty_transcript_and_short_audio_clips(tiny_en):
    past, short = tiny_en.transcribe([AUDIO / "weather.wav", AUDIO / "learning.wav"], clip_timestamps=[100.0])
    assert past.error is None and past.segments == [] and past.text == ""
    assert short.error is None and short.segments == []
    weather = tiny_en.transcribe(AUDIO / "weather.wav", clip_timestamps=[0.0, 1.6])[0]
    # The window holds 1.6 s of audio (then zeros); as in faster-whisper, its last timestamp may lie past that.
    assert weather.segments and all(s.start < 1.6 for s in weather.segments)
    assert "park" not in weather.text  # said after 1.6 s


def test_hallucination_threshold_keeps_clean_speech(tiny_en):
    plain = tiny_en.transcribe(AUDIO / "long_meeting.flac", word_timestamps=True)[0]
    checked = tiny_en.transcribe(AUDIO / "long_meeting.flac", word_timestamps=True,
                                 hallucination_silence_threshold=2.0)[0]
    assert checked.text == plain.text
    assert [w for s in checked.segments for w in s.words] == [w for s in plain.segments for w in s.words]


@pytest.mark.parametrize("options,match", [
    (dict(clip_timestamps="0,abc"), "comma-separated seconds"),
    (dict(clip_timestamps=[5.0, 2.0]), "must ascend"),
    (dict(clip_timestamps=[0.0, 5.0, 4.0, 9.0]), "must ascend"),
    (dict(clip_timestamps=[0.0, 5.0, 5.0, 5.0]), "must ascend"),
    (dict(clip_timestamps=[-1.0]), "non-negative"),
    (dict(hallucination_silence_threshold=2.0), "needs word_timestamps"),
    (dict(hallucination_silence_threshold=0.0, word_timestamps=True), "positive number of seconds"),
])
def test_bad_options_name_the_problem(options, match):
    with pytest.raises(ValueError, match=match):
        TranscribeOptions(**options)


def test_adjacent_clips_and_the_next_clip_starts_at_its_start():
    from encdec_engine.speech.job import TranscriptionJob
    from encdec_engine.speech.transcriber import WindowPlanner

    assert TranscribeOptions(clip_timestamps="0,5,5,9").clip_timestamps == (0.0, 5.0, 5.0, 9.0)
    # A window of the first clip ran on to frame 1600: the second clip still starts at its start, as in
    # openai-whisper and faster-whisper.
    job = TranscriptionJob(0, None, long_form=True, clips=[(0, 1530), (1560, 3000)], seek=1600)
    assert WindowPlanner.advance(job) and (job.clip_index, job.seek) == (1, 1560)
    job.seek = 3000
    assert not WindowPlanner.advance(job) and job.done


def words_segment(start: float, words: list[tuple[str, float, float, float]]) -> Segment:
    ws = [Word(s, e, text, p) for text, s, e, p in words]
    return Segment(0, start, ws[-1].end, "".join(w.word for w in ws), [], 0.0, 0.0, 1.0, 0.0, words=ws)


SPEECH = [(" We", 0.0, 0.3, 0.9), (" met", 0.3, 0.6, 0.9), (" today.", 0.6, 1.0, 0.9)]


def shifted(words, dt: float):
    return [(w, s + dt, e + dt, p) for w, s, e, p in words]


# A hallucination: improbable words of implausible length.
HALLUCINATION = [(" Thank", 0.0, 0.05, 0.05), (" you.", 0.05, 0.1, 0.05)]


def test_word_anomaly_scores():
    assert word_anomaly_score(Word(0.0, 0.3, " fine", 0.9)) == 0.0
    assert word_anomaly_score(Word(0.0, 0.3, " odd", 0.1)) == 1.0
    assert word_anomaly_score(Word(0.0, 0.033, " short", 0.9)) == pytest.approx(1.5)
    assert word_anomaly_score(Word(0.0, 3.0, " long", 0.9)) == pytest.approx(1.0)
    assert not is_segment_anomaly(words_segment(0.0, SPEECH))
    assert is_segment_anomaly(words_segment(0.0, HALLUCINATION))
    assert not is_segment_anomaly(None)


def test_cut_seeks_to_the_last_word_unless_little_of_the_window_is_left():
    segments = [words_segment(10.0, shifted(SPEECH, 10.0))]  # window from 10 s: speech ends at 11 s
    cut = cut_hallucinations(segments, 2.0, seek=1000, window_frames=3000, single_ending=False,
                             last_speech=9.0, total_frames=6000)
    assert (cut.seek, cut.keep, cut.discard) == (1100, 1, False)
    cut = cut_hallucinations(segments, 29.5, seek=1000, window_frames=3000, single_ending=False,
                             last_speech=9.0, total_frames=6000)  # 29 s left after it: not more than 29.5
    assert cut.seek == 4000
    cut = cut_hallucinations(segments, 2.0, seek=1000, window_frames=3000, single_ending=True,
                             last_speech=9.0, total_frames=6000)
    assert cut.seek is None  # a used-up window keeps its own seek


def test_cut_drops_a_window_that_starts_with_a_hallucination_after_silence():
    segments = [words_segment(15.0, shifted(HALLUCINATION, 15.0)), words_segment(20.0, shifted(SPEECH, 20.0))]
    cut = cut_hallucinations(segments, 2.0, seek=1000, window_frames=3000, single_ending=False,
                             last_speech=9.0, total_frames=6000)
    assert (cut.seek, cut.keep, cut.discard) == (1500, 0, True)  # on from the end of the 5 s of silence


def test_cut_ends_the_window_at_a_hallucination_between_silences():
    segments = [words_segment(10.0, shifted(SPEECH, 10.0)), words_segment(16.0, shifted(HALLUCINATION, 16.0)),
                words_segment(25.0, shifted(SPEECH, 25.0))]
    cut = cut_hallucinations(segments, 2.0, seek=1000, window_frames=3000, single_ending=False,
                             last_speech=9.0, total_frames=6000)
    assert (cut.seek, cut.keep, cut.discard) == (1600, 1, False)
    # Near the end of the recording: nothing but silence is left, so it goes on from the end.
    cut = cut_hallucinations(segments, 2.0, seek=1000, window_frames=3000, single_ending=False,
                             last_speech=9.0, total_frames=1700)
    assert (cut.seek, cut.keep) == (1700, 1)


def test_cut_keeps_a_hallucination_like_segment_next_to_speech():
    segments = [words_segment(10.0, shifted(SPEECH, 10.0)), words_segment(11.2, shifted(HALLUCINATION, 11.2)),
                words_segment(11.5, shifted(SPEECH, 11.5))]
    cut = cut_hallucinations(segments, 2.0, seek=1000, window_frames=3000, single_ending=False,
                             last_speech=9.0, total_frames=6000)
    assert (cut.keep, cut.discard) == (3, False)


def test_quiet_cuts_fall_in_the_quietest_frames():
    import numpy as np

    from encdec_engine.speech.chunking import quiet_cuts

    loudness = np.zeros(7000)
    assert quiet_cuts(loudness, 0, 2500) == [(0, 2500)]
    loudness[2500], loudness[5100] = -5.0, -3.0  # pauses, within the last 10 s of each 30 s span
    loudness[1000] = -9.0  # quieter, but too early: the window would be 10 s
    assert quiet_cuts(loudness, 0, 7000) == [(0, 2500), (2500, 5100), (5100, 7000)]
    flat = quiet_cuts(np.zeros(7000), 0, 7000)  # no pause: the latest frame, a full window each
    assert flat == [(0, 3000), (3000, 6000), (6000, 7000)]
    assert quiet_cuts(loudness, 4000, 6500) == [(4000, 6500)]


def test_chunked_runs_the_chunks_of_one_file_at_once(tiny_en, monkeypatch):
    added = record_adds(tiny_en.engine, monkeypatch)  # (request_id, requests finished by then)
    chunked = tiny_en.transcribe(AUDIO / "long_meeting.flac", chunked=True, word_timestamps=True)[0]
    monkeypatch.undo()
    parts = sorted({rid.split("-")[3] for rid, _ in added})
    assert len(parts) >= 3
    assert all(done == 0 for rid, done in added if rid.endswith("-0-0")), added  # every chunk starts at once
    assert [s.id for s in chunked.segments] == list(range(len(chunked.segments)))
    assert all(a.end <= b.start + 0.01 for a, b in zip(chunked.segments, chunked.segments[1:]))
    assert all(s.words and s.start - 0.7 <= s.words[0].start for s in chunked.segments)
    wer = jiwer.wer(norm(TRANSCRIPTS["long_meeting.flac"]), norm(chunked.text))
    assert wer < 0.15, wer
    short = AUDIO / "weather.wav"
    timed = [[(s.start, s.end, s.tokens) for s in t.segments] for t in tiny_en.transcribe([short, short], chunked=True)]
    assert timed[0] == [(s.start, s.end, s.tokens) for s in tiny_en.transcribe(short)[0].segments] == timed[1]
