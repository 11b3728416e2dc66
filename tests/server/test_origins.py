"""No web page may use the server through a visitor's browser (server/origins.py): a DNS-rebinding `Host`
and a cross-site `Origin` are refused (403, OpenAI's error body naming the header, its value and the flag
that allows it) on HTTP and on the realtime websocket; every one of these was served by an earlier main.
Clients that are not browsers (the openai client, curl) send no Origin and pass. A real uvicorn server
on loopback with the default limits (`encdec serve`'s on its default --host), driven by httpx, `websockets`
and the openai client."""

from __future__ import annotations

import json
import socket
from dataclasses import replace

import httpx
import openai
import pytest
import websockets.sync.client
from servers import AUDIO, LiveServer, default_model_server

from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.cli.main import build_parser, main
from encdec_engine.cli.serve import server_limits
from encdec_engine.server.app import ServerLimits

EVIL = "https://evil.example"


def serve_flags(*flags: str) -> ServerLimits:
    """The limits `encdec serve FLAGS` gives a server on its default --host (127.0.0.1)."""
    args = build_parser().parse_args(["serve", *flags])
    return server_limits(args).for_bind(args.host)


@pytest.fixture(scope="module")
def server():
    yield from default_model_server()


@pytest.fixture(autouse=True)
def clean(server):
    yield
    server.assert_clean()


def limits_of(server: LiveServer, monkeypatch, limits: ServerLimits) -> None:
    """Serve the next requests under `limits`' Host and Origin rules."""
    monkeypatch.setattr(server.state, "limits", replace(server.state.limits, allowed_hosts=limits.allowed_hosts,
                                                        allowed_origins=limits.allowed_origins))


def port(server: LiveServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def upload(server: LiveServer, **headers: str) -> httpx.Response:
    with server.http() as http, open(AUDIO / "fox.wav", "rb") as f:
        return http.post("/v1/audio/transcriptions", files={"file": ("fox.wav", f, "audio/wav")},
                         data={"model": "whisper-1", "response_format": "json"}, headers=headers)


def realtime(server: LiveServer, host: str | None = None,
             origin: str | None = None) -> websockets.sync.client.ClientConnection:
    """A websocket to /v1/realtime as a browser opens it: `origin` names the page, `host` the name the page
    reached the server by (the socket goes to the server's loopback port whatever it is)."""
    sock = socket.create_connection(("127.0.0.1", port(server)))
    uri = f"ws://{host or f'127.0.0.1:{port(server)}'}/v1/realtime?intent=transcription"
    return websockets.sync.client.connect(uri, sock=sock, origin=origin, proxy=None)


def refused_on_the_websocket(server: LiveServer, **how) -> dict:
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        with realtime(server, **how):
            pass
    assert refused.value.response.status_code == 403
    return json.loads(refused.value.response.body)["error"]


def test_a_dns_rebinding_host_is_refused_on_every_path(server):
    """A page whose name was re-resolved to 127.0.0.1 read /v1/models and /metrics and sent uploads."""
    rebound = f"evil.example:{port(server)}"
    with server.http() as http:
        for path in ("/v1/models", "/metrics", "/health", "/docs"):
            r = http.get(path, headers={"Host": rebound})
            assert r.status_code == 403, path
            error = r.json()["error"]
            assert error["type"] == "permission_error"
            assert f"Host '{rebound}'" in error["message"] and "--allowed-hosts evil.example" in error["message"]
        for host in ("localhost", f"localhost:{port(server)}", "127.0.0.1:1", f"[::1]:{port(server)}",
                     "app.localhost", "LOCALHOST.", "10.1.2.3:8000"):  # this machine's names; IP addresses
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
    r = upload(server, Host=rebound)
    assert r.status_code == 403 and "text" not in r.text
    error = refused_on_the_websocket(server, host=rebound)
    assert f"Host '{rebound}'" in error["message"]


def test_a_cross_site_upload_is_not_transcribed(server):
    """Any page could post a multipart form to http://127.0.0.1:8000 and get it transcribed."""
    r = upload(server, Origin=EVIL)
    assert r.status_code == 403
    error = r.json()["error"]
    assert f"Origin '{EVIL}'" in error["message"] and f"--allowed-origins {EVIL}" in error["message"]
    assert "fox" not in r.text.lower()
    for page in ("null", "http://127.0.0.1.evil.example", "http://localhost.evil.example"):
        assert upload(server, Origin=page).status_code == 403, page
    for page in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:5173"):  # this machine's pages
        r = upload(server, Origin=page)
        assert r.status_code == 200 and "fox" in r.json()["text"].lower(), page


def test_a_web_pages_realtime_websocket_is_refused(server):
    """A page's websocket (not held back by CORS) opened a realtime session and could stream audio."""
    error = refused_on_the_websocket(server, origin=EVIL)
    assert error["type"] == "permission_error" and f"Origin '{EVIL}'" in error["message"]
    with realtime(server, origin="http://localhost:5173") as ws:  # a page of this machine
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
    with realtime(server) as ws:  # not a browser: no Origin
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"


def test_allowed_hosts_and_origins_come_from_the_serve_flags(server, monkeypatch):
    limits = serve_flags("--allowed-hosts", "gpu-box.lan, .example.com", "--allowed-origins",
                         "https://app.example.com,http://gpu-box.lan:3000")
    assert limits.allowed_hosts == ("gpu-box.lan", ".example.com")
    limits_of(server, monkeypatch, limits)
    with server.http() as http:
        for host in ("gpu-box.lan:8000", "example.com", "api.example.com", "localhost"):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("other.lan", "badexample.com"):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 403, host
        for page in ("https://app.example.com", "http://gpu-box.lan:3000", "http://localhost:3000"):
            assert http.get("/v1/models", headers={"Origin": page}).status_code == 200, page
        # the server's own page (its /docs) under a name it serves
        same = {"Host": "gpu-box.lan:8000", "Origin": "http://gpu-box.lan:8000"}
        assert http.get("/v1/models", headers=same).status_code == 200
        assert http.get("/v1/models", headers={"Origin": EVIL}).status_code == 403
    with realtime(server, host="api.example.com", origin="https://app.example.com") as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
    limits_of(server, monkeypatch, serve_flags("--allowed-hosts", "*", "--allowed-origins", "*"))
    with server.http() as http:
        assert http.get("/v1/models", headers={"Host": "evil.example", "Origin": EVIL}).status_code == 200


def test_a_public_bind_serves_any_host_unless_allowed_hosts_names_some(server, monkeypatch):
    """0.0.0.0's clients reach it by names the server cannot know: no Host check unless --allowed-hosts; the
    Origin check stays, and a page is not its own origin by a name only the wildcard lets in."""
    assert serve_flags() == ServerLimits()  # on loopback: this machine's names only
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    public = server_limits(args).for_bind(args.host)
    assert public.allowed_hosts == ("*",)
    limits_of(server, monkeypatch, public)
    with server.http() as http:
        assert http.get("/v1/models", headers={"Host": "gpu-box.lan"}).status_code == 200
        assert http.get("/v1/models", headers={"Host": "evil.example", "Origin": "http://evil.example"}
                        ).status_code == 403
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--allowed-hosts", "gpu-box.lan"])
    limits_of(server, monkeypatch, server_limits(args).for_bind(args.host))
    with server.http() as http:
        assert http.get("/v1/models", headers={"Host": "gpu-box.lan"}).status_code == 200
        assert http.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403


@pytest.mark.parametrize("flags, message", [
    (["--allowed-hosts", "gpu-box.lan:8000"], "without scheme or port"),
    (["--allowed-hosts", "http://gpu-box.lan"], "without scheme or port"),
    (["--allowed-origins", "app.example.com"], "scheme://host[:port]"),
    (["--allowed-origins", "https://app.example.com/page"], "scheme://host[:port]"),
])
def test_a_malformed_allowed_host_or_origin_is_refused_at_startup(flags, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        serve_flags(*flags)


def test_the_openai_client_works_against_the_default_server(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [server.state.model_name]
    with open(AUDIO / "fox.wav", "rb") as f:
        assert "fox" in client.audio.transcriptions.create(model="whisper-1", file=f).text.lower()


def test_models_name_the_checkpoint_not_where_it_lies(server):
    """/v1/models gave the checkpoint's full path (`root`): where the server keeps its files, whose they are."""
    with server.http() as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == default_model_path().name and "/" not in json.dumps(card)


def test_an_api_key_on_the_command_line_is_warned_of(capsys, monkeypatch):
    """Every user of the machine reads a command line (`ps`); the key belongs in ENCDEC_API_KEY."""
    monkeypatch.delenv("ENCDEC_API_KEY", raising=False)
    assert server_limits(build_parser().parse_args(["serve", "--api-key", "k"])).api_key == "k"
    err = capsys.readouterr().err
    assert "warning: --api-key shows the key to every user" in err and "ENCDEC_API_KEY" in err
    monkeypatch.setenv("ENCDEC_API_KEY", "from-env")
    assert server_limits(build_parser().parse_args(["serve"])).api_key == "from-env"
    assert "warning" not in capsys.readouterr().err
    # the live client too (its server is not there: the command fails after the warning)
    assert main(["transcribe", "--live", "-", "--server", "http://127.0.0.1:1", "--api-key", "k"]) == 2
    assert "warning: --api-key shows the key" in capsys.readouterr().err
