"""Models by name or hub id, downloaded from a stand-in for the Hugging Face hub on loopback (tests/fake_hub.py)
with huggingface_hub's own client: into the standard cache, only the files the engine reads, resuming an
interrupted download; offline (or --no-download) the error names the hub id and the command that fetches
it; a CTranslate2 repository is imported into the engine's cache; and a transcription through a model
downloaded by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
from fake_hub import FakeHub
from helpers import AUDIO, make_whisper

from encdec_engine.checkpoints import hub
from encdec_engine.checkpoints.ct2 import importer as ct2_import
from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.checkpoints.names import resolve
from encdec_engine.cli.main import main


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repos")
    base = make_whisper(root / "whisper-base", "tiny-80", vocab_size=51865)
    for extra in ("flax_model.msgpack", "tf_model.h5", "pytorch_model.bin"):  # what the engine must not fetch
        (base / extra).write_bytes(b"not for us" * 100)
    ct2 = root / "faster-whisper-tiny.en"
    shutil.copytree(bundled_model_dir(), ct2)
    return {"openai/whisper-base": base, "Systran/faster-whisper-tiny.en": ct2,
            "openai/whisper-tiny": default_model_path()}  # tiny.en's weights, served as "tiny"


@pytest.fixture
def fake_hub(repos, tmp_path, monkeypatch):
    server = FakeHub(repos)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)  # what $HF_ENDPOINT sets at import
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("ENCDEC_CACHE", str(tmp_path / "engine-cache"))
    yield server
    server.stop()


def test_a_name_downloads_what_the_engine_reads_into_the_standard_cache(fake_hub, tmp_path, capsys):
    assert main(["download", "base"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder.is_relative_to(tmp_path / "hub" / "models--openai--whisper-base" / "snapshots")
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert not any((folder / f).exists() for f in ("flax_model.msgpack", "tf_model.h5", "pytorch_model.bin"))
    fetched = len(fake_hub.requests)
    assert resolve("base") == folder and resolve("openai/whisper-base") == folder  # now found, not fetched
    assert len(fake_hub.requests) == fetched


def test_an_interrupted_download_resumes_where_it_stopped(fake_hub, repos, monkeypatch):
    """The weights' download is cut halfway (a dropped connection): huggingface_hub asks for the rest only
    (an HTTP Range from where it stopped) and the file ends whole. Cut every time, the error names the hub
    id and the command. (Chunks of 64 KB here: a real model's file is far larger than the client's 10 MB.)"""
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    monkeypatch.setattr("time.sleep", lambda seconds: None)  # the client's pause between attempts
    weights = "openai/whisper-base/model.safetensors"
    fake_hub.cuts[weights] = 1000
    with pytest.raises(FileNotFoundError, match=r"model 'base' is not on this machine \(openai/whisper-base on the "
                                                r"Hugging Face hub\) and could not be downloaded .*encdec download base"):
        resolve("base")
    fake_hub.cuts[weights] = 2
    asked = len(fake_hub.requests)
    folder = resolve("base")
    ranges = [r for m, path, r in fake_hub.requests[asked:] if path == "model.safetensors" and m == "GET"]
    assert ranges[0] is None and len(ranges) == 3 and all(r is not None and int(r[6:].split("-")[0]) > 0
                                                          for r in ranges[1:])  # each retry asks for the rest
    assert (folder / "model.safetensors").read_bytes() == (repos["openai/whisper-base"] / "model.safetensors").read_bytes()


def test_offline_the_error_names_the_hub_id_and_the_command(fake_hub, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.DownloadsOff, match=r"model 'small' is not on this machine \(openai/whisper-small on the "
                                               r"Hugging Face hub\) and downloads are off \(\$HF_HUB_OFFLINE\); fetch "
                                               r"it once where the network allows with: encdec download small"):
        resolve("small")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert main(["transcribe", str(AUDIO / "fox.wav"), "--model", "base", "--no-download", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "downloads are off (--no-download)" in err and "encdec download base" in err and err.count("\n") == 1
    assert fake_hub.requests == []  # nothing was asked of the hub
    with pytest.raises(FileNotFoundError, match="no repository 'nobody/nothing' on the Hugging Face hub"):
        resolve("nobody/nothing")


def test_a_ctranslate2_repository_is_imported_into_the_engine_cache(fake_hub, tmp_path):
    folder = resolve("Systran/faster-whisper-tiny.en")
    assert folder.is_relative_to(tmp_path / "engine-cache" / "ct2") and (folder / "model.safetensors").is_file()
    snapshot = hub.cached("Systran/faster-whisper-tiny.en")
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in bundled_model_dir().iterdir())


def test_transcribing_with_a_model_downloaded_by_name(fake_hub, tmp_path, make_llm, capsys):
    out = tmp_path / "out"
    assert main(["transcribe", str(AUDIO / "fox.wav"), "--model", "tiny", "-o", str(out), "-f", "txt", "--quiet"]) == 0
    expected = make_llm(default_model_path(), kv_cache_space_gb=0.1).transcribe([AUDIO / "fox.wav"])[0].text
    assert (out / "fox.txt").read_text().strip() == expected.strip() and expected.strip()
    assert any(path == "model.safetensors" for _, path, _ in fake_hub.requests)
