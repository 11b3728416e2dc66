"""Greedy and beam parity with Hugging Face `generate`, token for token, on random-init T5 / mT5, mBART-50,
Marian and M2M100 / NLLB checkpoints: mixed batches of every prompt format. The default run takes one
small config per architecture; the other shapes (odd head counts, d_kv other than d_model / heads,
gated and untied T5 heads, other bucket counts and distances, NLLB's tokenizer) are `slow`."""

import pytest
import torch
from helpers import hf_greedy, mixed_prompts
from transformers import AutoModelForSeq2SeqLM

from encdec_engine import SamplingParams

DEFAULT = [("t5", "small"), ("mbart", "small"), ("marian", "small"), ("m2m100", "small")]
SLOW = [("t5", "gated_untied"), ("t5", "mt5"), ("t5", "tied_gated"), ("mbart", "odd_heads"),
        ("marian", "multilingual"), ("m2m100", "nllb")]
CONFIGS = DEFAULT + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW]
MAX_ENCODER_TOKENS = 190  # within every config's positions (mixed_prompts' long documents are cut)


def hf_model(path):
    return AutoModelForSeq2SeqLM.from_pretrained(path).eval()


def hf_beams(model, encoder_ids, decoder_ids, max_new, num_beams, n, eos) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids]),
                             attention_mask=torch.ones(1, len(encoder_ids), dtype=torch.long),
                             max_new_tokens=max_new, num_beams=num_beams, num_return_sequences=n, do_sample=False,
                             forced_eos_token_id=None, forced_bos_token_id=None, min_length=0)
    return [row[: row.index(eos) + 1] if eos in row else row for row in out[:, len(decoder_ids):].tolist()]


@pytest.mark.parametrize("arch,name", CONFIGS)
def test_greedy_mixed_batch_matches_hf(arch, name, text_model, make_llm):
    path = text_model(arch, name)
    llm = make_llm(path, num_kv_blocks=500)
    prompts = mixed_prompts(llm.get_tokenizer(), n=14, seed=len(arch) + len(name))
    max_tokens = [3 + (7 * i) % 29 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, truncate_prompt_tokens=MAX_ENCODER_TOKENS)
              for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    enc_lens = {len(o.encoder_prompt_token_ids) for o in outs}
    assert max(enc_lens) > 5 * min(enc_lens) and max(len(o.prompt_token_ids) for o in outs) >= 10  # really mixed
    model = hf_model(path)
    ref = [hf_greedy(model, o.encoder_prompt_token_ids, o.prompt_token_ids, m) for o, m in zip(outs, max_tokens)]
    mismatches = [i for i, (o, r) in enumerate(zip(outs, ref)) if o.outputs[0].token_ids != r]
    assert not mismatches, f"{len(mismatches)}/{len(outs)} differ from HF: {mismatches}"
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > len(outs) // 2  # the random model is not stuck


@pytest.mark.parametrize("arch,name", CONFIGS)
def test_beam_search_matches_hf(arch, name, text_model, make_llm):
    path = text_model(arch, name)
    llm = make_llm(path, num_kv_blocks=500)
    prompts = mixed_prompts(llm.get_tokenizer(), n=4, seed=40 + len(name))
    params = SamplingParams(num_beams=3, n=2, max_tokens=8, temperature=0.0, truncate_prompt_tokens=MAX_ENCODER_TOKENS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    model = hf_model(path)
    eos = llm.engine.eos_token_ids[0]
    for o in outs:
        ref = hf_beams(model, o.encoder_prompt_token_ids, o.prompt_token_ids, 8, 3, 2, eos)
        assert [c.token_ids for c in o.outputs] == ref


@pytest.mark.parametrize("arch", ["t5", "mbart"])
def test_hub_layout_loads_the_same_model_and_tokens(arch, text_model, make_llm):
    """The hub's SentencePiece-only tokenizer files (spiece.model; sentencepiece.bpe.model)
    give the tokens of the tokenizer.json / save_pretrained layout, and the same outputs."""
    saved, hub = text_model(arch), text_model(arch, hub_layout=True)
    assert not (hub / "tokenizer.json").exists()
    texts = ["The rain in spain falls mainly on the plain.", "Größer Café, déjà vu!"]
    outs = [make_llm(p, num_kv_blocks=200).generate(texts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            for p in (saved, hub)]
    assert [o.encoder_prompt_token_ids for o in outs[0]] == [o.encoder_prompt_token_ids for o in outs[1]]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
