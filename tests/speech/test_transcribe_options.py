"""Issue 15 item 5: the decoding options users of openai-whisper and faster-whisper reach for, held to
the peers' documented behaviour (openai-whisper's decoding.py/transcribe.py, faster-whisper's
transcribe.py: `_get_suppress_tokens`, `get_prompt`, the prompt reset after a window)."""

import json
from pathlib import Path

import pytest

from encdec_engine.server.protocol import TranscriptionRequest
from encdec_engine.speech.job import TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.requests import WindowRequests

AUDIO = Path(__file__).resolve().parents[2] / "prompts" / "audio"


def _requests(tiny_en, **options) -> WindowRequests:
    return WindowRequests(tiny_en.engine, TranscribeOptions(language="en", **options),
                          _tokens(tiny_en))


def _tokens(tiny_en):
    from encdec_engine.speech.transcriber import Transcriber

    return Transcriber(tiny_en.engine, TranscribeOptions(language="en")).tokens


def _id(tiny_en, token: str) -> int:
    return tiny_en.get_tokenizer().convert_tokens_to_ids(token)


def _always(tiny_en) -> set[int]:
    """openai-whisper's `_get_suppress_tokens` always adds these (tiny.en: <|nocaptions|> is its no-speech)."""
    names = ("<|transcribe|>", "<|translate|>", "<|startoftranscript|>", "<|startofprev|>", "<|startoflm|>",
             "<|nocaptions|>")
    ids = {_id(tiny_en, n) for n in names}
    assert len(ids) == len(names) and all(isinstance(i, int) and i > 50000 for i in ids)
    return ids


def test_suppress_tokens_minus_one_is_the_checkpoints_list(tiny_en):
    checkpoint = set(tiny_en.engine.generation_config.suppress_tokens)
    assert len(checkpoint) > 50  # the non-speech symbols
    assert set(_requests(tiny_en).suppress) == checkpoint | _always(tiny_en)  # the default is "-1"
    assert set(_requests(tiny_en, suppress_tokens="-1,7").suppress) == checkpoint | _always(tiny_en) | {7}
    # A user list without -1 replaces the checkpoint's; the special tokens stay suppressed.
    assert set(_requests(tiny_en, suppress_tokens=[7, 8]).suppress) == {7, 8} | _always(tiny_en)
    assert set(_requests(tiny_en, suppress_tokens="").suppress) == _always(tiny_en)


def _faster_whisper_prompt(tiny_en, previous, prefix=None, hotwords=None, without_timestamps=False):
    """faster-whisper's WhisperModel.get_prompt (1.x), written out for tiny.en (max_length 448)."""
    tok = tiny_en.get_tokenizer()
    encode = lambda text: tok(" " + text.strip(), add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = []
    if previous or (hotwords and not prefix):
        prompt.append(_id(tiny_en, "<|startofprev|>"))
        if hotwords and not prefix:
            prompt.extend(encode(hotwords)[: 448 // 2 - 1])
        prompt.extend(previous[-(448 // 2 - 1):])
    prompt.append(_id(tiny_en, "<|startoftranscript|>"))
    if without_timestamps:
        prompt.append(_id(tiny_en, "<|notimestamps|>"))
    if prefix:
        if not without_timestamps:
            prompt.append(_id(tiny_en, "<|0.00|>"))
        prompt.extend(encode(prefix)[: 448 // 2 - 1])
    return prompt


@pytest.mark.parametrize("options", [dict(prefix="Today is"), dict(hotwords="Stella Kubernetes"),
                                     dict(prefix="Today is", hotwords="Stella"),
                                     dict(prefix="Today is", timestamps=False), dict()])
def test_window_prompts_are_built_as_faster_whisper_builds_them(tiny_en, options):
    prompts = _requests(tiny_en, **options).prompts
    job = TranscriptionJob(0, None, language="en")
    kwargs = dict(prefix=options.get("prefix"), hotwords=options.get("hotwords"),
                  without_timestamps=options.get("timestamps") is False)
    assert prompts.decoder_prompt(job) == _faster_whisper_prompt(tiny_en, [], **kwargs)
    job.window, job.tokens = 1, list(range(1000, 1300))  # a later window: no prefix, the last 223 tokens
    kwargs["prefix"] = None  # faster-whisper: prefix only where seek == 0
    assert prompts.decoder_prompt(job) == _faster_whisper_prompt(tiny_en, job.tokens, **kwargs)
    assert prompts.forced(job) == []


def test_prompt_reset_on_temperature_and_condition_on_previous_text(tiny_en):
    """openai-whisper / faster-whisper: after a window kept above prompt_reset_on_temperature (0.5),
    or any window without condition_on_previous_text, later windows see none of the earlier text
    (the initial prompt included)."""
    def previous_after(temperature, **options):
        prompts = _requests(tiny_en, initial_prompt="Kubernetes", **options).prompts
        job = TranscriptionJob(0, None, language="en", window=1, tokens=[1000, 1001])
        prompts.after_window(job, temperature)
        job.tokens += [1002]  # the next window's text
        prompt = prompts.decoder_prompt(job)
        return prompt[1 : prompt.index(_id(tiny_en, "<|startoftranscript|>"))]

    kubernetes = tiny_en.get_tokenizer()(" Kubernetes", add_special_tokens=False)["input_ids"]
    assert previous_after(0.4) == kubernetes + [1000, 1001, 1002]
    assert previous_after(0.6) == [1002]
    assert previous_after(0.6, prompt_reset_on_temperature=0.8) == kubernetes + [1000, 1001, 1002]
    assert previous_after(0.0, condition_on_previous_text=False) == [1002]


def test_prefix_starts_the_first_window_and_max_new_tokens_caps_it(tiny_en):
    t = tiny_en.transcribe(AUDIO / "weather.wav", prefix="Today was")[0]
    assert t.text.startswith(" Today was") and t.segments[0].start == 0.0
    short = tiny_en.transcribe(AUDIO / "weather.wav", timestamps=False, temperatures=(0.0,), max_new_tokens=3)[0]
    assert len(tiny_en.get_tokenizer()(short.text, add_special_tokens=False)["input_ids"]) <= 3


@pytest.mark.parametrize(("options", "message"), [
    (dict(length_penalty=1.5), "length_penalty"), (dict(patience=2.0), "patience"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"), (dict(suppress_tokens="a,b"), "suppress_tokens"),
    (dict(suppress_tokens=[-2]), "suppress_tokens"), (dict(prefix=3), "prefix")])
def test_bad_decoding_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        TranscribeOptions(**options)


def test_vllm_transcription_fields():
    def decoding(**fields):
        return TranscriptionRequest(model="whisper-1", **fields).decoding_options()

    assert decoding()["beam_size"] == 1
    assert decoding(use_beam_search=True)["beam_size"] == 5  # openai-whisper's CLI default
    assert decoding(beam_size=3, use_beam_search=True)["beam_size"] == 3
    assert decoding(max_completion_tokens=50)["max_new_tokens"] == 50
    assert decoding(repetition_penalty=1.2)["repetition_penalty"] == 1.2
    TranscribeOptions(**decoding(length_penalty=0.6, beam_size=2))  # every field is a valid option
    assert json.loads(TranscriptionRequest(model="m").model_dump_json())["use_beam_search"] is False
