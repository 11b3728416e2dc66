"""/v1/realtime end to end: a uvicorn server on loopback driven by the official openai client's realtime
interface (GA `client.realtime.connect(extra_query={"intent": "transcription"})`) and its beta one
(`client.beta.realtime.connect`), unchanged. After every test the server holds no KV block, no session
and no queue slot, and still answers."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import websockets.sync.client
from servers import AUDIO, AUTH, KEY, LiveServer, default_model_server, until

from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.inputs.audio import load_audio, resample
from encdec_engine.inputs.pcm_stream import AudioChunks
from encdec_engine.server.app import ServerLimits, build_app
from encdec_engine.speech.offline import transcribe_offline
from encdec_engine.speech.options import TranscribeOptions

CHUNK = 4800  # bytes: 100 ms of pcm16 at 24 kHz
VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}


@pytest.fixture(scope="module")
def server():
    limits = ServerLimits(api_key=KEY, max_realtime_sessions=2, max_realtime_sessions_per_client=2,
                          max_realtime_buffer_seconds=30)
    yield from default_model_server(limits)


@pytest.fixture(autouse=True)
def clean(server):
    yield
    until(lambda: server.state.realtime.open == 0, "every session closed", 10)
    server.assert_clean()


def client(server: LiveServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{server.url}/v1", max_retries=0,
                         websocket_base_url=server.url.replace("http://", "ws://") + "/v1")


def connect(server: LiveServer, **kwargs):
    return client(server, **kwargs).realtime.connect(extra_query={"intent": "transcription"})


def ga_session(turn_detection=VAD, rate: int = 24000) -> dict:
    return {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": rate}, "transcription": {"model": "whisper-1", "language": "en"},
        "turn_detection": turn_detection}}}


def recording(*clips: str, gap: float = 1.0) -> np.ndarray:
    silence = np.zeros(int(gap * 16000), dtype=np.float32)
    return np.concatenate([p for clip in clips for p in (silence, load_audio(AUDIO / clip))] + [silence, silence])


def pcm24k(audio16k: np.ndarray) -> bytes:
    return (np.clip(resample(audio16k, 16000, 24000), -1, 1) * 32767).astype("<i2").tobytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def collect(conn, until_type: str, count: int = 1, timeout: float = 120.0) -> list[tuple[float, object]]:
    """Events (with their arrival time) until `count` of `until_type` have come."""
    events, deadline = [], time.monotonic() + timeout
    while sum(e.type == until_type for _, e in events) < count:
        assert time.monotonic() < deadline, f"timed out; got {[e.type for _, e in events]}"
        events.append((time.monotonic(), conn.recv()))
    return events


def offline(server: LiveServer, samples: np.ndarray) -> str:
    options = TranscribeOptions(language="en")
    return server.on_engine(lambda e: transcribe_offline(e, options, [samples])[0]).text.strip()


def test_streamed_speech_gets_deltas_while_spoken_and_offline_final_text(server):
    """Two utterances in 100 ms chunks at real-time pace: text arrives before each turn's speech_stopped,
    each turn's .completed equals the offline transcription of its span (of the very samples the server
    decoded: the 24 kHz stream resampled as it arrived), and /metrics shows the session."""
    audio = recording("stella.wav", "weather.wav")
    pcm = pcm24k(audio)
    chunks = [pcm[i : i + CHUNK] for i in range(0, len(pcm), CHUNK)]
    with connect(server) as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session=ga_session())
        updated = conn.recv()
        assert updated.type == "session.updated" and updated.session.audio.input.turn_detection.silence_duration_ms == 500

        def feed():
            for chunk in chunks:
                conn.input_audio_buffer.append(audio=b64(chunk))
                time.sleep(0.1)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        events = collect(conn, "conversation.item.input_audio_transcription.completed", 2)
        feeder.join()
        metrics = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert 'encdec_realtime_sessions{kind="open"} 1' in metrics and "encdec_realtime_lag_seconds_count" in metrics
    kinds = [e.type for _, e in events]
    assert kinds.count("input_audio_buffer.speech_started") == kinds.count("input_audio_buffer.committed") == 2
    committed = [e for _, e in events if e.type == "input_audio_buffer.committed"]
    assert committed[0].previous_item_id is None and committed[1].previous_item_id == committed[0].item_id
    heard = AudioChunks(24000)  # what the server heard, to the sample: the stream resampled as it arrived
    served = np.concatenate([heard(c) for c in chunks])
    early = 0
    for item in (c.item_id for c in committed):
        started = next(e for _, e in events if e.type == "input_audio_buffer.speech_started" and e.item_id == item)
        stopped_at, stopped = next((t, e) for t, e in events if e.type == "input_audio_buffer.speech_stopped"
                                   and e.item_id == item)
        deltas = [(t, e.delta) for t, e in events if e.type.endswith("transcription.delta") and e.item_id == item]
        done = next(e for _, e in events if e.type.endswith("transcription.completed") and e.item_id == item)
        early += any(t < stopped_at for t, _ in deltas)
        assert done.usage.seconds == pytest.approx((stopped.audio_end_ms - started.audio_start_ms) / 1000, abs=0.002)
        span = served[started.audio_start_ms * 16 : stopped.audio_end_ms * 16]
        assert done.transcript == offline(server, span)
    assert early >= 1, "no text arrived while a turn was being spoken"


def test_two_sessions_share_voice_detection_calls_and_each_gets_its_offline_text(server):
    """Two sessions streaming at once (each 100 ms chunk of one sent right after the other's): their voice
    detection runs in shared calls of the network, and each turn's .completed still equals the offline
    transcription of its span."""
    audios = [recording("fox.wav"), recording("coffee.wav", gap=1.3)]
    pcms = [pcm24k(a) for a in audios]
    calls, appends = server.state.vad.calls, server.state.vad.appends
    with connect(server) as first, connect(server) as second:
        conns = (first, second)
        for conn in conns:
            assert conn.recv().type == "session.created"
            conn.session.update(session=ga_session())
            assert conn.recv().type == "session.updated"

        def feed():
            for i in range(0, max(len(p) for p in pcms), CHUNK):
                for conn, pcm in zip(conns, pcms):
                    if i < len(pcm):
                        conn.input_audio_buffer.append(audio=b64(pcm[i : i + CHUNK]))
                time.sleep(0.1)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        events = [collect(conn, "conversation.item.input_audio_transcription.completed") for conn in conns]
        feeder.join()
    shared = server.state.vad.appends - appends - (server.state.vad.calls - calls)
    assert shared > 0, "no call of the voice detection took both sessions' appends"
    for pcm, got in zip(pcms, events):
        heard = AudioChunks(24000)
        served = np.concatenate([heard(pcm[i : i + CHUNK]) for i in range(0, len(pcm), CHUNK)])
        started = next(e for _, e in got if e.type == "input_audio_buffer.speech_started")
        stopped = next(e for _, e in got if e.type == "input_audio_buffer.speech_stopped")
        done = next(e for _, e in got if e.type.endswith("transcription.completed"))
        assert done.transcript == offline(server, served[started.audio_start_ms * 16 : stopped.audio_end_ms * 16])


def test_beta_interface_manual_commit(server):
    """The beta client (OpenAI-Beta: realtime=v1): transcription_session.update with turn detection off; the
    buffer becomes one turn when the client commits it."""
    clip = load_audio(AUDIO / "weather.wav")
    beta = client(server).beta.realtime.connect(model="whisper-1", extra_query={"intent": "transcription"})
    with beta as conn:
        assert conn.recv().type == "transcription_session.created"
        conn.transcription_session.update(session={"input_audio_format": "pcm16", "turn_detection": None,
                                                   "input_audio_transcription": {"model": "whisper-1"}})
        updated = conn.recv()
        assert updated.type == "transcription_session.updated" and updated.session.turn_detection is None
        pcm = pcm24k(clip)
        for i in range(0, len(pcm), CHUNK):
            conn.input_audio_buffer.append(audio=b64(pcm[i : i + CHUNK]))
        conn.input_audio_buffer.commit()
        events = [e for _, e in collect(conn, "conversation.item.input_audio_transcription.completed")]
    kinds = [e.type for e in events]
    assert "input_audio_buffer.speech_started" not in kinds
    assert kinds.index("input_audio_buffer.committed") < kinds.index("conversation.item.created")
    assert events[-1].transcript == "Today is a beautiful day to go for a walk in the park."


def test_bad_events_get_error_events_and_the_session_lives_on(server):
    with connect(server) as conn:
        conn.recv()
        errors = []

        def expect_error(param, code=None):
            e = conn.recv()
            assert e.type == "error", e
            assert e.error.param == param and (code is None or e.error.code == code), e.error
            errors.append(e)

        conn.input_audio_buffer.append(audio=b64(b"\0\0" * 2400))  # audio before session configuration
        expect_error("type", "session_not_configured")
        conn.send({"type": "response.create"})
        expect_error("type", "unknown_event")
        conn.session.update(session=ga_session({"type": "semantic_vad"}))
        expect_error("session.audio.input.turn_detection.type", "unsupported_parameter")
        conn.session.update(session=ga_session(rate=44100))
        expect_error("session.audio.input.format.rate", "unsupported_format")
        conn.session.update(session=ga_session(rate="24000"))  # a string: OpenAI's schema has a number
        expect_error("session.audio.input.format.rate")
        conn.session.update(session={"type": "transcription", "audio": {"input": {"transcription": {"language": "xx"}}}})
        expect_error("session.audio.input.transcription.language")
        conn.session.update(session={"type": "transcription", "audio": {"input": {"volume": 3}}})
        expect_error("session.audio.input.volume", "unknown_parameter")
        conn.session.update(session=ga_session(None))
        assert conn.recv().type == "session.updated"
        conn.send({"type": "input_audio_buffer.append", "audio": "not base64!", "event_id": "evt-1"})
        expect_error("audio", "invalid_base64")
        assert errors[-1].error.event_id == "evt-1"
        conn.input_audio_buffer.append(audio=b64(b"\0" * 4801))  # not 16-bit samples
        expect_error("audio", "invalid_audio_format")
        conn.input_audio_buffer.commit()  # nothing appended
        expect_error(None, "input_audio_buffer_commit_empty")
        pcm = pcm24k(load_audio(AUDIO / "fox.wav"))
        conn.input_audio_buffer.append(audio=b64(pcm))
        conn.input_audio_buffer.commit()
        done = collect(conn, "conversation.item.input_audio_transcription.completed")[-1][1]
    assert "quick brown fox" in done.transcript


def test_a_client_that_disconnects_mid_speech_frees_its_blocks(server):
    audio = load_audio(AUDIO / "stella.wav")
    conn = connect(server).enter()
    conn.recv()
    conn.session.update(session=ga_session(None, rate=16000))  # 16 kHz accepted too
    conn.recv()
    pcm = (audio * 32767).astype("<i2").tobytes()
    for i in range(0, len(pcm), 3200):
        conn.input_audio_buffer.append(audio=b64(pcm[i : i + 3200]))
    until(lambda: server.on_engine(lambda e: e.has_unfinished_requests()), "a decode in flight", 60)
    conn.close()  # mid-turn, a decode running: the session and its request go at once
    until(lambda: server.state.realtime.open == 0, "the session closed", 10)
    server.assert_clean()


def test_over_the_session_cap_the_next_client_gets_an_error_and_the_others_go_on(server):
    first, second = connect(server).enter(), connect(server).enter()
    try:
        for conn in (first, second):
            conn.recv()
            conn.session.update(session=ga_session(None))
            conn.recv()
        with connect(server) as third:
            refused = third.recv()
            assert refused.type == "error" and refused.error.code == "session_limit_reached"
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                third.recv()
            assert closed.value.rcvd.code == 1013  # try again later
        metrics = httpx.get(f"{server.url}/metrics", headers=AUTH).text
        assert 'encdec_realtime_sessions_total{outcome="refused"} 1' in metrics
        first.input_audio_buffer.append(audio=b64(pcm24k(load_audio(AUDIO / "coffee.wav"))))
        first.input_audio_buffer.commit()
        done = collect(first, "conversation.item.input_audio_transcription.completed")[-1][1]
        assert "coffee" in done.transcript
    finally:
        first.close()
        second.close()


def test_a_session_over_its_buffer_bound_gets_an_error_and_is_closed(server):
    """Decodes held back (the engine paused) while 35 s of audio arrive: over the 30 s bound the session
    gets an error event and close code 1013; the server goes on."""
    release = threading.Event()

    def pause(engine) -> None:  # on the engine thread
        def step():
            release.wait(30)
            return type(engine).step(engine)

        engine.step = step

    server.on_engine(pause)
    try:
        with connect(server) as conn:
            conn.recv()
            conn.session.update(session=ga_session(None))
            conn.recv()
            pcm = pcm24k(np.tile(load_audio(AUDIO / "learning.wav"), 8)[: 35 * 16000])
            for i in range(0, len(pcm), 10 * CHUNK):
                conn.input_audio_buffer.append(audio=b64(pcm[i : i + 10 * CHUNK]))
            error = conn.recv()
            while error.type != "error":
                error = conn.recv()
            assert error.error.code == "input_audio_buffer_full"
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                conn.recv()
            assert closed.value.rcvd.code == 1013
    finally:
        release.set()
        server.on_engine(lambda e: e.__dict__.pop("step", None))
    assert server.state.realtime.outcomes["overflowed"] == 1


def test_the_api_key_is_needed_on_the_websocket(server):
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        with connect(server, key="wrong"):
            pass
    assert refused.value.response.status_code == 401
    with websockets.sync.client.connect(server.url.replace("http", "ws") + "/v1/realtime?intent=transcription",
                                        additional_headers=AUTH) as ws:
        assert '"session.created"' in ws.recv(timeout=10)


def test_events_that_broke_the_receiver_get_error_events_and_the_session_lives_on(server):
    """A message nested thousands deep (RecursionError in the JSON parser) and a prompt with a lone
    surrogate (TypeError in the tokenizer) ended the session with no error event (close 1006)."""
    import json

    with websockets.sync.client.connect(server.url.replace("http", "ws") + "/v1/realtime?intent=transcription",
                                        additional_headers=AUTH) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        ws.send("[" * 5000 + "]" * 5000)
        error = json.loads(ws.recv(timeout=10))["error"]
        assert error["code"] == "invalid_json" and "nested" in error["message"]
        session = ga_session(None)
        session["audio"]["input"]["transcription"]["prompt"] = "\ud800"
        ws.send(json.dumps({"type": "session.update", "session": session}))
        error = json.loads(ws.recv(timeout=10))["error"]
        assert error["param"] == "session.audio.input.transcription.prompt"
        assert "surrogate" in error["message"] or "unicode" in error["message"]
        ws.send(json.dumps({"type": "session.update", "session": ga_session(None)}))
        assert json.loads(ws.recv(timeout=10))["type"] == "session.updated"


def test_a_server_fault_on_an_event_is_an_error_event_and_a_1011_close(server, monkeypatch):
    """Not a silent 1006: the client is told, the fault is logged, and the session's resources go."""
    import json

    from encdec_engine.server import realtime

    def broken(self, audio):
        raise RuntimeError("injected")

    monkeypatch.setattr(realtime.RealtimeConnection, "_append", broken)
    with websockets.sync.client.connect(server.url.replace("http", "ws") + "/v1/realtime?intent=transcription",
                                        additional_headers=AUTH) as ws:
        ws.recv(timeout=10)
        ws.send(json.dumps({"type": "session.update", "session": ga_session(None)}))
        ws.recv(timeout=10)
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(b"\0\0" * 2400), "event_id": "e1"}))
        error = json.loads(ws.recv(timeout=10))["error"]
        assert (error["type"], error["code"], error["event_id"]) == ("server_error", "server_error", "e1")
        with pytest.raises(websockets.exceptions.ConnectionClosedError) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1011


def test_audio_pace_lets_a_burst_through_then_holds_a_client_to_its_speed():
    from encdec_engine.server.realtime import AudioPace

    now = [100.0]
    pace = AudioPace(speed=4.0, burst=30.0, clock=lambda: now[0])
    assert pace.add(30.0) == 0.0  # the burst, at once
    assert pace.add(8.0) == pytest.approx(2.0)  # 8 s more at once: read on 2 s later (8 s at 4x)
    now[0] += 2.0
    assert pace.add(4.0) == pytest.approx(1.0)
    now[0] += 60.0  # a quiet minute: room for 4 minutes more (no new burst)
    assert pace.add(200.0) == 0.0


def test_a_client_sending_faster_than_the_server_takes_audio_is_slowed_not_refused(server):
    """One client flooding silence kept the event loop busy for every other client (a normal transcription
    took 55 s instead of 0.2 s): past its first 30 s (the buffer bound), audio is read at 4x real time."""
    with connect(server) as conn:
        conn.recv()
        conn.session.update(session=ga_session())
        assert conn.recv().type == "session.updated"
        start = time.monotonic()
        conn.input_audio_buffer.append(audio=b64(b"\0\0" * 24000 * 30))  # the burst: 30 s of silence
        for _ in range(8):  # 8 s more, at once: 2 s at 4x real time
            conn.input_audio_buffer.append(audio=b64(b"\0\0" * 24000))
        conn.input_audio_buffer.clear()
        assert collect(conn, "input_audio_buffer.cleared")
        assert time.monotonic() - start >= 1.5  # the last second's audio and the clear were read ~2 s on


def test_an_oversized_field_is_refused_without_being_quoted_back_whole(server):
    """A 10 KB language was echoed in full; a realtime field has the HTTP endpoints' caps, and any error
    message is cut at 2,000 characters."""
    import json

    from encdec_engine.server.errors import clip

    with websockets.sync.client.connect(server.url.replace("http", "ws") + "/v1/realtime?intent=transcription",
                                        additional_headers=AUTH) as ws:
        ws.recv(timeout=10)
        session = ga_session(None)
        session["audio"]["input"]["transcription"]["language"] = "x" * 10_000
        ws.send(json.dumps({"type": "session.update", "session": session}))
        error = json.loads(ws.recv(timeout=10))["error"]
        assert error["param"] == "session.audio.input.transcription.language" and len(error["message"]) < 500
    assert clip("y" * 5000).endswith("(the message was cut at 2000 of its 5,000 characters)")


def test_at_shutdown_an_open_turn_is_finished_and_the_session_closed_going_away():
    """uvicorn closed every websocket at once (1012) and the words of an open turn were lost; now the
    server ends the turn where its audio does, sends its .completed, then closes with 1001."""
    import json

    live = LiveServer(build_app(str(default_model_path()), limits=ServerLimits(api_key=KEY),
                                kv_cache_space_gb=0.25), shutdown_timeout=30)
    stopper = None
    try:
        with websockets.sync.client.connect(live.url.replace("http", "ws") + "/v1/realtime?intent=transcription",
                                            additional_headers=AUTH) as ws:
            ws.recv(timeout=10)
            ws.send(json.dumps({"type": "session.update", "session": ga_session(None)}))  # manual: never committed
            assert json.loads(ws.recv(timeout=10))["type"] == "session.updated"
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": b64(pcm24k(load_audio(AUDIO / "fox.wav")))}))
            time.sleep(0.5)  # the append is in before the shutdown starts
            stopper = threading.Thread(target=live.stop)
            stopper.start()
            kinds, completed = [], None
            with pytest.raises(websockets.exceptions.ConnectionClosedOK) as closed:
                while True:
                    message = json.loads(ws.recv(timeout=60))
                    kinds.append(message["type"])
                    if message["type"] == "conversation.item.input_audio_transcription.completed":
                        completed = message["transcript"]
            assert closed.value.rcvd.code == 1001, kinds
            assert completed is not None and "quick brown fox" in completed.lower(), kinds
    finally:
        if stopper is not None:
            stopper.join(60)
        else:
            live.stop()
    engine = live.engine.engine
    assert engine.num_free_blocks() == engine.num_total_blocks()
