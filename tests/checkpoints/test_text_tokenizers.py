"""The text family's tokenizers as the engine reads them: the hub's SentencePiece-only layouts give what
transformers gives on tokenizer.json (encodings, decodings, special ids), the engine's incremental text is
transformers' decode, every language code resolves to the token transformers uses, and a layout with a
file missing is refused naming it."""

import shutil

import pytest
from transformers import AutoTokenizer

from encdec_engine import SamplingParams
from encdec_engine.checkpoints import tokenizer_files
from encdec_engine.checkpoints.tokenizer_files import load_tokenizer
from encdec_engine.translation.conventions import translation_convention
from encdec_engine.translation.languages import LANGUAGES

TEXTS = ["The rain in spain falls mainly on the plain.", "Größer Café, déjà vu! Öl über Straße.",
         "  spaces   and\ttabs  ", "Unknown ✓ symbols ☃ and 123 digits", ">>fr<< a target token first"]
FAMILIES = [("t5", "small"), ("mbart", "small"), ("marian", "multilingual"), ("m2m100", "small"), ("m2m100", "nllb")]


@pytest.mark.parametrize("arch,name", FAMILIES, ids=[f"{a}-{n}" for a, n in FAMILIES])
def test_hub_layout_reads_as_transformers_reads_tokenizer_json(arch, name, text_model):
    saved, hub = text_model(arch, name), text_model(arch, name, hub_layout=True)
    ours, reference = load_tokenizer(hub), AutoTokenizer.from_pretrained(saved)
    assert len(ours) == len(reference) and ours.all_special_ids == reference.all_special_ids
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("arch,name", FAMILIES, ids=[f"{a}-{n}" for a, n in FAMILIES])
def test_incremental_text_is_transformers_decode(arch, name, text_model, make_llm):
    llm = make_llm(text_model(arch, name), num_kv_blocks=300)
    tok = llm.get_tokenizer()
    vocab = len(tok)
    # Generated ids biased towards multi-byte pieces, spaces and specials: the detokenizer's hard cases.
    pieces = [i for i, t in enumerate(tok.convert_ids_to_tokens(list(range(vocab))))
              if t and (any(ord(c) > 127 and c != "\u2581" for c in t) or t.startswith("\u2581"))][:40]
    pieces += list(tok.all_special_ids)
    bias = {i: 8.0 for i in pieces if i < llm.engine.input_processor.vocab_size}
    outs = llm.generate(TEXTS, [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True,
                                               logit_bias=bias) for s in range(len(TEXTS))], use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert out.outputs[0].text == tok.decode(ids, skip_special_tokens=True)


def test_language_codes_resolve_to_transformers_tokens(text_model):
    """Every language of the table a model has resolves, from its ISO code, to the token transformers uses
    for it (mBART-50's lang_code_to_id, M2M100's get_lang_id, NLLB's code tokens)."""
    config = {"mbart": "mbart", "m2m100": "m2m_100"}
    checked = 0
    for arch, name in (("mbart", "small"), ("m2m100", "small"), ("m2m100", "nllb")):
        tok = AutoTokenizer.from_pretrained(text_model(arch, name))
        convention = translation_convention(type("C", (), {"model_type": config[arch]})(), tok)
        for lang in LANGUAGES:
            if name == "nllb":
                expected = lang.nllb if tok.convert_tokens_to_ids(lang.nllb) != tok.unk_token_id else None
            elif arch == "m2m100":
                expected = next((c for c in (lang.iso1, lang.iso3) if c in tok.lang_code_to_id), None)
            else:
                expected = next((c for c in tok.lang_code_to_id if c.split("_")[0] == lang.iso1), None)
            if expected is None:
                with pytest.raises(ValueError, match="is not a language this"):
                    convention.code(lang.iso3, "target_language")
                continue
            for code in (lang.iso1 or lang.iso3, lang.iso3, lang.name):
                assert convention.code(code, "target_language") == expected, (arch, code)
            token = f"__{expected}__" if arch == "m2m100" and name != "nllb" else expected
            assert convention.token_id(expected) == tok.convert_tokens_to_ids(token)
            checked += 1
    assert checked > 120  # mBART-50's 52 codes, most of M2M100's 100, NLLB's in the table


@pytest.mark.parametrize("arch,name,remove,message", [
    ("marian", "small", "target.spm", "a Marian SentencePiece tokenizer also needs target.spm"),
    ("marian", "small", "vocab.json", "also needs vocab.json"),
    ("m2m100", "small", "vocab.json", "mBART / NLLB / M2M100 SentencePiece tokenizer also needs vocab.json"),
    ("t5", "small", "spiece.model", "no tokenizer files"),
])
def test_a_missing_tokenizer_file_is_named(arch, name, remove, message, text_model, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(text_model(arch, name, hub_layout=True), folder)
    (folder / remove).unlink()
    with pytest.raises(ValueError, match=message):
        load_tokenizer(folder)


def test_sentencepiece_layouts_name_the_missing_packages(text_model, monkeypatch):
    monkeypatch.setattr(tokenizer_files, "_has_module", lambda name: name != "sentencepiece")
    with pytest.raises(ValueError, match=r"spiece.model: reading a SentencePiece tokenizer needs the sentencepiece"):
        load_tokenizer(text_model("t5", hub_layout=True))
