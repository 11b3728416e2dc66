"""Every checkpoint layout transformers loads, served with HF's greedy tokens.

Random-init checkpoints of each architecture (models/configs/) are written with
`save_pretrained`; each layout is then made by editing the files as real checkpoints
differ: no or a minimal generation_config.json, one marked `_from_model_config`
(transformers then drops Whisper's fields), PyTorch `.bin` weights, shards with an
index, fp16/bf16 weights, untied output heads, slow tokenizer files only, a Whisper
tokenizer without timestamp tokens. Every layout must load and give HF `generate`'s
greedy tokens; Whisper is compared with HF given the checkpoint's complete
generation config, on the same log-mel features.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import ROOT, hf_greedy, make_bart, make_bart_tokenizer, make_causal_lm, make_whisper
from safetensors.torch import load_file
from transformers import (AutoTokenizer, BartForConditionalGeneration, GenerationConfig, GPT2LMHeadModel,
                          LlamaForCausalLM, WhisperForConditionalGeneration)

from encdec_engine import SamplingParams
from encdec_engine.inputs.audio import load_audio
from encdec_engine.inputs.features import log_mel_spectrogram
from encdec_engine.speech.timestamp_rules import timestamp_rules_from_generation_config

AUDIO = ROOT / "prompts" / "audio"
CLIPS = ["fox.wav", "coffee.wav"]
TEXT_PROMPTS = ["The rain in spain falls mainly on the plain.", "Council report said the bridge", "a",
                {"prompt_token_ids": [5, 77, 300, 12, 9, 41]}]
MAX_TOKENS = 12
HF_CLASSES = {"bart": BartForConditionalGeneration, "gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM,
              "whisper": WhisperForConditionalGeneration}


# -- layouts: each edits a copy of the saved checkpoint ---------------------------------------

def _edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | fields, indent=2))


def no_generation_config(folder: Path) -> None:
    (folder / "generation_config.json").unlink()


def minimal_generation_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    fields = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    (folder / "generation_config.json").write_text(json.dumps({k: config[k] for k in fields if k in config}))


def from_model_config(folder: Path) -> None:
    _edit_json(folder / "generation_config.json", _from_model_config=True)


def _state_dict(folder: Path) -> dict[str, torch.Tensor]:
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    file.unlink()
    return tensors


def pytorch_bin(folder: Path) -> None:
    torch.save(_state_dict(folder), folder / "pytorch_model.bin")


def sharded_bin(folder: Path) -> None:
    """transformers 4's sharded .bin layout: pytorch_model-0000k-of-0000n.bin + pytorch_model.bin.index.json."""
    tensors, n = _state_dict(folder), 3
    names = sorted(tensors)
    weight_map = {}
    for k in range(n):
        shard = f"pytorch_model-{k + 1:05d}-of-{n:05d}.bin"
        torch.save({name: tensors[name] for name in names[k::n]}, folder / shard)
        weight_map |= {name: shard for name in names[k::n]}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _resave(folder: Path, **kwargs) -> None:
    """Save the checkpoint again with transformers (sharded or in another dtype)."""
    config = json.loads((folder / "config.json").read_text())
    model = HF_CLASSES[config["model_type"]].from_pretrained(folder, dtype=torch.float32)
    dtype = kwargs.pop("dtype", None)
    for file in folder.glob("*.safetensors"):
        file.unlink()
    (model.to(dtype) if dtype else model).save_pretrained(folder, **kwargs)


def sharded_safetensors(folder: Path) -> None:
    _resave(folder, max_shard_size="1MB")


def fp16(folder: Path) -> None:
    _resave(folder, dtype=torch.float16)


def bf16(folder: Path) -> None:
    _resave(folder, dtype=torch.bfloat16)


def slow_tokenizer(folder: Path) -> None:
    """tokenizer.json removed, leaving vocab.json + merges.txt (written from it where missing)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    if not (folder / "vocab.json").is_file():
        (folder / "vocab.json").write_text(json.dumps(data["model"]["vocab"]))
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
        (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (folder / "tokenizer.json").unlink()


def no_timestamp_tokens(folder: Path) -> None:
    """A Whisper tokenizer.json without <|0.00|> ... (CTranslate2 exports, older hub checkpoints)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"][2:3].isdigit()]
    path.write_text(json.dumps(data))


LAYOUTS: dict[str, Callable[[Path], None]] = {
    "saved": lambda folder: None,
    "no_generation_config": no_generation_config,
    "minimal_generation_config": minimal_generation_config,
    "from_model_config": from_model_config,
    "pytorch_bin": pytorch_bin,
    "sharded_bin": sharded_bin,
    "sharded_safetensors": sharded_safetensors,
    "fp16": fp16,
    "bf16": bf16,
    "slow_tokenizer": slow_tokenizer,
}
WHISPER_LAYOUTS = {**LAYOUTS, "no_timestamp_tokens": no_timestamp_tokens,
                   "slow_tokenizer_no_gc": lambda f: (slow_tokenizer(f), no_generation_config(f))}
# (checkpoint, architecture): the base checkpoints, tied and untied heads.
BASES = {"bart": "bart", "bart_untied": "bart", "gpt2": "gpt2", "gpt2_untied": "gpt2", "llama_untied": "llama",
         "llama_tied": "llama", "whisper": "whisper", "whisper_untied": "whisper"}
CASES = ([(base, layout) for base in ("bart", "gpt2", "llama_untied") for layout in LAYOUTS]
         + [("whisper", layout) for layout in WHISPER_LAYOUTS]
         + [(base, "saved") for base in ("bart_untied", "gpt2_untied", "llama_tied", "whisper_untied")])
# The default run: every Whisper generation-config and tokenizer layout, and each weight layout, dtype,
# tokenizer form and head once; the remaining combinations run with -m slow.
DEFAULT_CASES = {("whisper", layout) for layout in ("saved", "no_generation_config", "minimal_generation_config",
                                                    "from_model_config", "no_timestamp_tokens",
                                                    "slow_tokenizer_no_gc", "sharded_bin", "bf16")}
DEFAULT_CASES |= {("bart", "sharded_safetensors"), ("bart", "fp16"), ("bart", "slow_tokenizer"),
                  ("bart", "no_generation_config"), ("gpt2", "pytorch_bin"), ("gpt2", "slow_tokenizer"),
                  ("llama_untied", "sharded_safetensors"), ("llama_untied", "bf16")}
DEFAULT_CASES |= {(base, "saved") for base in ("bart_untied", "gpt2_untied", "llama_tied", "whisper_untied")}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    tok = make_bart_tokenizer(root / "tokenizer")
    return {
        "bart": make_bart(root / "bart", "small"),
        "bart_untied": make_bart(root / "bart_untied", "untied"),
        "gpt2": make_causal_lm(root / "gpt2", tok, "gpt2", "tiny"),
        "gpt2_untied": make_causal_lm(root / "gpt2_untied", tok, "gpt2", "odd"),
        "llama_untied": make_causal_lm(root / "llama_untied", tok, "llama", "gqa"),
        "llama_tied": make_causal_lm(root / "llama_tied", tok, "llama", "mqa"),
        "whisper": make_whisper(root / "whisper", "tiny-80"),
        "whisper_untied": make_whisper(root / "whisper_untied", "tiny-80", tie_word_embeddings=False),
    }


@pytest.fixture(scope="module")
def layout_folder(bases, tmp_path_factory) -> Callable[[str, str], Path]:
    root = tmp_path_factory.mktemp("variants")

    def make(base: str, layout: str) -> Path:
        folder = root / f"{base}-{layout}"
        if not folder.exists():
            shutil.copytree(bases[base], folder)
            WHISPER_LAYOUTS[layout](folder)
        return folder

    return make


@pytest.fixture(scope="module")
def features() -> torch.Tensor:
    return log_mel_spectrogram([load_audio(AUDIO / name) for name in CLIPS])


def hf_model(folder: Path, arch: str):
    return HF_CLASSES[arch].from_pretrained(folder, dtype=torch.float32).eval()  # fp16/bf16 files too


def decoder_only_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    return out[0, len(prompt_ids):].tolist()


def text_reference(folder: Path, arch: str, outs) -> list[list[int]]:
    """HF's greedy tokens for the engine's prompts."""
    hf = hf_model(folder, arch)
    if arch == "bart":
        return [hf_greedy(hf, o.encoder_prompt_token_ids, o.prompt_token_ids, MAX_TOKENS) for o in outs]
    return [decoder_only_greedy(hf, o.prompt_token_ids, MAX_TOKENS) for o in outs]


def whisper_reference(folder: Path, full_gc, features: torch.Tensor) -> dict[str, list[list[int]]]:
    """HF's greedy tokens given the complete generation config: the whole sequence without timestamps,
    the generated tokens with them (HF's return values)."""
    hf = hf_model(folder, "whisper")
    with torch.no_grad():
        plain = hf.generate(input_features=features, generation_config=full_gc, max_new_tokens=MAX_TOKENS,
                            return_dict_in_generate=True).sequences
        timed = hf.generate(input_features=features, generation_config=full_gc, max_new_tokens=MAX_TOKENS,
                            return_timestamps=True)
    return {"plain": unpad(plain, full_gc.pad_token_id), "timestamps": unpad(timed, full_gc.pad_token_id)}


def unpad(rows: torch.Tensor, pad: int) -> list[list[int]]:
    """HF's batch rows without the padding after a shorter row's EOS (Whisper pads with EOS)."""
    out = []
    for row in rows.tolist():
        out.append(row[: row.index(pad) + 1] if pad in row else row)
    return out


@pytest.fixture(scope="module")
def references(bases, features) -> Callable:
    """HF's tokens per checkpoint weights, made once: the layouts that only move the tensors between files
    share the base's, fp16/bf16 files get their own (HF reads the rounded weights from them)."""
    cache: dict = {}

    def get(base: str, layout: str, folder: Path, compute: Callable[[Path], object]):
        key = (base, layout if layout in ("fp16", "bf16") else "fp32")
        if key not in cache:
            cache[key] = compute(folder if key[1] != "fp32" else bases[base])
        return cache[key]

    return get


def check_text_parity(llm, arch: str, reference_tokenizer, reference: Callable) -> None:
    outs = llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    texts = [p for p in TEXT_PROMPTS if isinstance(p, str)]
    # Whatever files the tokenizer came from, it splits text as the fast tokenizer does.
    ours = [o.encoder_prompt_token_ids if arch == "bart" else o.prompt_token_ids for o in outs[: len(texts)]]
    assert ours == [reference_tokenizer(t)["input_ids"] for t in texts]
    assert [o.outputs[0].token_ids for o in outs] == reference(lambda folder: text_reference(folder, arch, outs))
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # not one repeated answer


def whisper_prompts(features: torch.Tensor) -> list[dict]:
    return [{"prompt": "", "multi_modal_data": {"input_features": f}} for f in features]


def check_whisper_parity(llm, full_gc, features: torch.Tensor, reference: Callable) -> None:
    """Greedy without timestamps (the checkpoint's suppression applied by default, as in HF), then
    with HF's timestamp rules, against HF given the complete generation config."""
    ref = reference(lambda folder: whisper_reference(folder, full_gc, features))
    outs = llm.generate(whisper_prompts(features), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert [o.prompt_token_ids + o.outputs[0].token_ids for o in outs] == ref["plain"]
    gc = llm.engine.generation_config
    timestamped = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                 logits_processors=[timestamp_rules_from_generation_config(gc)])
    sot = [llm.engine.hf_config.decoder_start_token_id]  # English-only, timestamp mode: no <|notimestamps|>
    outs = llm.generate([{"encoder_prompt": p, "decoder_prompt": {"prompt_token_ids": sot}}
                         for p in whisper_prompts(features)], timestamped, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref["timestamps"]
    assert all(o.outputs[0].token_ids[0] > gc.no_timestamps_token_id for o in outs)  # it did decode timestamps


def case_params(cases: list[tuple[str, str]]) -> list:
    """The default run keeps DEFAULT_CASES; the rest of the matrix is marked slow."""
    return [pytest.param(base, layout, id=f"{base}-{layout}",
                         marks=() if (base, layout) in DEFAULT_CASES else pytest.mark.slow) for base, layout in cases]


@pytest.mark.parametrize("base,layout", case_params(CASES))
def test_layout_loads_and_matches_hf_greedy(base, layout, bases, layout_folder, features, references, make_llm):
    folder = layout_folder(base, layout)
    arch = BASES[base]
    llm = make_llm(folder, num_kv_blocks=240)
    reference = lambda compute: references(base, layout, folder, compute)  # noqa: E731
    if arch == "whisper":
        check_whisper_parity(llm, GenerationConfig.from_pretrained(bases["whisper"]), features, reference)
        gc = llm.engine.generation_config
        assert (gc.no_timestamps_token_id, gc.prev_sot_token_id) == (50362, 50360)
        assert llm.get_tokenizer().convert_ids_to_tokens(50363) == "<|0.00|>"
    else:
        check_text_parity(llm, arch, AutoTokenizer.from_pretrained(bases[base]), reference)


# -- the two failures of issue 13, on the real tiny.en ----------------------------------------

@pytest.fixture(scope="module")
def tiny_en_reference(make_llm):
    from encdec_engine.checkpoints.ct2.importer import default_model_path

    path = default_model_path()
    return path, make_llm(path, num_kv_blocks=200)


def test_tiny_en_saved_by_transformers_with_from_model_config_loads(tiny_en_reference, tmp_path, make_llm):
    """transformers drops every Whisper field of a generation_config.json marked _from_model_config;
    the engine used to refuse such a checkpoint (no no_timestamps_token_id)."""
    path, reference = tiny_en_reference
    saved = tmp_path / "tiny.en"
    WhisperForConditionalGeneration.from_pretrained(path).save_pretrained(saved)
    AutoTokenizer.from_pretrained(path).save_pretrained(saved)
    from_model_config(saved)
    assert not hasattr(GenerationConfig.from_pretrained(saved), "no_timestamps_token_id")  # what HF sees
    llm = make_llm(saved, num_kv_blocks=200)
    options = dict(language="en", timestamps=False, temperatures=(0.0,))
    ours = llm.transcribe(AUDIO / "weather.wav", **options)[0]
    expected = reference.transcribe(AUDIO / "weather.wav", **options)[0]
    assert ours.error is None and ours.text == expected.text and ours.text.strip()
    assert llm.engine.generation_config.alignment_heads == reference.engine.generation_config.alignment_heads


def test_transcribe_with_timestamps_through_a_tokenizer_without_timestamp_tokens(tiny_en_reference, tmp_path,
                                                                                 make_llm):
    """A tokenizer.json without <|0.00|> ... used to make the detokenizer raise inside the engine step."""
    path, reference = tiny_en_reference
    folder = tmp_path / "tiny.en-no-timestamps"
    folder.mkdir()
    for file in path.iterdir():
        (folder / file.name).symlink_to(file)
    (folder / "tokenizer.json").unlink()
    shutil.copy(path / "tokenizer.json", folder / "tokenizer.json")
    no_timestamp_tokens(folder)
    assert len(AutoTokenizer.from_pretrained(folder)) == 50363  # up to <|notimestamps|>
    llm = make_llm(folder, num_kv_blocks=200)
    ours = llm.transcribe(AUDIO / "weather.wav", language="en")[0]
    expected = reference.transcribe(AUDIO / "weather.wav", language="en")[0]
    assert ours.error is None and ours.segments
    assert [(s.start, s.end, s.text, s.tokens) for s in ours.segments] == \
        [(s.start, s.end, s.text, s.tokens) for s in expected.segments]
    raw = llm.generate({"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": load_audio_pair("weather.wav")}},
                        "decoder_prompt": {"prompt_token_ids": [50257]}},
                       SamplingParams(temperature=0.0, max_tokens=3, skip_special_tokens=False,
                                      logits_processors=[timestamp_rules_from_generation_config(
                                          llm.engine.generation_config)]), use_tqdm=False)[0]
    assert raw.outputs[0].text.startswith("<|0.00|>")  # the timestamp renders as with HF's full tokenizer


def load_audio_pair(name: str):
    return load_audio(AUDIO / name), 16000


# -- Llama with a SentencePiece tokenizer.model alone ------------------------------------------

def make_sentencepiece_llama(folder: Path) -> Path:
    """A random-init Llama whose only tokenizer file is a freshly trained SentencePiece tokenizer.model."""
    import sentencepiece
    from helpers import corpus

    folder.mkdir()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(400)), model_prefix=str(folder / "tokenizer"), vocab_size=500,
        model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    staging = make_causal_lm(folder.parent / "staging", tokenizer, "llama", "gqa")
    for file in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.move(staging / file, folder / file)
    return folder


def test_llama_with_a_sentencepiece_tokenizer_model_only(tmp_path, make_llm):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    folder = make_sentencepiece_llama(tmp_path / "llama-sp")
    assert not (folder / "tokenizer.json").exists()
    llm = make_llm(folder, num_kv_blocks=240)
    check_text_parity(llm, "llama", AutoTokenizer.from_pretrained(folder), lambda compute: compute(folder))


def test_a_tokenizer_the_install_cannot_read_names_the_file(tmp_path, monkeypatch, bases):
    from encdec_engine import LLM
    from encdec_engine.checkpoints import tokenizer_files

    folder = tmp_path / "llama"
    shutil.copytree(bases["llama_untied"], folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"")  # its bytes do not matter: the packages are missing
    monkeypatch.setattr(tokenizer_files, "_has_module", lambda name: False)
    with pytest.raises(ValueError, match=r"tokenizer\.model: reading a SentencePiece tokenizer needs the "
                                         r"sentencepiece and protobuf package"):
        LLM(model=str(folder), num_kv_blocks=16)
    (folder / "tokenizer.model").unlink()
    with pytest.raises(ValueError, match="no tokenizer files"):
        LLM(model=str(folder), num_kv_blocks=16)
    assert LLM(model=str(folder), num_kv_blocks=16, skip_tokenizer_init=True).get_tokenizer() is None


def test_the_matrix_counts_the_layouts_the_readme_states():
    assert (len(CASES), len(DEFAULT_CASES & set(CASES))) == (46, 20)


def test_openai_whisper_defaults_equal_tiny_en_generation_config(caplog):
    """With generation_config.json's Whisper fields taken away, the tokenizer and openai-whisper's rules
    give them back, and the loader says where each came from."""
    from encdec_engine.checkpoints.ct2.importer import default_model_path
    from encdec_engine.checkpoints.whisper.vocab import complete_whisper_generation_config
    from transformers import AutoConfig

    path = default_model_path()
    full = GenerationConfig.from_pretrained(path)
    bare = GenerationConfig(decoder_start_token_id=50257, eos_token_id=50256)
    with caplog.at_level("INFO", logger="encdec_engine"):
        complete_whisper_generation_config(bare, AutoConfig.from_pretrained(path),
                                           AutoTokenizer.from_pretrained(path), str(path))
    for field in ("suppress_tokens", "begin_suppress_tokens", "max_initial_timestamp_index", "no_timestamps_token_id",
                  "prev_sot_token_id", "is_multilingual"):
        assert getattr(bare, field) == getattr(full, field), field
    (record,) = [r for r in caplog.records if r.name.startswith("encdec_engine")]
    assert record.levelname == "WARNING"
    assert "no_timestamps_token_id, prev_sot_token_id, suppress_tokens from the tokenizer vocabulary" in record.message
    assert "max_initial_timestamp_index, suppress_tokens, begin_suppress_tokens from openai-whisper's decoding " \
           "defaults" in record.message


def test_fields_transformers_drops_are_read_from_the_json(bases, tmp_path):
    from encdec_engine.checkpoints.generation_config import load_generation_config
    from transformers import AutoConfig

    folder = tmp_path / "whisper"
    shutil.copytree(bases["whisper"], folder)
    from_model_config(folder)
    assert not hasattr(GenerationConfig.from_pretrained(folder), "no_timestamps_token_id")  # transformers drops it
    gc = load_generation_config(folder, AutoConfig.from_pretrained(folder))
    full = GenerationConfig.from_pretrained(bases["whisper"])
    assert (gc.no_timestamps_token_id, gc.alignment_heads, gc.max_initial_timestamp_index) == \
        (full.no_timestamps_token_id, full.alignment_heads, full.max_initial_timestamp_index)


# -- what cannot be served fails at load, naming the file and the field ------------------------
# (A head the config ties but the checkpoint holds apart is served untied, as transformers 5 serves
# it: tests/checkpoints/test_tie_rules.py.)

def _missing_shard(folder: Path) -> None:
    sharded_bin(folder)
    (folder / "pytorch_model-00002-of-00003.bin").unlink()


def _wrong_shape(folder: Path) -> None:
    _edit_json(folder / "config.json", n_inner=100)


def _unknown_whisper_vocabulary(folder: Path) -> None:
    no_generation_config(folder)
    (folder / "tokenizer.json").unlink()
    _edit_json(folder / "config.json", vocab_size=51870)


@pytest.mark.parametrize("base,edit,match", [
    ("gpt2", lambda f: (f / "generation_config.json").write_text("{not json"),
     r"generation_config\.json: not a readable JSON"),
    ("gpt2", _missing_shard, r"pytorch_model\.bin\.index\.json: weight_map names shard files that are not there: "
                             r"pytorch_model-00002-of-00003\.bin"),
    ("gpt2", _wrong_shape, r"the weights \(model\.safetensors\) do not fit config\.json: weight h\.0\.mlp\.c_fc\.\w+: "),
    ("whisper", _unknown_whisper_vocabulary, r"no no_timestamps_token_id, the tokenizer has no <\|notimestamps\|> "
                                             r"token, and config\.json vocab_size 51870 is none of openai-whisper"),
], ids=["bad_generation_config", "missing_shard", "wrong_shape", "unknown_whisper_vocab"])
def test_a_checkpoint_that_cannot_be_served_is_refused_naming_the_file(base, edit, match, bases, tmp_path):
    from encdec_engine import LLM

    folder = tmp_path / base
    shutil.copytree(bases[base], folder)
    edit(folder)
    with pytest.raises(ValueError, match=match):
        LLM(model=str(folder), num_kv_blocks=240, skip_tokenizer_init=base == "whisper")


def test_ids_past_the_tokenizer_decode_to_no_text(bases):
    """A vocabulary padded past its tokenizer: such an id adds no text (vLLM), instead of failing the step."""
    from encdec_engine.engine.detokenizer import Detokenizer
    from encdec_engine.engine.sequence_group import Sequence

    tokenizer = AutoTokenizer.from_pretrained(bases["gpt2"])
    seq = Sequence(0, [5])
    detokenizer = Detokenizer(tokenizer)
    text = []
    for token in [*tokenizer.encode(" rain", add_special_tokens=False), len(tokenizer) + 7,
                  *tokenizer.encode(" falls", add_special_tokens=False)]:
        seq.append_token(token, 0.0, None)
        text.append(detokenizer.step(seq, skip_special_tokens=True))
    assert text == [" rain", "", " falls"]


@pytest.mark.parametrize("vocab_size,expected", [
    (51864, dict(multilingual=False, languages=99, sot_prev=50360, no_timestamps=50362)),  # tiny.en ... medium.en
    (51865, dict(multilingual=True, languages=99, sot_prev=50361, no_timestamps=50363, en=50259, transcribe=50359,
                 translate=50358)),  # tiny ... large-v2
    (51866, dict(multilingual=True, languages=100, sot_prev=50362, no_timestamps=50364, en=50259, transcribe=50360,
                 translate=50359, yue=50358)),  # large-v3
])
def test_openai_whisper_layout_without_tokenizer_or_generation_config(vocab_size, expected):
    """The ids of HF's own generation configs for these vocabularies, from the vocabulary size alone."""
    from encdec_engine.checkpoints.whisper.vocab import complete_whisper_generation_config
    from transformers import WhisperConfig

    config = WhisperConfig(vocab_size=vocab_size, decoder_start_token_id=50257 + (vocab_size > 51864))
    gc = GenerationConfig()
    complete_whisper_generation_config(gc, config, None, "test")
    assert gc.is_multilingual == expected["multilingual"]
    assert (gc.prev_sot_token_id, gc.no_timestamps_token_id) == (expected["sot_prev"], expected["no_timestamps"])
    assert gc.suppress_tokens is None  # openai-whisper's symbol list needs the tokenizer
    if expected["multilingual"]:
        assert len(gc.lang_to_id) == expected["languages"] and gc.lang_to_id["<|en|>"] == expected["en"]
        assert gc.task_to_id == {"transcribe": expected["transcribe"], "translate": expected["translate"]}
        assert gc.lang_to_id.get("<|yue|>") == expected.get("yue")
