"""Inputs an attacker would craft, each one that worked on an earlier main: media that makes the decoder
read the server's own files, output paths that leave the output folder, requests that make the server
allocate far more than they send, and errors that show the server's paths."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from servers import AUDIO, LiveServer

from encdec_engine.server.app import ServerLimits, build_app
from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.inputs import ffmpeg
from encdec_engine.inputs.audio import AudioError, load_audio

PLAYLISTS = {
    "ffconcat": "ffconcat version 1.0\nfile {target}\n",
    "concat list": "file '{target}'\n",
    "M3U/HLS": "#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{target}\n#EXT-X-ENDLIST\n",
    "PLS": "[playlist]\nFile1={target}\nNumberOfEntries=1\n",
}
CONTAINER_SUFFIXES = (".m4a", ".mp4", ".webm", ".mkv", ".avi", ".wma", ".mov")


@pytest.fixture(scope="module")
def playlists(tmp_path_factory) -> Path:
    """Playlists next to a WAV they point at (relative and absolute), under every container suffix."""
    folder = tmp_path_factory.mktemp("playlists")
    target = folder / "secret.wav"
    target.write_bytes((AUDIO / "fox.wav").read_bytes())
    for kind, text in PLAYLISTS.items():
        for suffix in CONTAINER_SUFFIXES:
            for how, ref in (("rel", "secret.wav"), ("abs", str(target))):
                (folder / f"{kind.split()[0].replace('/', '_')}-{how}{suffix}").write_text(text.format(target=ref))
    return folder


@pytest.fixture(scope="module")
def containers(tmp_path_factory) -> dict[str, Path]:
    """The same speech in each container ffmpeg decodes for us."""
    folder = tmp_path_factory.mktemp("containers")
    out = {}
    for suffix, codec in ((".m4a", "aac"), (".mp4", "aac"), (".webm", "libopus"), (".mkv", "libvorbis"),
                          (".avi", "pcm_s16le"), (".wma", "wmav2"), (".mov", "aac"), (".aac", "aac"),
                          (".ac3", "ac3"), (".caf", "pcm_s16le"), (".wv", "wavpack")):
        path = folder / f"fox{suffix}"
        subprocess.run(["ffmpeg", "-v", "error", "-i", str(AUDIO / "fox.wav"), "-c:a", codec, str(path)], check=True)
        out[suffix] = path
    return out


def test_every_playlist_is_refused_whatever_its_suffix(playlists):
    """The issue's case: `ffconcat version 1.0\\nfile some/path.wav` saved as x.m4a used to decode the WAV."""
    files = sorted(playlists.glob("*-*.*"))
    assert len(files) == len(PLAYLISTS) * len(CONTAINER_SUFFIXES) * 2
    for path in files:
        with pytest.raises(AudioError, match="playlist|concat list") as e:
            load_audio(path, name=path.name)
        assert "refer to other files" in str(e.value) and str(path.parent) not in str(e.value)


def test_each_container_is_decoded_by_the_demuxer_its_bytes_name(containers):
    reference = load_audio(AUDIO / "fox.wav")
    for suffix, path in containers.items():
        samples = load_audio(path)
        assert abs(len(samples) - len(reference)) < 0.1 * len(reference), suffix
    head = {suffix: path.read_bytes()[:ffmpeg.HEADER_BYTES] for suffix, path in containers.items()}
    assert {s: ffmpeg.sniff(h, s) for s, h in head.items()} == {
        ".m4a": "mov", ".mp4": "mov", ".mov": "mov", ".webm": "matroska", ".mkv": "matroska", ".avi": "avi",
        ".wma": "asf", ".aac": "aac", ".ac3": "ac3", ".caf": "caf", ".wv": "wv"}


def test_unknown_bytes_are_refused_naming_the_formats_decoded(tmp_path):
    path = tmp_path / "noise.m4a"
    path.write_bytes(b"\x00\x01garbage that no container starts with")
    with pytest.raises(AudioError, match=r"noise.m4a is not in an audio format this engine decodes \(WAV, "):
        load_audio(path)


@pytest.fixture(scope="module")
def whisper_server():
    server = LiveServer(build_app(str(default_model_path()), kv_cache_space_gb=0.1,
                                  limits=ServerLimits(max_upload_mb=2.0, max_audio_seconds=60.0)))
    yield server
    server.stop()


def test_a_container_is_decoded_whatever_its_name_says(containers, tmp_path):
    """An m4a called "blob" (what a browser's MediaRecorder upload is often called) or "x.dat": ffmpeg
    names the format by the bytes. It was refused by its suffix (the CLI) or took a 429 (the server)."""
    reference = load_audio(AUDIO / "fox.wav")
    for name in ("blob", "x.dat"):
        path = tmp_path / name
        path.write_bytes(containers[".m4a"].read_bytes())
        assert abs(len(load_audio(path)) - len(reference)) < 0.1 * len(reference), name


def test_an_upload_named_for_nothing_is_transcribed_and_text_is_a_400(whisper_server, containers):
    with whisper_server.http() as http:
        r = http.post("/v1/audio/transcriptions", files={"file": ("blob", containers[".webm"].read_bytes())},
                      data={"model": "whisper-1"})
        assert r.status_code == 200 and "fox" in r.json()["text"].lower(), r.text
        r = http.post("/v1/audio/transcriptions", files={"file": ("notes", b"these are my notes\n" * 40)},
                      data={"model": "whisper-1"})
        assert r.status_code == 400 and "not in an audio format" in r.json()["error"]["message"], r.text
    whisper_server.assert_clean()


def test_a_huge_bad_field_is_not_quoted_back_whole(whisper_server):
    """A 900 KB chunking_strategy was echoed in its 400: a 900 KB answer to a bad field."""
    with whisper_server.http() as http:
        r = http.post("/v1/audio/transcriptions", files={"file": ("weather.wav", (AUDIO / "weather.wav").read_bytes())},
                      data={"model": "whisper-1", "chunking_strategy": "z" * 900_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chunking_strategy"
    assert len(r.content) < 3000 and "the message was cut at 2000" in r.json()["error"]["message"]
    whisper_server.assert_clean()


def test_an_uploaded_playlist_gets_a_400_naming_it_and_no_transcript(whisper_server, playlists):
    """The server used to answer with the transcript of a file on its own disk."""
    with whisper_server.http() as http:
        for suffix in CONTAINER_SUFFIXES:
            for how in ("rel", "abs"):
                name = f"ffconcat-{how}{suffix}"
                r = http.post("/v1/audio/transcriptions", files={"file": (name, (playlists / name).read_bytes())},
                              data={"model": "whisper-1", "response_format": "text"})
                assert r.status_code == 400, (name, r.text)
                error = r.json()["error"]
                assert f"{name} is an ffconcat playlist" in error["message"] and error["param"] == "file"
    whisper_server.assert_clean()


def test_an_undecodable_upload_names_the_clients_file_never_a_server_path(whisper_server):
    fake_mp4 = b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64  # an MP4 header and nothing behind it
    with whisper_server.http() as http:
        r = http.post("/v1/audio/transcriptions", files={"file": ("call.m4a", fake_mp4)}, data={"model": "whisper-1"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "call.m4a" in message, r.text
    assert "/tmp" not in message and "/" not in message.replace("MP4/M4A/MOV", ""), message
    whisper_server.assert_clean()


@pytest.mark.integration  # a subprocess of the engine
def test_the_cli_refuses_a_playlist_naming_it(playlists, tmp_path):
    from helpers import encdec

    r = encdec("transcribe", str(playlists / "ffconcat-rel.m4a"), "--output-dir", str(tmp_path), "--quiet")
    assert r.returncode == 1 and "ffconcat-rel.m4a is an ffconcat playlist" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("output", ["/tmp/escaped", "../escaped", "calls/../../escaped", "~/escaped", "C:/escaped",
                                    "a\\..\\escaped", ".", "./"])
def test_a_manifest_output_outside_the_output_folder_is_refused(tmp_path, output):
    import json

    from encdec_engine.distributed.inputs import audio_inputs

    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text(json.dumps({"audio": str(AUDIO / "fox.wav"), "output": output}) + "\n")
    with pytest.raises(ValueError, match=rf"jobs.jsonl:1: field 'output' .*{'names no file' if output in './/' else ''}"):
        audio_inputs(manifest=manifest)


def test_two_spellings_of_one_output_collide_before_any_work(tmp_path, monkeypatch):
    """`call` and `./call` used to be two outputs landing in one file (one transcript lost, and --resume
    counted both as done)."""
    import json

    from encdec_engine import distributed
    from encdec_engine.distributed.inputs import audio_inputs

    manifest = tmp_path / "jobs.jsonl"
    lines = [{"audio": str(AUDIO / "fox.wav"), "output": "call"}, {"audio": str(AUDIO / "coffee.wav"), "output": "./call"},
             {"audio": str(AUDIO / "stella.wav"), "output": "calls//2024/./one"}]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=r"would both be written as call\.\*"):
        audio_inputs(manifest=manifest)
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines[1:]))
    assert [i.output for i in audio_inputs(manifest=manifest)] == ["call", "calls/2024/one"]
    monkeypatch.setattr("encdec_engine.distributed.jobs.connect", lambda *a: pytest.fail("a cluster was started"))
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match="would both be written"):
        distributed.transcribe(manifest=manifest, output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


PART = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'


def _slow_upload(url: str, length: int, first: bytes, source: str = "127.0.0.2"):
    """A raw connection from `source` that sends an upload's headers and `first` body bytes, then stalls."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect((host, int(port)))
    sock.sendall(f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: localhost\r\nContent-Length: {length}\r\n"
                 "Content-Type: multipart/form-data; boundary=b\r\n\r\n".encode() + first)
    return sock


@pytest.fixture(scope="module")
def guarded_server():
    limits = ServerLimits(max_upload_mb=3.0, max_audio_memory_mb=16.0, max_client_audio_mb=4.0,
                          body_grace_s=1.5, min_body_kb_per_s=16.0, max_audio_seconds=60.0)
    server = LiveServer(build_app(str(default_model_path()), kv_cache_space_gb=0.1, limits=limits))
    yield server
    server.stop()


def test_stalled_uploads_hold_nothing_but_their_bytes_and_get_408(guarded_server):
    """The issue's case: 16 connections that send headers and 5 bytes kept every legitimate upload at 429
    as long as they stayed open. Now they hold 5 bytes each, the upload beside them is served, and each
    stalled one gets 408 once it falls under the minimum rate."""
    import time

    memory, wav = guarded_server.state.audio_memory, (AUDIO / "weather.wav").read_bytes()
    stalled = [_slow_upload(guarded_server.url, 2_900_000, b"--b\r\n") for _ in range(16)]
    try:
        deadline = time.monotonic() + 10
        while memory.used != 16 * 5:
            assert time.monotonic() < deadline, memory.used
            time.sleep(0.02)
        with guarded_server.http() as http:
            r = http.post("/v1/audio/transcriptions", files={"file": ("weather.wav", wav)}, data={"model": "whisper-1"})
        assert r.status_code == 200, r.text
        for sock in stalled:
            sock.settimeout(30)
            answer = sock.recv(65536).decode()
            assert answer.startswith("HTTP/1.1 408"), answer
            assert "request body too slow: 5 bytes in" in answer and "16 KB/s after the first 1.5 s" in answer
    finally:
        for sock in stalled:
            sock.close()
    guarded_server.assert_clean()


def test_one_address_cannot_hold_more_than_its_share(guarded_server):
    import time

    memory, wav = guarded_server.state.audio_memory, (AUDIO / "weather.wav").read_bytes()
    first = _slow_upload(guarded_server.url, 2_900_000, PART + b"\x00" * 2_500_000)
    try:
        deadline = time.monotonic() + 10
        while memory.used < 2_500_000:
            assert time.monotonic() < deadline, memory.used
            time.sleep(0.02)
        second = _slow_upload(guarded_server.url, 2_900_000, PART + b"\x00" * 2_000_000)
        second.settimeout(30)
        answer = second.recv(65536).decode()
        second.close()
        assert answer.startswith("HTTP/1.1 429") and "over the per-client limit of 4.0 MB" in answer, answer
        with guarded_server.http() as http:  # another address is served meanwhile
            r = http.post("/v1/audio/transcriptions", files={"file": ("weather.wav", wav)}, data={"model": "whisper-1"})
        assert r.status_code == 200, r.text
    finally:
        first.close()
    guarded_server.assert_clean()


def test_the_largest_allowed_upload_fits_one_client_and_one_that_never_fits_is_a_413():
    """Defaults: a 40-minute 48 kHz stereo MP3 (9.6 MB, 1.1 GB while it decodes) got a 429 ("retry") from
    the 1 GB per-client quarter, and so did any upload whose header said nothing (counted as an hour of
    48 kHz stereo); a request that can never fit is a 413, not a 429 the client retries."""
    from encdec_engine.server.errors import APIError
    from encdec_engine.server.limits import AudioMemory
    from encdec_engine.server.uploads import decode_peak_bytes, largest_upload_bytes

    limits = ServerLimits()
    largest = largest_upload_bytes(limits.max_body_bytes, limits.max_audio_seconds)
    memory = AudioMemory(int(limits.max_audio_memory_mb * 2**20), limits.max_client_audio_bytes(largest))
    assert memory.client_limit == largest  # above the quarter (1 GB), below the whole (4 GB)
    podcast, beside = memory.reserve("a"), memory.reserve("a")
    podcast.resize(decode_peak_bytes(9_600_000, 2400, 48000, 2, 80))
    with pytest.raises(APIError) as busy:  # a second one from the same address waits its turn
        beside.resize(decode_peak_bytes(9_600_000, 2400, 48000, 2, 80))
    assert busy.value.status == 429 and "per-client limit" in busy.value.message
    podcast.release()
    beside.release()
    never = memory.reserve("b")
    with pytest.raises(APIError) as refused:  # an hour of 96 kHz 8-channel audio
        never.resize(decode_peak_bytes(25_000_000, 3600, 96000, 8, 128))
    assert refused.value.status == 413 and refused.value.param == "file" and "send it shorter" in refused.value.message
    assert memory.used == 0


@pytest.fixture(scope="module")
def bart_server(bart_path):
    server = LiveServer(build_app(str(bart_path), limits=ServerLimits(max_request_tokens=4096), num_kv_blocks=256))
    yield server
    server.stop()


def test_one_small_request_cannot_ask_for_gigabytes(bart_server):
    """The issue's case: 256 prompts x n=16 x the model's length with 20 logprobs each made a 1.2 KB
    request produce a 50 MB response and +656 MB of server memory. Now it is refused at admission,
    naming the fields; logprobs stop at OpenAI's 5."""
    body = {"prompt": ["word " * 8] * 256, "n": 16, "max_tokens": 64, "logprobs": 5,
            "temperature": 1.0}
    with bart_server.http() as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        message = r.json()["error"]["message"]
        assert "256 prompts x 16 sequences (n/best_of) x max_tokens 64 x (1 + logprobs 5) = 1572864" in message
        assert "budget of 4096 per request" in message
        r = http.post("/v1/completions", json={**body, "logprobs": 20})
        assert r.status_code == 400 and "logprobs" in r.text, r.text
        r = http.post("/v1/completions", json={"prompt": ["word"] * 4, "n": 2, "max_tokens": 8, "logprobs": 5})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8, r.text
    bart_server.assert_clean()


@pytest.mark.parametrize("body", [
    {"prompt": "\ud800 hi"}, {"prompt": ["fine", "bad \udfff"]},
    {"prompt": {"encoder_prompt": "fine", "decoder_prompt": "\ud800"}}, {"prompt": "\ud800", "stream": True},
], ids=["text", "list", "decoder", "stream"])
def test_a_lone_surrogate_is_a_400_naming_it(bart_server, body):
    """JSON can carry "\\ud800", which no UTF-8 holds: the tokenizer raised a TypeError, a 500."""
    with bart_server.http() as http:
        r = http.post("/v1/completions", content=json.dumps({**body, "max_tokens": 2}),
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
    bart_server.assert_clean()


def test_every_endpoint_refuses_token_limits_past_the_model(whisper_server):
    """One rule on every endpoint: asking for more tokens than the model has positions is a 400 naming the
    field (the audio endpoints used to answer max_completion_tokens=10000000 with 200)."""
    with whisper_server.http() as http, open(AUDIO / "fox.wav", "rb") as f:
        r = http.post("/v1/audio/transcriptions", files={"file": ("fox.wav", f.read())},
                      data={"model": "whisper-1", "max_completion_tokens": "10000000"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_completion_tokens", r.text
    assert "plus the window's 2-token decoder prompt is more than the model's limit of 448 positions; ask for at " \
           "most 446" in error["message"]


def test_the_openapi_document_says_what_the_forms_and_bodies_take(whisper_server, bart_server):
    audio = whisper_server.http().get("/openapi.json").json()
    form = audio["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]["multipart/form-data"]
    fields = form["schema"]["properties"]
    assert not [name for name, field in fields.items() if "null" in str(field)]  # a form has no null
    assert fields["max_completion_tokens"]["maximum"] == 446 and "en" in fields["language"]["enum"]
    assert "de" not in fields["language"]["enum"]  # English-only tiny.en
    text = bart_server.http().get("/openapi.json").json()
    request = text["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["suffix"]["type"] == "null" and request["echo"]["anyOf"][0] == {"const": False, "type": "boolean"}
    assert {"type": "null"} in request["skip_special_tokens"]["anyOf"]  # null is taken (as the default)
    vocab = bart_server.engine.engine.input_processor.vocab_size
    assert request["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == vocab - 1
    with bart_server.http() as http:
        r = http.post("/v1/completions", json={"prompt": [5.0, 6.0], "max_tokens": 2.0, "skip_special_tokens": None})
        assert r.status_code == 200, r.text  # JSON Schema's integers include 2.0
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": "2"}).status_code == 400


def test_atomic_writes_reach_the_disk_before_and_after_the_rename(tmp_path, monkeypatch):
    """After a power loss `--resume` must never find an empty file where a finished transcript was: the
    data is synced before the rename, the rename (the folder) after it."""
    import os

    from encdec_engine import files

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", None)) or real_replace(a, b))
    files.write_atomically(tmp_path / "call.txt", "hello\n")
    assert events == [("fsync", False), ("replace", None), ("fsync", True)]
    assert (tmp_path / "call.txt").read_text() == "hello\n"


def test_a_ctranslate2_folder_is_imported_once_into_the_cache_never_written_into(tmp_path, monkeypatch):
    """It used to get a hidden `.encdec-hf` copy written into it (and JSON files rewritten in place at
    every start, while other workers read them)."""
    import shutil

    from encdec_engine.checkpoints.ct2 import importer as ct2_import

    src = tmp_path / "faster-whisper-tiny.en"
    shutil.copytree(bundled_model_dir(), src)
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    imports = []
    real = ct2_import.import_ct2_whisper
    monkeypatch.setattr(ct2_import, "import_ct2_whisper", lambda *a, **k: imports.append(a) or real(*a, **k))
    cache = tmp_path / "cache"
    first = ct2_import.cached_import(src, cache)
    assert ct2_import.cached_import(src, cache) == first and len(imports) == 1  # once, keyed by content
    assert first.parent == cache / "ct2" and (first / "model.safetensors").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before  # nothing written into src
    config = src / "config.json"
    config.write_text(config.read_text().replace("}", ', "note": 1}', 1))  # new content: a new import
    second = ct2_import.cached_import(src, cache)
    assert second != first and len(imports) == 2


def test_per_input_limits_refuse_before_decoding(tmp_path, make_llm, monkeypatch):
    """A worker used to take a 10-hour recording or a multi-GB "document" whole. Now an input over the
    limit is its own error, found from the header (audio) or the file size (text) before decoding."""
    import subprocess

    from encdec_engine.cli.main import main
    from encdec_engine.inputs import audio

    long_m4a, long_wav = tmp_path / "two-minutes.m4a", tmp_path / "two-minutes.wav"
    for path in (long_m4a, long_wav):
        subprocess.run(["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "sine=frequency=300:duration=120", "-ar", "16000",
                        "-ac", "1", str(path)], check=True)
    decoded = []
    real = ffmpeg.decode
    monkeypatch.setattr(ffmpeg, "decode", lambda *a, **k: decoded.append(a[1]) or real(*a, **k))
    llm = make_llm(default_model_path(), kv_cache_space_gb=0.1)
    results = llm.transcribe([str(long_m4a), str(long_wav), str(AUDIO / "fox.wav")], max_audio_seconds=60)
    assert [r.error for r in results[:2]] == [f"audio is 120.0 s long; the limit is 60 s: {p}" for p in (long_m4a, long_wav)]
    assert results[2].error is None and "fox" in results[2].text.lower() and decoded == []
    with pytest.raises(audio.AudioTooLong):
        audio.audio_samples((audio.load_audio(long_wav), 16000), max_seconds=60)

    big = tmp_path / "big.txt"
    big.write_text("word " * 1000)
    with pytest.raises(ValueError, match=r"big.txt is 5000 bytes, more than the limit of 4096 bytes"):
        from encdec_engine.inputs.documents import read_document

        read_document(big, 4096)
    assert main(["summarize", str(big), "--model", "unused", "--max-document-bytes", "4096"]) == 2
