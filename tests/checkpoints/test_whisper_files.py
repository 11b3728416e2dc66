"""A Whisper checkpoint read without transformers gives what transformers reads from the same files.

The engine reads Whisper's config.json, generation_config.json, tokenizer.json and mel filters
itself (transformers' import costs about a second of every start). Each reader is checked here
against transformers on files transformers wrote (`save_pretrained`) and on the layouts published
checkpoints have; and a whole transcription, CLI included, is checked not to import transformers.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, make_bart
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, WhisperConfig
from transformers.audio_utils import mel_filter_bank as hf_mel_filter_bank
from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

from encdec_engine.engine.loader import read_model_config
from encdec_engine.checkpoints.whisper import languages as whisper_languages
from encdec_engine.checkpoints.ct2.importer import default_model_path
from encdec_engine.checkpoints.generation_config import GENERATION_FIELDS, load_generation_config
from encdec_engine.checkpoints.model_config import WHISPER_ALIASES, WHISPER_DEFAULTS, ModelConfig
from encdec_engine.checkpoints.tokenizer_files import load_tokenizer
from encdec_engine.checkpoints.whisper.tokenizer import WhisperTextTokenizer, read_whisper_tokenizer
from encdec_engine.inputs.features import mel_filter_bank

TEXTS = ["Hello world.", " Hello world.", "  spaced  out ", "ÀÉÎ ünïcödé — “quotes” 日本語", "don't won't I'm",
         "<|endoftext|> in text", "Numbers 1,234.56 and $7", ""]


@pytest.fixture(scope="module")
def tiny_en_files() -> Path:
    return default_model_path()


def test_language_tables_are_transformers():
    assert list(whisper_languages.LANGUAGES.items()) == list(LANGUAGES.items())
    assert whisper_languages.TO_LANGUAGE_CODE == TO_LANGUAGE_CODE


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_are_transformers_bit_for_bit(n_mels):
    hf = hf_mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0, max_frequency=8000.0,
                            sampling_rate=16000, norm="slaney", mel_scale="slaney")
    assert np.array_equal(mel_filter_bank(n_mels), hf.T)


# -- config.json --------------------------------------------------------------------------------

def _write_config(folder: Path, fields: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def test_whisper_defaults_are_transformers():
    hf = WhisperConfig().to_dict()
    assert {k: v for k, v in hf.items() if k not in ("transformers_version", "_name_or_path")} == WHISPER_DEFAULTS
    assert WhisperConfig.attribute_map == WHISPER_ALIASES


def _config_layouts(tmp: Path, tiny_en: Path) -> dict[str, Path]:
    saved = tmp / "saved"
    WhisperConfig(vocab_size=51865, num_mel_bins=128, encoder_layers=2, decoder_layers=3, d_model=64,
                  encoder_attention_heads=4, decoder_attention_heads=2, eos_token_id=[50256, 50257],
                  architectures=["WhisperForConditionalGeneration"]).save_pretrained(saved)
    return {
        "tiny.en": tiny_en,
        "save_pretrained": saved,
        # Older releases wrote only what differs from the defaults, with torch_dtype.
        "diff_only": _write_config(tmp / "diff", {"model_type": "whisper", "d_model": 512, "torch_dtype": "float16",
                                                  "decoder_layers": 6, "id2label": {"0": "a", "1": "b"},
                                                  "architectures": ["WhisperForConditionalGeneration"],
                                                  "forced_decoder_ids": [[1, 50259]], "transformers_version": "4.27",
                                                  "max_length": 448, "num_beams": 5, "suppress_tokens": [1, 2],
                                                  "custom_field": {"kept": True}}),
    }


def test_config_reads_as_autoconfig(tmp_path, tiny_en_files):
    for name, folder in _config_layouts(tmp_path, tiny_en_files).items():
        ours, hf = read_model_config(folder), AutoConfig.from_pretrained(folder)
        assert isinstance(ours, ModelConfig), name
        expected = {k: v for k, v in hf.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
        assert ours.to_dict() == expected, name
        for alias in WHISPER_ALIASES:
            assert getattr(ours, alias) == getattr(hf, alias), (name, alias)
    with pytest.raises(AttributeError, match="no 'not_a_field'"):
        read_model_config(tiny_en_files).not_a_field


def test_other_model_types_and_bad_files(tmp_path):
    bart = make_bart(tmp_path / "bart", "small")
    assert not isinstance(read_model_config(bart), ModelConfig)  # AutoConfig's
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken/config.json: not a readable JSON file"):
        read_model_config(tmp_path / "broken")


# -- generation_config.json ---------------------------------------------------------------------

def _hf_generation_config(folder: Path):
    if (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))


def _generation_layouts(tmp: Path, tiny_en: Path) -> dict[str, Path]:
    layouts = {"tiny.en": tiny_en}
    for name in ("no_file", "from_model_config", "minimal"):
        folder = tmp / name
        shutil.copytree(tiny_en, folder)
        path = folder / "generation_config.json"
        raw = json.loads(path.read_text())
        if name == "no_file":
            path.unlink()
        elif name == "from_model_config":
            path.write_text(json.dumps({**raw, "_from_model_config": True}))
        else:
            path.write_text(json.dumps({"decoder_start_token_id": 50257, "eos_token_id": 50256, "num_beams": 2}))
        layouts[name] = folder
    bart = make_bart(tmp / "bart", "small")
    bart_bare = tmp / "bart_bare"
    shutil.copytree(bart, bart_bare)
    (bart_bare / "generation_config.json").unlink()
    return {**layouts, "bart": bart, "bart_no_file": bart_bare}


def test_generation_settings_read_as_transformers(tmp_path, tiny_en_files):
    standard = set(GenerationConfig().to_dict()) - {"transformers_version", "_from_model_config"}
    assert set(GENERATION_FIELDS) <= standard
    for name, folder in _generation_layouts(tmp_path, tiny_en_files).items():
        ours, hf = load_generation_config(folder, read_model_config(folder)), _hf_generation_config(folder)
        for field in standard:
            assert getattr(ours, field, None) == getattr(hf, field), (name, field)
        path = folder / "generation_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        for key, value in raw.items():  # Whisper's own fields too, which transformers drops from some files
            if not key.startswith("_") and key != "transformers_version":
                assert getattr(ours, key) == value, (name, key)
        assert ours.to_dict()["max_new_tokens"] is None  # the fields tests save and restore


def test_generation_settings_legacy_bart_flag_and_bad_values(tmp_path):
    folder = make_bart(tmp_path / "bart", "small")
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "force_bos_token_to_be_generated": True}))
    hf = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    ours = load_generation_config(folder, read_model_config(folder))
    assert ours.forced_bos_token_id == hf.forced_bos_token_id == config["bos_token_id"]
    for field, value, kind in [("num_beams", "4", "a whole number"), ("eos_token_id", [2, "x"], "a token id or a list"),
                               ("early_stopping", "sometimes", 'true, false or "never"'), ("suppress_tokens", 5, "a list of token ids"),
                               ("max_length", -1, "a whole number >= 0"), ("length_penalty", True, "a number")]:
        (folder / "generation_config.json").write_text(json.dumps({"num_beams": 2, field: value}))
        with pytest.raises(ValueError, match=rf"generation_config.json: {field} must be {kind}"):
            load_generation_config(folder, read_model_config(folder))


# -- tokenizer ----------------------------------------------------------------------------------

def _edited(tiny_en: Path, folder: Path, edit) -> Path:
    """A copy of tiny.en's tokenizer.json and tokenizer_config.json in `folder`, after
    `edit(folder, settings, tokenizer)` changed their contents (and wrote any other file)."""
    folder.mkdir()
    settings = json.loads((tiny_en / "tokenizer_config.json").read_text())
    tokenizer = json.loads((tiny_en / "tokenizer.json").read_text())
    edit(folder, settings, tokenizer)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def _listed_added_tokens(tokenizer: dict) -> dict:
    """tokenizer.json's added tokens as tokenizer_config.json's added_tokens_decoder lists them."""
    return {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tokenizer["added_tokens"]}


def _prefixed(folder, settings, tokenizer):
    settings.update(language="English", task="transcribe", predict_timestamps=True)


def _hub_legacy(folder, settings, tokenizer):
    # The layout hub checkpoints saved by transformers 4 have: added tokens listed in
    # tokenizer_config.json, additional_special_tokens, a special_tokens_map.json.
    extra = settings.pop("extra_special_tokens")
    settings["additional_special_tokens"] = extra
    settings["added_tokens_decoder"] = _listed_added_tokens(tokenizer)
    settings["tokenizer_class"] = "WhisperTokenizerFast"
    (folder / "special_tokens_map.json").write_text(json.dumps({"additional_special_tokens": extra,
                                                                "eos_token": "<|endoftext|>"}))


def _no_timestamps(folder, settings, tokenizer):
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] <= 50362]


def _truncating(folder, settings, tokenizer):  # saved after a tokenizer(..., truncation=True, padding=...) call
    tokenizer["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    tokenizer["padding"] = {"strategy": {"Fixed": 12}, "direction": "Right", "pad_to_multiple_of": None,
                            "pad_id": 50256, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    settings["add_prefix_space"] = True


def _no_prompt_token(folder, settings, tokenizer):  # <|startofprev|> unknown: it reads as the unknown token
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<|startofprev|>"]
    settings["extra_special_tokens"] = [t for t in settings["extra_special_tokens"] if t != "<|startofprev|>"]


def _tokenizer_layouts(tmp: Path, tiny_en: Path) -> dict[str, Path]:
    edits = {"prefixed": _prefixed, "hub_legacy": _hub_legacy, "no_timestamps": _no_timestamps,
             "truncating": _truncating, "no_prompt_token": _no_prompt_token}
    return {"tiny.en": tiny_en, **{name: _edited(tiny_en, tmp / name, edit) for name, edit in edits.items()}}


def assert_same_tokenizer(ours, hf, name: str) -> None:
    assert (len(ours), ours.get_vocab(), ours.all_special_ids, ours.eos_token_id) == \
        (len(hf), hf.get_vocab(), hf.all_special_ids, hf.eos_token_id), name
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == \
                hf(text, add_special_tokens=special)["input_ids"], (name, text, special)
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    prev, sot = hf.convert_tokens_to_ids("<|startofprev|>"), hf.convert_tokens_to_ids("<|startoftranscript|>")
    assert ours.convert_tokens_to_ids(["<|startofprev|>", "<|not-a-token|>"]) == \
        hf.convert_tokens_to_ids(["<|startofprev|>", "<|not-a-token|>"])
    for _ in range(400):
        ids = [rng.choice([rng.randrange(50256), rng.randrange(50256, len(hf)), sot]) for _ in range(rng.randint(0, 24))]
        ids = [prev, *ids] if rng.random() < 0.3 else ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (name, ids)
        tokens = ours.convert_ids_to_tokens(ids)
        assert tokens == hf.convert_ids_to_tokens(ids)
        assert ours.convert_tokens_to_string(tokens) == hf.convert_tokens_to_string(tokens)
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            hf.convert_ids_to_tokens(ids, skip_special_tokens=True)


def test_tokenizer_reads_as_transformers(tmp_path, tiny_en_files):
    for name, folder in _tokenizer_layouts(tmp_path, tiny_en_files).items():
        ours, hf = read_whisper_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert isinstance(ours, WhisperTextTokenizer), name
        assert_same_tokenizer(ours, hf, name)
        if name == "no_timestamps":  # the loader gives both the timestamp tokens it lacks, at the same ids
            timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
            assert ours.add_tokens(timestamps) == hf.add_tokens(timestamps) == 1501
            assert_same_tokenizer(ours, hf, name + "+timestamps")


def _strip_around_sot(folder, settings, tokenizer):  # the config's added token differs from the file's
    settings["added_tokens_decoder"] = _listed_added_tokens(tokenizer)
    settings["added_tokens_decoder"]["50257"].update(lstrip=True, rstrip=True)


def _eot_not_added(folder, settings, tokenizer):  # a special token only in the BPE vocabulary: transformers adds it
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<|endoftext|>"]


def _model_specific_token(folder, settings, tokenizer):  # becomes a special token in transformers
    settings["prev_token"] = "<|startofprev|>"


def _named_extra_tokens(folder, settings, tokenizer):  # extra_special_tokens as a dict: model-specific names too
    settings["extra_special_tokens"] = {"sot_token": "<|startoftranscript|>"}


@pytest.mark.parametrize("edit", [_strip_around_sot, _eot_not_added, _model_specific_token, _named_extra_tokens])
def test_tokenizer_rules_not_repeated_go_to_transformers(tmp_path, tiny_en_files, edit):
    folder = _edited(tiny_en_files, tmp_path / "edited", edit)
    assert read_whisper_tokenizer(folder) is None
    assert not isinstance(load_tokenizer(folder), WhisperTextTokenizer)


def _legacy_special_tokens_map(folder, settings, tokenizer):
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def _other_class(folder, settings, tokenizer):
    settings["tokenizer_class"] = "GPT2Tokenizer"


def _unknown_language(folder, settings, tokenizer):
    settings["language"] = "klingon"


def test_tokenizer_layouts_left_to_transformers(tmp_path, tiny_en_files):
    legacy = _edited(tiny_en_files, tmp_path / "legacy", _legacy_special_tokens_map)
    assert read_whisper_tokenizer(legacy) is None
    assert not isinstance(load_tokenizer(legacy), WhisperTextTokenizer)  # transformers reads it
    assert read_whisper_tokenizer(_edited(tiny_en_files, tmp_path / "other_class", _other_class)) is None
    with pytest.raises(ValueError, match="tokenizer_config.json names language 'klingon'"):
        read_whisper_tokenizer(_edited(tiny_en_files, tmp_path / "bad_language", _unknown_language))


def test_get_tokenizer_is_transformers_with_the_same_ids(tiny_en_files):
    from encdec_engine import LLM

    llm = LLM(str(tiny_en_files), num_kv_blocks=64)
    engine_tokenizer = llm.engine.tokenizer
    assert isinstance(engine_tokenizer, WhisperTextTokenizer)
    hf = llm.get_tokenizer()
    assert type(hf).__name__ == "WhisperTokenizer" and llm.get_tokenizer() is hf
    assert len(hf) == len(engine_tokenizer) and hf.get_prompt_ids("Hi there.").tolist()[1:] == \
        engine_tokenizer.encode(" Hi there.", add_special_tokens=False)


@pytest.mark.integration  # a subprocess of the engine
def test_transcription_never_imports_transformers(tmp_path, tiny_en_files):
    """The main job (README): `encdec transcribe` with the bundled model, in a fresh process (the
    model imported already: the first import of the bundled CTranslate2 files writes it with transformers)."""
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('IMPORTED', sorted(m for m in sys.modules if m.split('.')[0] == "
              "'transformers')[:3], file=sys.stderr))\n"
              "from encdec_engine.cli.main import main\n"
              f"sys.argv = ['encdec', 'transcribe', {str(ROOT / 'prompts/audio/weather.wav')!r}, '-o', "
              f"{str(tmp_path)!r}, '-f', 'txt']\n"
              "main()\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TQDM_DISABLE": "1"})
    assert r.returncode == 0, r.stderr
    assert "IMPORTED []" in r.stderr, r.stderr[-2000:]
    assert "beautiful day" in (tmp_path / "weather.txt").read_text()
