"""/v1/realtime's limits against one client, end to end over real websockets: what a client that reads
nothing may make the server hold (its outbox bound, then close 1008), an append over the buffer bound,
a client's share of the sessions, and the idle timeout. A second client is a second loopback address
(127.0.0.2), as the server keys clients by address."""

from __future__ import annotations

import base64
import json
import select
import socket
import threading
import time

import numpy as np
import pytest
import websockets.sync.client
from servers import AUDIO, AUTH, KEY, LiveServer, default_model_server, until
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from encdec_engine.inputs.audio import load_audio, resample
from encdec_engine.server.app import ServerLimits

IDLE_S = 3.0  # the test server's idle timeout


@pytest.fixture(scope="module")
def server():
    limits = ServerLimits(api_key=KEY, max_realtime_sessions=3, max_realtime_sessions_per_client=2,
                          max_realtime_buffer_seconds=30, realtime_idle_timeout_s=IDLE_S)
    yield from default_model_server(limits)


@pytest.fixture(autouse=True)
def clean(server):
    yield
    until(lambda: server.state.realtime.open == 0, "every session closed", 15)
    server.assert_clean()


def ws_url(server: LiveServer) -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"


def connect(server: LiveServer, source: str = "127.0.0.1"):
    """A websocket client from the loopback address `source`."""
    uri = parse_uri(ws_url(server))
    sock = socket.create_connection((uri.host, uri.port), timeout=10, source_address=(source, 0))
    return websockets.sync.client.connect(ws_url(server), sock=sock, additional_headers=AUTH)


def configure(ws, turn_detection=None) -> None:
    assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
    ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 24000}, "transcription": {"language": "en"},
        "turn_detection": turn_detection}}}}))
    assert json.loads(ws.recv(timeout=10))["type"] == "session.updated"


def append(ws, pcm: bytes, event_id: str | None = None) -> None:
    ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode(),
                        "event_id": event_id}))


def silence(seconds: float) -> bytes:
    return b"\0\0" * int(24000 * seconds)


def pcm24k(audio16k: np.ndarray) -> bytes:
    return (np.clip(resample(audio16k, 16000, 24000), -1, 1) * 32767).astype("<i2").tobytes()


def next_of(ws, kind: str) -> dict:
    while (message := json.loads(ws.recv(timeout=30)))["type"] != kind:
        pass
    return message


def closed_code(ws) -> int:
    with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=10)
    return closed.value.rcvd.code


class SlowReader:
    """A websocket client that reads only when told to: its own socket I/O over websockets' sans-I/O
    protocol (the threaded client reads in the background), small socket buffers so that what the server
    sends stays on the server's side, and sends that never block (what the socket does not take now is
    not sent)."""

    def __init__(self, url: str) -> None:
        uri = parse_uri(url)
        self.sock = socket.socket()
        for buffer in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # small: the sends of both sides stall soon
            self.sock.setsockopt(socket.SOL_SOCKET, buffer, 16384)
        self.sock.settimeout(10)
        self.sock.connect((uri.host, uri.port))
        self.protocol = ClientProtocol(uri)
        request = self.protocol.connect()
        request.headers["Authorization"] = f"Bearer {KEY}"
        self.protocol.send_request(request)
        self.sock.sendall(b"".join(self.protocol.data_to_send()))
        self.texts: list[str] = []
        while self.protocol.state is State.CONNECTING:
            self._take(self.sock.recv(65536))
        self.sock.setblocking(False)
        self.unsent = b""

    def try_send(self, text: str) -> bool:
        """Send `text` if the socket takes it without waiting; False (nothing sent) while it is full."""
        if self.unsent and not self._flush():
            return False
        self.protocol.send_text(text.encode())
        self.unsent = b"".join(self.protocol.data_to_send())
        self._flush()
        return True

    def read_to_close(self, timeout: float = 20) -> int:
        """Read every message until the server's close frame; its close code."""
        deadline = time.monotonic() + timeout
        while self.protocol.close_rcvd is None:
            assert time.monotonic() < deadline, f"no close frame after {len(self.texts)} messages"
            if select.select([self.sock], [], [], 0.1)[0]:
                self._take(self.sock.recv(65536))
        return self.protocol.close_rcvd.code

    def _flush(self) -> bool:
        try:
            self.unsent = self.unsent[self.sock.send(self.unsent):]
        except BlockingIOError:
            pass
        return not self.unsent

    def _take(self, data: bytes) -> None:
        if data:
            self.protocol.receive_data(data)
        else:
            self.protocol.receive_eof()
        self.texts += [e.data.decode() for e in self.protocol.events_received()
                       if getattr(e, "opcode", None) is Opcode.TEXT]

    def close(self) -> None:
        self.sock.close()


def test_a_client_that_reads_nothing_holds_the_server_to_its_outbox_bound_then_is_closed(server):
    """A client flooding bad events (each answered by an error event) while reading slowly grew the server
    2.9 MB/s without end: its error events queued without bound. Past OUTBOX_CHARS of them the server reads
    no more of its events (its sends wait in TCP), and a client that reads none for the idle timeout gets
    an error event and close 1008."""
    from encdec_engine.server.realtime import OUTBOX_CHARS

    client = SlowReader(ws_url(server))
    try:
        until(lambda: len(server.state.realtime_connections) == 1, "the session open", 10)
        (conn,) = list(server.state.realtime_connections)
        sent, deadline = 0, time.monotonic() + 20
        while server.state.realtime.outcomes.get("not_reading", 0) == 0:
            assert time.monotonic() < deadline, (f"the server went on taking events: {sent} sent, "
                                                 f"{conn.outbox.qsize()} of its answers queued")
            if client.try_send("{}"):  # not an event: an error event answers it
                sent += 1
            else:
                time.sleep(0.005)
        assert OUTBOX_CHARS <= conn.outbox_chars <= OUTBOX_CHARS + 2 * 2500  # + the last answer and the error
        assert client.read_to_close() == 1008
    finally:
        client.close()
    events = [json.loads(t) for t in client.texts]
    answered = sum(e["type"] == "error" and e["error"]["code"] == "missing_type" for e in events)
    assert 0 < answered < sent, (answered, sent)
    last = events[-1]["error"]
    assert last["code"] == "client_not_reading" and "--realtime-idle-timeout" in last["message"], last


def test_an_append_holding_more_than_the_buffer_bound_is_refused_whole_and_the_session_lives_on(server):
    """One append of 391 s was decoded whole against the 120 s bound (here 30 s): now it is refused
    before it is decoded, the error names the bound and its flag, and nothing of it is held."""
    with connect(server) as ws:
        configure(ws)
        append(ws, silence(31), "big")
        error = next_of(ws, "error")["error"]
        assert (error["code"], error["param"], error["event_id"]) == ("audio_too_long", "audio", "big"), error
        assert "--max-realtime-buffer-seconds" in error["message"]
        (conn,) = list(server.state.realtime_connections)
        assert conn.session.buffered_seconds == 0
        append(ws, silence(1))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        assert next_of(ws, "input_audio_buffer.committed")
    assert server.state.realtime.outcomes["overflowed"] == 0


def test_an_append_that_takes_a_session_over_its_bound_is_taken_no_further(server):
    """With decodes held back, 20 s then an append of 25 s: the session held all 45 s before it was closed
    over its 30 s bound; now the append stops at the bound (a second at a time) and the session closes."""
    release = threading.Event()

    def pause(engine) -> None:  # on the engine thread
        def step():
            release.wait(30)
            return type(engine).step(engine)

        engine.step = step

    dropped = server.state.realtime.dropped_seconds
    server.on_engine(pause)
    try:
        with connect(server) as ws:
            configure(ws)
            append(ws, silence(20))
            append(ws, silence(25))
            error = next_of(ws, "error")["error"]
            assert error["code"] == "input_audio_buffer_full", error
            assert closed_code(ws) == 1013
    finally:
        release.set()
        server.on_engine(lambda e: e.__dict__.pop("step", None))
    assert 30 < server.state.realtime.dropped_seconds - dropped <= 31


def test_one_client_holds_its_share_of_the_sessions_and_another_still_gets_one(server):
    """One client held 32 of 32 sessions while the next was refused; now one address holds at most its
    share (2 of 3 here), and each refusal names its limit and flag."""
    first, second = connect(server), connect(server)
    other = None
    try:
        for ws in (first, second):
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        with connect(server) as third:
            refused = json.loads(third.recv(timeout=10))
            assert refused["type"] == "error", "a third session for one client"
            error = refused["error"]
            assert error["code"] == "client_session_limit_reached", error
            assert "--max-realtime-sessions-per-client 2" in error["message"]
            assert closed_code(third) == 1013
        other = connect(server, source="127.0.0.2")  # another client: the third session
        assert json.loads(other.recv(timeout=10))["type"] == "session.created"
        with connect(server, source="127.0.0.2") as fourth:  # within its share, over the server's limit
            refused = json.loads(fourth.recv(timeout=10))
            assert refused["type"] == "error", "a fourth session"
            error = refused["error"]
            assert error["code"] == "session_limit_reached" and "--max-realtime-sessions)" in error["message"]
            assert closed_code(fourth) == 1013
    finally:
        for ws in (first, second, other):
            if ws is not None:
                ws.close()
    assert server.state.realtime.outcomes["refused_client"] >= 1


def test_a_session_with_no_client_event_for_the_idle_timeout_is_closed(server):
    """One client held sessions open and idle for as long as it liked; now a session that gets no client
    event for the idle timeout (and owes no transcription) gets an error event naming it and close 1008."""
    with connect(server) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        error = json.loads(ws.recv(timeout=IDLE_S + 10))["error"]  # nothing sent
        assert error["code"] == "session_idle_timeout" and "--realtime-idle-timeout" in error["message"], error
        assert closed_code(ws) == 1008
    assert server.state.realtime.outcomes["idle"] >= 1


def test_a_client_waiting_for_its_transcription_is_not_idle(server):
    """Decodes held back past the idle timeout after a commit: the client, sending nothing, still gets its
    text (the session owes it a transcription, so it is not idle)."""
    release = threading.Event()

    def pause(engine) -> None:
        def step():
            release.wait(30)
            return type(engine).step(engine)

        engine.step = step

    with connect(server) as ws:
        configure(ws)
        server.on_engine(pause)
        try:
            append(ws, pcm24k(load_audio(AUDIO / "fox.wav")))
            ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            assert next_of(ws, "input_audio_buffer.committed")
            time.sleep(IDLE_S + 1)
        finally:
            release.set()
            server.on_engine(lambda e: e.__dict__.pop("step", None))
        done = next_of(ws, "conversation.item.input_audio_transcription.completed")
    assert "quick brown fox" in done["transcript"]
