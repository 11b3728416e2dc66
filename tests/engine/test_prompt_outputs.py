"""What a prefill reports besides its samples: vLLM's prompt_logprobs, and cross-attention
probabilities of chosen heads (Whisper's alignment heads), each against HF's forward."""

from pathlib import Path

import pytest
import torch
from transformers import BartForConditionalGeneration, WhisperForConditionalGeneration

from encdec_engine import SamplingParams
from encdec_engine.inputs.audio import load_audio
from encdec_engine.inputs.features import log_mel_spectrogram
from encdec_engine.checkpoints.ct2.importer import default_model_path

AUDIO = Path(__file__).resolve().parents[2] / "prompts" / "audio"


def hf_decoder_logprobs(model, decoder_ids: list[int], **encoder) -> torch.Tensor:
    with torch.no_grad():
        out = model(**encoder, decoder_input_ids=torch.tensor([decoder_ids]), output_attentions=True)
    return out.logits[0].float().log_softmax(-1), out


def test_prompt_logprobs_match_hf_also_over_a_cached_prefix(bart_path, make_llm):
    llm = make_llm(bart_path)  # prefix caching on: the second run must still compute every position
    tok = llm.get_tokenizer()
    encoder_ids = tok("The rain in Spain stays mainly in the plain.")["input_ids"]
    decoder_ids = [2, 0] + tok("A short summary of the weather in Spain today", add_special_tokens=False)["input_ids"]
    prompt = {"encoder_prompt": {"prompt_token_ids": encoder_ids}, "decoder_prompt": {"prompt_token_ids": decoder_ids}}
    ref, _ = hf_decoder_logprobs(BartForConditionalGeneration.from_pretrained(bart_path).eval(), decoder_ids,
                                 input_ids=torch.tensor([encoder_ids]))
    for _ in range(2):
        out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3),
                           use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(decoder_ids) and out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            token = decoder_ids[i + 1]
            assert entry[token] == pytest.approx(float(ref[i, token]), abs=1e-5)
            top = ref[i].topk(3).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= 4
    # The sampled tokens are those of a plain request.
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids and plain.prompt_logprobs is None


@pytest.fixture(scope="module")
def whisper_window():
    features = log_mel_spectrogram([load_audio(AUDIO / "fox.wav")])[0]
    tokens = [50257, 50362, 383, 2068, 7586, 21831, 4391, 625, 262, 16931, 3290, 13, 50256]  # fox.wav, tiny.en
    return features, tokens


def test_cross_attentions_of_alignment_heads_match_hf(whisper_window, make_llm):
    llm = make_llm(default_model_path())
    heads = [tuple(h) for h in llm.engine.generation_config.alignment_heads]
    features, tokens = whisper_window
    prompt = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"input_features": features}},
              "decoder_prompt": {"prompt_token_ids": tokens}}
    hf = WhisperForConditionalGeneration.from_pretrained(default_model_path(), attn_implementation="eager").eval()
    ref_logprobs, ref = hf_decoder_logprobs(hf, tokens, input_features=features[None])
    expected = torch.stack([ref.cross_attentions[layer][0, head] for layer, head in heads])
    encoder_runs = llm.engine.stats["encoder_runs"]
    for _ in range(2):  # the second run reads the cached cross KV (no encoder run)
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, cross_attention_heads=heads),
                           use_tqdm=False)[0]
        assert out.cross_attentions.shape == (len(heads), len(tokens), 1500)
        assert torch.allclose(out.cross_attentions, expected, atol=1e-5)
        got = [out.prompt_logprobs[i + 1][t] for i, t in enumerate(tokens[1:])]
        assert got == pytest.approx([float(ref_logprobs[i, t]) for i, t in enumerate(tokens[1:])], abs=1e-4)
    assert llm.engine.stats["encoder_runs"] - encoder_runs <= 1


@pytest.mark.parametrize("heads, match", [([(4, 0)], "outside the decoder's 4 layers x 6 heads"),
                                          ([(0, 6)], "outside"), ([], "non-empty list"), ([(0,)], "pairs")])
def test_bad_cross_attention_heads_are_refused(heads, match, whisper_window, make_llm):
    llm = make_llm(default_model_path())
    features, tokens = whisper_window
    prompt = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"input_features": features}},
              "decoder_prompt": {"prompt_token_ids": tokens}}
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=1, cross_attention_heads=heads), use_tqdm=False)


def test_a_one_token_prompt_has_prompt_logprobs_none_beside_a_no_speech_probe(whisper_window, make_llm):
    llm = make_llm(default_model_path())
    features, _ = whisper_window
    prompt = {"encoder_prompt": {"prompt": "", "multi_modal_data": {"input_features": features}},
              "decoder_prompt": {"prompt_token_ids": [50257]}}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, allowed_token_ids=range(100), no_speech_token_id=50361)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.prompt_logprobs == [None] and out.outputs[0].token_ids[0] < 100 and out.no_speech_prob > 0
