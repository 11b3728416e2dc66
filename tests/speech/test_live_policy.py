"""The live streaming policy on its own (no audio decoded): LocalAgreement over token hypotheses, words
found again in a hypothesis that changed them, the final decode, trimming a long turn's buffer, flushing,
stale results, the options' validation. The tokens are tiny.en's; the model's engine is only read for its token facts."""

import numpy as np
import pytest

from encdec_engine.speech.live.agreement import Word, agreed_words, align, word_spans
from encdec_engine.speech.live.model import LiveModel
from encdec_engine.speech.live.options import LiveOptions, TurnDetection
from encdec_engine.speech.live.turn import Kind, LiveTurn


@pytest.fixture(scope="module")
def model(make_llm):
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    return LiveModel(make_llm(default_model_path()).engine)


def ids(model: LiveModel, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def ts(model: LiveModel, seconds: float) -> int:
    return model.tokens.timestamp_begin + round(seconds / 0.02)


def turn(model: LiveModel, seconds: float = 3.0, **options) -> LiveTurn:
    t = LiveTurn(model, LiveOptions(**options), "item_1", 0, [], "en")
    t.append(np.zeros(int(seconds * 16000), dtype=np.float32))
    return t


def test_words_are_runs_from_a_spaced_token_and_timestamps_end_them():
    text = {1: " The", 2: " quick", 3: "est", 4: ".", 9: " fox"}
    spans = word_spans([100, 1, 2, 3, 4, 101, 101, 9], lambda t: t < 100, lambda t: text[t].startswith(" "))
    assert spans == [(1, 2), (2, 5), (7, 8)]
    assert word_spans([3, 4, 9], lambda t: True, lambda t: text[t].startswith(" ")) == [(0, 2), (2, 3)]
    assert agreed_words([["a", "b", "c"], ["a", "b", "x"], ["a", "b"]]) == 2
    assert agreed_words([["a"], ["b"]]) == 0 and agreed_words([]) == 0


def test_confirmed_words_are_found_in_a_hypothesis_that_changed_them():
    def words(text: str) -> list[Word]:
        return [Word((hash(w),), " " + w) for w in text.split()]

    assert align(words("I will like a cup"), words("I will")) == 2
    assert align(words("I would like a cup"), words("I will")) == 2  # "will" stands for "would"
    assert align(words("So I would like a cup"), words("I would")) == 3
    assert align(words("Hello"), words("I would like")) == 1  # nothing matches: word for word, within the hypothesis


def test_two_agreeing_hypotheses_confirm_their_shared_words_but_not_the_last_one(model):
    t = turn(model)
    first = t.request()
    assert first.kind is Kind.PARTIAL
    assert first.prompt["decoder_prompt"]["prompt_token_ids"] == [model.tokens.sot]  # as offline: no prefix
    assert first.params.begin_suppress_tokens == model.begin_suppress and first.params.temperature == 0.0
    assert t.take(first, [ts(model, 0), *ids(model, " Today is a beaut")]) == ""  # one hypothesis: nothing yet
    delta = t.take(t.request(), [ts(model, 0), *ids(model, " Today is a beautiful day"), model.tokens.eot])
    assert delta == "Today is a"  # " beaut" != " beautiful"; no leading space on a turn's first text
    # After the confirmed words both have " beautiful day"; " to" is the newest's last word: it waits.
    assert t.take(t.request(), [ts(model, 0), *ids(model, " Today is a beautiful day to")]) == " beautiful day"
    assert t.emitted == t.text == "Today is a beautiful day"


def test_agreement_goes_on_after_a_confirmed_word_that_later_hypotheses_changed(model):
    t = turn(model)
    t.take(t.request(), ids(model, " I will die."))
    assert t.take(t.request(), ids(model, " I will die cut upon")) == "I will"
    t.take(t.request(), ids(model, " I would like a cup of"))
    assert t.take(t.request(), ids(model, " I would like a cup of coffee")) == " like a cup of"


def test_the_final_decode_is_the_offline_request_and_its_text_the_turns_transcript(model):
    t = turn(model)
    t.take(t.request(), ids(model, " I will die."))
    t.take(t.request(), ids(model, " I will die cut"))
    t.end()
    final = t.request()
    assert final.kind is Kind.FINAL and final.prompt["decoder_prompt"]["prompt_token_ids"] == [model.tokens.sot]
    tokens = [ts(model, 0), *ids(model, " I would like a coffee."), ts(model, 2.4), model.tokens.eot]
    assert t.take(final, tokens) == " like a coffee."  # the words after the confirmed ones
    assert t.done and not t.wants_decode()
    assert t.emitted == "I will like a coffee." and t.text == "I would like a coffee."


def audio_ctx(request) -> int | None:
    return request.prompt["encoder_prompt"].get("mm_processor_kwargs", {}).get("audio_ctx")


def test_interim_decodes_read_their_audio_and_padding_and_the_final_the_whole_window(model):
    t = turn(model, seconds=3.1)
    partial = t.request()
    assert partial.kind is Kind.PARTIAL and audio_ctx(partial) == 300  # 3.1 s + 2 s of padding -> 6 s, 50 a second
    t.append(np.zeros(int(3.0 * 16000), dtype=np.float32))
    assert audio_ctx(t.request()) == 450  # 6.1 + 2 s -> 9 s
    t.end()
    final = t.request()
    assert final.kind is Kind.FINAL and audio_ctx(final) is None  # the offline request: the whole 30 s window
    assert audio_ctx(turn(model, seconds=3.1, interim_padding_seconds=None).request()) is None
    assert audio_ctx(turn(model, seconds=3.1, interim_padding_seconds=0).request()) == 200
    assert audio_ctx(turn(model, seconds=27.5).request()) is None  # 30 s: the whole window


def test_a_long_buffer_is_cut_at_a_confirmed_segment_end_and_stale_results_change_nothing(model):
    t = turn(model, seconds=20.0, trim_seconds=15.0)
    old = t.request()
    seg = [ts(model, 0), *ids(model, " One two."), ts(model, 4.0), ts(model, 4.0), *ids(model, " Three four five")]
    t.take(t.request(), seg)
    assert t.take(t.request(), seg) == "One two. Three four"  # then the buffer (20 s) is cut at 4 s
    assert t.offset == 64000 and len(t.audio) == 16 * 16000 and t.generation == 1
    assert t.history == [ts(model, 0), *ids(model, " One two."), ts(model, 4.0)] and t.cut_text == " One two."
    assert [w.text for w in t.confirmed] == [" Three", " four"]
    assert t.take(old, ids(model, " anything else entirely")) == ""  # built before the cut
    loop = ids(model, " five five five five five five five five five five five five five five five")
    t.take(t.request(), loop)
    assert t.take(t.request(), loop) == ""  # a hypothesis that loops is not used
    prompt = t.request().prompt["decoder_prompt"]["prompt_token_ids"]
    assert prompt == [model.tokens.sot_prev, *t.history, model.tokens.sot]  # the cut-off text conditions
    t.end()
    t.take(t.request(), [ts(model, 0), *ids(model, " Three four five six."), ts(model, 3.0)])
    assert t.text == "One two. Three four five six." == t.emitted


def test_a_buffer_near_30_s_is_flushed_at_its_last_segment_end_and_nothing_is_dropped(model):
    t = turn(model, seconds=29.0)
    flush = t.request()
    assert flush.kind is Kind.FLUSH and flush.covers == 29 * 16000
    tokens = [ts(model, 0), *ids(model, " First part."), ts(model, 20.0), ts(model, 20.0), *ids(model, " Second pa")]
    assert t.take(flush, tokens) == "First part."
    assert t.offset == 20 * 16000 and len(t.audio) == 9 * 16000 and t.confirmed == []
    t.append(np.zeros(32000, dtype=np.float32))
    assert t.num_samples == 31 * 16000  # every sample is either cut off (transcribed) or still in the buffer


def test_silence_confirms_nothing(model):
    t = turn(model)
    for _ in range(3):
        t.take(t.request(), [ts(model, 0), *ids(model, " you")], no_speech_prob=0.9, avg_logprob=-1.5)
    assert t.text == "" and t.confirmed == []


def test_options_are_validated_on_construction():
    with pytest.raises(ValueError, match="threshold"):
        TurnDetection(threshold=1.5)
    with pytest.raises(ValueError, match="silence_duration_ms"):
        LiveOptions(turn_detection={"silence_duration_ms": 10})
    with pytest.raises(ValueError, match="unknown turn_detection fields"):
        LiveOptions(turn_detection={"min_speech_ms": 10})
    with pytest.raises(ValueError, match="agreement"):
        LiveOptions(agreement=0)
    with pytest.raises(ValueError, match="language"):
        LiveOptions(language="xx")
    with pytest.raises(ValueError, match="interim_padding_seconds"):
        LiveOptions(interim_padding_seconds=-1)
    assert LiveOptions(language="English").language == "en"
    assert LiveOptions(turn_detection={"threshold": 0.6}).turn_detection == TurnDetection(threshold=0.6)


def test_a_multilingual_checkpoint_without_a_language_detects_it_once_per_turn(tmp_path, make_llm):
    from helpers import make_whisper

    from encdec_engine.speech.live.session import LiveSession

    engine = make_llm(make_whisper(tmp_path / "w", "tiny-80", multilingual=True, seed=3)).engine
    live = LiveModel(engine)
    session = LiveSession(live, LiveOptions(turn_detection=None))
    session.append(np.random.default_rng(0).normal(0, 0.1, 24000).astype(np.float32))
    detect = session.next_request()
    assert detect.kind is Kind.DETECT and detect.prompt["decoder_prompt"]["prompt_token_ids"] == [live.tokens.sot]
    out = engine_run(engine, detect)
    assert session.take_output(detect, out) == [] and detect.turn.language is not None
    decode = session.next_request()
    language = live.tokens.language_token(detect.turn.language)
    assert decode.kind is Kind.PARTIAL
    assert decode.prompt["decoder_prompt"]["prompt_token_ids"][:2] == [live.tokens.sot, language]
    session.drop(decode)


def engine_run(engine, request):
    engine.add_request("live-test", request.prompt, request.params)
    while True:
        for out in engine.step():
            if out.finished:
                return out


def test_voice_detection_turned_on_mid_turn_stops_no_turn_it_did_not_start(model):
    """A turn opened by hand (no turn detection) and ended by the voice detection turned on meanwhile was
    announced by speech_stopped alone, with no speech_started before it; now it is committed without one."""
    from pathlib import Path

    from encdec_engine.inputs.audio import load_audio
    from encdec_engine.speech.live.events import Committed, SpeechStarted, SpeechStopped
    from encdec_engine.speech.live.session import LiveSession

    speech = load_audio(Path(__file__).resolve().parents[2] / "prompts" / "audio" / "fox.wav")
    session = LiveSession(model, LiveOptions(turn_detection=None))
    assert session.append(speech[:16000]) == []  # a turn opens by hand: nothing announced
    session.configure(LiveOptions(turn_detection=TurnDetection()))
    events = session.append(np.concatenate([speech[16000:], np.zeros(3 * 16000, dtype=np.float32)]))
    first = next(e for e in events if isinstance(e, Committed))
    assert not any(isinstance(e, SpeechStopped) and e.item_id == first.item_id for e in events), events
    started = {e.item_id for e in events if isinstance(e, SpeechStarted)}
    assert all(e.item_id in started for e in events if isinstance(e, SpeechStopped)), events
