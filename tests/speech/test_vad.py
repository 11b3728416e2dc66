"""Silero VAD, batched (speech/vad.py), and the joined-speech timeline (speech/timeline.py): the spans
equal silero_vad.get_speech_timestamps on every test recording, and times map back onto the recording."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from vad_audio import AUDIO, CLIPS, clip, fixtures, recording, silence, tone, white_noise

from encdec_engine.inputs.audio import SAMPLE_RATE
from encdec_engine.machine.threads import one_thread
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.results import Segment, Word
from encdec_engine.speech.timeline import SpeechTimeline
from encdec_engine.speech.vad import VadOptions, shared_vad

PARAMETERS = [
    VadOptions(),  # faster-whisper's defaults
    TranscribeOptions(vad_filter=True, chunked=True).vad_parameters,  # its batched pipeline's
    VadOptions(threshold=0.6, neg_threshold=0.3, min_speech_duration_ms=250, max_speech_duration_s=3.0,
               min_silence_duration_ms=100, speech_pad_ms=30),  # silero's own defaults, and splits
]


@pytest.fixture(scope="module")
def recordings() -> dict[str, np.ndarray]:
    recs = {name: rec.samples for name, rec in fixtures().items()}
    recs.update({name: clip(name) for name in CLIPS})
    recs["meeting_40s"] = clip("long_meeting.flac")[: 40 * SAMPLE_RATE]
    recs["stereo_44k"] = clip("meeting_stereo_44k.wav")
    recs["pure_silence"] = silence(3)
    recs["noise_only"] = white_noise(5)
    return recs


@pytest.mark.parametrize("options", PARAMETERS, ids=["faster-whisper", "batched", "silero-splits"])
def test_speech_spans_equal_silero_get_speech_timestamps(recordings, options):
    import silero_vad

    names = list(recordings)
    got = shared_vad().speech_spans([recordings[n] for n in names], options)  # all recordings in one batch
    model = silero_vad.load_silero_vad()
    with one_thread():
        for name, spans in zip(names, got):
            expected = silero_vad.get_speech_timestamps(
                torch.from_numpy(recordings[name]), model, threshold=options.threshold,
                neg_threshold=options.neg_threshold, min_speech_duration_ms=options.min_speech_duration_ms,
                max_speech_duration_s=options.max_speech_duration_s,
                min_silence_duration_ms=options.min_silence_duration_ms, speech_pad_ms=options.speech_pad_ms)
            assert spans == [(s["start"], s["end"]) for s in expected], name
    assert sum(map(len, got)) > len(names)  # speech was found, and split where asked
    assert got[names.index("pure_silence")] == [] and got[names.index("noise_only")] == []


def test_speech_probs_equal_the_frame_loop():
    """The batched network (front on all frames, one LSTM per recording) against silero's model called
    frame by frame, across the window boundary where the LSTM state is carried."""
    import silero_vad

    audios = [clip("long_meeting.flac")[: 40 * SAMPLE_RATE], clip("fox.wav"), np.zeros(0, np.float32),
              np.full(700, 0.1, np.float32)]
    probs = shared_vad().speech_probs(audios)
    model = silero_vad.load_silero_vad()
    with one_thread(), torch.no_grad():
        for audio, got in zip(audios, probs):
            model.reset_states()
            frames = torch.nn.functional.pad(torch.from_numpy(audio), (0, -len(audio) % 512)).view(-1, 512)
            expected = [model(frame, SAMPLE_RATE).item() for frame in frames]
            assert got.shape == (len(expected),)
            np.testing.assert_allclose(got, expected, atol=1e-4)
    assert len(probs[0]) > 1024  # more than one window of frames


def test_the_vad_reports_the_seconds_it_has_searched_up_to_all_of_them():
    """The progress bar's VAD phase sat at 0% until the VAD was done (nothing told how far it was): it
    reports after each window of frames now, in seconds of audio, the last report at the total."""
    audios = [np.zeros(70 * SAMPLE_RATE + 123, np.float32), np.zeros(0, np.float32), np.full(700, 0.1, np.float32)]
    reports = []
    shared_vad().speech_spans(audios, VadOptions(), on_progress=lambda done, total: reports.append((done, total)))
    total = (70 * SAMPLE_RATE + 123 + 700) / SAMPLE_RATE
    assert len(reports) == 3  # the 70 s recording takes 3 windows of 1024 frames
    assert all(t == pytest.approx(total) for _, t in reports)
    assert [d for d, _ in reports] == sorted(d for d, _ in reports) and reports[0][0] > 0
    assert reports[-1][0] == pytest.approx(total)


@pytest.mark.integration  # a subprocess of the engine
def test_importing_silero_keeps_the_thread_count():
    """silero_vad sets one thread for the whole process when imported; loading it here does not."""
    code = ("import torch; torch.set_num_threads(2); from encdec_engine.speech.vad import SileroVad; "
            "SileroVad(); print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2"]


@pytest.mark.parametrize("options,match", [
    (dict(vad_parameters={"threshold": 0.4}), "vad_parameters need vad_filter=True"),
    (dict(vad_filter=True, clip_timestamps="0,5"), "cannot be combined"),
    (dict(vad_filter=True, vad_parameters={"thresh": 0.4}), r"unknown vad_parameters \['thresh'\]"),
    (dict(vad_filter=True, vad_parameters={"threshold": 1.5}), "threshold must be a probability"),
    (dict(vad_filter=True, vad_parameters={"threshold": 0.3, "neg_threshold": 0.5}), "must not exceed threshold"),
    (dict(vad_filter=True, vad_parameters={"speech_pad_ms": -1}), "speech_pad_ms must be a non-negative"),
    (dict(vad_filter=True, vad_parameters={"min_silence_duration_ms": "long"}), "min_silence_duration_ms"),
    (dict(vad_filter=True, vad_parameters={"max_speech_duration_s": 0.5}), "max_speech_duration_s must be"),
    (dict(vad_filter=True, vad_parameters=[0.5]), "must be a dict or a VadOptions"),
])
def test_bad_vad_options_name_the_problem(options, match):
    with pytest.raises(ValueError, match=match):
        TranscribeOptions(**options)


def test_vad_defaults_are_faster_whispers():
    assert TranscribeOptions(vad_filter=True).vad_parameters == VadOptions(
        threshold=0.5, neg_threshold=None, min_speech_duration_ms=0, max_speech_duration_s=float("inf"),
        min_silence_duration_ms=2000, speech_pad_ms=400)
    # BatchedInferencePipeline: its own defaults when none are given; a dict keeps VadOptions' defaults,
    # and speech is never longer than a window.
    batched = TranscribeOptions(vad_filter=True, chunked=True)
    assert (batched.vad_parameters.max_speech_duration_s, batched.vad_parameters.min_silence_duration_ms) == (30, 160)
    given = TranscribeOptions(vad_filter=True, chunked=True, vad_parameters={"threshold": 0.4}).vad_parameters
    assert (given.threshold, given.max_speech_duration_s, given.min_silence_duration_ms) == (0.4, 30, 2000)
    assert TranscribeOptions().vad_parameters is None


# -- the timeline ---------------------------------------------------------------------------------
S = SAMPLE_RATE


def test_spans_join_into_chunks_of_at_most_the_limit():
    spans = [(0, 10 * S), (20 * S, 35 * S), (40 * S, 45 * S), (50 * S, 80 * S), (90 * S, 90 * S + 100)]
    timeline = SpeechTimeline.of(spans, 100 * S, pad=0, max_chunk_samples=30 * S)
    assert timeline.spans == tuple(spans[:4])  # shorter than a mel frame: nothing to decode
    assert timeline.chunks == ((0, 3), (3, 4))  # 10 + 15 + 5 s; then 30 s would pass 30 s: a chunk of its own
    assert timeline.chunk_frames() == [(0, 3000), (3000, 6000)]
    assert SpeechTimeline.of(spans, 100 * S, max_chunk_samples=25 * S).chunks == ((0, 2), (2, 3), (3, 4))
    assert SpeechTimeline.of(spans, 100 * S).chunks == ((0, 4),)
    samples = np.arange(100 * S, dtype=np.float32)
    joined = timeline.join(samples)
    assert len(joined) == 60 * S and joined[10 * S] == 20 * S and joined[25 * S] == 40 * S
    assert SpeechTimeline.of([], 5 * S).join(samples).shape == (0,)


def seg(start: float, end: float, words: list[tuple[float, float]] | None = None) -> Segment:
    return Segment(0, start, end, " x", words=None if words is None else [Word(a, b, " w", 0.9) for a, b in words])


def test_times_map_back_through_the_span_that_holds_them():
    # Speech at 2-5 s and 20-24 s (VAD padding 0.4 s included), then 24-30 s touching it: joined 0-3, 3-7, 7-13.
    pad = round(0.4 * S)
    timeline = SpeechTimeline.of([(2 * S, 5 * S), (20 * S, 24 * S), (24 * S, 30 * S)], 40 * S, pad=pad)
    words = [(0.1, 1.0), (2.9, 3.6)]
    out = timeline.restore([seg(0.5, 1.5), seg(3.5, 6.5), seg(7.5, 12.0), seg(0.1, 3.6, words), seg(12.5, 14.0)], 0)
    assert [(s.start, s.end) for s in out[:3]] == [(2.5, 3.5), (20.5, 23.5), (24.5, 29.0)]
    # Words map through the span holding their middle; a time in padding beside removed audio moves to
    # where the VAD heard speech (2.4 s, 20.4 s), and times past the speech stay in it (29.6 s).
    assert [(w.start, w.end) for w in out[3].words] == [(2.4, 3.0), (20.4, 20.6)]
    assert (out[3].start, out[3].end) == (2.4, 20.6) and out[3].words[0].word == " w"
    assert (out[4].start, out[4].end) == (29.5, 29.6)
    # Where spans touch (24 s) no audio was removed: nothing moves.
    assert [(s.start, s.end) for s in timeline.restore([seg(6.9, 7.2)], 0)] == [(23.9, 24.2)]


def test_segment_boundaries_near_a_join_go_to_its_side():
    """Whisper puts a boundary somewhere in the pause it hears: within a second before a join a start
    belongs to the speech after it, within a second after one an end to the speech before."""
    pad = round(0.4 * S)
    timeline = SpeechTimeline.of([(2 * S, 5 * S), (20 * S, 24 * S)], 30 * S, pad=pad)  # joined 0-3, 3-7
    late_start, early_end, both = timeline.restore([seg(2.3, 5.0), seg(0.0, 3.6), seg(2.9, 3.1)], 0)
    assert (late_start.start, late_start.end) == (20.4, 22.0)
    assert (early_end.start, early_end.end) == (2.4, 4.6)
    assert (both.start, both.end) == (4.6, 20.4)  # snapping both would end before it starts: plain map
    assert [(s.start, s.end) for s in timeline.restore([seg(1.0, 1.9), seg(4.2, 6.0)], 0)] == [(3.0, 3.9), (21.2, 23.0)]


def test_a_chunk_maps_through_its_own_spans_only():
    timeline = SpeechTimeline.of([(0, 10 * S), (40 * S, 60 * S)], 60 * S, max_chunk_samples=15 * S)
    assert timeline.chunks == ((0, 1), (1, 2))
    # Chunk 0's window runs past its 10 s of speech: the time stays in chunk 0's speech (no jump over the
    # 30 s gap to chunk 1's); chunk 1's times start where its speech does on the joined timeline (10 s).
    assert timeline.restore([seg(9.0, 12.0)], 0)[0].end == 10.0
    assert timeline.restore([seg(10.0, 12.0)], 1)[0].start == 40.0
    assert timeline.restore([], 1) == []


# -- no speech: nothing is decoded ----------------------------------------------------------------
def test_no_speech_gives_an_empty_transcript_without_decoding(tmp_path, make_llm, monkeypatch):
    from helpers import make_whisper, record_requests

    llm = make_llm(make_whisper(tmp_path / "w", "tiny-80", multilingual=True, seed=3))
    added = record_requests(llm.engine, monkeypatch)
    inputs = [silence(40), white_noise(20), tone(8), silence(3), AUDIO / "missing.wav"]
    for chunked in (False, True):
        results = llm.transcribe(inputs, vad_filter=True, chunked=chunked)
        assert [(r.text, r.segments) for r in results[:4]] == [("", [])] * 4
        assert [r.duration for r in results[:4]] == [40.0, 20.0, 8.0, 3.0]
        assert "not found" in results[4].error
    assert added == []  # not even language detection


def test_speech_is_found_across_many_files_at_once(monkeypatch):
    """The offline driver runs the VAD once over every input."""
    from encdec_engine.speech.transcriber import WindowPlanner

    calls = []
    vad = shared_vad()
    speech_spans = vad.speech_spans
    monkeypatch.setattr(vad, "speech_spans", lambda audios, options, **kw: calls.append(len(audios))
                        or speech_spans(audios, options, **kw))
    planner = WindowPlanner(TranscribeOptions(vad_filter=True), n_mels=80)
    recs = [recording("fox.wav", silence(12), "weather.wav"), recording(silence(2), "coffee.wav")]
    jobs = planner.load_many([(0, recs[0].samples), (1, b"not audio"), (2, recs[1].samples)], "en")
    assert calls == [2] and jobs[1].error is not None
    assert [len(j.speech.spans) for j in (jobs[0], jobs[2])] == [2, 1]
    assert jobs[0].duration < 8.5 and jobs[0].speech.duration == pytest.approx(len(recs[0].samples) / S)
