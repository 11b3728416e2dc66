"""The OpenAI-compatible server end to end: real uvicorn servers on loopback ports, driven by the
official `openai` client and by raw HTTP; after every test each server still answers and holds
no KV block (checked on the engine thread)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import BrokenOnOneToken
from servers import AUDIO, AUTH, KEY, LiveServer, until

from encdec_engine import SamplingParams
from encdec_engine.config import EngineConfig
from encdec_engine.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from encdec_engine.engine.llm_engine import LLMEngine
from encdec_engine.cli.main import build_parser
from encdec_engine.server.app import ServerLimits, build_app
from encdec_engine.speech.writers import render
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.speech.offline import transcribe_offline
from encdec_engine.speech.options import TranscribeOptions

GREEDY = dict(temperature=0.0, max_tokens=8)


_LIVE: list[LiveServer] = []


@pytest.fixture(scope="module")
def bart_server(bart_path):
    app = build_app(str(bart_path), limits=ServerLimits(api_key=KEY, max_queue=2), served_model_name="bart",
                    num_kv_blocks=256)
    server = LiveServer(app)
    _LIVE.append(server)
    yield server
    _LIVE.remove(server)
    server.stop()


@pytest.fixture(scope="module")
def whisper_server():
    limits = ServerLimits(max_upload_mb=2.0, max_audio_seconds=60.0)
    server = LiveServer(build_app(str(default_model_path()), limits=limits, kv_cache_space_gb=0.25))
    _LIVE.append(server)
    yield server
    _LIVE.remove(server)
    server.stop()


@pytest.fixture(autouse=True)
def servers_clean():
    yield
    for server in _LIVE:
        server.assert_clean()


def pause_after_first_output(server: LiveServer, finished: bool = False) -> threading.Event:
    """Hold the engine thread between two steps, from the step after the first one that produces text
    (with `finished`: the first that finishes a request with text), until the returned event is set:
    a request is then certainly still running."""
    release = threading.Event()

    def install(engine) -> None:  # runs on the engine thread
        produced = []

        def step():
            if produced:
                del engine.step
                release.wait(30)
            outputs = type(engine).step(engine)
            produced.extend(o for o in outputs
                            if o.outputs and o.outputs[0].text.strip() and (o.finished or not finished))
            return outputs

        engine.step = step

    server.on_engine(install)
    return release


def wait_until_gone(server: LiveServer, endpoint: str, before: int) -> None:
    """Until the server has finished answering a client that left (its abort is queued by then)."""
    deadline = time.monotonic() + 10
    while server.state.metrics.requests[(endpoint, 499)] == before:
        assert time.monotonic() < deadline, "the server did not notice the client leaving"
        time.sleep(0.02)


def reference_transcript(server: LiveServer, name: str, **options):
    """The offline transcript, computed on the server's own engine thread while nothing else runs."""
    opts = TranscribeOptions(language="en", **options)
    return server.on_engine(lambda e: transcribe_offline(e, opts, [AUDIO / name])[0])


# -- discovery ------------------------------------------------------------------
def test_models_health_and_metrics(bart_server, whisper_server):
    assert [m.id for m in bart_server.client().models.list()] == ["bart"]
    assert [m.id for m in whisper_server.client().models.list()] == ["whisper-tiny.en"]
    for server, headers in ((bart_server, AUTH), (whisper_server, {})):
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # never needs the key
        text = httpx.get(f"{server.url}/metrics", headers=headers).text  # with a key set, metrics need it
        for name in ("encdec_requests_waiting", "encdec_requests_running", "encdec_requests_swapped",
                     'encdec_kv_blocks_used{kind="self"}', 'encdec_kv_blocks_used{kind="cross"}',
                     "encdec_generated_tokens_total", "encdec_generation_tokens_per_second",
                     "encdec_request_latency_seconds_bucket", "encdec_engine_busy_seconds_total"):
            assert name in text

    def busy() -> float:
        text = httpx.get(f"{whisper_server.url}/metrics").text
        return float(re.search(r"^encdec_engine_busy_seconds_total (\S+)$", text, re.M).group(1))

    before = busy()
    with open(AUDIO / "fox.wav", "rb") as f:
        whisper_server.client().audio.transcriptions.create(model="whisper-1", file=f)
    until(lambda: busy() > before, "the engine's busy seconds counted the transcription's steps", 10)


# -- transcription ------------------------------------------------------------------
def test_transcription_every_response_format(whisper_server):
    client = whisper_server.client()

    def transcribe(fmt: str):
        extra = {"timestamp_granularities": ["segment"]} if fmt == "verbose_json" else {}
        with open(AUDIO / "fox.wav", "rb") as f:
            return client.audio.transcriptions.create(model="whisper-1", file=f, response_format=fmt, **extra)

    with ThreadPoolExecutor(5) as pool:  # concurrently: the windows share the engine's batches
        formats = ["json", "text", "srt", "vtt", "verbose_json"]
        got = dict(zip(formats, pool.map(transcribe, formats)))
    ref = reference_transcript(whisper_server, "fox.wav")
    assert "quick brown fox" in ref.text
    assert got["json"].text == ref.text.strip()
    assert got["text"] == ref.text.strip() + "\n"
    assert got["srt"] == render(ref, "srt") and got["srt"].startswith("1\n00:00:00,000 --> ")
    assert got["vtt"] == render(ref, "vtt") and got["vtt"].startswith("WEBVTT\n\n")
    verbose = got["verbose_json"]
    assert verbose.language == "english" and verbose.duration == pytest.approx(3.72, abs=0.01)
    assert [(s.start, s.end, s.text) for s in verbose.segments] == [(s.start, s.end, s.text) for s in ref.segments]


def test_transcription_word_timestamps(whisper_server):
    client = whisper_server.client()
    ref = reference_transcript(whisper_server, "stella.wav", word_timestamps=True)
    expected = [(w.word.strip(), w.start, w.end) for s in ref.segments for w in s.words]
    for granularities in (["word"], ["word", "segment"]):
        with open(AUDIO / "stella.wav", "rb") as f:
            got = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json",
                                                     timestamp_granularities=granularities)
        assert [(w.word, w.start, w.end) for w in got.words] == expected and len(expected) > 10
        assert (got.segments is not None) == ("segment" in granularities)


def test_transcription_chunking_strategy_auto(whisper_server, tmp_path):
    """OpenAI's chunking_strategy="auto": the chunks of a 45 s upload run at once, as LLM.transcribe(chunked=True)."""
    import soundfile

    from encdec_engine.inputs.audio import load_audio

    clip = tmp_path / "meeting45.wav"
    soundfile.write(clip, load_audio(AUDIO / "long_meeting.flac")[: 45 * 16000], 16000, subtype="PCM_16")
    opts = TranscribeOptions(language="en", chunked=True)
    ref = whisper_server.on_engine(lambda e: transcribe_offline(e, opts, [clip])[0])
    with open(clip, "rb") as f:
        got = whisper_server.client().audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json", timestamp_granularities=["segment"],
            extra_body={"chunking_strategy": "auto"})
    assert [(s.start, s.end, s.text) for s in got.segments] == [(s.start, s.end, s.text) for s in ref.segments]
    assert got.segments[-1].end > 40 and [s.id for s in got.segments] == list(range(len(got.segments)))


def test_transcription_stream(whisper_server):
    with open(AUDIO / "weather.wav", "rb") as f:
        events = list(whisper_server.client().audio.transcriptions.create(model="whisper-1", file=f, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert [e.type for e in events[len(deltas):]] == ["transcript.text.done"]
    assert len(deltas) == 1  # one window: its text is sent once it is final
    done = events[-1]
    ref = reference_transcript(whisper_server, "weather.wav")  # decoded as the non-streamed answer
    assert "".join(deltas) == done.text == ref.text.strip()
    assert done.usage.output_tokens > 0 and done.usage.input_tokens > done.usage.output_tokens


def test_silence_is_skipped_streamed_or_not(whisper_server, tmp_path):
    import numpy as np
    import soundfile

    path = tmp_path / "noise.wav"
    soundfile.write(path, (np.random.default_rng(0).standard_normal(16000 * 5) * 0.01).astype(np.float32), 16000)
    client = whisper_server.client()
    with open(path, "rb") as f:  # improbable text where no speech is likely: skipped, as faster-whisper does
        assert client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text") == "\n"
    with open(path, "rb") as f:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=f, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert deltas == [] and events[-1].text == ""  # a window's text is sent only once it is kept


def test_the_repeated_phrase_recording_keeps_every_utterance_streamed_or_not(whisper_server, tmp_path):
    """Issue 15 over HTTP: the recording whose fallback window lost three sentences (old ranking,
    and old streams, which decoded without fallback) is transcribed completely in both modes, and a
    stream sends exactly the non-streamed text, one delta per kept window."""
    import soundfile
    from recordings import build, missing_utterances

    path = tmp_path / "repeated_phrase.wav"
    soundfile.write(path, build("repeated_phrase"), 16000)
    client = whisper_server.client().with_options(timeout=600)  # 6 temperatures x 5 samples on 2 busy cores
    with open(path, "rb") as f:
        text = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text").strip()
    assert missing_utterances("repeated_phrase", text) == [], text
    with open(path, "rb") as f:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=f, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert "".join(deltas) == events[-1].text == text and len(deltas) == 2  # two windows


def test_translation_needs_multilingual_model(whisper_server):
    with open(AUDIO / "fox.wav", "rb") as f, pytest.raises(openai.BadRequestError, match="English-only") as e:
        whisper_server.client().audio.translations.create(model="whisper-1", file=f)
    assert e.value.body["param"] == "model"  # the model, not the prompt, is what cannot translate


# -- completions --------------------------------------------------------------------
def test_completions_match_offline_generate(bart_server, bart_path, make_llm):
    llm, client = make_llm(bart_path), bart_server.client()
    prompts = ["The rain in Spain falls mainly on the plain.", [0, 133, 157, 2],
               {"encoder_prompt": "The city council met on Monday.", "decoder_prompt": "The river"}]
    offline = [prompts[0], {"prompt_token_ids": prompts[1]}, prompts[2]]  # the engine's spelling of token ids
    refs = llm.generate(offline, SamplingParams(**GREEDY), use_tqdm=False)
    for prompt, ref in zip(prompts, refs):
        got = client.completions.create(model="bart", prompt=prompt, **GREEDY)
        assert got.choices[0].text == ref.outputs[0].text
        assert got.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids) + len(ref.encoder_prompt_token_ids)
    both = client.completions.create(model="bart", prompt=[prompts[0], "A second document."], **GREEDY)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == refs[0].outputs[0].text
    sampled = [client.completions.create(model="bart", prompt=prompts[0], n=2, seed=7, temperature=1.0,
                                         max_tokens=6, logprobs=2) for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]  # seeded
    assert [c.index for c in sampled[0].choices] == [0, 1]
    lp = sampled[0].choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(t for t in lp.top_logprobs)
    shaped = dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"133": 2.0})
    ref = llm.generate([prompts[0]], SamplingParams(**GREEDY, **{**shaped, "logit_bias": {133: 2.0}},
                                                    bad_words=["rain"]), use_tqdm=False)[0]
    got = client.completions.create(model="bart", prompt=prompts[0], **GREEDY, **shaped,
                                    extra_body={"bad_words": ["rain"]})
    assert got.choices[0].text == ref.outputs[0].text and got.choices[0].text != refs[0].outputs[0].text


def test_completion_stream(bart_server):
    client = bart_server.client()
    prompt = "Finish me."
    full = client.completions.create(model="bart", prompt=prompt, temperature=0.0, max_tokens=16).choices[0].text
    chunks = list(client.completions.create(model="bart", prompt=prompt, temperature=0.0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    counted = list(client.completions.create(model="bart", prompt=prompt, temperature=0.0, max_tokens=16, stream=True,
                                             stream_options={"include_usage": True, "continuous_usage_stats": True}))
    so_far = [c.usage.completion_tokens for c in counted[:-1]]  # vLLM: the usage so far on every chunk
    assert so_far == sorted(so_far) and so_far[-1] == 16 and counted[-1].usage.completion_tokens == 16
    # A stop string is never streamed, even in part.
    stop = full[len(full) // 2: len(full) // 2 + 2]
    expected = full[: full.find(stop)]
    assert client.completions.create(model="bart", prompt=prompt, temperature=0.0, max_tokens=16,
                                     stop=stop).choices[0].text == expected
    streamed = client.completions.create(model="bart", prompt=prompt, temperature=0.0, max_tokens=16, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


# -- errors ---------------------------------------------------------------------
def _float_wav(samples) -> bytes:
    import io

    import numpy as np
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.asarray(samples, dtype=np.float32), 16000, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def _multipart(**fields) -> dict:
    return {"files": {"file": ("clip.wav", fields.pop("file", (AUDIO / "fox.wav").read_bytes()))}, "data": fields}


BAD_AUDIO = [
    ({"json": {"model": "whisper-1"}}, 400, "multipart/form-data"),
    ({"content": b"--xx\r\nnot multipart", "headers": {"content-type": "multipart/form-data"}}, 400, "boundary"),
    ({"data": {"model": "whisper-1"}, "files": {"other": ("a.wav", b"x")}}, 400, "'other' must be text"),
    ({"data": {"model": "whisper-1"}}, 400, "multipart/form-data"),
    (_multipart(temperature="hot"), 400, "temperature"),
    (_multipart(response_format="mp3"), 400, "response_format"),
    (_multipart(**{"timestamp_granularities[]": "word"}), 400, "need response_format verbose_json"),
    (_multipart(stream="true", response_format="srt"), 400, "json or text"),
    (_multipart(stream="true", chunking_strategy="auto"), 400, "chunking_strategy is not supported with stream"),
    (_multipart(chunking_strategy="server_vad"), 400, "chunking_strategy"),
    (_multipart(language="fr"), 400, "English-only"),
    (_multipart(language="xx"), 400, "'xx' is not a language Whisper knows"),
    (_multipart(model="gpt-4o"), 404, "not served here"),
    (_multipart(file=b"RIFF garbage, not audio" * 50), 400, "cannot decode"),
    (_multipart(file=b""), 400, "empty"),
    (_multipart(file=_float_wav([0.1, float("nan")] * 8000)), 400, "8000 NaN or infinite samples"),
    (_multipart(file=b"\0" * (3 << 20)), 413, "limit of 2 MB"),
    (_multipart(file=(AUDIO / "long_meeting.flac").read_bytes()), 413, "at most 60 s"),
    (_multipart(prompt="p" * 8193), 400, "prompt: String should have at most 8192 characters"),
    (_multipart(language="x" * 33), 400, "language: String should have at most 32 characters"),
    ({**_multipart(), "data": {"model": "whisper-1", "": "x"}}, 400, "a form part has no name"),
    ({"content": b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF',
      "headers": {"content-type": "multipart/form-data; boundary=b"}}, 400, "cut off before its closing boundary"),
]

BAD_COMPLETIONS = [
    ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "not valid JSON"),
    ({"json": {"model": "bart"}}, 400, "prompt: Field required"),
    ({"json": {"prompt": "x", "max_tokens": "ten"}}, 400, "max_tokens"),
    ({"json": {"prompt": "x", "truncate_prompt_tokens": "8"}}, 400, "truncate_prompt_tokens: Input should be a valid integer"),
    ({"json": {"prompt": "x", "temperature": -1}}, 400, "temperature"),
    ({"json": {"prompt": "x", "n": 0}}, 400, "n:"),
    ({"json": {"prompt": "x", "echo": True}}, 400, "echo"),
    ({"json": {"prompt": "x", "colour": "red"}}, 400, "colour"),
    ({"json": {"prompt": ""}}, 400, "empty"),
    ({"json": {"prompt": [1.5, 2]}}, 400, "prompt"),
    ({"json": {"prompt": {"encoder_prompt": "x", "extra": 1}}}, 400, "unknown keys"),
    ({"json": {"prompt": [0, 99999, 2]}}, 400, "outside the vocabulary"),
    ({"json": {"prompt": ["fine", [0, 99999]]}}, 400, "prompt 1"),
    ({"json": {"prompt": "word " * 400}}, 400, "limit"),
    ({"json": {"prompt": "x", "model": "gpt-4o"}}, 404, "not served here"),
    ({"json": {"prompt": "x", "max_tokens": 100_000}}, 400, "ask for at most"),
    ({"json": {"prompt": "x", "stop": ["y", ""]}}, 400, "stop.1: String should have at least 1 character"),
    ({"json": {"prompt": ["a", "b", "c"]}}, 400, "exceed this server's queue"),
    ({"json": {"prompt": "x", "logit_bias": {"rain": 1}}}, 400, "logit_bias.rain.[key]: String should match"),
    ({"json": {"prompt": "x", "logit_bias": {"\u00b2": 1}}}, 400, "String should match pattern '^[0-9]+$'"),
    ({"json": {"prompt": "x", "logit_bias": {"5": 101}}}, 400, "logit_bias.5: Input should be less than or equal to 100"),
    ({"json": {"prompt": "x", "logit_bias": {"99999": 1}}}, 400, "logit_bias [99999] is outside the vocabulary"),
    ({"json": {"prompt": "x", "stop_token_ids": [2, 99999]}}, 400, "stop_token_ids [99999] is outside the vocabulary"),
    ({"json": {"prompt": "x", "presence_penalty": 2.5}}, 400, "presence_penalty"),
    ({"json": {"prompt": "x", "bad_words": [""]}}, 400, "bad_words.0: String should have at least 1 character"),
    ({"json": {"prompt": "x", "bad_words": [" "]}}, 400, "bad_words must be a list of non-blank strings"),
    # Every list and string field has a cap (a 400 naming the field and the cap).
    ({"json": {"prompt": "x", "stop": ["s"] * 33}}, 400, "stop: List should have at most 32 items"),
    ({"json": {"prompt": "x", "stop": "s" * 257}}, 400, "stop: String should have at most 256 characters"),
    ({"json": {"prompt": "x", "stop_token_ids": [5] * 1025}}, 400, "stop_token_ids: List should have at most 1024"),
    ({"json": {"prompt": "x", "bad_words": ["w"] * 257}}, 400, "bad_words: List should have at most 256 items"),
    ({"json": {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}}, 400,
     "logit_bias: Dictionary should have at most 1024 items"),
    ({"json": {"prompt": "x", "seed": 2**64}}, 400, "seed: Input should be less than or equal to 9007199254740991"),
    ({"json": {"prompt": ["x"] * 257}}, 400, "at most 256 prompts per request"),
    ({"json": {"prompt": "x" * 1_000_001}}, 400, "more than the limit of 1000000"),
    ({"json": {"prompt": [5] * 262_145, "truncate_prompt_tokens": 8}}, 400, "more than the limit of 262144"),
    ({"json": {"prompt": "x", "user": "u" * 257}}, 400, "user: String should have at most 256 characters"),
    # A value under the other kind's key (schemathesis: "abc" as token ids was served as a text prompt).
    ({"json": {"prompt": [{"prompt_token_ids": "abc"}]}}, 400, "prompt_token_ids must be a list of token ids"),
    ({"json": {"prompt": {"prompt": [5, 6]}}}, 400, "prompt must be a string, got list"),
]


@pytest.mark.parametrize("kwargs,status,message", BAD_AUDIO)
def test_bad_audio_requests_get_clean_errors(whisper_server, kwargs, status, message):
    with whisper_server.http() as http:
        r = http.post("/v1/audio/transcriptions", **kwargs)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_an_engine_refusal_names_its_field(bart_server):
    """The engine's own checks (the model's length) named no `param`: now the field their message starts with."""
    with bart_server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 100_000}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    from encdec_engine.server.errors import engine_error

    assert engine_error(ValueError("prompt 0: encoder prompt has 9 tokens")).param == "prompt"
    assert engine_error(ValueError("SamplingParams.n must be an integer")).param == "n"
    assert engine_error(ValueError("the model is not ready")).param is None


@pytest.mark.parametrize("kwargs,status,message", BAD_COMPLETIONS)
def test_bad_completion_requests_get_clean_errors(bart_server, kwargs, status, message):
    kwargs = {**kwargs, "headers": {**AUTH, **kwargs.get("headers", {})}}
    with bart_server.http() as http:
        r = http.post("/v1/completions", **kwargs)
        assert r.status_code == status, r.text
        assert message in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "Still serving.", "max_tokens": 2},
                         headers=AUTH).status_code == 200


def test_null_optional_fields_take_their_defaults(bart_server):
    """OpenAI's optional fields are nullable; max_tokens: null means up to the model's limit."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "best_of", "stop", "seed", "logprobs", "echo", "stream",
                           "presence_penalty", "frequency_penalty", "user", "suffix", "logit_bias"])
    with bart_server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "The rain in spain", "max_tokens": 3, **nulls}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] <= 3
        r = http.post("/v1/completions", json={"prompt": "The rain", "max_tokens": None, "temperature": 0,
                                                "ignore_eos": True}, headers=AUTH)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_retrieve_model(bart_server):
    assert bart_server.client().models.retrieve("bart").id == "bart"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        bart_server.client().models.retrieve("gpt-4o")


def test_metric_samples_are_exact():
    from encdec_engine.server.metrics import prometheus_number

    assert [prometheus_number(v) for v in (1234567, 1234567.0, 0.25, 3.0000001)] == ["1234567", "1234567", "0.25", "3.0000001"]


def test_translations_report_english():
    from encdec_engine.server.protocol import verbose_transcription
    from encdec_engine.speech.results import Transcription

    t = Transcription(text=" Hello.", language="fr", segments=[], duration=1.0)
    assert verbose_transcription(t, "translate").language == "english"
    assert verbose_transcription(t, "transcribe").language == "french"


def test_wrong_model_kind_and_unknown_paths(bart_server, whisper_server):
    with pytest.raises(openai.NotFoundError, match="needs a text model"):
        whisper_server.client().completions.create(model="whisper-1", prompt="hello")
    with open(AUDIO / "fox.wav", "rb") as f, pytest.raises(openai.NotFoundError, match="needs a speech model"):
        bart_server.client().audio.transcriptions.create(model="bart", file=f)
    assert httpx.get(f"{bart_server.url}/v1/nothing", headers=AUTH).status_code == 404


def test_api_key(bart_server):
    with bart_server.http() as http:
        missing = http.post("/v1/completions", json={"prompt": "x"})
        wrong = http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert http.get("/health").status_code == 200
    assert missing.status_code == wrong.status_code == 401
    assert "missing API key" in missing.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        bart_server.client(api_key="nope").completions.create(model="bart", prompt="x")


INFO = ["/metrics", "/docs", "/redoc", "/openapi.json"]


def test_info_endpoints_need_the_key_when_one_is_set(bart_server, whisper_server):
    """With --api-key, /metrics, /docs, /redoc and /openapi.json are guarded too; /health is not."""
    with bart_server.http() as http:
        assert [http.get(p).status_code for p in INFO] == [401] * 4
        assert [http.get(p, headers=AUTH).status_code for p in INFO] == [200] * 4
        assert http.get("/health").status_code == 200
    with whisper_server.http() as http:  # no key: public unless --protect-info
        assert [http.get(p).status_code for p in INFO] == [200] * 4


def test_protect_info_without_a_key_stops_serving_them(bart_path):
    app = build_app(str(bart_path), limits=ServerLimits(protect_info=True), num_kv_blocks=32)
    server = LiveServer(app)
    try:
        with server.http() as http:
            assert [http.get(p).status_code for p in INFO] == [404] * 4
            assert "--protect-info" in http.get("/metrics").json()["error"]["message"]
            assert http.get("/health").status_code == 200
    finally:
        server.stop()
    assert build_parser().parse_args(["serve", "--no-protect-info"]).protect_info is False


def test_a_failing_request_gets_a_500_with_a_request_id_and_the_others_go_on(bart_server, bart_path, make_llm,
                                                                              caplog):
    """One request whose output processing raises (a token its tokenizer cannot convert) ends alone;
    its 500 names a request id, never the exception, and the log has the traceback under that id."""
    prompts = ["The first document is about rain.", "A second one, about the plain."]
    body = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = make_llm(bart_path).generate(prompts, SamplingParams(**body), use_tqdm=False)
    bad_id = next(t for t in ref[0].outputs[0].token_ids if t not in ref[1].outputs[0].token_ids)
    tokenizer = bart_server.engine.engine.tokenizer

    detok = bart_server.on_engine(lambda e: e.output_processor.detokenizer)
    bart_server.on_engine(lambda e: setattr(detok, "tokenizer", BrokenOnOneToken(tokenizer, bad_id)))
    try:
        with ThreadPoolExecutor(2) as pool, caplog.at_level("ERROR"):
            answers = list(pool.map(lambda p: httpx.post(f"{bart_server.url}/v1/completions", headers=AUTH,
                                                         json={"prompt": p, **body}, timeout=60), prompts))
    finally:
        bart_server.on_engine(lambda e: setattr(detok, "tokenizer", tokenizer))
    assert answers[0].status_code == 500 and answers[1].status_code == 200
    assert answers[1].json()["choices"][0]["text"] == ref[1].outputs[0].text
    message = answers[0].json()["error"]["message"]
    request_id = re.search(r"request id (cmpl-[0-9a-f]+)", message).group(1)
    assert "TypeError" not in message and "NoneType" not in message
    logged = [r.exc_info for r in caplog.records if request_id in r.getMessage() and r.exc_info]
    assert any(info[0] is TypeError for info in logged)  # the engine's traceback, under the request's id


# -- load and lifecycle -----------------------------------------------------------
def test_full_queue_answers_429(bart_server):
    release = threading.Event()
    blocker = bart_server.engine.call(lambda e: release.wait(30))  # the engine thread stops stepping
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(httpx.post, f"{bart_server.url}/v1/completions", headers=AUTH, timeout=60,
                               json={"prompt": f"Document {i}.", "max_tokens": 4}) for i in range(2)]
        deadline = time.monotonic() + 10
        while bart_server.state.admission.waiting < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        full = httpx.post(f"{bart_server.url}/v1/completions", headers=AUTH, json={"prompt": "One more."})
        release.set()
        assert [f.result().status_code for f in waiting] == [200, 200]
    blocker.result(10)
    assert full.status_code == 429 and "server busy" in full.json()["error"]["message"]
    assert full.headers["retry-after"] == "1"


@pytest.mark.parametrize("kind", ["completion", "transcription"])
def test_client_disconnect_mid_stream_aborts(bart_server, whisper_server, kind):
    server = bart_server if kind == "completion" else whisper_server
    endpoint = "/v1/completions" if kind == "completion" else "/v1/audio/transcriptions"
    before, gone = server.engine.num_aborted, server.state.metrics.requests[(endpoint, 499)]
    # A transcription stream sends a window's text once the window is kept: two windows (fox, 30 s of
    # silence, weather), the engine held once the first is done, while the second runs.
    release = pause_after_first_output(server, finished=kind == "transcription")
    if kind == "completion":
        request = dict(headers=AUTH, json={"prompt": "A long story.", "max_tokens": 200, "ignore_eos": True,
                                           "stream": True})
    else:
        request = _multipart(stream="true", file=_two_windows())
    with server.http() as http, http.stream("POST", endpoint, **request) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
    # The client is gone while its request holds self and cross blocks in the paused engine.
    wait_until_gone(server, endpoint, gone)
    release.set()
    server.assert_clean()
    assert server.engine.num_aborted == before + 1


def _two_windows() -> bytes:
    import io

    import numpy as np
    import soundfile

    from encdec_engine.inputs.audio import load_audio

    silence = np.zeros(30 * 16000, dtype=np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.concatenate([load_audio(AUDIO / "fox.wav"), silence, load_audio(AUDIO / "weather.wav")]),
                    16000, format="WAV")
    return buffer.getvalue()


def test_client_disconnect_before_the_answer_aborts(bart_server):
    before, gone = bart_server.engine.num_aborted, bart_server.state.metrics.requests[("/v1/completions", 499)]
    release = threading.Event()
    blocker = bart_server.engine.call(lambda e: release.wait(30))  # the request waits unanswered
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{bart_server.url}/v1/completions", headers=AUTH, timeout=0.5,
                   json={"prompt": "Never read.", "max_tokens": 200, "ignore_eos": True})
    wait_until_gone(bart_server, "/v1/completions", gone)
    release.set()
    blocker.result(10)
    bart_server.assert_clean()
    assert bart_server.engine.num_aborted == before + 1


def test_async_engine_failures_stay_with_their_callers(bart_path):
    engine = LLMEngine(EngineConfig(model=str(bart_path), num_kv_blocks=64))

    async def main():
        async_engine = AsyncLLMEngine(engine)
        params = SamplingParams(temperature=0.0, max_tokens=4)

        async def run(prompt, rid):
            return [out async for out in async_engine.generate(prompt, params, rid)][-1]

        good, bad = await asyncio.gather(run("A fine document.", "good"),
                                         run({"prompt_token_ids": [0, 10 ** 6]}, "bad"), return_exceptions=True)
        assert good.finished and isinstance(bad, ValueError) and "vocabulary" in str(bad)
        calls = []

        def failing_step():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("simulated kernel failure")
            return LLMEngine.step(engine)

        await async_engine.run_in_engine(lambda e: setattr(e, "step", failing_step))
        with pytest.raises(EngineStepError, match="simulated kernel failure"):
            await run("This one is in flight when the step fails.", "crashed")
        assert (await run("The engine goes on.", "after")).finished  # state was consistent: not dead
        await async_engine.run_in_engine(lambda e: delattr(e, "step"))
        # Shutdown aborts what is still running and refuses new work.
        stream = async_engine.generate("Long.", SamplingParams(max_tokens=200, ignore_eos=True), "long")
        await anext(stream)
        await async_engine.shutdown(timeout=0.0)
        with pytest.raises(EngineDeadError):
            await anext(stream)
        with pytest.raises(EngineDeadError):
            await run("Too late.", "late")
        assert async_engine.snapshot.num_step_errors == 1

    asyncio.run(main())
    assert not engine.has_unfinished_requests() and engine.num_free_blocks() == engine.num_total_blocks()


def test_requests_are_prepared_off_the_event_loop_and_the_engine_thread(bart_path, make_llm, monkeypatch):
    """Tokenizing, resolving bad words and building sampler state run in the input workers."""
    engine = make_llm(bart_path, num_kv_blocks=64).engine
    threads = []
    process = engine.process_request

    def recording(prompt, params):
        threads.append(threading.current_thread().name)
        return process(prompt, params)

    monkeypatch.setattr(engine, "process_request", recording)

    async def main():
        async_engine = AsyncLLMEngine(engine)
        outs = [o async for o in async_engine.generate("A document.", SamplingParams(max_tokens=2), "r")]
        await async_engine.shutdown()
        return outs[-1]

    assert asyncio.run(main()).finished
    assert len(threads) == 1 and threads[0].startswith("encdec-inputs")


def test_graceful_shutdown_finishes_in_flight_requests(bart_path):
    server = LiveServer(build_app(str(bart_path), num_kv_blocks=64), shutdown_timeout=10)
    release = pause_after_first_output(server)
    body = {"prompt": "Finish me.", "max_tokens": 120, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not lines:  # shut down while the request is in flight: new connections are refused...
                server.server.should_exit = True
                deadline = time.monotonic() + 10
                while _accepts_connections(server.url):
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                release.set()  # ...and the request in flight still finishes
            lines.append(line)
    server.thread.join(30)
    assert not server.thread.is_alive()
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    finished = json.loads(events[-2].removeprefix("data: "))
    assert finished["choices"][0]["finish_reason"] == "length"
    engine = server.engine.engine  # the engine thread has stopped: safe to look directly
    assert not engine.has_unfinished_requests() and engine.num_free_blocks() == engine.num_total_blocks()


def _accepts_connections(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def test_serve_command_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model, args.threads) == ("127.0.0.1", 8000, None, "tiny.en", 0)
    args = build_parser().parse_args(["serve", "--port", "0", "--max-queue", "4", "--api-key", "k"])
    assert (args.port, args.max_queue, args.api_key) == (0, 4, "k")


def test_top_logprobs_rank_likeliest_first_and_keep_it_on_equal_text():
    from encdec_engine.server.protocol import completion_logprobs

    pieces = {1: "a", 2: "\ufffd", 3: "\ufffd", 4: "b"}
    lp = completion_logprobs([2], [{2: -0.1, 3: -5.0, 4: -2.0, 1: -3.0}], pieces.__getitem__)
    assert list(lp.top_logprobs[0].items()) == [("\ufffd", -0.1), ("b", -2.0), ("a", -3.0)]
    assert lp.token_logprobs == [-0.1]


def test_text_offsets_skip_special_tokens_the_text_does_not_hold():
    """A forced language code or BOS shows in `tokens` but adds nothing to the text: the next token's offset
    stays where the text starts (it counted the code's characters before)."""
    from encdec_engine.server.protocol import completion_logprobs

    shown = {5: "deu_Latn", 6: "port", 7: "s"}
    in_text = {5: "", 6: "port", 7: "s"}
    lp = completion_logprobs([5, 6, 7], [{5: 0.0}, {6: -0.5}, {7: -0.2}], shown.__getitem__, 3,
                             in_text.__getitem__)
    assert lp.tokens == ["deu_Latn", "port", "s"]
    assert lp.text_offset == [3, 3, 7]


# -- memory held by transcriptions (issue 14: bounded resources) ----------------------------
def test_an_upload_holds_the_audio_budget_only_for_the_bytes_it_sent(whisper_server):
    """A client still sending a 1.9 MB body holds what it has sent, not its Content-Length (an earlier main
    reserved the whole length from the headers on, so that slow clients held every upload at 429); an
    upload that does not fit beside the bytes in flight gets 429 naming the limit and what holds it, and
    the slow client's bytes come back when it gives up."""
    memory, wav = whisper_server.state.audio_memory, (AUDIO / "weather.wav").read_bytes()
    limit = memory.limit
    memory.limit = 4 << 20  # a short upload needs 3.3 MB while it decodes (its samples and log-mel, padded)
    host, port = whisper_server.url.removeprefix("http://").split(":")
    slow = socket.create_connection((host, int(port)))
    try:
        head = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n"
        slow.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1900000\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\n\r\n" + head)
        until(lambda: memory.used == len(head), "the slow upload's first bytes to be reserved")
        with whisper_server.http() as http:
            r = http.post("/v1/audio/transcriptions", files={"file": ("weather.wav", wav)}, data={"model": "whisper-1"})
        assert r.status_code == 200, r.text  # it fits beside what the slow client really sent
        slow.sendall(b"\x00" * 1_500_000)
        until(lambda: memory.used >= 1_500_000, "the slow upload's bytes to be reserved")
        with whisper_server.http() as http:
            r = http.post("/v1/audio/transcriptions", files={"file": ("weather.wav", wav)}, data={"model": "whisper-1"})
        message = r.json()["error"]["message"]
        assert r.status_code == 429 and "of it in uploads still arriving" in message and "limit of 4.0 MB" in message
        assert r.headers["retry-after"] == "1"
        metrics = httpx.get(f"{whisper_server.url}/metrics").text
        assert f'encdec_audio_memory_bytes{{kind="used"}} {memory.used}' in metrics
        assert f'encdec_audio_memory_bytes{{kind="limit"}} {4 << 20}' in metrics
    finally:
        slow.close()
        until(lambda: memory.used == 0, "the slow upload's bytes to come back")
        memory.limit = limit
    with whisper_server.http() as http:
        r = http.post("/v1/audio/transcriptions", files={"file": ("weather.wav", wav)}, data={"model": "whisper-1"})
    assert r.status_code == 200, r.text


def test_a_transcription_holds_its_audio_memory_until_it_ends(whisper_server, tmp_path):
    """Not only until its first window runs (the queue slot): the samples and log-mel stay while the job
    runs (two windows here), and so does their reservation."""
    import soundfile

    samples, rate = soundfile.read(AUDIO / "long_meeting.flac", dtype="float32")
    soundfile.write(tmp_path / "45s.flac", samples[: 45 * rate], rate)
    memory, held = whisper_server.state.audio_memory, []
    with open(tmp_path / "45s.flac", "rb") as f:
        for _ in whisper_server.client().audio.transcriptions.create(model="whisper-1", file=f, stream=True):
            held.append(memory.used)
    # At least the samples at the first window's text, sent while the second window decodes (later
    # events may race the release at the stream's end).
    assert len(held) >= 2 and held[0] >= 45 * 16000 * 4, held
    until(lambda: memory.used == 0, "the reservation to be released")


def test_a_long_upload_is_refused_from_its_header_before_decoding(whisper_server, tmp_path, monkeypatch):
    """A small low-bitrate file of two minutes (the limit here is 60 s): 413 from the duration ffmpeg
    reads in the header, nothing decoded. An ffmpeg-only container (m4a) and a libsndfile one (ogg)."""
    import subprocess

    from encdec_engine.server.uploads import UploadedAudio

    decoded = []
    monkeypatch.setattr(UploadedAudio, "decode", lambda self: decoded.append(self.name))
    for name, codec in (("long.m4a", ["-c:a", "aac", "-b:a", "16k"]), ("long.ogg", ["-c:a", "libvorbis"])):
        path = tmp_path / name
        subprocess.run(["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "sine=frequency=300:duration=120",
                        "-ar", "16000", "-ac", "1", *codec, str(path)], check=True)
        with whisper_server.http() as http:
            r = http.post("/v1/audio/transcriptions", files={"file": (name, path.read_bytes())},
                          data={"model": "whisper-1"})
        assert r.status_code == 413 and "audio is 120.0 s long" in r.json()["error"]["message"], r.text
    assert decoded == []


def test_per_request_cpu_work_runs_off_the_event_loop(whisper_server, monkeypatch):
    """Tokenizing the prompt, aligning words (DTW) and planning windows happen in worker threads: on the
    event loop they would stall every other stream."""
    from encdec_engine.speech.prompts import WindowPrompts
    from encdec_engine.speech.transcriber import Transcriber

    on_loop = []

    def record(fn):
        def wrapper(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop.append(fn.__name__)
            except RuntimeError:
                on_loop.append(False)
            return fn(*args, **kwargs)
        return wrapper

    for cls, name in ((Transcriber, "start"), (Transcriber, "take"), (WindowPrompts, "_text_tokens")):
        monkeypatch.setattr(cls, name, record(getattr(cls, name)))
    with open(AUDIO / "weather.wav", "rb") as f:
        got = whisper_server.client().audio.transcriptions.create(
            model="whisper-1", file=f, prompt="A weather report.", response_format="verbose_json",
            timestamp_granularities=["word"])
    assert got.words and len(on_loop) >= 4
    assert not any(on_loop), on_loop


def test_swagger_ui_is_served_from_the_package_offline(whisper_server):
    """/docs used to fetch Swagger UI's scripts from a CDN (a blank page offline); its page now names only
    this server's own URLs, and they answer."""
    with whisper_server.http() as http:
        page = http.get("/docs").text
        assets = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page)
        assert assets and all(a.startswith("/docs/static/") for a in assets), assets
        assert "cdn" not in page.lower() and "/openapi.json" in page
        for asset in assets:
            r = http.get(asset)
            assert r.status_code == 200 and len(r.content) > 500, asset
        assert http.get("/docs/oauth2-redirect").status_code == 200
