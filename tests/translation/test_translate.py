"""LLM.translate and summarize on the text family: the languages told each model its family's way (equal
to transformers' tokenizers with src_lang set, and to HF generate with forced_bos_token_id), what comes
back, and the errors for languages a model does not have."""

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from encdec_engine.translation.conventions import translation_convention
from encdec_engine.translation.languages import find_language

TEXTS = ["The rain in spain falls mainly on the plain.", "Größer Café", "A report said the council met."]


def hf_generate(path, encoder_ids: list[int], **kw) -> list[int]:
    model = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([encoder_ids]), **kw)
    return out[0, 1:].tolist()  # after the decoder start token


# (arch, config, source, target, transformers' spelling: (src_lang or text prefix, forced target token))
CASES = [
    ("t5", "small", "en", "de", ("translate English to German: ", None)),
    ("mbart", "small", "en", "German", ("en_XX", "de_DE")),
    ("marian", "multilingual", None, "fr", (">>fr<< ", None)),
    ("m2m100", "small", "de", "fr", ("de", "__fr__")),
    ("m2m100", "nllb", "English", "deu", ("eng_Latn", "deu_Latn")),
]


@pytest.mark.parametrize("arch,name,source,target,hf", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_translate_tells_the_languages_as_transformers_does(arch, name, source, target, hf, text_model, make_llm):
    path = text_model(arch, name)
    llm = make_llm(path, num_kv_blocks=300)
    tok = AutoTokenizer.from_pretrained(path)
    spelling, forced = hf
    if arch in ("t5", "marian"):  # a text prefix
        expected = [tok(spelling + t)["input_ids"] for t in TEXTS]
    else:  # transformers' tokenizer with src_lang set
        tok.src_lang = spelling
        expected = [tok(t)["input_ids"] for t in TEXTS]
    forced_id = None if forced is None else tok.convert_tokens_to_ids(forced)
    out = llm.translate(TEXTS, source_language=source, target_language=target, max_tokens=6)
    request = llm._translator.request(source, target)
    assert [request.encoder_ids(llm.engine.tokenizer, t) for t in TEXTS] == expected
    assert request.forced_bos_token_id == forced_id
    # What comes back: HF generate's tokens with the same settings, decoded without the target code.
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=1)
    if forced_id is not None:
        kw["forced_bos_token_id"] = forced_id
    for text, ids, got in zip(TEXTS, expected, out):
        ref = hf_generate(path, ids, **kw)
        ref = ref[1:] if forced_id is not None else ref
        assert got == tok.decode(ref, skip_special_tokens=True).strip()
        assert isinstance(got, str)


def test_translate_follows_the_checkpoints_generation_config_and_task_params(text_model, make_llm):
    """T5: task_specific_params' prefix and settings for the pair (beam search here), as HF's pipeline."""
    llm = make_llm(text_model("t5"), num_kv_blocks=400)
    config = llm.engine.hf_config
    saved = getattr(config, "task_specific_params", None)
    config.task_specific_params = {"translation_en_to_fr": {"prefix": "to French: ", "num_beams": 3,
                                                            "max_length": 9, "early_stopping": True}}
    llm._translator = None
    try:
        out = llm.translate(TEXTS[:2], target_language="fr")
        request = llm._translator.request(None, "fr")
        request_params = llm._translator.params(request)
    finally:
        config.task_specific_params = saved
        llm._translator = None
    assert request.text_prefix == "to French: "
    assert request_params.num_beams == 3 and request_params.max_tokens == 8
    tok = llm.get_tokenizer()
    path = text_model("t5")
    for text, got in zip(TEXTS[:2], out):
        ref = hf_generate(path, tok("to French: " + text)["input_ids"], num_beams=3, max_length=9,
                          early_stopping=True, do_sample=False)
        assert got == tok.decode(ref, skip_special_tokens=True).strip()


def test_summarize_t5_uses_its_prefix(text_model, make_llm):
    path = text_model("t5")
    llm = make_llm(path, num_kv_blocks=300)
    got = llm.summarize(TEXTS[:2], max_tokens=7)
    tok = llm.get_tokenizer()
    for text, summary in zip(TEXTS[:2], got):
        ref = hf_generate(path, tok("summarize: " + text)["input_ids"], max_new_tokens=7, do_sample=False)
        assert summary == tok.decode(ref, skip_special_tokens=True).strip()


def test_language_codes_and_names_resolve_to_one_language():
    for code in ("de", "deu", "German", "german", "de_DE", "deu_Latn"):
        assert find_language(code).iso1 == "de", code
    assert find_language("zho_Hant").iso1 == "zh" and find_language("klingon") is None


@pytest.mark.parametrize("arch,name,code,message", [
    ("mbart", "small", "tlh", "not a language this mBART-50 model translates"),
    ("m2m100", "nllb", "klingon", "not a language this NLLB model translates"),
    ("marian", "multilingual", "it", "not a language this Marian model translates; it has: de, es, fr"),
    ("marian", "small", "fr", "this Marian model translates en to de only"),
    ("t5", "small", "xx", "not a language code or name this engine knows"),
])
def test_a_language_the_model_lacks_is_refused_by_name(arch, name, code, message, text_model, make_llm):
    llm = make_llm(text_model(arch, name), num_kv_blocks=300)
    with pytest.raises(ValueError, match=message):
        llm.translate(["Hello"], target_language=code)
    known = {"mbart": "de", "m2m100": "de", "marian": "de" if name == "small" else "fr", "t5": "de"}[arch]
    assert len(llm.translate(["Hello"], target_language=known, max_tokens=2)) == 1  # the engine is fine after


def test_models_that_do_not_translate_say_so(bart_path, make_llm):
    llm = make_llm(bart_path, num_kv_blocks=400)
    with pytest.raises(ValueError, match="bart models do not translate"):
        llm.translate(["Hello"], target_language="de")


def test_a_target_language_is_needed(text_model, make_llm):
    with pytest.raises(ValueError, match="needs a target_language"):
        make_llm(text_model("t5"), num_kv_blocks=300).translate(["Hello"])


def test_legacy_nllb_and_mbart25_put_the_source_code_last(text_model):
    """transformers' suffix conventions: NLLB with legacy_behaviour and mBART-25's MBartTokenizer."""
    from transformers import MBartTokenizer, NllbTokenizer

    path = text_model("m2m100", "nllb")
    for tok in (NllbTokenizer.from_pretrained(path, legacy_behaviour=True),):
        config = type("C", (), {"model_type": "m2m_100"})()
        request = translation_convention(config, tok).request("fr", "de")
        tok.src_lang = "fra_Latn"
        assert request.encoder_ids(tok, TEXTS[0]) == tok(TEXTS[0])["input_ids"]
        assert request.encoder_ids(tok, TEXTS[0])[-2:] == [tok.eos_token_id, tok.convert_tokens_to_ids("fra_Latn")]
    mbart = MBartTokenizer.from_pretrained(text_model("mbart"))
    request = translation_convention(type("C", (), {"model_type": "mbart"})(), mbart).request("ro", "de")
    mbart.src_lang = "ro_RO"
    assert request.encoder_ids(mbart, TEXTS[1]) == mbart(TEXTS[1])["input_ids"]
    assert request.forced_bos_token_id == mbart.convert_tokens_to_ids("de_DE")


def test_the_generation_configs_banned_tokens_are_never_generated(text_model, make_llm):
    """Marian's generation configs ban <pad> (bad_words_ids [[pad]]): translate follows, as HF generate does."""
    path = text_model("marian")
    llm = make_llm(path, num_kv_blocks=300)
    gc = llm.engine.generation_config
    saved = gc.bad_words_ids
    tok = llm.get_tokenizer()
    first = [tok(t)["input_ids"] for t in TEXTS]
    model_first = [hf_generate(path, ids, max_new_tokens=1, do_sample=False)[0] for ids in first]
    gc.bad_words_ids = [[tid] for tid in set(model_first)] + [[5, 6]]  # ban what it says first; longer: not mapped
    try:
        params = llm._translator.params(llm._translator.request(None, "de"))
        assert set(params.suppress_tokens) == set(model_first)
        out = llm.translate(TEXTS, target_language="de", max_tokens=5)
        for text, ids in zip(out, first):
            ref = hf_generate(path, ids, max_new_tokens=5, do_sample=False, bad_words_ids=gc.bad_words_ids[:-1])
            assert text == tok.decode(ref, skip_special_tokens=True).strip()
    finally:
        gc.bad_words_ids = saved
