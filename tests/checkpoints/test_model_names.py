"""Short model names (openai-whisper's tiny.en ... turbo) resolve offline: --model-dir, the checkout's models/,
the cache, the Hugging Face hub cache (a snapshot huggingface_hub itself recognizes), and the bundled tiny.en."""

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants  # the tests patch it: loaded here, not by whatever ran before
import pytest
from helpers import make_whisper

from encdec_engine.engine.loader import resolve_model_path
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.checkpoints.names import (WHISPER_NAMES, available_names, is_english_only, resolve_model_name)
from encdec_engine.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face hub cache for this test."""
    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    return hub


def test_openai_whisper_names_are_known():
    assert set(WHISPER_NAMES) == {"tiny.en", "tiny", "base.en", "base", "small.en", "small", "medium.en", "medium",
                                  "large-v1", "large-v2", "large-v3", "large", "large-v3-turbo", "turbo"}


def test_tiny_en_is_always_there(hub_cache):
    assert resolve_model_name("tiny.en") in (default_model_path(), ROOT / "models" / "whisper-tiny.en")
    assert resolve_model_path("tiny.en") == resolve_model_name("tiny.en")  # what LLM(model="tiny.en") loads
    assert is_english_only("tiny.en") and "tiny.en" in available_names()


def test_a_downloaded_hub_snapshot_is_found(tmp_path, hub_cache):
    """The layout huggingface_hub writes (models--org--name/snapshots/<commit>, refs/main), made with
    save_pretrained, recognized by huggingface_hub itself, then by the name `base`."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / "models--openai--whisper-base"
    make_whisper(repo / "snapshots" / commit, "tiny-80", vocab_size=51865)  # a multilingual vocabulary
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = Path(huggingface_hub.snapshot_download("openai/whisper-base", local_files_only=True))
    assert resolve_model_name("base") == snapshot == repo / "snapshots" / commit
    assert "base" in available_names() and is_english_only("base", snapshot) is False
    assert "base.en" not in available_names()


def test_model_dir_folders_and_aliases(tmp_path, hub_cache):
    model_dir = tmp_path / "models"
    make_whisper(model_dir / "whisper-large-v3-turbo", "tiny-80")
    assert resolve_model_name("turbo", model_dir) == model_dir / "whisper-large-v3-turbo"  # openai-whisper's alias
    assert resolve_model_name("large-v3-turbo", model_dir) == model_dir / "whisper-large-v3-turbo"
    assert is_english_only("turbo", model_dir / "whisper-large-v3-turbo")  # its vocabulary: 51864 ids
    assert available_names(model_dir) == ["tiny.en", "large-v3-turbo", "turbo"]
    (model_dir / "whisper-small").mkdir()  # a folder without weights is no checkpoint
    (model_dir / "whisper-small" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_name("small", model_dir)
    message = str(e.value)
    assert f"Looked in {model_dir / 'whisper-small'} and the Hugging Face cache (openai/whisper-small)" in message
    assert "Available: tiny.en, large-v3-turbo, turbo" in message


@pytest.mark.integration  # a subprocess of the engine
def test_cli_takes_a_short_name_offline(tmp_path):
    """`--model tiny.en` with the hub offline: resolved before loading, transcribed."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "encdec_engine.cli.main", "transcribe",
                        str(ROOT / "prompts" / "audio" / "coffee.wav"), "--model", "tiny.en", "-f", "txt"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "coffee with milk" in r.stdout and "coffee with milk" in (tmp_path / "coffee.txt").read_text()


def test_the_first_use_of_the_default_model_is_announced(tmp_path, monkeypatch, capsys):
    """With an empty cache the first transcription spends seconds importing the bundled model before its
    progress bar moves (4.2 s against 1.6 s warm on a 2-core Xeon): the CLI says so, once."""
    from encdec_engine.cache import IMPORT_MARKER
    from encdec_engine.checkpoints.names import first_import
    from encdec_engine.cli import args as cli_args

    folder = tmp_path / "whisper-tiny.en"
    assert first_import("tiny.en", tmp_path) == folder
    assert first_import("base", tmp_path) is None and first_import(str(tmp_path), tmp_path) is None
    monkeypatch.setattr(cli_args, "resolve", lambda *a, **k: folder)  # no import here: only the message
    args = build_parser().parse_args(["transcribe", "a.wav", "--model-dir", str(tmp_path)])
    cli_args.resolve_model(args)
    assert f"first use of tiny.en: importing the bundled model into {folder}" in capsys.readouterr().err
    folder.mkdir()
    (folder / IMPORT_MARKER).write_text("{}")  # an import is there (current or to refresh)
    assert first_import("tiny.en", tmp_path) is None
    cli_args.resolve_model(args)
    assert capsys.readouterr().err == ""
