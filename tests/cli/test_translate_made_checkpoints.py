"""The newcomer's offline path to `encdec translate` (docs/models.md, docs/cli.md): scripts/make_checkpoints.py
writes random-init T5 and Marian folders with their tokenizers, and `encdec translate` runs on each (the
words are noise; one line out per line in is what counts)."""

import runpy
import sys
from pathlib import Path

import pytest

from encdec_engine.cli.main import main

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_checkpoints.py"
ONLY_TEXT = ["--no-tiny-en", "--bart", "", "--gpt2", "", "--llama", ""]


def make_checkpoints(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    runpy.run_path(str(SCRIPT), run_name="__main__")


def test_made_t5_and_marian_translate(monkeypatch, tmp_path, capsys):
    make_checkpoints(monkeypatch, "--out", str(tmp_path), *ONLY_TEXT, "--t5", "small", "--marian", "small")
    made = capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marian-small", "t5-small"]
    assert "sacremoses" not in made.err
    notes = tmp_path / "notes.txt"
    notes.write_text("The rain in Spain falls mainly on the plain.\n\nThe council met on Monday.\n", encoding="utf-8")
    for folder in ("t5-small", "marian-small"):
        args = ["translate", str(notes), "--model", str(tmp_path / folder), "--to", "de", "--max-tokens", "6",
                "--quiet", "--threads", "2"]
        assert main(args) == 0, folder
        out = capsys.readouterr()
        lines = out.out.split("\n")
        assert len(lines) == 4 and lines[0] and lines[1] == "" and lines[2] and lines[3] == "", (folder, lines)
        assert "sacremoses" not in out.err


def test_without_sentencepiece_the_script_names_the_extra_before_building(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # find_spec: not installed
    with pytest.raises(SystemExit) as exited:
        make_checkpoints(monkeypatch, "--out", str(tmp_path), *ONLY_TEXT, "--marian", "small")
    assert exited.value.code == 2
    assert "pip install 'encdec-engine[sentencepiece]'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
