"""Transcription with Silero VAD on tiny.en (vad_filter, chunked): recordings with silence, white noise,
babble and a tone between the bundled espeak-ng clips. No words land in the non-speech, segments and
words lie within 0.3 s of the speech, and times agree with those of the same speech without the gaps."""

import difflib

import jiwer
import numpy as np
import pytest
from helpers import norm, record_adds, record_requests
from vad_audio import CLIPS, Recording, fixtures, recording, silence

from encdec_engine.inputs.audio import SAMPLE_RATE

TOLERANCE = 0.3  # seconds: a segment or word may run this far past the speech it belongs to
STEP = 0.02  # seconds: Whisper's time resolution (timestamp tokens, alignment frames)
MODES = {"sequential": dict(vad_filter=True), "chunked": dict(vad_filter=True, chunked=True)}


@pytest.fixture(scope="module")
def runs(tiny_en):
    """Transcripts of the fixtures (all in one call per setting), computed once: runs(mode, words)."""
    recs, done = fixtures(), {}

    def run(mode: str, words: bool) -> list:
        if (mode, words) not in done:
            options = dict(MODES.get(mode, {}), word_timestamps=words)
            audio = [gapless(rec).samples for rec in recs.values()] if mode == "gapless" else \
                [rec.samples for rec in recs.values()]
            done[mode, words] = tiny_en.transcribe(audio, **options)
        return done[mode, words]

    return recs, run


def overrun(start: float, end: float, rec: Recording) -> float:
    """Seconds by which [start, end] runs past the nearest one of the recording's speech spans."""
    return min(max(a - start, end - b, 0.0) for a, b in rec.speech)


def words_of(result) -> list:
    return [w for s in result.segments for w in s.words]


@pytest.mark.parametrize("mode", MODES)
def test_vad_keeps_words_and_segments_on_the_speech(runs, mode):
    recs, run = runs
    worst = {}
    for (name, rec), result in zip(recs.items(), run(mode, words=True)):
        words = words_of(result)
        assert len(words) >= len(norm(rec.text).split()) - 2, (name, result.text)
        worst[name] = max(overrun(x.start, x.end, rec) for x in [*result.segments, *words])
        assert jiwer.wer(norm(rec.text), norm(result.text)) <= 0.15, (name, result.text)
        assert result.duration == round(len(rec.samples) / SAMPLE_RATE, 3)
        assert [s.id for s in result.segments] == list(range(len(result.segments)))
    print(f"{mode}: the farthest a segment or word runs past its speech: {worst}")
    assert max(worst.values()) <= TOLERANCE + STEP, worst


@pytest.mark.parametrize("mode", [pytest.param("sequential", marks=pytest.mark.slow), "chunked"])
def test_vad_segments_without_words_stay_off_the_non_speech(runs, mode):
    """Without word timestamps the segments are still placed by their words (aligned, then left out of
    the result): Whisper's timestamp tokens start a window's first segment at its start, which on the
    babble recording is noise the VAD heard as speech 0.53 s before the utterance."""
    recs, run = runs
    worst = {}
    for (name, rec), result in zip(recs.items(), run(mode, words=False)):
        assert result.segments and all(s.words is None for s in result.segments)
        worst[name] = max(overrun(s.start, s.end, rec) for s in result.segments)
        assert all(a.end <= b.start for a, b in zip(result.segments, result.segments[1:]))
    print(f"{mode}, no words: the farthest a segment runs past its speech: {worst}")
    assert max(worst.values()) <= TOLERANCE + STEP, worst


@pytest.mark.parametrize("mode", MODES)
def test_streamed_vad_segments_are_on_the_recording_timeline(tiny_en, mode):
    """transcribe_segments hands out the same segments as transcribe: times mapped back onto the
    recording, not those of the joined speech."""
    rec = fixtures()["silence10"]
    whole = tiny_en.transcribe(rec.samples, **MODES[mode])[0].segments
    streamed = list(tiny_en.transcribe_segments(rec.samples, **MODES[mode]))
    assert [(s.id, s.start, s.end, s.text, s.words) for s in streamed] == \
        [(s.id, s.start, s.end, s.text, s.words) for s in whole]
    assert streamed[-1].start > 10.0  # after the 10 s of silence


@pytest.mark.parametrize("mode", MODES)
def test_vad_times_agree_with_the_speech_without_the_gaps(runs, mode):
    """Each word's time after VAD equals its time in the clips played back to back (no VAD), shifted by
    what was inserted before its clip."""
    recs, run = runs
    errors = []
    for rec, before, after in zip(recs.values(), run("gapless", words=True), run(mode, words=True)):
        ref = gapless(rec)
        shift = [b - a for a, b in zip(ref.offsets, rec.offsets)]
        pairs = matched_words(words_of(before), words_of(after))
        assert len(pairs) >= 0.8 * len(words_of(before))
        for w_ref, w in pairs:
            k = max(i for i, o in enumerate(ref.offsets) if o <= (w_ref.start + w_ref.end) / 2)
            errors += [abs(w.start - (w_ref.start + shift[k])), abs(w.end - (w_ref.end + shift[k]))]
    print(f"{mode}: {len(errors) // 2} words, max error {max(errors):.3f} s, median {np.median(errors):.3f} s")
    assert max(errors) <= TOLERANCE + STEP


def test_without_vad_the_engine_loses_speech_and_strays_into_the_gaps(runs):
    """What the README says the engine produces on these recordings without VAD (sequential long-form): the
    utterance after a long gap is lost on some, words stretch into the noise on others; with VAD neither."""
    recs, run = runs
    rows = {name: [(jiwer.wer(norm(rec.text), norm(r.text)), stray_words(r, rec)) for r in (without, with_vad)]
            for (name, rec), without, with_vad in zip(recs.items(), run("none", True), run("sequential", True))}
    print("\n(WER, words more than 0.32 s off the speech) without VAD | with VAD")
    for name, (without, with_vad) in rows.items():
        print(f"{name:>10}: ({without[0]:.2f}, {without[1]}) | ({with_vad[0]:.2f}, {with_vad[1]})")
    assert all(with_vad[1] == 0 for _, with_vad in rows.values())
    assert any(without[0] > 0.3 or without[1] > 0 for without, _ in rows.values())


def stray_words(result, rec: Recording) -> int:
    """How many words run more than the tolerance past the speech."""
    return sum(overrun(w.start, w.end, rec) > TOLERANCE + STEP for w in words_of(result))


def gapless(rec: Recording) -> Recording:
    """The same clips back to back, nothing between them."""
    return recording(*rec.clips)


def matched_words(a: list, b: list) -> list[tuple]:
    """Pairs of the same words (normalized) in the two word lists, in order."""
    key = [norm(w.word) for w in a], [norm(w.word) for w in b]
    blocks = difflib.SequenceMatcher(None, *key, autojunk=False).get_matching_blocks()
    return [(a[m.a + i], b[m.b + i]) for m in blocks for i in range(m.size)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_vad_over_a_minute_of_silence(tiny_en, mode):
    """Without VAD the engine decodes the silent minute (and tiny.en hears words in it); with VAD, nothing
    there is decoded."""
    rec = fixtures(long=True)["silence60"]
    result = tiny_en.transcribe(rec.samples, word_timestamps=True, **MODES[mode])[0]
    assert jiwer.wer(norm(rec.text), norm(result.text)) <= 0.15, result.text
    assert max(overrun(x.start, x.end, rec) for x in [*result.segments, *words_of(result)]) <= TOLERANCE + STEP
    without = tiny_en.transcribe(rec.samples, word_timestamps=True, chunked=MODES[mode].get("chunked", False))[0]
    in_gap = [w.word for w in words_of(without) if overrun(w.start, w.end, rec) > TOLERANCE + STEP]
    print(f"\n{mode} without VAD: {without.text!r}; words in the silent minute: {in_gap}")
    assert in_gap  # tiny.en hears words in the silence: what the README states


def long_recording() -> Recording:
    """Eight utterances with 6 s pauses: 35 s of speech once the pauses are removed."""
    return recording(*[p for n in [*CLIPS, "fox.wav", "weather.wav"] for p in (n, silence(6))])


def test_sequential_vad_long_form_is_conditioned_and_skips_the_non_speech(tiny_en, monkeypatch):
    """Over 30 s of speech, joined: windows one after another, each conditioned on the text before,
    as faster-whisper's vad_filter does; the pauses are never decoded."""
    rec = long_recording()
    added = record_requests(tiny_en.engine, monkeypatch)
    result = tiny_en.transcribe(rec.samples, vad_filter=True)[0]
    monkeypatch.undo()
    decodes = [prompt["decoder_prompt"]["prompt_token_ids"] for _, prompt, params in added
               if params.prompt_logprobs is None]  # not the requests that align a window's words
    assert len(decodes) >= 2 and decodes[0][0] != decodes[1][0]  # the second window starts with <|startofprev|>
    assert jiwer.wer(norm(rec.text), norm(result.text)) <= 0.15, result.text
    assert max(overrun(s.start, s.end, rec) for s in result.segments) <= TOLERANCE + STEP
    assert result.segments[-1].end > rec.speech[-1][0]


def test_vad_chunks_of_many_files_are_decoded_at_once(tiny_en, monkeypatch):
    """With chunked, the speech chunks (at most 30 s each) of every file start together."""
    added = record_adds(tiny_en.engine, monkeypatch)  # (request_id, requests finished by then)
    long, short = long_recording(), recording(silence(5), "fox.wav", silence(4))
    results = tiny_en.transcribe([long.samples, short.samples], vad_filter=True, chunked=True, word_timestamps=True)
    monkeypatch.undo()
    first = {tuple(rid.split("-")[2:4]) for rid, done in added if done == 0}  # (file, chunk) of the first requests
    assert first == {("0", "0"), ("0", "1"), ("1", "0")}, added
    for rec, result in zip((long, short), results):
        assert jiwer.wer(norm(rec.text), norm(result.text)) <= 0.15, result.text
        assert max(overrun(w.start, w.end, rec) for w in words_of(result)) <= TOLERANCE + STEP
