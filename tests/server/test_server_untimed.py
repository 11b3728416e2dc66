"""`encdec serve --without-timestamps` (ServerLimits.without_timestamps): answers that carry no times decode
with <|notimestamps|>, as vLLM's server does; answers with times still decode timestamp tokens."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
from servers import default_model_server
from vad_audio import clip, silence, wav

from encdec_engine.cli.main import build_parser
from encdec_engine.cli.serve import server_limits
from encdec_engine.server.app import ServerLimits
from encdec_engine.speech.offline import transcribe_offline
from encdec_engine.speech.options import TranscribeOptions

# Three clips with pauses, on which tiny.en's two decodings give different words ("I would like" with
# timestamp tokens, "I will like" without): the test tells which one the server ran.
CLIPS = ("weather.wav", "coffee.wav", "fox.wav")


@pytest.fixture(scope="module")
def server():
    yield from default_model_server(ServerLimits(without_timestamps=True))


@pytest.fixture(autouse=True)
def clean(server):
    yield
    server.assert_clean()


@pytest.fixture(scope="module")
def upload() -> bytes:
    return wav(np.concatenate([silence(0.5)] + [part for name in CLIPS for part in (clip(name), silence(0.6))]))


@pytest.fixture(scope="module")
def offline(server, upload):
    """{timestamps: the offline Transcription} of what the server decodes (the 16-bit upload)."""
    samples = soundfile.read(io.BytesIO(upload), dtype="float32")[0]
    results = {ts: server.on_engine(lambda e: transcribe_offline(e, TranscribeOptions(language="en", timestamps=ts),
                                                                 [samples])[0]) for ts in (True, False)}
    assert results[True].text != results[False].text  # else the test cannot tell the decodings apart
    return results


@pytest.mark.parametrize("response_format", ["json", "text"])
def test_answers_without_times_decode_without_timestamp_tokens(server, upload, offline, response_format):
    got = server.client().audio.transcriptions.create(model="whisper-1", file=("three.wav", upload),
                                                      language="en", response_format=response_format)
    assert (got if response_format == "text" else got.text).strip() == offline[False].text.strip()


def test_a_stream_decodes_without_timestamp_tokens(server, upload, offline):
    events = list(server.client().audio.transcriptions.create(model="whisper-1", file=("three.wav", upload),
                                                              language="en", stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text.strip() == offline[False].text.strip()


def test_timed_answers_still_decode_timestamp_tokens(server, upload, offline):
    got = server.client().audio.transcriptions.create(model="whisper-1", file=("three.wav", upload),
                                                      language="en", response_format="verbose_json")
    assert [(s.start, s.end, s.text) for s in got.segments] == [(s.start, s.end, s.text)
                                                                for s in offline[True].segments]
    assert len(got.segments) > 1  # timed segments, not one per window


def test_the_serve_flag_sets_it():
    parse = build_parser().parse_args
    assert server_limits(parse(["serve", "--without-timestamps"])).without_timestamps is True
    assert server_limits(parse(["serve"])).without_timestamps is False
