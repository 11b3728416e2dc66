"""Issue 15: no speech silently lost. Candidates ranked as openai-whisper ranks them, times
clamped to the audio, and the recording that lost 30 s of speech transcribed completely
(tests/recordings.py builds it from the bundled espeak-ng clips)."""

import numpy as np
import pytest
from recordings import build, missing_utterances, utterances

from encdec_engine.outputs import CompletionOutput, RequestOutput
from encdec_engine.speech.job import TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.ranking import best_candidate, candidate
from encdec_engine.speech.transcriber import Transcriber

EOT = 50256  # tiny.en's <|endoftext|>


def _out(*candidates: tuple[int, float]) -> RequestOutput:
    """A finished window request whose candidates have `length` text tokens then <|endoftext|>,
    and a summed log-probability."""
    outputs = [CompletionOutput(i, "", list(range(100, 100 + n)) + [EOT], lp, None, "stop")
               for i, (n, lp) in enumerate(candidates)]
    return RequestOutput("r", None, [], None, None, outputs, True)


def test_candidates_are_ranked_by_mean_log_probability_not_sum():
    # The window: a short improbable sample (9 tokens, mean -3.3) had the best sum,
    # the full transcript (90 tokens, mean -0.54) the best mean. openai-whisper keeps the latter.
    short, full = (8, -3.3 * 9), (90, -0.54 * 91)
    chosen = best_candidate(_out(short, full), EOT, None)
    assert len(chosen.tokens) == 90 and chosen.tokens[-1] != EOT
    # avg_logprob (what the fallback rules judge) divides by length + 1: the <|endoftext|> counts.
    assert chosen.avg_logprob == pytest.approx(-0.54)
    # score: the sum over the length of the text tokens (MaximumLikelihoodRanker, length_penalty None).
    assert candidate(_out(full).outputs[0], EOT).score(None) == pytest.approx(-0.54 * 91 / 90)


def test_length_penalty_is_googles_alpha():
    a, b = (10, -5.0), (30, -12.0)  # means over length: -0.5 vs -0.4; alpha 0 ranks by the sum
    assert len(best_candidate(_out(a, b), EOT, None).tokens) == 30
    assert len(best_candidate(_out(a, b), EOT, 0.0).tokens) == 10
    # alpha 1: sum / ((5 + length) / 6) -> -5 / 2.5 = -2.0 vs -12 / (35 / 6) = -2.06
    assert len(best_candidate(_out(a, b), EOT, 1.0).tokens) == 10
    assert candidate(_out(b).outputs[0], EOT).score(0.6) == pytest.approx(-12.0 / (35 / 6) ** 0.6)
    assert len(best_candidate(_out(a, a), EOT, None).tokens) == 10  # a tie keeps the first (np.argmax)


def test_ranking_needs_log_probabilities():
    out = RequestOutput("r", None, [], None, None, [CompletionOutput(0, "", [1, EOT], None, None, "stop")], True)
    with pytest.raises(ValueError, match="cumulative_logprob"):
        best_candidate(out, EOT, None)


def test_every_utterance_of_the_repeated_phrase_recording_is_kept(tiny_en):
    """Window 1 falls back to temperature 1.0; ranking its samples by their summed log-probability
    kept a 10-token sample and lost three of the four meeting sentences (fails on the old main)."""
    audio = build("repeated_phrase")
    assert len(audio) / 16000 == pytest.approx(34.65, abs=0.01) and len(utterances("repeated_phrase")) == 6
    t = tiny_en.transcribe(audio)[0]  # the defaults: temperatures 0 .. 1.0, best_of 5, seed 0
    assert missing_utterances("repeated_phrase", t.text) == [], t.text
    assert t.segments[0].temperature == 1.0  # the fallback was hit (else this test proves nothing)


def test_missing_utterances_sees_a_lost_sentence():
    spoken = utterances("repeated_phrase")
    assert missing_utterances("repeated_phrase", " ".join(spoken)) == []
    assert missing_utterances("repeated_phrase", " ".join(spoken[:2] + spoken[3:])) == [spoken[3]]
    # What the old ranking kept of window 1 (3 of 9 words of a meeting sentence: not enough), and then
    # the first Stella sentence.
    assert missing_utterances("repeated_phrase", "STEP Welcome to pharmacy meeting, Deborah " + spoken[4]) \
        == spoken[:4] + [spoken[5]]


def _window(tiny_en, seconds: float, clip_timestamps=()) -> tuple[Transcriber, TranscriptionJob]:
    transcriber = Transcriber(tiny_en.engine, TranscribeOptions(language="en", clip_timestamps=clip_timestamps))
    job = TranscriptionJob(0, None, samples=np.zeros(round(seconds * 16000), dtype=np.float32), language="en")
    job.long_form = True
    job.clips = [(0, job.num_frames)]
    return transcriber, job


@pytest.mark.parametrize("clip", [(), (0.0, 2.5)])
def test_segment_times_end_at_the_audio_or_clip_end(tiny_en, clip):
    """A last timestamp token past the audio (the issue's 44 s file ended at 51.24 s) is clamped."""
    transcriber, job = _window(tiny_en, 3.0)
    if clip:
        job.clips = [(0, 250)]
    ts = transcriber.tokens.timestamp_begin
    text = tiny_en.get_tokenizer()(" Thank you.", add_special_tokens=False)["input_ids"]
    tokens = [ts, *text, ts + 100, ts + 100, *text, ts + 250]  # 0.00-2.00, then 2.00-5.00 on 3 s of audio
    window = transcriber.assembler.decoded_window(job, tokens, 300, 0.0, _quality())
    end = 2.5 if clip else 3.0
    assert [(s.start, s.end) for s in window.segments] == [(0.0, 2.0), (2.0, end)]
    assert window.seek == 300  # seek still follows the tokens (openai-whisper): the window is used up


def _quality():
    from encdec_engine.speech.fallback import WindowQuality

    return WindowQuality(-0.2, 1.0, 0.01)


def test_word_times_are_clamped_with_their_segment():
    from encdec_engine.speech.assembly import clamp_words
    from encdec_engine.speech.results import Segment, Word

    seg = Segment(0, 2.0, 5.0, " Thank you.", [1], words=[Word(2.0, 2.8, " Thank", 0.9), Word(2.8, 5.0, " you.", 0.9)])
    clamp_words([seg], 3.0)
    assert (seg.start, seg.end) == (2.0, 3.0)
    assert [(w.start, w.end) for w in seg.words] == [(2.0, 2.8), (2.8, 3.0)]
