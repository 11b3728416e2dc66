"""The server's `chunking_strategy` {"type": "server_vad", ...} (OpenAI's field) through the official client:
Silero VAD, chunks of speech decoded at once, times on the upload's timeline; bad values get a 400 naming
the field."""

from __future__ import annotations

import io
import json

import numpy as np
import openai
import pytest
import soundfile
from servers import LiveServer, default_model_server
from vad_audio import recording, silence, wav, white_noise

from encdec_engine.server.app import ServerLimits
from encdec_engine.inputs.audio import SAMPLE_RATE
from encdec_engine.speech.offline import transcribe_offline
from encdec_engine.speech.options import TranscribeOptions

SERVER_VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 200, "silence_duration_ms": 400}


@pytest.fixture(scope="module")
def server():
    yield from default_model_server(ServerLimits(max_upload_mb=2.0))


@pytest.fixture(autouse=True)
def clean(server):
    yield
    server.assert_clean()


def test_server_vad_through_the_openai_client(server):
    """Same words and times as LLM.transcribe(vad_filter=True, chunked=True) with the fields under
    faster-whisper's names; no word in the silence or the noise."""
    rec = recording(silence(1), "fox.wav", silence(8), "weather.wav", white_noise(5), "coffee.wav")
    upload = wav(rec.samples)
    got = server.client().audio.transcriptions.create(
        model="whisper-1", file=("pauses.wav", upload), response_format="verbose_json",
        timestamp_granularities=["word", "segment"], chunking_strategy=SERVER_VAD)
    params = {"threshold": 0.5, "speech_pad_ms": 200, "min_silence_duration_ms": 400}
    opts = TranscribeOptions(language="en", vad_filter=True, chunked=True, vad_parameters=params, word_timestamps=True)
    samples = soundfile.read(io.BytesIO(upload), dtype="float32")[0]  # what the server decoded (16-bit)
    ref = server.on_engine(lambda e: transcribe_offline(e, opts, [samples])[0])
    expected = [(w.word.strip(), w.start, w.end) for s in ref.segments for w in s.words]
    assert [(w.word, w.start, w.end) for w in got.words] == expected
    assert [(s.start, s.end, s.text) for s in got.segments] == [(s.start, s.end, s.text) for s in ref.segments]
    assert len(got.words) >= 25 and got.duration == pytest.approx(len(rec.samples) / SAMPLE_RATE, abs=1e-3)
    for w in got.words:
        assert any(a - 0.32 <= w.start and w.end <= b + 0.32 for a, b in rec.speech), (w, rec.speech)


def test_server_vad_defaults_and_a_json_form_field(server):
    """The object may come as one JSON text (curl -F), its fields left out take OpenAI's defaults; audio
    with no speech gives an empty transcript."""
    with server.http() as http:
        r = http.post("/v1/audio/transcriptions", files={"file": ("quiet.wav", wav(silence(4)))},
                      data={"chunking_strategy": json.dumps({"type": "server_vad"}), "response_format": "verbose_json"})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "" and r.json()["segments"] == []


BAD = [
    ({"chunking_strategy[type]": "client_vad"}, "type: Input should be 'server_vad'"),
    ({"chunking_strategy[threshold]": "0.5"}, "type: Field required"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "1.5"},
     "threshold: Input should be less than or equal to 1"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[prefix_padding_ms]": "-5"},
     "prefix_padding_ms: Input should be greater than or equal to 0"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[silence_duration_ms]": "long"},
     "silence_duration_ms: Input should be a valid integer"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[min_speech_ms]": "5"},
     "min_speech_ms: Extra inputs are not permitted"),
    ({"chunking_strategy": "{not json"}, "not valid JSON"),
    ({"chunking_strategy": "vad"}, 'must be "auto" or an object with "type": "server_vad"'),
    ({"chunking_strategy": "auto", "chunking_strategy[type]": "server_vad"}, "given more than once"),
]


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_chunking_strategy_gets_a_400_naming_the_field(server, fields, message):
    with server.http() as http:
        r = http.post("/v1/audio/transcriptions", files={"file": ("fox.wav", wav(silence(1)))}, data=fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "chunking_strategy", error


def test_bad_server_vad_through_the_openai_client(server):
    with pytest.raises(openai.BadRequestError, match="threshold"):
        server.client().audio.transcriptions.create(
            model="whisper-1", file=("quiet.wav", wav(silence(1))),
            chunking_strategy={"type": "server_vad", "threshold": -0.1})
