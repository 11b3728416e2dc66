"""`LLM.generate` on Whisper bans the checkpoint's suppress_tokens and begin_suppress_tokens, as HF
`generate` does, unless the request says otherwise (SamplingParams.use_checkpoint_suppress_tokens)."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, make_whisper
from safetensors.torch import load_file, save_file
from transformers import WhisperForConditionalGeneration

from encdec_engine import SamplingParams
from encdec_engine.inputs.audio import load_audio
from encdec_engine.inputs.features import log_mel_spectrogram

SUPPRESSED, BEGIN_SUPPRESSED = 14, 220  # "/" in suppress_tokens, " " in begin_suppress_tokens (tiny.en's)


@pytest.fixture(scope="module")
def rigged(tmp_path_factory):
    """A random-init Whisper whose decoder output is one constant vector b (final norm weight 0), with
    an untied head that scores "/" at 100 and " " at 50: both win unless suppressed."""
    path = make_whisper(tmp_path_factory.mktemp("rigged") / "whisper", "tiny-80", tie_word_embeddings=False)
    weights = load_file(path / "model.safetensors")
    weights["model.decoder.layer_norm.weight"].zero_()
    b = weights["model.decoder.layer_norm.bias"]
    unit = b / b.dot(b)  # unit @ b == 1
    weights["proj_out.weight"][SUPPRESSED] = 100 * unit
    weights["proj_out.weight"][BEGIN_SUPPRESSED] = 50 * unit
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_generate_applies_the_checkpoint_suppression_like_hf(rigged, make_llm):
    llm = make_llm(rigged, num_kv_blocks=200)
    gc = llm.engine.generation_config
    assert SUPPRESSED in gc.suppress_tokens and BEGIN_SUPPRESSED in gc.begin_suppress_tokens
    features = log_mel_spectrogram([load_audio(ROOT / "prompts" / "audio" / "fox.wav")])
    prompt = {"prompt": "", "multi_modal_data": {"input_features": features[0]}}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    hf = WhisperForConditionalGeneration.from_pretrained(rigged).eval()
    with torch.no_grad():
        ref = hf.generate(input_features=features, max_new_tokens=6, return_dict_in_generate=True).sequences[0]
    assert out.prompt_token_ids + out.outputs[0].token_ids == ref.tolist()
    tokens = out.outputs[0].token_ids
    assert SUPPRESSED not in tokens and tokens[0] != BEGIN_SUPPRESSED and tokens[1:] == [BEGIN_SUPPRESSED] * 5

    off = SamplingParams(temperature=0.0, max_tokens=6, use_checkpoint_suppress_tokens=False)
    assert llm.generate(prompt, off, use_tqdm=False)[0].outputs[0].token_ids == [SUPPRESSED] * 6
    # A request's own list replaces the checkpoint's (as a generate() argument replaces HF's config).
    own = SamplingParams(temperature=0.0, max_tokens=3, suppress_tokens=[SUPPRESSED], begin_suppress_tokens=[])
    assert llm.generate(prompt, own, use_tqdm=False)[0].outputs[0].token_ids == [BEGIN_SUPPRESSED] * 3


def test_the_switch_is_validated():
    with pytest.raises(ValueError, match="use_checkpoint_suppress_tokens must be True or False"):
        SamplingParams(use_checkpoint_suppress_tokens="yes")
