"""/v1/completions with a target_language on a random-init M2M100 (whose language tokens transformers'
tokenizer does not count as special): text and explicit prompts are told the languages as LLM.translate
tells them, whole and streamed, the forced target code left out of the text; refusals are 400s."""

import httpx
import openai
import pytest
from servers import KEY, LiveServer

from encdec_engine.server.app import ServerLimits, build_app
from encdec_engine.translation.tasks import Translator

GREEDY = dict(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def m2m_server(text_model):
    server = LiveServer(build_app(str(text_model("m2m100")), limits=ServerLimits(api_key=KEY), served_model_name="m2m",
                                  num_kv_blocks=256))
    yield server
    server.stop()


def test_completions_translate_text_and_explicit_prompts(m2m_server, text_model, make_llm):
    llm = make_llm(text_model("m2m100"), num_kv_blocks=300)
    texts = ["The rain in spain falls mainly.", "The council met."]
    expected = llm.translate(texts, "en", "fr", max_tokens=6)
    client = m2m_server.client()
    lang = {"target_language": "fr", "source_language": "en"}
    got = client.completions.create(model="m2m", prompt=texts, extra_body=lang, **GREEDY)
    assert [c.text for c in got.choices] == expected
    assert got.usage.prompt_tokens == 2 * 1 + sum(len(llm._translator.request("en", "fr").encoder_ids(
        llm.engine.tokenizer, t)) for t in texts)  # the decoder start token, the encoder ids with their codes
    explicit = client.completions.create(model="m2m", prompt={"encoder_prompt": texts[0], "decoder_prompt": None},
                                         extra_body=lang, **GREEDY)
    assert explicit.choices[0].text == expected[0]
    chunks = list(client.completions.create(model="m2m", prompt=texts[0], stream=True, extra_body=lang, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    m2m_server.assert_clean()


def test_explicit_text_decoder_prompt_is_a_prefix_in_the_target_language(m2m_server, text_model, make_llm):
    """With a target_language, an explicit prompt's text decoder prompt is continued as the translation's
    start: decoder start, the target's code, the prefix's tokens (it was tokenized as a source text, with
    the source code where the target's belongs, and the target language was silently lost)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    path = text_model("m2m100")
    llm = make_llm(path, num_kv_blocks=300)
    tok, request = llm.engine.tokenizer, Translator(llm.engine).request("en", "fr")
    source, prefix = "The rain in spain falls mainly.", "La pluie"
    encoder = request.encoder_ids(tok, source)
    decoder = [llm.engine.input_processor.decoder_start_token_id, request.forced_bos_token_id,
               *tok(prefix, add_special_tokens=False)["input_ids"]]
    got = m2m_server.client().completions.create(
        model="m2m", prompt={"encoder_prompt": {"prompt": source}, "decoder_prompt": prefix},
        extra_body={"target_language": "fr", "source_language": "en"}, **GREEDY)
    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([encoder]), decoder_input_ids=torch.tensor([decoder]), do_sample=False,
                          max_new_tokens=6, min_new_tokens=6, num_beams=1)[0, len(decoder):].tolist()
    assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    m2m_server.assert_clean()


def test_completions_translation_refusals(m2m_server, bart_path):
    client = m2m_server.client()
    with pytest.raises(openai.BadRequestError, match="'tlh' is not a language this M2M100 model translates"):
        client.completions.create(model="m2m", prompt="Hello", extra_body={"target_language": "tlh"}, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="source_language needs target_language"):
        client.completions.create(model="m2m", prompt="Hello", extra_body={"source_language": "en"}, **GREEDY)
    bart = LiveServer(build_app(str(bart_path), limits=ServerLimits(api_key=KEY), num_kv_blocks=64))
    try:
        response = httpx.post(f"{bart.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"prompt": "Hello", "target_language": "de", "max_tokens": 2}, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith("target_language: bart models do not translate")
    finally:
        bart.stop()
    m2m_server.assert_clean()
