"""What a SentencePiece checkpoint (T5, Marian, mBART, M2M100, Llama's tokenizer.model) does on an install
without the `[sentencepiece]` extra: a ValueError naming the file, the package and the pip line, from the
library and from `encdec translate`; and what loading Marian says about sacremoses: nothing, since
transformers never applies the Moses normalizer it recommends it for (same ids and text with or without)."""

import shutil
import sys
import types
import warnings

import pytest
from transformers import AutoTokenizer

from encdec_engine.checkpoints import tokenizer_files
from encdec_engine.checkpoints.tokenizer_files import load_tokenizer
from encdec_engine.cli.main import main

INSTALL = "pip install 'encdec-engine\\[sentencepiece\\]'"
TEXTS = ["The rain in spain falls mainly on the plain.", "\u201cQuoted\u201d \u2013 dashes \u2026 and  spaces ,here !",
         "Gr\u00f6\u00dfer Caf\u00e9, d\u00e9j\u00e0 vu! \u00d6l \u00fcber Stra\u00dfe.", ""]


@pytest.fixture
def without_sentencepiece(monkeypatch):
    """The import check of tokenizer_files sees no sentencepiece package (protobuf is there)."""
    monkeypatch.setattr(tokenizer_files, "_has_module", lambda name: name != "sentencepiece")


@pytest.mark.parametrize("arch,marker,tokenizer_json_helps", [
    ("marian", "source.spm", False), ("t5", "spiece.model", True), ("m2m100", "sentencepiece.bpe.model", False),
])
def test_a_sentencepiece_layout_without_the_package_names_the_extra(arch, marker, tokenizer_json_helps, text_model,
                                                                     without_sentencepiece):
    folder = text_model(arch, hub_layout=True)
    with pytest.raises(ValueError) as raised:
        load_tokenizer(folder)
    message = str(raised.value)
    assert message.startswith(f"{folder / marker}: reading a SentencePiece tokenizer needs the sentencepiece "
                              "package, which is not installed: pip install 'encdec-engine[sentencepiece]'")
    assert ("tokenizer.json" in message) == tokenizer_json_helps  # Marian and M2M100 have no such form


def test_translate_without_the_package_exits_2_naming_the_extra(text_model, without_sentencepiece, tmp_path, capsys):
    doc = tmp_path / "notes.txt"
    doc.write_text("The rain in spain.\n", encoding="utf-8")
    folder = text_model("marian")  # save_pretrained's Marian layout is the hub's: source.spm, target.spm, vocab.json
    capsys.readouterr()  # the fixture's own output
    assert main(["translate", str(doc), "--model", str(folder), "--to", "de", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "source.spm" in err and "pip install 'encdec-engine[sentencepiece]'" in err


def test_transformers_sentencepiece_import_error_becomes_the_same_message(text_model, without_sentencepiece,
                                                                          monkeypatch, tmp_path):
    """A Marian folder with a tokenizer.json passes the file check, but MarianTokenizer still needs the package:
    transformers' ImportError (its install page) becomes ours; any other ImportError passes through."""
    folder = tmp_path / "marian"
    shutil.copytree(text_model("marian"), folder)
    (folder / "tokenizer.json").write_text("{}")

    def failing(message: str):
        def from_pretrained(*args, **kwargs):
            raise ImportError(message)
        return from_pretrained

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", failing(
        "\nMarianTokenizer requires the SentencePiece library but it was not found in your environment."))
    with pytest.raises(ValueError, match=f"{folder}: reading a SentencePiece tokenizer needs the sentencepiece "
                                         f"package, which is not installed: {INSTALL}$"):
        load_tokenizer(folder)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", failing("this tokenizer needs tiktoken"))
    with pytest.raises(ImportError, match="tiktoken"):
        load_tokenizer(folder)


def _load_marian(folder, loader, caplog) -> tuple[object, list[str]]:
    """The tokenizer `loader` gives, and every warning and log line said while it loaded."""
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokenizer = loader(folder)
    return tokenizer, [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]


def test_loading_marian_says_nothing_about_sacremoses(text_model, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "sacremoses", None)  # absent, as in a plain install
    folder = text_model("marian")
    caplog.set_level("DEBUG")
    _, said = _load_marian(folder, AutoTokenizer.from_pretrained, caplog)
    assert any("sacremoses" in line for line in said)  # transformers alone does warn
    _, said = _load_marian(folder, load_tokenizer, caplog)
    assert not any("sacremoses" in line for line in said), said


def test_marian_ids_and_text_are_the_same_with_sacremoses(text_model, monkeypatch, caplog):
    """Why the warning may be dropped: with sacremoses present MarianTokenizer builds its punctuation
    normalizer, but encode and decode never call it. A stand-in normalizer that would change every text
    leaves the ids and the decoded text as they are without the package."""
    folder = text_model("marian", "multilingual")
    monkeypatch.setitem(sys.modules, "sacremoses", None)
    plain, _ = _load_marian(folder, load_tokenizer, caplog)
    normalizer = types.SimpleNamespace(normalize=lambda text: "NORMALIZED " + text.replace("\u201c", '"'))
    monkeypatch.setitem(sys.modules, "sacremoses", types.SimpleNamespace(MosesPunctNormalizer=lambda lang: normalizer))
    moses, _ = _load_marian(folder, load_tokenizer, caplog)
    assert moses.punc_normalizer is normalizer.normalize  # the stand-in was taken
    for text in TEXTS + [">>fr<< " + TEXTS[0]]:
        ids = plain(text)["input_ids"]
        assert moses(text)["input_ids"] == ids, text
        assert moses.decode(ids, skip_special_tokens=True) == plain.decode(ids, skip_special_tokens=True)
        assert moses(text_target=text)["input_ids"] == plain(text_target=text)["input_ids"], text
